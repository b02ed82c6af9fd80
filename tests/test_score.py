"""`jaxspec.score`: log-probabilities of given sequences from one forward of the model.

The real model: the values equal what `generate(..., logprobs=L)` recorded while decoding, and the logits behind
them equal transformers' float32 run (tests/fixtures/smollm2_greedy.json). The tiny random model: batched rows
equal each row alone and a hand-written log-softmax of the model's own forward, at any temperature and with
`max_scored`; the gradient with respect to the weights equals that reference's; bad input is refused by name.

The tiny model's calls share shapes ([3, 16] rows, or [1, 16]), so the file compiles few programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from contracts import programs_compiled

VOCAB = 97  # the tiny model's
WIDTH = 16
LENGTHS = [16, 9, 12]
PROMPT_LENS = [4, 1, 7]


@pytest.fixture(scope="module")
def rows():
    """i32[3, 16] random tokens; the padding past each row's length is garbage (-1, 500) the forward must ignore."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(3, WIDTH)).astype(np.int32)
    tokens[1, LENGTHS[1]:] = -1
    tokens[2, LENGTHS[2]:] = 500
    return tokens


def reference(lm, params, tokens, length: int, prompt_len: int, temperature: float = 1.0):
    """f32[T] a row's log-probabilities by hand: log-softmax of the full forward's logits / temperature at t - 1,
    picked at token t, for max(prompt_len, 1) <= t < length; 0 elsewhere. Differentiable in params."""
    row = jnp.asarray(tokens[None, :length], jnp.int32)
    model = nnx.merge(lm.graphdef, params)
    out, _ = model(row, jnp.arange(length, dtype=jnp.int32)[None], model.new_cache(1, length))
    logp = jax.nn.log_softmax(out.logits[0].astype(jnp.float32) / temperature, axis=-1)  # f32[length, V]
    picked = jnp.take_along_axis(logp[:-1], row[0, 1:, None], axis=-1)[:, 0]  # f32[length - 1] tokens 1..
    t = jnp.arange(1, length)
    picked = jnp.where(t >= prompt_len, picked, 0.0)
    return jnp.zeros((len(tokens),), jnp.float32).at[1:length].set(picked)


# ------------------------------------------------------------------------------------------- real model

@pytest.fixture(scope="module")
def real_run(smollm2, greedy_fixture):
    """Greedy generate with logprobs=5 of two prompts of different lengths, and score of prompt + output."""
    prompts = [greedy_fixture["fibonacci"]["prompt_ids"], greedy_fixture["humaneval"][2]["prompt_ids"]]
    gen = jaxspec.generate(smollm2, prompts, max_new_tokens=12, logprobs=5, ignore_eos=True)
    seqs = [p + out for p, out in zip(prompts, gen.token_ids)]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    res = jaxspec.score(smollm2, tokens, lengths=[len(s) for s in seqs], prompt_lens=[len(p) for p in prompts],
                        top_logprobs=64)
    return prompts, gen, res


@pytest.mark.real_model
def test_score_equals_generate_logprobs(real_run):
    prompts, gen, res = real_run
    logprobs, top_ids, top = (np.asarray(x) for x in (res.logprobs, res.top_ids, res.top_logprobs))
    for i, (prompt, out, recorded) in enumerate(zip(prompts, gen.token_ids, gen.logprobs)):
        at = slice(len(prompt), len(prompt) + len(out))
        assert np.asarray(res.mask)[i].nonzero()[0].tolist() == list(range(at.start, at.stop))
        np.testing.assert_allclose(logprobs[i, at], [e.logprob for e in recorded], atol=1e-4)
        for t, e in zip(range(at.start, at.stop), recorded):
            assert top_ids[i, t, :5].tolist() == [tid for tid, _ in e.top]
            np.testing.assert_allclose(top[i, t, :5], [v for _, v in e.top], atol=1e-4)
            assert top_ids[i, t, 0] == e.token_id  # greedy: the chosen token is the most likely
        assert np.all(logprobs[i, : at.start] == 0) and np.all(logprobs[i, at.stop:] == 0)


@pytest.mark.real_model
def test_score_agrees_with_transformers_logits(real_run, greedy_fixture):
    """At the prompt's last position transformers' float32 logits of its top-20 ids differ from each other as
    score's log-probabilities of those ids do (log-softmax only subtracts one constant per position)."""
    fib = greedy_fixture["fibonacci"]
    _, _, res = real_run
    t = len(fib["prompt_ids"])  # the first generated token's position: predicted from the whole prompt
    got = dict(zip(np.asarray(res.top_ids)[0, t].tolist(), np.asarray(res.top_logprobs)[0, t].tolist()))
    ids, hf = fib["last_prompt_top20_ids"], np.asarray(fib["last_prompt_top20_logits"])
    assert set(ids) <= set(got), "transformers' 20 most likely tokens are among score's 64"
    ours = np.asarray([got[i] for i in ids])
    np.testing.assert_allclose(ours - ours[0], hf - hf[0], atol=2e-3)
    assert int(np.asarray(res.top_ids)[0, t, 0]) == ids[0] == fib["greedy_new_ids"][0]
    assert float(np.asarray(res.logprobs)[0, t]) == pytest.approx(ours[0], abs=1e-6)


