"""Tests of jaxspec.kernels.verify_attention (Pallas: interpret mode on CPU, compiled through Triton on a GPU).

Shapes are tiny and shared between tests where possible: every distinct (shape, dtype,
static-argument) combination costs a few seconds of interpret-mode compilation, while new
values for the same shapes (lengths, masks, NaN poisoning) are free.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.verify_attention import (
    BlockSizes,
    ancestor_mask,
    choose_num_splits,
    fit_shared_memory,
    shared_memory_estimate,
    verify_attention,
    verify_attention_reference,
)

# Per-dtype tolerances against the f32 reference.  bf16 inputs lose precision in the output
# cast (2**-8 relative) and in the bf16 probabilities fed to the P @ V matmul.
TOLERANCES = {
    jnp.float32: dict(atol=1e-5, rtol=1e-5),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: type
    num_new: int  # T
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_slots: int  # S
    lengths: tuple[int, ...]  # one row per entry: B = len(lengths)
    tree: bool  # random draft tree via mask=; otherwise the causal chain via mask=None
    block_sizes: BlockSizes = BlockSizes(block_kv=16)
    sm_scale: float | None = None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


# Lengths in every case: 0, 1, exactly a block boundary, a window ending exactly on a block
# boundary, and the full cache (S - T), mixed within one batch.
CASES = [
    Case("f32-chain-gqa1-d64", jnp.float32, 5, 2, 2, 64, 64, (0, 1, 16, 27, 59), tree=False),
    Case("f32-tree-gqa3-d64", jnp.float32, 7, 6, 2, 64, 64, (0, 1, 16, 25, 57), tree=True),
    # S = 80 is not a multiple of block_kv = 32: the last block slides back inside the cache.
    Case("f32-chain-gqa4-d128-ragged-s", jnp.float32, 4, 8, 2, 128, 80, (0, 1, 32, 60, 76),
         tree=False, block_sizes=BlockSizes(block_kv=32)),
    Case("bf16-tree-gqa4-d64", jnp.bfloat16, 6, 4, 1, 64, 64, (0, 1, 16, 26, 58), tree=True),
    Case("bf16-chain-gqa3-d128", jnp.bfloat16, 5, 3, 1, 128, 64, (0, 1, 16, 27, 59),
         tree=False, sm_scale=0.05),
    # S = 40 is below the default block_kv = 128: the kernel uses one 64-slot block and pads.
    Case("bf16-tree-gqa1-d128-short-cache", jnp.bfloat16, 8, 2, 2, 128, 40, (0, 1, 16, 32),
         tree=True, block_sizes=BlockSizes()),
    # T * G = 21 rows pad to 32 and split into two 16-row query blocks over the grid.
    Case("f32-tree-gqa3-d64-block-q", jnp.float32, 7, 6, 2, 64, 64, (0, 1, 16, 25, 57),
         tree=True, block_sizes=BlockSizes(block_kv=16, block_q=16)),
    # Split-KV: 4 blocks over 3 splits of 2 blocks, so the last split is always empty, and rows whose
    # length ends inside the first split leave the second empty too.
    Case("f32-tree-gqa3-d64-split", jnp.float32, 7, 6, 2, 64, 64, (0, 1, 16, 25, 57),
         tree=True, block_sizes=BlockSizes(block_kv=16, num_splits=3)),
    Case("bf16-chain-gqa4-d128-split", jnp.bfloat16, 4, 8, 2, 128, 80, (0, 1, 32, 60, 76),
         tree=False, block_sizes=BlockSizes(block_kv=16, num_splits=2)),
    # The default model's heads (9 over 3) at a 31-node tree: 93 rows pad to 128, which in f32 with the
    # default blocks asked an H100 for more shared memory than it has until the blocks were fitted.
    Case("f32-tree-gqa3-d64-wide", jnp.float32, 31, 9, 3, 64, 256, (0, 100, 225),
         tree=True, block_sizes=BlockSizes()),
]
CASES_BY_NAME = {case.name: case for case in CASES}

# The interpreter is the only way to run a Pallas kernel on CPU; on a GPU the same tests check the compiled
# kernel (every case's head dim is a power of two, as Triton needs).
INTERPRET = jax.default_backend() != "gpu"


def random_parents(rng: np.random.Generator, batch: int, num_new: int) -> np.ndarray:
    """i32[B, T]: a random forest in topological order (parent < child), several roots."""
    parents = np.full((batch, num_new), -1, dtype=np.int32)
    for b in range(batch):
        for i in range(1, num_new):
            parents[b, i] = rng.integers(-1, i)  # -1 makes an extra root
    return parents


def make_inputs(case: Case, seed: int = 0, poison: float | None = np.nan):
    """q, k_cache, v_cache, lengths, mask for a case; unused slots filled with `poison`."""
    rng = np.random.default_rng(seed)
    batch = len(case.lengths)
    t, s, d = case.num_new, case.num_slots, case.head_dim
    q = rng.standard_normal((batch, t, case.num_q_heads, d)).astype(np.float32)
    k = rng.standard_normal((batch, case.num_kv_heads, s, d)).astype(np.float32)
    v = rng.standard_normal((batch, case.num_kv_heads, s, d)).astype(np.float32)
    lengths = np.asarray(case.lengths, dtype=np.int32)
    if poison is not None:
        for b, length in enumerate(lengths):
            k[b, :, length + t:] = poison
            v[b, :, length + t:] = poison
    mask = None
    if case.tree:
        mask = np.asarray(ancestor_mask(random_parents(rng, batch, t)))

    def cast(x):
        return jnp.asarray(x, dtype=case.dtype)

    return cast(q), cast(k), cast(v), jnp.asarray(lengths), mask


def run_kernel(case: Case, q, k, v, lengths, mask=None, **kwargs):
    return verify_attention(
        q, k, v, lengths, mask, sm_scale=case.sm_scale, block_sizes=case.block_sizes,
        interpret=INTERPRET, **kwargs,
    )


def run_reference(case: Case, q, k, v, lengths, mask=None, **kwargs):
    return verify_attention_reference(q, k, v, lengths, mask, sm_scale=case.sm_scale, **kwargs)


def assert_close(actual, expected, dtype):
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float32), np.asarray(expected, dtype=np.float32),
        **TOLERANCES[dtype],
    )


def naive_attention(q, k, v, lengths, new_mask, sm_scale) -> np.ndarray:
    """float64 softmax(Q K^T) V per row and head with the full [T, S] mask built by loops."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, num_new, num_q_heads, _ = q.shape
    num_kv_heads, num_slots = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for b in range(batch):
        full = np.zeros((num_new, num_slots), dtype=bool)
        for i in range(num_new):
            for s in range(num_slots):
                if s < lengths[b]:
                    full[i, s] = True
                elif s < lengths[b] + num_new:
                    full[i, s] = bool(new_mask[b, i, s - lengths[b]])
        for h in range(num_q_heads):
            kh = h // group
            scores = q[b, :, h] @ k[b, kh].T * sm_scale  # [T, S]
            scores = np.where(full, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[b, :, h] = p @ v[b, kh]
    return out


def brute_force_ancestors(parents: np.ndarray) -> np.ndarray:
    batch, num_new = parents.shape
    out = np.zeros((batch, num_new, num_new), dtype=bool)
    for b in range(batch):
        for i in range(num_new):
            node = i
            while 0 <= node < num_new:
                out[b, i, node] = True
                node = parents[b, node]
    return out


# --------------------------------------------------------------------------------------------
# kernel against reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(case):
    q, k, v, lengths, mask = make_inputs(case)
    out = run_kernel(case, q, k, v, lengths, mask)
    expected = run_reference(case, q, k, v, lengths, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(np.asarray(expected, dtype=np.float32)).all()
    assert_close(out, expected, case.dtype)


@pytest.mark.parametrize("name", ["f32-tree-gqa3-d64", "bf16-chain-gqa3-d128"])
def test_unused_slots_never_leak(name):
    """NaN or inf past lengths[b] + T changes nothing, bit for bit, in kernel and reference."""
    case = CASES_BY_NAME[name]
    clean = make_inputs(case, seed=1, poison=0.0)
    out_clean = run_kernel(case, *clean)
    ref_clean = run_reference(case, *clean)
    for poison in (np.nan, np.inf, -np.inf):
        q, k, v, lengths, mask = make_inputs(case, seed=1, poison=poison)
        out = run_kernel(case, q, k, v, lengths, mask)
        ref = run_reference(case, q, k, v, lengths, mask)
        assert np.isfinite(np.asarray(out, dtype=np.float32)).all(), poison
        assert np.isfinite(np.asarray(ref, dtype=np.float32)).all(), poison
        np.testing.assert_array_equal(np.asarray(out), np.asarray(out_clean))
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(ref_clean))
        assert_close(out, ref, case.dtype)


def test_parents_equals_ancestor_mask():
    case = CASES_BY_NAME["f32-tree-gqa3-d64"]
    q, k, v, lengths, _ = make_inputs(case, seed=2)
    parents = jnp.asarray(random_parents(np.random.default_rng(2), len(case.lengths),
                                         case.num_new))
    mask = ancestor_mask(parents)
    by_parents = run_kernel(case, q, k, v, lengths, parents=parents)
    by_mask = run_kernel(case, q, k, v, lengths, mask)
    np.testing.assert_array_equal(np.asarray(by_parents), np.asarray(by_mask))
    np.testing.assert_array_equal(
        np.asarray(run_reference(case, q, k, v, lengths, parents=parents)),
        np.asarray(run_reference(case, q, k, v, lengths, mask)),
    )
    assert_close(by_parents, run_reference(case, q, k, v, lengths, mask), case.dtype)


def test_out_of_range_lengths_are_clipped():
    case = CASES_BY_NAME["f32-chain-gqa1-d64"]
    s, t = case.num_slots, case.num_new
    q, k, v, _, _ = make_inputs(case, seed=3, poison=None)
    wild = jnp.asarray([-5, -1, s - t + 1, s + 1, 10 * s], dtype=jnp.int32)
    clipped = jnp.asarray([0, 0, s - t + 1, s, s], dtype=jnp.int32)
    out = run_kernel(case, q, k, v, wild)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run_kernel(case, q, k, v, clipped)))
    assert_close(out, run_reference(case, q, k, v, wild), case.dtype)


