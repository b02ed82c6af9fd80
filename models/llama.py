"""A Llama-family decoder in Flax NNX (Llama, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 2, Gemma 3 text).

One forward path serves prefill, single-token decode and verification: T new tokens per row at per-row
positions, their K/V written into a preallocated cache at per-row lengths, an optional mask among the new
tokens (causal by default, a tree's ancestor mask for tree verification). It returns logits and hidden states.
The architectures differ in config switches only (`ModelConfig`): q/k/v biases (Qwen2), per-head q/k norms (Qwen3,
Gemma 3), a sliding attention window, which narrows every mask below to the keys within the window of each query's
position, on every layer (Mistral) or on some (`layer_types`: Qwen2 and Qwen3 where configured, Gemma's local
layers, each kind with its rotary tables), and Gemma's (1 + w) norms, normed block outputs, scaled embeddings,
GELU gate, attention scale and tanh soft-capping of attention scores and logits (Gemma 2). A window or a cap sends
attention through XLA: the Pallas kernel's mask has neither (in a scanned stack of mixed layers every layer has a
window, a full-attention layer's one that hides nothing).

The layer stack runs one of two ways (`layer_loop`, chosen per platform by `default_layer_loop`): "scan", the
layout JAX users know from MaxText and tpu-inference, where the layers' weights are stacked [L, ...] and one
`lax.scan` runs them, so a forward compiles in time that does not grow with depth (the default off the CPU); or
"unroll", separate per-layer arrays and a Python loop unrolled in the trace, the default on the CPU, where a scan's
per-layer weight slices are materialised before each matmul and a one-row decode step costs 1.5-1.9x as much.
Unrolled layers alike are traced once (`_traced_once`): XLA still compiles each of them, but Python traces and
lowers one layer per kind: about half of a first call's time here when the programs come from the persistent
compilation cache. The KV cache follows (`jaxspec.cache.KVCache`: stacked [B, L, ...] or per layer);
`set_layer_loop` converts a model.

Activations are [batch, tokens, features] and weights [out, in] (Hugging Face's order); q/k/v and gate/up are
fused into one wider matmul each; attention contracts the G query heads and T new tokens of a KV head as one row
block; the LM head is also kept as [D, V] (a transposed copy when embeddings are tied) because a single row runs
fastest as h @ W (docs/cpu-performance.md).

Every projection goes through `jaxspec.kernels.cpu.linear`, the one boundary that knows about the CPU: there, for
the few rows of a decode or verify step, the product runs as a custom call over feature-major activations, which
reads the weights once for any number of rows up to a verify step's, where XLA's GEMM costs several one-row
products. Everywhere else it is XLA's dot. Each module's `matmul` picks the path: "auto" (the kernel where it is
built and wins), "xla" or "ffi"; a model gets $JAXSPEC_MATMUL (default auto) when built, `set_matmul` changes it.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.cache import KVCache, write_new
from jaxspec.kernels.cpu import MatmulImpl, default_impl, linear, uses_kernel
from jaxspec.kernels.verify_attention import compiled_supports, verify_attention
from jaxspec.sharding import active, constrain, mesh_size

from .config import FULL_WINDOW, ModelConfig
from .packing import Packing
from .rope import apply_rope, rope_tables

AttentionImpl = Literal["xla", "pallas"]
LayerLoop = Literal["scan", "unroll"]
LAYER_LOOP_ENV = "JAXSPEC_LAYER_LOOP"  # overrides `default_layer_loop`: "scan" or "unroll"
_MASKED = -1e30  # finite, so a fully masked row (never produced here) would not turn into NaN


@flax.struct.dataclass
class ModelOutput:
    """What a forward returns: logits where asked, the final hidden states, and chosen layers' outputs."""

    logits: jax.Array | None  # f32[B, L, V]  (L = T, or the positions picked by `logits_at`)
    hidden: jax.Array  # [B, T, D]  final normed hidden state (the feature EAGLE heads read)
    layer_hidden: tuple[jax.Array, ...] = ()  # [B, T, D] each: outputs of the requested decoder layers


def _dense_init(rngs: nnx.Rngs, shape, dtype, scale=0.02):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * scale)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned scale, over the last (feature) axis. With `plus_one` (Gemma) the
    scale is 1 + w, so a zero weight is the identity."""

    def __init__(self, dim: int, eps: float, dtype, plus_one: bool = False):
        self.weight = nnx.Param(jnp.full((dim,), 0.0 if plus_one else 1.0, dtype))
        self.eps = eps
        self.plus_one = plus_one  # static

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise x [..., D] over its features."""
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.weight[...].astype(jnp.float32)  # [D]
        if self.plus_one:
            scale = 1.0 + scale
        return (x32 * scale).astype(x.dtype)


