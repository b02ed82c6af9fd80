"""The speculative loop on a tiny random model: exactness against plain decoding, commit rules, stats.

An oracle proposer that drafts the tokens plain decoding produced makes every draft accepted, so blocks of
K + 1 tokens are committed per step and stops and token budgets fall inside accepted blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.proposers.base import ChainProposer, Committed, Context, Draft
from jaxspec.shapes import bucket_shapes


@dataclasses.dataclass(frozen=True)
class OracleProposer(ChainProposer):
    """Drafts the next tokens of a known continuation (params: i32[B, R] prompt + reference output)."""

    num_speculative_tokens: int
    drafts_per_row: tuple[int, ...] | None = None  # cap per row (fewer drafts, or none, for some rows)

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        k = self.num_speculative_tokens
        idx = jnp.minimum(ctx.history_len[:, None] + jnp.arange(k), params.shape[1] - 1)
        tokens = jnp.take_along_axis(params, idx, axis=1)
        num = jnp.minimum(ctx.max_draft, k)
        if self.drafts_per_row is not None:
            num = jnp.minimum(num, jnp.asarray(self.drafts_per_row))
        return Draft(tokens=tokens, num_draft=num), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


def _run_with(lm, prompts, proposer, proposer_params, *, max_new_tokens, stop_token_ids=(), sampling=None,
              widths=None, attention_impl=None):
    spec = SpecConfig(method="custom", num_speculative_tokens=proposer.num_speculative_tokens, verify_widths=widths,
                      proposer=proposer, proposer_params=proposer_params)
    return jaxspec.generate(lm, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                            sampling=sampling or SamplingParams(), spec=spec, attention_impl=attention_impl)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, size=n).tolist() for n in (5, 17, 30, 9)]


@pytest.fixture(scope="module")
def plain(tiny_lm, prompts):
    return jaxspec.generate(tiny_lm, prompts, max_new_tokens=40)


def _reference(prompts, plain) -> jnp.ndarray:
    rows = [p + t for p, t in zip(prompts, plain.token_ids)]
    table = np.zeros((len(rows), max(map(len, rows)) + 1), np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return jnp.asarray(table)


def test_oracle_drafts_are_all_accepted(tiny_lm, prompts, plain):
    k = 4
    out = _run_with(tiny_lm, prompts, OracleProposer(k), _reference(prompts, plain), max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    s = out.stats
    assert s.accepted == s.drafted > 0
    # 39 loop tokens per row in blocks of 5: 8 steps, the last one cut to the token budget.
    assert [r.committed_per_step for r in s.rows] == [(5,) * 7 + (4,)] * 4
    assert s.acceptance_rate_per_position == (1.0,) * k
    assert s.mean_acceptance_length == pytest.approx(39 / 8)


@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_drafts_run_to_the_last_cache_slot(tiny_lm, attention_impl):
    """The cache holds the prompt and the budget and no more (no room for a draft past the row's last token):
    near the end drafts run past the last slot, their K/V are dropped, and every token equals plain decoding's.
    Both an oracle chain and a draft model (the target itself, whose own cache is the same size) draft there."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (91, 12)]
    assert bucket_shapes([91, 12], 37)[2] == 128  # the first row's last token lands on the last slot
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=37)
    oracle = _run_with(tiny_lm, prompts, OracleProposer(4), _reference(prompts, plain), max_new_tokens=37,
                       widths=(5,), attention_impl=attention_impl)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=4, draft_model=tiny_lm, verify_widths=(5,))
    drafted = jaxspec.generate(tiny_lm, prompts, max_new_tokens=37, spec=spec, attention_impl=attention_impl)
    for out in (oracle, drafted):
        assert out.token_ids == plain.token_ids
        assert out.stats.accepted == out.stats.drafted > 0
        assert out.stats.rows[0].committed_per_step == (5,) * 7 + (1,)


