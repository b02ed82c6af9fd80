"""Draft trees (`jaxspec.tree`): layout, static topologies, node selection, verification, commit.

Everything is checked against plain numpy / Python references: brute-force tree walks, the documented random
streams replayed one row and one node at a time, plain sampling, and the chain verifier. The distribution
test treats the verifier as a black box (the first two output tokens must follow the target's processed
distributions) and must reject deliberately wrong verifiers, so it is known to be able to fail. Most tests
share one shape [B, K+1, V] = [6, 8, 11] so the jitted verifier compiles once per draft kind.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import SamplingParams, process_logits, processed_probs, rejection_sample, sample
from jaxspec.rejection import _ACCEPT_STREAM
from jaxspec.sampling import categorical as categorical_draw
from jaxspec.sampling import row_keys
from jaxspec.tree import (
    DraftTree,
    TreeTopology,
    depths,
    gather_nodes,
    gather_path,
    select_nodes,
    tokens_from_topk,
    tree_ancestor_mask,
    verify_tree,
)

ROWS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 4, 1.0, 0.0),
    (1.2, 0, 0.7, 0.0),
    (0.9, 0, 1.0, 0.15),
    (0.8, 5, 0.8, 0.05),
]
B, K, V = 6, 7, 11

verify = jax.jit(verify_tree, static_argnames="max_depth")
chain_verify = jax.jit(rejection_sample)
plain_sample = jax.jit(sample)
process_one = jax.jit(process_logits)
categorical = jax.jit(categorical_draw)
uniform = jax.jit(lambda key, position, stream: jax.random.uniform(
    jax.random.fold_in(jax.random.fold_in(key, position), stream)))


def _params(rows) -> SamplingParams:
    return SamplingParams.stack([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows])


def _seed_keys(seeds) -> jax.Array:
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


# --- numpy references of the layout ------------------------------------------------------------------------

def _np_depths(parents) -> np.ndarray:
    """[K+1] depth per node of one row, root included."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return np.asarray(depth)


def _np_ancestors(parents) -> np.ndarray:
    """bool[K+1, K+1] of one row by walking up from every node."""
    up = np.concatenate([[-1], parents])
    mask = np.zeros((len(up), len(up)), bool)
    for i in range(len(up)):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = up[j]
    return mask


def _random_parents(rng, batch, k) -> np.ndarray:
    """Random trees, biased deep (a parent among the few previous nodes); row 0 a chain, row 1 a star."""
    parents = np.stack([[rng.integers(max(0, i - 3), i + 1) for i in range(k)] for _ in range(batch)])
    parents[0] = np.arange(k)
    if batch > 1:
        parents[1] = 0
    return parents.astype(np.int32)


def _close_valid(rng, parents, p_valid=0.85) -> np.ndarray:
    """bool[B, K] random validity closed under ancestors."""
    valid = rng.random(parents.shape) < p_valid
    for b, i in itertools.product(range(parents.shape[0]), range(parents.shape[1])):
        valid[b, i] &= parents[b, i] == 0 or valid[b, parents[b, i] - 1]
    return valid


def test_depths_and_ancestor_mask_match_brute_force():
    rng = np.random.default_rng(0)
    layout = jax.jit(lambda parents: (depths(parents), tree_ancestor_mask(parents)))
    for k in (0, 3, 16):  # row 0 a chain: depth 16 needs every doubling round
        parents = _random_parents(rng, 4, k)
        depth, mask = layout(parents)
        np.testing.assert_array_equal(np.asarray(depth), np.stack([_np_depths(p) for p in parents]))
        np.testing.assert_array_equal(np.asarray(mask), np.stack([_np_ancestors(p) for p in parents]))
    with pytest.raises(ValueError, match="parents"):
        tree_ancestor_mask(np.zeros(3, np.int32))


# --- static topologies -------------------------------------------------------------------------------------

def test_chain_topology():
    t = TreeTopology.chain(4)
    assert t.parents == (0, 1, 2, 3) and t.child_rank == (0, 0, 0, 0)
    assert t.depths == (1, 2, 3, 4) and t.max_depth == 4 and t.num_nodes == 4
    assert TreeTopology.chain(0).max_depth == 0 and TreeTopology.chain(0).num_nodes == 0
    assert t == TreeTopology.from_paths([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]) and hash(t) == hash(
        TreeTopology((0, 1, 2, 3)))
    with pytest.raises(ValueError, match="k="):
        TreeTopology.chain(-1)


