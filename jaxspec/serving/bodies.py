"""Request bodies off the wire: a size limit counted as bytes arrive, then JSON decoded and validated.

A body must be declared JSON (`Content-Type: application/json`, any parameters; HTTP 415 otherwise): a web page
can send a form or text/plain to another site without the browser asking that site first (a "simple" CORS
request), but not JSON. A body over the limit is refused (HTTP 413) as soon as its declared length or its bytes
so far pass it, with or without a Content-Length (a chunked body declares none). A large body is validated in
the app's thread pool for text work, so one client's megabyte of JSON does not stall the streams the event loop
is serving for long.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Any

from fastapi import Request as HTTPRequest

from .protocol import RequestError, parse, parse_json

DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB: a full 2048-token context is ~10 kB of text
OFF_LOOP_BYTES = 64 << 10  # validate bodies larger than this (and tokenize as much text) in a worker thread


def _too_large(size: str, max_bytes: int) -> RequestError:
    return RequestError(f"the request body has {size} bytes; this server takes at most {max_bytes}",
                        status=413, code="request_too_large")


async def read_body(request: HTTPRequest, max_bytes: int) -> bytes:
    """The raw body, or a RequestError: 415 unless it is declared JSON, 413 once it passes `max_bytes`."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise RequestError(f"the request body must be sent as Content-Type: application/json (got "
                           f"{media or 'none'!r})", status=415, code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(declared, max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():  # counted as it arrives: a chunked body declares no length
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"more than {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _decoded(model: type, body: bytes) -> Any:
    return parse(model, parse_json(body))


async def read_request(request: HTTPRequest, model: type, max_bytes: int, executor: Executor | None = None) -> Any:
    """The body decoded and validated as `model` (a pydantic model of `jaxspec.serving.protocol`), a large one
    decoded and validated in `executor` (None: asyncio's default pool); RequestError (400 naming the field, or
    413) otherwise."""
    body = await read_body(request, max_bytes)
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(_decoded, model, body))
    return _decoded(model, body)