# ------------------------------------------------------------------------------------------- tiny model

def test_batched_rows_equal_each_row_alone_and_the_reference(tiny_lm, rows):
    for temperature in (1.0, 0.7):
        batched = jaxspec.score(tiny_lm, rows, lengths=LENGTHS, prompt_lens=PROMPT_LENS, temperature=temperature,
                                top_logprobs=3)
        bounded = jaxspec.score(tiny_lm, rows, lengths=LENGTHS, prompt_lens=PROMPT_LENS, temperature=temperature,
                                top_logprobs=3, max_scored=12)
        for i, (n, p) in enumerate(zip(LENGTHS, PROMPT_LENS)):
            want = np.asarray(reference(tiny_lm, tiny_lm.params, rows[i], n, p, temperature))
            alone = jaxspec.score(tiny_lm, rows[i: i + 1], lengths=[n], prompt_lens=[p], temperature=temperature,
                                  top_logprobs=3)
            for got in (batched, bounded):
                np.testing.assert_allclose(np.asarray(got.logprobs[i]), want, atol=2e-5)
                np.testing.assert_allclose(np.asarray(got.logprobs[i]), np.asarray(alone.logprobs[0]), atol=2e-5)
                np.testing.assert_array_equal(np.asarray(got.top_ids[i]), np.asarray(alone.top_ids[0]))
                np.testing.assert_allclose(np.asarray(got.top_logprobs[i]), np.asarray(alone.top_logprobs[0]),
                                           atol=2e-5)
            mask = np.asarray(batched.mask[i])
            assert mask.nonzero()[0].tolist() == list(range(max(p, 1), n))
            assert np.all(np.asarray(batched.top_ids[i])[~mask] == 0)
            assert np.all(np.asarray(batched.top_logprobs[i])[~mask] == 0)
            np.testing.assert_array_equal(np.asarray(bounded.mask[i]), mask)
    # A row of exactly its own length (no padding, no prompt_lens: every position but 0), and a mask instead of
    # lengths (at the last temperature), give the same values.
    n = LENGTHS[1]
    own = jaxspec.score(tiny_lm, rows[1:2, :n].tolist())
    np.testing.assert_allclose(np.asarray(own.logprobs[0]), np.asarray(reference(tiny_lm, tiny_lm.params,
                                                                                 rows[1], n, 0))[:n], atol=2e-5)
    masked = jaxspec.score(tiny_lm, rows, mask=np.arange(WIDTH)[None] < np.asarray(LENGTHS)[:, None],
                           prompt_lens=PROMPT_LENS, temperature=0.7, top_logprobs=3)
    np.testing.assert_array_equal(np.asarray(masked.logprobs), np.asarray(batched.logprobs))


def test_top_logprobs_and_ranks_are_the_vocabulary_order(tiny_lm, rows):
    res = jaxspec.score(tiny_lm, rows, lengths=LENGTHS, prompt_lens=PROMPT_LENS, top_logprobs=3)
    model = tiny_lm.module
    out, _ = model(jnp.asarray(rows[:1]), jnp.arange(WIDTH)[None], model.new_cache(1, WIDTH))
    logp = np.asarray(jax.nn.log_softmax(out.logits[0], axis=-1))  # f32[T, V] row 0 is unpadded
    for t in range(PROMPT_LENS[0], WIDTH):
        order = np.argsort(-logp[t - 1])[:3]
        assert np.asarray(res.top_ids[0, t]).tolist() == order.tolist()
        np.testing.assert_allclose(np.asarray(res.top_logprobs[0, t]), logp[t - 1, order], atol=2e-5)
        assert float(res.logprobs[0, t]) == pytest.approx(logp[t - 1, rows[0, t]], abs=2e-5)
        assert int(res.ranks[0, t]) == 1 + int(np.sum(logp[t - 1] > logp[t - 1, rows[0, t]]))
    assert np.all(np.asarray(res.ranks)[~np.asarray(res.mask)] == 0)


@pytest.mark.contract
def test_new_params_reuse_the_program_and_score_under_those_weights(tiny_lm, rows, caplog):
    scaled = jax.tree.map(lambda x: x * 1.5, tiny_lm.params)
    base = jaxspec.score(tiny_lm, rows, lengths=LENGTHS, prompt_lens=PROMPT_LENS, top_logprobs=3)
    res = []
    assert programs_compiled(caplog, lambda: res.append(jaxspec.score(
        tiny_lm, rows, lengths=LENGTHS, prompt_lens=PROMPT_LENS, top_logprobs=3, params=scaled))) == {}
    res = res[0]
    want = np.asarray(reference(tiny_lm, scaled, rows[2], LENGTHS[2], PROMPT_LENS[2]))
    np.testing.assert_allclose(np.asarray(res.logprobs[2]), want, atol=2e-5)
    assert np.abs(np.asarray(res.logprobs) - np.asarray(base.logprobs)).max() > 1e-2


