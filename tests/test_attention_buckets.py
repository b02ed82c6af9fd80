"""Length-aware attention: a forward reads only the cache blocks its rows use, with the same result.

The target's attention reads the cache a block of slots at a time (`READ_BLOCK`), as many blocks as hold the
longest row's committed tokens and its new ones, and merges the blocks' softmax statistics. Rows of different
lengths, chains and trees must give what a read of the whole cache gives (up to float summation order), and the
decode loop must update the cache in place (no copy of a whole layer's buffer per step), which is what makes a
step's cost follow the tokens used rather than the cache size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from contracts import whole_copies
from jaxspec import SamplingParams
from jaxspec.cache import write_new
from jaxspec.decode import NoProposer, PrefillSpec, StepSpec, decode, prefill
from jaxspec.models import llama
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import Llama, row_group
from jaxspec.proposers.base import Context, Draft
from jaxspec.proposers.ngram import NgramProposer
from jaxspec.state import RowLimits, RowParams
from jaxspec.tree import tree_ancestor_mask

CFG = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=2048)
S = 1024


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(1))


def test_write_new_drops_tokens_past_the_last_slot():
    """New token t of row b lands at slot start[b] + t where it exists; past the end it is dropped and every
    other slot keeps its value (a clamped write would move the window back over committed slots)."""
    rng = np.random.default_rng(2)
    slots, t = 16, 5
    buffer = rng.standard_normal((5, 2, slots, 3)).astype(np.float32)
    new = rng.standard_normal((5, 2, t, 3)).astype(np.float32)
    start = np.asarray([0, 7, slots - t, slots - 2, slots], np.int32)  # inside, at the end, 3 and all 5 past it
    want = buffer.copy()
    for b in range(5):
        for i in range(t):
            if start[b] + i < slots:
                want[b, :, start[b] + i] = new[b, :, i]
    got = jax.jit(write_new)(jnp.asarray(buffer), jnp.asarray(new), jnp.asarray(start))
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="17 new tokens cannot be written into a cache of 16 slots"):
        write_new(jnp.asarray(buffer), jnp.zeros((5, 2, 17, 3)), jnp.asarray(start))


def _filled_cache(model, lengths: list[int], slots: int = S):
    """A cache of `slots` slots whose rows hold `lengths` random tokens (written by a prefill forward)."""
    rng = np.random.default_rng(0)
    width = max(lengths)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (len(lengths), width)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
    _, cache = jax.jit(lambda t, p, c: model(t, p, c, compute_logits=False, cached_slots=0))(
        tokens, positions, model.new_cache(len(lengths), slots))
    return cache.advance(jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("lengths", [[100, 600], [10, 20], [700, 1000]])
@pytest.mark.parametrize("tree", [False, True])
def test_block_read_equals_whole_cache_read(model, lengths, tree):
    """Rows of different lengths (and a batch within the first block, and one that needs the whole cache) give
    the logits and cache of a forward that reads all S slots."""
    cache = _filled_cache(model, lengths)
    batch, t = len(lengths), 4
    new = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (batch, t)), jnp.int32)
    if tree:  # root, two children of the root, a grandchild under the second child
        parents = jnp.broadcast_to(jnp.asarray([0, 0, 2], jnp.int32), (batch, t - 1))
        mask = tree_ancestor_mask(parents)
        depth = jnp.asarray([0, 1, 1, 2], jnp.int32)
    else:
        mask, depth = None, jnp.arange(t, dtype=jnp.int32)
    positions = cache.lengths[:, None] + depth

    def forward(cached_slots):
        return jax.jit(lambda c: model(new, positions, c, tree_mask=mask, cached_slots=cached_slots))(cache)

    out, got_cache = forward(None)
    ref, ref_cache = forward(S)  # a static bound of S: every slot is read
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    # The new tokens' K/V past layer 0 come from attention outputs summed over fewer slots, so they may differ in
    # the last bit (seen: 3e-8); a misplaced or missing write would differ by the values themselves.
    for a, b in zip(got_cache.k + got_cache.v, ref_cache.k + ref_cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_a_cache_of_no_whole_number_of_blocks_reads_its_last_slots_once(model):
    """A cache of 200 slots is read as slots 0-127 and 72-199, the second skipping the slots the first read: the
    logits of rows that end in the last block equal those of a whole-cache read."""
    lengths = [150, 190, 3]
    cache = _filled_cache(model, lengths, slots=200)
    new = jnp.asarray(np.random.default_rng(5).integers(0, CFG.vocab_size, (3, 4)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(4, dtype=jnp.int32)
    want, _ = jax.jit(lambda c: model(new, positions, c, cached_slots=200))(cache)
    for write in (True, False):
        got, _ = jax.jit(functools.partial(model, new, positions, write_cache=write))(cache)
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("cached", [0, 40])
def test_queries_in_blocks_equal_one_block(monkeypatch, window, cached):
    """A forward of 300 new tokens attends with its queries in 3 blocks of 128, 128 and 44, each against the slots
    up to its own last query (after a prefix of up to `cached` slots, and within a sliding window): the same
    logits and cache as the queries in one block."""
    cfg = CFG if window is None else dataclasses.replace(CFG, sliding_window=window)
    module = Llama(cfg, rngs=nnx.Rngs(4))
    assert llama._query_block(300) == 128 and llama._query_block(1024) == 256 and llama._query_block(100) == 128
    lengths = [cached, cached // 2]
    cache = _filled_cache(module, [max(n, 1) for n in lengths], slots=512).replace(
        lengths=jnp.asarray(lengths, jnp.int32))
    new = jnp.asarray(np.random.default_rng(6).integers(0, CFG.vocab_size, (2, 300)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(300, dtype=jnp.int32)

    def forward():
        return jax.jit(lambda c: module(new, positions, c, cached_slots=cached))(cache)

    got, got_cache = forward()
    monkeypatch.setattr(llama, "QUERY_BLOCKS", 1)
    jax.clear_caches()  # the layer's trace is cached by its shapes and settings (`_traced_once`)
    want, want_cache = forward()
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=1e-5, atol=1e-5)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths", [[100, 600], [0, 20], [700, 1000]])
@pytest.mark.parametrize("tree", [False, True])
def test_forward_that_defers_its_writes_equals_one_that_writes(model, lengths, tree):
    """write_cache=False leaves the cache as it was and returns the new tokens' K/V from slot 0; written at the
    rows' lengths they give the cache, and the attention beside the cache the logits, of a forward that writes
    (rows in different buckets, an empty row, chains and trees)."""
    cache = _filled_cache(model, lengths) if max(lengths) else model.new_cache(len(lengths), S)
    batch, t = len(lengths), 5
    new = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (batch, t)), jnp.int32)
    if tree:  # root; two children of the root; a child of each
        mask = tree_ancestor_mask(jnp.broadcast_to(jnp.asarray([0, 0, 1, 2], jnp.int32), (batch, t - 1)))
        depth = jnp.asarray([0, 1, 1, 2, 2], jnp.int32)
    else:
        mask, depth = None, jnp.arange(t, dtype=jnp.int32)
    positions = cache.lengths[:, None] + depth
    out, written = jax.jit(lambda c: model(new, positions, c, tree_mask=mask))(cache)
    deferred, slots = jax.jit(lambda c: model(new, positions, c, tree_mask=mask, write_cache=False))(cache)
    np.testing.assert_allclose(np.asarray(deferred.logits), np.asarray(out.logits), rtol=1e-5, atol=1e-5)
    assert (np.asarray(slots.lengths) == 0).all()
    for a, b, old in zip(slots.k + slots.v, written.k + written.v, cache.k + cache.v):
        assert a.shape == (batch, CFG.num_kv_heads, t, CFG.head_dim)
        np.testing.assert_allclose(np.asarray(write_new(old, a, cache.lengths)), np.asarray(b), rtol=1e-6,
                                   atol=1e-6)
    with pytest.raises(ValueError, match="write_cache=False needs attention_impl='xla'"):
        model(new, positions, cache, write_cache=False, cached_slots=0)


def test_incremental_decode_equals_one_forward(model):
    """Teacher forcing across a bucket boundary: logits of tokens fed ten at a time past slot 256 equal the
    logits of one forward over the whole sequence."""
    seq = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (1, 300)), jnp.int32)
    positions = jnp.arange(300, dtype=jnp.int32)[None]
    full, _ = jax.jit(lambda: model(seq, positions, model.new_cache(1, S), cached_slots=0))()
    _, cache = jax.jit(lambda: model(seq[:, :250], positions[:, :250], model.new_cache(1, S),
                                     compute_logits=False, cached_slots=0))()
    cache = cache.advance(jnp.asarray([250], jnp.int32))
    step = jax.jit(lambda tok, pos, c: model(tok, pos, c))
    for i in range(250, 300, 10):
        out, cache = step(seq[:, i:i + 10], positions[:, i:i + 10], cache)
        cache = cache.advance(jnp.asarray([10], jnp.int32))
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(full.logits[:, i:i + 10]), rtol=2e-4,
                                   atol=2e-4)


@dataclasses.dataclass(frozen=True)
class _StaticTree(NoProposer):
    """Drafts the same 4-node tree every step (root; two children; a grandchild under each): a tree proposer
    for compiling the tree verification path (max_depth 4 bounds its depth of 2)."""

    num_speculative_tokens: int = 4

    def propose(self, params, pstate, ctx: Context, keys):
        batch = ctx.history.shape[0]
        tokens = jnp.broadcast_to(jnp.asarray([1, 2, 3, 4], jnp.int32), (batch, 4))
        parents = jnp.broadcast_to(jnp.asarray([0, 0, 1, 2], jnp.int32), (batch, 4))
        return Draft(tokens=tokens, num_draft=jnp.full((batch,), 4, jnp.int32), parents=parents), pstate


@pytest.fixture
def small_row_groups(monkeypatch):
    """Attention in groups of rows whose K/V read is at most 2 rows' worth of a cache block (`row_group`). Traces
    are dropped around it, so no forward traced with the usual groups is reused."""
    jax.clear_caches()
    monkeypatch.setattr(llama, "ROW_GROUP_BYTES", 2 * 2 * CFG.num_kv_heads * llama.READ_BLOCK * CFG.head_dim * 4)
    yield
    jax.clear_caches()


# Row groups are XLA:CPU's remedy for a slow scores dot; off a CPU every row attends in one group.
on_cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="attention in row groups runs on a CPU only")


@on_cpu_only
def test_row_group():
    """Rows per attention group: the largest divisor of the batch within the byte budget, the whole batch when it
    fits, one row when even one is over."""
    budget = llama.ROW_GROUP_BYTES
    assert row_group(128, budget // 4) == 4
    assert row_group(96, budget // 5) == 4  # 5 is not a divisor of 96
    assert row_group(7, budget // 3) == 1  # 7 is prime
    assert row_group(8, budget // 8) == 8  # fits whole
    assert row_group(3, 2 * budget) == 1


def test_row_group_is_the_whole_batch_off_a_cpu(monkeypatch):
    """Off a CPU one group holds every row, however much K/V they read."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert row_group(128, llama.ROW_GROUP_BYTES) == 128