def _norm(dim: int, cfg: ModelConfig) -> RMSNorm:
    """An RMSNorm over `dim` features as the config's architecture scales it."""
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.jnp_dtype, plus_one=cfg.gemma_norms)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """tanh(x / cap) * cap: x squashed smoothly into (-cap, cap) (Gemma 2's soft-capping); x itself for None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def _attention_logits(products: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention scores from query-key products f32[...]: scaled, then soft-capped where the config caps them."""
    return softcap(products * cfg.attention_scale, cfg.attn_logit_softcapping)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions over the KV cache (fused q/k/v projection)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, matmul: MatmulImpl | None = None,
                 in_features: int | None = None):
        dt = cfg.jnp_dtype
        self.cfg = cfg
        self.matmul = matmul or default_impl()  # static: part of the graphdef, so each path compiles apart
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        # The input width is the residual stream's, D, except in an EAGLE-3 drafter's layer, which attends over
        # [embedding; feature] (2D) and adds its output to a D-wide residual.
        in_features = cfg.hidden_size if in_features is None else in_features
        self.qkv = _dense_init(rngs, (qkv_width, in_features), dt)  # [(H + 2 Hkv) hd, D_in]
        self.qkv_bias = nnx.Param(jnp.zeros((qkv_width,), dt)) if cfg.attention_bias else None
        self.o = _dense_init(rngs, (cfg.hidden_size, cfg.num_heads * cfg.head_dim), dt)  # [D, H hd]
        self.q_norm = _norm(cfg.head_dim, cfg) if cfg.qk_norm else None
        self.k_norm = _norm(cfg.head_dim, cfg) if cfg.qk_norm else None
        # Static: the qkv rows are stored as `blocks` consecutive [q; k; v] blocks of H/blocks query and
        # Hkv/blocks KV heads each (`set_blocks`), so a tensor-parallel split of the rows gives each device whole
        # heads. 1 (one [q; k; v]) without a mesh.
        self.blocks = 1

    def project(self, x, cos, sin) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The rotated queries q [B, T, H, hd] and keys k [B, Hkv, T, hd], and the values v [B, Hkv, T, hd], of
        x [B, T, D_in] at the positions whose rotary tables cos, sin [B, T, hd] hold."""
        cfg = self.cfg
        B, T = cos.shape[:2]
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = linear(x, self.qkv[...], self.matmul)  # [B, T, (H + 2 Hkv) hd]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        n = self.blocks
        qkv = qkv.reshape(B, T, n, (H + 2 * Hkv) // n, hd)  # block i: its H/n query, Hkv/n key, Hkv/n value heads
        q, k, v = jnp.split(qkv, [H // n, (H + Hkv) // n], axis=3)
        q, k, v = (a.reshape(B, T, -1, hd) for a in (q, k, v))  # [B, T, heads, hd]
        q, k, v = (constrain(a, "batch", None, "heads", None) for a in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin).transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
        return q, k, v.transpose(0, 2, 1, 3)

    def __call__(self, x, cos, sin, k_cache, v_cache, lengths, visible, attention_impl, tree_mask,
                 cached_slots=None, write_cache=True, layer=None, window=None, packing=None):
        """x [B, T, D]; returns the attention block's output [B, T, D] and the caches with the new K/V written,
        or (write_cache=False) the caches untouched and the new K/V [B, Hkv, T, hd].

        With `packing` (`jaxspec.models.packing.Packing`, a packed prefill) x and cos, sin hold N packed positions
        ([1, N, ...]) and so does the output: the queries, keys and values are placed in the padded rows
        [B, W] for attention, and its output gathered back before the output projection.

        With `layer` (i32[], inside a scanned layer stack) the caches are the stack's [B, L, Hkv, S, hd] buffers,
        written and read at that layer. `window`: None for full attention, or (positions, W): the new tokens'
        positions i32[B, T] and the layer's window W (an int, or an i32[] in a scanned stack of mixed layers);
        committed slot s holds position s, so the window bounds slots as well as new tokens."""
        cfg = self.cfg
        H, hd = cfg.num_heads, cfg.head_dim
        q, k, v = self.project(x, cos, sin)
        if packing is not None:
            q = packing.unpack(q)  # [B, W, H, hd]
            k, v = (packing.unpack(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for a in (k, v))  # [B, Hkv, W, hd]
        B, T = q.shape[:2]

        def output(out):  # [B, T, H, hd] -> the output projection, over the packed positions with `packing`
            out = out.reshape(B, T, H * hd)
            return linear(out if packing is None else packing.pack(out), self.o[...], self.matmul)

        def this_layer(buffer):  # [B, Hkv, S, hd]: the layer's own buffer, or its slice of the stack's
            return buffer if layer is None else jax.lax.dynamic_index_in_dim(buffer, layer, 1, keepdims=False)

        if not write_cache:
            out = _attention_beside_cache(q, this_layer(k_cache), this_layer(v_cache), k, v, lengths, tree_mask, cfg,
                                          window)
            return output(out), k, v
        k_cache, v_cache = write_new(k_cache, k, lengths, layer), write_new(v_cache, v, lengths, layer)
        k_layer, v_layer = this_layer(k_cache), this_layer(v_cache)
        # "pallas" is a hint: the interpreter (CPU) takes any head dim, the compiled kernel only those Triton takes,
        # so a model with another (8, 80, ...) uses XLA's attention rather than fail on a GPU, where it is the default.
        # The kernel has no window in its mask and no soft-capping of its scores either.
        interpret = jax.default_backend() == "cpu"
        if (attention_impl == "pallas" and (interpret or compiled_supports(hd)) and window is None
                and cfg.attn_logit_softcapping is None):
            scale = None if cfg.query_pre_attn_scalar is None else cfg.attention_scale  # None: the kernel's 1/sqrt(hd)
            out = verify_attention(q, k_layer, v_layer, lengths, tree_mask, sm_scale=scale, interpret=interpret)
        elif visible is not None:  # the caller's own mask over the whole cache (the EAGLE head's trees)
            out = _xla_attention(q, k_layer, v_layer, visible, cfg)
        else:
            out = _attention_in_cache(q, k_layer, v_layer, lengths, tree_mask, cfg, cached_slots, window)
        return output(out), k_cache, v_cache


def _xla_attention(q, k_cache, v_cache, visible, cfg: ModelConfig):
    """q [B,T,H,hd] against the whole cache [B,Hkv,S,hd] under visible bool[B,T,S] -> [B,T,H,hd]."""
    B, T, H, hd = q.shape
    Hkv, G = cfg.num_kv_heads, cfg.q_per_kv
    S = k_cache.shape[2]
    # The G query heads of a KV head and the T new tokens form one M = G*T row block per (row, KV head):
    # a plain batched [M, hd] x [hd, S] matmul, which XLA:CPU runs several times faster than the same
    # contraction with G and T as separate dimensions.
    q = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, hd)
    scores = _attention_logits(jnp.einsum("bkmd,bksd->bkms", q, k_cache, preferred_element_type=jnp.float32), cfg)
    scores = jnp.where(visible[:, None, None], scores.reshape(B, Hkv, G, T, S), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).reshape(B, Hkv, G * T, S)
    # Invisible slots may hold stale values; their probability is exactly zero after the masked softmax,
    # and this model only ever writes finite values into the cache.
    out = jnp.einsum("bkms,bksd->bkmd", probs, v_cache)
    return out.reshape(B, Hkv, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def _attention_beside_cache(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, cfg: ModelConfig, window=None):
    """q [B,T,H,hd] against the committed slots of an unwritten cache [B,Hkv,S,hd] (those below lengths i32[B])
    and the T new tokens' own k_new, v_new [B,Hkv,T,hd] (causal among themselves, or as `tree_mask` bool[B,T,T]
    says) -> [B,T,H,hd]: one softmax over both, the cache only read. `window`: None, or (positions i32[B,T], W) to
    hide keys W or more positions behind each query.

    The same attention as writing the new K/V at slots lengths.. and reading the cache (`_attention_in_cache`),
    up to float summation order. The cache is read block by block (`_cache_blocks`), up to the longest row.
    """
    B, T, H, hd = q.shape
    Hkv, G = cfg.num_kv_heads, cfg.q_per_kv

    positions, W = (None, None) if window is None else window

    def attend_rows(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, positions):  # any b of the B rows
        b = q.shape[0]
        q = _query_blocks(q, Hkv, G)

        def visible(slots):  # bool[b, 1 or T, block]: committed slots, within the window where there is one
            committed = (slots[None, :] < lengths[:, None])[:, None]
            return committed if positions is None else committed & _in_window(positions, slots[None, :], W)

        parts = _cache_blocks(q, k_cache, v_cache, jnp.max(lengths), visible, cfg)
        among_new = jnp.tril(jnp.ones((1, T, T), bool)) if tree_mask is None else tree_mask  # bool[b or 1, T, T]
        if positions is not None:  # keys within the window of each query's position
            among_new = among_new & _in_window(positions, positions, W)  # bool[b, T, T]
        scores = _attention_logits(jnp.einsum("bkmd,bktd->bkmt", q, k_new, preferred_element_type=jnp.float32), cfg)
        scores = jnp.where(among_new[:, None, None], scores.reshape(b, Hkv, G, T, T), _MASKED).reshape(scores.shape)
        out = _softmax_merge(parts, scores, v_new.astype(v_cache.dtype)).astype(v_cache.dtype)
        return _heads_back(out, T)

    return _by_row_groups(attend_rows, kv_row_bytes(k_cache, _read_block(k_cache.shape[2])),
                          q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, positions)


def _query_blocks(q: jax.Array, Hkv: int, G: int) -> jax.Array:
    """q [B,T,H,hd] -> [B,Hkv,G*T,hd]: the G query heads of a KV head and the T new tokens form one row block per
    (row, KV head), so each score is a plain batched [G*T, hd] x [hd, S] matmul (`_xla_attention`)."""
    B, T, _, hd = q.shape
    return q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, hd)


def _heads_back(out: jax.Array, T: int) -> jax.Array:
    """The inverse of `_query_blocks`: [B,Hkv,G*T,hd] -> [B,T,H,hd]."""
    B, Hkv, M, hd = out.shape
    G = M // T
    return out.reshape(B, Hkv, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, Hkv * G, hd)


# The cache is read in blocks of this many slots, as many as the longest row needs: a step's attention then costs
# what its rows hold rather than what the cache could hold, at one compiled loop body per layer. Slicing a long
# prefix of the cache copies it on a CPU (docs/cpu-performance.md), and a small block's slice stays in cache.
READ_BLOCK = 128
# A cache of at most this many slots is read whole, without the loop: the slots it would skip cost less than a
# loop costs to compile and run.
WHOLE_READ_SLOTS = 256


# A forward of many new tokens (a prefill) attends with its queries in up to QUERY_BLOCKS blocks of at least
# QUERY_BLOCK_MIN, each block against the slots up to its own last query, so a causal prefill skips up to 3/8 of
# its scores. More blocks skip more, but each is more program to compile: a default-model prefill of 1024 tokens
# ran in 1.71 s as one block, 1.22 s as 4 and 1.20 s as 8, and compiled in 1.2, 2.2 and 3.8 s.
QUERY_BLOCKS = 4
QUERY_BLOCK_MIN = 128


def _query_block(num_new: int) -> int:
    """Queries per block of a forward of `num_new` new tokens (`num_new` itself: one block)."""
    return max(QUERY_BLOCK_MIN, -(-num_new // QUERY_BLOCKS))


def _read_block(max_len: int) -> int:
    """Slots per cache block: the whole cache up to `WHOLE_READ_SLOTS` slots, else `READ_BLOCK`. The row groups
    are sized by it (`_by_row_groups`), so a whole read of up to 256 slots counts as what it reads."""
    return max_len if max_len <= WHOLE_READ_SLOTS else READ_BLOCK


def _cache_blocks(q, k_cache, v_cache, needed: jax.Array, visible, cfg: ModelConfig):
    """The softmax parts of q [B,Hkv,M,hd] (M = G*T) against cache slots [0, needed) of k_cache, v_cache
    [B,Hkv,S,hd], read a block at a time in a loop (flash-decoding's split of the keys): `visible(slots
    i32[block])` -> bool[B, 1 or T, block] masks each block's scores. Returns (m, z, acc): the running max of the
    scores and the sum of their exponentials f32[B,Hkv,M,1], and the exponentials' weighted sum of values
    f32[B,Hkv,M,hd]; `_softmax_merge` adds more scores to them, acc / z is the attention.

    A masked score counts as `_MASKED`, as in a single softmax: while every score seen is masked, the parts hold
    junk that the first visible score's rescaling (by exp(_MASKED - max) = 0) wipes out. Every query sees at
    least its own key, so the result never rests on junk."""
    B, Hkv, M, hd = q.shape
    S = k_cache.shape[2]
    block = _read_block(S)
    G = cfg.q_per_kv

    def add_block(parts, k, v, seen):  # k, v [B,Hkv,n,hd]; seen bool[B, 1 or T, n]
        n = k.shape[2]
        scores = _attention_logits(jnp.einsum("bkmd,bksd->bkms", q, k, preferred_element_type=jnp.float32), cfg)
        scores = jnp.where(seen[:, None, None], scores.reshape(B, Hkv, G, M // G, n), _MASKED)
        return _softmax_merge(parts, scores.reshape(B, Hkv, M, n), v, done=False)

    empty = (jnp.full((B, Hkv, M, 1), _MASKED, jnp.float32), jnp.zeros((B, Hkv, M, 1), jnp.float32),
             jnp.zeros((B, Hkv, M, hd), jnp.float32))
    if block == S:  # one block of the whole cache: no loop to compile
        return add_block(empty, k_cache, v_cache, visible(jnp.arange(S)))

    def step(i, parts):
        first = jnp.minimum(i * block, S - block)  # the last block of a cache of S % block != 0 overlaps ...
        slots = first + jnp.arange(block)
        seen = visible(slots) & (slots >= i * block)[None, None]  # ... the one before it, whose slots it skips
        k = jax.lax.dynamic_slice_in_dim(k_cache, first, block, axis=2)
        v = jax.lax.dynamic_slice_in_dim(v_cache, first, block, axis=2)
        return add_block(parts, k, v, seen)

    return jax.lax.fori_loop(0, (needed + block - 1) // block, step, empty)


def _softmax_merge(parts, scores, values, done: bool = True):
    """Softmax parts (m, z, acc) (`_cache_blocks`) with one more block of scores f32[B,Hkv,M,n] over values
    [B,Hkv,n,hd]: the merged parts, or (done) the attention output f32[B,Hkv,M,hd]."""
    m, z, acc = parts
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
    p = jnp.exp(scores - m_new)
    rescale = jnp.exp(m - m_new)
    z = z * rescale + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * rescale + jnp.einsum("bkmn,bknd->bkmd", p.astype(values.dtype), values,
                                     preferred_element_type=jnp.float32)
    return acc / z if done else (m_new, z, acc)


# On a CPU, XLA's attention over many rows slows several-fold once the K/V a step reads outgrows the caches: the
# scores' dot (q against K, a YNNPACK fusion) then runs far below memory speed: a one-token forward of 128 rows
# reading 512 slots costs about three times as much as with its rows in groups (docs/cpu-performance.md,
# "Attention in row groups"). So the rows attend in groups whose K and V reads stay within this many bytes, one
# group after another (small enough, presumably, for each group's block copies and dots to stay in cache); rows are
# independent in attention, so the result is the same.
ROW_GROUP_BYTES = 4 << 20


def kv_row_bytes(k_cache: jax.Array, slots: int) -> int:
    """Bytes of K and V one row's attention reads from a cache [B, Hkv, S, hd] over its first `slots` slots."""
    return 2 * k_cache.shape[1] * slots * k_cache.shape[3] * k_cache.dtype.itemsize


def row_group(batch: int, row_bytes: int) -> int:
    """Rows per attention group: the largest divisor of `batch` whose rows read at most `ROW_GROUP_BYTES` of
    K/V (at least 1) on a CPU; the whole batch when it fits, off a CPU, or under a mesh of several devices
    (where the rows are split over devices and a loop over them would gather them)."""
    current = active()
    if (batch * row_bytes <= ROW_GROUP_BYTES or jax.default_backend() != "cpu"
            or (current is not None and mesh_size(current[0]) > 1)):
        return batch
    return max((g for g in range(1, batch + 1) if batch % g == 0 and g * row_bytes <= ROW_GROUP_BYTES), default=1)


def _by_row_groups(attend_rows, row_bytes: int, *rows):
    """attend_rows(*rows) for arrays with the B rows leading (None passes through) -> [B, ...], computed group
    by group (`row_group`) in a loop."""
    B = rows[0].shape[0]
    g = row_group(B, row_bytes)
    if g == B:
        return attend_rows(*rows)
    grouped = [None if x is None else x.reshape(B // g, g, *x.shape[1:]) for x in rows]
    out = jax.lax.map(lambda xs: attend_rows(*xs), grouped)  # [B/g, g, ...]
    return out.reshape(B, *out.shape[2:])


def _attention_in_cache(q, k_cache, v_cache, lengths, tree_mask, cfg: ModelConfig, cached_slots: int | None,
                        window=None):
    """q [B,T,H,hd] against the committed prefix and the T new tokens (already written at slots lengths i32[B]
    onwards; causal among themselves, or as `tree_mask` bool[B,T,T] says) -> [B,T,H,hd]. `window`: None, or
    (positions i32[B,T], W) as in `visibility_mask`.

    Only the slots the rows use are read: the first `cached_slots` + T when the caller bounds every row's length
    statically (0 for a prefill), else the cache's blocks up to the longest row and its new tokens
    (`_cache_blocks`). A step's attention then costs what the rows hold, not what the cache could hold; reading
    the updated buffer in place also leaves XLA free to update the cache in place.
    """
    T = q.shape[1]
    S = k_cache.shape[2]
    Hkv, G = cfg.num_kv_heads, cfg.q_per_kv

    positions, W = (None, None) if window is None else window

    if cached_slots is not None:
        slots = min(S, cached_slots + T)

        def attend_prefix(q, k_cache, v_cache, lengths, tree_mask, positions):  # any b of the B rows
            block = _query_block(T)
            if tree_mask is not None or T <= block:
                visible = visibility_mask(lengths, T, slots, tree_mask, positions, W)  # bool[b, T, slots]
                return _xla_attention(q, k_cache[:, :, :slots], v_cache[:, :, :slots], visible, cfg)
            # Causal: the queries in blocks, each against the slots up to its last query's, not all `slots`.
            out = []
            for start in range(0, T, block):
                stop = min(T, start + block)
                seen = min(S, cached_slots + stop)
                at = None if positions is None else positions[:, start:stop]
                visible = visibility_mask(lengths + start, stop - start, seen, None, at, W)  # bool[b, n, seen]
                out.append(_xla_attention(q[:, start:stop], k_cache[:, :, :seen], v_cache[:, :, :seen], visible,
                                          cfg))
            return jnp.concatenate(out, axis=1)  # [b, T, H, hd]

        return _by_row_groups(attend_prefix, kv_row_bytes(k_cache, slots), q, k_cache, v_cache, lengths,
                              tree_mask, positions)

    def attend_rows(q, k_cache, v_cache, lengths, tree_mask, positions):  # any b of the B rows
        def visible(slots):  # bool[b, T, block]
            return visibility_mask(lengths, T, slots, tree_mask, positions, W)

        _, z, acc = _cache_blocks(_query_blocks(q, Hkv, G), k_cache, v_cache, jnp.max(lengths) + T, visible, cfg)
        return _heads_back((acc / z).astype(v_cache.dtype), T)

    return _by_row_groups(attend_rows, kv_row_bytes(k_cache, _read_block(S)), q, k_cache, v_cache, lengths,
                          tree_mask, positions)


# The gate activations of ACTIVATIONS: SwiGLU's, and GeGLU's tanh approximation (Gemma; transformers'
# "gelu_pytorch_tanh").
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated feed-forward block (fused gate/up projection): down(act(gate x) * up x), SwiGLU or GeGLU."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, matmul: MatmulImpl | None = None):
        dt = cfg.jnp_dtype
        self.gate_up = _dense_init(rngs, (2 * cfg.intermediate_size, cfg.hidden_size), dt)  # [2F, D]
        self.down = _dense_init(rngs, (cfg.hidden_size, cfg.intermediate_size), dt)  # [D, F]
        self.matmul = matmul or default_impl()
        self.blocks = 1  # static: gate_up rows stored as `blocks` [gate; up] blocks of F/blocks units (`set_blocks`)
        self.activation = cfg.hidden_act  # static

    def __call__(self, x):
        """x [B, T, D] -> [B, T, D]."""
        h = linear(x, self.gate_up[...], self.matmul)  # [B, T, 2F]
        h = h.reshape(*x.shape[:-1], self.blocks, 2, -1)  # block i: [gate; up] of its F/blocks hidden units
        gate = _ACTIVATIONS[self.activation](h[..., 0, :])
        hidden = (gate * h[..., 1, :]).reshape(*x.shape[:-1], -1)  # [B, T, F], canonical order
        return linear(constrain(hidden, "batch", None, "mlp"), self.down[...], self.matmul)


class MoE(nnx.Module):
    """A mixture of gated experts (Mixtral, Qwen3-MoE): a router scores E experts per token, the k best run, and
    their outputs are summed weighted by the router's softmax over the k (renormalised to sum to one, or, with
    `normalize_expert_weights` off, as they are).

    Two exact ways to run them, chosen statically by size: with few token-expert pairs (decoding a row or a few)
    each token gathers its k experts' weights, so a step reads k experts per token rather than all E; with more
    (prefill, wide verification, many rows) every expert runs on every token and the router's weights, zero outside
    the k, combine them. Gathering passes over N k experts' weights three times (read, written as the gathered copy,
    read by the product) where running all of them passes over E once, so it is chosen while 3 N k <= E.

    The experts' axis is the one tensor parallelism splits (`ShardingRules.experts`): each device holds E / n whole
    experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = cfg.jnp_dtype
        e, f, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
        self.router = _dense_init(rngs, (e, d), dt)  # [E, D]
        self.expert_gate_up = _dense_init(rngs, (e, 2 * f, d), dt)  # [E, 2F, D]: each expert's [gate; up] rows
        self.expert_down = _dense_init(rngs, (e, d, f), dt)  # [E, D, F]
        self.top_k = cfg.experts_per_token  # static
        self.normalize = cfg.normalize_expert_weights  # static
        self.activation = cfg.hidden_act  # static

    def route(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights f32[N, k], experts i32[N, k]) for token rows [N, D]: the k experts of highest router
        probability and their weights."""
        logits = jnp.dot(rows, self.router[...].T, preferred_element_type=jnp.float32)  # [N, E]
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def _gated(self, h: jax.Array) -> jax.Array:
        """act(gate) * up from [..., 2F] rows of [gate; up]."""
        gate, up = jnp.split(h, 2, axis=-1)
        return _ACTIVATIONS[self.activation](gate) * up

    def gathered(self, rows: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """[N, D] from token rows [N, D] and their routing (weights f32[N, k], experts i32[N, k]): each token's k
        experts' weights gathered and run on it alone."""
        gate_up = jnp.take(self.expert_gate_up[...], experts, axis=0)  # [N, k, 2F, D]
        h = self._gated(jnp.einsum("nd,nkfd->nkf", rows, gate_up))  # [N, k, F]
        down = jnp.take(self.expert_down[...], experts, axis=0)  # [N, k, D, F]
        return jnp.einsum("nkf,nkdf,nk->nd", h, down, weights.astype(h.dtype))

    def dense(self, rows: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """As `gathered`, with every expert run on every token and combined by the routing weights, zero outside
        each token's k."""
        h = self._gated(jnp.einsum("nd,efd->nef", rows, self.expert_gate_up[...]))  # [N, E, F]
        combine = jnp.zeros((rows.shape[0], self.router.shape[0]), h.dtype)  # [N, E]
        combine = combine.at[jnp.arange(rows.shape[0])[:, None], experts].set(weights.astype(h.dtype))
        return jnp.einsum("nef,edf,ne->nd", h, self.expert_down[...], combine)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        rows = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, experts = self.route(rows)  # [N, k]
        few = 3 * rows.shape[0] * self.top_k <= self.router.shape[0]  # static: see the class's docstring
        out = (self.gathered if few else self.dense)(rows, weights, experts)
        return out.reshape(x.shape).astype(x.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: attention then MLP, each added to the residual stream. With Gemma's norms each
    block's output is normed too before it is added (4 norms)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, matmul: MatmulImpl | None = None):
        d = cfg.hidden_size
        self.input_norm = _norm(d, cfg)  # before attention
        self.attn = Attention(cfg, rngs, matmul)
        self.post_attention_norm = _norm(d, cfg)  # before the MLP (Gemma's `pre_feedforward_layernorm`)
        self.mlp = MoE(cfg, rngs) if cfg.num_experts else MLP(cfg, rngs, matmul)
        # Gemma: on the attention output (its `post_attention_layernorm`) and the MLP output.
        self.attn_output_norm = _norm(d, cfg) if cfg.gemma_norms else None
        self.mlp_output_norm = _norm(d, cfg) if cfg.gemma_norms else None

    def __call__(self, x, cos, sin, k_cache, v_cache, lengths, visible, attention_impl, tree_mask,
                 cached_slots=None, write_cache=True, layer=None, window=None, packing=None):
        """x [B, T, D] (or [1, N, D] packed, with `packing`) -> the block's output in x's layout and the caches
        (as `Attention` returns them)."""
        attn_out, k_cache, v_cache = self.attn(self.input_norm(x), cos, sin, k_cache, v_cache, lengths, visible,
                                               attention_impl, tree_mask, cached_slots, write_cache, layer, window,
                                               packing)
        if self.attn_output_norm is not None:
            attn_out = self.attn_output_norm(attn_out)
        x = x + attn_out  # [B, T, D]
        mlp_out = self.mlp(self.post_attention_norm(x))
        if self.mlp_output_norm is not None:
            mlp_out = self.mlp_output_norm(mlp_out)
        x = x + mlp_out
        return x, k_cache, v_cache


def visibility_mask(lengths: jax.Array, num_new: int, slots: int | jax.Array, tree_mask: jax.Array | None = None,
                    positions: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """bool[B, T, S]: may new token t of row b attend cache slot s? `slots`: the first S slots (an int S), or the
    slot indices i32[S] asked about.

    Slots below lengths[b] are the committed prefix (always visible); the T new tokens occupy slots
    lengths[b] .. lengths[b]+T-1 and see each other causally, or as `tree_mask` bool[B, T, T] says. With a sliding
    `window` and the new tokens' `positions` i32[B, T], a key is visible only when it is fewer than `window`
    positions behind the query (a committed slot s holds position s, new token j position positions[b, j]).
    """
    slots = jnp.arange(slots) if isinstance(slots, int) else slots
    rel = slots[None, :] - lengths[:, None]  # [B, S]: slot index among the new tokens
    prefix = (rel < 0)[:, None, :]
    is_new = ((rel >= 0) & (rel < num_new))[:, None, :]
    if tree_mask is None:
        among_new = rel[:, None, :] <= jnp.arange(num_new)[None, :, None]
    else:
        idx = jnp.broadcast_to(jnp.clip(rel, 0, num_new - 1)[:, None, :], (lengths.shape[0], num_new, slots.shape[0]))
        among_new = jnp.take_along_axis(tree_mask, idx, axis=2)
    visible = prefix | (is_new & among_new)
    if window is None:
        return visible
    new_at = jnp.take_along_axis(positions, jnp.clip(rel, 0, num_new - 1), axis=1)  # [B, S]
    key_position = jnp.where(rel < 0, slots[None, :], new_at)  # [B, S]
    return visible & _in_window(positions, key_position, window)


def _in_window(query_positions: jax.Array, key_positions: jax.Array, window: int) -> jax.Array:
    """bool[B, T, S]: is key s fewer than `window` positions behind query t? (transformers' sliding window rule,
    kv > q - window; causality is the caller's mask). query_positions i32[B, T], key_positions i32[B or 1, S]."""
    return key_positions[:, None, :] > query_positions[:, :, None] - window


class Llama(nnx.Module):
    """Decoder-only transformer. Parameters live in NNX state; jit over `nnx.split(model)`, never closure."""

    # A forward can leave the cache unwritten and return the new tokens' K/V instead (`write_cache=False`).
    defers_cache_writes = True
    # A prefill can run its token-wise work over the prompts packed end to end (`packing=`).
    packs_prefill = True

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmul: MatmulImpl | None = None,
                 layer_loop: LayerLoop | None = None):
        self.cfg = cfg
        dt = cfg.jnp_dtype
        self.matmul = matmul or default_impl()
        self.embed = _dense_init(rngs, (cfg.vocab_size, cfg.hidden_size), dt, scale=1.0)  # [V, D]
        # Static: "unroll" holds a list of layers, "scan" one DecoderLayer whose parameters are stacked [L, ...].
        self.layer_loop: LayerLoop = "unroll"
        self.layers = nnx.List([DecoderLayer(cfg, rngs, self.matmul) for _ in range(cfg.num_layers)])
        set_layer_loop(self, layer_loop or default_layer_loop())
        self.norm = _norm(cfg.hidden_size, cfg)
        # [D, V] even when tied: XLA:CPU runs x @ W faster than x @ E.T for this shape (docs/cpu-performance.md).
        self.lm_head = nnx.Param(self.embed[...].T if cfg.tie_word_embeddings
                                 else _dense_init(rngs, (cfg.hidden_size, cfg.vocab_size), dt)[...])

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache of `max_len` slots per row for `batch` rows, in the model's dtype."""
        cfg = self.cfg
        return KVCache.create(num_layers=cfg.num_layers, batch=batch, num_kv_heads=cfg.num_kv_heads,
                              max_len=max_len, head_dim=cfg.head_dim, dtype=cfg.jnp_dtype,
                              stacked=self.layer_loop == "scan")

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """[B, T, D] embeddings of tokens i32[B, T]; Gemma's scaled by sqrt(hidden_size) (in the model's dtype, as
        transformers rounds it)."""
        x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]
        if self.cfg.gemma_norms:
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        return x

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[..., V] from final normed hidden states [..., D], soft-capped where the config caps them."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        if self.cfg.tie_word_embeddings and uses_kernel(self.matmul, self.embed[...], rows.T):
            # The kernel reads the [V, D] table row-major, as its projections read their weights.
            out = linear(rows, self.embed[...], self.matmul)
        elif rows.shape[0] > 1 and self.cfg.tie_word_embeddings:
            # Several rows: E @ h^T over the [V, D] table runs faster on XLA:CPU than h @ W (docs/cpu-performance.md).
            out = jnp.dot(self.embed[...], rows.T, preferred_element_type=jnp.float32).T
        else:
            out = jnp.dot(rows, self.lm_head[...], preferred_element_type=jnp.float32)
        out = softcap(out, self.cfg.final_logit_softcapping)
        return out.reshape(hidden.shape[:-1] + (out.shape[-1],))

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]  new tokens
        positions: jax.Array,  # i32[B, T]  their rotary positions (lengths + t for a chain, + depth for a tree)
        cache: KVCache,
        *,
        tree_mask: jax.Array | None = None,  # bool[B, T, T]  among the new tokens; None = causal
        logits_at: jax.Array | None = None,  # i32[B, L]  compute logits only at these new-token indices
        compute_logits: bool = True,
        return_layers: tuple[int, ...] = (),  # decoder layers whose outputs to return (EAGLE-3 features)
        attention_impl: AttentionImpl = "xla",
        cached_slots: int | None = None,  # static bound on cache.lengths (0: an empty cache); None: any
        write_cache: bool = True,  # False: leave the cache as it is, return the new K/V (below)
        packing: Packing | None = None,  # a prefill's token-wise work over its prompts packed end to end (below)
    ) -> tuple[ModelOutput, KVCache]:
        """Returns the output and the cache with the new K/V written; `cache.lengths` is not advanced.

        `cached_slots=0` tells a prefill that the cache holds nothing yet: attention reads only the new tokens'
        slots. With None, each forward reads the cache's blocks up to its longest row (`_cache_blocks`).

        `write_cache=False` (with attention_impl "xla") writes nothing: attention reads the committed slots and
        the new tokens' K/V beside them, and the second value is a cache of T slots holding just those K/V
        (lengths 0), for the caller to write at `cache.lengths` (`jaxspec.cache.write_new`). A caller that
        picks one of several forward widths with `lax.switch` writes after the switch, where XLA updates the
        buffers in place; a branch that updates them makes XLA copy every buffer, whole, each step.

        `packing` (`jaxspec.models.packing.Packing`, for a prefill into an empty cache: `cached_slots=0`) runs the
        embeddings, norms, projections and MLPs over the prompts' tokens laid end to end, and attention over the
        padded rows as without it; the outputs are as without it (up to float summation order), in the padded
        layout, with zeros at padding positions and in the cache slots past each prompt."""
        if not write_cache and (attention_impl != "xla" or cached_slots is not None):
            raise ValueError(f"write_cache=False needs attention_impl='xla' and cached_slots=None, got "
                             f"{attention_impl!r} and {cached_slots!r}")
        if packing is not None and (cached_slots != 0 or tree_mask is not None):
            raise ValueError(f"packing is for a prefill into an empty cache (cached_slots=0, no tree_mask), got "
                             f"cached_slots={cached_slots!r}" + (" and a tree_mask" if tree_mask is not None else ""))
        # Packed, the token-wise work sees one row of N positions; attention sees `positions` [B, T] (windows).
        inputs = (tokens, positions) if packing is None else (packing.pack(tokens), packing.pack(positions))
        x = self.embed_tokens(inputs[0])  # [B, T, D], or [1, N, D] packed
        cfg = self.cfg
        ropes = dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers))  # in layer order, each once
        tables = {rope: rope_tables(inputs[1], rope, cfg.head_dim) for rope in ropes}  # (cos, sin) f32[B, T, hd]
        args = (cache.lengths, attention_impl, tree_mask, cached_slots, write_cache, packing)
        if self.layer_loop == "scan":
            x, ks, vs, outputs = self._scan_layers(x, positions, tables, cache, args, return_layers)
        else:
            x, ks, vs, outputs = self._unrolled_layers(x, positions, tables, cache, args, return_layers)
        hidden = self.norm(x)  # [B, T, D]
        if packing is not None:
            hidden, outputs = packing.unpack(hidden), [packing.unpack(o) for o in outputs]
        logits = None
        if compute_logits:
            picked = hidden if logits_at is None else jnp.take_along_axis(hidden, logits_at[..., None], axis=1)
            logits = self.logits(picked)
        new_cache = cache.replace(k=ks, v=vs)
        if not write_cache:  # ks, vs hold the new tokens' K/V [B, (L,) Hkv, T, hd] from slot 0
            new_cache = new_cache.replace(lengths=jnp.zeros_like(cache.lengths))
        return ModelOutput(logits=logits, hidden=hidden, layer_hidden=tuple(outputs)), new_cache

    def _unrolled_layers(self, x, positions, tables: dict, cache: KVCache, args: tuple,
                         return_layers: tuple[int, ...]):
        """The layers one after another in the trace, each with its own rotary tables (`tables`, by RopeConfig)
        and static window: (x, per-layer K and V buffers, requested layers' x)."""
        lengths, attention_impl, tree_mask, cached_slots, write_cache, packing = args
        cfg = self.cfg
        ks, vs, saved = list(cache.k), list(cache.v), []
        for i, layer in enumerate(self.layers):
            cos, sin = tables[cfg.layer_rope(i)]
            window = None if cfg.layer_window(i) is None else (positions, cfg.layer_window(i))
            x, ks[i], vs[i] = _traced_once(layer, (x, cos, sin, ks[i], vs[i], lengths, tree_mask, packing, window),
                                           (attention_impl, cached_slots, write_cache))
            if i in return_layers:
                saved.append(x)
        return x, tuple(ks), tuple(vs), saved

    def _scan_layers(self, x, positions, tables: dict, cache: KVCache, args: tuple,
                     return_layers: tuple[int, ...]):
        """The stacked layers as one `lax.scan`: (x, stacked K and V [B, L, Hkv, S or T, hd], requested layers'
        x). Writing, each layer updates its slice of the carried cache in place; deferring (write_cache=False)
        it only reads the cache and the new tokens' K/V leave the scan as its stacked output.

        Layers alike share one window and one pair of rotary tables. Where they mix (`layer_types`), each
        layer's window (full attention as FULL_WINDOW, which hides no key) is scanned beside its weights, and so,
        where the kinds rotate differently (Gemma 3), is which of the stacked tables it reads."""
        lengths, attention_impl, tree_mask, cached_slots, write_cache, packing = args
        cfg = self.cfg
        L = cfg.num_layers
        graphdef, stacked = nnx.split(self.layers)
        ropes = list(tables)
        per_layer = {}  # scanned beside the weights where layers differ
        if cfg.layer_types is not None:
            per_layer["window"] = jnp.asarray([cfg.layer_window(i) or FULL_WINDOW for i in range(L)], jnp.int32)
        if len(ropes) > 1:
            per_layer["rope"] = jnp.asarray([ropes.index(cfg.layer_rope(i)) for i in range(L)], jnp.int32)  # i32[L]
            cos_all = jnp.stack([tables[r][0] for r in ropes])  # [R, B, T, hd], R: the distinct rotary settings
            sin_all = jnp.stack([tables[r][1] for r in ropes])

        def body(carry, xs):
            x, k_cache, v_cache = carry
            params, i, per_layer = xs
            if "rope" in per_layer:
                cos, sin = cos_all[per_layer["rope"]], sin_all[per_layer["rope"]]  # [B, T, hd] each
            else:
                cos, sin = tables[ropes[0]]
            if "window" in per_layer:
                window = (positions, per_layer["window"])
            else:
                window = None if cfg.sliding_window is None else (positions, cfg.sliding_window)
            layer = nnx.merge(graphdef, params)
            x, k_out, v_out = layer(x, cos, sin, k_cache, v_cache, lengths, None, attention_impl, tree_mask,
                                    cached_slots, write_cache, layer=i, window=window, packing=packing)
            if write_cache:
                return (x, k_out, v_out), ((), x if return_layers else None)
            return (x, k_cache, v_cache), ((k_out, v_out), x if return_layers else None)  # new K/V [B, Hkv, T, hd]

        layers = jnp.arange(L, dtype=jnp.int32)
        (x, ks, vs), (new, outputs) = jax.lax.scan(body, (x, cache.k, cache.v), (stacked, layers, per_layer))
        if not write_cache:
            ks, vs = (a.swapaxes(0, 1) for a in new)  # [L, B, Hkv, T, hd] -> [B, L, Hkv, T, hd]
        saved = [outputs[i] for i in range(self.cfg.num_layers) if i in return_layers]
        return x, ks, vs, saved


def _traced_once(layer: DecoderLayer, inputs: tuple, settings: tuple):
    """`layer` over inputs (x, cos, sin, k_cache, v_cache, lengths, tree_mask, packing, window) with settings
    (attention_impl, cached_slots, write_cache), through one jitted function: layers of one structure, shapes and
    settings share a single trace, so an unrolled stack traces one layer rather than every one of them. Nested in
    the caller's jit it is inlined before XLA compiles, so the program is the same as tracing each layer; what it
    saves is Python tracing and lowering, seconds of a first call for each verify width."""
    graphdef, state = nnx.split(layer)
    *arrays, window = inputs
    positions, size = (None, None) if window is None else window
    # The mesh rules are read while tracing (`jaxspec.sharding.constrain`): part of the key, so a trace made
    # under one mesh is never reused under another.
    return _layer_jit(graphdef, state, (*arrays, positions), (*settings, size, active()))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _layer_jit(graphdef, state, inputs: tuple, settings: tuple):
    x, cos, sin, k_cache, v_cache, lengths, tree_mask, packing, positions = inputs
    attention_impl, cached_slots, write_cache, size, _ = settings
    window = None if size is None else (positions, size)
    # visible=None: the target's mask is built per cache block (`_attention_in_cache`).
    return nnx.merge(graphdef, state)(x, cos, sin, k_cache, v_cache, lengths, None, attention_impl, tree_mask,
                                      cached_slots, write_cache, window=window, packing=packing)


def default_layer_loop() -> LayerLoop:
    """$JAXSPEC_LAYER_LOOP ("scan" or "unroll") where set, else "unroll" on a CPU backend and "scan" elsewhere."""
    loop = os.environ.get(LAYER_LOOP_ENV, "")
    if loop:
        if loop not in ("scan", "unroll"):
            raise ValueError(f"${LAYER_LOOP_ENV}={loop!r} must be 'scan' or 'unroll'")
        return loop
    return "unroll" if jax.default_backend() == "cpu" else "scan"


def set_layer_loop(model: "Llama", loop: LayerLoop) -> None:
    """Run `model`'s layers as `loop`: "scan" stacks every layer parameter into one [L, ...] array (a single
    DecoderLayer holds them), "unroll" splits them back into one layer module each. The outputs are the same.

    Static module state, like `set_matmul`: split the model again (`nnx.split`) and jit over the new graphdef. A
    KV cache from `new_cache` before the change has the other layout.
    """
    if loop not in ("scan", "unroll"):
        raise ValueError(f"layer_loop={loop!r} must be 'scan' or 'unroll'")
    if loop == model.layer_loop:
        return
    if loop == "scan":
        graphdef, states = None, []
        for layer in model.layers:
            graphdef, state = nnx.split(layer)
            states.append(state)
        model.layers = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    else:
        graphdef, stacked = nnx.split(model.layers)
        model.layers = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], stacked))
                                 for i in range(model.cfg.num_layers)])
    model.layer_loop = loop


def set_matmul(module: nnx.Module, impl: MatmulImpl) -> None:
    """Switch every projection under `module` (a Llama, a layer, a head) to `impl`: "auto", "xla" or "ffi".

    The choice is static module state, part of the graphdef: split the module again (`nnx.split`) and jit over
    the new graphdef; functions already compiled keep the path they were traced with.
    """
    if impl not in ("auto", "xla", "ffi"):
        raise ValueError(f"impl={impl!r} must be 'auto', 'xla' or 'ffi'")
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, (Llama, Attention, MLP)):
            sub.matmul = impl


def interleave_blocks(w, parts: tuple[int, ...], blocks: int, inverse: bool = False):
    """Rows of w [sum(parts), ...] stored part after part -> `blocks` consecutive blocks, each holding 1/blocks of
    every part in order (and back with inverse=True). A numpy array stays on the host (a load lays out each
    tensor before it goes to its devices); a jax array is permuted where it lives."""
    xp = np if isinstance(w, np.ndarray) else jnp
    rest = w.shape[1:]
    if inverse:
        per_block = [p // blocks for p in parts]
        chunks = xp.split(w.reshape(blocks, sum(per_block), *rest), np.cumsum(per_block)[:-1].tolist(), axis=1)
        return xp.concatenate([c.reshape(-1, *rest) for c in chunks], axis=0)
    chunks = xp.split(w, np.cumsum(parts)[:-1].tolist(), axis=0)
    return xp.concatenate([c.reshape(blocks, -1, *rest) for c in chunks], axis=1).reshape(w.shape)


def _each_layer(fn, w: jax.Array, base_ndim: int) -> jax.Array:
    """fn(w) for one layer's parameter, vectorised over a scanned stack's leading [L] axis where w has one."""
    return jax.vmap(fn)(w) if w.ndim > base_ndim else fn(w)


def abstract_llama(config: ModelConfig, layer_loop: LayerLoop, heads: int = 1, mlp: int = 1) -> "Llama":
    """A Llama of `config` whose parameters are shapes only (`nnx.eval_shape`), for a loader to fill a tensor at a
    time where each one lives; its layers run as `layer_loop` and its fused projections are stored as `heads` and
    `mlp` per-device blocks (`set_blocks`), so the tensors given to it must already be laid out so."""
    module = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), layer_loop=layer_loop))
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Attention):
            node.blocks = heads
        elif isinstance(node, MLP):
            node.blocks = mlp
    return module


def set_blocks(module: nnx.Module, heads: int, mlp: int) -> None:
    """Store every fused projection under `module` (a Llama, a layer) as per-device blocks, permuting the weights
    in place: qkv as `heads` blocks of [q; k; v] (whole heads each), gate_up as `mlp` blocks of [gate; up].

    A tensor-parallel split of the rows over n devices then gives each device whole heads and matching gate and
    up units when n divides the block count (`jaxspec.sharding` sets blocks = n). Outputs are unchanged; 1 and 1
    is the layout models are built and loaded in. ValueError when a count does not divide the heads or units.
    """
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, Attention):
            cfg = sub.cfg
            if cfg.num_kv_heads % heads or cfg.num_heads % heads:
                raise ValueError(f"heads={heads} blocks must divide num_heads={cfg.num_heads} and "
                                 f"num_kv_heads={cfg.num_kv_heads}")
            parts = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
            for name in ("qkv", "qkv_bias"):
                param = getattr(sub, name)
                if param is not None:
                    def relaid(w, parts=parts, old=sub.blocks):
                        return interleave_blocks(interleave_blocks(w, parts, old, inverse=True), parts, heads)

                    param[...] = _each_layer(relaid, param[...], base_ndim=2 if name == "qkv" else 1)
            sub.blocks = heads
        elif isinstance(sub, MLP):
            units = sub.down.shape[-1]
            if units % mlp:
                raise ValueError(f"mlp={mlp} blocks must divide intermediate_size={units}")
            parts = (units, units)
            def relaid_mlp(w, parts=parts, old=sub.blocks):
                return interleave_blocks(interleave_blocks(w, parts, old, inverse=True), parts, mlp)

            sub.gate_up[...] = _each_layer(relaid_mlp, sub.gate_up[...], base_ndim=2)
            sub.blocks = mlp

