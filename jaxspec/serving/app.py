"""The OpenAI-compatible HTTP layer over the engine (FastAPI): routes, streaming, errors.

Every request is validated here (HTTP 400 naming the field, 413 for a body over the size limit, 429 when the
queue is full, 503 while shutting down) before it reaches the engine; tokenization of large prompts runs in a
worker thread so it never stalls the streams the event loop is serving. Each choice of a request becomes one
engine request; the engine thread hands its outputs to the event loop with `call_soon_threadsafe`. A client
that goes away cancels its engine requests, which frees their rows within one chunk.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import SamplingParams
from ..engine import Engine, EngineStopped, InvalidRequest, Output, QueueFull, Request
from .logprobs import Entry, TokenText, chat_logprobs, completion_logprobs
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse, parse_json
from .text import TextStream

DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB: a full 2048-token context is ~10 kB of text
_OFF_LOOP_BYTES = 64 << 10  # parse and tokenize bodies larger than this in a worker thread

# The HTTP field behind each engine `Request` field an InvalidRequest names ("prompt_ids": the request's
# prompt or messages, filled in per endpoint).
_ENGINE_PARAMS = {"max_tokens": "max_tokens", "num_speculative_tokens": "speculative.num_speculative_tokens",
                  "method": "speculative.method", "stop_token_ids": "stop_token_ids"}


class _Choice:
    """One engine request of an HTTP request: its outputs as an async iterator of text pieces."""

    def __init__(self, index: int, tokenizer, stop: list[str]):
        self.index = index
        self.text = TextStream(tokenizer, stop)
        self.logprobs: list[Entry] = []  # one per token of the text, when the request asked for them
        self._logprobs_taken = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.first_token_at: float | None = None
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.handle = None

    def callback(self, out: Output) -> None:  # the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    async def pieces(self) -> AsyncIterator[str]:
        while True:
            out = await self._queue.get()
            if self.first_token_at is None and out.token_ids:
                self.first_token_at = time.perf_counter()
            tokens = out.token_ids
            count_only: list[int] = []
            if out.finish_reason == "stop" and tokens:
                tokens, count_only = tokens[:-1], tokens[-1:]  # the stop token is counted, not shown
            delta = self._add(tokens, count_only, out.logprobs)
            if self.text.stopped and self.finish_reason is None:
                self.finish_reason = "stop"
                if out.finish_reason is None and self.handle is not None:
                    self.handle.cancel()  # a stop string: the row is no longer needed
            if out.finish_reason is not None:
                self.finish_reason = self.finish_reason or {"cancelled": "abort"}.get(out.finish_reason,
                                                                                       out.finish_reason)
                self.error = out.error
                delta += self.text.finish()
                if delta:
                    yield delta
                return
            if delta:
                yield delta

    def _add(self, tokens: list[int], count_only: list[int], logprobs) -> str:
        if logprobs is None:
            return self.text.add(tokens, count_only)
        # One token at a time, to know where each token's text starts and which tokens a stop string cut.
        delta = ""
        for token, logprob in zip(tokens, logprobs):
            if self.text.stopped:
                break
            offset = len(self.text.text)
            delta += self.text.add([token])
            self.logprobs.append(Entry(logprob, offset))
        return delta + self.text.add([], count_only)

    def take_logprobs(self) -> list[Entry]:
        """The entries not taken yet: a streamed chunk carries the tokens consumed since the previous one."""
        new = self.logprobs[self._logprobs_taken:]
        self._logprobs_taken = len(self.logprobs)
        return new


def create_app(engine: Engine, *, served_model_name: str, warmup: bool = True, graceful_timeout_s: float = 30.0,
               on_ready: Callable[[], None] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app; its lifespan starts the engine (compiling every batch size unless `warmup` is False), calls
    `on_ready` once requests can be served, and on shutdown finishes in-flight requests for up to
    `graceful_timeout_s` before failing the rest. A request body over `max_body_bytes` gets HTTP 413."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be an integer >= 1")
    lm = engine.lm
    tokenizer = lm.tokenizer
    metrics = ServerMetrics(engine)
    created = int(time.time())
    token_text = TokenText(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine._thread is None:
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

    app = FastAPI(title="jaxspec", lifespan=lifespan)

    def error_response(err: RequestError) -> JSONResponse:
        metrics.rejected.labels(status=str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestError)
    async def _request_error(request: HTTPRequest, err: RequestError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, err: StarletteHTTPException):
        # Unknown paths (404) and methods (405) answer in the same error format as everything else.
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(f"{request.method} {request.url.path}: {err.detail}",
                                           status=err.status_code, type=kind))

    def too_large(size: str) -> RequestError:
        return RequestError(f"the request body has {size} bytes; this server takes at most {max_body_bytes}",
                            status=413, code="request_too_large")

    async def read_body(request: HTTPRequest) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large(declared)
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: a chunked body declares no length
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large(f"more than {max_body_bytes}")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_request(request: HTTPRequest, model: type) -> Any:
        """The body parsed and validated as `model`; a large one off the event loop."""
        body = await read_body(request)
        if len(body) > _OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse, model, parse_json(body))
        return parse(model, parse_json(body))

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {served_model_name!r}",
                               param="model", code="model_not_found")

    def encode_now(text: str, param: str) -> list[int]:
        try:
            return tokenizer.encode(text)
        except (ValueError, TypeError) as e:  # text the tokenizer cannot take is the client's error
            raise RequestError(f"{param}: {e}", param=param) from None

    async def encode_all(prompts: list, param: str) -> list[list[int]]:
        """Token ids of each prompt (text or ids); much text is encoded in a worker thread."""
        def run() -> list[list[int]]:
            return [encode_now(p, param) if isinstance(p, str) else list(p) for p in prompts]

        chars = sum(len(p) for p in prompts if isinstance(p, str))
        return await asyncio.to_thread(run) if chars > _OFF_LOOP_BYTES // 4 else run()

    async def encode(text: str, param: str) -> list[int]:
        ids = (await encode_all([text], param))[0]
        if not ids:
            raise RequestError(f"{param} is empty: at least one token is needed", param=param)
        return ids

    def engine_requests(body, prompt_ids: list[int], prompt_param: str, default_max: int | None,
                        logprobs_param: str) -> list[Request]:
        spec = body.speculative
        method = "none" if spec == "off" else (spec.method if spec else None)
        k = spec.num_speculative_tokens if spec not in (None, "off") else None
        seed = secrets.randbits(32) if body.seed is None else body.seed % (1 << 32)
        max_tokens = default_max if body.max_tokens is None else body.max_tokens
        if max_tokens is None:  # chat without a limit: up to the end of the context
            max_tokens = max(engine.config.max_context - len(prompt_ids), 1)
        requests = []
        for i in range(body.n):
            sampling = SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                                      min_p=body.min_p, seed=(seed + i) % (1 << 32))
            requests.append(Request(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling,
                                    stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                                    method=method, num_speculative_tokens=k, logprobs=body.top_logprobs_wanted))
        for r in requests[:1]:
            try:
                engine.validate(r)
            except InvalidRequest as e:
                param = {"prompt_ids": prompt_param, "logprobs": logprobs_param}.get(e.field) or \
                    _ENGINE_PARAMS.get(e.field) or e.field.removeprefix("sampling.")
                raise RequestError(str(e), param=param) from None
        return requests

    def submit(requests: list[Request], stop: list[str]) -> list[_Choice]:
        choices = []
        try:
            for i, r in enumerate(requests):
                choice = _Choice(i, tokenizer, stop)
                choice.handle = engine.submit(r, choice.callback)
                choices.append(choice)
        except (QueueFull, EngineStopped, ValueError) as e:
            for c in choices:
                c.handle.cancel()
            if isinstance(e, QueueFull):
                raise RequestError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
            if isinstance(e, EngineStopped):
                raise RequestError(str(e), status=503, type="server_error", code="unavailable") from None
            raise RequestError(str(e)) from None
        return choices

    def usage(prompt_tokens: int, choices: list[_Choice]) -> dict:
        completion = sum(c.text.num_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def record(arrived: float, choices: list[_Choice]) -> None:
        now = time.perf_counter()
        for c in choices:
            metrics.requests.labels(finish_reason=c.finish_reason or "abort").inc()
            if c.first_token_at is not None:
                metrics.ttft.observe(c.first_token_at - arrived)
                if c.text.num_tokens > 1:
                    metrics.tpot.observe((now - c.first_token_at) / (c.text.num_tokens - 1))
            metrics.e2e.observe(now - arrived)

    async def merged(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, str]]:
        """(choice, text piece) from every choice as they come, then a final (choice, "") per choice."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice):
            async for piece in c.pieces():
                await queue.put((c, piece))
            await queue.put((c, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                c, piece = await queue.get()
                if piece is None:
                    remaining -= 1
                    yield c, ""
                else:
                    yield c, piece
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                if c.finish_reason is None:
                    c.handle.cancel()  # the client went away: free the row

    async def collect(request: HTTPRequest, choices: list[_Choice]) -> list[str]:
        texts = ["" for _ in choices]
        gen = merged(choices)
        try:
            while True:
                task = asyncio.ensure_future(gen.__anext__())
                while not task.done():
                    await asyncio.wait([task], timeout=1.0)
                    if not task.done() and await request.is_disconnected():
                        task.cancel()
                        raise asyncio.CancelledError
                try:
                    c, piece = task.result()
                except StopAsyncIteration:
                    break
                texts[c.index] += piece
        finally:
            await gen.aclose()
        return texts

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def engine_error(choices: list[_Choice]) -> RequestError | None:
        """A server error for a request the engine failed (it failed that request alone), else None."""
        failed = [c for c in choices if c.finish_reason == "error"]
        if not failed:
            return None
        return RequestError(f"the engine failed this request: {failed[0].error}", status=500, type="server_error")

    def check_errors(choices: list[_Choice]) -> None:
        err = engine_error(choices)
        if err is not None:
            raise err

    async def respond(request: HTTPRequest, body, choices: list[_Choice], prompt_tokens: int, arrived: float, *,
                      chat: bool):
        """The response in OpenAI's completion or chat format: server-sent chunks when `body.stream`, else one body."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        wants_logprobs = body.top_logprobs_wanted is not None

        def logprobs(entries: list[Entry]) -> dict | None:
            if not wants_logprobs:
                return None
            return chat_logprobs(entries, token_text) if chat else completion_logprobs(entries, token_text)

        def envelope(obj: str, choice_list: list, **extra) -> dict:
            return {"id": rid, "object": obj, "created": int(time.time()), "model": served_model_name,
                    "choices": choice_list, **extra}

        if body.stream:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def piece_choice(c: _Choice, piece: str, finish: str | None) -> dict:
                text = {"delta": {"content": piece} if piece else {}} if chat else {"text": piece}
                return {"index": c.index, **text, "logprobs": logprobs(c.take_logprobs()), "finish_reason": finish}

            async def events():
                try:
                    if chat:  # OpenAI opens each choice with its role
                        for c in choices:
                            yield sse(envelope(obj, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]))
                    async for c, piece in merged(choices):
                        done = piece == "" and c.finish_reason is not None
                        if piece or done:
                            yield sse(envelope(obj, [piece_choice(c, piece, c.finish_reason if done else None)]))
                    err = engine_error(choices)
                    if err is not None:  # as OpenAI streams an error: an event carrying the error body
                        yield sse(err.body())
                    if body.stream_options and body.stream_options.include_usage:
                        yield sse(envelope(obj, [], usage=usage(prompt_tokens, choices)))
                    yield "data: [DONE]\n\n"
                finally:
                    record(arrived, choices)

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            texts = await collect(request, choices)
        finally:
            record(arrived, choices)
        check_errors(choices)

        def final_choice(c: _Choice) -> dict:
            text = {"message": {"role": "assistant", "content": texts[c.index]}} if chat else {"text": texts[c.index]}
            return {"index": c.index, **text, "logprobs": logprobs(c.logprobs), "finish_reason": c.finish_reason}

        return envelope("chat.completion" if chat else "text_completion", [final_choice(c) for c in choices],
                        usage=usage(prompt_tokens, choices))

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        if engine.failed is not None:
            return JSONResponse({"status": "failed", "error": repr(engine.failed)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "jaxspec", "max_model_len": engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        arrived = time.perf_counter()
        body: CompletionRequest = await read_request(request, CompletionRequest)
        check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("prompt is empty: at least one token is needed", param="prompt")
        capacity = engine.config.max_slots + engine.config.max_waiting
        if len(prompts) * body.n > capacity:  # refused before any work: each choice is one engine request
            raise RequestError(f"prompt: {len(prompts)} prompts x n={body.n} make {len(prompts) * body.n} "
                               f"choices; this server takes at most {capacity} at once", param="prompt")
        ids_list = await encode_all(prompts, "prompt")
        requests = []
        for ids in ids_list:
            if not ids:
                raise RequestError("prompt is empty: at least one token is needed", param="prompt")
            requests += engine_requests(body, ids, "prompt", 16, "logprobs")
        choices = submit(requests, body.stop_strings)
        prompt_tokens = sum(len(ids) for ids in ids_list)
        return await respond(request, body, choices, prompt_tokens, arrived, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        arrived = time.perf_counter()
        body: ChatCompletionRequest = await read_request(request, ChatCompletionRequest)
        check_model(body.model)
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        try:
            text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, add_generation_prompt=True)
        except ValueError as e:
            raise RequestError(f"messages: {e}", param="messages") from None
        ids = await encode(text, "messages")
        choices = submit(engine_requests(body, ids, "messages", None, "top_logprobs"), body.stop_strings)
        return await respond(request, body, choices, len(ids), arrived, chat=True)

    return app
