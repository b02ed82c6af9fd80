"""The token ids a request may carry, checked once for `jaxspec.generate` and the serving engine alike.

A prompt holds at least one token and every id, prompt or stop id, must index the model's embedding table.
A row stops at any of its stop ids: the model's end-of-sequence ids (unless the caller ignores them) followed
by the caller's own. The decode loop reads them as one table, a row per batch row padded with -1.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .validation import is_integer, short_repr


def is_token_list(x) -> bool:
    """A list, tuple or 1-D integer array of token ids (possibly empty): one prompt, not a batch."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and x.dtype.kind in "iu"
    return isinstance(x, (list, tuple)) and all(is_integer(t) for t in x)


def check_token_ids(ids, vocab_size: int, where: str) -> list[int]:
    """`ids` as Python ints; ValueError naming `where` unless they are integer token ids in [0, vocab_size)."""
    if not is_token_list(ids):
        raise ValueError(f"{where}={short_repr(ids)} must be a list of integer token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where} has token id {bad[0]} outside [0, {vocab_size})")
    return [int(t) for t in ids]


def check_prompt(ids, vocab_size: int, where: str = "prompt") -> list[int]:
    """A prompt's token ids as Python ints (`check_token_ids`); ValueError naming `where` when it is empty."""
    ids = check_token_ids(ids, vocab_size, where)
    if not ids:
        raise ValueError(f"{where} is empty: at least one token is needed")
    return ids


def eos_ids(lm) -> tuple[int, ...]:
    """The end-of-sequence ids of `lm` (a `LanguageModel`); none for a model without a tokenizer."""
    return tuple(lm.tokenizer.eos_token_ids) if lm.tokenizer is not None else ()


def stop_ids(stop_token_ids, eos: Sequence[int], vocab_size: int, where: str = "stop_token_ids") -> list[int]:
    """One row's stop ids: `eos` (the model's EOS ids, or () to ignore them), then the caller's, checked."""
    return list(eos) + check_token_ids(stop_token_ids, vocab_size, where)


def stop_table(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """i32[B, M]: row i's stop ids (`stop_ids`), -1 padded to `width` (default: the longest row, at least 1)."""
    width = max([1, *(len(r) for r in rows)]) if width is None else width
    table = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table
