"""`generate(..., logprobs=L)`: the target's log-probability of every generated token, and its L most likely
tokens, recorded inside the decode loop.

On the tiny random model (a flat-ish distribution, so ranks and values are both informative): plain decoding
must match a teacher-forced forward over the whole generated sequence, and every proposer (chain and tree)
must record the same values as plain decoding, since each committed token's position was scored by the
target either way. Tree proposers are covered in tests/test_tree_decode.py, the engine in test_engine.py and
the server's OpenAI formats in test_server.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from test_speculative import OracleProposer

PROMPTS = [[5, 6, 7, 8] * 3, [10, 11, 12, 13, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=3),
            SamplingParams(temperature=1.2, top_p=0.8, seed=4)]
N, TOP = 24, 5


def teacher_forced(lm, prompt: list[int], generated: list[int]) -> np.ndarray:
    """f32[len(generated), V]: the target's log-softmax at each generated token's position, from one forward
    over the whole sequence."""
    tokens = jnp.asarray([prompt + generated], jnp.int32)
    n = tokens.shape[1]
    model = nnx.merge(lm.graphdef, lm.params)
    out, _ = model(tokens, jnp.arange(n, dtype=jnp.int32)[None], model.new_cache(1, n), attention_impl="xla")
    logp = jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1)
    return np.asarray(logp[len(prompt) - 1: n - 1])


@pytest.fixture(scope="module")
def plain(tiny_lm):
    return jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=N, sampling=SAMPLING, logprobs=TOP)


def test_plain_logprobs_equal_a_teacher_forced_forward(tiny_lm, plain):
    assert plain.logprobs is not None
    for prompt, generated, row in zip(PROMPTS, plain.token_ids, plain.logprobs):
        assert [e.token_id for e in row] == generated
        ref = teacher_forced(tiny_lm, prompt, generated)
        got = np.asarray([e.logprob for e in row])
        np.testing.assert_allclose(got, ref[np.arange(len(generated)), generated], atol=2e-5)
        for i, e in enumerate(row):
            ids, values = zip(*e.top)
            assert len(ids) == TOP
            np.testing.assert_allclose(values, ref[i, list(ids)], atol=2e-5)
            np.testing.assert_allclose(values, np.sort(ref[i])[::-1][:TOP], atol=2e-5)  # the most likely, in order
    # The greedy row's token is the most likely one; the sampled rows pick others too.
    assert all(e.token_id == e.top[0][0] for e in plain.logprobs[0])
    assert any(e.token_id != e.top[0][0] for row in plain.logprobs[1:] for e in row)


SPECS = [SpecConfig(method="ngram", num_speculative_tokens=4, min_match=2),
         SpecConfig(method="sam", num_speculative_tokens=6, min_match=2),
         SpecConfig(method="self_draft", num_speculative_tokens=3, self_draft_layers=1), "oracle"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s if isinstance(s, str) else s.method)
def test_speculative_logprobs_equal_plain(tiny_lm, plain, spec):
    greedy = SAMPLING[:1] * len(PROMPTS)
    ref = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=N, sampling=greedy, logprobs=TOP)
    if spec == "oracle":  # drafts the plain continuation, rows capped at 0-4 drafts: blocks of 1-5 tokens
        known = [p + r for p, r in zip(PROMPTS, ref.token_ids)]
        width = max(len(r) for r in known)
        table = jnp.asarray([r + [0] * (width - len(r)) for r in known], jnp.int32)
        spec = SpecConfig(method="custom", num_speculative_tokens=4, proposer=OracleProposer(4, (4, 0, 2)),
                          proposer_params=table)
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=N, sampling=greedy, logprobs=TOP, spec=spec)
    assert out.token_ids == ref.token_ids
    if spec.method == "custom":
        assert max(max(r.committed_per_step) for r in out.stats.rows) == 5  # several tokens in one step
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b], atol=2e-5)
        assert [[t for t, _ in e.top] for e in a] == [[t for t, _ in e.top] for e in b]
    if spec.method in ("ngram", "sam"):  # deterministic drafts replay seeded sampling token for token
        seeded = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=N, sampling=SAMPLING, logprobs=TOP, spec=spec)
        assert seeded.token_ids == plain.token_ids
        for a, b in zip(seeded.logprobs, plain.logprobs):
            np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b], atol=2e-5)


def test_stops_and_budgets_keep_one_value_per_token(tiny_lm, plain):
    stop = plain.token_ids[0][5]
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=N, stop_token_ids=[stop], logprobs=0,
                           spec=SpecConfig(method="sam", num_speculative_tokens=6, min_match=2))
    for ids, row in zip(out.token_ids, out.logprobs):
        assert [e.token_id for e in row] == ids
        assert all(e.top == () for e in row)  # logprobs=0: the chosen token's value only
    assert out.finish_reason[0] == "stop"
    np.testing.assert_allclose([e.logprob for e in out.logprobs[0]], [e.logprob for e in plain.logprobs[0][:6]],
                               atol=2e-5)


def test_logprobs_off_records_nothing(tiny_lm):
    out = jaxspec.generate(tiny_lm, PROMPTS[:1], max_new_tokens=4)
    assert out.logprobs is None
    assert jaxspec.generate(tiny_lm, PROMPTS[:1], max_new_tokens=0, logprobs=2).logprobs == [[]]


@pytest.mark.parametrize("bad", [-1, 98, 1.5, True, "3"])
def test_bad_logprobs_name_the_value(tiny_lm, bad):
    with pytest.raises(ValueError, match=f"logprobs={bad!r}"):
        jaxspec.generate(tiny_lm, PROMPTS[:1], max_new_tokens=4, logprobs=bad)
