"""OpenAI's two `logprobs` formats, from the engine's per-token log-probabilities.

Completions (the legacy format) list `tokens`, `token_logprobs`, `top_logprobs` (a dict per position of the
`logprobs` most likely tokens, plus the chosen one, as OpenAI documents) and `text_offset`, after an echoed
prompt's own (`jaxspec.serving.echo`); chat lists one object per token under `content`, each with its `bytes`
and its `top_logprobs`. A token is reported as the text of its own bytes: a byte-level token that holds part of
a UTF-8 character reads as U+FFFD there, and its `bytes` are exact.
"""

from __future__ import annotations

import dataclasses

from ..logprobs import TokenLogprob


@dataclasses.dataclass(frozen=True)
class Entry:
    """A token of a choice's text: its log-probabilities and where its text starts in the choice's text."""

    logprob: TokenLogprob
    text_offset: int


class TokenText:
    """Token id -> (text, bytes) with a cache: a response repeats few distinct tokens."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            raw = self._tokenizer.token_bytes(token_id)
            self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token_id]


def completion_logprobs(entries: list[Entry], text: TokenText, *, offset: int = 0,
                        before: dict | None = None) -> dict:
    """The legacy `logprobs` of `entries`, their text offsets moved by `offset` (the length of an echoed prompt's
    text), after the lists of `before` (an echoed prompt's own `logprobs`) when given."""
    out = {k: list(v) for k, v in before.items()} if before is not None else \
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        lp = e.logprob
        out["tokens"].append(text(lp.token_id)[0])
        out["token_logprobs"].append(lp.logprob)
        top = {text(t)[0]: v for t, v in lp.top}
        top.setdefault(text(lp.token_id)[0], lp.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(e.text_offset + offset)
    return out


def chat_logprobs(entries: list[Entry], text: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token, raw = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": raw}

    content = [{**item(e.logprob.token_id, e.logprob.logprob),
                "top_logprobs": [item(t, v) for t, v in e.logprob.top]} for e in entries]
    return {"content": content, "refusal": None}
