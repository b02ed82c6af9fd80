"""The playground: a page at `/` for trying the engine by hand, and the stream that page reads.

The page (static/index.html, app.js and style.css: plain files, no build step, nothing loaded from elsewhere,
so it works offline) sends a prompt, or a chat, to `POST /playground/generate` and renders the output as it
streams, each token marked by who produced it: an accepted draft, or the target model itself. Beside the text
it keeps the acceptance per draft position and the tokens per second, updated with every event.

The stream is NDJSON (`application/x-ndjson`), one object per line:

- for each engine event that committed tokens, `{"ids": [...], "pieces": [...], "draft": [...]}`, one entry per
  token: its id, the text it completes (incremental detokenization: empty while a character still misses
  bytes, and for special tokens such as EOS) and whether it was an accepted draft (true) or the target's own
  token (false; null where the engine did not say);
- last, `{"done": true, "finish_reason", "error", "tail", "prompt_tokens", "stats"}`: `tail` is text held back
  at the end (bytes of an unfinished character), `stats` the request's `jaxspec.engine.RequestStats` (steps,
  drafted, accepted, queued_s, prefill_s).

The body is validated as the OpenAI routes validate theirs (HTTP 400 in OpenAI's error format, naming the
field; 413 for a body over the size limit; 429 when the engine's queue is full; 503 while it shuts down).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from concurrent.futures import Executor
from pathlib import Path
from typing import Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from ..engine import Engine, EngineStopped, InvalidRequest, Output, QueueFull, Request
from ..sampling_params import SamplingParams
from ..text import Detokenizer
from .bodies import read_request
from .errors import invalid_request, refused
from .protocol import ChatMessage, RequestError, SpeculativeOptions
from .translate import Translator

STATIC_DIR = Path(__file__).parent / "static"


class PlaygroundRequest(BaseModel):
    """The body of `POST /playground/generate`: `prompt` or `messages`, the method, the sampling settings.

    Ranges are those of the OpenAI routes (`jaxspec.serving.protocol`). Unknown fields are refused: the page is
    the only client, and a misspelt field is a bug to hear about."""

    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: str | None = None  # prompt mode: the text to continue
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # chat mode: rendered with the chat template
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # below 1e-5 greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1 disables
    seed: int | None = None  # None: a random seed
    speculative: SpeculativeOptions | Literal["off"] | None = None  # None: the server's default method and K


def mount_playground(app: FastAPI, engine: Engine, *, served_model_name: str, max_body_bytes: int,
                     executor: Executor | None = None) -> None:
    """Serve the playground page at `/`, its files under `/playground/static/`, the page's settings at
    `GET /playground/config` and the generation stream at `POST /playground/generate`; text is tokenized in
    `executor` (None: asyncio's default pool)."""
    translator = Translator(engine, served_model_name, executor)  # tokenizes as the OpenAI routes do

    app.mount("/playground/static", StaticFiles(directory=STATIC_DIR), name="playground-static")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/playground/config")
    async def config():
        return {"model": served_model_name, "methods": list(engine.config.methods),
                "default_method": engine.config.spec.method,
                "num_speculative_tokens": engine.config.num_speculative_tokens, "max_context": engine.max_context}

    def engine_request(body: PlaygroundRequest, ids: list[int]) -> Request:
        spec = body.speculative
        seed = secrets.randbits(32) if body.seed is None else body.seed % (1 << 32)
        return Request(prompt_ids=ids, max_tokens=body.max_tokens,
                       sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p,
                                               top_k=max(body.top_k, 0), seed=seed),
                       method="none" if spec == "off" else (spec.method if spec else None),
                       num_speculative_tokens=spec.num_speculative_tokens if isinstance(spec, SpeculativeOptions)
                       else None)

    def line(obj: dict) -> str:
        return json.dumps(obj, ensure_ascii=False) + "\n"

    @app.post("/playground/generate")
    async def generate(request: HTTPRequest):
        body: PlaygroundRequest = await read_request(request, PlaygroundRequest, max_body_bytes, executor)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send either prompt (prompt mode) or messages (chat mode)", param="prompt")
        if body.messages is None:
            ids, prompt_param = await translator.encode(body.prompt, "prompt"), "prompt"
        else:
            ids, prompt_param = await translator.chat_prompt(body.messages), "messages"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Output] = asyncio.Queue()
        try:
            handle = engine.submit(engine_request(body, ids),
                                   lambda out: loop.call_soon_threadsafe(events.put_nowait, out))
        except InvalidRequest as e:
            raise invalid_request(e, prompt_param=prompt_param, logprobs_param="logprobs") from None
        except (QueueFull, EngineStopped) as e:
            raise refused(e) from None

        async def stream():
            detok = Detokenizer(translator.tokenizer)
            finished = False
            try:
                while not finished:
                    out = await events.get()
                    if out.token_ids:
                        draft = None if out.from_draft is None else [bool(f) for f in out.from_draft]
                        yield line({"ids": out.token_ids, "pieces": [detok.add(t) for t in out.token_ids],
                                    "draft": draft})
                    finished = out.finish_reason is not None
                stats = None if out.stats is None else dataclasses.asdict(out.stats)
                yield line({"done": True, "finish_reason": out.finish_reason, "error": out.error,
                            "tail": detok.finish(), "prompt_tokens": len(ids), "stats": stats})
            finally:
                if not finished:
                    handle.cancel()  # the page went away or stopped: free the row

        return StreamingResponse(stream(), media_type="application/x-ndjson")