def test_stop_inside_an_accepted_block_ends_the_row_there(tiny_lm, prompts, plain):
    # Stop ids chosen from plain output so that rows stop at different indices, mid-block.
    stops = [[plain.token_ids[i][j]] for i, j in enumerate((3, 7, 12, 2))]
    expected = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, stop_token_ids=stops)
    out = _run_with(tiny_lm, prompts, OracleProposer(4), _reference(prompts, plain), max_new_tokens=40,
                    stop_token_ids=stops)
    assert out.token_ids == expected.token_ids
    assert out.finish_reason == ["stop"] * 4
    for row, stop in zip(out.token_ids, stops):
        assert row[-1] == stop[0] and stop[0] not in row[:-1]
    # Rows finish at different steps; nothing after a stop is counted.
    assert len({r.steps for r in out.stats.rows}) > 1
    assert out.stats.generated_tokens == sum(len(r) for r in expected.token_ids)


def test_token_budget_reached_mid_block(tiny_lm, prompts, plain):
    out = _run_with(tiny_lm, prompts, OracleProposer(4), _reference(prompts, plain), max_new_tokens=8)
    assert out.token_ids == [t[:8] for t in plain.token_ids]
    assert out.finish_reason == ["length"] * 4
    # 7 loop tokens: one block of 5, then a block cut to 2 (drafts are capped by the remaining budget).
    assert [r.committed_per_step for r in out.stats.rows] == [(5, 2)] * 4
    assert out.stats.drafted == 4 * (4 + 1)


def test_rows_with_fewer_or_no_drafts_take_part(tiny_lm, prompts, plain):
    proposer = OracleProposer(4, drafts_per_row=(0, 1, 4, 2))
    out = _run_with(tiny_lm, prompts, proposer, _reference(prompts, plain), max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    assert [max(r.committed_per_step) for r in out.stats.rows] == [1, 2, 5, 3]


@pytest.mark.parametrize("widths", [(1, 5), (1, 2, 3, 5), (5,)])
def test_verify_widths_do_not_change_output(tiny_lm, prompts, plain, widths):
    proposer = OracleProposer(4, drafts_per_row=(0, 1, 4, 2))
    out = _run_with(tiny_lm, prompts, proposer, _reference(prompts, plain), max_new_tokens=40, widths=widths)
    assert out.token_ids == plain.token_ids


def test_plain_greedy_equals_teacher_forced_argmax(tiny_lm, prompts, plain):
    """The reference every speculative test compares with, checked on its own: each generated token is the
    argmax of one forward over the prompt and the tokens before it."""
    for prompt, row in zip(prompts, plain.token_ids):
        seq = jnp.asarray([prompt + row], jnp.int32)
        positions = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
        out, _ = tiny_lm.module(seq, positions, tiny_lm.module.new_cache(1, seq.shape[1] + 1))
        argmax = np.asarray(jnp.argmax(out.logits[0], axis=-1))
        assert row == argmax[len(prompt) - 1: len(prompt) - 1 + len(row)].tolist()


@pytest.mark.parametrize("spec", [
    SpecConfig(method="ngram", num_speculative_tokens=3, min_match=1),
    SpecConfig(method="ngram", num_speculative_tokens=5, draft_per_match=1.0, verify_widths=(1, 3, 6)),
    SpecConfig(method="sam", num_speculative_tokens=4, min_match=1),
    SpecConfig(method="self_draft", num_speculative_tokens=3, self_draft_layers=1),
], ids=lambda s: f"{s.method}-k{s.num_speculative_tokens}")
def test_greedy_speculative_equals_plain(tiny_lm, prompts, plain, spec):
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.generated_tokens == plain.stats.generated_tokens
    # It cannot pass by never drafting: drafts were made, some accepted, and fewer steps than tokens.
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert out.stats.row_steps < plain.stats.row_steps


@pytest.mark.parametrize("method", ["ngram", "sam"])
def test_seeded_sampling_is_the_same_with_and_without_lookup_speculation(tiny_lm, prompts, method):
    # Deterministic drafts are verified against the target's own position-keyed sample, so a seeded run
    # reproduces plain sampling token for token (mixed greedy and sampled rows, every filter).
    sampling = [SamplingParams(temperature=0.9, seed=1), SamplingParams(),
                SamplingParams(temperature=1.3, top_k=5, seed=7), SamplingParams(temperature=0.7, top_p=0.8,
                                                                                 min_p=0.05, seed=3)]
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=sampling)
    spec = SpecConfig(method=method, num_speculative_tokens=4, min_match=1)
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=sampling, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


