"""Hardening: bad input gives a ValueError naming the value, and no input corrupts the output.

- SamplingParams: complete validation (types, ranges, PRNG keys, nested junk); `stack`/`broadcast` raise only
  ValueError.
- Temperatures below GREEDY_BELOW act exactly as greedy, in plain sampling and speculative verification.
- Out-of-vocabulary draft tokens never reach the target forward and are never accepted; a static automaton
  over ids the model cannot embed is rejected at the boundary.
- `generate` raises only ValueError on junk arguments.
- Sampled rows: top-k 1 is greedy at any temperature; speculation at the cache-length boundary; the draft's
  random stream is independent of the acceptance stream (a chi-square test with a negative control).

Shapes are shared on purpose (prompts of at most 16 tokens and at most 16 new tokens compile to one bucket)
so that the file compiles few programs.
"""

from __future__ import annotations

import dataclasses
import math
import runpy
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.decode import OOV_DRAFT_PLACEHOLDER
from jaxspec.proposers.base import ChainProposer, Committed, Context, Draft, Proposer
from jaxspec.proposers.draft_model import DraftModelProposer
from jaxspec.proposers.index.suffix_automaton import StaticSuffixAutomaton
from jaxspec.rejection import _ACCEPT_STREAM, rejection_sample
from jaxspec.sampling import GREEDY_BELOW, process_logits, sample
from jaxspec.shapes import bucket_shapes

VOCAB = 97  # the tiny model's
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [11, 12, 13, 14, 15]]  # repetitive, so lookup proposers draft
NEW = 12


@pytest.fixture(scope="module")
def plain(tiny_lm):
    """Plain greedy output for PROMPTS."""
    return jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=NEW, ignore_eos=True)