def test_from_paths_orders_breadth_first():
    paths = [(0, 0, 0), (1, 0), (0,), (0, 1), (1,), (0, 0), (2,)]  # shuffled on purpose
    t = TreeTopology.from_paths(paths)
    assert t.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parents == (0, 0, 0, 1, 1, 2, 4)
    assert t.child_rank == (0, 1, 2, 0, 1, 0, 0)
    assert t.depths == (1, 1, 1, 2, 2, 2, 3) and t.max_depth == 3
    assert TreeTopology.from_paths(t.paths) == t
    # A gap in the ranks is kept: the node still takes its head's rank-2 candidate.
    assert TreeTopology.from_paths([(0,), (2,)]).child_rank == (0, 2)
    assert TreeTopology((0, 0, 1)).child_rank == (0, 1, 0)  # derived: order of creation


@pytest.mark.parametrize("paths, match", [
    ([(0,), (0, 1, 0)], r"\(0, 1, 0\).*prefix \(0, 1\)"),
    ([(1, 0)], r"\(1, 0\).*prefix \(1,\)"),
    ([(0,), (0,)], r"\(0,\) appears more than once"),
    ([()], "non-empty"),
    ([(0, -1)], "non-empty tuple of ranks"),
])
def test_from_paths_rejects_bad_paths(paths, match):
    with pytest.raises(ValueError, match=match):
        TreeTopology.from_paths(paths)


def test_topology_rejects_bad_parents():
    with pytest.raises(ValueError, match=r"parents\[1\]=2"):
        TreeTopology((0, 2))
    with pytest.raises(ValueError, match="repeats a rank"):
        TreeTopology((0, 0), child_rank=(1, 1))
    with pytest.raises(ValueError, match="one per node"):
        TreeTopology((0, 0), child_rank=(0,))


def _all_paths(depth, k):
    return [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]


def _path_prob(table, path):
    return math.prod(table[d][r] for d, r in enumerate(path))


@pytest.mark.parametrize("seed", range(4))
def test_best_first_takes_the_likeliest_paths(seed):
    """Every path ranked by its probability (shallower, then smaller path on ties) and cut at the budget;
    measured accuracies need not fall with the rank (seeds 2, 3), and ties are common (rounded tables)."""
    rng = np.random.default_rng(seed)
    depth, k = 3, 3
    table = np.round(rng.random((depth, k)), 1)
    if seed < 2:
        table = -np.sort(-table, axis=1)
    table = table.tolist()
    ranked = sorted(_all_paths(depth, k), key=lambda p: (-_path_prob(table, p), len(p), p))
    for budget in (0, 1, 5, 12, len(ranked)):
        t = TreeTopology.best_first(table, budget)
        assert set(t.paths) == set(ranked[:budget])
        assert list(t.paths) == sorted(t.paths, key=lambda p: (len(p), p))
        assert all(t.parents[i] < i + 1 for i in range(budget))


def test_best_first_maximises_expected_acceptance():
    """Against every prefix-closed tree of the same size: the sum of path probabilities (the expected number
    of accepted drafts when heads are right independently) is the largest possible."""
    table = [[0.7, 0.2], [0.5, 0.3], [0.4, 0.35]]
    paths = _all_paths(3, 2)
    for budget in (3, 5, 7):
        best = max(sum(_path_prob(table, p) for p in subset) for subset in itertools.combinations(paths, budget)
                   if all(len(p) == 1 or p[:-1] in subset for p in subset))
        got = sum(_path_prob(table, p) for p in TreeTopology.best_first(table, budget).paths)
        assert got == pytest.approx(best, rel=1e-12)


def test_best_first_and_default_validate():
    with pytest.raises(ValueError, match="budget=15"):
        TreeTopology.best_first([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], 15)
    with pytest.raises(ValueError, match="probabilities"):
        TreeTopology.best_first([[1.5]], 1)
    with pytest.raises(ValueError, match="table"):
        TreeTopology.best_first([[0.5, 0.2], [0.5]], 1)
    with pytest.raises(ValueError, match="top_k"):
        TreeTopology.default(depth=3, top_k=0, budget=2)
    t = TreeTopology.default(depth=4, top_k=4, budget=15)
    prior = [[0.6 ** (d + 1) / (r + 1) for r in range(4)] for d in range(4)]
    assert t == TreeTopology.best_first(prior, 15) and t.num_nodes == 15
    assert t.paths[:4] == ((0,), (1,), (2,), (3,)) and (0, 0) in t.paths and 1 < t.max_depth <= 4


