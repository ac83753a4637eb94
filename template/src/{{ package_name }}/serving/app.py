"""The FastAPI app of `serve`: `create_app(served, ...)`.

Routes: GET `/` (page.html, read from the package once, when the app is made: no request
reads a file), GET `/health`, GET `/metrics` (Prometheus text), GET `/v1/models` (OpenAI's list
format) and the task's own endpoints (serving/language.py or serving/vision.py). Every
refusal is a 4xx JSON body in OpenAI's error shape (guard.ApiError); the model runs on one
worker thread (engine.Worker), never on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from .engine import Worker
from .guard import ApiError, Guard, Metrics

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass
class Served:
    """What one server serves: the task ("lm" or "image"), the model's name (its id in
    /v1/models), the worker running it, the task's endpoints and what /health adds."""

    task: str
    name: str
    worker: Worker
    routes: Callable[[FastAPI, Metrics], None]  # adds the task's endpoints to the app
    health: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(
    served: Served,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app; closing it (its lifespan's end) stops the worker after its work."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        served.worker.stop()

    app = FastAPI(title=f"{served.name} ({served.task})", lifespan=lifespan)
    metrics = Metrics()
    metrics.gauges["streams_in_progress"] = served.worker.busy
    metrics.gauges["streams_cancelled_total"] = lambda: served.worker.cancelled
    metrics.gauges["batches_total"] = lambda: served.worker.batches
    metrics.busy = lambda: served.worker.seconds
    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "task": served.task, "model": served.name, **served.health}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        check_model(model, served.name)
        return model_card(served)

    served.routes(app, metrics)
    add_error_handlers(app)
    paths = {getattr(route, "path", "") for route in app.routes}
    app.add_middleware(
        Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, paths=paths
    )
    return app


def model_card(served: Served) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "local"}


def check_model(requested: str | None, name: str) -> None:
    """A request naming another model than the one served is 404 (none named: this one)."""
    if requested is not None and requested != name:
        raise ApiError(
            404,
            f"the model {requested!r} is not served here; this serves {name!r}",
            "model_not_found",
        )


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape, never FastAPI's `{"detail": ...}`."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return await api_error(_, ApiError(400, validation_message(error), "invalid_request"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = (
            f"no such endpoint: {request.method} {request.url.path}"
            if error.status_code in (404, 405)
            else str(error.detail)
        )
        return await api_error(request, ApiError(error.status_code, message, None))


def validation_message(error: RequestValidationError) -> str:
    """One line for a body FastAPI refused: malformed JSON, or the first field that is wrong."""
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'malformed')})"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where or 'body'}: {first.get('msg', 'invalid')}"