def _reference_table(plain) -> jnp.ndarray:
    """i32[B, R] prompt + plain greedy output per row, zero padded: what an oracle drafts from."""
    rows = [p + t for p, t in zip(PROMPTS, plain.token_ids)]
    table = np.zeros((len(rows), max(map(len, rows)) + 1), np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return jnp.asarray(table)


def _assert_in_vocab(out):
    for row in out.token_ids:
        assert all(0 <= t < VOCAB for t in row), row


# ----------------------------------------------------------------------------------------------- SamplingParams

_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")
_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(max_magnitude=2), st.text(max_size=3), st.binary(max_size=2),
    st.lists(st.one_of(st.integers(-(2**40), 2**40), st.floats(-2, 2), st.none(), st.text(max_size=1)), max_size=3),
    st.lists(st.lists(st.integers(-2, 5), max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=1), st.integers(), max_size=1),
    st.sampled_from([jax.random.key(0), jax.random.PRNGKey(1), np.array([[0.5, 1.0]]), np.array(["a"]),
                     np.array([True]), jnp.arange(3), jnp.asarray(-1.0), np.uint64(2**64 - 1), object(), (),
                     np.array([np.nan]), np.float16(0.5), np.int8(-3)]),
)
_VALID = {
    "temperature": st.one_of(st.floats(0, 1e30), st.integers(0, 5), st.just(1e-38)),
    "top_k": st.one_of(st.integers(0, 2**31 - 1), st.just(3.0)),
    "top_p": st.floats(1e-30, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.one_of(st.integers(0, 2**32 - 1), st.just(np.uint32(7))),
}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_sampling_params_fuzz_raises_only_value_error(data):
    kwargs = {name: data.draw(st.one_of(_VALID[name], _JUNK), label=name)
              for name in data.draw(st.sets(st.sampled_from(_FIELDS)), label="fields")}
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert any(f"{name}" in str(e) for name in kwargs), e  # the message names the field
        return
    for call in (lambda: params.broadcast(3), lambda: SamplingParams.stack([params, SamplingParams()])):
        try:
            rows = call()
        except ValueError:
            continue
        assert rows.seed.dtype == jnp.uint32 and rows.top_k.dtype == jnp.int32
        assert rows.temperature.shape == (rows.seed.shape[0],)


@settings(max_examples=100, deadline=None)
@given(st.fixed_dictionaries(_VALID))
def test_valid_sampling_params_construct_stack_and_broadcast(kwargs):
    params = SamplingParams(**kwargs)
    rows = SamplingParams.stack([params, params])
    wide = params.broadcast(2)
    for name in _FIELDS:
        np.testing.assert_array_equal(getattr(rows, name), getattr(wide, name))
    assert int(rows.seed[0]) == int(kwargs["seed"]) and int(rows.top_k[1]) == int(kwargs["top_k"])


@pytest.mark.parametrize("kwargs,message", [
    (dict(seed=-1), r"seed=-1 must be an integer in \[0, 2\*\*32 - 1\]"),
    (dict(seed=2**32), r"seed=4294967296"),
    (dict(top_k=2**31), r"top_k=2147483648 must be an integer in \[0, 2\*\*31 - 1\]"),
    (dict(seed=jax.random.key(0)), "seed is a PRNG key"),
    (dict(temperature="hot"), "temperature='hot'"),
    (dict(temperature=None), "temperature=None"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(top_k=True), "top_k=True"),
    (dict(top_p=0.0), r"top_p=0.0 must be a number in \(0, 1\]"),
    (dict(min_p=[0.5, 1.5]), r"min_p=\[0.5, 1.5\]"),
    (dict(seed=[[1], [2, 3]]), "seed="),
    (dict(top_k=np.array([1, -1])), "top_k="),
    (dict(seed=jnp.asarray([1, -1])), "seed="),
])
def test_sampling_params_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_still_accept_tracers_and_stacked_arrays():
    rows = SamplingParams(temperature=np.ones((3, 2), np.float32), seed=jnp.arange(6, dtype=jnp.uint32).reshape(3, 2))
    doubled = jax.jit(lambda s: s.replace(seed=s.seed * 2).broadcast(2))(SamplingParams(seed=jnp.uint32(3)))
    assert rows.temperature.shape == (3, 2) and doubled.seed.tolist() == [6, 6]
    # A placeholder leaf (what pytree machinery may unflatten) constructs, but never becomes rows.
    structure = jax.tree.structure(SamplingParams())
    opaque = jax.tree.unflatten(structure, [object()] * structure.num_leaves)
    with pytest.raises(ValueError, match="temperature="):
        opaque.broadcast(2)
    with pytest.raises(ValueError, match="params\\[1\\]=3"):
        SamplingParams.stack([SamplingParams(), 3])


def test_generate_script_prints_a_clean_error_for_a_bad_seed(capsys, monkeypatch):
    script = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"
    monkeypatch.setattr(sys, "argv", [str(script), "hello", "--seed", "-1"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 2
    assert "error: seed=-1 must be an integer in [0, 2**32 - 1]" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- tiny temperatures

_TINY_TEMPERATURES = (1e-38, 5e-38, 1e-37, 1e-6)


def test_greedy_floor_in_process_logits_sample_and_rejection():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 3, VOCAB)) * 5, jnp.float32)  # [B, K+1, V]
    best = np.asarray(logits).argmax(-1)
    # Rows 0-3 below the floor, in a batch with a sampled row so the sampled branch runs.
    sampling = SamplingParams(temperature=np.array([*_TINY_TEMPERATURES[:3], 1.0], np.float32), seed=np.arange(4))
    z = process_logits(logits, sampling)
    assert not np.any(np.isnan(np.asarray(z)))
    np.testing.assert_array_equal(np.asarray(z[:3]).argmax(-1), best[:3])
    assert np.all(np.isfinite(np.asarray(z[:3])).sum(-1) == 1)  # a point mass
    keys = jax.vmap(jax.random.key)(jnp.arange(4))
    np.testing.assert_array_equal(np.asarray(sample(keys, logits[:, 0], sampling))[:3], best[:3, 0])
    drafts = jnp.asarray(best[:, :2], jnp.int32)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(4, 2, VOCAB)), jnp.float32), axis=-1)
    tokens, num = rejection_sample(keys, logits, drafts, probs, jnp.full((4,), 2, jnp.int32), sampling)
    np.testing.assert_array_equal(np.asarray(tokens)[:3], best[:3])  # argmax drafts all accepted, then the bonus
    assert GREEDY_BELOW == 1e-5 and SamplingParams(temperature=GREEDY_BELOW / 2).is_greedy