def test_tokens_from_topk():
    t = TreeTopology.from_paths([(0,), (1,), (3,), (0, 0), (0, 2), (1, 0), (0, 0, 1)])
    topk = np.random.default_rng(0).integers(0, 1000, (2, 4, 5)).astype(np.int32)  # [B, D, k], D > max_depth
    want = np.stack([[topk[b, len(p) - 1, p[-1]] for p in t.paths] for b in range(2)])
    np.testing.assert_array_equal(np.asarray(tokens_from_topk(t, topk)), want)
    assert tokens_from_topk(TreeTopology.chain(0), topk).shape == (2, 0)
    with pytest.raises(ValueError, match="rank 3"):
        tokens_from_topk(t, topk[:, :, 0])
    with pytest.raises(ValueError, match="needs 3"):
        tokens_from_topk(t, topk[:, :2])
    with pytest.raises(ValueError, match="rank 3"):  # rank 3 is used, but only 3 candidates given
        tokens_from_topk(t, topk[:, :, :3])


# --- select_nodes (EAGLE-2) --------------------------------------------------------------------------------

def _reference_select(scores, parents, tokens, budget):
    """One row: rank by (score desc, index), kept in that order; parents remapped."""
    floor = []  # the smallest score on each node's path
    for i, p in enumerate(parents):
        floor.append(min(scores[i], floor[p - 1]) if p else scores[i])
    kept = sorted(range(len(scores)), key=lambda i: (-floor[i], i))[:budget]
    new = {0: 0, **{old + 1: n + 1 for n, old in enumerate(kept)}}
    return ([tokens[i] for i in kept], [new[parents[i]] for i in kept], kept, [floor[i] > -np.inf for i in kept])


def test_select_nodes_matches_reference():
    rng = np.random.default_rng(3)
    batch, m, budget = 8, 20, 9
    parents = _random_parents(rng, batch, m)
    parents[2] = np.minimum(np.arange(m), rng.integers(0, 4, m))  # wide: many level-1 nodes
    # Cumulative log-probabilities on a coarse grid: ties everywhere, parent-child ties included.
    step = np.round(np.log(rng.random((batch, m))) * 2) / 2
    dead = rng.random((batch, m)) < 0.1
    dead[5, 3:] = True  # a row with fewer valid candidates than the budget
    scores = np.zeros((batch, m))
    for b, i in itertools.product(range(batch), range(m)):
        above = scores[b, parents[b, i] - 1] if parents[b, i] else 0.0
        scores[b, i] = -np.inf if dead[b, i] else above + step[b, i]
    tokens = rng.integers(0, 100, (batch, m))
    sel = jax.jit(select_nodes, static_argnums=3)
    got = [np.asarray(x) for x in sel(scores.astype(np.float32), parents, tokens, budget)]
    for b in range(batch):
        want = _reference_select(list(scores[b]), list(parents[b]), list(tokens[b]), budget)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[b], w, err_msg=f"row {b}")
        new_tokens, new_parents, kept, valid = (g[b] for g in got)
        assert set(parents[b, kept][parents[b, kept] > 0] - 1) <= set(kept)  # closed under ancestors
        assert np.all(new_parents < np.arange(1, budget + 1))  # still a tree in the convention
        np.testing.assert_array_equal(np.sort(scores[b, kept])[::-1], np.sort(scores[b])[::-1][:budget])
        assert np.all(valid == (np.arange(budget) < valid.sum()))  # valid nodes form a prefix
    assert not got[3][5].all() and got[3].sum() > budget * (batch - 2)


def test_select_nodes_validates():
    with pytest.raises(ValueError, match="budget=4"):
        select_nodes(np.zeros((1, 3)), np.zeros((1, 3), np.int32), np.zeros((1, 3), np.int32), 4)
    with pytest.raises(ValueError, match="parents.shape"):
        select_nodes(np.zeros((1, 3)), np.zeros((1, 2), np.int32), np.zeros((1, 3), np.int32), 1)


# --- verification: references ------------------------------------------------------------------------------

