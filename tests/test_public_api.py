"""The public low-level API: `prepare` + `prefill` + `decode` (or `decode_chunk`, `spec_step`) are the loop
`generate` runs; array prompts in and arrays out; `rng=`; `rejection_sample` inside the caller's own jit and
vmap; ValueErrors naming the value for bad rejection inputs, bad custom proposers and bad Drafts.

Prompts of at most 30 tokens and at most 16 new tokens share one prompt bucket and one output buffer, so the
file compiles few programs.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.generation import rng_seeds
from jaxspec.proposers.base import ChainProposer, Committed, Context, Draft

VOCAB = 97  # the tiny model's
NEW = 16
SAM = SpecConfig(method="sam", num_speculative_tokens=4, min_match=1)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prompts():
    """Random prompts of different lengths (lookup proposers find matches in them)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 17, 30, 9)]


def _own_loop(lm, prompts, **kwargs):
    """A hand-written generate: prepare, prefill, decode, read the tokens. Returns (tokens, counts, state)."""
    p = jaxspec.prepare(lm, prompts, max_new_tokens=NEW, **kwargs)
    state = jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                            p.processors, spec=p.prefill_spec)
    state = jaxspec.decode(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step)
    tokens, counts = p.new_tokens(state)
    return tokens, counts, state


# ------------------------------------------------------------------------------------------------ the loop

@pytest.mark.parametrize("spec", [None, SAM], ids=["plain", "sam"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=5)],
                         ids=["greedy", "sampled"])
def test_own_loop_equals_generate(tiny_lm, prompts, spec, sampling):
    tokens, counts, state = _own_loop(tiny_lm, prompts, spec=spec, sampling=sampling)
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, spec=spec, sampling=sampling)
    np.testing.assert_array_equal(tokens, out.token_array)
    np.testing.assert_array_equal(counts, out.num_tokens)
    assert [t[:n].tolist() for t, n in zip(tokens, counts)] == out.token_ids
    assert tokens.shape == (len(prompts), NEW) and tokens.dtype == np.int32
    if spec is not None:
        assert int(state.counters.drafted.sum()) > 0 and out.stats.drafted > 0  # the proposer really drafted
        plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=sampling)
        assert out.token_ids == plain.token_ids  # greedy: identical; seeded lookup drafts: the same samples


@functools.partial(jax.jit, static_argnames=("graphdef", "step"))
def _one_step(graphdef, params, state, rows, proposer_params, *, step):
    return jaxspec.spec_step(nnx.merge(graphdef, params), step, proposer_params, state, rows)


def test_spec_step_and_decode_chunk_loops_equal_generate(tiny_lm, prompts):
    lm = tiny_lm
    p = jaxspec.prepare(lm, prompts, max_new_tokens=NEW, spec=SAM)
    want = jaxspec.generate(lm, prompts, max_new_tokens=NEW, spec=SAM)

    def start():
        return jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                               spec=p.prefill_spec)

    state = start()
    while not bool(jnp.all(state.done)):  # one step per call: the host sees every step
        state = _one_step(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step)
    np.testing.assert_array_equal(p.new_tokens(state)[0], want.token_array)
    assert int(state.steps) == want.stats.steps

    state, chunks = start(), 0
    while not bool(jnp.all(state.done)):
        state = jaxspec.decode_chunk(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step,
                                     num_steps=3)
        chunks += 1
    np.testing.assert_array_equal(p.new_tokens(state)[0], want.token_array)
    assert chunks == -(-want.stats.steps // 3)


def test_prepared_holds_the_bucketed_inputs(tiny_lm, prompts):
    p = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=NEW, spec=SAM, stop_token_ids=[3, 4])
    assert p.prompts.shape == (4, 32) and p.prompts.dtype == jnp.int32
    np.testing.assert_array_equal(p.prompt_lens, [5, 17, 30, 9])
    np.testing.assert_array_equal(p.prompts[0, :5], prompts[0])
    assert p.sampling.temperature.shape == (4,) and p.limits.stop_ids.shape == (4, 2)
    assert p.proposer.num_speculative_tokens == 4 and p.widths == (1, 5)
    assert p.buffer_len == NEW and p.cache_len % 128 == 0 and p.batch_size == 4
    plain = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=NEW)
    assert plain.proposer.num_speculative_tokens == 0 and plain.widths == (1,) and plain.proposer_params is None


