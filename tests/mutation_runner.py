"""Run a rendered project's tests against many planted bugs, each in a forked child.

    python tests/mutation_runner.py PROJECT JOBS.json RESULTS.json

Most of a small pytest run is importing torch. This process imports torch, pytest and the
generated project's other dependencies once (never the project itself), compiles a copy of
`src/`, freezes what it holds for the garbage collector, then forks one child per mutation:
the child copies the compiled `src/`, plants the bug in its copy, puts that copy first on
`sys.path` and runs `pytest.main` on the chosen tests. Two children run at a time (CI has two
cores). A child runs in its own session, so a hung run is killed with everything it started.

Each job in JOBS.json: {"name", "module", "edits": [[old, new], ...] (none: the unmutated
code), "tests": [paths], "select": str|null, "timeout": seconds, and optionally "markers" (a -m
expression, default "not gpu") and "alone" (true: run with no other child beside it, for a test
that measures speed)}. RESULTS.json maps each name to {"code", "seconds",
"output", "problem"}: the pytest exit code (1 = a test failed, the mutation was caught), or -1
with a "problem" when the bug could not be planted or the run timed out.
"""

from __future__ import annotations

import compileall
import contextlib
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

# Imported before forking: every child starts with them loaded. Importing torch starts no
# threads, so forking afterwards is safe (DataLoader workers do the same).
import numpy  # noqa: F401
import PIL.Image  # noqa: F401
import pytest
import torch  # noqa: F401
import tqdm  # noqa: F401

PARALLEL = 2
# The variables by which pytest knows it runs on CI (_pytest.compat.running_on_ci).
CI_VARIABLES = ("CI", "BUILD_NUMBER")
# Imported before forking too (warm()), because every child imported them again: pytest's
# plugins and the debugger it loads at start, and the generated package's and tests' slowest
# libraries (torch.distributed.checkpoint alone took 2.3 s). Never the package itself: each
# child imports its own, mutated copy. Not pyarrow, pandas or datasets: importing them starts
# a thread, and a forked child has none of its parent's threads (a lock one held stays held).
# Not torch._dynamo: the generated conftest resets it after each test wherever it is imported.
WARM = ["pdb", "tyro", "torch.distributed.checkpoint", "transformers", "tokenizers",
        "safetensors.torch", "optuna", "webdataset"]  # fmt: skip


def plant(source: str, job: dict) -> str:
    """Apply the job's edits in order; each target must occur exactly once."""
    for old, new in job["edits"]:
        count = source.count(old)
        if count != 1:
            what = "not found" if count == 0 else f"found {count} times, not once"
            raise LookupError(f"mutation target {what}: {job['module']}: {old!r}")
        source = source.replace(old, new)
    return source


def compiled_source(project: Path, folder: Path) -> Path:
    """A copy of the project's src/ with its bytecode, which children copy instead: none is
    written where tests run (PYTHONDONTWRITEBYTECODE, as on CI), so each child compiled every
    module of the package it imported (0.2 s each)."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(project / "src", folder)
    compileall.compile_dir(folder, quiet=1)
    return folder


def child(compiled: Path, project: Path, package: str, workdir: Path, job: dict) -> int:
    """In the forked child: plant the bug in a copy of src/ (of `compiled`, with its bytecode)
    and run the tests in-process."""
    os.setsid()
    mutant = workdir / job["name"]
    log = os.open(mutant.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        shutil.copytree(compiled, mutant / "src")  # file times kept: the bytecode stays valid
        target = mutant / "src" / package / job["module"]
        target.write_text(plant(target.read_text(encoding="utf-8"), job), encoding="utf-8")
        # The planted module's bytecode is the unmutated code: never let an import take it.
        Path(importlib.util.cache_from_source(str(target))).unlink(missing_ok=True)
        source = str(mutant / "src")
        sys.path.insert(0, source)
        # Tests that start subprocesses (torchrun) pass on the package's location themselves.
        paths = [source, os.environ.get("PYTHONPATH")]
        os.environ["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # the shared tests/ folder stays clean
        # Where CI is set, pytest explains a failed `==` of two lists by a full, untruncated
        # diff: two lists of 2,800 token ids took 2.5 minutes to diff (and one child 3 min in
        # CI). A mutant's outcome is its exit code; its log keeps the truncated explanation.
        for name in CI_VARIABLES:
            os.environ.pop(name, None)
        os.chdir(project)
        args = ["-x", "-q", "-rs", "-p", "no:cacheprovider", "--basetemp", str(mutant / "tmp")]
        args += ["-m", job.get("markers") or "not gpu", *job["tests"]]
        if job.get("select"):
            args += ["-k", job["select"]]
        return int(pytest.main(args))
    except LookupError as error:
        print(error)
        return 97
    except BaseException:
        traceback.print_exc()
        return 98


def warm() -> None:
    """Import WARM and pytest's plugins, then freeze every object there is: a child's garbage
    collections (pytest runs two as it ends) then skip them. A collection writes to each object
    it visits, so each child copied most of its parent's memory, torch's included, page by
    page, and paid 0.3 s per collection (gc.freeze's documented use: a parent that forks)."""
    plugins = [entry.value for entry in importlib.metadata.entry_points(group="pytest11")]
    for name in [*plugins, *WARM]:
        with contextlib.suppress(ImportError):  # an extra this environment lacks
            importlib.import_module(name.partition(":")[0])
    tasks = Path("/proc/self/task")
    if tasks.is_dir() and len(list(tasks.iterdir())) > 1:
        raise RuntimeError(f"importing {WARM} started a thread: forking would be unsafe")
    gc.collect()
    gc.freeze()


def main() -> int:
    project, jobs_file, results_file = (Path(arg) for arg in sys.argv[1:4])
    warm()
    jobs = json.loads(jobs_file.read_text())
    (package,) = (init.parent.name for init in (project / "src").glob("*/__init__.py"))
    workdir = results_file.parent / "mutants"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    compiled = compiled_source(project, results_file.parent / "compiled-src")
    pending, running, results = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            if pending[0].get("alone") and running:
                break  # it starts when the running children are done
            if any(job.get("alone") for job, _ in running.values()):
                break
            job = pending.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                code = 98
                try:
                    code = child(compiled, project, package, workdir, job)
                finally:
                    sys.stdout.flush()
                    os._exit(code)
            running[pid] = (job, time.monotonic())
        time.sleep(0.05)
        for pid, (job, started) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - started
            if not done and elapsed < job["timeout"]:
                continue
            problem = ""
            if not done:  # a hang: kill the child's whole session
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code, problem = -1, f"timed out after {job['timeout']} s"
            else:
                code = os.waitstatus_to_exitcode(status)
            log = (workdir / job["name"]).with_suffix(".log")
            output = log.read_text(errors="replace") if log.exists() else ""
            if code == 97:
                code, problem = -1, output.strip()
            results[job["name"]] = {
                "code": code,
                "seconds": round(elapsed, 1),
                "output": output[-6000:],
                "problem": problem,
            }
            print(f"{job['name']}: exit {code} in {elapsed:.1f} s", flush=True)
            del running[pid]
    results_file.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