def _walk(target, tokens, parents, eligible):
    """One row of the greedy / point-mass rule: (path, output tokens) for a target token per node."""
    cur, path = 0, [0]
    while True:
        match = [i for i in range(len(parents)) if parents[i] == cur and eligible[i] and tokens[i] == target[cur]]
        if not match:
            return path, [tokens[n - 1] for n in path[1:]] + [target[cur]]
        cur = match[0] + 1
        path.append(cur)


def _eligible(parents, valid, max_depth):
    return valid & (np.stack([_np_depths(p)[1:] for p in parents]) <= max_depth)


def _padded(rows, width):
    return np.asarray([list(r) + [-1] * (width - len(r)) for r in rows])


def reference_tree_rejection(keys, logits, tokens, parents, eligible, probs, rows, positions):
    """Recursive rejection one row and one node at a time, with the random streams of jaxspec/tree.py."""
    paths, outs = [], []
    for b in range(logits.shape[0]):
        z = np.asarray(process_one(jnp.asarray(logits[b][None]), SamplingParams(*rows[b])))[0]  # [K+1, V]
        depth = _np_depths(parents[b])
        cur, path = 0, [0]
        while True:
            key = jax.random.fold_in(keys[b], positions[b] + depth[cur])
            p = np.exp(z[cur].astype(np.float64) - np.max(z[cur]))
            r, q, rejected, moved = p / p.sum(), probs[b, cur].astype(np.float64), False, False
            children = [i for i in range(len(parents[b])) if parents[b, i] == cur and eligible[b, i]]
            for s, i in enumerate(children):  # s: the children rejected so far
                x = tokens[b, i]
                u = float(uniform(keys[b], positions[b] + depth[cur], _ACCEPT_STREAM + s))
                if (u < r[x] / q[x]) if q[x] > 0 else (r[x] > 0):
                    cur, moved = i + 1, True
                    path.append(cur)
                    break
                left = np.maximum(r - q, 0.0)
                if left.sum() > 0:
                    r, rejected = left / left.sum(), True
            if moved:
                continue
            with np.errstate(divide="ignore"):
                last = int(categorical(key, np.log(r).astype(np.float32) if rejected else z[cur]))
            paths.append(path)
            outs.append([tokens[b, n - 1] for n in path[1:]] + [last])
            break
    return paths, outs


def _tree_case(seed, rows=None):
    """Random trees, validity, logits, seeds and positions for B rows of mixed sampling settings."""
    rng = np.random.default_rng(seed)
    rows = rows or [ROWS[i] for i in rng.integers(0, len(ROWS), B)]
    parents = _random_parents(rng, B, K)
    logits = (rng.normal(size=(B, K + 1, V)) * 2).astype(np.float32)
    return rng, rows, parents, _close_valid(rng, parents), logits, rng.integers(0, 2**31, B), rng.integers(0, 999, B)


def _likely_tokens(rng, target, parents, p_match=0.6):
    """Node tokens that often equal the target's token at their parent (so paths get accepted), and often
    duplicate a sibling (so the lowest-index rule matters)."""
    at_parent = np.take_along_axis(target, parents, axis=1)
    return np.where(rng.random(parents.shape) < p_match, at_parent, rng.integers(0, V, parents.shape)).astype(np.int32)


def _run(seeds, logits, tokens, parents, valid, probs, params, positions, max_depth=K):
    tree = DraftTree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(valid),
                     None if probs is None else jnp.asarray(probs, jnp.float32))
    out = verify(_seed_keys(seeds), jnp.asarray(logits), tree, params, positions=jnp.asarray(positions, jnp.int32),
                 max_depth=max_depth)
    return tuple(np.asarray(x) for x in out)


def _plain_at_nodes(seeds, positions, logits, parents, params) -> np.ndarray:
    """i32[B, K+1]: what plain decoding draws after each node, keyed by the position that node predicts."""
    depth = np.stack([_np_depths(p) for p in parents])
    seeds, positions = jnp.asarray(seeds, jnp.uint32), np.asarray(positions)
    return np.stack([np.asarray(plain_sample(row_keys(seeds, jnp.asarray(positions + depth[:, j], jnp.int32)),
                                             jnp.asarray(logits[:, j]), params))
                     for j in range(logits.shape[1])], axis=1)


# --- verification: greedy, point-mass, chain ----------------------------------------------------------------