@pytest.mark.parametrize("name", ["f32-chain-gqa1-d64", "f32-tree-gqa3-d64"])
def test_new_tokens_past_the_cache_end_have_no_slot(name):
    """A row whose T new tokens run past slot S - 1 (drafts past a row's budget; `write_new` drops their K/V):
    every query whose own slot exists attends exactly as in a cache with room for all of them."""
    case = CASES_BY_NAME[name]
    s, t = case.num_slots, case.num_new
    q, k, v, _, mask = make_inputs(case, seed=5, poison=None)
    lengths = jnp.asarray([s - t + 1, s - 2, s - 1, s - t, s - t + 2], dtype=jnp.int32)
    # The same rows in a cache of S + T slots, the new tokens' K/V that did not fit written past slot S - 1
    # (and, where a row's window ends before the cache does, noise there: slots past a row's window are unread).
    rng = np.random.default_rng(6)
    extra = jnp.asarray(rng.standard_normal(k.shape[:2] + (t, k.shape[3])), k.dtype)
    roomy = [jnp.concatenate([c, extra], axis=2) for c in (k, v)]
    roomy_case = dataclasses.replace(case, num_slots=s + t)
    out = run_kernel(case, q, k, v, lengths, mask)
    want = run_kernel(roomy_case, q, *roomy, lengths, mask)
    assert_close(out, run_reference(case, q, k, v, lengths, mask), case.dtype)
    has_slot = np.asarray(lengths)[:, None] + np.arange(t)[None, :] < s  # bool[B, T]
    assert has_slot.any() and (~has_slot).any()
    np.testing.assert_allclose(np.asarray(out)[has_slot], np.asarray(want)[has_slot], **TOLERANCES[case.dtype])


