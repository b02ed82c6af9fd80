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
    "choose_num_splits",
    "compiled_supports",
    "fit_shared_memory",
    "shared_memory_estimate",
    "shared_memory_limit",
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


def compiled_supports(head_dim: int) -> bool:
    """Whether the compiled (Triton) kernel takes this head dim: a power of two >= 16.

    Padding D would copy the whole cache every call, so other head dims (8, 80, 96, ...) run only in the
    interpreter; a model given ``attention_impl="pallas"`` (a hint) uses XLA's attention for them instead.
    """
    return head_dim >= _MIN_TILE and _is_power_of_two(head_dim)


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
      num_splits: programs that share one (row, KV head, query block)'s cache, each taking a
        contiguous run of its KV blocks (split-KV, as in flash-decoding); their partial softmax
        sums are merged afterwards.  None picks enough to fill a GPU when B * Hkv is small
        (one split in the interpreter); 1 never splits.

    The compiled kernel treats ``block_kv`` and ``block_q`` as upper bounds: it halves them
    while its estimated shared memory would exceed what the GPU has (f32 inputs with many
    query rows need that; see :func:`fit_shared_memory`).
    """

    block_kv: int = 128
    block_q: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_splits: int | None = None

    def __post_init__(self):
        for name, minimum, power_of_two in (
            ("block_kv", _MIN_TILE, True),
            ("block_q", _MIN_TILE, True),
            ("num_warps", 1, True),
            ("num_stages", 1, False),
            ("num_splits", 1, False),
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
# launch shape: shared memory and split-KV
# --------------------------------------------------------------------------------------------

# Shared memory per thread block by CUDA compute capability (the opt-in maximum a kernel may use).
_SHARED_MEMORY_BY_CC = {(7, 0): 98304, (8, 0): 166912, (8, 7): 166912, (9, 0): 232448, (10, 0): 232448}
# Where the GPU is unknown (lowering without one) or not listed: the consumer Ampere/Ada figure.
_SHARED_MEMORY_DEFAULT = 101376
# Programs worth launching before splitting the cache stops paying: about two waves on 100-150 SMs.
_TARGET_PROGRAMS = 256
# Triton's pipelining depth when none is given (jax's Pallas-Triton lowering on CUDA).
_TRITON_DEFAULT_STAGES = 3


def shared_memory_limit() -> int:
    """Bytes of shared memory one program may use on the default GPU (a conservative default elsewhere)."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if not cc:
        return _SHARED_MEMORY_DEFAULT
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    return _SHARED_MEMORY_BY_CC.get((major, minor), _SHARED_MEMORY_DEFAULT)


def shared_memory_estimate(block_q: int, block_kv: int, head_dim: int, itemsize: int,
                           num_new_padded: int, num_stages: int) -> int:
    """Bytes of shared memory Triton allocates for one program, as measured on an H100.

    The pipelined K and V blocks (``num_stages`` copies each), the probabilities P [block_q, block_kv]
    staged for the P @ V matmul in the cache dtype, and the f32 new-token mask [block_q, Tpad]: f32
    inputs at T * G = 96 query rows (padded to 128), block_kv 128 and 3 stages asked Triton for
    279040 bytes, this formula's 278528 plus 512; bf16 at 256 rows fitted in 232448.
    """
    kv = 2 * num_stages * block_kv * head_dim * itemsize
    return kv + block_q * block_kv * itemsize + block_q * num_new_padded * 4


def fit_shared_memory(block_q: int, block_kv: int, head_dim: int, itemsize: int, num_new_padded: int,
                      num_stages: int, limit: int) -> tuple[int, int]:
    """(block_q, block_kv), each halved as needed (never below 16) so that the estimate fits in ``limit``.

    block_kv shrinks first, down to 64 (a longer loop of smaller blocks), then block_q down to 64 (more
    programs, each reading the cache again), then both down to 16.
    """
    def fits(q: int, kv: int) -> bool:
        return shared_memory_estimate(q, kv, head_dim, itemsize, num_new_padded, num_stages) <= limit

    for floor in (64, _MIN_TILE):
        while not fits(block_q, block_kv) and block_kv > floor:
            block_kv //= 2
        while not fits(block_q, block_kv) and block_q > floor:
            block_q //= 2
    return block_q, block_kv


