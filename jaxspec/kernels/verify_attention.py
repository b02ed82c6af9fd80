"""Verification attention: the T new tokens of each row against that row's KV cache.

Speculative decoding scores a chain of K+1 proposed tokens, or the N nodes of a draft tree, in
one forward pass of the target model.  At that point the new tokens' keys and values have
already been written to the cache at slots ``lengths[b] .. lengths[b] + T - 1``, so each query
needs the committed prefix ``[0, lengths[b])`` plus the subset of the new slots that its
``mask`` row (causal chain, or "is me or my ancestor" for a tree) allows.

:func:`verify_attention` is a Pallas kernel organised like the public Pallas ops
(``jax/experimental/pallas/ops/gpu``): one program per (row, KV head, query block), a
flash-style loop over KV blocks with an online softmax, and a pure-JAX
:func:`verify_attention_reference` with the same semantics to test it against.  The same code
runs under ``interpret=True`` (the only mode on CPU) and lowers to Triton on NVIDIA GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# The tree layout lives in jaxspec.tree; re-exported here, where the kernel's `parents=` argument uses it.
from ..tree import ancestor_mask

__all__ = [
    "BlockSizes",
    "ancestor_mask",
    "verify_attention",
    "verify_attention_reference",
]

# Finite rather than -inf so that a row with nothing allowed in a block never computes
# (-inf) - (-inf) = NaN in the running-max update; far below any real score.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Triton's tl.dot needs every matmul dimension to be at least 16, and every tensor a
# power-of-two size, so the query tile, the new-token mask and the KV block are padded to this.
_MIN_TILE = 16


def _matmul(a, b, *, trans_b: bool = False, precision=None):
    """f32-accumulating 2-D matmul as a bare dot_general, which both the interpreter and the
    Triton lowering accept (trans_b maps onto Triton's transposed operand, no copy)."""
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (and Triton launch knobs) of :func:`verify_attention`.

    Attributes:
      block_kv: cache slots per step of the online softmax.  A power of two >= 16 (the
        Triton matmul minimum).  Caches shorter than this are processed with a smaller block.
      block_q: rows of the [T * G, D] query tile (G = query heads per KV head) handled by
        one program, or None for the whole tile.  Splitting only pays off on a GPU, when
        T * G is large enough that one tile would spill registers or too few programs would
        run; a power of two >= 16.
      num_warps, num_stages: passed to Triton; None keeps Triton's defaults.  Ignored by the
        interpreter.
    """

    block_kv: int = 128
    block_q: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for name, minimum, power_of_two in (
            ("block_kv", _MIN_TILE, True),
            ("block_q", _MIN_TILE, True),
            ("num_warps", 1, True),
            ("num_stages", 1, False),
        ):
            value = getattr(self, name)
            if value is None and name != "block_kv":
                continue
            # bool is an int subclass; True as a block size is always a bug.
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BlockSizes.{name} must be an int, got {name}={value!r}")
            if value < minimum or (power_of_two and not _is_power_of_two(value)):
                kind = "a power of two" if power_of_two else "an int"
                raise ValueError(f"BlockSizes.{name}={value} must be {kind} >= {minimum}")


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------


def _new_token_mask(mask, parents, batch: int, num_new: int) -> jax.Array:
    """bool[B, T, T] from whichever of mask / parents / neither (a causal chain) was given."""
    if parents is not None:
        return ancestor_mask(parents)
    if mask is not None:
        return jnp.asarray(mask)
    causal = jnp.tril(jnp.ones((num_new, num_new), dtype=bool))
    return jnp.broadcast_to(causal, (batch, num_new, num_new))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check_inputs(q, k_cache, v_cache, lengths, mask, parents) -> tuple[int, ...]:
    """Raises ValueError naming the offending value; returns (B, T, Hq, Hkv, S, D)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            layout = "[B, T, Hq, D]" if name == "q" else "[B, Hkv, S, D]"
            raise ValueError(f"{name} must be rank 4 {layout}, got {name}.shape={x.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype=}, "
            f"{k_cache.dtype=}, {v_cache.dtype=}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a floating-point array, got {q.dtype=}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{k_cache.shape=} must equal {v_cache.shape=}")
    batch, num_new, num_q_heads, head_dim = q.shape
    cache_batch, num_kv_heads, num_slots, cache_head_dim = k_cache.shape
    if cache_batch != batch:
        raise ValueError(f"batch of q ({batch=}) must match the cache's ({cache_batch=})")
    if cache_head_dim != head_dim:
        raise ValueError(f"{head_dim=} of q must match the cache's {cache_head_dim=}")
    if num_new < 1:
        raise ValueError(f"q must hold at least one new token, got {num_new=}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    if num_new > num_slots:
        raise ValueError(f"{num_new=} new tokens do not fit in a cache of {num_slots=}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape [B]=({batch},), got {lengths.shape=}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array, got {lengths.dtype=}")
    if mask is not None and parents is not None:
        raise ValueError("give at most one of mask and parents, got both")
    if mask is not None:
        if mask.shape != (batch, num_new, num_new):
            raise ValueError(
                f"mask must have shape [B, T, T]=({batch}, {num_new}, {num_new}), "
                f"got {mask.shape=}"
            )
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask must be a bool array, got {mask.dtype=}")
    if parents is not None:
        if parents.shape != (batch, num_new):
            raise ValueError(
                f"parents must have shape [B, T]=({batch}, {num_new}), got {parents.shape=}"
            )
        if not jnp.issubdtype(parents.dtype, jnp.integer):
            raise ValueError(f"parents must be an integer array, got {parents.dtype=}")
    return batch, num_new, num_q_heads, num_kv_heads, num_slots, head_dim


def _as_array(x):
    return None if x is None else jnp.asarray(x)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------


def _verify_attention_kernel(
    lengths_ref,  # i32[]                 committed prefix length of this row
    q_ref,        # [block_q, D]          query rows r = t * G + g of this row and KV head
    k_ref,        # [S, D]                this row's and KV head's key cache
    v_ref,        # [S, D]                value cache, same layout
    mask_ref,     # f32[block_q, Tpad]    1.0 where query row r may attend new token j
    o_ref,        # [block_q, D]          output rows, same order as q_ref
    *,
    sm_scale: float,
    block_kv: int,
    num_new: int,
):
    block_q, head_dim = q_ref.shape
    num_slots = k_ref.shape[0]
    num_new_padded = mask_ref.shape[1]
    # f32 matmuls would otherwise run in TF32 on Triton; verification must reproduce what the
    # target model computes without speculation, so keep full input precision.
    precision = lax.Precision.HIGHEST

    length = lengths_ref[()]
    q = q_ref[...]
    new_mask = mask_ref[...]

    def body(i, carry, *, in_window: bool):
        acc, m_prev, l_prev = carry
        nominal = i * block_kv
        if in_window:
            # The last block may stick out of a cache whose size is not a multiple of
            # block_kv; slide it back inside (reads stay in bounds on the GPU) and drop the
            # slots it re-covers via `slot >= nominal` below.
            start = jnp.minimum(nominal, num_slots - block_kv)
        else:
            start = pl.multiple_of(nominal, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]  # [block_kv, D]
        v = v_ref[pl.ds(start, block_kv), :]  # [block_kv, D]
        s = _matmul(q, k, trans_b=True, precision=precision) * sm_scale  # f32[block_q, block_kv]

        if in_window:
            slot = start + jnp.arange(block_kv, dtype=jnp.int32)
            owned = (slot >= nominal) & (slot < length + num_new)  # real slots, counted once
            # Gather mask[r, slot - length] without a gather (which Triton cannot lower): a
            # one-hot [Tpad, block_kv] matmul picks the column; slots outside the window get an
            # all-zero one-hot column and so no grant.  0/1 values are exact even in TF32.
            rel = slot - length
            onehot = jnp.where(
                jnp.arange(num_new_padded, dtype=jnp.int32)[:, None] == rel[None, :], 1.0, 0.0
            ).astype(jnp.float32)
            granted = _matmul(new_mask, onehot) > 0.5  # bool[block_q, block_kv]
            allowed = owned[None, :] & ((slot < length)[None, :] | granted)
            # Select, not multiply: slots past length + T may hold NaN/inf garbage.
            s = jnp.where(allowed, s, _MASK_VALUE)
            # A zero probability times a NaN value is still NaN, so clear those value rows too.
            v = jnp.where(owned[:, None], v, jnp.zeros_like(v))

        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        if in_window:
            # A row with nothing allowed so far has m_next == _MASK_VALUE, where exp(0) = 1
            # would count masked slots; force them to zero.
            p = jnp.where(allowed, p, 0.0)
        l_next = correction * l_prev + jnp.sum(p, axis=-1)
        # Casting p to the cache dtype keeps the bf16 matmul on tensor cores; accumulation
        # stays f32.
        pv = _matmul(p.astype(v.dtype), v, precision=precision)
        acc_next = correction[:, None] * acc + pv
        return acc_next, m_next, l_next

    acc = jnp.zeros((block_q, head_dim), dtype=jnp.float32)
    m = jnp.full((block_q,), _MASK_VALUE, dtype=jnp.float32)
    l = jnp.zeros((block_q,), dtype=jnp.float32)

    # Blocks wholly inside the committed prefix need no masking at all; only the (at most
    # cdiv(T, block_kv) + 1) blocks that touch the new-token window pay for it, and the loop
    # stops there, so slots past length + T are never visited.
    num_prefix_blocks = lax.div(length, jnp.int32(block_kv))
    num_blocks = lax.div(length + jnp.int32(num_new + block_kv - 1), jnp.int32(block_kv))
    carry = lax.fori_loop(
        0, num_prefix_blocks, functools.partial(body, in_window=False), (acc, m, l)
    )
    acc, m, l = lax.fori_loop(
        num_prefix_blocks, num_blocks, functools.partial(body, in_window=True), carry
    )

    # Rows with no allowed slot at all (an all-False mask row at length 0, or padding rows)
    # return 0 rather than 0/0.
    l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def verify_attention(
    q: jax.Array,        # f32/bf16[B, T, Hq, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    lengths: jax.Array,  # i32[B]
    mask: jax.Array | None = None,  # bool[B, T, T]
    *,
    parents: jax.Array | None = None,  # i32[B, T]
    sm_scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
) -> jax.Array:  # [B, T, Hq, D], dtype of q
    """Attention of the T new tokens of each row against that row's KV cache.

    Query ``i`` of row ``b`` attends cache slot ``s`` iff ``s < lengths[b]`` (the committed
    prefix), or ``lengths[b] <= s < lengths[b] + T`` and ``mask[b, i, s - lengths[b]]``.
    Slots at or past ``lengths[b] + T`` are never read into the result and may hold garbage,
    including NaN.  Query head ``h`` reads KV head ``h // (Hq // Hkv)``.

    Args:
      q: f32/bf16[B, T, Hq, D]; queries of the new tokens, RoPE already applied.
      k_cache: [B, Hkv, S, D]; key cache with the new tokens' keys already written at slots
        ``lengths[b] .. lengths[b] + T - 1``.
      v_cache: [B, Hkv, S, D]; value cache, same layout and dtype.
      lengths: i32[B]; committed prefix length of each row, in [0, S - T].  Values outside
        that range are clipped into it (they cannot be checked under jit, and an unclipped
        value would read outside the cache on the GPU).
      mask: bool[B, T, T] or None; ``mask[b, i, j]``: new query i may attend new key j.  None
        means a causal chain (j <= i).
      parents: i32[B, T] or None; a draft tree instead of ``mask``: parent of node i among the
        new tokens, -1 for a root.  The mask is then :func:`ancestor_mask` (parents).
      sm_scale: softmax scale, default 1/sqrt(D).
      block_sizes: tile sizes, see :class:`BlockSizes`.
      interpret: run the kernel in the Pallas interpreter (required on CPU).

    Returns:
      [B, T, Hq, D] in the dtype of q.  A query with no allowed slot at all gets zeros.
    """
    q, k_cache, v_cache, lengths = map(jnp.asarray, (q, k_cache, v_cache, lengths))
    mask, parents = _as_array(mask), _as_array(parents)
    batch, num_new, num_q_heads, num_kv_heads, num_slots, head_dim = _check_inputs(
        q, k_cache, v_cache, lengths, mask, parents
    )
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {block_sizes=}")
    if not interpret and (head_dim < _MIN_TILE or not _is_power_of_two(head_dim)):
        # Triton tensors must have power-of-two sizes; padding D would copy the whole cache.
        raise ValueError(
            f"{head_dim=} must be a power of two >= {_MIN_TILE} for the compiled (Triton) "
            "kernel; interpret=True accepts any head_dim"
        )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    group = num_q_heads // num_kv_heads

    # One [T * G, D] tile per (row, KV head): all the query heads that share a KV head read
    # each K/V block once.  Rows are padded to a power of two (>= 16) for Triton.
    num_rows = num_new * group
    rows_padded = max(_MIN_TILE, _next_power_of_two(num_rows))
    block_q = rows_padded if block_sizes.block_q is None else min(block_sizes.block_q,
                                                                  rows_padded)
    q_tiles = q.reshape(batch, num_new, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_rows, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows_padded - num_rows), (0, 0)))

    # The new-token mask expanded to tile rows (row r is query r // G); padding rows and
    # columns are False, so padded rows only ever see the prefix and are dropped anyway.
    num_new_padded = max(_MIN_TILE, _next_power_of_two(num_new))
    new_mask = _new_token_mask(mask, parents, batch, num_new)
    row_mask = jnp.repeat(new_mask, group, axis=1).astype(jnp.float32)  # f32[B, T*G, T]
    row_mask = jnp.pad(
        row_mask, ((0, 0), (0, rows_padded - num_rows), (0, num_new_padded - num_new))
    )

    # A cache shorter than block_kv gets a smaller block, and is padded up to it when its
    # size is not a power of two: a copy, but only of a cache under block_kv slots.
    block_kv = min(block_sizes.block_kv, max(_MIN_TILE, _next_power_of_two(num_slots)))
    if num_slots < block_kv:
        pad = ((0, 0), (0, 0), (0, block_kv - num_slots), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    padded_slots = k_cache.shape[2]

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, num_slots - num_new)

    kernel = functools.partial(
        _verify_attention_kernel, sm_scale=float(sm_scale), block_kv=block_kv, num_new=num_new
    )
    grid = (batch, num_kv_heads, rows_padded // block_q)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, r: (b,)),
            pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, r: (b, h, r, 0)),
            pl.BlockSpec((None, None, padded_slots, head_dim), lambda b, h, r: (b, h, 0, 0)),
            pl.BlockSpec((None, None, padded_slots, head_dim), lambda b, h, r: (b, h, 0, 0)),
            pl.BlockSpec((None, block_q, num_new_padded), lambda b, h, r: (b, r, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, r: (b, h, r, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows_padded, head_dim), q.dtype),
        # Explicit Triton params: with none, jax >= 0.10 lowers pallas_call on CUDA through
        # Mosaic GPU, which would try to stage the whole [S, D] cache block in shared memory.
        compiler_params=pltriton.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="verify_attention",
    )(lengths, q_tiles, k_cache, v_cache, row_mask)

    out = out[:, :, :num_rows].reshape(batch, num_kv_heads, num_new, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_new, num_q_heads, head_dim)


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def verify_attention_reference(
    q: jax.Array,        # f32/bf16[B, T, Hq, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    lengths: jax.Array,  # i32[B]
    mask: jax.Array | None = None,  # bool[B, T, T]
    *,
    parents: jax.Array | None = None,  # i32[B, T]
    sm_scale: float | None = None,
) -> jax.Array:  # [B, T, Hq, D], dtype of q
    """Pure-JAX :func:`verify_attention`: materialises the [B, Hq, T, S] scores in f32.

    Same semantics, clipping of ``lengths`` and zeros for a query with no allowed slot.
    """
    q, k_cache, v_cache, lengths = map(jnp.asarray, (q, k_cache, v_cache, lengths))
    mask, parents = _as_array(mask), _as_array(parents)
    batch, num_new, num_q_heads, num_kv_heads, num_slots, head_dim = _check_inputs(
        q, k_cache, v_cache, lengths, mask, parents
    )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    group = num_q_heads // num_kv_heads
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, num_slots - num_new)
    new_mask = _new_token_mask(mask, parents, batch, num_new)  # bool[B, T, T]

    slot = jnp.arange(num_slots)[None, :]  # [1, S]
    rel = slot - lengths[:, None]  # i32[B, S]; index among the new tokens
    in_window = (rel >= 0) & (rel < num_new)
    gathered = jnp.take_along_axis(
        new_mask, jnp.broadcast_to(jnp.clip(rel, 0, num_new - 1)[:, None, :],
                                   (batch, num_new, num_slots)), axis=2
    )  # bool[B, T, S]
    allowed = (rel < 0)[:, None, :] | (in_window[:, None, :] & gathered)  # bool[B, T, S]

    qg = q.astype(jnp.float32).reshape(batch, num_new, num_kv_heads, group, head_dim)
    k = k_cache.astype(jnp.float32)
    # Slots past length + T may hold NaN; 0 * NaN is NaN, so clear them on the value side.
    used = (rel < num_new)[:, None, :, None]  # [B, 1, S, 1]
    v = jnp.where(used, v_cache.astype(jnp.float32), 0.0)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision=lax.Precision.HIGHEST)
    scores = scores * sm_scale
    allowed = allowed[:, None, None]  # [B, 1, 1, T, S]
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksd->btkgd", p, v, precision=lax.Precision.HIGHEST)
    out = out / jnp.where(denom == 0.0, 1.0, denom).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, num_new, num_q_heads, head_dim).astype(q.dtype)