@on_cpu_only
@pytest.mark.parametrize("lengths", [[100, 600, 30, 300, 0, 450], [700, 1000, 10, 900]])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_in_row_groups_equals_one_group(model, lengths, tree, small_row_groups):
    """On a CPU, many rows attend group by group (a loop over `row_group` rows): the logits, the written cache
    and the deferred K/V equal those of one group of every row, for chains and trees in every bucket."""
    batch, t = len(lengths), 4
    cache = _filled_cache(model, lengths)
    new = jnp.asarray(np.random.default_rng(4).integers(0, CFG.vocab_size, (batch, t)), jnp.int32)
    if tree:
        mask = tree_ancestor_mask(jnp.broadcast_to(jnp.asarray([0, 0, 2], jnp.int32), (batch, t - 1)))
        depth = jnp.asarray([0, 1, 1, 2], jnp.int32)
    else:
        mask, depth = None, jnp.arange(t, dtype=jnp.int32)
    positions = cache.lengths[:, None] + depth
    assert row_group(batch, llama.kv_row_bytes(cache.k[0], llama.READ_BLOCK)) == 2  # so the rows go in groups

    def forward(**kw):
        compiled = jax.jit(lambda c: model(new, positions, c, tree_mask=mask, **kw)).lower(cache).compile()
        return compiled(cache), compiled.as_text()

    results = {}
    for write in (True, False):
        (grouped, grouped_cache), hlo = forward(write_cache=write)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(llama, "ROW_GROUP_BYTES", 1 << 40)
            jax.clear_caches()
            (whole, whole_cache), whole_hlo = forward(write_cache=write)
        assert hlo.count(" while(") > whole_hlo.count(" while(")  # the groups' loop, around the blocks' loops
        np.testing.assert_allclose(np.asarray(grouped.logits), np.asarray(whole.logits), rtol=1e-5, atol=1e-5)
        for a, b in zip(grouped_cache.k + grouped_cache.v, whole_cache.k + whole_cache.v):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        results[write] = grouped.logits
    np.testing.assert_allclose(np.asarray(results[False]), np.asarray(results[True]), rtol=1e-5, atol=1e-5)


