"""Lossless verification (`rejection_sample`): a scalar reference, the target distribution, plain sampling.

The distribution checks treat the sampler as a black box: the first two tokens of a sequence must be
distributed as p0 x p1 (the processed target distributions), and the same check must reject samplers with a
deliberate bug, so it is known to be able to fail. Most tests share one shape [B, K+1, V] = [6, 5, 11] so
the jitted function compiles once per draft kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import SamplingParams, process_logits, processed_probs, sample, sampling
from jaxspec.rejection import _ACCEPT_STREAM, rejection_sample
from jaxspec.sampling import row_keys

ROWS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 4, 1.0, 0.0),
    (1.2, 0, 0.7, 0.0),
    (0.9, 0, 1.0, 0.15),
    (0.8, 5, 0.8, 0.05),
    (0.0, 3, 0.5, 0.2),  # greedy wins over the rest
    (0.3, 0, 1.0, 0.0),
]
B, K, V = 6, 4, 11

verify = jax.jit(rejection_sample)
plain_sample = jax.jit(sample)
# Eager process_logits retraces its lax.cond on every call; jitted, the reference loop stays fast.
process_one = jax.jit(process_logits)
categorical = jax.jit(sampling.categorical)


def _params(rows) -> SamplingParams:
    return SamplingParams.stack([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows])


def _seed_keys(seeds) -> jax.Array:
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def _plain(seeds, positions, logits, params) -> np.ndarray:
    """i32[B, K+1]: what plain decoding draws at positions P..P+K from the same logits (sampling.sample)."""
    seeds, positions = jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32)
    return np.stack([np.asarray(plain_sample(row_keys(seeds, positions + j), jnp.asarray(logits[:, j]), params))
                     for j in range(logits.shape[1])], axis=1)


def _run(seeds, logits, drafts, probs, num_draft, params, positions):
    out = verify(_seed_keys(seeds), jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                 None if probs is None else jnp.asarray(probs, jnp.float32), jnp.asarray(num_draft, jnp.int32),
                 params, positions=jnp.asarray(positions, jnp.int32))
    return tuple(np.asarray(x) for x in out)


def _case(seed, rows=None):
    """Random logits, num_draft (0 and K always among them), seeds and positions for B rows."""
    rng = np.random.default_rng(seed)
    rows = rows or [ROWS[i] for i in rng.integers(0, len(ROWS), B)]
    logits = (rng.normal(size=(B, K + 1, V)) * 2).astype(np.float32)
    num_draft = rng.integers(0, K + 1, B)
    num_draft[:2] = 0, K
    return rng, rows, logits, num_draft, rng.integers(0, 2**31, B), rng.integers(0, 1000, B)


def _sample_from(rng, probs):
    """One token per row of probs [..., V], by inverse CDF."""
    return (probs.cumsum(-1) < rng.random(probs.shape[:-1])[..., None]).sum(-1).clip(0, probs.shape[-1] - 1)


# --- 1. a scalar reference, one row and one position at a time -------------------------------------------

def reference_rejection(keys, logits, drafts, probs, num_draft, rows, positions):
    """Plain loops over rows and positions with the key streams documented in jaxspec/rejection.py."""
    batch, width, _ = logits.shape
    tokens, counts = np.full((batch, width), -1), np.zeros(batch, int)
    for b in range(batch):
        params = SamplingParams(*rows[b])  # Python scalars: one request on its own
        z = np.asarray(process_one(jnp.asarray(logits[b][None]), params))[0]  # [K+1, V]

        def key(j, b=b):
            return jax.random.fold_in(keys[b], positions[b] + j)

        out = []
        for j in range(width):
            if probs is None:  # deterministic draft: compare with the target's own sample
                t = int(categorical(key(j), z[j]))
                out.append(t)
                if j < num_draft[b] and drafts[b, j] == t:
                    continue
                break
            if j == num_draft[b]:  # every draft accepted: the bonus token from p itself
                out.append(int(categorical(key(j), z[j])))
                break
            p = np.exp(z[j].astype(np.float64) - np.max(z[j]))
            p /= p.sum()
            x, q = drafts[b, j], probs[b, j].astype(np.float64)
            u = float(jax.random.uniform(jax.random.fold_in(key(j), _ACCEPT_STREAM)))
            if (u < p[x] / q[x]) if q[x] > 0 else (p[x] > 0):
                out.append(int(x))
                continue
            residual = np.maximum(p - q, 0.0)
            with np.errstate(divide="ignore"):
                recover = np.log(residual).astype(np.float32) if residual.sum() > 0 else z[j]
            out.append(int(categorical(key(j), recover)))
            break
        tokens[b, : len(out)], counts[b] = out, len(out)
    return tokens, counts


def _garbage(rng, drafts, probs, num_draft):
    """Entries at j >= num_draft must be ignored: fill them with out-of-range tokens and NaN probabilities."""
    past = np.arange(drafts.shape[1]) >= num_draft[:, None]
    drafts = np.where(past, rng.choice([-1, 10**6], size=drafts.shape), drafts).astype(np.int32)
    return drafts, None if probs is None else np.where(past[..., None], np.nan, probs).astype(np.float32)


@pytest.mark.parametrize("probabilistic", [False, True])
def test_matches_scalar_reference(probabilistic):
    """Several seeds of mixed greedy / sampled rows (top-k, top-p, min-p), and one all-greedy batch."""
    outcomes = []
    for seed in range(5):
        rng, rows, logits, num_draft, seeds, positions = _case(seed, rows=[ROWS[0]] * B if seed == 4 else None)
        params, keys = _params(rows), _seed_keys(seeds)
        if probabilistic:
            # A draft distribution near p (acceptances) that still covers tokens p excludes (rejections).
            q = np.asarray(jax.nn.softmax(logits[:, :K] + rng.normal(size=(B, K, V)), -1), np.float64)
            drafts, probs = _sample_from(rng, q), q.astype(np.float32)
        else:
            # Often the target's own sample, so runs of acceptances happen.
            plain = _plain(seeds, positions, logits, params)[:, :K]
            drafts, probs = np.where(rng.random(plain.shape) < 0.6, plain, rng.integers(0, V, plain.shape)), None
        drafts, probs = _garbage(rng, drafts, probs, num_draft)
        tokens, num = _run(seeds, logits, drafts, probs, num_draft, params, positions)
        want_tokens, want_num = reference_rejection(keys, logits, drafts, probs, num_draft, rows, positions)
        np.testing.assert_array_equal(num, want_num, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(tokens, want_tokens, err_msg=f"seed {seed}")
        outcomes += [num > 1, num <= num_draft]
    outcomes = np.stack(outcomes).reshape(5, 2, B)
    assert outcomes[:, 0].any() and outcomes[:, 1].any()  # both acceptances and rejections were compared


# --- 2 and 3. the emitted tokens follow the processed target distribution -----------------------------------

N, DV, DK = 40000, 8, 2  # rows, vocabulary, drafts per row of the distribution tests
DIST = {"temperature": (0.7, 0, 1.0, 0.0), "top_k": (1.0, 4, 1.0, 0.0), "top_p": (1.0, 0, 0.8, 0.0),
        "min_p": (1.0, 0, 1.0, 0.2)}
# Sampling noise in total variation for 40k draws (expected value, sum sqrt(2 p (1 - p) / (pi N)) / 2): about
# 0.004 over the 8 first tokens, at most 0.012 over the 64 pairs; its spread is a fraction of that.
TV_FIRST, TV_JOINT = 0.02, 0.03


def _dist_setup(name):
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(DK + 1, DV)) * 1.5).astype(np.float32)  # the same context in every row
    p = np.asarray(processed_probs(jnp.asarray(logits[None]), SamplingParams(*DIST[name]).broadcast(1)))[0]
    p = p.astype(np.float64)
    p /= p.sum(-1, keepdims=True)  # [K+1, V]
    # Drafts half like the target, half noise: total variation from p 0.25 to 0.55, and mass on every token
    # (top-k / top-p / min-p exclude 30-50% of q's mass).
    noise = np.exp(rng.normal(size=(DK, DV)) * 1.5)
    q = 0.5 * noise / noise.sum(-1, keepdims=True) + 0.5 * np.asarray(jax.nn.softmax(logits[:DK], -1), np.float64)
    q /= q.sum(-1, keepdims=True)
    drafts = np.stack([rng.choice(DV, N, p=q[j]) for j in range(DK)], axis=1).astype(np.int32)  # [N, K]
    num_draft = rng.choice(DK + 1, N, p=[0.1, 0.1, 0.8]).astype(np.int32)
    return rng, logits, p, q, drafts, num_draft


def _tv(a, b):
    return 0.5 * np.abs(a - b).sum()


def _check(tokens, num, p, rng):
    """(TV of the first token vs p0, TV of the first two tokens of the sequence vs p0 x p1, tokens emitted
    with target probability 0). Target logits at position 1 do not depend on token 0 here, so when a step
    emits one token the sequence's next token is what the next step would draw: a fresh sample from p1."""
    tokens, num = np.asarray(tokens), np.asarray(num)
    first = tokens[:, 0]
    second = np.where(num >= 2, tokens[:, 1], rng.choice(DV, len(num), p=p[1]))
    emp_first = np.bincount(first, minlength=DV) / len(num)
    emp_joint = np.bincount(first * DV + second, minlength=DV * DV) / len(num)
    joint = np.outer(p[0], p[1]).ravel()
    return _tv(emp_first, p[0]), _tv(emp_joint, joint), int(np.sum(emp_joint[joint == 0] > 0))


