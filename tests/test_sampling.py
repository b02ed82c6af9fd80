"""The processed distribution (temperature, top-k, top-p, min-p, greedy) and seeded sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import SamplingParams, process_logits, processed_probs, sample
from jaxspec.sampling import TOP_CANDIDATES, VOCAB_BLOCKS, argmax, categorical, draw, row_keys


def reference_probs(logits: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Plain scalar numpy version of the processing rules for one row."""
    logits = logits.astype(np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    k = top_k if top_k > 0 else len(z)
    p = np.exp(z[order[:k]] - z[order[0]])
    p /= p.sum()
    mass = 0.0
    for rank, idx in enumerate(order[:k]):
        if mass < top_p:
            keep[idx] = True
        mass += p[rank]
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if min_p > 0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


ROWS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.9, 8, 0.6, 0.05),
    (0.0, 3, 0.5, 0.2),  # greedy wins over the rest
]


def _params(rows):
    return SamplingParams.stack([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows])


def test_processed_probs_match_scalar_reference():
    logits = np.random.default_rng(0).normal(size=(len(ROWS), 40)).astype(np.float32) * 2
    got = np.asarray(jax.jit(processed_probs)(jnp.asarray(logits), _params(ROWS)))
    for b, row in enumerate(ROWS):
        np.testing.assert_allclose(got[b], reference_probs(logits[b], *row), atol=1e-5, err_msg=str(row))


def test_process_logits_handles_extra_axes():
    """[B, K, V] logits with per-row settings, as verification of K+1 positions needs."""
    logits = np.random.default_rng(1).normal(size=(len(ROWS), 3, 30)).astype(np.float32)
    got = np.asarray(jax.nn.softmax(process_logits(jnp.asarray(logits), _params(ROWS)), -1))
    for b, row in enumerate(ROWS):
        for k in range(3):
            np.testing.assert_allclose(got[b, k], reference_probs(logits[b, k], *row), atol=1e-5)


def _empirical(logits, params, num=20000):
    keys = jax.random.split(jax.random.key(0), num)
    draw = jax.jit(jax.vmap(lambda k: sample(k[None], logits[None], params)[0]))
    counts = np.bincount(np.asarray(draw(keys)), minlength=logits.shape[-1])
    return counts / num


@pytest.mark.parametrize("row", ROWS[1:6])
def test_sample_follows_processed_distribution(row):
    """Total variation between 20k draws and the processed distribution stays within sampling noise."""
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(12,)).astype(np.float32))
    params = SamplingParams(temperature=row[0], top_k=row[1], top_p=row[2], min_p=row[3]).broadcast(1)
    target = reference_probs(np.asarray(logits), *row)
    tv = 0.5 * np.abs(_empirical(logits, params) - target).sum()
    assert tv < 0.02, tv  # noise level for 20k draws over 12 outcomes is about 0.01


def test_negative_control_unfiltered_sampling_is_detected():
    """The same test rejects a sampler that ignores top-k: the check can fail."""
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(12,)).astype(np.float32))
    unfiltered = SamplingParams(temperature=0.7).broadcast(1)
    target = reference_probs(np.asarray(logits), 0.7, 5, 1.0, 0.0)
    tv = 0.5 * np.abs(_empirical(logits, unfiltered) - target).sum()
    assert tv > 0.05, tv


def test_greedy_rows_take_argmax_in_a_sampled_batch():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(len(ROWS), 50)).astype(np.float32))
    keys = row_keys(jnp.arange(len(ROWS), dtype=jnp.uint32), jnp.zeros(len(ROWS), jnp.int32))
    tokens = np.asarray(sample(keys, logits, _params(ROWS)))
    assert tokens[0] == np.argmax(logits[0]) and tokens[6] == np.argmax(logits[6])


