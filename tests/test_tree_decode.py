"""Tree drafts in the decode loop and the trained-head proposers (Medusa, EAGLE chain, EAGLE-2 tree), on a
tiny random model.

An oracle tree proposer hides the true continuation among distractors at every level, so whole paths are
accepted and the K/V of the accepted path must be moved to contiguous slots correctly for later steps to
stay exact. Random (untrained) heads check that the head proposers are lossless whatever they draft.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.models.heads import Readout, eagle3_layers
from jaxspec.proposers.base import Committed, Context, Draft, Proposer
from jaxspec.proposers.eagle import EagleProposer
from jaxspec.shapes import bucket_shapes
from jaxspec.tree import TreeTopology

# Two candidates per level, four levels deep, plus a side branch: 9 nodes.
TOPOLOGY = TreeTopology.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0),
                                    (0, 0, 0, 1)])


@dataclasses.dataclass(frozen=True)
class OracleTreeProposer(Proposer):
    """Drafts a tree whose nodes are right or wrong by their rank: the true next tokens (params: the known
    continuation i32[B, R]) sit at rank `right_rank[depth - 1]`, a wrong token (+1 mod V) elsewhere."""

    num_speculative_tokens: int
    topology: TreeTopology
    right_rank: tuple[int, ...]
    vocab: int
    @property
    def max_depth(self) -> int:
        return self.topology.max_depth

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        depth = jnp.asarray(self.topology.depths)  # i32[K]
        rank = jnp.asarray(self.topology.child_rank)
        # A node is on the true path iff every node on its path has the right rank for its depth.
        on_path = np.ones(self.topology.num_nodes, bool)
        for i, (p, d, r) in enumerate(zip(self.topology.parents, self.topology.depths, self.topology.child_rank)):
            on_path[i] = (r == self.right_rank[d - 1]) and (p == 0 or on_path[p - 1])
        idx = jnp.minimum(ctx.history_len[:, None] - 1 + depth[None], params.shape[1] - 1)
        truth = jnp.take_along_axis(params, idx, axis=1)  # [B, K]
        tokens = jnp.where(jnp.asarray(on_path), truth, (truth + 1 + rank) % self.vocab)
        parents = jnp.broadcast_to(jnp.asarray(self.topology.parents, jnp.int32), tokens.shape)
        num = jnp.full(tokens.shape[:1], self.num_speculative_tokens, jnp.int32)
        return Draft(tokens=tokens.astype(jnp.int32), num_draft=num, parents=parents), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 97, size=n).tolist() for n in (6, 19, 11)]


@pytest.fixture(scope="module")
def plain(tiny_lm, prompts):
    return jaxspec.generate(tiny_lm, prompts, max_new_tokens=40)


def _known(prompts, plain, width):
    table = np.zeros((len(prompts), width), np.int32)
    for i, (p, out) in enumerate(zip(prompts, plain.token_ids)):
        row = p + out
        table[i, : len(row)] = row
    return jnp.asarray(table)


@pytest.mark.parametrize("right_rank", [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 1)])
def test_oracle_tree_greedy_equals_plain(tiny_lm, prompts, plain, right_rank):
    """Deep accepted paths through side branches: the compacted cache keeps every later step exact."""
    proposer = OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, right_rank, vocab=97)
    spec = SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, proposer=proposer,
                      proposer_params=_known(prompts, plain, 128))
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, spec=spec)
    assert out.token_ids == plain.token_ids
    # The true path is in the tree whenever it is reachable: right_rank (0, 0, 0, 0) reaches depth 4,
    # a path that leaves the deepest branch stops earlier.
    reach = {(0, 0, 0, 0): 4, (1, 0, 0, 0): 2, (0, 1, 0, 0): 2, (0, 0, 1, 1): 3}[right_rank]
    assert out.stats.mean_acceptance_length > 0.8 * (reach + 1)


def test_oracle_tree_budget_and_stops(tiny_lm, prompts, plain):
    """Token budgets and stop ids that fall inside an accepted path cut it exactly where plain decoding ends."""
    proposer = OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, (0, 0, 0, 0), vocab=97)
    spec = SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, proposer=proposer,
                      proposer_params=_known(prompts, plain, 128))
    stop = plain.token_ids[1][7]
    for kwargs in (dict(max_new_tokens=6), dict(max_new_tokens=40, stop_token_ids=[stop])):
        ref = jaxspec.generate(tiny_lm, prompts, **kwargs)
        assert jaxspec.generate(tiny_lm, prompts, spec=spec, **kwargs).token_ids == ref.token_ids


HEAD_SPECS = [
    dict(method="medusa", num_speculative_tokens=7),
    dict(method="eagle", num_speculative_tokens=4),
    dict(method="eagle", num_speculative_tokens=8, tree_depth=3, tree_top_k=3),
    dict(method="eagle2", num_speculative_tokens=9, tree_depth=4, tree_top_k=3),
    dict(method="eagle3", num_speculative_tokens=9, tree_depth=4, tree_top_k=3),
]


def _head_kind(method: str) -> str:
    """The kind of head file a method runs."""
    return method if method in ("medusa", "eagle3") else "eagle"


def _head_spec_id(d):
    return d["method"] + ("-static" if d["method"] == "eagle" and "tree_depth" in d else "")


@pytest.mark.parametrize("spec_kwargs", HEAD_SPECS, ids=_head_spec_id)
def test_head_proposers_greedy_equal_plain(tiny_lm, prompts, plain, head_files, spec_kwargs):
    kind = _head_kind(spec_kwargs["method"])
    spec = SpecConfig(head_path=str(head_files[kind]), **spec_kwargs)
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


def test_tree_logprobs_follow_the_accepted_path(tiny_lm, prompts):
    """Each committed token's log-probabilities come from its own path node's row of the tree forward: the
    oracle tree (the right token at rank 1 of depth 2: accepted paths run through side branches) records
    what plain decoding records."""
    ref = jaxspec.generate(tiny_lm, prompts, max_new_tokens=24, logprobs=3)
    proposer = OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, (0, 1, 0, 0), vocab=97)
    spec = SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, proposer=proposer,
                      proposer_params=_known(prompts, ref, 64))
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=24, logprobs=3, spec=spec)
    assert out.token_ids == ref.token_ids and out.stats.accepted > 0
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b], atol=2e-5)
        assert [[t for t, _ in e.top] for e in a] == [[t for t, _ in e.top] for e in b]


@pytest.mark.parametrize("spec_kwargs", HEAD_SPECS, ids=_head_spec_id)
def test_head_proposers_seeded_sampling(tiny_lm, prompts, head_files, spec_kwargs):
    """Trees of deterministic candidates follow plain sampling token for token (the point-mass rule); the
    EAGLE chain samples its drafts from q, so only its lengths and token range are checked here (its
    distribution is the chain sampler's, tested in test_rejection.py)."""
    kind = _head_kind(spec_kwargs["method"])
    sampling = [SamplingParams(temperature=0.9, top_k=20, seed=11), SamplingParams(),
                SamplingParams(temperature=1.3, top_p=0.8, seed=4)]
    ref = jaxspec.generate(tiny_lm, prompts, max_new_tokens=30, sampling=sampling)
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=30, sampling=sampling,
                           spec=SpecConfig(head_path=str(head_files[kind]), **spec_kwargs))
    if spec_kwargs["method"] == "eagle" and "tree_depth" not in spec_kwargs:
        assert out.token_ids[1] == ref.token_ids[1]  # the greedy row
        assert all(len(t) == 30 for t in out.token_ids)
    else:
        assert out.token_ids == ref.token_ids


