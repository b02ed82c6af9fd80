"""Responses in OpenAI's completion and chat formats: one JSON body, or server-sent chunks as the text comes.

A stream sends, per choice, chunks of text as they become final and one chunk with its finish reason (chat
opens each choice with its role), then the usage when asked, then `data: [DONE]`. A request the engine failed
is a 500 with the error body, or, once a stream has started, an event carrying that body. Either way the
request's latencies and finish reasons are recorded when it ends.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from .choices import Choice, collect, merged
from .errors import engine_failure
from .logprobs import Entry, TokenText, chat_logprobs, completion_logprobs
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

    def __init__(self, *, chat: bool, model: str, token_text: TokenText, wants_logprobs: bool):
        self.chat = chat  # chat completions, else (legacy) completions
        self.model = model  # the served model's name
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # the response's id, on every chunk
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"  # a streamed chunk's `object`
        self.final_object = "chat.completion" if chat else "text_completion"  # the one body's `object`
        self._token_text = token_text
        self._wants_logprobs = wants_logprobs

    def logprobs(self, entries: list[Entry]) -> dict | None:
        """The `logprobs` of a choice (or of a chunk): None when the request did not ask."""
        if not self._wants_logprobs:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(entries, self._token_text)

    def envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        """The response object around `choices`."""
        return {"id": self.id, "object": obj, "created": int(time.time()), "model": self.model, "choices": choices,
                **extra}

    def role_chunk(self, c: Choice) -> dict:
        """A chat stream's first chunk of a choice: its role (OpenAI opens each choice with it)."""
        return self.envelope(self.chunk_object, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}])

    def piece_chunk(self, c: Choice, piece: str, finish: str | None) -> dict:
        """A streamed chunk: a piece of a choice's text (with the logprobs of the tokens taken since the last)."""
        text = {"delta": {"content": piece} if piece else {}} if self.chat else {"text": piece}
        choice = {"index": c.index, **text, "logprobs": self.logprobs(c.take_logprobs()), "finish_reason": finish}
        return self.envelope(self.chunk_object, [choice])

    def final_choice(self, c: Choice, text: str) -> dict:
        """A choice of the one-body response."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": c.index, **body, "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason}


async def _events(fmt: ResponseFormat, body, choices: list[Choice], prompt_tokens: int, arrived: float,
                  metrics: ServerMetrics) -> AsyncIterator[str]:
    try:
        if fmt.chat:
            for c in choices:
                yield sse(fmt.role_chunk(c))
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
                  chat: bool, model: str, token_text: TokenText, metrics: ServerMetrics):
    """The response to a submitted request (`body`, its `choices`): a `StreamingResponse` of server-sent chunks
    when `body.stream`, else the whole response object (RequestError 500 when the engine failed the request)."""
    fmt = ResponseFormat(chat=chat, model=model, token_text=token_text,
                         wants_logprobs=body.top_logprobs_wanted is not None)
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