@pytest.mark.parametrize("probabilistic", [False, True])
def test_greedy_follows_the_argmax_walk(probabilistic):
    """All-greedy batches (the fast path): the brute-force walk, with and without a depth limit; draft
    distributions do not matter to greedy rows."""
    lengths = []
    for seed in range(3):
        rng, _, parents, valid, logits, seeds, positions = _tree_case(seed)
        logits[2, :, 4] = logits[2, :, 9] = 9.0  # ties: the first index is the argmax, as plain greedy picks
        best = logits.argmax(-1)
        tokens = _likely_tokens(rng, best, parents, 0.7)
        probs = rng.dirichlet(np.ones(V), (B, K)) if probabilistic else None
        for max_depth in (K, 2) if not probabilistic else (K,):
            path, out, num = _run(seeds, logits, tokens, parents, valid, probs, SamplingParams().broadcast(B),
                                  positions, max_depth)
            walks = [_walk(best[b], tokens[b], parents[b], e)
                     for b, e in enumerate(_eligible(parents, valid, max_depth))]
            np.testing.assert_array_equal(path, _padded([w[0] for w in walks], max_depth + 1))
            np.testing.assert_array_equal(out, _padded([w[1] for w in walks], max_depth + 1))
            np.testing.assert_array_equal(num, [len(w[1]) for w in walks])
            lengths += list(num)
    assert max(lengths) >= 4 and min(lengths) == 1 and 3 in lengths  # depth limit 2 reached too


@pytest.mark.parametrize("probabilistic", [False, True])
def test_chain_equals_rejection_sample(probabilistic):
    """A chain tree is the chain verifier, token for token, in mixed greedy / sampled batches and an
    all-greedy one: the same random streams, the same probabilities."""
    runs = []
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        rows = [ROWS[0]] * B if seed == 3 else [ROWS[i] for i in rng.integers(0, len(ROWS), B)]
        params, seeds, positions = _params(rows), rng.integers(0, 2**31, B), rng.integers(0, 999, B)
        logits = (rng.normal(size=(B, K + 1, V)) * 2).astype(np.float32)
        num_draft = rng.integers(0, K + 1, B)
        if probabilistic:
            q = np.asarray(jax.nn.softmax(logits[:, :K] + rng.normal(size=(B, K, V)), -1), np.float64)
            drafts = (q.cumsum(-1) < rng.random((B, K, 1))).sum(-1).clip(0, V - 1)
            probs = q.astype(np.float32)
        else:
            plain = _plain_at_nodes(seeds, positions, logits, np.tile(np.arange(K), (B, 1)), params)
            drafts, probs = np.where(rng.random((B, K)) < 0.7, plain[:, :K], rng.integers(0, V, (B, K))), None
        want_tokens, want_num = (np.asarray(x) for x in chain_verify(
            _seed_keys(seeds), jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
            None if probs is None else jnp.asarray(probs), jnp.asarray(num_draft, jnp.int32), params,
            positions=jnp.asarray(positions, jnp.int32)))
        path, out, num = _run(seeds, logits, drafts, np.tile(np.arange(K), (B, 1)), np.arange(K) < num_draft[:, None],
                              probs, params, positions)
        np.testing.assert_array_equal(out, want_tokens)
        np.testing.assert_array_equal(num, want_num)
        np.testing.assert_array_equal(path, np.where(np.arange(K + 1) < num[:, None], np.arange(K + 1), -1))
        runs += list(num)
    assert 1 in runs and max(runs) >= 3


def test_deterministic_drafts_reproduce_plain_sampling():
    """Point-mass rule on random trees, mixed greedy / sampled rows: every output token is the token plain
    sampling draws at its position (sampling.sample with row_keys(seed, position)), and the path is the
    first-matching-child walk over those tokens."""
    lengths = []
    for seed in range(3):
        rng, rows, parents, valid, logits, seeds, positions = _tree_case(20 + seed)
        params = _params(rows)
        plain = _plain_at_nodes(seeds, positions, logits, parents, params)  # [B, K+1]
        tokens = _likely_tokens(rng, plain, parents)
        path, out, num = _run(seeds, logits, tokens, parents, valid, None, params, positions)
        walks = [_walk(plain[b], tokens[b], parents[b], valid[b]) for b in range(B)]
        np.testing.assert_array_equal(path, _padded([w[0] for w in walks], K + 1))
        np.testing.assert_array_equal(out, _padded([w[1] for w in walks], K + 1))
        for b in range(B):  # token d is plain sampling's draw after the path's node at depth d
            np.testing.assert_array_equal(out[b, : num[b]], plain[b, path[b, : num[b]]])
        lengths += list(num)
    assert len(set(lengths)) >= 3 and max(lengths) >= 3