def _draft(proposer, params, ctx, keys) -> Draft:
    """init then propose, jitted as the decode loop runs them (one compile, not one per eager op)."""
    run = jax.jit(lambda params, ctx, keys: proposer.propose(params, proposer.init(params, ctx), ctx, keys)[0])
    return run(params, ctx, keys)


def _eagle_params(tiny_lm, head_file):
    head, _ = jaxspec.models.heads.load_head(head_file, tiny_lm.config)
    graphdef, state = nnx.split(head)
    return graphdef, {"head": state, "readout": Readout.of(tiny_lm.params)}


def _prompt_ctx(tiny_lm, tokens, layers=()):
    """Context after a prefill of `tokens[:-1]` with `tokens[-1]` as the newest token (batch of 1); its
    features are the final hidden states, or with `layers` those layers' outputs side by side (EAGLE-3)."""
    module = tiny_lm.module
    prompt = jnp.asarray([tokens[:-1]], jnp.int32)
    cache = module.new_cache(1, 64)
    out, _ = module(prompt, jnp.arange(prompt.shape[1])[None], cache, compute_logits=False, return_layers=layers)
    features = jnp.concatenate(out.layer_hidden, axis=-1) if layers else out.hidden
    history = jnp.asarray([tokens + [0] * (64 - len(tokens))], jnp.int32)
    ctx = Context(history=history, history_len=jnp.asarray([len(tokens)]), max_draft=jnp.asarray([8]),
                  sampling=SamplingParams().broadcast(1), positions=jnp.asarray([len(tokens) - 1]),
                  features=features)
    return ctx, features


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_update_matches_a_fresh_prefill(tiny_lm, head_files, kind):
    """The head's state after reading committed tokens with the target's features equals a prefill of the
    longer prompt: the head cache stays in step with the target (EAGLE-3: features fused from layers)."""
    graphdef, params = _eagle_params(tiny_lm, head_files[kind])
    layers = eagle3_layers(tiny_lm.config.num_layers) if kind == "eagle3" else ()
    proposer = EagleProposer(4, graphdef, cache_len=64, feature_layers=layers)
    seq = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
    short_ctx, _ = _prompt_ctx(tiny_lm, seq[:6], layers)
    long_ctx, long_hidden = _prompt_ctx(tiny_lm, seq, layers)
    state = jax.jit(proposer.init)(params, short_ctx)
    # Committed: tokens seq[6:10] produced by the features at positions 5..8.
    committed = Committed(tokens=jnp.asarray([seq[6:10] + [-1]]), num=jnp.asarray([4]),
                          features=jnp.pad(long_hidden[:, 5:9], ((0, 0), (0, 1), (0, 0))))
    updated = jax.jit(proposer.update)(params, state, long_ctx, committed)
    fresh = jax.jit(proposer.init)(params, long_ctx)
    assert int(updated.cache.lengths[0]) == int(fresh.cache.lengths[0]) == 9
    np.testing.assert_allclose(np.asarray(updated.pred), np.asarray(fresh.pred), atol=2e-5)


