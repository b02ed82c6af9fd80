"""Constraints inside the decode loop: every verified position masked, the state advanced along drafts (chains
and trees) and by exactly the committed tokens, forced tokens drafted for free.

On the tiny model (no tokenizer) the constraint is a hand-built token automaton; on the default model, JSON
schemas and regexes compiled with outlines-core. Speculative greedy output equals plain constrained greedy
output; sampled output follows the masked target distribution, and a verifier that skips the mask at draft
positions (the negative control) does not.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.constraints import TokenAutomaton
from jaxspec.constraints import rows as constraint_rows
from test_speculative import OracleProposer, _reference
from test_tree_decode import TOPOLOGY, OracleTreeProposer, _known

VOCAB = 97  # the tiny model's


def parity_automaton(vocab: int = VOCAB) -> TokenAutomaton:
    """Tokens alternate even, odd, even, ...: state 0 allows even ids (then state 1), state 1 odd ones (then 0)."""
    words = -(-vocab // 32)
    allowed = np.zeros((2, words * 32), bool)
    allowed[0, 0:vocab:2] = True
    allowed[1, 1:vocab:2] = True
    # bit i of word w is token 32 w + i
    packed = (allowed.reshape(2, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    keys, nxt = [], []
    for state in (0, 1):
        for token in range(state, vocab, 2):
            keys.append(state * vocab + token)
            nxt.append(1 - state)
    return TokenAutomaton(allowed=jnp.asarray(packed.reshape(2, words).astype(np.uint32)),
                          keys=jnp.asarray(keys, jnp.int32), next=jnp.asarray(nxt, jnp.int32),
                          final=jnp.zeros((2,), bool), forced=jnp.full((2,), -1, jnp.int32),
                          jump=jnp.full((2,), -1, jnp.int32), vocab_size=vocab)


def _parity_ok(tokens) -> bool:
    return all(t % 2 == i % 2 for i, t in enumerate(tokens))


@pytest.fixture(scope="module")
def parity():
    return parity_automaton()


def test_the_hand_built_automaton_is_what_it_says(parity):
    mask = np.asarray(jaxspec.constraints.allowed_mask(parity, jnp.asarray([0, 1])))
    assert mask[0].tolist() == [t % 2 == 0 for t in range(VOCAB)]
    assert mask[1].tolist() == [t % 2 == 1 for t in range(VOCAB)]
    assert jaxspec.constraints.advance(parity, jnp.int32(0), jnp.int32(3)).item() == jaxspec.constraints.DEAD


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (6, 13, 9)]


@pytest.fixture(scope="module")
def plain(tiny_lm, prompts, parity):
    """Plain constrained decoding: no drafts at all (forced tokens off)."""
    return jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, constraint=parity,
                            spec=SpecConfig(forced_tokens=0))


def test_plain_constrained_greedy_is_the_masked_argmax(tiny_lm, prompts, plain):
    unconstrained = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32)
    assert all(_parity_ok(row) for row in plain.token_ids)
    assert not all(_parity_ok(row) for row in unconstrained.token_ids)
    assert plain.stats.drafted == 0


def test_forced_drafting_verifies_short_runs_at_short_widths(tiny_lm, prompts, parity):
    """A forced run (a JSON key) is a few tokens: widths 3 and 5 beside the long-draft ones; no forced drafting,
    no extra widths."""
    assert jaxspec.prepare(tiny_lm, prompts, max_new_tokens=32, constraint=parity).widths == (1, 3, 5, 9, 17)
    sam = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=32, constraint=parity, spec=SpecConfig(method="sam"))
    assert sam.widths == (1, 3, 5, 9, 17)
    off = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=32, constraint=parity, spec=SpecConfig(forced_tokens=0))
    assert off.widths == (1,)


@pytest.mark.parametrize("kind", ["oracle_chain", "oracle_tree", "sam"])
def test_greedy_speculative_under_a_constraint_equals_plain(tiny_lm, prompts, plain, parity, kind):
    spec = {"oracle_chain": lambda: SpecConfig(method="custom", num_speculative_tokens=5,
                                               proposer=OracleProposer(5),
                                               proposer_params=_reference(prompts, plain)),
            "oracle_tree": lambda: SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes,
                                              proposer=OracleTreeProposer(TOPOLOGY.num_nodes, TOPOLOGY, (0, 1, 0, 0),
                                                                          vocab=VOCAB),
                                              proposer_params=_known(prompts, plain, 128)),
            "sam": lambda: SpecConfig(method="sam", num_speculative_tokens=4, min_match=1)}[kind]()
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, constraint=parity, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_rows_without_a_constraint_decode_as_if_alone(tiny_lm, prompts, plain, parity):
    free = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32)
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=32, constraint=[parity, None, parity],
                           spec=SpecConfig(method="sam", num_speculative_tokens=4, min_match=1))
    assert out.token_ids == [plain.token_ids[0], free.token_ids[1], plain.token_ids[2]]


def _exact_masked_joint(lm, prompt, sampling, aut, length):
    """{token sequence: probability} of the first `length` tokens sampled under the constraint, by
    teacher-forced forwards and the automaton's masks."""
    joint = {(): 1.0}
    for _ in range(length):
        seqs = list(joint)
        rows = np.array([prompt + list(q) for q in seqs], np.int32)
        out, _ = lm.module(jnp.asarray(rows), jnp.broadcast_to(jnp.arange(rows.shape[1]), rows.shape),
                           lm.module.new_cache(len(rows), 64))
        states = jnp.asarray([len(q) % 2 for q in seqs], jnp.int32)  # the parity automaton's state
        logits = jnp.where(jaxspec.constraints.allowed_mask(aut, states), out.logits[:, -1], -jnp.inf)
        probs = np.asarray(jaxspec.processed_probs(logits, sampling))
        joint = {q + (t,): joint[q] * p[t] for q, p in zip(seqs, probs) for t in np.flatnonzero(p > 0)}
    return joint


