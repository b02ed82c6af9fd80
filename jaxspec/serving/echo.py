"""A completion's prompt in its response: `echo` and `prompt_logprobs` on `/v1/completions`, from `jaxspec.score`.

`echo: true` puts each choice's prompt before its text, as OpenAI's legacy completions do; with `logprobs: N`
the choice's `logprobs` then cover the prompt's tokens first, the first of them with a null log-probability
and null `top_logprobs` (nothing comes before it to predict it from). `prompt_logprobs: N` (vLLM's extension)
gives each choice a list with one entry per prompt token: null for the first, then a dict from token id (a
string) to `{"logprob", "rank", "decoded_token"}` holding the prompt's token (its rank in the vocabulary) and
the N most likely tokens (ranks 1 to N).

A prompt's log-probabilities are scored once per request prompt, whatever `n`, in the app's scoring thread
(never on the event loop, and never on the engine's thread: the engine keeps serving other requests while a
prompt is scored). Its ids are padded to a power-of-two width (`jaxspec.shapes.prompt_bucket`, as prefill pads
them) and the most likely tokens are always taken `TOP_WIDTH` at a time, so a new prompt length does not
recompile: each width compiles once, with and without the most likely tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import Executor
from typing import Sequence

import jax
import numpy as np

from ..engine import Engine
from ..logprobs import TokenLogprob, to_host
from ..score import score
from ..shapes import prompt_bucket
from ..text import Detokenizer
from .logprob_formats import Entry, TokenText, completion_logprobs
from .protocol import CompletionRequest, RequestError

TOP_WIDTH = 20  # most likely tokens scored per position when a request asks for any (prompt_logprobs' bound)


@dataclasses.dataclass(frozen=True)
class PromptPart:
    """What each choice of one prompt carries of it in the response."""

    text: str  # the prompt's text, before the choice's own ("" without echo)
    logprobs: dict | None  # the legacy `logprobs` of the echoed prompt's tokens (None unless echo)
    prompt_logprobs: list | None  # vLLM's `prompt_logprobs` (None unless the request asked)


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """Scores of a prompt's tokens 1.. (token 0 has no context), on the host."""

    ids: list[int]  # the prompt's tokens, token 0 included
    logprobs: np.ndarray  # f32[n - 1]
    top_ids: np.ndarray  # i32[n - 1, K]
    top_logprobs: np.ndarray  # f32[n - 1, K]
    ranks: np.ndarray  # i32[n - 1]

    def token_logprobs(self, num_top: int) -> list[TokenLogprob]:
        """Tokens 1.. with their `num_top` most likely tokens."""
        return to_host(self.ids[1:], self.logprobs, self.top_ids, self.top_logprobs, num_top)


def prompt_text(tokenizer, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text of `ids` and where each token's text starts in it (as a choice's text offsets are found)."""
    detok = Detokenizer(tokenizer)
    pieces, offsets, length = [], [], 0
    for t in ids:
        offsets.append(length)
        piece = detok.add(int(t))
        pieces.append(piece)
        length += len(piece)
    pieces.append(detok.finish())
    return "".join(pieces), offsets


def echo_logprobs(scores: PromptScores, num_top: int, offsets: list[int], text: TokenText) -> dict:
    """The legacy `logprobs` of the echoed prompt: its first token with null log-probability and null
    `top_logprobs`, then each token's value and `num_top` most likely tokens (and itself)."""
    entries = [Entry(lp, offset) for lp, offset in zip(scores.token_logprobs(num_top), offsets[1:])]
    out = completion_logprobs(entries, text)
    for key, first in (("tokens", text(scores.ids[0])[0]), ("token_logprobs", None), ("top_logprobs", None),
                       ("text_offset", offsets[0])):
        out[key].insert(0, first)
    return out