def test_eagle_tree_with_one_child_per_level_is_the_greedy_chain(tiny_lm, head_files):
    """A dynamic tree of top-1 expansions is the chain of argmax drafts: the tree masks and scratch slots of
    the head agree with plain autoregressive drafting."""
    graphdef, params = _eagle_params(tiny_lm, head_files["eagle"])
    ctx, _ = _prompt_ctx(tiny_lm, [5, 17, 3, 88, 41, 9, 60])
    chain = EagleProposer(5, graphdef, cache_len=64)
    tree = EagleProposer(5, graphdef, cache_len=64, mode="tree", depth=5, top_k=1)
    keys = jax.vmap(jax.random.key)(jnp.zeros((1,), jnp.uint32))
    chain_draft = _draft(chain, params, ctx, keys)
    tree_draft = _draft(tree, params, ctx, keys)
    assert tree_draft.tokens.tolist() == chain_draft.tokens.tolist()
    assert tree_draft.parents.tolist() == [[0, 1, 2, 3, 4]]
    static = EagleProposer(5, graphdef, cache_len=64, mode="static", topology=jaxspec.TreeTopology.chain(5))
    static_draft = _draft(static, params, ctx, keys)
    assert static_draft.tokens.tolist() == chain_draft.tokens.tolist()


def test_eagle_static_tree_children_are_each_nodes_ranked_candidates(tiny_lm, head_files):
    """In a static tree every node's children are its own top-k: the depth-1 nodes of a wide tree are the
    chain's first draft and its runners-up, and the rank-0 path is the greedy chain."""
    graphdef, params = _eagle_params(tiny_lm, head_files["eagle"])
    ctx, _ = _prompt_ctx(tiny_lm, [5, 17, 3, 88, 41, 9, 60])
    keys = jax.vmap(jax.random.key)(jnp.zeros((1,), jnp.uint32))
    topo = TreeTopology.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    static = EagleProposer(topo.num_nodes, graphdef, cache_len=64, mode="static", topology=topo)
    draft = _draft(static, params, ctx, keys)
    chain = EagleProposer(3, graphdef, cache_len=64)
    chain_draft = _draft(chain, params, ctx, keys)
    tokens = draft.tokens[0].tolist()
    assert [tokens[0], tokens[3], tokens[6]] == chain_draft.tokens[0].tolist()  # paths (0,), (0,0), (0,0,0)
    assert len({tokens[0], tokens[1], tokens[2]}) == 3 and tokens[3] != tokens[4]