@pytest.mark.parametrize("name", DIST)
@pytest.mark.parametrize("probabilistic", [False, True])
def test_emitted_tokens_follow_processed_distribution(name, probabilistic):
    rng, logits, p, q, drafts, num_draft = _dist_setup(name)
    tokens, num = verify(jax.random.split(jax.random.key(11), N),
                         jnp.broadcast_to(jnp.asarray(logits), (N, DK + 1, DV)), jnp.asarray(drafts),
                         jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, DK, DV)) if probabilistic else None,
                         jnp.asarray(num_draft), SamplingParams(*DIST[name]).broadcast(N))
    tv_first, tv_joint, impossible = _check(tokens, num, p, rng)
    assert impossible == 0 and tv_first < TV_FIRST and tv_joint < TV_JOINT, (tv_first, tv_joint, impossible)
    assert np.mean(np.asarray(num) - 1) > 0.2  # drafts were accepted, so the check covers acceptance too


def _numpy_speculative(drafts, q, num_draft, p, rng, *, always_accept=False, recover_from_p=False):
    """A vectorised numpy sampler with optional bugs: the controls for the statistical check."""
    rows = len(num_draft)
    tokens, num = np.full((rows, DK + 1), -1), np.zeros(rows, int)
    alive = np.ones(rows, bool)  # rows whose drafts were all accepted so far
    for j in range(DK + 1):
        jj = min(j, DK - 1)  # position K has no draft
        x = drafts[:, jj]
        drafting = alive & (j < num_draft)
        accept = drafting & (always_accept | (rng.random(rows) * q[jj, x] < p[j, x]))
        rejected, bonus = drafting & ~accept, alive & ~drafting
        residual = p[j] if recover_from_p else np.maximum(p[j] - q[jj], 0.0)
        tokens[accept, j] = x[accept]
        tokens[rejected, j] = rng.choice(DV, rows, p=residual / residual.sum())[rejected]
        tokens[bonus, j] = rng.choice(DV, rows, p=p[j])[bonus]
        num[rejected | bonus] = j + 1
        alive = accept
    return tokens, num