def vllm_prompt_logprobs(scores: PromptScores, num_top: int, text: TokenText) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then per token a dict from token id (a string) to
    {"logprob", "rank", "decoded_token"}: the prompt's token first, then the `num_top` most likely."""
    def item(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": text(token_id)[0]}

    out: list = [None]
    for lp, rank in zip(scores.token_logprobs(num_top), scores.ranks.tolist()):
        entry = {str(lp.token_id): item(lp.token_id, lp.logprob, rank)}
        for r, (token_id, logprob) in enumerate(lp.top, 1):
            entry.setdefault(str(token_id), item(token_id, logprob, r))
        out.append(entry)
    return out


class PromptScorer:
    """The `PromptPart`s of a completions request, scored in `executor` (the app's scoring thread)."""

    def __init__(self, engine: Engine, token_text: TokenText, executor: Executor | None = None):
        self.lm = engine.lm  # the served model: its raw distribution is what is reported
        self.max_logprobs = engine.config.max_logprobs  # most likely tokens a request may ask for (None: none)
        self.max_width = engine.max_context  # a served prompt is shorter than the context
        self.top_width = min(TOP_WIDTH, self.lm.config.vocab_size)
        self.token_text = token_text
        self.executor = executor

    def check(self, body: CompletionRequest) -> None:
        """RequestError (400 naming `prompt_logprobs`) when it asks for more most likely tokens than the
        engine's `max_logprobs`, as `logprobs` is checked."""
        n = body.prompt_logprobs
        if n is not None and (self.max_logprobs is None or n > self.max_logprobs):
            most = ("log-probabilities are not served (--max-logprobs -1)" if self.max_logprobs is None
                    else f"this server returns at most {self.max_logprobs} most likely tokens per position")
            raise RequestError(f"prompt_logprobs: {most} (got {n})", param="prompt_logprobs")

    def score(self, ids: list[int], with_top: bool) -> PromptScores:
        """The prompt's scores under the served model at temperature 1.0: the model's raw distribution, which
        OpenAI reports for echoed prompt tokens and the engine records for generated ones (whatever the
        request's sampling settings). The ids are padded to a power-of-two width and the most likely tokens
        taken `top_width` at a time (or none), so prompts of similar lengths share one compiled program."""
        n = len(ids)
        tokens = np.zeros((1, prompt_bucket(n, self.max_width)), np.int32)
        tokens[0, :n] = ids
        res = jax.device_get(score(self.lm, tokens, lengths=[n], temperature=1.0,
                                   top_logprobs=self.top_width if with_top else 0))
        return PromptScores(ids=list(ids), logprobs=res.logprobs[0, 1:n], top_ids=res.top_ids[0, 1:n],
                            top_logprobs=res.top_logprobs[0, 1:n], ranks=res.ranks[0, 1:n])

    def part(self, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> PromptPart:
        """One prompt's part of every choice it has (blocking: run in the executor)."""
        text, offsets = prompt_text(self.lm.tokenizer, ids) if body.echo else ("", [])
        if body.echo and isinstance(prompt, str):
            text = prompt  # echoed as sent
        echo_top = body.logprobs if body.echo else None
        scores = None
        if echo_top is not None or body.prompt_logprobs is not None:
            scores = self.score(ids, with_top=bool(echo_top) or bool(body.prompt_logprobs))
        return PromptPart(
            text=text,
            logprobs=None if echo_top is None else echo_logprobs(scores, echo_top, offsets, self.token_text),
            prompt_logprobs=(None if body.prompt_logprobs is None
                             else vllm_prompt_logprobs(scores, body.prompt_logprobs, self.token_text)))

    async def parts(self, body: CompletionRequest, prompts: list, ids_list: list[list[int]]) -> list[PromptPart] | None:
        """One `PromptPart` per prompt (text, or token ids as sent, beside its ids), or None when the body asks
        for neither echo nor prompt_logprobs. RequestError when prompt_logprobs asks too much."""
        if not body.echo and body.prompt_logprobs is None:
            return None
        self.check(body)
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(self.executor, functools.partial(self.part, body, prompt, ids))
                for prompt, ids in zip(prompts, ids_list)]