@pytest.mark.parametrize("spec", [None, SpecConfig(method="self_draft", num_speculative_tokens=3, self_draft_layers=1)],
                         ids=["plain", "self_draft"])
def test_tiny_temperatures_give_the_greedy_tokens(tiny_lm, spec):
    """Four rows below the floor beside a sampled row (so the batch takes the sampled branch), and the same
    rows beside a greedy one (the all-greedy branch): both equal plain greedy decoding."""
    prompts = [PROMPTS[1]] * 5
    greedy = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, ignore_eos=True).token_ids[0]
    for fifth in (1.0, 0.0):
        sampling = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((*_TINY_TEMPERATURES, fifth))]
        out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=sampling, spec=spec, ignore_eos=True)
        assert out.token_ids[:4] == [greedy] * 4
        _assert_in_vocab(out)
        if spec is not None:
            assert out.stats.drafted > 0 and out.stats.accepted > 0


# ----------------------------------------------------------------------------------------------- top-k 1

@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_speculative_tokens=3, min_match=1)],
                         ids=["plain", "ngram"])
def test_top_k_one_is_greedy_at_any_temperature_in_a_mixed_batch(tiny_lm, spec):
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    greedy = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, ignore_eos=True).token_ids
    sampling = [SamplingParams(temperature=0.5, top_k=1, seed=1), SamplingParams(temperature=1.0, top_k=1, seed=2),
                SamplingParams(temperature=2.0, top_k=1, seed=3), SamplingParams(temperature=1.0, seed=4),
                SamplingParams(temperature=0.7, top_p=0.9, seed=5), SamplingParams(temperature=1.5, top_k=1, seed=6)]
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=sampling, spec=spec, ignore_eos=True)
    for i in (0, 1, 2, 5):
        assert out.token_ids[i] == greedy[i], i
    if spec is not None:
        assert out.stats.drafted > 0


def test_a_top_p_below_float32_resolution_keeps_the_likeliest_token(tiny_lm):
    """top_p=1e-50 is inside (0, 1] but 0.0 in float32: it is stored as float32's smallest normal value, so
    it stacks without error and samples the argmax, as any top_p below the top token's probability does."""
    rows = SamplingParams.stack([SamplingParams(temperature=1.0, top_p=1e-50)])
    assert 0 < float(rows.top_p[0]) <= np.finfo(np.float32).tiny
    prompts = [PROMPTS[0]] * 4
    greedy = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, ignore_eos=True).token_ids
    sampling = [SamplingParams(temperature=1.0, top_p=1e-50, seed=s) for s in range(4)]
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=sampling, ignore_eos=True)
    assert out.token_ids == greedy


def test_top_k_three_negative_control_samples_several_tokens_of_the_top_three(tiny_lm):
    num = 64
    sampling = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(num)]
    out = jaxspec.generate(tiny_lm, [PROMPTS[1]] * num, max_new_tokens=1, sampling=sampling, logprobs=3)
    top3 = {t for t, _ in out.logprobs[0][0].top}
    first = {row[0] for row in out.token_ids}
    assert len(first) > 1 and first <= top3


# ----------------------------------------------------------------------------------------------- OOV drafts