# ------------------------------------------------------------------------------------------------ arrays

def _padded(prompts, width=30, fill=0):
    table = np.full((len(prompts), width), fill, np.int32)
    for i, p in enumerate(prompts):
        table[i, : len(p)] = p
    return table, np.asarray([len(p) for p in prompts])


def test_array_prompts_in_arrays_out_equal_the_list_api(tiny_lm, prompts):
    want = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW)
    table, lengths = _padded(prompts, fill=7)  # padding is never read
    for given, given_lengths in ((table, lengths), (jnp.asarray(table), jnp.asarray(lengths)),
                                 (table.astype(np.int64), lengths.tolist())):
        out = jaxspec.generate(tiny_lm, given, prompt_lengths=given_lengths, max_new_tokens=NEW)
        assert out.token_ids == want.token_ids
        np.testing.assert_array_equal(out.token_array, want.token_array)
    rows = jaxspec.generate(tiny_lm, [jnp.asarray(p) for p in prompts], max_new_tokens=NEW)  # 1-D jax arrays
    assert rows.token_ids == want.token_ids
    full = jaxspec.generate(tiny_lm, np.asarray([prompts[2]]), max_new_tokens=NEW)  # no lengths: every column
    assert full.token_ids == [want.token_ids[2]]


def test_token_array_is_minus_one_padded_after_a_stop(tiny_lm, prompts):
    free = jaxspec.generate(tiny_lm, prompts[:2], max_new_tokens=NEW)
    stop = free.token_ids[0][3]
    out = jaxspec.generate(tiny_lm, prompts[:2], max_new_tokens=NEW, stop_token_ids=[[stop], []])
    n = out.num_tokens
    assert n[0] == free.token_ids[0].index(stop) + 1 and n[1] == NEW
    assert out.token_array[0, : n[0]].tolist() == out.token_ids[0] and np.all(out.token_array[0, n[0]:] == -1)
    empty = jaxspec.generate(tiny_lm, prompts[:2], max_new_tokens=0)
    assert empty.token_array.shape == (2, 0) and empty.num_tokens.tolist() == [0, 0]


# ------------------------------------------------------------------------------------------------ rng=

_HOT = SamplingParams(temperature=1.0, seed=0)  # seed 0 is the default: rng fills it


def test_rng_is_reproducible_and_different_rngs_differ(tiny_lm, prompts):
    a = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=_HOT, rng=7)
    again = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=_HOT, rng=jax.random.key(7))
    raw = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=_HOT, rng=jax.random.PRNGKey(7))
    assert a.token_ids == again.token_ids == raw.token_ids
    b = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=_HOT, rng=8)
    assert a.token_ids != b.token_ids
    seeds = rng_seeds(7, len(prompts))
    assert seeds.dtype == np.uint32 and len(set(seeds.tolist())) == len(prompts)  # rows get different seeds
    # The documented derivation: row i's seed is the one `rng_seeds` gives, as an explicit seed.
    explicit = [SamplingParams(temperature=1.0, seed=int(s)) for s in seeds]
    assert jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=explicit).token_ids == a.token_ids


def test_rng_fills_only_rows_left_at_the_default_seed(tiny_lm, prompts):
    mine = SamplingParams(temperature=1.0, seed=1234)
    rows = [mine, _HOT, SamplingParams(), _HOT]  # an explicit seed, two default seeds, one greedy row
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=rows, rng=3)
    alone = jaxspec.generate(tiny_lm, [prompts[0]], max_new_tokens=NEW, sampling=mine)
    assert out.token_ids[0] == alone.token_ids[0]  # the row's own seed wins over rng
    greedy = jaxspec.generate(tiny_lm, [prompts[2]], max_new_tokens=NEW)
    assert out.token_ids[2] == greedy.token_ids[0]
    seed_1 = int(rng_seeds(3, 4)[1])
    filled = jaxspec.generate(tiny_lm, [prompts[1]], max_new_tokens=NEW,
                              sampling=SamplingParams(temperature=1.0, seed=seed_1))
    assert out.token_ids[1] == filled.token_ids[0]
    no_rng = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=rows)
    assert no_rng.token_ids[0] == out.token_ids[0] and no_rng.token_ids[1] != out.token_ids[1]


