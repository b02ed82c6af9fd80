"""The KV cache: preallocated per-layer buffers plus each row's committed length.

A forward pass writes the K/V of its T new tokens at slots `lengths[b] .. lengths[b]+T-1` but does not
advance `lengths`; the caller commits by advancing. Rejecting speculative tokens therefore costs nothing:
the row's length simply does not move past them and the next write overwrites the slots.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    """Per-layer K/V buffers of S slots per row and each row's committed length (a pytree)."""

    k: tuple[jax.Array, ...]  # per layer: [B, Hkv, S, hd]
    v: tuple[jax.Array, ...]  # per layer: [B, Hkv, S, hd]
    lengths: jax.Array  # i32[B]  committed tokens per row

    @classmethod
    def create(cls, *, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype=jnp.float32) -> "KVCache":
        """Zeroed buffers [batch, num_kv_heads, max_len, head_dim] per layer, every length 0."""
        # Per-layer arrays rather than one stacked [L, ...] array: slicing a stacked cache (or weights) per
        # layer materialises copies on XLA:CPU (docs/cpu-performance.md).
        shape = (batch, num_kv_heads, max_len, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        """Rows B."""
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """Slots S per row."""
        return self.k[0].shape[2]

    def advance(self, num_tokens: jax.Array) -> "KVCache":
        """Commit `num_tokens` (i32[B] or scalar) more tokens of each row."""
        return self.replace(lengths=self.lengths + num_tokens)


def write_new(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, Hkv, T, hd] into buffer [B, Hkv, S, hd] at per-row slots start i32[B].

    The caller guarantees start + T <= S (dynamic_update_slice would clamp, not drop, an overflowing write).
    """
    def one_row(buf, upd, s):
        return jax.lax.dynamic_update_slice(buf, upd, (0, s, 0))

    return jax.vmap(one_row)(buffer, new.astype(buffer.dtype), start)