def test_probabilistic_matches_scalar_reference():
    """Recursive rejection on random trees (draws from q, rejections, residuals over several siblings) equals
    a node-by-node replay of the documented random streams."""
    outcomes = []
    for seed in range(4):
        rng, rows, parents, valid, logits, seeds, positions = _tree_case(40 + seed)
        # Drafts near the target (acceptances) that still cover tokens the target excludes (rejections).
        q = np.asarray(jax.nn.softmax(logits[:, :K] + rng.normal(size=(B, K, V)), -1), np.float64)  # by node
        q_parent = np.take_along_axis(q, np.minimum(parents, K - 1)[..., None], axis=1)  # [B, K, V]
        tokens = (q_parent.cumsum(-1) < rng.random((B, K, 1))).sum(-1).clip(0, V - 1).astype(np.int32)
        path, out, num = _run(seeds, logits, tokens, parents, valid, q, _params(rows), positions)
        want_paths, want_out = reference_tree_rejection(_seed_keys(seeds), logits, tokens, parents, valid, q, rows,
                                                        positions)
        np.testing.assert_array_equal(path, _padded(want_paths, K + 1), err_msg=f"seed {seed}")
        np.testing.assert_array_equal(out, _padded(want_out, K + 1), err_msg=f"seed {seed}")
        outcomes += [num.max(), np.sum(path[:, 1] > 1)]  # long paths; a later sibling accepted at the root
    assert max(outcomes[0::2]) >= 3 and sum(outcomes[1::2]) >= 2


@pytest.mark.parametrize("probabilistic", [False, True])
def test_no_drafts_is_one_plain_step(probabilistic):
    """K = 0: the root's own token, exactly plain sampling."""
    rng, rows, _, _, logits, seeds, positions = _tree_case(9)
    params = _params(rows)
    empty = np.zeros((B, 0), np.int32)
    path, out, num = _run(seeds, logits[:, :1], empty, empty, empty.astype(bool),
                          np.zeros((B, 0, V)) if probabilistic else None, params, positions, 0)
    np.testing.assert_array_equal(path, np.zeros((B, 1)))
    np.testing.assert_array_equal(num, np.ones(B))
    np.testing.assert_array_equal(out, _plain_at_nodes(seeds, positions, logits[:, :1], empty, params))


def test_verify_validates_shapes():
    rng, rows, parents, valid, logits, seeds, positions = _tree_case(0)
    keys, tree, params = _seed_keys(seeds), DraftTree(parents, parents, valid), _params(rows)
    with pytest.raises(ValueError, match="max_depth=8"):
        verify_tree(keys, logits, tree, params, max_depth=K + 1)
    with pytest.raises(ValueError, match="node_valid"):
        verify_tree(keys, logits, tree._replace(node_valid=valid[:, :3]), params)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_tree(keys, logits, tree._replace(draft_probs=np.zeros((B, K, V + 1))), params)
    with pytest.raises(ValueError, match="target_logits"):
        verify_tree(keys, logits[0], tree, params)
    with pytest.raises(ValueError, match="positions"):
        verify_tree(keys, logits, tree, params, positions=np.zeros(B + 1, np.int32))


# --- verification: the emitted tokens follow the processed target distribution ------------------------------

# A fixed tree: the root has three children (nodes 1-3), node 1 two (nodes 4, 5). Node 3 is invalid in a
# third of the rows, chosen independently of the drafted tokens (which keeps verification lossless).
TREE = np.asarray([0, 0, 0, 1, 1], np.int32)
N, DV, DK = 40000, 6, len(TREE)
DIST = {"temperature": (0.7, 0, 1.0, 0.0), "top_k": (1.0, 3, 1.0, 0.0), "top_p": (1.0, 0, 0.75, 0.0),
        "min_p": (1.2, 0, 1.0, 0.2)}