def test_gradient_with_respect_to_params_equals_the_reference(tiny_lm, rows):
    weights = jnp.asarray(np.random.default_rng(1).normal(size=rows.shape), jnp.float32)  # f32[B, T]
    lengths, prompt_lens = jnp.asarray(LENGTHS, jnp.int32), jnp.asarray(PROMPT_LENS, jnp.int32)
    tokens = jnp.asarray(rows)

    def ours(params, max_scored):
        res = jaxspec.score_arrays(tiny_lm.graphdef, params, tokens, lengths, prompt_lens, 0.8,
                                   max_scored=max_scored)
        return jnp.sum(weights * res.logprobs)

    def theirs(params):
        return sum(jnp.sum(weights[i] * reference(tiny_lm, params, rows[i], n, p, 0.8))
                   for i, (n, p) in enumerate(zip(LENGTHS, PROMPT_LENS)))

    want_value, want = jax.value_and_grad(theirs)(tiny_lm.params)
    norm = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want))
    assert norm > 1e-3  # the check below has something to compare
    for max_scored in (None, 12):
        value, grad = jax.jit(jax.value_and_grad(ours), static_argnums=1)(tiny_lm.params, max_scored)
        assert float(value) == pytest.approx(float(want_value), abs=1e-4)
        assert jax.tree_util.tree_structure(grad) == jax.tree_util.tree_structure(want)
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grad)[0], jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * norm + 1e-6,
                                       err_msg=jax.tree_util.keystr(path))


def test_rows_of_one_token_score_nothing(tiny_lm):
    res = jaxspec.score(tiny_lm, [[5], [7]], top_logprobs=2)
    assert res.logprobs.shape == (2, 1) and res.top_ids.shape == (2, 1, 2)
    assert not np.asarray(res.mask).any() and np.all(np.asarray(res.logprobs) == 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(token_ids=[[1, 2, 3], [4, 5]]), r"token_ids is ragged: row 1 has 2 tokens, row 0 has 3"),
    (dict(token_ids=[[1, 2, 3], [4, 97, 5]]), r"token_ids\[1, 1\]=97 is outside the vocabulary \[0, 97\)"),
    (dict(token_ids=[[1, -2, 3]]), r"token_ids\[0, 1\]=-2 is outside"),
    (dict(token_ids=np.zeros((2, 0), np.int32)), r"token_ids has shape \(2, 0\)"),
    (dict(token_ids=[]), r"token_ids=\[\] must be a non-empty list"),
    (dict(token_ids=[[1.5, 2.0]]), r"token_ids\[0\]=\[1.5, 2.0\] must hold integer token ids"),
    (dict(token_ids=np.ones((2, 3), np.float32)), r"token_ids is a float32 array of shape \(2, 3\)"),
    (dict(token_ids=[1, 2, 3]), r"token_ids=\[1, 2, 3\] must be a non-empty list of token-id lists"),
    (dict(lengths=[3, 4]), r"lengths\[1\]=4 must be in \[0, 3\]"),
    (dict(lengths=[3]), r"lengths=\[3\] must be 2 integers"),
    (dict(lengths=[3, 3], mask=np.ones((2, 3), bool)), r"pass lengths= or mask=, not both"),
    (dict(mask=[[1, 0, 1], [1, 1, 1]]), r"mask row 0 has padding before a token"),
    (dict(mask=np.ones((2, 4), bool)), r"mask has shape \(2, 4\); it must be booleans of token_ids' shape"),
    (dict(mask=[[1, 2, 1], [1, 1, 1]]), r"mask=.* must hold booleans"),
    (dict(lengths=[3, 2], prompt_lens=[1, 3]), r"prompt_lens\[1\]=3 must be in \[0, 2\]"),
    (dict(temperature=0.0), r"temperature=0.0 must be a finite number > 0"),
    (dict(temperature=float("nan")), r"temperature=nan"),
    (dict(top_logprobs=98), r"top_logprobs=98 must be an integer in \[0, 97\]"),
    (dict(top_logprobs=True), r"top_logprobs=True"),
    (dict(max_scored=1), r"max_scored=1 is less than row 0's 2 scored positions"),
    (dict(max_scored=0), r"max_scored=0 must be None or an integer >= 1"),
])
def test_bad_input_is_refused_by_name(tiny_lm, kwargs, match):
    kwargs = {"token_ids": [[1, 2, 3], [4, 5, 6]], **kwargs}
    with pytest.raises(ValueError, match=match):
        jaxspec.score(tiny_lm, **kwargs)


def test_params_of_other_shapes_are_refused(tiny_lm):
    wrong = jax.tree.map(lambda x: x[..., :1] if x.ndim == 2 else x, tiny_lm.params)
    with pytest.raises(ValueError, match=r"params.* has shape"):
        jaxspec.score(tiny_lm, [[1, 2, 3]], params=wrong)
