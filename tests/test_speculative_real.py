"""Speculative decoding on the real default model (SmolLM2-135M-Instruct) with real HumanEval prompts.

Greedy speculative output must equal greedy plain output token for token, for every proposer, one prompt at
a time and four at a time.
"""

from __future__ import annotations

import json
import re

import pytest
import tokenizers

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.models.tokenizer import Tokenizer
from jaxspec.proposers.draft_model import self_draft_model

pytestmark = pytest.mark.real_model

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompt_ids(smollm2, humaneval_prompts):
    return [smollm2.tokenizer.encode(p) for p in humaneval_prompts[:8]]


@pytest.fixture(scope="module")
def plain(smollm2, prompt_ids):
    return [jaxspec.generate(smollm2, [p], max_new_tokens=NEW_TOKENS).token_ids[0] for p in prompt_ids]


def _specs(lm):
    return {
        "ngram": SpecConfig(method="ngram", num_speculative_tokens=5),
        "sam": SpecConfig(method="sam", num_speculative_tokens=8, min_match=2),
        "self_draft": SpecConfig(method="self_draft", num_speculative_tokens=2, self_draft_layers=2),
        "draft_model": SpecConfig(method="draft_model", num_speculative_tokens=2,
                                  draft_model=self_draft_model(lm, 4)),
    }


@pytest.mark.parametrize("method", ["ngram", "sam", "self_draft", "draft_model"])
def test_greedy_speculative_equals_plain_batch_1(smollm2, prompt_ids, plain, method):
    spec = _specs(smollm2)[method]
    outs = [jaxspec.generate(smollm2, [p], max_new_tokens=NEW_TOKENS, spec=spec) for p in prompt_ids]
    assert [o.token_ids[0] for o in outs] == plain
    if method in ("ngram", "sam"):
        # Code repeats itself: lookup proposers find matches, and some drafts are accepted.
        assert sum(o.stats.accepted for o in outs) > 0


@pytest.mark.parametrize("method", ["ngram", "sam", "self_draft", "draft_model"])
def test_greedy_speculative_equals_plain_batch_4(smollm2, prompt_ids, plain, method):
    spec = _specs(smollm2)[method]
    got = []
    for i in range(0, len(prompt_ids), 4):
        got += jaxspec.generate(smollm2, prompt_ids[i: i + 4], max_new_tokens=NEW_TOKENS, spec=spec).token_ids
    assert got == plain


def test_seeded_sampling_with_sam_mostly_reproduces_plain(smollm2, prompt_ids):
    """Deterministic drafts are judged against the target's position-keyed sample, so a seeded sampled run
    reproduces plain sampling exactly unless the verify forward's logits (T new tokens) and the decode
    forward's (one token) differ in float rounding enough to move a sample; that is rare, so most rows match
    and every row agrees for its first tokens."""
    sampling = SamplingParams(temperature=0.8, seed=11)
    plain = jaxspec.generate(smollm2, prompt_ids, max_new_tokens=NEW_TOKENS, sampling=sampling)
    spec = SpecConfig(method="sam", num_speculative_tokens=8, min_match=2)
    out = jaxspec.generate(smollm2, prompt_ids, max_new_tokens=NEW_TOKENS, sampling=sampling, spec=spec)
    same = sum(a == b for a, b in zip(out.token_ids, plain.token_ids))
    assert same >= 6, (same, out.token_ids, plain.token_ids)
    assert all(a[:8] == b[:8] for a, b in zip(out.token_ids, plain.token_ids))


def test_both_sam_indexes_draft_the_same_tokens(smollm2, prompt_ids, plain):
    """The match-length array and the suffix automaton find the same earlier occurrences on real text: equal
    outputs, and equal drafted and accepted counts step for step."""
    runs = {}
    for index in ("match", "automaton"):
        spec = SpecConfig(method="sam", num_speculative_tokens=8, min_match=2, sam_index=index)
        runs[index] = jaxspec.generate(smollm2, prompt_ids[:4], max_new_tokens=NEW_TOKENS, spec=spec)
    match, automaton = runs["match"], runs["automaton"]
    assert match.token_ids == automaton.token_ids == plain[:4]
    assert match.stats.drafted > 0 and match.stats.accepted > 0
    for field in ("steps", "drafted", "accepted", "drafted_per_position", "accepted_per_position"):
        assert getattr(match.stats, field) == getattr(automaton.stats, field), field