@pytest.mark.parametrize("rng,message", [
    (-1, "rng=-1"), (2**32, "rng=4294967296"), (1.5, "rng=1.5"), (True, "rng=True"), ("7", "rng='7'"),
    (jax.random.split(jax.random.key(0), 2), r"rng has shape \(2,\)"), (np.zeros(2, np.float32), "rng=array"),
])
def test_bad_rng_raises_naming_it(tiny_lm, rng, message):
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=2, rng=rng)


def test_prng_key_as_seed_points_at_rng():
    with pytest.raises(ValueError, match="seed is a PRNG key.*rng="):
        SamplingParams(seed=jax.random.key(0))


# ------------------------------------------------------------------------------------------------ rejection_sample

B, K, V = 3, 4, 11


def _rejection_case(seed, calls=2):
    """[C, ...] inputs for `calls` independent verification calls."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(calls, B, K + 1, V)).astype(np.float32) * 2
    drafts = np.where(rng.random((calls, B, K)) < 0.6, logits[..., :K, :].argmax(-1),
                      rng.integers(0, V, (calls, B, K))).astype(np.int32)
    draft_logits = rng.normal(size=(calls, B, K, V)).astype(np.float32)
    num_draft = rng.integers(0, K + 1, (calls, B)).astype(np.int32)
    seeds = rng.integers(0, 2**31, (calls, B)).astype(np.uint32)
    return logits, drafts, draft_logits, num_draft, seeds


def _my_verify(seeds, logits, drafts, draft_logits, num_draft, temperature):
    """A caller's own function around rejection_sample: keys from seeds, draft probs from draft logits."""
    keys = jax.vmap(jax.random.key)(seeds)
    sampling = SamplingParams(temperature=temperature, top_k=jnp.zeros_like(temperature, jnp.int32),
                              top_p=jnp.ones_like(temperature), min_p=jnp.zeros_like(temperature), seed=seeds)
    probs = jax.nn.softmax(draft_logits, axis=-1)  # f32[B, K, V]
    return jaxspec.rejection_sample(keys, logits, drafts, probs, num_draft, sampling)


def test_rejection_sample_in_own_jit_and_vmap_equals_eager_calls():
    logits, drafts, draft_logits, num_draft, seeds = _rejection_case(0)
    temperature = np.asarray([[0.0, 1.0, 0.7]] * 2, np.float32)  # a greedy row among sampled ones
    batched = jax.jit(jax.vmap(_my_verify))(seeds, logits, drafts, draft_logits, num_draft, temperature)
    for c in range(2):
        tokens, num = _my_verify(jnp.asarray(seeds[c]), jnp.asarray(logits[c]), jnp.asarray(drafts[c]),
                                 jnp.asarray(draft_logits[c]), jnp.asarray(num_draft[c]), jnp.asarray(temperature[c]))
        np.testing.assert_array_equal(batched[0][c], tokens)
        np.testing.assert_array_equal(batched[1][c], num)
        assert np.all((1 <= np.asarray(num)) & (np.asarray(num) <= num_draft[c] + 1))


def test_rejection_sample_takes_raw_keys_as_typed_keys():
    logits, drafts, _, num_draft, seeds = _rejection_case(1, calls=1)
    sampling = SamplingParams(temperature=np.ones(B, np.float32), seed=seeds[0])
    typed = jaxspec.rejection_sample(jax.vmap(jax.random.key)(seeds[0]), logits[0], drafts[0], None, num_draft[0],
                                     sampling)
    raw = jaxspec.rejection_sample(jax.vmap(jax.random.PRNGKey)(seeds[0]), logits[0], drafts[0], None, num_draft[0],
                                   sampling)
    np.testing.assert_array_equal(typed[0], raw[0])