def choose_num_splits(programs: int, num_blocks: int) -> int:
    """Splits of each cache so that about `_TARGET_PROGRAMS` programs run, each with >= 2 KV blocks."""
    if programs >= _TARGET_PROGRAMS or num_blocks < 4:
        return 1
    return max(1, min(-(-_TARGET_PROGRAMS // programs), num_blocks // 2))


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
    *out_refs,
    sm_scale: float,
    block_kv: int,
    num_new: int,
    cache_slots: int,
    blocks_per_split: int | None,
):
    # out_refs, unsplit (blocks_per_split None): o_ref [block_q, D], the output rows in q_ref's order.
    # Split: acc_ref f32[block_q, D], m_ref f32[block_q], l_ref f32[block_q]: this split's unnormalised
    # P @ V, running max and softmax denominator, merged across splits outside the kernel.
    block_q, head_dim = q_ref.shape
    num_slots = k_ref.shape[0]
    num_new_padded = mask_ref.shape[1]
    # f32 matmuls would otherwise run in TF32 on Triton; verification must reproduce what the
    # target model computes without speculation, so keep full input precision.
    precision = lax.Precision.HIGHEST

    length = lengths_ref[()]
    # The new tokens' slots end here: past the cache's last real slot (`cache_slots`; k_ref may be padded
    # beyond it) a new token has no K/V (`jaxspec.cache.write_new` dropped it), so no query sees it.
    end = jnp.minimum(length + num_new, cache_slots)
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
            owned = (slot >= nominal) & (slot < end)  # real slots, counted once
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
    num_blocks = lax.div(end + jnp.int32(block_kv - 1), jnp.int32(block_kv))
    if blocks_per_split is None:
        first, last = jnp.int32(0), num_blocks
    else:  # this program's run of blocks; a run past num_blocks is empty and leaves (0, MASK, 0)
        first = pl.program_id(3) * blocks_per_split
        last = jnp.minimum(first + blocks_per_split, num_blocks)
    carry = lax.fori_loop(
        first, jnp.minimum(last, num_prefix_blocks), functools.partial(body, in_window=False), (acc, m, l)
    )
    acc, m, l = lax.fori_loop(
        jnp.maximum(first, num_prefix_blocks), last, functools.partial(body, in_window=True), carry
    )

    if blocks_per_split is not None:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l
        return
    # Rows with no allowed slot at all (an all-False mask row at length 0, or padding rows)
    # return 0 rather than 0/0.
    (o_ref,) = out_refs
    l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _merge_splits(acc, m, l):
    """f32[B, Hkv, splits, R, D], f32[B, Hkv, splits, R] x 2 -> f32[B, Hkv, R, D]: the softmax over the whole
    cache from each split's partial sums (flash-decoding's reduction). A split that saw nothing has
    m = MASK and l = 0, so its weight underflows to 0 beside any split that saw a slot."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.exp(m - m_all)  # [B, Hkv, splits, R]
    denom = jnp.sum(weight * l, axis=2)
    out = jnp.sum(weight[..., None] * acc, axis=2)
    return out / jnp.where(denom == 0.0, 1.0, denom)[..., None]


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
    including NaN.  New tokens whose slot would lie past ``S - 1`` have none (their K/V were
    dropped): no query sees them.  Query head ``h`` reads KV head ``h // (Hq // Hkv)``.

    Args:
      q: f32/bf16[B, T, Hq, D]; queries of the new tokens, RoPE already applied.
      k_cache: [B, Hkv, S, D]; key cache with the new tokens' keys already written at slots
        ``lengths[b] .. min(lengths[b] + T, S) - 1``.
      v_cache: [B, Hkv, S, D]; value cache, same layout and dtype.
      lengths: i32[B]; committed prefix length of each row, in [0, S].  Values outside that
        range are clipped into it (they cannot be checked under jit, and an unclipped value
        would read outside the cache on the GPU).
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
    if not interpret and not compiled_supports(head_dim):
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
    block_q = rows_padded if block_sizes.block_q is None else min(block_sizes.block_q, rows_padded)
    num_new_padded = max(_MIN_TILE, _next_power_of_two(num_new))
    # A cache shorter than block_kv gets a smaller block (padded up to it below).
    block_kv = min(block_sizes.block_kv, max(_MIN_TILE, _next_power_of_two(num_slots)))
    if not interpret:
        # Triton fails at run time, not compile time, when a program asks for more shared memory than the
        # GPU has (f32 at T * G > 64 rows with the default 128-slot blocks, on an H100): shrink first.
        stages = block_sizes.num_stages or _TRITON_DEFAULT_STAGES
        block_q, block_kv = fit_shared_memory(block_q, block_kv, head_dim, q.dtype.itemsize, num_new_padded,
                                              stages, shared_memory_limit())

    q_tiles = q.reshape(batch, num_new, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_rows, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows_padded - num_rows), (0, 0)))

    # The new-token mask expanded to tile rows (row r is query r // G); padding rows and
    # columns are False, so padded rows only ever see the prefix and are dropped anyway.
    new_mask = _new_token_mask(mask, parents, batch, num_new)
    row_mask = jnp.repeat(new_mask, group, axis=1).astype(jnp.float32)  # f32[B, T*G, T]
    row_mask = jnp.pad(
        row_mask, ((0, 0), (0, rows_padded - num_rows), (0, num_new_padded - num_new))
    )

    # A cache shorter than block_kv is padded up to it when its size is not a power of two:
    # a copy, but only of a cache under block_kv slots.
    if num_slots < block_kv:
        pad = ((0, 0), (0, 0), (0, block_kv - num_slots), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    padded_slots = k_cache.shape[2]

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, num_slots)

    # Split-KV: with few rows and KV heads, one program per (row, KV head) leaves most of a GPU idle
    # while it walks a long cache alone; splitting the cache's blocks over more programs and merging
    # their softmax sums afterwards keeps it busy. The interpreter runs programs one by one: no gain.
    num_q_blocks = rows_padded // block_q
    max_blocks = -(-padded_slots // block_kv)
    num_splits = block_sizes.num_splits
    if num_splits is None:
        num_splits = 1 if interpret else choose_num_splits(batch * num_kv_heads * num_q_blocks, max_blocks)
    num_splits = min(num_splits, max_blocks)
    blocks_per_split = None if num_splits == 1 else -(-max_blocks // num_splits)

    kernel = functools.partial(
        _verify_attention_kernel, sm_scale=float(sm_scale), block_kv=block_kv, num_new=num_new,
        cache_slots=num_slots, blocks_per_split=blocks_per_split,
    )
    tile = (batch, num_kv_heads, rows_padded, head_dim)
    if blocks_per_split is None:
        out_shape = jax.ShapeDtypeStruct(tile, q.dtype)
        out_specs = pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, r, s: (b, h, r, 0))
    else:
        parts = (batch, num_kv_heads, num_splits, rows_padded)
        out_shape = (jax.ShapeDtypeStruct(parts + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(parts, jnp.float32), jax.ShapeDtypeStruct(parts, jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, block_q, head_dim), lambda b, h, r, s: (b, h, s, r, 0)),
                     pl.BlockSpec((None, None, None, block_q), lambda b, h, r, s: (b, h, s, r)),
                     pl.BlockSpec((None, None, None, block_q), lambda b, h, r, s: (b, h, s, r)))
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_q_blocks, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, r, s: (b,)),
            pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, r, s: (b, h, r, 0)),
            pl.BlockSpec((None, None, padded_slots, head_dim), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, padded_slots, head_dim), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, block_q, num_new_padded), lambda b, h, r, s: (b, r, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        # Explicit Triton params: with none, jax >= 0.10 lowers pallas_call on CUDA through
        # Mosaic GPU, which would try to stage the whole [S, D] cache block in shared memory.
        compiler_params=pltriton.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="verify_attention",
    )(lengths, q_tiles, k_cache, v_cache, row_mask)
    if blocks_per_split is not None:
        out = _merge_splits(*out).astype(q.dtype)  # [B, Hkv, rows_padded, D]

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
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, num_slots)
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