def test_query_with_nothing_to_attend_gets_zeros():
    case = CASES_BY_NAME["f32-tree-gqa3-d64"]
    q, k, v, lengths, mask = make_inputs(case, seed=4)
    mask = mask.copy()
    mask[0, 2, :] = False  # row 0 has lengths 0: query 2 sees nothing at all
    mask[1, 3, :] = False  # row 1 has lengths 1: query 3 sees only the prefix
    out = run_kernel(case, q, k, v, lengths, mask)
    ref = run_reference(case, q, k, v, lengths, mask)
    assert_close(out, ref, case.dtype)
    np.testing.assert_array_equal(np.asarray(out[0, 2]), 0.0)
    # With only slot 0 visible the softmax is one-hot: the output is that value row.
    expected = np.repeat(np.asarray(v[1, :, 0]), case.group, axis=0)  # [Hq, D]
    np.testing.assert_allclose(np.asarray(out[1, 3]), expected, atol=1e-6)


# --------------------------------------------------------------------------------------------
# reference against numpy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["f32-chain-gqa4-d128-ragged-s", "f32-tree-gqa3-d64"])
def test_reference_matches_naive_numpy(name):
    case = CASES_BY_NAME[name]
    q, k, v, lengths, mask = make_inputs(case, seed=5, poison=None)
    new_mask = (np.tril(np.ones((case.num_new, case.num_new), dtype=bool))[None]
                .repeat(len(case.lengths), axis=0) if mask is None else mask)
    sm_scale = 1.0 / np.sqrt(case.head_dim)
    expected = naive_attention(q, k, v, np.asarray(lengths), new_mask, sm_scale)
    np.testing.assert_allclose(
        np.asarray(run_reference(case, q, k, v, lengths, mask)), expected, atol=1e-5, rtol=1e-5
    )