def test_row_keys_depend_only_on_seed_and_position():
    a = row_keys(jnp.asarray([7, 1, 2], jnp.uint32), jnp.asarray([10, 3, 4]))
    b = row_keys(jnp.asarray([5, 7], jnp.uint32), jnp.asarray([0, 10]))
    assert np.array_equal(jax.random.key_data(a[0]), jax.random.key_data(b[1]))
    assert not np.array_equal(jax.random.key_data(a[0]), jax.random.key_data(a[1]))


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                         ("min_p", 1.2), ("temperature", float("nan"))])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 1000, 300])
def test_argmax_is_the_first_largest_logit(vocab):
    """The blocked search (vocabularies a block size divides: 512, 256, 128 here) and the whole-vocabulary one
    (1000, 300) both return numpy's argmax: the first index on ties, within a block, across blocks, and in
    rows of -inf logits."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((4, 3, vocab)).astype(np.float32)
    top = float(logits.max()) + 1.0
    logits[0, 0, [vocab - 1, 5, vocab // 2]] = top  # ties in different blocks: the first wins
    logits[0, 1, [7, 6]] = top  # ties in one block
    logits[1, 0, :] = -np.inf  # nothing to choose: index 0, as numpy
    logits[1, 1, vocab - 1] = top  # the very last logit
    logits[2, 2, :] = 0.0  # all equal
    got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    blocked = any(vocab % b == 0 and vocab >= 4 * b for b in VOCAB_BLOCKS)
    assert blocked == (vocab >= 32000)


def _support_logits(vocab: int, support: np.ndarray, seed: int) -> np.ndarray:
    """f32[V]: random finite logits on `support`, -inf elsewhere."""
    logits = np.full(vocab, -np.inf, np.float32)
    logits[support] = np.random.default_rng(seed).normal(size=len(support)) * 1.5
    return logits


def _draw_counts(logits: np.ndarray, num: int = 50000) -> np.ndarray:
    keys = jax.random.split(jax.random.key(11), num)
    draw = jax.jit(lambda k: categorical(k, jnp.broadcast_to(jnp.asarray(logits), (num, logits.shape[-1]))))
    return np.bincount(np.asarray(draw(keys)), minlength=logits.shape[-1])


# A support across blocks of 512: both edges of blocks, the first and last token, an empty block (1024-1535).
SUPPORT = np.array([0, 3, 200, 510, 511, 512, 513, 700, 1000, 1023, 1536, 1600, 1800, 2000, 2046, 2047])


@pytest.mark.parametrize("vocab", [2048, 1000])
def test_categorical_follows_softmax(vocab):
    """Blocked (2048: four blocks of 512) and whole (1000) inverse transforms: 50k draws are within sampling
    noise of softmax(logits), and tokens of probability zero are never drawn."""
    support = SUPPORT[SUPPORT < vocab]
    logits = _support_logits(vocab, support, seed=vocab)
    counts = _draw_counts(logits)
    assert counts.sum() == counts[support].sum()  # nothing outside the support
    target = np.exp(logits[support] - logits[support].max())
    target /= target.sum()
    tv = 0.5 * np.abs(counts[support] / counts.sum() - target).sum()
    assert tv < 0.02, tv  # noise for 50k draws over 16 outcomes is about 0.007


def test_negative_control_categorical_check_detects_a_shifted_block():
    """The same check fails against a distribution whose third block holds 1.5 times its mass: it can fail."""
    logits = _support_logits(2048, SUPPORT, seed=2048)
    counts = _draw_counts(logits)
    wrong = logits.copy()
    wrong[1536:] += np.log(1.5)
    target = np.exp(wrong[SUPPORT] - wrong[SUPPORT].max())
    target /= target.sum()
    tv = 0.5 * np.abs(counts[SUPPORT] / counts.sum() - target).sum()
    assert tv > 0.04, tv


def test_categorical_edge_rows_and_key_forms():
    """A single allowed token (the last of the vocabulary, or the first) is always drawn; rows [B, K, V] take
    keys [B, K]; raw uint32 keys draw what the typed keys they hold draw."""
    logits = np.full((3, 2, 2048), -np.inf, np.float32)
    logits[0, 0, 2047] = 5.0
    logits[0, 1, 0] = -80.0  # far below any other row's scale: only the relative values matter
    logits[1:] = np.random.default_rng(5).normal(size=(2, 2, 2048)).astype(np.float32)
    keys = jax.random.split(jax.random.key(4), (3, 2))
    got = np.asarray(jax.jit(categorical)(keys, jnp.asarray(logits)))
    assert got.shape == (3, 2) and got[0, 0] == 2047 and got[0, 1] == 0
    raw = np.asarray(jax.jit(categorical)(jax.random.key_data(keys), jnp.asarray(logits)))
    np.testing.assert_array_equal(raw, got)
    # Rows with the same key and the same logits draw the same token, whatever else is in the batch.
    alone = np.asarray(jax.jit(categorical)(keys[1:2], jnp.asarray(logits[1:2])))
    np.testing.assert_array_equal(alone, got[1:2])


def test_draw_is_categorical_of_the_processed_distribution():
    """`draw` takes a shortcut for batches that only divide by a temperature; its tokens are still those of
    categorical(process_logits), in such a batch and when one row's top-p sends the batch the long way, where
    every other row draws what it drew before."""
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(4, 3, 2048)).astype(np.float32) * 3)
    keys = jax.random.split(jax.random.key(8), (4, 3))
    plain = SamplingParams.stack([SamplingParams(temperature=t) for t in (0.5, 0.8, 1.0, 1.3)])
    reference = jax.jit(lambda k, z, s: categorical(k, process_logits(z, s)))
    shortcut = np.asarray(jax.jit(draw)(keys, logits, plain))
    np.testing.assert_array_equal(shortcut, np.asarray(reference(keys, logits, plain)))
    mixed = SamplingParams.stack([SamplingParams(temperature=t, top_p=p) for t, p in
                                  ((0.5, 1.0), (0.8, 1.0), (1.0, 0.5), (1.3, 1.0))])
    long_way = np.asarray(jax.jit(draw)(keys, logits, mixed))
    np.testing.assert_array_equal(long_way, np.asarray(reference(keys, logits, mixed)))
    np.testing.assert_array_equal(long_way[[0, 1, 3]], shortcut[[0, 1, 3]])


LARGE_VOCAB_ROWS = [  # temperature, top_k, top_p, min_p; over 2048 logits, 256 of them candidates
    (1.0, 0, 0.9, 0.0),  # peaked logits: the top-p set ends among the candidates
    (0.7, 50, 0.8, 0.0),  # top-k within the candidates
    (1.0, 0, 0.99, 0.0),  # flat logits: the top-p set runs past the candidates, so it is bisected for
    (0.8, 300, 1.0, 0.0),  # top-k larger than the candidates
    (1.0, 1000, 0.95, 0.05),
]


@pytest.mark.parametrize("together", [True, False])
def test_top_k_top_p_over_a_large_vocabulary(together):
    """Top-k and top-p decided from the largest logits (`TOP_CANDIDATES`) or, where those do not decide it, by
    bisection over the whole vocabulary, match the scalar reference: each row alone (the candidates decide the
    first two; the bisection the others) and all rows in one batch (one row needing it bisects the batch)."""
    assert TOP_CANDIDATES == 256
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(len(LARGE_VOCAB_ROWS), 2048)).astype(np.float32)
    logits[0] *= 3.0  # peaked
    logits[2] *= 0.1  # nearly flat
    batches = [list(range(len(LARGE_VOCAB_ROWS)))] if together else [[i] for i in range(len(LARGE_VOCAB_ROWS))]
    for rows in batches:
        params = _params([LARGE_VOCAB_ROWS[i] for i in rows])
        got = np.asarray(jax.jit(processed_probs)(jnp.asarray(logits[rows]), params))
        for j, i in enumerate(rows):
            np.testing.assert_allclose(got[j], reference_probs(logits[i], *LARGE_VOCAB_ROWS[i]), atol=1e-5,
                                       err_msg=str(LARGE_VOCAB_ROWS[i]))
    kept = [int((reference_probs(logits[i], *row) > 0).sum()) for i, row in enumerate(LARGE_VOCAB_ROWS)]
    assert 1 < kept[0] < 256 and 1 < kept[1] <= 50 and kept[2] > 256 and kept[3] == 300, kept


def _sorted_threshold(z: np.ndarray, top_k: int, top_p: float) -> float:
    """The smallest logit top-k then top-p keep, by ranking one row (float64 masses)."""
    ranked = np.sort(z)[::-1][: top_k if top_k > 0 else len(z)]
    probs = np.exp(ranked.astype(np.float64) - ranked[0])
    probs /= probs.sum()
    if top_p >= 1:
        return float(ranked[-1])
    mass_before = np.cumsum(probs) - probs
    return float(ranked[np.sum(mass_before < top_p) - 1])


def test_bisected_threshold_equals_the_ranked_one():
    """The fallback for rows the candidates do not decide: with ties (logits on a 0.05 grid), masked tokens
    (-inf), negative and positive logits, top-k above and below the candidates, and top-p from tiny to 1, the
    bisection finds exactly the logit a ranking of the row finds."""
    from jaxspec.sampling import _bisected_threshold

    rng = np.random.default_rng(12)
    rows = [(0, 0.95), (0, 0.5), (0, 1.0), (300, 0.9), (300, 1.0), (1000, 0.99), (7, 0.6), (0, 1e-4), (1, 0.9),
            (2048, 0.97)]
    z = np.round(rng.normal(size=(len(rows), 2048)) * rng.uniform(0.3, 3, size=(len(rows), 1)) / 0.05) * 0.05
    z = z.astype(np.float32)
    z[:, rng.choice(2048, 100, replace=False)] = -np.inf
    z[3] -= 40.0  # all negative
    k = jnp.asarray([[r[0] if r[0] > 0 else 2048] for r in rows], jnp.int32)
    p = jnp.asarray([[r[1]] for r in rows], jnp.float32)
    got = np.asarray(jax.jit(_bisected_threshold)(jnp.asarray(z), k, p))[:, 0]
    want = [_sorted_threshold(z[i], *rows[i]) for i in range(len(rows))]
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    assert len(set(got.tolist())) == len(rows)  # the rows' thresholds differ: nothing passes by a constant