@dataclasses.dataclass(frozen=True)
class JunkOracleProposer(ChainProposer):
    """Drafts plain greedy's continuation (params: i32[B, R] prompt + reference output) with junk planted:
    "ignored": every entry past num_draft holds the vocabulary size; "drafted": drafted entry 1 holds it
    (and entry 3 a negative id)."""

    num_speculative_tokens: int
    junk: str

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        k = self.num_speculative_tokens
        idx = jnp.minimum(ctx.history_len[:, None] + jnp.arange(k), params.shape[1] - 1)
        tokens = jnp.take_along_axis(params, idx, axis=1)  # i32[B, K]
        num = jnp.minimum(ctx.max_draft, k - 1)  # the last entry is always past num_draft
        if self.junk == "ignored":
            tokens = jnp.where(jnp.arange(k) >= num[:, None], VOCAB, tokens)
        else:
            tokens = tokens.at[:, 1].set(VOCAB).at[:, 3].set(-5)
            num = jnp.full_like(num, k)
        return Draft(tokens=tokens, num_draft=num), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


@dataclasses.dataclass(frozen=True)
class JunkTreeProposer(Proposer):
    """A tree whose first branch starts with an out-of-vocabulary node (its child holds the right token) and
    whose second branch drafts plain greedy's next two tokens."""

    num_speculative_tokens: int = 4
    max_depth: int = 2

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        idx = jnp.minimum(ctx.history_len[:, None] + jnp.arange(2), params.shape[1] - 1)
        nxt = jnp.take_along_axis(params, idx, axis=1)  # i32[B, 2]
        oov = jnp.full_like(nxt[:, 0], VOCAB)
        tokens = jnp.stack([oov, nxt[:, 0], nxt[:, 0], nxt[:, 1]], axis=1)  # i32[B, 4]
        parents = jnp.broadcast_to(jnp.asarray([0, 1, 0, 3], jnp.int32), tokens.shape)
        return Draft(tokens=tokens, num_draft=jnp.full_like(oov, 4), parents=parents), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


def _custom(proposer, params, **kw) -> SpecConfig:
    return SpecConfig(method="custom", num_speculative_tokens=proposer.num_speculative_tokens, proposer=proposer,
                      proposer_params=params, **kw)


@pytest.mark.parametrize("junk", ["ignored", "drafted"])
def test_out_of_vocab_chain_drafts_never_reach_the_model(tiny_lm, plain, junk):
    spec = _custom(JunkOracleProposer(5, junk), _reference_table(plain))
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=NEW, spec=spec, ignore_eos=True, logprobs=1)
    assert out.token_ids == plain.token_ids
    _assert_in_vocab(out)
    assert all(np.isfinite(e.logprob) for row in out.logprobs for e in row)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    if junk == "drafted":  # cut at the first out-of-vocabulary draft: only draft 0 is ever scored
        assert out.stats.drafted_per_position[0] > 0 and sum(out.stats.drafted_per_position[1:]) == 0


def test_out_of_vocab_tree_nodes_are_never_accepted(tiny_lm, plain):
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=NEW, spec=_custom(JunkTreeProposer(),
                                                                               _reference_table(plain)),
                           ignore_eos=True)
    assert out.token_ids == plain.token_ids
    _assert_in_vocab(out)
    # The second branch carries every accepted draft: two per step.
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert OOV_DRAFT_PLACEHOLDER in range(VOCAB)


def test_static_sam_with_ids_outside_the_vocabulary_is_rejected(tiny_lm):
    corpus = StaticSuffixAutomaton.build([[1, 2, 3, VOCAB + 3], [4, 5]], separator=0)
    spec = SpecConfig(method="sam", sam_source="static", static_sam=corpus, min_match=1)
    with pytest.raises(ValueError, match=f"static_sam holds token id {VOCAB + 3} outside \\[0, {VOCAB}\\)"):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=4, spec=spec)
    with pytest.raises(ValueError, match="sequences\\[1\\]\\[0\\]=-4"):
        StaticSuffixAutomaton.build([[1, 2], [-4]], separator=0)
    with pytest.raises(ValueError, match="separator=-1"):
        StaticSuffixAutomaton.build([[1, 2]], separator=-1)
    with pytest.raises(ValueError, match="static_sam=.* must be a jaxspec.StaticSuffixAutomaton"):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=4,
                         spec=SpecConfig(method="sam", sam_source="both", static_sam=[1, 2, 3]))


