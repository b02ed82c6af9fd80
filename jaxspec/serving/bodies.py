"""Request bodies off the wire: a size limit counted as bytes arrive, then JSON decoded and validated.

A body over the limit is refused (HTTP 413) as soon as its declared length or its bytes so far pass it, with or
without a Content-Length (a chunked body declares none). A large body is validated in a worker thread, so one
client's megabyte of JSON does not stall the streams the event loop is serving for long.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request as HTTPRequest

from .protocol import RequestError, parse, parse_json

DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB: a full 2048-token context is ~10 kB of text
OFF_LOOP_BYTES = 64 << 10  # validate bodies larger than this (and tokenize as much text) in a worker thread


def _too_large(size: str, max_bytes: int) -> RequestError:
    return RequestError(f"the request body has {size} bytes; this server takes at most {max_bytes}",
                        status=413, code="request_too_large")


async def read_body(request: HTTPRequest, max_bytes: int) -> bytes:
    """The raw body, or a RequestError (413) once it passes `max_bytes`."""
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


async def read_request(request: HTTPRequest, model: type, max_bytes: int) -> Any:
    """The body decoded and validated as `model` (a pydantic model of `jaxspec.serving.protocol`), a large one
    validated off the event loop; RequestError (400 naming the field, or 413) otherwise."""
    body = await read_body(request, max_bytes)
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse, model, parse_json(body))
    return parse(model, parse_json(body))
