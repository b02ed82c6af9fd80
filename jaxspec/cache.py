"""The KV cache: preallocated per-layer buffers plus each row's committed length.

The buffers are laid out for the model's layer loop: one [B, Hkv, S, hd] array per layer when the layers are
unrolled in the trace, one stacked [B, L, Hkv, S, hd] array when they run as a `lax.scan` (the rows lead in both,
so batch-wise operations, row placement and sharding treat them alike). `map_layers` applies a per-layer function
to either.

A forward pass writes the K/V of its T new tokens at slots `lengths[b] .. lengths[b]+T-1` but does not
advance `lengths`; the caller commits by advancing. Rejecting speculative tokens therefore costs nothing:
the row's length simply does not move past them and the next write overwrites the slots.

New tokens that would land past the last slot are dropped, not written: a cache holds the prompt and the output
budget, so drafts past a row's last slot can never be committed, and the cache needs no room for them. A cache
with K + 1 spare slots for a full draft was often a larger compiled bucket than the plain loop's (125 + 128 tokens
fit 256 slots; with 9 more they took 384, and a plain rollout of 4 prompts x 8 samples then took 19% longer).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    """Per-layer K/V buffers of S slots per row and each row's committed length (a pytree)."""

    k: tuple[jax.Array, ...] | jax.Array  # per layer [B, Hkv, S, hd], or stacked [B, L, Hkv, S, hd]
    v: tuple[jax.Array, ...] | jax.Array  # the same layout as k
    lengths: jax.Array  # i32[B]  committed tokens per row

    @classmethod
    def create(cls, *, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype=jnp.float32, stacked: bool = False) -> "KVCache":
        """Zeroed buffers, every length 0: [batch, num_kv_heads, max_len, head_dim] per layer, or (`stacked`, for
        a scanned layer stack) one [batch, num_layers, num_kv_heads, max_len, head_dim] array each for K and V."""
        if stacked:
            shape = (batch, num_layers, num_kv_heads, max_len, head_dim)
            return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))
        # Per-layer arrays for unrolled layers: slicing a stacked cache per layer materialises copies on XLA:CPU.
        shape = (batch, num_kv_heads, max_len, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def stacked(self) -> bool:
        """Whether K and V are each one [B, L, Hkv, S, hd] array (a scanned layer stack's cache)."""
        return not isinstance(self.k, tuple)

    def map_layers(self, fn, *others: "KVCache") -> "KVCache":
        """This cache with K and V replaced by fn(buffer, *other_buffers) layer by layer, for a `fn` on one layer's
        [B, Hkv, S, hd] buffer (other caches in the same layout, their buffers passed alongside; S may differ).
        A stacked cache runs fn once, vectorised over its layer axis; lengths are kept."""
        def each(name: str):
            mine, theirs = getattr(self, name), [getattr(c, name) for c in others]
            if self.stacked:
                return jax.vmap(fn, in_axes=1, out_axes=1)(mine, *theirs)
            return tuple(fn(*bufs) for bufs in zip(mine, *theirs))

        return self.replace(k=each("k"), v=each("v"))

    @property
    def batch(self) -> int:
        """Rows B."""
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """Slots S per row."""
        return self.k.shape[3] if self.stacked else self.k[0].shape[2]

    def advance(self, num_tokens: jax.Array) -> "KVCache":
        """Commit `num_tokens` (i32[B] or scalar) more tokens of each row."""
        return self.replace(lengths=self.lengths + num_tokens)


def write_new(buffer: jax.Array, new: jax.Array, start: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """Write new [B, Hkv, T, hd] into buffer [B, Hkv, S, hd] at per-row slots start i32[B] (T <= S), or with
    `layer` (i32[]) into that layer of a stacked buffer [B, L, Hkv, S, hd].

    New token t goes to slot start[b] + t where that slot exists; tokens past slot S - 1 are dropped, and no other
    slot changes. (dynamic_update_slice alone would clamp an overflowing write, moving it over committed slots.)
    """
    num_new, num_slots = new.shape[2], buffer.shape[-2]
    if num_new > num_slots:
        raise ValueError(f"{num_new} new tokens cannot be written into a cache of {num_slots} slots")
    lead = () if layer is None else (layer,)  # the layer index, in front of one row's [Hkv, S, hd] offsets

    def one_row(buf, upd, s):  # [(L,) Hkv, S, hd], [Hkv, T, hd], i32[]
        # The T-slot window written stays inside the buffer; where the write runs past the end, the window
        # starts `shift` slots early and those slots keep their values. An in-place update either way.
        at = jnp.minimum(s, num_slots - num_new)
        shift = s - at  # i32[], > 0 only for a write past the end
        src = jnp.arange(num_new) - shift  # i32[T]: the new token landing in window slot i, < 0 for none
        window_shape = (1,) * len(lead) + (upd.shape[0], num_new, upd.shape[2])
        old = jax.lax.dynamic_slice(buf, (*lead, 0, at, 0), window_shape).reshape(upd.shape)  # [Hkv, T, hd]
        moved = jnp.take(upd, jnp.maximum(src, 0), axis=1)  # [Hkv, T, hd]
        window = jnp.where((src >= 0)[None, :, None], moved, old)
        return jax.lax.dynamic_update_slice(buf, window.reshape(window_shape), (*lead, 0, at, 0))

    return jax.vmap(one_row)(buffer, new.astype(buffer.dtype), start)


def kv_bytes_per_slot(module) -> int:
    """Bytes one row's KV cache takes per slot, read from the target module's own `new_cache` (the model
    contract: any layout, heads and dtype) by shape alone, nothing allocated."""
    cache = jax.eval_shape(lambda: module.new_cache(1, 1))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
