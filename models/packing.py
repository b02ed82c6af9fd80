"""Packed prefill: a batch's prompts laid end to end, without the padding to the longest one.

A prefill of B prompts right-padded to W tokens runs its projections and MLPs over B * W token positions. When the
prompts' lengths differ, most of those can be padding: eight prompts of 74-223 tokens padded to 256 are 2048
positions for 967 tokens. Those token-wise parts (embeddings, norms, projections, MLPs, rotary embedding) do not
care which row a token belongs to, so a packed prefill runs them over the N positions of the prompts laid end to
end in one row (N a power of two holding the real tokens), and only attention, which does, runs over the padded
[B, W] layout: its queries, keys and values are placed there and its output packed back. That is what
ragged prefill in vLLM and SGLang saves too; here the attention keeps the padded layout and its masks, so every
attention path and the cache writes are the same as a padded prefill's.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Packing:
    """Where each of N packed token positions sits in the padded [B, W] batch."""

    rows: jax.Array  # i32[N]  the row of packed position n; `batch` (out of range) past the last prompt's end
    cols: jax.Array  # i32[N]  its column in that row: its position within the prompt
    sources: jax.Array  # i32[B, W]  the packed position each padded position holds; N (out of range) for padding

    @property
    def batch(self) -> int:
        """B, the padded batch's rows."""
        return self.sources.shape[0]

    @classmethod
    def of(cls, prompt_lens: jax.Array, width: int, packed: int) -> "Packing":
        """The packing of prompts of lengths i32[B] (padded to `width`) into `packed` positions (at least their
        sum; the rest is padding, which no row reads)."""
        batch = prompt_lens.shape[0]
        ends = jnp.cumsum(prompt_lens)  # i32[B]: one past each prompt's last packed position
        n = jnp.arange(packed, dtype=jnp.int32)
        rows = jnp.searchsorted(ends, n, side="right").astype(jnp.int32)  # i32[N]: B past the last prompt
        starts = ends - prompt_lens
        cols = n - jnp.take(starts, jnp.minimum(rows, batch - 1))
        w = jnp.arange(width, dtype=jnp.int32)
        sources = jnp.where(w[None, :] < prompt_lens[:, None], starts[:, None] + w[None, :], packed)  # i32[B, W]
        return cls(rows=rows, cols=jnp.where(rows < batch, cols, 0), sources=sources.astype(jnp.int32))

    def pack(self, x: jax.Array) -> jax.Array:
        """x [B, W, ...] -> [1, N, ...]: each packed position's entry (the last row's first column's for padding)."""
        return x[jnp.minimum(self.rows, self.batch - 1), self.cols][None]

    def unpack(self, x: jax.Array) -> jax.Array:
        """x [1, N, ...] -> [B, W, ...]: each packed position's entry at its row and column, zeros elsewhere."""
        # A gather, not a scatter: XLA:CPU runs a scatter's updates one after another.
        return jnp.take(x[0], self.sources, axis=0, mode="fill", fill_value=0)