@pytest.mark.contract
@pytest.mark.parametrize("method", ["none", "ngram", "tree"])
@pytest.mark.parametrize("batch,groups", [(1, "usual"), (2, "usual"), (2, "small")])
def test_decode_loop_updates_the_cache_in_place(batch, method, groups, request):
    """The compiled decode loop copies no whole per-layer cache buffer: each step's K/V write is in place, also
    where a `lax.switch` picks among several verify widths (chain and tree): their forwards leave the cache
    unwritten and one write follows the switch (a branch that wrote would make XLA copy every buffer)."""
    if groups == "small":  # attention in groups of rows (`row_group`) is in place too
        request.getfixturevalue("small_row_groups")
    lm = jaxspec.LanguageModel.from_module(Llama(CFG, rngs=nnx.Rngs(0)), name="bucket-test")
    prompts = jnp.zeros((batch, 16), jnp.int32)
    rows = RowParams(sampling=SamplingParams().broadcast(batch),
                     limits=RowLimits(max_new_tokens=jnp.full((batch,), 8, jnp.int32),
                                      stop_ids=jnp.full((batch, 1), -1, jnp.int32)))
    proposer, widths = NoProposer(), (1,)
    if method == "ngram":
        proposer, widths = NgramProposer(num_speculative_tokens=8), (1, 5, 9)
    elif method == "tree":
        proposer, widths = _StaticTree(), (1, 3, 5)
    state = prefill(lm.graphdef, lm.params, prompts, jnp.full((batch,), 5, jnp.int32), rows,
                    spec=PrefillSpec(cache_len=S, buffer_len=16, proposer=proposer))
    hlo = decode.lower(lm.graphdef, lm.params, state, rows, step=StepSpec(proposer, widths)).compile().as_text()
    copies = whole_copies(hlo, f"f32[{batch},{CFG.num_kv_heads},{S},{CFG.head_dim}]")
    assert not copies, f"{len(copies)} copies of a whole cache buffer in the decode loop"
    # The loop still runs and commits tokens.
    out = decode(lm.graphdef, lm.params, state, rows, step=StepSpec(proposer, widths))
    assert int(out.history_len[0] - out.prompt_len[0]) == 8
