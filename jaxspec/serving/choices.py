"""The choices of one HTTP request, each one engine request: its `Output` events as text, merged or collected.

The engine thread hands each `Output` to the event loop (`call_soon_threadsafe`); a `Choice` turns them into
text pieces (incremental detokenization, stop strings: `jaxspec.text`) and log-probability entries.
A choice whose stop string appeared cancels its engine request, and a client that goes away cancels every
unfinished one, which frees their rows within one chunk.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request as HTTPRequest

from ..engine import Engine, EngineStopped, Handle, Output, QueueFull, Request, RequestStats
from ..text import TextStream
from .errors import refused
from .logprob_formats import Entry


class Choice:
    """One engine request of an HTTP request: its outputs as an async iterator of text pieces."""

    def __init__(self, index: int, tokenizer, stop: list[str]):
        self.index = index  # the choice's index in the response
        self.text = TextStream(tokenizer, stop)  # the text so far, and the tokens it consumed
        self.logprobs: list[Entry] = []  # one per token of the text, when the request asked for them
        self._logprobs_taken = 0
        self.finish_reason: str | None = None  # OpenAI's: "stop", "length", "abort" (cancelled) or "error"
        self.error: str | None = None  # the engine's error, with finish_reason "error"
        self.first_token_at: float | None = None  # perf_counter() at the first token
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.handle: Handle | None = None  # set once submitted
        self.stats: RequestStats | None = None  # the engine's counts, from its final event

    def callback(self, out: Output) -> None:
        """The engine's callback (called on the engine thread): queue the output for the event loop."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    async def pieces(self) -> AsyncIterator[str]:
        """The choice's text as it becomes final, until the engine's final event."""
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
                self.stats = out.stats
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


def submit(engine: Engine, requests: list[Request], tokenizer, stop: list[str]) -> list[Choice]:
    """Submit every request, one choice each; all or none: if the engine refuses one, the others are cancelled
    and the refusal is raised as a RequestError (429 queue full, 503 stopping, 400 otherwise)."""
    choices = []
    try:
        for i, r in enumerate(requests):
            choice = Choice(i, tokenizer, stop)
            choice.handle = engine.submit(r, choice.callback)
            choices.append(choice)
    except (QueueFull, EngineStopped, ValueError) as e:
        for c in choices:
            c.handle.cancel()
        raise refused(e) from None
    return choices


def generating_nothing(count: int, tokenizer) -> list[Choice]:
    """`count` choices that submit nothing (`max_tokens` 0 with echo: the prompt alone), each finished at once
    with OpenAI's finish reason "length"."""
    choices = [Choice(i, tokenizer, []) for i in range(count)]
    for c in choices:
        c.callback(Output(token_ids=[], finish_reason="length"))
    return choices


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, str]]:
    """(choice, text piece) from every choice as they come, then a final (choice, "") per choice. Closing the
    iterator early (the client went away) cancels the unfinished choices' engine requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
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
            if c.finish_reason is None and c.handle is not None:
                c.handle.cancel()  # the client went away: free the row


async def collect(request: HTTPRequest, choices: list[Choice]) -> list[str]:
    """Each choice's whole text; checks every second whether the client is still there, and cancels the choices
    (raising CancelledError) when it is not."""
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