@pytest.mark.parametrize("name", ["temperature", "top_k"])
def test_statistical_check_rejects_wrong_samplers(name):
    rng, logits, p, q, drafts, num_draft = _dist_setup(name)
    correct = _check(*_numpy_speculative(drafts, q, num_draft, p, rng), p, rng)
    assert correct[2] == 0 and correct[0] < TV_FIRST and correct[1] < TV_JOINT, correct  # the harness is fair
    for bug, margin in (("always_accept", 4), ("recover_from_p", 2)):
        tv_first, tv_joint, impossible = _check(*_numpy_speculative(drafts, q, num_draft, p, rng, **{bug: True}),
                                                p, rng)
        assert tv_joint > margin * TV_JOINT, (bug, tv_first, tv_joint)
        if name == "top_k" and bug == "always_accept":
            assert impossible > 0  # drafts of excluded tokens got through


# --- 4. deterministic drafts reproduce plain sampling ------------------------------------------------------

def test_deterministic_drafts_reproduce_plain_sampling():
    counts = []
    for seed in range(3):
        rng, rows, logits, num_draft, seeds, positions = _case(20 + seed)
        params = _params(rows)
        plain = _plain(seeds, positions, logits, params)  # [B, K+1]
        drafts = np.where(rng.random((B, K)) < 0.8, plain[:, :K], rng.integers(0, V, (B, K)))
        tokens, num = _run(seeds, logits, drafts, None, num_draft, params, positions)
        matches = np.cumprod((drafts == plain[:, :K]) & (np.arange(K) < num_draft[:, None]), axis=1).sum(1)
        np.testing.assert_array_equal(num, matches + 1)
        for b in range(B):
            np.testing.assert_array_equal(tokens[b, : num[b]], plain[b, : num[b]])
        counts += list(num)
    assert len(set(counts)) >= 4  # short and long runs alike


