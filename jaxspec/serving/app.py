"""The OpenAI-compatible HTTP app over the engine (FastAPI), put together from one module per job.

Every request is validated before it reaches the engine (HTTP 400 naming the field, 413 for a body over the
size limit, 429 when the queue is full, 503 while shutting down); each choice of a request becomes one engine
request, and a client that goes away cancels its engine requests, which frees their rows within one chunk.

Access control (`AccessControl`, before any route): with `allowed_hosts`, a request whose Host header names
another host gets 421 (a page on another site that rebinds its DNS name to 127.0.0.1 sends its own name);
with an `api_key`, every route but the playground page and its files, `/health` and `/metrics` needs
`Authorization: Bearer <key>` (401 otherwise). Every request body must come as `Content-Type: application/json`
(415 otherwise, `jaxspec.serving.bodies`), which a web page cannot send to another site without the browser
asking the server first (CORS), and this server answers no such question.

Tokenizing, chat templates and parsing large bodies run in a thread pool the app owns (`TEXT_WORKERS` threads),
so no other work queued in asyncio's default pool delays them. Scoring prompts (completions' `echo` and
`prompt_logprobs`) runs in a second pool of its own (`SCORE_WORKERS` threads): a forward over a prompt, or the
compile of a new width, takes far longer than text work and must not hold the text threads.

- `jaxspec.serving.bodies`: reading a body under the size limit, parsing and validating it;
- `jaxspec.serving.protocol`: the request bodies (pydantic) and OpenAI's error body;
- `jaxspec.serving.translate`: a body into token ids and engine `Request`s;
- `jaxspec.serving.choices`: each engine request's outputs as text, merged or collected;
- `jaxspec.serving.responses`: OpenAI's completion and chat formats, one body or server-sent chunks;
- `jaxspec.serving.echo`: a completion's prompt in its response (`echo`, `prompt_logprobs`);
- `jaxspec.serving.errors`: failures as HTTP statuses and OpenAI's error body;
- `jaxspec.serving.routes`: the routes; `jaxspec.serving.metrics`: Prometheus metrics;
- `jaxspec.serving.playground`: a page at `/` for trying the engine by hand;
- `jaxspec.serving.server`: the command line (`python scripts/serve.py`).
"""

from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Callable, Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from ..engine import Engine
from .bodies import DEFAULT_MAX_BODY_BYTES
from .errors import add_error_handlers
from .metrics import ServerMetrics
from .playground import mount_playground
from .protocol import RequestError
from .routes import api_router

TEXT_WORKERS = 4  # threads for tokenizing and chat templates: short tasks that mostly hold the GIL
SCORE_WORKERS = 1  # threads scoring prompts: one forward at a time beside the engine's, which it competes with
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the names a loopback server is reached by
OPEN_PATHS = ("/", "/health", "/metrics")  # served without the API key (the page holds no data; probes carry no key)
OPEN_PREFIXES = ("/playground/static/",)


def host_name(host: str) -> str | None:
    """The name in a Host header, lower-cased and without its port (`[::1]:8000` -> `[::1]`), or None when the
    header is malformed."""
    host = host.strip().lower()
    name, sep, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
    if not sep:
        name = host
    elif not port.isdigit() or (":" in name and not name.startswith("[")):
        return None
    return name or None


class AccessControl:
    """ASGI middleware in front of every route: the Host check and the API key. A refusal is OpenAI's error body,
    counted in `metrics.rejected` by status. (The JSON content type is checked where a body is read:
    `jaxspec.serving.bodies.read_body`.)"""

    def __init__(self, app, *, metrics: ServerMetrics, api_key: str | None, allowed_hosts: Sequence[str] | None):
        self.app = app
        self.metrics = metrics
        self.api_key = None if api_key is None else api_key.encode("utf-8")
        self.allowed_hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}

    def refusal(self, scope, headers: Headers) -> RequestError | None:
        """Why the request is refused, or None."""
        if self.allowed_hosts is not None and host_name(headers.get("host", "")) not in self.allowed_hosts:
            return RequestError("the Host header names a host this server does not serve (it answers to "
                                f"{', '.join(sorted(self.allowed_hosts))})", status=421, code="host_not_allowed")
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode("utf-8"), self.api_key):
                return RequestError("missing or incorrect API key: send the server's key as Authorization: Bearer "
                                    "<key>", status=401, code="invalid_api_key")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.refusal(scope, Headers(scope=scope))
            if err is not None:
                self.metrics.rejected.labels(status=str(err.status)).inc()
                headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
                await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _lifespan(engine: Engine, warmup: bool, graceful_timeout_s: float, on_ready: Callable[[], None] | None,
              executors: Sequence[ThreadPoolExecutor]):
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
        # A program still compiling is not waited for here: the server's command ends the process without Python's
        # finalisation when one is (`jaxspec.serving.server.main`); elsewhere an exit handler waits for it
        # (`jaxspec.engine.runner`).
        await asyncio.to_thread(engine.shutdown, True, graceful_timeout_s, False)
        await asyncio.to_thread(engine.shutdown, False, 10.0, False)
        for executor in executors:
            executor.shutdown(wait=False, cancel_futures=True)

    return lifespan


def create_app(engine: Engine, *, served_model_name: str, warmup: bool = True, graceful_timeout_s: float = 30.0,
               on_ready: Callable[[], None] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               api_key: str | None = None, allowed_hosts: Sequence[str] | None = None) -> FastAPI:
    """The app; its lifespan starts the engine (compiling every batch size unless `warmup` is False), calls
    `on_ready` once requests can be served, and on shutdown finishes in-flight requests for up to
    `graceful_timeout_s` before failing the rest. A request body over `max_body_bytes` gets HTTP 413.

    `api_key`: when set, every route but `OPEN_PATHS` (and the page's files) needs `Authorization: Bearer
    <api_key>` (401 otherwise). `allowed_hosts`: when set, the names (ports aside) a request's Host header may
    carry (421 otherwise), such as `LOOPBACK_HOSTS` for a server bound to the loopback interface."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be an integer >= 1")
    if api_key is not None and (not isinstance(api_key, str) or not api_key or api_key != api_key.strip()):
        raise ValueError("api_key must be a non-empty string without surrounding whitespace")
    if allowed_hosts is not None and (isinstance(allowed_hosts, str) or not allowed_hosts
                                      or not all(isinstance(h, str) and host_name(h) for h in allowed_hosts)):
        raise ValueError(f"allowed_hosts={allowed_hosts!r} must be a non-empty list of host names (an IPv6 address "
                         "in brackets: [::1])")
    metrics = ServerMetrics(engine)
    executor = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="jaxspec-text")
    score_executor = ThreadPoolExecutor(SCORE_WORKERS, thread_name_prefix="jaxspec-score")
    app = FastAPI(title="jaxspec", lifespan=_lifespan(engine, warmup, graceful_timeout_s, on_ready,
                                                      (executor, score_executor)))
    add_error_handlers(app, metrics)
    app.include_router(api_router(engine, served_model_name=served_model_name, metrics=metrics,
                                  max_body_bytes=max_body_bytes, executor=executor, score_executor=score_executor))
    mount_playground(app, engine, served_model_name=served_model_name, max_body_bytes=max_body_bytes,
                     executor=executor)
    app.add_middleware(AccessControl, metrics=metrics, api_key=api_key, allowed_hosts=allowed_hosts)
    return app
