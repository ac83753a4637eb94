"""What the serve tests share: an app served by uvicorn in a thread on 127.0.0.1 (a free port),
and plain HTTP requests to it (http.client: the raw bytes, also bodies no client would send)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any


class Server:
    """`app` on 127.0.0.1 until `close()`; `url` is its address."""

    def __init__(self, app: Any):
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server started"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        # Every test's requests have ended by now, so uvicorn stops at once; where one has not
        # (a test failing), waiting longer would not end it.
        self.thread.join(timeout=10)

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """(status, the JSON body, or the text where it is not JSON)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = dict(headers or {})
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode("utf-8", errors="replace")


def metric(text: str, name: str) -> float:
    """The value of the line `name value` of a Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in the metrics")


def multipart(fields: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body and its header; a bytes value is a file part."""
    boundary = "serve-test-boundary"
    parts = []
    for name, value in fields.items():
        if isinstance(value, bytes):
            head = f'Content-Disposition: form-data; name="{name}"; filename="{name}.bin"\r\n'
            head += "Content-Type: application/octet-stream\r\n\r\n"
            parts.append(f"--{boundary}\r\n{head}".encode() + value + b"\r\n")
        else:
            head = f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
            parts.append(f"--{boundary}\r\n{head}".encode())
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


TRAVERSALS = [
    "/../config.py",
    "/%2e%2e/config.py",
    "/static/../config.py",
    "/page.html",
    "/serving/page.html",
    "/..%2fconfig.py",
    "//etc/passwd",
    "/static/..%2f..%2fa",
]
DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def no_file_read(server: Server, monkeypatch: Any, task_routes: set[str]) -> None:
    """Requests for files (path traversals among them) are 404 and open no file, the page is
    served from memory, and the routes are the page, the API and FastAPI's docs only."""
    import builtins
    import io
    import os
    from pathlib import Path

    opened = []

    def recording(real: Any) -> Any:
        def opener(*args: Any, **kwargs: Any) -> Any:
            opened.append(args[0] if args else kwargs)
            return real(*args, **kwargs)

        return opener

    for owner, name in [
        (builtins, "open"),
        (io, "open"),
        (os, "open"),
        (Path, "open"),
        (Path, "read_text"),
        (Path, "read_bytes"),
    ]:
        monkeypatch.setattr(owner, name, recording(getattr(owner, name)))
    answers = [(path, *server.request("GET", path)) for path in TRAVERSALS]
    status, page = server.request("GET", "/")
    monkeypatch.undo()
    for path, code, answer in answers:
        assert code == 404 and "error" in answer, (path, answer)
    assert status == 200 and "<html" in page.lower()
    assert opened == []
    app: Any = server.server.config.app
    routes = {getattr(route, "path", None) for route in app.routes}
    common = {"/", "/health", "/metrics", "/v1/models", "/v1/models/{model}"}
    assert routes == common | DOCS | task_routes


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_serving(package: str, *flags: str, prelude: str = "") -> tuple[Any, int]:
    """`python -m <package>.serve FLAGS` on a free port, once it accepts connections;
    `prelude` runs first (the tests' registrations: `import conftest; ...`)."""
    import importlib
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    port = free_port()
    source = str(Path(importlib.import_module(package).__file__ or "").resolve().parents[1])
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in [source, tests, os.environ.get("PYTHONPATH")] if p)
    code = f"{prelude}\nimport sys\nfrom {package}.serve import main\nsys.exit(main())"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *flags, "--port", str(port)],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError(process.communicate()[0]) from None
            time.sleep(0.1)


def check_serving_section(section: dict[str, Any], unit: str) -> None:
    """The benchmark's serving section (13) is well formed: a positive server / direct ratio
    that is the median of its per-round ratios, and 1, 4 and 16 clients, each with p50 <= p99
    and a throughput that is its requests over its wall time. Never a speed."""
    assert section["status"] == "measured", section
    assert section["unit"] == unit and section["units_per_request"] >= 1
    ratio = section["ratio"]
    per_round = [
        a / b
        for a, b in zip(section["server"]["rounds_s"], section["direct"]["rounds_s"], strict=True)
    ]
    assert len(per_round) >= 3 and ratio["per_round"] == per_round
    ordered = sorted(per_round)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    assert ratio["ratio"] > 0 and abs(ratio["ratio"] - median) < 1e-9
    low, high = ratio["spread"]
    assert min(per_round) <= low <= ratio["ratio"] <= high <= max(per_round)
    assert abs(section["overhead_percent"] - 100 * (ratio["ratio"] - 1)) < 1e-9
    assert [level["clients"] for level in section["levels"]] == [1, 4, 16]
    for level in section["levels"]:
        latencies = level["latencies_s"]
        assert (
            len(latencies) == level["requests"] == level["clients"] * level["requests_per_client"]
        )
        assert 0 < min(latencies) <= level["p50_s"] <= level["p99_s"] <= max(latencies)
        rate = level["requests"] / level["wall_s"] * section["units_per_request"]
        assert abs(level["units_per_s"] - rate) <= 1e-9 * rate
        assert max(latencies) <= level["wall_s"]
    assert "server / direct" in [row[0] for row in section["table"]["rows"]]
    assert section["others"]["server"]["ratio"] == ratio  # every server, each with its ratio
    for other in section["others"].values():
        assert other["ratio"]["ratio"] > 0 and len(other["ratio"]["per_round"]) == len(per_round)