def test_probabilistic_last_token_is_plain_sampling():
    """A bonus token is the plain-decoding token. With q >= p everywhere the residual max(0, p - q) is empty,
    so a recovered token comes from p as well: every row's last token is then plain sampling."""
    last_kinds = []
    for seed in range(3):
        rng, rows, logits, num_draft, seeds, positions = _case(30 + seed)
        params = _params(rows)
        p = np.asarray(processed_probs(jnp.asarray(logits[:, :K]), params), np.float64)
        drafts = _sample_from(rng, p)
        # q = 1.2 p: each draft is accepted with probability 1/1.2.
        tokens, num = _run(seeds, logits, drafts, p * 1.2, num_draft, params, positions)
        plain = _plain(seeds, positions, logits, params)
        rows_ = np.arange(B)
        np.testing.assert_array_equal(tokens[rows_, num - 1], plain[rows_, num - 1])
        last_kinds += list(num == num_draft + 1)
    assert 3 <= sum(last_kinds) <= len(last_kinds) - 3  # bonus and recovered tokens both checked


# --- 5. greedy -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("probabilistic", [False, True])
def test_greedy_takes_longest_argmax_prefix(probabilistic):
    rng, _, logits, num_draft, seeds, positions = _case(5)
    logits[0, :, 3] = logits[0, :, 7] = 10.0  # ties: the first index wins, as plain greedy decoding picks
    best = logits.argmax(-1)
    drafts = np.where(rng.random((B, K)) < 0.8, best[:, :K], (best[:, :K] + 1) % V)
    probs = rng.dirichlet(np.ones(V), (B, K)) if probabilistic else None
    tokens, num = _run(seeds, logits, drafts, probs, num_draft, SamplingParams().broadcast(B), positions)
    for b in range(B):
        n = 0
        while n < num_draft[b] and drafts[b, n] == best[b, n]:
            n += 1
        assert num[b] == n + 1
        np.testing.assert_array_equal(tokens[b], list(best[b, : n + 1]) + [-1] * (K - n))
    assert tokens[0, 0] == 3 and num[0] == 1  # num_draft = 0: just the argmax of position 0
    assert len(set(num)) >= 3


@pytest.mark.parametrize("probabilistic", [False, True])
def test_greedy_rows_unaffected_by_sampled_neighbours(probabilistic):
    """Rows 0 and 3 greedy in a sampled batch; the same rows alone (copies fill the batch, so an all-greedy
    batch takes the fast path) give the same result, and so do the sampled rows without the greedy ones."""
    rows = [ROWS[i] for i in (0, 1, 2, 6, 4, 5)]
    rng, rows, logits, num_draft, seeds, positions = _case(6, rows)
    drafts = np.where(rng.random((B, K)) < 0.7, logits[:, :K].argmax(-1), rng.integers(0, V, (B, K)))
    probs = rng.dirichlet(np.ones(V), (B, K)) if probabilistic else None

    def run(idx):  # the rows idx, repeated to fill the batch
        idx = np.resize(idx, B)
        return _run(seeds[idx], logits[idx], drafts[idx], None if probs is None else probs[idx], num_draft[idx],
                    _params([rows[i] for i in idx]), positions[idx])

    mixed_tokens, mixed_num = run(np.arange(B))
    for group in ([0], [3], [0, 3], [1, 2, 4, 5]):
        tokens, num = run(np.array(group))
        idx = np.resize(group, B)
        np.testing.assert_array_equal(tokens, mixed_tokens[idx])
        np.testing.assert_array_equal(num, mixed_num[idx])
    assert np.any(mixed_num[[0, 3]] > 1)  # a greedy row accepted drafts