def test_sampled_constrained_output_follows_the_masked_distribution(tiny_lm, parity, monkeypatch):
    """2048 seeds, a probabilistic draft model: the first three tokens follow the exact masked joint; a verifier
    that masks only the first scored position (skipping the mask at draft positions) does not."""
    num, prompt = 2048, [3, 14, 15, 92, 65]
    sampling = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(num)]
    exact = _exact_masked_joint(tiny_lm, prompt, SamplingParams(temperature=1.0, top_k=3), parity, 3)  # 27 cells
    draft = dataclasses.replace(tiny_lm, name="sharpened", params=jax.tree.map(lambda x: x, tiny_lm.params))
    draft.params["lm_head"].set_value(tiny_lm.params["lm_head"].get_value() * 20)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=2, draft_model=draft)

    def empirical():
        out = jaxspec.generate(tiny_lm, [prompt] * num, max_new_tokens=3, sampling=sampling, spec=spec,
                               constraint=parity)
        assert 0 < out.stats.accepted < out.stats.drafted
        seqs, counts = np.unique(np.array(out.token_ids), axis=0, return_counts=True)
        return {tuple(int(t) for t in q): c / num for q, c in zip(seqs, counts)}

    def tv(a, b):
        return 0.5 * sum(abs(a.get(q, 0.0) - b.get(q, 0.0)) for q in set(a) | set(b))

    speculative = empirical()
    assert all(_parity_ok(q) for q in speculative)
    assert tv(speculative, exact) < 0.08  # a correct sampler: ~0.04 at 2048 draws over 27 cells

    original = constraint_rows.constrain_scored

    def first_position_only(logits, rows, fed, parents, stop_ids):
        masked = original(logits, rows, fed, parents, stop_ids)
        return masked.at[:, 1:].set(logits[:, 1:])

    monkeypatch.setattr(constraint_rows, "constrain_scored", first_position_only)
    jax.clear_caches()
    try:
        control = empirical()
    finally:
        jax.clear_caches()
    print(f"TV speculative {tv(speculative, exact):.3f}, control {tv(control, exact):.3f}")
    assert tv(control, exact) > 0.2


# ------------------------------------------------------------------------------------- the default model

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "pet": {"enum": ["cat", "dog", "fish"]}, "indoor": {"type": "boolean"}},
          "required": ["name", "age", "pet", "indoor"]}
REQUESTS = ["Describe Tom, a 3 year old indoor cat, as JSON with name, age, pet and indoor.",
            "Give me JSON for Rex: a dog, 7 years old, who lives outside. Fields: name, age, pet, indoor."]


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    return [smollm2.tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True)
            for r in REQUESTS]


@pytest.fixture(scope="module")
def json_plain(smollm2, chat_prompts):
    return jaxspec.generate(smollm2, chat_prompts, max_new_tokens=64, constraint=jaxspec.JsonSchema(SCHEMA),
                            spec=SpecConfig(forced_tokens=0))


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig(method="sam"), SpecConfig(method="eagle2")],
                         ids=["forced", "sam+forced", "eagle2"])
def test_json_schema_output_validates_and_speculation_is_exact(smollm2, chat_prompts, json_plain, spec):
    out = jaxspec.generate(smollm2, chat_prompts, max_new_tokens=64, constraint=jaxspec.JsonSchema(SCHEMA),
                           spec=spec)
    assert out.token_ids == json_plain.token_ids
    for text, reason in zip(out.text, out.finish_reason):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_sampled_rows_and_mixed_constraints_on_the_default_model(smollm2, chat_prompts):
    """A regex row, a choice row and a free row in one batch, sampled with seeds: identical with and without
    speculation, and each constrained text matches its constraint."""
    prompts = ["The date of the first moon landing was ", chat_prompts[0], "def add(a, b):"]
    constraint = [jaxspec.Regex(r"\d{4}-\d{2}-\d{2}"), jaxspec.Choice(["cat", "dog", "fish"]), None]
    sampling = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    plain = jaxspec.generate(smollm2, prompts, max_new_tokens=16, sampling=sampling, constraint=constraint,
                             spec=SpecConfig(forced_tokens=0))
    out = jaxspec.generate(smollm2, prompts, max_new_tokens=16, sampling=sampling, constraint=constraint,
                           spec=SpecConfig(method="sam"))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", out.text[0]) and out.text[1] in ("cat", "dog", "fish")
    free = jaxspec.generate(smollm2, prompts[2:], max_new_tokens=16, sampling=sampling[2:])
    assert out.token_ids[2] == free.token_ids[0]


def test_constraint_errors(smollm2, tiny_lm, parity):
    with pytest.raises(ValueError, match="2 entries"):
        jaxspec.generate(smollm2, ["a", "b", "c"], max_new_tokens=4, constraint=[jaxspec.Regex("a"), None])
    with pytest.raises(ValueError, match=r"constraint\[0\]='x'"):
        jaxspec.generate(smollm2, ["a"], max_new_tokens=4, constraint=["x"])
    with pytest.raises(ValueError, match="has none: pass a TokenAutomaton"):
        jaxspec.generate(tiny_lm, [[1, 2]], max_new_tokens=4, constraint=jaxspec.Regex("a+"))
    with pytest.raises(ValueError, match="automaton over 97 tokens"):
        jaxspec.generate(smollm2, ["a"], max_new_tokens=4, constraint=parity)
    with pytest.raises(ValueError, match="forced_tokens=-1"):
        SpecConfig(forced_tokens=-1)