# ----------------------------------------------------------------------------------------------- cache boundary

@pytest.mark.parametrize("k", [1, 3, 10])
def test_cache_length_boundary(tiny_lm, plain, k):
    """The longest prompt plus max_new_tokens fills max_cache_len exactly; a static automaton over plain
    greedy's own output drafts (and gets accepted) right up to the token budget; one slot fewer is refused."""
    corpus = StaticSuffixAutomaton.build([p + t for p, t in zip(PROMPTS, plain.token_ids)], separator=0)
    spec = SpecConfig(method="sam", sam_source="static", static_sam=corpus, num_speculative_tokens=k, min_match=1,
                      draft_per_match=math.inf)
    limit = len(PROMPTS[0]) + NEW
    bounded = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=NEW, ignore_eos=True, max_cache_len=limit)
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=NEW, ignore_eos=True, max_cache_len=limit, spec=spec)
    assert out.token_ids == bounded.token_ids == plain.token_ids
    assert out.finish_reason == ["length", "length"] and [len(t) for t in out.token_ids] == [NEW, NEW]
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    with pytest.raises(ValueError, match=f"needs {limit} cache slots but max_cache_len={limit - 1}"):
        jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=NEW, ignore_eos=True, max_cache_len=limit - 1, spec=spec)


# ----------------------------------------------------------------------------------------------- generate fuzz

