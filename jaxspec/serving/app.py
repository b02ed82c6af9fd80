"""The OpenAI-compatible HTTP app over the engine (FastAPI), put together from one module per job.

Every request is validated before it reaches the engine (HTTP 400 naming the field, 413 for a body over the
size limit, 429 when the queue is full, 503 while shutting down); each choice of a request becomes one engine
request, and a client that goes away cancels its engine requests, which frees their rows within one chunk.

- `jaxspec.serving.bodies`: reading a body under the size limit, parsing and validating it;
- `jaxspec.serving.protocol`: the request bodies (pydantic) and OpenAI's error body;
- `jaxspec.serving.translate`: a body into token ids and engine `Request`s;
- `jaxspec.serving.choices`: each engine request's outputs as text, merged or collected;
- `jaxspec.serving.responses`: OpenAI's completion and chat formats, one body or server-sent chunks;
- `jaxspec.serving.errors`: failures as HTTP statuses and OpenAI's error body;
- `jaxspec.serving.routes`: the routes; `jaxspec.serving.metrics`: Prometheus metrics;
- `jaxspec.serving.playground`: a page at `/` for trying the engine by hand.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI

from ..engine import Engine
from .bodies import DEFAULT_MAX_BODY_BYTES
from .errors import add_error_handlers
from .metrics import ServerMetrics
from .playground import mount_playground
from .routes import api_router


def _lifespan(engine: Engine, warmup: bool, graceful_timeout_s: float, on_ready: Callable[[], None] | None):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.started:
            engine.start(warmup=warmup)
        await asyncio.to_thread(engine.ready.wait)
        if engine.failed is not None:
            raise RuntimeError(f"the engine failed to start: {engine.failed!r}")
        if on_ready is not None:
            on_ready()
        yield
        # uvicorn has stopped accepting connections and waited for open ones; fail whatever is left.
        await asyncio.to_thread(engine.shutdown, True, graceful_timeout_s)
        await asyncio.to_thread(engine.shutdown, False, 10.0)

    return lifespan


def create_app(engine: Engine, *, served_model_name: str, warmup: bool = True, graceful_timeout_s: float = 30.0,
               on_ready: Callable[[], None] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app; its lifespan starts the engine (compiling every batch size unless `warmup` is False), calls
    `on_ready` once requests can be served, and on shutdown finishes in-flight requests for up to
    `graceful_timeout_s` before failing the rest. A request body over `max_body_bytes` gets HTTP 413."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be an integer >= 1")
    metrics = ServerMetrics(engine)
    app = FastAPI(title="jaxspec", lifespan=_lifespan(engine, warmup, graceful_timeout_s, on_ready))
    add_error_handlers(app, metrics)
    app.include_router(api_router(engine, served_model_name=served_model_name, metrics=metrics,
                                  max_body_bytes=max_body_bytes))
    mount_playground(app, engine, served_model_name=served_model_name, max_body_bytes=max_body_bytes)
    return app
