"""Draft vocabularies (FR-Spec): the frequency ranking, heads drafting over its first N ids, and losslessness.

On the tiny random model each head file is copied beside a ranking of its own (`<head>.draft_vocab.json`); on
the real model the shipped heads draft over the shipped ranking (models/weights/smollm2-135m.draft_vocab.json).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.builders import draft_readout
from jaxspec.decode import propose_once
from jaxspec.models.heads import WEIGHTS_DIR, load_draft_vocab, save_draft_vocab
from jaxspec.proposers.base import Proposer
from jaxspec.train import draft_vocab
from jaxspec.train.prompts import humaneval_split
from test_hardening import _exact_pairs

VOCAB = 97  # the tiny model's
N = 40  # the tiny model's draft vocabulary in most tests here


# ----------------------------------------------------------------------------------------------- the ranking


def test_rank_mixes_sources_by_frequency_puts_specials_first_and_breaks_ties_by_id():
    big = np.zeros(10, np.int64)
    big[[3, 4]] = [1000, 10]  # a large source: shares 0.99 and 0.01
    small = np.zeros(10, np.int64)
    small[[5, 6]] = [1, 1]  # a small one: shares 0.5 and 0.5, a tie
    ranking = draft_vocab.rank({"big": big, "small": small}, specials=[9, 2])
    # Mixture scores: 3 -> 0.495, 5 and 6 -> 0.25 each (tie: lower id first), 4 -> 0.005; then unseen ids by id.
    assert ranking.tolist() == [9, 2, 3, 5, 6, 4, 0, 1, 7, 8]
    assert ranking.dtype == np.int32
    weighted = draft_vocab.rank({"big": big, "small": small}, specials=[], weights={"big": 1.0, "small": 0.0})
    assert weighted.tolist()[:2] == [3, 4]
    assert draft_vocab.rank({"big": big, "small": small}, specials=[9, 2]).tolist() == ranking.tolist()


def test_coverage_counts_each_sources_tokens_among_the_first_n():
    counts = {"a": np.array([5, 3, 2, 0]), "b": np.array([0, 0, 1, 1])}
    ranking = np.array([0, 2, 1, 3])
    assert draft_vocab.coverage(ranking, counts, [1, 2]) == {"1": {"a": 0.5, "b": 0.0}, "2": {"a": 0.7, "b": 0.5}}


@pytest.mark.real_model
def test_build_counts_the_corpus_with_stop_and_chat_specials_first(smollm2, tmp_path):
    """On a two-file "standard library": the test folder is skipped, the stop tokens and the chat template's
    special tokens come first, frequent tokens rank above unseen ones, and two builds agree exactly."""
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "skipped.py").write_text("zebra_quagga_okapi = 1\n" * 50)
    (tmp_path / "lib.py").write_text('"""Module docs."""\n# a comment\n\ndef spam(eggs):\n'
                                     '    """Return the spam of eggs, for every egg there is in the basket."""\n'
                                     '    return eggs\n' + "spam = spam\n" * 40)
    tok = smollm2.tokenizer
    ranking, meta = draft_vocab.build(tok, smollm2.config.vocab_size, stdlib_root=tmp_path)
    again, meta_again = draft_vocab.build(tok, smollm2.config.vocab_size, stdlib_root=tmp_path)
    assert ranking.tolist() == again.tolist() and meta == meta_again
    assert sorted(ranking.tolist()) == list(range(smollm2.config.vocab_size))
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert meta["specials"][: len(tok.eos_token_ids)] == list(tok.eos_token_ids)
    assert {im_start, im_end} <= set(meta["specials"])
    assert ranking[: len(meta["specials"])].tolist() == meta["specials"]
    assert meta["corpus"]["stdlib"]["texts"] == 1  # lib.py; test/ is left out
    assert meta["corpus"]["humaneval"]["texts"] == len(humaneval_split()[0])
    assert meta["corpus"]["chat"]["texts"] == len(humaneval_split()[0]) + 1  # + spam explained by its docstring
    position = np.argsort(ranking)
    spam = tok.encode(" spam")[0]
    zebra = tok.encode("zebra_quagga_okapi")
    assert position[spam] < 2048
    assert all(position[t] > position[spam] for t in zebra if t != spam)
    shares = [meta["coverage"][str(n)]["stdlib"] for n in draft_vocab.COVERAGE_SIZES]
    assert shares == sorted(shares) and shares[-1] == 1.0


def test_shipped_ranking_records_how_it_was_made():
    path = WEIGHTS_DIR / "smollm2-135m.draft_vocab.json"
    meta = json.loads(path.read_text())
    ids = load_draft_vocab(path, 49152)
    assert sorted(ids.tolist()) == list(range(49152))  # the whole vocabulary: any N in [1, V] works
    assert ids[: len(meta["specials"])].tolist() == meta["specials"]
    assert meta["model"] == "smollm2-135m" and meta["command"].startswith("python -m jaxspec.train.draft_vocab")
    assert set(meta["corpus"]) == set(draft_vocab.SOURCES)
    assert all(meta["corpus"][s]["tokens"] > 10_000 for s in draft_vocab.SOURCES)
    assert meta["coverage"]["4096"]["humaneval"] > 0.95


def test_save_and_load_check_the_ranking(tmp_path):
    path = save_draft_vocab(tmp_path / "r.draft_vocab.json", [3, 1, 2], vocab_size=4, metadata={"note": "x"})
    assert load_draft_vocab(path, 4).tolist() == [3, 1, 2]
    assert json.loads(path.read_text())["note"] == "x"
    with pytest.raises(ValueError, match="vocab_size=4"):
        load_draft_vocab(path, 5)
    with pytest.raises(ValueError, match="repeats"):
        save_draft_vocab(tmp_path / "bad.json", [1, 1], vocab_size=4)
    with pytest.raises(ValueError, match="token id 4"):
        save_draft_vocab(tmp_path / "bad.json", [0, 4], vocab_size=4)


# ------------------------------------------------------------------------------------ the tiny model's heads


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 17, 30, 9)]


@pytest.fixture(scope="module")
def plain(tiny_lm, prompts):
    return jaxspec.generate(tiny_lm, prompts, max_new_tokens=40)


@pytest.fixture(scope="module")
def ranked_heads(head_files, plain, tmp_path_factory):
    """Copies of the tiny heads, each beside a ranking of the tokens plain decoding emits (by frequency)."""
    counts = np.bincount(np.concatenate(plain.token_ids), minlength=VOCAB)
    ranking = draft_vocab.rank({"plain": counts}, specials=[])
    root = tmp_path_factory.mktemp("ranked")
    out = {}
    for kind, path in head_files.items():
        shutil.copy(path, root / path.name)
        shutil.copy(path.with_suffix(".json"), root / path.with_suffix(".json").name)
        save_draft_vocab((root / path.name).with_suffix(".draft_vocab.json"), ranking, vocab_size=VOCAB)
        out[kind] = root / path.name
    return out, ranking


SPECS = [
    dict(method="medusa", num_speculative_tokens=7),
    dict(method="eagle", num_speculative_tokens=4),
    dict(method="eagle", num_speculative_tokens=8, tree_depth=3, tree_top_k=3),
    dict(method="eagle2", num_speculative_tokens=9, tree_depth=4, tree_top_k=3),
]
SPEC_IDS = ["medusa", "eagle", "eagle-static", "eagle2"]


def _spec(ranked_heads, kwargs, n=N) -> SpecConfig:
    files, _ = ranked_heads
    kind = "medusa" if kwargs["method"] == "medusa" else "eagle"
    return SpecConfig(head_path=str(files[kind]), draft_vocab=n, **kwargs)


@pytest.mark.parametrize("kwargs", SPECS, ids=SPEC_IDS)
def test_reduced_vocab_greedy_equals_plain(tiny_lm, prompts, plain, ranked_heads, kwargs):
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, spec=_spec(ranked_heads, kwargs))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    # A draft vocabulary that leaves out most of what the target emits still changes nothing but acceptance.
    few = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, spec=_spec(ranked_heads, kwargs, n=3))
    assert few.token_ids == plain.token_ids and few.stats.drafted > 0


def _first_draft(lm, prompts, spec, sampling):
    """The Draft `propose` returns right after prefill, as the loop calls it; the Prepared; the state."""
    p = jaxspec.prepare(lm, prompts, max_new_tokens=8, spec=spec, sampling=sampling)
    state = jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                            spec=p.prefill_spec)
    draft, _ = jax.jit(propose_once, static_argnums=0)(p.proposer, p.proposer_params, state, p.rows)
    return draft, p, state


@pytest.mark.parametrize("kwargs", SPECS, ids=SPEC_IDS)
def test_drafts_are_target_ids_of_the_draft_vocabulary(tiny_lm, prompts, ranked_heads, kwargs):
    _, ranking = ranked_heads
    draft, p, _ = _first_draft(tiny_lm, prompts, _spec(ranked_heads, kwargs), SamplingParams())
    readout = p.proposer_params["readout"]
    assert readout.lm_head.shape == (tiny_lm.config.hidden_size, N)
    assert np.asarray(readout.ids).tolist() == ranking[:N].tolist()
    assert set(np.asarray(draft.tokens).ravel().tolist()) <= set(ranking[:N].tolist())


def test_sampled_chain_probs_are_the_distribution_over_exactly_the_draft_vocabulary(tiny_lm, prompts, ranked_heads):
    """Temperature 1: each draft's q is a distribution over target ids, zero outside the N ids, and it is the
    head's own processed distribution over those N columns (step 0 reads the prefill's prediction)."""
    _, ranking = ranked_heads
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(len(prompts))]
    draft, _, state = _first_draft(tiny_lm, prompts, _spec(ranked_heads, SPECS[1]), sampling)
    probs = np.asarray(draft.probs, np.float64)  # [B, K, V]
    assert probs.shape == (len(prompts), 4, VOCAB)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    outside = np.setdiff1d(np.arange(VOCAB), ranking[:N])
    assert np.all(probs[..., outside] == 0)
    tokens = np.asarray(draft.tokens)
    assert np.all(np.take_along_axis(probs, tokens[..., None], axis=-1) > 0)  # each draft was drawable
    # Step 0's q is the softmax of the full LM head's logits at the head's prediction, taken at the N ids.
    full = np.asarray(state.pstate.pred @ tiny_lm.params["lm_head"][...], np.float64)[:, ranking[:N]]  # [B, N]
    expected = np.exp(full - full.max(-1, keepdims=True))
    np.testing.assert_allclose(probs[:, 0][:, ranking[:N]], expected / expected.sum(-1, keepdims=True), atol=1e-5)


@dataclasses.dataclass(frozen=True)
class RewrittenQ(Proposer):
    """Negative controls: a head's proposer whose sampled drafts reach verification with their q rewritten by
    `rewrite(probs f32[B, K, V], params) -> f32[B, K, V]`, the drafts themselves unchanged."""

    inner: Proposer
    rewrite: Callable
    needs_features: bool = True

    @property
    def num_speculative_tokens(self) -> int:
        return self.inner.num_speculative_tokens

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.inner.feature_layers

    @property
    def max_depth(self) -> int:
        return self.inner.max_depth

    def init(self, params, ctx):
        return self.inner.init(params, ctx)

    def propose(self, params, pstate, ctx, keys):
        draft, pstate = self.inner.propose(params, pstate, ctx, keys)
        return draft.replace(probs=self.rewrite(draft.probs, params)), pstate

    def update(self, params, pstate, ctx, committed):
        return self.inner.update(params, pstate, ctx, committed)


def unscattered(probs, params):
    """The restricted chain's q *not* scattered back to target ids: column j's probability left at id j (what
    forgetting the draft-to-target map in q would do)."""
    ids = params["readout"].ids
    columns = jnp.take(probs, ids, axis=-1)  # f32[B, K, N] the distribution over the N columns
    return jnp.zeros_like(probs).at[..., : ids.shape[0]].set(columns)


ROWS = 2048
PROMPT = [3, 14, 15, 92, 65]


def _second_token_p(lm, spec, exact) -> tuple[float, object]:
    """Chi-square p-value of the second generated token (the first one drafted) of ROWS seeded rows against its
    exact marginal; cells expecting fewer than 5 draws are pooled."""
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(ROWS)]
    out = jaxspec.generate(lm, [PROMPT] * ROWS, max_new_tokens=3, sampling=sampling, spec=spec, ignore_eos=True)
    observed = np.bincount([row[1] for row in out.token_ids], minlength=VOCAB).astype(np.float64)
    expected = ROWS * exact / exact.sum()
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(observed, expected).pvalue), out.stats


def test_sampled_reduced_vocab_chain_follows_the_target_distribution(tiny_lm, ranked_heads):
    """2048 seeded rows at temperature 1 (the tiny model's p is spread over the whole vocabulary; the draft's q
    over N = 40 ids): the first drafted token follows the target's exact marginal (teacher-forced) by a
    chi-square test, though most of the target's mass lies outside the draft vocabulary and must come from the
    residual. The same chain with its q left unscattered (negative control) fails the test."""
    exact = np.zeros(VOCAB)
    for (_, t1), prob in _exact_pairs(tiny_lm, PROMPT, SamplingParams(temperature=1.0)).items():
        exact[t1] += prob
    spec = _spec(ranked_heads, dict(method="eagle", num_speculative_tokens=2))
    p_value, run = _second_token_p(tiny_lm, spec, exact)
    assert run.drafted > 0 and 0 < run.accepted < run.drafted

    p = jaxspec.prepare(tiny_lm, [PROMPT] * ROWS, max_new_tokens=3, spec=spec)
    control = SpecConfig(method="custom", num_speculative_tokens=2, proposer=RewrittenQ(p.proposer, unscattered),
                         proposer_params=p.proposer_params)
    control_p, control_run = _second_token_p(tiny_lm, control, exact)
    print(f"chi-square p: scattered q {p_value:.3g}, unscattered q {control_p:.3g}")
    assert control_run.drafted > 0
    assert p_value > 1e-3
    assert control_p < 1e-6


# ------------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_bad_draft_vocab_values_name_the_field(value):
    with pytest.raises(ValueError, match="draft_vocab="):
        SpecConfig(method="eagle", draft_vocab=value)


def test_the_default_draft_vocab_belongs_to_the_shipped_heads():
    for method in ("medusa", "eagle", "eagle2"):
        assert SpecConfig(method=method).draft_vocab == 4096
        assert SpecConfig(method=method, head_path="my/head").draft_vocab is None  # your head: full vocabulary
        assert SpecConfig(method=method, head_path="my/head", draft_vocab=512).draft_vocab == 512
    assert SpecConfig(method="sam").draft_vocab is None


def test_draft_vocab_errors_at_build_time(tiny_lm, prompts, head_files, ranked_heads, tmp_path):
    with pytest.raises(ValueError, match="draft_vocab=8 applies to the trained heads"):
        SpecConfig(method="sam", draft_vocab=8)
    with pytest.raises(ValueError, match=r"draft_vocab=98 must be in \[1, 97\]"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4, spec=_spec(ranked_heads, SPECS[1], n=98))
    with pytest.raises(ValueError, match="draft_vocab needs a token ranking"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4,
                         spec=SpecConfig(method="eagle", head_path=str(head_files["eagle"]), draft_vocab=8))
    shutil.copy(head_files["eagle"], tmp_path / "eagle.safetensors")
    shutil.copy(head_files["eagle"].with_suffix(".json"), tmp_path / "eagle.json")
    save_draft_vocab(tmp_path / "eagle.draft_vocab.json", list(range(10)), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="draft_vocab=20 exceeds the 10 ids"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4,
                         spec=SpecConfig(method="eagle", head_path=str(tmp_path / "eagle"), draft_vocab=20))


def test_full_vocab_is_the_unrestricted_readout_and_columns_are_cached(tiny_lm, ranked_heads):
    full = draft_readout(tiny_lm, _spec(ranked_heads, SPECS[1], n=VOCAB))
    assert full.ids is None and full.lm_head is tiny_lm.params["lm_head"][...]
    first = draft_readout(tiny_lm, _spec(ranked_heads, SPECS[1]))
    assert draft_readout(tiny_lm, _spec(ranked_heads, SPECS[2])).lm_head is first.lm_head


# ------------------------------------------------------------------------------------- the real model's heads


@pytest.fixture(scope="module")
def held_out(smollm2):
    prompts = [smollm2.tokenizer.encode(p) for p in humaneval_split()[1][:2]]
    return prompts, jaxspec.generate(smollm2, prompts, max_new_tokens=32)


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle2"])
def test_shipped_heads_with_the_shipped_ranking_greedy_equal_plain(smollm2, held_out, method):
    """The methods' default: the shipped heads draft over the first 4096 ids of the shipped ranking."""
    prompts, plain = held_out
    spec = SpecConfig(method=method)
    assert spec.draft_vocab == 4096
    assert draft_readout(smollm2, spec).lm_head.shape == (smollm2.config.hidden_size, 4096)
    out = jaxspec.generate(smollm2, prompts, max_new_tokens=32, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert out.stats.mean_acceptance_length > 1.4