# --- 6 and 7. jit, vmap, K = 0, padding --------------------------------------------------------------------

@pytest.mark.parametrize("probabilistic", [False, True])
def test_vmap_over_calls_matches_a_loop(probabilistic):
    calls = 3
    cases = [_case(40 + c, rows=[ROWS[0]] * B if c == 0 else None) for c in range(calls)]  # call 0 all-greedy
    logits = np.stack([c[2] for c in cases])
    num_draft = np.stack([c[3] for c in cases])
    seeds, positions = np.stack([c[4] for c in cases]), np.stack([c[5] for c in cases])
    rng = np.random.default_rng(8)
    drafts = np.where(rng.random((calls, B, K)) < 0.7, logits[..., :K, :].argmax(-1),
                      rng.integers(0, V, (calls, B, K))).astype(np.int32)
    probs = rng.dirichlet(np.ones(V), (calls, B, K)).astype(np.float32) if probabilistic else None
    params = [_params(c[1]) for c in cases]

    batched = jax.jit(jax.vmap(lambda ky, lg, dr, pr, nd, sp, pos: rejection_sample(ky, lg, dr, pr, nd, sp,
                                                                                    positions=pos)))
    tokens, num = batched(jax.vmap(_seed_keys)(seeds), jnp.asarray(logits), jnp.asarray(drafts),
                          None if probs is None else jnp.asarray(probs), jnp.asarray(num_draft, jnp.int32),
                          jax.tree.map(lambda *x: jnp.stack(x), *params), jnp.asarray(positions, jnp.int32))
    for c in range(calls):
        want_tokens, want_num = _run(seeds[c], logits[c], drafts[c], None if probs is None else probs[c],
                                     num_draft[c], params[c], positions[c])
        np.testing.assert_array_equal(np.asarray(tokens[c]), want_tokens)
        np.testing.assert_array_equal(np.asarray(num[c]), want_num)


def test_output_padding_and_counts():
    for seed in range(3):
        rng, rows, logits, num_draft, seeds, positions = _case(10 + seed)
        logits[..., :3] += 3.0
        drafts = rng.integers(0, 3, (B, K))  # likely tokens: some accepted
        for probs in (None, rng.dirichlet(np.ones(V), (B, K))):
            tokens, num = _run(seeds, logits, drafts, probs, num_draft, _params(rows), positions)
            assert tokens.shape == (B, K + 1) and tokens.dtype == np.int32 and num.dtype == np.int32
            assert np.all((num >= 1) & (num <= num_draft + 1))
            emitted = np.arange(K + 1) < num[:, None]
            assert np.all(tokens[~emitted] == -1) and np.all((tokens[emitted] >= 0) & (tokens[emitted] < V))
            accepted = np.arange(K) < num[:, None] - 1
            np.testing.assert_array_equal(tokens[:, :K][accepted], drafts[accepted])


@pytest.mark.parametrize("probabilistic", [False, True])
def test_no_drafts_is_one_plain_step(probabilistic):
    """K = 0 (the narrowest verify width): one token, exactly plain sampling; no positions means 0."""
    _, rows, logits, _, seeds, positions = _case(9)
    params = _params(rows)
    probs = jnp.zeros((B, 0, V)) if probabilistic else None
    pos = jnp.asarray(positions, jnp.int32) if probabilistic else None  # one compile per kind: vary the two
    tokens, num = verify(_seed_keys(seeds), jnp.asarray(logits[:, :1]), jnp.zeros((B, 0), jnp.int32), probs,
                         jnp.zeros(B, jnp.int32), params, positions=pos)
    np.testing.assert_array_equal(np.asarray(num), np.ones(B))
    want = _plain(seeds, positions if probabilistic else np.zeros(B, int), logits[:, :1], params)
    np.testing.assert_array_equal(np.asarray(tokens), want)