# --------------------------------------------------------------------------------------------
# ancestor_mask
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_new", [1, 2, 5, 8, 17])
def test_ancestor_mask_matches_brute_force(num_new):
    rng = np.random.default_rng(num_new)
    parents = random_parents(rng, 6, num_new)
    parents[0] = np.arange(num_new) - 1  # one deep chain: depth T - 1 needs every doubling round
    np.testing.assert_array_equal(np.asarray(ancestor_mask(parents)),
                                  brute_force_ancestors(parents))


def test_ancestor_mask_treats_out_of_range_parents_as_roots():
    parents = np.asarray([[-1, 0, -7, 99, 3]], dtype=np.int32)
    expected = brute_force_ancestors(np.where((parents >= 0) & (parents < 5), parents, -1))
    np.testing.assert_array_equal(np.asarray(ancestor_mask(parents)), expected)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _valid_args():
    b, t, hq, hkv, s, d = 2, 3, 4, 2, 16, 16
    return dict(
        q=jnp.zeros((b, t, hq, d), jnp.float32),
        k_cache=jnp.zeros((b, hkv, s, d), jnp.float32),
        v_cache=jnp.zeros((b, hkv, s, d), jnp.float32),
        lengths=jnp.zeros((b,), jnp.int32),
    )


INVALID = [
    ("heads", dict(q=jnp.zeros((2, 3, 3, 16))),
     "num_q_heads=3 must be divisible by num_kv_heads=2"),
    ("t-gt-s", dict(q=jnp.zeros((2, 17, 4, 16))), "num_new=17 new tokens do not fit in a cache of "
     "num_slots=16"),
    ("dtype", dict(k_cache=jnp.zeros((2, 2, 16, 16), jnp.bfloat16)),
     "k_cache.dtype=dtype(bfloat16)"),
    ("q-rank", dict(q=jnp.zeros((2, 3, 64))), "q.shape=(2, 3, 64)"),
    ("k-rank", dict(k_cache=jnp.zeros((2, 16, 16))), "k_cache.shape=(2, 16, 16)"),
    ("kv-shape", dict(v_cache=jnp.zeros((2, 2, 8, 16))), "v_cache.shape=(2, 2, 8, 16)"),
    ("batch", dict(k_cache=jnp.zeros((3, 2, 16, 16)), v_cache=jnp.zeros((3, 2, 16, 16))),
     "cache_batch=3"),
    ("head-dim", dict(k_cache=jnp.zeros((2, 2, 16, 8)), v_cache=jnp.zeros((2, 2, 16, 8))),
     "cache_head_dim=8"),
    ("lengths-shape", dict(lengths=jnp.zeros((3,), jnp.int32)), "lengths.shape=(3,)"),
    ("lengths-dtype", dict(lengths=jnp.zeros((2,), jnp.float32)), "lengths.dtype=dtype('float32')"),
    ("mask-shape", dict(mask=jnp.ones((2, 3, 4), bool)), "mask.shape=(2, 3, 4)"),
    ("mask-dtype", dict(mask=jnp.ones((2, 3, 3), jnp.int32)), "mask.dtype=dtype('int32')"),
    ("mask-and-parents",
     dict(mask=jnp.ones((2, 3, 3), bool), parents=jnp.zeros((2, 3), jnp.int32)),
     "mask and parents"),
    ("parents-shape", dict(parents=jnp.zeros((2, 4), jnp.int32)), "parents.shape=(2, 4)"),
    ("parents-dtype", dict(parents=jnp.zeros((2, 3), jnp.float32)),
     "parents.dtype=dtype('float32')"),
]


