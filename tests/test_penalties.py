"""Presence, frequency and repetition penalties: equal to recomputation from the full history, in plain and
speculative decoding (chains, trees, lookup proposers), greedy and seeded sampling; a negative control shows
the tests notice penalties that forget the drafts before a position."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec import penalties as pen
from test_speculative import OracleProposer, _reference
from test_tree_decode import TOPOLOGY, OracleTreeProposer, _known

VOCAB = 97
PENALIZED = [SamplingParams(frequency_penalty=1.5), SamplingParams(presence_penalty=2.0),
             SamplingParams(repetition_penalty=1.8), SamplingParams(),
             SamplingParams(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.3),
             SamplingParams(repetition_penalty=0.7)]  # below 1: repeats within a verified block


def _np_penalize(logits: np.ndarray, prompt: list[int], output: list[int], s: SamplingParams) -> np.ndarray:
    """The definitions, one position, in numpy."""
    z = logits.astype(np.float64).copy()
    count = np.bincount(np.asarray(output, np.int64), minlength=len(z)).astype(np.float64)
    seen = (count > 0) | np.isin(np.arange(len(z)), prompt)
    z = np.where(seen, np.where(z > 0, z / s.repetition_penalty, z * s.repetition_penalty), z)
    return z - s.frequency_penalty * count - s.presence_penalty * (count > 0)


def _next_logits(lm, seq: list[int], width: int = 96) -> np.ndarray:
    """The target's logits after `seq`, by one teacher-forced forward (right-padded to one width, so one
    compiled program serves every length)."""
    row = np.zeros((1, width), np.int32)
    row[0, : len(seq)] = seq
    out, _ = lm.module(jnp.asarray(row), jnp.arange(width, dtype=jnp.int32)[None], lm.module.new_cache(1, width))
    return np.asarray(out.logits[0, len(seq) - 1])


def _recomputed_greedy(lm, prompt: list[int], s: SamplingParams, n: int) -> list[int]:
    """Greedy decoding by forwards over the whole history, the penalties applied in numpy from the history."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(_np_penalize(_next_logits(lm, prompt + out), prompt, out, s))))
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 15, 4, 11, 9, 6)]


@pytest.fixture(scope="module")
def plain(tiny_lm, prompts):
    return jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=PENALIZED)


def test_penalize_follows_the_definitions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(PENALIZED), 1, 23)).astype(np.float32) * 3
    prompts = [rng.integers(0, 23, size=5).tolist() for _ in PENALIZED]
    outputs = [rng.integers(0, 23, size=8).tolist() for _ in PENALIZED]
    counts = pen.TokenCounts.of_prompts(jnp.asarray(prompts, jnp.int32), jnp.full((len(prompts),), 5, jnp.int32), 23)
    counts = counts.add(jnp.asarray(outputs, jnp.int32), jnp.full((len(outputs),), 8, jnp.int32))
    got = pen.penalize(jnp.asarray(logits), counts.output[:, None], counts.in_prompt, SamplingParams.stack(PENALIZED))
    for i, s in enumerate(PENALIZED):
        np.testing.assert_allclose(got[i, 0], _np_penalize(logits[i, 0], prompts[i], outputs[i], s), rtol=1e-5,
                                   atol=1e-5)


def test_plain_greedy_with_penalties_equals_recomputation(tiny_lm, prompts, plain):
    for prompt, s, row in zip(prompts, PENALIZED, plain.token_ids):
        assert row == _recomputed_greedy(tiny_lm, prompt, s, len(row))
    # The penalties change the output: the same prompts without them decode differently.
    unpenalized = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32)
    changed = [a != b for a, b in zip(unpenalized.token_ids, plain.token_ids)]
    assert changed == [s != SamplingParams() for s in PENALIZED]


def _chain_spec(prompts, plain, k=5):
    return SpecConfig(method="custom", num_speculative_tokens=k, proposer=OracleProposer(k),
                      proposer_params=_reference(prompts, plain))


def _tree_spec(prompts, plain):
    proposer = OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, (0, 1, 0, 0), vocab=VOCAB)
    return SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, proposer=proposer,
                      proposer_params=_known(prompts, plain, 128))


@pytest.mark.parametrize("kind", ["oracle_chain", "oracle_tree", "ngram", "sam"])
def test_greedy_speculative_with_penalties_equals_plain(tiny_lm, prompts, plain, kind):
    spec = {"oracle_chain": lambda: _chain_spec(prompts, plain), "oracle_tree": lambda: _tree_spec(prompts, plain),
            "ngram": lambda: SpecConfig(method="ngram", num_speculative_tokens=4, min_match=1),
            "sam": lambda: SpecConfig(method="sam", num_speculative_tokens=4, min_match=1)}[kind]()
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=PENALIZED, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_seeded_sampling_with_penalties_is_the_same_with_and_without_speculation(tiny_lm, prompts):
    sampling = [SamplingParams(temperature=0.9, seed=11 + i, top_k=20, presence_penalty=s.presence_penalty,
                               frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty)
                for i, s in enumerate(PENALIZED)]
    base = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=sampling)
    for spec in (_chain_spec(prompts, base), SpecConfig(method="ngram", num_speculative_tokens=4, min_match=1)):
        out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=sampling, spec=spec)
        assert out.token_ids == base.token_ids
        assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_negative_control_penalties_that_ignore_the_drafts_break_exactness(tiny_lm, prompts, monkeypatch):
    """If a scored position saw only the committed counts (not the drafts before it), speculative output
    would differ from plain decoding: the tests above would notice. (A repetition penalty below 1 makes the
    output repeat tokens within one verified block, where the difference shows.)"""
    sampling = SamplingParams(repetition_penalty=0.7)
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=sampling)
    exact = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=sampling, spec=_chain_spec(prompts, plain))
    assert exact.token_ids == plain.token_ids

    def committed_only(counts, fed, on_path):
        return jnp.broadcast_to(counts.output[:, None, :], fed.shape + counts.output.shape[1:])

    monkeypatch.setattr(pen, "path_counts", committed_only)
    jax.clear_caches()  # the loop traced with the real path_counts is cached: trace it again
    try:
        out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, sampling=sampling,
                               spec=_chain_spec(prompts, plain))
    finally:
        jax.clear_caches()  # and drop the broken program before any other test can reuse it
    assert out.stats.accepted > 0
    assert out.token_ids != plain.token_ids


def test_logprobs_under_sampling_follow_the_penalised_distribution(tiny_lm, prompts):
    """Rollouts' "sampling" log-probabilities are under the distribution each token was drawn from: with a
    penalty, that is the penalised one (greedy rows: the token's log-probability is 0)."""
    lm = tiny_lm
    sampling = SamplingParams(temperature=1.0, frequency_penalty=2.0, seed=3)
    res = jaxspec.rollout(lm, prompts[:2], num_samples=2, max_new_tokens=12, sampling=sampling, logprobs=True)
    for p, prompt in enumerate(prompts[:2]):
        for g in range(2):
            tokens, got = res.token_ids[p][g], res.logprobs[p][g]
            for j, t in enumerate(tokens):
                z = _np_penalize(_next_logits(lm, prompt + tokens[:j]), prompt, tokens[:j], sampling)
                want = z[t] - np.log(np.sum(np.exp(z - z.max()))) - z.max()
                assert got[j] == pytest.approx(want, abs=2e-4)


def test_penalty_values_are_checked():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=float("nan"))
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