def test_a_draft_model_with_another_tokenizer_is_refused(smollm2):
    """Same vocabulary size, two entries swapped: the draft's ids would mean other tokens, so drafting is refused
    by name before anything compiles; an equal tokenizer in another object passes the check."""
    def rebuilt(edit=lambda vocab: None):
        data = json.loads(smollm2.tokenizer.backend.to_str())
        edit(data["model"]["vocab"])
        t = smollm2.tokenizer
        return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(data)), bos_token_id=t.bos_token_id,
                         eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id, add_bos=t.add_bos)

    a, b = smollm2.tokenizer.id_to_token(1000), smollm2.tokenizer.id_to_token(2000)

    def swap(vocab):
        vocab[a], vocab[b] = vocab[b], vocab[a]

    assert smollm2.tokenizer.first_difference(rebuilt()) is None
    draft = self_draft_model(smollm2, 2)
    draft.tokenizer = rebuilt(swap)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=2, draft_model=draft)
    with pytest.raises(ValueError, match=re.escape(f"token 1000 is {b!r} there and {a!r} in the target")):
        jaxspec.generate(smollm2, ["def f():"], max_new_tokens=4, spec=spec)


def test_generate_follows_the_draft_policy(smollm2, prompt_ids, plain):
    """`generate(policy=...)` takes the same `DraftPolicy` the engine and rollouts use: its cap for the call's
    batch bounds every row's drafts, and a policy kept across calls learns from each (the guard's warm-up
    alternates drafting and plain calls). Output is plain greedy's whatever the cap."""
    from jaxspec.policy import DraftPolicy, LoadLimit

    spec = SpecConfig(method="sam", num_speculative_tokens=8, min_match=2)
    four = prompt_ids[:4]
    off = jaxspec.generate(smollm2, four, max_new_tokens=NEW_TOKENS, spec=spec, policy=DraftPolicy("off"))
    assert off.token_ids == plain[:4] and off.stats.drafted == 0
    # Four rows, the full K at one request in flight, halved per doubling: a cap of 8 / 4 = 2 drafts.
    capped = jaxspec.generate(smollm2, four, max_new_tokens=NEW_TOKENS, spec=spec,
                              policy=DraftPolicy(load=LoadLimit(max_active=8), guard=None))
    assert capped.token_ids == plain[:4]
    assert capped.stats.drafted > 0 and capped.stats.accepted > 0
    assert max(max(r.committed_per_step) for r in capped.stats.rows) <= 3
    assert max(max(r.committed_per_step) for r in jaxspec.generate(
        smollm2, four, max_new_tokens=NEW_TOKENS, spec=spec).stats.rows) > 3  # the cap is what held it
    # The serving default at one row: the guard measures a drafting call, then a plain one.
    policy = DraftPolicy()
    first = jaxspec.generate(smollm2, [prompt_ids[0]], max_new_tokens=NEW_TOKENS, spec=spec, policy=policy)
    assert first.stats.drafted > 0 and policy.guard.measured(1) == (1, 0)
    second = jaxspec.generate(smollm2, [prompt_ids[0]], max_new_tokens=NEW_TOKENS, spec=spec, policy=policy)
    assert second.stats.drafted == 0 and policy.guard.measured(1) == (1, 1)
    assert first.token_ids[0] == second.token_ids[0] == plain[0]
    # A prediction's drafts are drafts too: "off" caps them at 0 although spec's own method drafts nothing.
    predicted = dict(max_new_tokens=NEW_TOKENS, prediction=plain[0])
    free = jaxspec.generate(smollm2, [prompt_ids[0]], **predicted)
    held = jaxspec.generate(smollm2, [prompt_ids[0]], **predicted, policy=DraftPolicy("off"))
    assert free.stats.drafted > 0 and free.stats.accepted > 0 and held.stats.drafted == 0
    assert free.token_ids[0] == held.token_ids[0] == plain[0]
    with pytest.raises(ValueError, match="policy='adaptive'"):
        jaxspec.generate(smollm2, four, max_new_tokens=4, spec=spec, policy="adaptive")