_SPEC = SpecConfig(method="ngram", num_speculative_tokens=2, min_match=1)
_prompt = st.lists(st.integers(-2, VOCAB + 2), min_size=0, max_size=10)
_GENERATE_ARGS = {
    # Valid choices keep every call inside one shape bucket (batch 1 or 2, widths 16): a few programs in all.
    "prompts": st.one_of(_prompt, st.lists(_prompt, min_size=1, max_size=2), _JUNK,
                         st.lists(st.one_of(_prompt, _JUNK), min_size=1, max_size=2)),
    "max_new_tokens": st.sampled_from([0, 1, 3, -1, 300, 2**40, 2.5, True, None, "3", np.int64(2), [2]]),
    "sampling": st.one_of(st.just(SamplingParams()), st.just(SamplingParams(temperature=0.8, seed=3)),
                          st.lists(st.sampled_from([SamplingParams(), SamplingParams(top_k=2, temperature=1.0)]),
                                   max_size=3), _JUNK),
    "stop_token_ids": st.one_of(st.just(()), st.lists(st.integers(-3, VOCAB + 3), max_size=1),
                                st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=1), max_size=2), _JUNK),
    "ignore_eos": st.one_of(st.booleans(), _JUNK),
    "max_cache_len": st.sampled_from([None, 64, 12, 0, -1, 10**9, 1.5, True, "64", jnp.asarray(64)]),
    "attention_impl": st.sampled_from([None, "xla", "cuda", 3, ["xla"], b"xla", jnp.asarray(1)]),
    "spec": st.sampled_from([None, _SPEC, "ngram", {"method": "ngram"}, 3]),
    "logprobs": st.sampled_from([None, -1, 98, 1.0, True, "2"]),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_generate_fuzz_raises_only_value_error(tiny_lm, data):
    kwargs = {name: data.draw(strategy, label=name) for name, strategy in _GENERATE_ARGS.items()
              if data.draw(st.booleans(), label=f"pass {name}")}
    prompts = kwargs.pop("prompts", [[1, 2, 3]])
    try:
        out = jaxspec.generate(tiny_lm, prompts, **kwargs)
    except ValueError:
        return
    _assert_in_vocab(out)
    assert all(r in ("stop", "length") for r in out.finish_reason)


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompts=[[1, 2.0]]), r"prompt 0=\[1, 2.0\] must be a string or a list of integer token ids"),
    (dict(prompts=[[True, 2]]), "prompt 0="),
    (dict(prompts=None), "prompts=None"),
    (dict(prompts=b"ab"), "prompts=b'ab'"),
    (dict(prompts=[[1], {1: 2}]), "prompt 1="),
    (dict(prompts=[[1, 2]], stop_token_ids=[VOCAB]), f"stop_token_ids has token id {VOCAB} outside"),
    (dict(prompts=[[1, 2]], stop_token_ids=[1.5]), r"stop_token_ids=\[1.5\]"),
    (dict(prompts=[[1, 2]], stop_token_ids=[[1], 2]), "stop_token_ids="),
    (dict(prompts=[[1, 2]], stop_token_ids=[[-1]]), r"stop_token_ids\[0\] has token id -1"),
    (dict(prompts=[[1, 2]], max_cache_len=0), "max_cache_len=0"),
    (dict(prompts=[[1, 2]], max_cache_len=1.5), "max_cache_len=1.5"),
    (dict(prompts=[[1, 2]], attention_impl=["xla"]), r"attention_impl=\['xla'\]"),
    (dict(prompts=[[1, 2]], sampling=[3]), r"sampling has 1 entries|sampling\[0\]=3"),
    (dict(prompts=[[1, 2]], sampling=[SamplingParams(seed=[1, 2])]), r"params\[0\].seed"),
    (dict(prompts=[[1, 2]], sampling="greedy"), "sampling='greedy'"),
    (dict(prompts=[[1, 2]], sampling=SamplingParams(seed=[1, 2])), r"seed has shape \(2,\)"),
    (dict(prompts=[[1, 2]], ignore_eos="no"), "ignore_eos='no'"),
    (dict(prompts=[[1, 2]], spec="ngram"), "spec='ngram'"),
])
def test_generate_errors_name_the_value(tiny_lm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(tiny_lm, **kwargs)


@pytest.mark.real_model
def test_lone_surrogates_are_a_value_error_naming_the_prompt(smollm2):
    with pytest.raises(ValueError, match="prompt 0 is not valid Unicode text"):
        jaxspec.generate(smollm2, "\ud800", max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt 1 is not valid Unicode text"):
        jaxspec.generate(smollm2, ["fine", "a\udc00b"], max_new_tokens=1)


# ----------------------------------------------------------------------------------------------- random streams

_STREAM_SAMPLING = dict(temperature=1.0, top_k=3)
_STREAM_ROWS = 512
_STREAM_PROMPT = [3, 14, 15, 92, 65]


def _scaled(lm, factor: float, name: str):
    """The model with its LM head scaled: a sharper (factor > 1) distribution over the same ranking."""
    out = dataclasses.replace(lm, name=name, params=jax.tree.map(lambda x: x, lm.params))
    out.params["lm_head"].set_value(lm.params["lm_head"].get_value() * factor)
    return out


def _exact_pairs(lm, prompt, sampling) -> dict[tuple[int, int], float]:
    """{(t0, t1): probability} of the first two sampled tokens, by teacher-forced forwards."""
    def next_probs(rows):
        rows = np.asarray(rows, np.int32)
        positions = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
        out, _ = lm.module(jnp.asarray(rows), jnp.asarray(positions), lm.module.new_cache(len(rows), 64))
        return np.asarray(jaxspec.processed_probs(out.logits[:, -1], sampling), np.float64)

    first = next_probs([prompt])[0]
    t0s = np.flatnonzero(first > 0)
    second = next_probs([prompt + [int(t)] for t in t0s])
    return {(int(a), int(b)): first[a] * second[i, b] for i, a in enumerate(t0s) for b in np.flatnonzero(second[i])}


def _chi_square_p(lm, spec, exact) -> tuple[float, object]:
    """p-value of the first two tokens of _STREAM_ROWS seeds against the exact joint, and the run's stats."""
    sampling = [SamplingParams(**_STREAM_SAMPLING, seed=s) for s in range(_STREAM_ROWS)]
    out = jaxspec.generate(lm, [_STREAM_PROMPT] * _STREAM_ROWS, max_new_tokens=3, sampling=sampling, spec=spec,
                           ignore_eos=True)
    cells = sorted(exact)
    counts = {c: 0 for c in cells}
    outside = 0  # pairs the target never emits
    for row in out.token_ids:
        pair = tuple(row[:2])
        if pair in counts:
            counts[pair] += 1
        else:
            outside += 1
    if outside:
        return 0.0, out.stats
    observed = np.array([counts[c] for c in cells], np.float64)
    expected = np.array([exact[c] for c in cells])
    expected *= _STREAM_ROWS / expected.sum()  # float32 probabilities: make the totals agree exactly
    return float(stats.chisquare(observed, expected).pvalue), out.stats


@dataclasses.dataclass(frozen=True)
class AcceptKeyDraftProposer(ChainProposer):
    """Negative control: a draft model whose one draft is drawn by inverse CDF from the *verification's*
    acceptance uniform, uniform(fold_in(fold_in(key(seed), P), _ACCEPT_STREAM)) at the draft's position P, so
    the draft and its acceptance test share one random number (what verification must never allow)."""

    inner: DraftModelProposer
    num_speculative_tokens: int = 1

    def init(self, params, ctx: Context):
        return self.inner.init(params, ctx)

    def propose(self, params, pstate, ctx: Context, keys):
        draft, pstate = self.inner.propose(params, pstate, ctx, keys)
        q = draft.probs[:, 0]  # f32[B, V]
        position = ctx.positions + 1  # output token 0 sits one past the newest token
        u = jax.vmap(lambda seed, p: jax.random.uniform(jax.random.fold_in(
            jax.random.fold_in(jax.random.key(seed), p), _ACCEPT_STREAM)))(ctx.sampling.seed, position)  # f32[B]
        token = jnp.sum(jnp.cumsum(q, axis=-1) <= u[:, None], axis=-1)  # i32[B]
        token = jnp.minimum(token, q.shape[-1] - 1).astype(jnp.int32)
        return draft.replace(tokens=draft.tokens.at[:, 0].set(token)), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return self.inner.update(params, pstate, ctx, committed)


def test_draft_stream_is_independent_of_the_acceptance_stream(tiny_lm):
    """One call of 512 seeded rows: the first two tokens (the second verified against a probabilistic draft)
    follow the target's exact joint by a chi-square test; drafting with the acceptance stream's own uniforms
    (negative control) fails the same test. The target is the tiny model sharpened (p over its top 3 about
    0.49 / 0.32 / 0.18); the draft is the tiny model itself (q nearly uniform over the same 3 tokens)."""
    target = _scaled(tiny_lm, 15.0, "tiny-x15")
    sampling = SamplingParams(**_STREAM_SAMPLING)
    exact = _exact_pairs(target, _STREAM_PROMPT, sampling)
    assert len(exact) == 9

    spec = SpecConfig(method="draft_model", num_speculative_tokens=1, draft_model=tiny_lm)
    p_value, run = _chi_square_p(target, spec, exact)
    assert run.drafted > 0 and 0 < run.accepted < run.drafted
    width, _, cache_len = bucket_shapes([len(_STREAM_PROMPT)], 3)
    control = _custom(AcceptKeyDraftProposer(DraftModelProposer(1, tiny_lm.graphdef, cache_len=cache_len,
                                                                prompt_width=width)), tiny_lm.params)
    control_p, control_run = _chi_square_p(target, control, exact)
    print(f"chi-square p: independent streams {p_value:.3g}, shared stream {control_p:.3g}")
    assert control_run.drafted > 0
    assert p_value > 1e-3
    assert control_p < 1e-6


def test_half_precision_values_are_checked_without_warnings():
    """A float16 seed or top_k is compared with bounds float16 cannot hold (2**32 - 1): checked in float64, with no
    overflow warning, and still refused when it is not a whole number in range."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SamplingParams(seed=np.float16(3), top_k=np.array([1, 2], np.float16)).seed == 3
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=np.float16(-1))
