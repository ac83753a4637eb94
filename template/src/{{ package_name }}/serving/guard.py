"""What every request passes through before the endpoints (one ASGI middleware, `Guard`):
the API key, the body size limit and the metrics; and the OpenAI error shape every refusal
takes: `{"error": {"message", "type", "code"}}` with a 4xx status."""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class ApiError(Exception):
    """A refused request: `status`, one line `message`, and OpenAI's `code`."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "")
        kind = kind or "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code}}


class Metrics:
    """Counters for GET /metrics, in Prometheus' text format (version 0.0.4)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.latency: dict[str, list[float]] = {}  # path -> [seconds, count]
        self.work: dict[str, int] = {}  # "tokens" | "images" -> how many the model produced
        self.busy: Callable[[], float] = lambda: 0.0  # seconds the model's thread worked
        self.gauges: dict[str, Callable[[], float]] = {}

    def request(self, path: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[path, status] = self.requests.get((path, status), 0) + 1
            total = self.latency.setdefault(path, [0.0, 0])
            total[0] += seconds
            total[1] += 1

    def produced(self, what: str, count: int) -> None:
        with self.lock:
            self.work[what] = self.work.get(what, 0) + count

    def text(self) -> str:
        with self.lock:
            lines = ["# TYPE serve_requests_total counter"]
            lines += [
                f'serve_requests_total{{path="{path}",status="{status}"}} {count}'
                for (path, status), count in sorted(self.requests.items())
            ]
            errors = sum(n for (_, status), n in self.requests.items() if status >= 400)
            lines += ["# TYPE serve_errors_total counter", f"serve_errors_total {errors}"]
            lines.append("# TYPE serve_request_seconds summary")
            for path, (seconds, count) in sorted(self.latency.items()):
                lines.append(f'serve_request_seconds_sum{{path="{path}"}} {seconds:.6f}')
                lines.append(f'serve_request_seconds_count{{path="{path}"}} {int(count)}')
            busy = self.busy()
            lines.append("# TYPE serve_busy_seconds_total counter")
            lines.append(f"serve_busy_seconds_total {busy:.6f}")
            for what, count in sorted(self.work.items()):
                rate = count / busy if busy > 0 else 0.0
                lines.append(f"# TYPE serve_{what}_total counter")
                lines.append(f"serve_{what}_total {int(count)}")
                lines.append(f"# TYPE serve_{what}_per_second gauge")
                lines.append(f"serve_{what}_per_second {rate:.3f}")
            for name, value in sorted(self.gauges.items()):
                lines += [f"# TYPE serve_{name} gauge", f"serve_{name} {value()}"]
        return "\n".join(lines) + "\n"


class Guard:
    """ASGI middleware: a request to /v1/... without `Authorization: Bearer <api_key>` is 401
    (when a key is set); a body over `max_body_bytes` is 413, by its Content-Length or by the
    bytes that arrive; every request is counted in `metrics` under its route's path."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        paths: set[str],
    ):
        self.app, self.api_key, self.limit = app, api_key, max_body_bytes
        self.metrics, self.paths = metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        path = scope["path"] if scope["path"] in self.paths else "other"
        try:
            await self._guarded(scope, receive, counted)
        finally:
            self.metrics.request(path, status[0], time.perf_counter() - started)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8")):
                await respond(
                    send,
                    ApiError(
                        401,
                        "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "invalid_api_key",
                    ),
                )
                return
        too_big = ApiError(413, f"the request body is over {self.limit:,} bytes", "body_too_large")
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await respond(send, too_big)
            return
        chunks, size = [], 0
        while True:  # read the body here, counting it: a stream may lie about its length
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending it all
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await respond(send, too_big)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def respond(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