def _rejection_args(**overrides):
    args = dict(keys=jax.vmap(jax.random.key)(jnp.arange(B, dtype=jnp.uint32)),
                target_logits=jnp.zeros((B, K + 1, V)), draft_tokens=jnp.zeros((B, K), jnp.int32),
                draft_probs=jnp.full((B, K, V), 1 / V), num_draft=jnp.zeros((B,), jnp.int32),
                sampling=SamplingParams(temperature=1.0).broadcast(B))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,message", [
    (dict(draft_tokens=jnp.zeros((B, K + 1), jnp.int32)), r"draft_tokens has shape \(3, 5\).*\(3, 4\).*K=4"),
    (dict(draft_tokens=jnp.zeros((B, K))), r"draft_tokens .* dtype float32; expected integers"),
    (dict(draft_probs=jnp.full((B, K, V + 1), 0.1)), r"draft_probs has shape \(3, 4, 12\).*\(3, 4, 11\)"),
    (dict(num_draft=jnp.zeros((B, 1), jnp.int32)), r"num_draft has shape \(3, 1\).*\(3,\)"),
    (dict(target_logits=jnp.zeros((B, V))), r"target_logits has shape \(3, 11\).*\[B, K\+1, V\]"),
    (dict(target_logits=jnp.zeros((B, K + 1, V), jnp.int32)), "target_logits .* dtype int32; expected floats"),
    (dict(keys=jax.random.split(jax.random.key(0), B + 1)), r"keys has shape \(4,\).*\(3,\)"),
    (dict(keys=jnp.zeros((B,), jnp.int32)), r"keys has shape \(3,\) and dtype int32.*uint32\[3, 2\]"),
    (dict(sampling=SamplingParams(temperature=jnp.ones(B + 1))), r"sampling.temperature has shape \(4,\)"),
    (dict(sampling=0.5), "sampling=0.5 must be a jaxspec.SamplingParams"),
])
def test_rejection_sample_rejects_bad_shapes_naming_the_argument(overrides, message):
    args = _rejection_args(**overrides)
    with pytest.raises(ValueError, match=message):
        jaxspec.rejection_sample(**args)
    if not isinstance(args["sampling"], SamplingParams):
        return
    with pytest.raises(ValueError, match=message):  # at trace time, under the caller's jit
        jax.jit(jaxspec.rejection_sample)(**args)


def test_rejection_sample_shape_checks_run_under_vmap():
    args = _rejection_args(draft_tokens=jnp.zeros((B, K - 1), jnp.int32))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), args)  # two calls, vmapped
    with pytest.raises(ValueError, match=r"draft_tokens has shape \(3, 3\)"):
        jax.vmap(lambda a: jaxspec.rejection_sample(**a))(stacked)


# ------------------------------------------------------------------------------------------------ custom proposers

@dataclasses.dataclass(frozen=True)
class ShapedProposer(ChainProposer):
    """Drafts zeros, with one Draft field of a chosen wrong shape ("" for none)."""

    num_speculative_tokens: int = 3
    wrong: str = ""

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        b, k = ctx.history.shape[0], self.num_speculative_tokens
        shapes = {"tokens": (b, k), "num_draft": (b,), "probs": (b, k, VOCAB), "parents": (b, k),
                  "confidence": (b, k)}
        if self.wrong:
            name, delta = self.wrong.split(":")
            shapes[name] = shapes[name][:-1] + (shapes[name][-1] + int(delta),)
        tokens = jnp.zeros(shapes["tokens"], jnp.int32)
        num = jnp.zeros(shapes["num_draft"], jnp.int32)  # never drafts: output equals plain decoding
        probs = jnp.full(shapes["probs"], 1.0 / VOCAB) if self.wrong.startswith("probs") else None
        parents = jnp.zeros(shapes["parents"], jnp.int32) if self.wrong.startswith("parents") else None
        confidence = jnp.ones(shapes["confidence"]) if self.wrong.startswith("confidence") else None
        return Draft(tokens=tokens, num_draft=num, probs=probs, parents=parents, confidence=confidence), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


def _custom(proposer, k=3):
    return SpecConfig(method="custom", num_speculative_tokens=k, proposer=proposer)


def test_a_well_shaped_custom_proposer_passes(tiny_lm, prompts):
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, spec=_custom(ShapedProposer()))
    assert out.token_ids == jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW).token_ids


@pytest.mark.parametrize("wrong,message", [
    ("tokens:1", r"Draft.tokens has shape \(4, 4\) and dtype int32; expected integers of shape \(4, 3\)"),
    ("tokens:-1", r"Draft.tokens has shape \(4, 2\)"),
    ("num_draft:1", r"Draft.num_draft has shape \(5,\).*expected integers of shape \(4,\)$"),
    ("probs:1", r"Draft.probs has shape \(4, 3, 98\).*\(4, 3, 97\) or None"),
    ("parents:1", r"Draft.parents has shape \(4, 4\).*\(4, 3\) or None"),
    ("confidence:-1", r"Draft.confidence has shape \(4, 2\).*expected floats of shape \(4, 3\) or None"),
])
def test_a_wrongly_shaped_draft_raises_naming_the_field(tiny_lm, prompts, wrong, message):
    spec = _custom(ShapedProposer(wrong=wrong))
    with pytest.raises(ValueError, match=f"ShapedProposer.*{message}"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, spec=spec)
    with pytest.raises(ValueError, match=message):
        jaxspec.prepare(tiny_lm, prompts, max_new_tokens=NEW, spec=spec)


