"""Every failure as OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, with its status.

The engine's refusals map to HTTP statuses here: an `InvalidRequest` is a 400 naming the request's field (the
engine names its own `Request` field, translated to the HTTP body's), a full queue a 429, a stopping engine a
503, and a request the engine failed while running it a 500. Unknown paths and methods answer in the same format,
and so does any other exception a route raises (a 500 whose message names no detail; the log has the trace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineStopped, InvalidRequest, QueueFull
from .metrics import ServerMetrics
from .protocol import RequestError

if TYPE_CHECKING:
    from .choices import Choice

# The HTTP field behind each engine `Request` field an InvalidRequest names ("prompt_ids" and "logprobs" differ by
# endpoint; "sampling.<name>" is the body's <name>).
ENGINE_PARAMS = {"max_tokens": "max_tokens", "num_speculative_tokens": "speculative.num_speculative_tokens",
                 "method": "speculative.method", "stop_token_ids": "stop_token_ids", "prediction_ids": "prediction",
                 "constraint": "response_format"}


def invalid_request(error: InvalidRequest, *, prompt_param: str, logprobs_param: str) -> RequestError:
    """A 400 naming the body field behind the engine field `error.field`; the prompt and logprobs fields are
    named by the endpoint (`prompt` or `messages`, `logprobs` or `top_logprobs`)."""
    param = ({"prompt_ids": prompt_param, "logprobs": logprobs_param}.get(error.field)
             or ENGINE_PARAMS.get(error.field) or error.field.removeprefix("sampling."))
    return RequestError(str(error), param=param)


def refused(error: Exception) -> RequestError:
    """The answer to a submission the engine refused: 429 for a full queue, 503 while it stops, else 400."""
    if isinstance(error, QueueFull):
        return RequestError(str(error), status=429, type="rate_limit_error", code="queue_full")
    if isinstance(error, EngineStopped):
        return RequestError(str(error), status=503, type="server_error", code="unavailable")
    return RequestError(str(error))


def engine_failure(choices: Sequence["Choice"]) -> RequestError | None:
    """A 500 for a request the engine failed (it failed that request alone), else None."""
    failed = [c for c in choices if c.finish_reason == "error"]
    if not failed:
        return None
    return RequestError(f"the engine failed this request: {failed[0].error}", status=500, type="server_error")


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer every `RequestError`, and Starlette's own 404 and 405, with OpenAI's error body, counting each in
    `metrics.rejected` by status."""
    def response(err: RequestError) -> JSONResponse:
        metrics.rejected.labels(status=str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestError)
    async def _request_error(request: HTTPRequest, err: RequestError):
        return response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: HTTPRequest, err: Exception):  # a bug: the client still gets the error object
        return response(RequestError("the server failed while handling this request", status=500,
                                     type="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return response(RequestError(f"{request.method} {request.url.path}: {err.detail}", status=err.status_code,
                                     type=kind))