# Sampling noise in total variation for 40k draws: about 0.004 over the 6 first tokens and at most 0.012 over
# the 36 pairs (expected value); its spread is a fraction of that.
TV_FIRST, TV_JOINT = 0.015, 0.02
verify_dist = jax.jit(verify_tree, static_argnames="max_depth")


def _dist_setup(name):
    """A Markov target: the logits after a token depend on that token alone (row x of `markov`), so the true
    distribution after any token is known whether or not the tree drafted it. The draft: the root's children
    i.i.d. from q0, node 1's children i.i.d. from q_after[token of node 1]."""
    rng = np.random.default_rng(5)
    markov = (rng.normal(size=(DV, DV)) * 1.5).astype(np.float32)  # logits after token x: markov[x]
    p = np.asarray(processed_probs(jnp.asarray(markov[None]), SamplingParams(*DIST[name]).broadcast(1)))[0]
    p = p.astype(np.float64) / p.sum(-1, keepdims=True)  # [V, V]: p[x] the target after token x
    noise = np.exp(rng.normal(size=(DV + 1, DV)))
    q = 0.5 * noise / noise.sum(-1, keepdims=True) + 0.5 * np.asarray(jax.nn.softmax(markov[[0] + list(range(DV))]))
    q0, q_after = q[0] / q[0].sum(), q[1:] / q[1:].sum(-1, keepdims=True)  # the root's token is 0
    tokens = np.zeros((N, DK), np.int32)
    tokens[:, :3] = (q0.cumsum() < rng.random((N, 3, 1))).sum(-1).clip(0, DV - 1)
    tokens[:, 3:] = (q_after[tokens[:, 0]][:, None].cumsum(-1) < rng.random((N, 2, 1))).sum(-1).clip(0, DV - 1)
    probs = np.full((N, DK, DV), np.nan, np.float32)  # leaves' rows are never read
    probs[:, 0], probs[:, 1] = q0, q_after[tokens[:, 0]]
    valid = np.ones((N, DK), bool)
    valid[:, 2] = rng.random(N) < 2 / 3
    node_tokens = np.concatenate([np.zeros((N, 1), np.int32), tokens], axis=1)
    return rng, markov[node_tokens], p, tokens, probs, valid


def _tv(a, b):
    return 0.5 * np.abs(a - b).sum()


def _check(out, num, p, rng):
    """(TV of the first token vs p[0], TV of the first two tokens vs p[0](x) p[x](y), tokens emitted with
    target probability 0). When a step emits one token, the next is what the next step draws after it."""
    first = out[:, 0]
    fresh = (p[first].cumsum(-1) < rng.random((len(num), 1))).sum(-1).clip(0, DV - 1)
    second = np.where(num >= 2, out[:, 1], fresh)
    joint = (p[0][:, None] * p).ravel()
    emp_first = np.bincount(first, minlength=DV) / len(num)
    emp_joint = np.bincount(first * DV + second, minlength=DV * DV) / len(num)
    return _tv(emp_first, p[0]), _tv(emp_joint, joint), int(np.sum(emp_joint[joint == 0] > 0))


@pytest.mark.parametrize("name", DIST)
def test_emitted_tokens_follow_processed_distribution(name):
    rng, logits, p, tokens, probs, valid = _dist_setup(name)
    path, out, num = (np.asarray(x) for x in verify_dist(
        jax.random.split(jax.random.key(11), N), jnp.asarray(logits),
        DraftTree(jnp.asarray(tokens), jnp.broadcast_to(jnp.asarray(TREE), (N, DK)), jnp.asarray(valid),
                  jnp.asarray(probs)),
        SamplingParams(*DIST[name]).broadcast(N), max_depth=2))
    tv_first, tv_joint, impossible = _check(out, num, p, rng)
    assert impossible == 0 and tv_first < TV_FIRST and tv_joint < TV_JOINT, (tv_first, tv_joint, impossible)
    # The check covers acceptance at both levels and of later siblings.
    assert np.mean(num == 3) > 0.05 and np.mean(np.isin(path[:, 1], [2, 3])) > 0.05 and np.mean(path[:, 2] == 5) > 0


