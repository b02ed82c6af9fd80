"""Responses in OpenAI's completion and chat formats: one JSON body, or server-sent chunks as the text comes.

A stream sends, per choice, chunks of text as they become final and one chunk with its finish reason (chat
opens each choice with its role; a completion that echoes its prompt or asked for `prompt_logprobs` opens with
the prompt's text and log-probabilities, `jaxspec.serving.echo`), then the usage when asked, then
`data: [DONE]`. A request the engine failed
is a 500 with the error body, or, once a stream has started, an event carrying that body. Either way the
request's latencies and finish reasons are recorded when it ends.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Sequence

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from .choices import Choice, collect, merged
from .echo import PromptPart
from .errors import engine_failure
from .logprob_formats import Entry, TokenText, chat_logprobs, completion_logprobs
from .metrics import ServerMetrics


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    """OpenAI's `usage`: prompt tokens, tokens the choices consumed (up to a stop string), their sum."""
    completion = sum(c.text.num_tokens for c in choices)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    predicted = [c.stats for c in choices if c.stats is not None and c.stats.accepted_prediction_tokens is not None]
    if predicted:  # a request with a prediction: OpenAI reports what became of its tokens
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in predicted),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in predicted)}
    return out


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ResponseFormat:
    """The OpenAI shape of one response: its id, object names, the layout of a choice, the logprobs format."""

    def __init__(self, *, chat: bool, model: str, token_text: TokenText, wants_logprobs: bool,
                 prompts: Sequence[PromptPart] | None = None):
        self.chat = chat  # chat completions, else (legacy) completions
        self.model = model  # the served model's name
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # the response's id, on every chunk
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"  # a streamed chunk's `object`
        self.final_object = "chat.completion" if chat else "text_completion"  # the one body's `object`
        self._token_text = token_text
        self._wants_logprobs = wants_logprobs
        self._prompts = prompts  # per choice index, what it carries of its prompt (None: nothing)

    def prompt(self, c: Choice) -> PromptPart | None:
        """What choice `c` carries of its prompt (echoed text, prompt log-probabilities), or None."""
        return None if self._prompts is None else self._prompts[c.index]

    def logprobs(self, entries: list[Entry], prompt: PromptPart | None = None, *, with_prompt: bool = False
                 ) -> dict | None:
        """The `logprobs` of a choice (or of a chunk): None when the request did not ask. After an echoed
        `prompt` the text offsets move by its text's length, and `with_prompt` lists its tokens first."""
        if not self._wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self._token_text)
        return completion_logprobs(entries, self._token_text, offset=len(prompt.text) if prompt else 0,
                                   before=prompt.logprobs if prompt and with_prompt else None)

    def envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        """The response object around `choices`."""
        return {"id": self.id, "object": obj, "created": int(time.time()), "model": self.model, "choices": choices,
                **extra}

    def role_chunk(self, c: Choice) -> dict:
        """A chat stream's first chunk of a choice: its role (OpenAI opens each choice with it)."""
        return self.envelope(self.chunk_object, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}])

    def prompt_chunk(self, c: Choice) -> dict | None:
        """A completion stream's first chunk of a choice: its echoed prompt, with the prompt's logprobs and
        prompt_logprobs when asked; None when the choice carries nothing of its prompt."""
        prompt = self.prompt(c)
        if prompt is None:
            return None
        choice = {"index": c.index, "text": prompt.text, "logprobs": self.logprobs([], prompt, with_prompt=True),
                  "finish_reason": None}
        return self.envelope(self.chunk_object, [_with_prompt_logprobs(choice, prompt)])

    def piece_chunk(self, c: Choice, piece: str, finish: str | None) -> dict:
        """A streamed chunk: a piece of a choice's text (with the logprobs of the tokens taken since the last)."""
        text = {"delta": {"content": piece} if piece else {}} if self.chat else {"text": piece}
        choice = {"index": c.index, **text, "logprobs": self.logprobs(c.take_logprobs(), self.prompt(c)),
                  "finish_reason": finish}
        return self.envelope(self.chunk_object, [choice])

    def final_choice(self, c: Choice, text: str) -> dict:
        """A choice of the one-body response (a completion's text after its echoed prompt)."""
        prompt = self.prompt(c)
        body = {"message": {"role": "assistant", "content": text}} if self.chat else \
            {"text": (prompt.text if prompt else "") + text}
        choice = {"index": c.index, **body, "logprobs": self.logprobs(c.logprobs, prompt, with_prompt=True),
                  "finish_reason": c.finish_reason}
        return _with_prompt_logprobs(choice, prompt)


def _with_prompt_logprobs(choice: dict, prompt: PromptPart | None) -> dict:
    """`choice` with vLLM's `prompt_logprobs` when the request asked for them."""
    if prompt is not None and prompt.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt.prompt_logprobs
    return choice


async def _events(fmt: ResponseFormat, body, choices: list[Choice], prompt_tokens: int, arrived: float,
                  metrics: ServerMetrics) -> AsyncIterator[str]:
    try:
        for c in choices:
            opening = fmt.role_chunk(c) if fmt.chat else fmt.prompt_chunk(c)
            if opening is not None:
                yield sse(opening)
        async for c, piece in merged(choices):
            done = piece == "" and c.finish_reason is not None
            if piece or done:
                yield sse(fmt.piece_chunk(c, piece, c.finish_reason if done else None))
        err = engine_failure(choices)
        if err is not None:  # as OpenAI streams an error: an event carrying the error body
            yield sse(err.body())
        if body.stream_options and body.stream_options.include_usage:
            yield sse(fmt.envelope(fmt.chunk_object, [], usage=usage(prompt_tokens, choices)))
        yield "data: [DONE]\n\n"
    finally:
        metrics.record(arrived, choices)


async def respond(request: HTTPRequest, body, choices: list[Choice], prompt_tokens: int, arrived: float, *,
                  chat: bool, model: str, token_text: TokenText, metrics: ServerMetrics,
                  prompts: Sequence[PromptPart] | None = None):
    """The response to a submitted request (`body`, its `choices`): a `StreamingResponse` of server-sent chunks
    when `body.stream`, else the whole response object (RequestError 500 when the engine failed the request).
    `prompts`: per choice, what it carries of its prompt (`jaxspec.serving.echo`), or None."""
    fmt = ResponseFormat(chat=chat, model=model, token_text=token_text,
                         wants_logprobs=body.top_logprobs_wanted is not None, prompts=prompts)
    if body.stream:
        return StreamingResponse(_events(fmt, body, choices, prompt_tokens, arrived, metrics),
                                 media_type="text/event-stream")
    try:
        texts = await collect(request, choices)
    finally:
        metrics.record(arrived, choices)
    err = engine_failure(choices)
    if err is not None:
        raise err
    return fmt.envelope(fmt.final_object, [fmt.final_choice(c, texts[c.index]) for c in choices],
                        usage=usage(prompt_tokens, choices))