@dataclasses.dataclass  # not frozen: unhashable
class MutableProposer(ChainProposer):
    num_speculative_tokens: int = 3
    init, propose, update = ShapedProposer.init, ShapedProposer.propose, ShapedProposer.update


@dataclasses.dataclass(frozen=True)
class ArrayHoldingProposer(ShapedProposer):
    table: jax.Array = None  # arrays belong in proposer_params: this makes the proposer unhashable


class NoUpdate:
    num_speculative_tokens = 3

    def init(self, params, ctx):
        return ()

    def propose(self, params, pstate, ctx, keys):
        raise AssertionError("never called")


@dataclasses.dataclass(frozen=True)
class Undeclared:
    num_speculative_tokens: int = 3
    init, propose, update = ShapedProposer.init, ShapedProposer.propose, ShapedProposer.update


@dataclasses.dataclass(frozen=True)
class NoBudget(ChainProposer):  # a Proposer without its K
    init, propose, update = ShapedProposer.init, ShapedProposer.propose, ShapedProposer.update


@dataclasses.dataclass(frozen=True)
class WrongDepth(ShapedProposer):
    max_depth: int = 4  # deeper than K = 3 drafts can reach


@pytest.mark.parametrize("proposer,message", [
    (MutableProposer(), r"proposer=MutableProposer\(.*\) is not hashable.*frozen dataclass"),
    (ArrayHoldingProposer(table=jnp.arange(3)), r"proposer=ArrayHoldingProposer\(.*is not hashable.*proposer_params"),
    (NoUpdate(), r"proposer=<.*NoUpdate.*> is not a jaxspec.proposers.base.Proposer"),
    (Undeclared(), r"proposer=Undeclared\(.*\) is not a jaxspec.proposers.base.Proposer: inherit it.*ChainProposer"),
    (NoBudget(), r"proposer=NoBudget\(\) has no num_speculative_tokens"),
    (WrongDepth(), r"proposer.max_depth=4 must be an integer in \[0, num_speculative_tokens=3\]"),
    (None, r"method='custom' needs proposer="),
])
def test_bad_custom_proposers_raise_naming_the_proposer(proposer, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(method="custom", num_speculative_tokens=3, proposer=proposer)


# ------------------------------------------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("kwargs,message", [
    (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[4, 5]), r"prompt_lengths\[1\]=5 must be in \[1, 4\]"),
    (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[4, 0]), r"prompt_lengths\[1\]=0"),
    (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[4]), r"prompt_lengths=\[4\] must be 2 integers"),
    (dict(prompts=np.ones((2, 4), np.float32)), "prompts is a float32 array"),
    (dict(prompts=np.ones((2, 0), np.int32)), r"prompts has shape \(2, 0\)"),
    (dict(prompts=[[1, 2]], prompt_lengths=[2]), "prompt_lengths=.* needs prompts as one 2-D integer array"),
    (dict(prompts=np.asarray([[1, 2, 500]])), "token id 500"),
    (dict(prompts=[jnp.asarray([1.0, 2.0])]), "prompt 0=.* must be a string or a list of integer token ids"),
])
def test_bad_array_prompts_raise_naming_the_value(tiny_lm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(tiny_lm, max_new_tokens=2, **kwargs)


def test_prepare_needs_at_least_one_new_token(tiny_lm):
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1 for prepare"):
        jaxspec.prepare(tiny_lm, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens=-3"):
        jaxspec.prepare(tiny_lm, [[1, 2]], max_new_tokens=-3)


# ------------------------------------------------------------------------------------------------ the example

@pytest.mark.real_model
def test_example_own_loop_runs_on_the_default_model(default_model_installed):
    """examples/own_loop.py on SmolLM2-135M (skipped where the model is not installed, except under CI=true)."""
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "own_loop.py"), "--max-new-tokens", "8"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plain" in run.stdout and "sam" in run.stdout and "identical: True" in run.stdout