def test_head_errors(tiny_lm, head_files, tmp_path):
    with pytest.raises(ValueError, match="head_path"):
        jaxspec.generate(tiny_lm, [[1, 2, 3]], max_new_tokens=4,
                         spec=SpecConfig(method="eagle", head_path=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="needs a 'eagle' head"):
        jaxspec.generate(tiny_lm, [[1, 2, 3]], max_new_tokens=4,
                         spec=SpecConfig(method="eagle", head_path=str(head_files["medusa"])))
    with pytest.raises(ValueError, match="no shipped eagle head for model 'tiny'"):
        jaxspec.generate(tiny_lm, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="eagle"))
    with pytest.raises(ValueError, match="num_speculative_tokens=99 exceeds"):
        SpecConfig(method="eagle2", num_speculative_tokens=99, tree_depth=2, tree_top_k=3)
    with pytest.raises(ValueError, match="tree_top_k=0"):
        SpecConfig(method="eagle2", tree_top_k=0)


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_default_tree_depth_holds_the_budget(method):
    """Unset, a dynamic tree is 3 levels deep, or as deep as it must be to draft its K nodes: top_k + (depth - 1)
    * top_k**2 of them. A depth that is set stays as set, and is checked."""
    def depth(**kw):
        return SpecConfig(method=method, **kw).tree_depth

    assert depth() == 3 and SpecConfig(method=method).tree_top_k == 4
    assert depth(num_speculative_tokens=36) == 3  # 4 + 2 * 16 nodes
    assert depth(num_speculative_tokens=37) == 4
    assert depth(num_speculative_tokens=63) == 5  # 4 + 4 * 16 = 68 nodes
    assert depth(num_speculative_tokens=15, tree_top_k=2) == 5  # 2 + 4 * 4 = 18 nodes
    assert depth(num_speculative_tokens=63, tree_depth=6) == 6
    with pytest.raises(ValueError, match="num_speculative_tokens=63 exceeds"):
        SpecConfig(method=method, num_speculative_tokens=63, tree_depth=3)


def test_oracle_tree_with_the_pallas_kernel(tiny_lm, prompts, plain):
    """Tree verification through the Pallas kernel (interpret mode on CPU) with its ancestor mask."""
    proposer = OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, (0, 0, 1, 1), vocab=97)
    spec = SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, proposer=proposer,
                      proposer_params=_known(prompts, plain, 128)[:1])
    out = jaxspec.generate(tiny_lm, prompts[:1], max_new_tokens=12, spec=spec, attention_impl="pallas")
    assert out.token_ids[0] == plain.token_ids[0][:12]
    assert out.stats.mean_acceptance_length > 2


@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_oracle_tree_runs_to_the_last_cache_slot(tiny_lm, attention_impl):
    """The cache holds the prompt and the budget and no more: near the end a tree's nodes past the last slot are
    dropped and never accepted, the ones that fit still are, and every token equals plain decoding's. One verify
    width, so the forward writes the cache before attending (no deferred write)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (88, 30)]
    assert bucket_shapes([88, 30], 40)[2] == 128  # the first row's last token lands on the last slot
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40)
    proposer = OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, (0, 0, 0, 0), vocab=97)
    spec = SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, proposer=proposer,
                      proposer_params=_known(prompts, plain, 160), verify_widths=(TOPOLOGY.num_nodes + 1,))
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, spec=spec, attention_impl=attention_impl)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted > 0
    # Whole 4-deep paths (5 tokens a step) while the tree fits; then the row has 123 tokens cached and only the
    # nodes at slots 124-127 (the first four: depths 1 and 2) have a slot, so the path stops at depth 2.
    assert out.stats.rows[0].committed_per_step == (5,) * 7 + (3, 1)