@pytest.mark.parametrize("fn", ["kernel", "reference"])
@pytest.mark.parametrize("overrides,message", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_inputs_raise(fn, overrides, message):
    args = _valid_args() | overrides
    with pytest.raises(ValueError) as info:
        if fn == "kernel":
            verify_attention(**args, interpret=True)
        else:
            verify_attention_reference(**args)
    assert message in str(info.value)


def test_shared_memory_fit():
    """The estimate reproduces what Triton asked an H100 for, and the fit shrinks only what does not fit."""
    h100 = 232448
    # f32, T * G = 96 rows padded to 128, Tpad 32, block_kv 128, 3 stages: Triton asked for 279040.
    assert shared_memory_estimate(128, 128, 64, 4, 32, 3) == 279040 - 512
    assert fit_shared_memory(128, 128, 64, 4, 32, 3, h100) == (128, 64)
    # bf16 at 256 rows (T = 64) ran with the default blocks: left alone.
    assert fit_shared_memory(256, 128, 64, 2, 64, 3, h100) == (256, 128)
    # Shrinks block_kv to 64 first, then block_q, then both to 16, and stops there.
    assert fit_shared_memory(512, 128, 128, 4, 64, 3, 160_000) == (64, 32)
    for limit in (60_000, 30_000, 1):
        q, kv = fit_shared_memory(512, 128, 128, 4, 64, 3, limit)
        assert q >= 16 and kv >= 16
        assert shared_memory_estimate(q, kv, 128, 4, 64, 3) <= limit or (q, kv) == (16, 16)


def test_split_count_fills_the_gpu_only_when_rows_are_few():
    assert choose_num_splits(programs=3, num_blocks=256) == 86  # B 1, 3 KV heads, a 32k cache
    assert choose_num_splits(programs=96, num_blocks=256) == 3
    assert choose_num_splits(programs=3, num_blocks=8) == 4  # at least 2 blocks per split
    assert choose_num_splits(programs=256, num_blocks=256) == 1
    assert choose_num_splits(programs=3, num_blocks=3) == 1


def test_compiled_kernel_requires_power_of_two_head_dim():
    args = _valid_args()
    args["q"] = jnp.zeros((2, 3, 4, 24))
    args["k_cache"] = args["v_cache"] = jnp.zeros((2, 2, 16, 24))
    with pytest.raises(ValueError, match="head_dim=24"):
        verify_attention(**args, interpret=False)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(block_kv=100), "block_kv=100"),
        (dict(block_kv=8), "block_kv=8"),
        (dict(block_kv=0), "block_kv=0"),
        (dict(block_kv=128.0), "128.0"),
        (dict(block_kv=True), "True"),
        (dict(block_q=24), "block_q=24"),
        (dict(num_warps=3), "num_warps=3"),
        (dict(num_stages=0), "num_stages=0"),
    ],
)
def test_block_sizes_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        BlockSizes(**kwargs)


def test_block_sizes_is_frozen_and_hashable():
    sizes = BlockSizes(block_kv=64, block_q=32, num_warps=8, num_stages=2)
    assert hash(sizes) == hash(BlockSizes(block_kv=64, block_q=32, num_warps=8, num_stages=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.block_kv = 32  # type: ignore[misc]
