"""The OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`.

A generation route reads and validates the body, translates it into engine requests (one per choice and
prompt), submits them all or none, and responds in OpenAI's format (`jaxspec.serving.responses`). A request with
more choices than the engine's slots and queue hold together can never be served, so it is a 400 (not the
retryable 429 of a queue that is full now), the same on both endpoints. A completion that echoes its prompt or
asks for `prompt_logprobs` has its prompts scored first (`jaxspec.serving.echo`); with `max_tokens` 0 (echo
only) its requests are checked as one token's and nothing is submitted.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine import Engine
from .bodies import read_request
from .choices import generating_nothing, submit
from .echo import PromptScorer
from .logprob_formats import TokenText
from .metrics import ServerMetrics
from .protocol import MAX_MESSAGE_CHARS, ChatCompletionRequest, CompletionRequest, RequestError, clipped
from .responses import respond
from .translate import Translator


def check_choices(engine: Engine, num_prompts: int, n: int, param: str) -> None:
    """RequestError (400 naming `param`) when `num_prompts` x `n` choices, each one engine request, exceed what the
    engine's slots and queue can ever hold at once."""
    capacity = engine.config.max_slots + engine.config.max_waiting
    if num_prompts * n > capacity:
        raise RequestError(f"{param}: {num_prompts} prompt{'s' if num_prompts != 1 else ''} x n={n} make "
                           f"{num_prompts * n} choices; this server takes at most {capacity} at once", param=param)


def api_router(engine: Engine, *, served_model_name: str, metrics: ServerMetrics, max_body_bytes: int,
               executor: Executor | None = None, score_executor: Executor | None = None) -> APIRouter:
    """The routes over `engine`, serving its model as `served_model_name`; bodies over `max_body_bytes` get 413.
    Large bodies are parsed, and text tokenized, in `executor`, and prompts scored (echo, prompt_logprobs) in
    `score_executor` (None: asyncio's default pool)."""
    router = APIRouter()
    translator = Translator(engine, served_model_name, executor)
    tokenizer = engine.lm.tokenizer
    token_text = TokenText(tokenizer)
    scorer = PromptScorer(engine, token_text, score_executor)
    created = int(time.time())

    @router.get("/health")
    async def health():
        if engine.failed is not None:
            return JSONResponse({"status": "failed", "error": clipped(repr(engine.failed), MAX_MESSAGE_CHARS)},
                                status_code=503)
        return {"status": "ok"}

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "jaxspec", "max_model_len": engine.max_context}]}

    @router.post("/v1/completions")
    async def completions(request: HTTPRequest):
        arrived = time.perf_counter()
        body: CompletionRequest = await read_request(request, CompletionRequest, max_body_bytes, executor)
        translator.check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("prompt is empty: at least one token is needed", param="prompt")
        check_choices(engine, len(prompts), body.n, "prompt")  # refused before any work
        ids_list = await translator.encode_all(prompts, "prompt")
        await translator.compile_response_format(body, request)
        nothing = body.max_tokens == 0  # echo alone: checked as one token's requests, never submitted
        checked = body.model_copy(update={"max_tokens": 1}) if nothing else body
        requests = []
        for ids in ids_list:
            if not ids:
                raise RequestError("prompt is empty: at least one token is needed", param="prompt")
            requests += await translator.engine_requests(checked, ids, prompt_param="prompt", default_max=16,
                                                         logprobs_param="logprobs")
        parts = await scorer.parts(body, prompts, ids_list)  # None without echo or prompt_logprobs
        choices = (generating_nothing(len(requests), tokenizer) if nothing
                   else submit(engine, requests, tokenizer, body.stop_strings))
        return await respond(request, body, choices, sum(len(ids) for ids in ids_list), arrived, chat=False,
                             model=served_model_name, token_text=token_text, metrics=metrics,
                             prompts=None if parts is None else [parts[c.index // body.n] for c in choices])

    @router.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        arrived = time.perf_counter()
        body: ChatCompletionRequest = await read_request(request, ChatCompletionRequest, max_body_bytes, executor)
        translator.check_model(body.model)
        check_choices(engine, 1, body.n, "n")  # refused before any work
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        ids = await translator.chat_prompt(body.messages)
        await translator.compile_response_format(body, request)
        requests = await translator.engine_requests(body, ids, prompt_param="messages", default_max=None,
                                                    logprobs_param="top_logprobs")
        choices = submit(engine, requests, tokenizer, body.stop_strings)
        return await respond(request, body, choices, len(ids), arrived, chat=True, model=served_model_name,
                             token_text=token_text, metrics=metrics)

    return router