def _exact_joint(lm, prompt, sampling, length):
    """{token sequence: probability} of the first `length` sampled tokens, by teacher-forced forwards."""
    def next_probs(seqs):
        rows = np.array([prompt + list(q) for q in seqs], np.int32)
        cache = lm.module.new_cache(len(rows), 64)
        positions = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
        out, _ = lm.module(jnp.asarray(rows), jnp.asarray(positions), cache)
        return np.asarray(jaxspec.processed_probs(out.logits[:, -1], sampling))

    joint = {(): 1.0}
    for _ in range(length):
        seqs = list(joint)
        probs = next_probs(seqs)
        joint = {q + (t,): joint[q] * p[t] for q, p in zip(seqs, probs) for t in np.flatnonzero(p > 0)}
    return joint


def test_draft_model_with_sampling_matches_the_target_distribution(tiny_lm):
    """2048 seeds of one prompt: the first three tokens of a run with a probabilistic draft model follow the
    exact joint distribution of the target (computed by teacher forcing); the same test tells the draft
    model's own distribution apart (negative control)."""
    num, prompt = 2048, [3, 14, 15, 92, 65]
    target = SamplingParams(temperature=1.0, top_k=3)
    exact = _exact_joint(tiny_lm, prompt, target, 3)  # 27 sequences

    speculative_stats = {}

    def empirical(lm, spec):
        sampling = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(num)]
        out = jaxspec.generate(lm, [prompt] * num, max_new_tokens=3, sampling=sampling, spec=spec)
        speculative_stats.update(accepted=out.stats.accepted, drafted=out.stats.drafted)
        seqs, counts = np.unique(np.array(out.token_ids), axis=0, return_counts=True)
        return {tuple(int(t) for t in q): c / num for q, c in zip(seqs, counts)}

    def tv(a, b):
        return 0.5 * sum(abs(a.get(q, 0.0) - b.get(q, 0.0)) for q in set(a) | set(b))

    # The draft: the target with a sharpened LM head, so q ranks tokens like p but is far from it.
    draft = dataclasses.replace(tiny_lm, name="sharpened", params=jax.tree.map(lambda x: x, tiny_lm.params))
    draft.params["lm_head"].set_value(tiny_lm.params["lm_head"].get_value() * 50)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=2, draft_model=draft)
    speculative = empirical(tiny_lm, spec)
    assert 0 < speculative_stats["accepted"] < speculative_stats["drafted"]
    # 2048 draws over 27 cells: the expected TV of a correct sampler is ~0.04.
    assert tv(speculative, exact) < 0.08
    # Negative control: what a verifier that accepted every draft would emit, the draft model's own samples.
    control = empirical(draft, None)
    print(f"TV speculative {tv(speculative, exact):.3f}, control {tv(control, exact):.3f}")
    assert tv(control, exact) > 0.12


def test_spec_config_errors_name_the_value():
    with pytest.raises(ValueError, match="method='lookahead'"):
        SpecConfig(method="lookahead")
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        SpecConfig(method="ngram", num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SpecConfig(method="sam", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="verify_widths"):
        SpecConfig(method="sam", num_speculative_tokens=4, verify_widths=(1, 4))
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig(method="draft_model")


def test_generate_rejects_bad_spec_and_mismatched_draft_vocab(tiny_lm, smollm2):
    with pytest.raises(ValueError, match="spec="):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=2, spec="sam")
    with pytest.raises(ValueError, match="vocab_size"):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=2,
                         spec=SpecConfig(method="draft_model", num_speculative_tokens=2, draft_model=smollm2))
    with pytest.raises(ValueError, match="self_draft_layers=3"):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=2,
                         spec=SpecConfig(method="self_draft", num_speculative_tokens=2, self_draft_layers=3))
