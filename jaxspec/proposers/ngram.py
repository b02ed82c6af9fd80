"""Prompt lookup: draft the tokens that followed an earlier occurrence of the row's last n tokens.

Stateless and vectorised: for each n from `ngram_max` down to `min_match` every window of the row's history
(prompt + output) is compared with its last n tokens at once, and the longest n with a match wins. Among
matches of that length the earliest is used, as transformers' prompt lookup does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import ChainProposer, Committed, Context, Draft, lookup_draft_count


@dataclasses.dataclass(frozen=True)
class NgramProposer(ChainProposer):
    """Prompt lookup (`SpecConfig(method="ngram")`): stateless, params unused, deterministic drafts."""

    num_speculative_tokens: int  # K
    ngram_max: int = 4  # the longest n-gram tried
    min_match: int = 2  # the shortest n-gram tried; shorter matches draft nothing
    draft_per_match: float | None = None  # at most ceil(draft_per_match * match length) drafts; None: no cap

    def init(self, params, ctx: Context):
        """No state: ()."""
        return ()

    def propose(self, params, pstate, ctx: Context, keys: jax.Array) -> tuple[Draft, tuple]:
        """The K tokens after the earliest occurrence of the longest matching n-gram, per row."""
        hist, hist_len = ctx.history, ctx.history_len  # i32[B, H], i32[B]
        batch, width = hist.shape
        k = self.num_speculative_tokens
        start = jnp.zeros((batch,), jnp.int32)  # index of the first continuation token
        match_len = jnp.zeros((batch,), jnp.int32)
        # Shorter n-grams first so that longer ones, when they match, overwrite them.
        for n in range(self.min_match, self.ngram_max + 1):
            if n >= width:
                break
            suffix = jnp.take_along_axis(hist, jnp.maximum(hist_len[:, None] - n + jnp.arange(n), 0), axis=1)
            num_windows = width - n
            hits = jnp.ones((batch, num_windows), bool)  # window i covers hist[i : i + n]
            for t in range(n):
                hits &= hist[:, t: t + num_windows] == suffix[:, t: t + 1]
            # The window must end before the suffix does and leave at least one continuation token.
            i = jnp.arange(num_windows)
            hits &= (i + n < hist_len[:, None]) & (hist_len[:, None] >= n)
            first = jnp.min(jnp.where(hits, i, width), axis=1)
            found = first < width
            start = jnp.where(found, first + n, start)
            match_len = jnp.where(found, n, match_len)
        available = jnp.where(match_len > 0, hist_len - start, 0)
        num_draft = lookup_draft_count(match_len, available, ctx.max_draft, k, self.min_match, self.draft_per_match)
        tokens = jnp.take_along_axis(hist, jnp.minimum(start[:, None] + jnp.arange(k), width - 1), axis=1)
        return Draft(tokens=tokens, num_draft=num_draft, match_len=match_len), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        """No state to update."""
        return pstate