def _numpy_tree_verify(logits_p, tokens, probs, valid, rng, *, keep_residual=False, recover_from_p=False):
    """Vectorised numpy recursive rejection on the fixed tree, with optional bugs: the controls.

    logits_p: f32[N, K+1, V] target probabilities by node. keep_residual: test every sibling against p (the
    residual is never updated after a rejection); recover_from_p: after rejections, emit from p."""
    rows = np.arange(len(tokens))
    cur, residual = np.zeros(len(tokens), int), logits_p[:, 0].copy()
    rejected = np.zeros(len(tokens), bool)
    path = np.full((len(tokens), 3), -1)
    path[:, 0] = 0
    depth = _np_depths(TREE)
    for i in range(DK):
        child = valid[:, i] & (TREE[i] == cur)
        x, q = tokens[:, i], probs[rows, np.minimum(cur, DK - 1)]
        accept = child & (rng.random(len(tokens)) * q[rows, x] < residual[rows, x])
        miss = child & ~accept
        left = np.maximum(residual - q, 0.0)
        if not keep_residual:
            residual[miss] = left[miss] / left[miss].sum(-1, keepdims=True)
        rejected = (rejected | miss) & ~accept
        residual[accept] = logits_p[accept, i + 1]
        path[accept, depth[i + 1]] = i + 1
        cur = np.where(accept, i + 1, cur)
    final = np.where(rejected[:, None] & (not recover_from_p), residual, logits_p[rows, cur])
    last = (final.cumsum(-1) < rng.random((len(tokens), 1))).sum(-1).clip(0, DV - 1)
    num = (path >= 0).sum(1)
    node_tokens = np.concatenate([np.zeros((len(tokens), 1), int), tokens], axis=1)
    drafts = np.take_along_axis(node_tokens, np.maximum(path[:, 1:], 0), axis=1)
    out = np.where(np.arange(3) < num[:, None] - 1, np.pad(drafts, ((0, 0), (0, 1))), -1)
    out[rows, num - 1] = last
    return out, num


@pytest.mark.parametrize("name", ["temperature", "top_k"])
def test_statistical_check_rejects_wrong_verifiers(name):
    rng, logits, p, tokens, probs, valid = _dist_setup(name)
    probs = np.nan_to_num(probs.astype(np.float64))
    logits_p = p[np.concatenate([np.zeros((N, 1), int), tokens], axis=1)]  # [N, K+1, V]: p after each node
    correct = _check(*_numpy_tree_verify(logits_p, tokens, probs, valid, rng), p, rng)
    assert correct[2] == 0 and correct[0] < TV_FIRST and correct[1] < TV_JOINT, correct  # the harness is fair
    for bug in ("keep_residual", "recover_from_p"):
        tv_first, tv_joint, impossible = _check(*_numpy_tree_verify(logits_p, tokens, probs, valid, rng,
                                                                    **{bug: True}), p, rng)
        assert tv_joint > 2 * TV_JOINT, (bug, tv_first, tv_joint)


# --- commit ------------------------------------------------------------------------------------------------

def _random_paths(rng, batch, k, depth):
    """Increasing node indices from the root (so path[j] >= j), -1 padded after a random length."""
    paths = np.full((batch, depth + 1), -1)
    for b in range(batch):
        n = rng.integers(0, depth + 1)
        paths[b, : n + 1] = [0] + sorted(rng.choice(np.arange(1, k + 1), n, replace=False))
    return paths


def test_gather_path_moves_the_path_to_a_prefix():
    rng = np.random.default_rng(0)
    batch, heads, slots, dim, k, depth = 5, 2, 24, 3, 8, 4
    buffer = rng.normal(size=(batch, heads, slots, dim)).astype(np.float32)
    start = np.asarray([0, 3, 10, slots - k - 1, 7])  # row 3: the tree ends at the last slot
    path = _random_paths(rng, batch, k, depth)
    path[3] = [0, 2, 5, 8, -1]
    want = buffer.copy()
    for b, j in itertools.product(range(batch), range(depth + 1)):
        if path[b, j] >= 0:
            want[b, :, start[b] + j] = buffer[b, :, start[b] + path[b, j]]
    got = jax.jit(gather_path)(buffer, start, path)
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="start"):
        gather_path(buffer, start[:2], path)


def test_gather_nodes():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 9, 5)).astype(np.float32)
    path = _random_paths(rng, 4, 8, 3)
    got = np.asarray(gather_nodes(x, path))
    for b, j in itertools.product(range(4), range(4)):
        if path[b, j] >= 0:
            np.testing.assert_array_equal(got[b, j], x[b, path[b, j]])
    assert got.shape == (4, 4, 5)
