"""`jaxspec.generate`: the real model against a float32 transformers run, batching, stopping, bad input."""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig

# ------------------------------------------------------------------------------------------- real model

@pytest.mark.real_model
def test_fibonacci_greedy_matches_independent_float32_run(smollm2, greedy_fixture):
    fib = greedy_fixture["fibonacci"]
    assert smollm2.tokenizer.encode(fib["prompt"]) == fib["prompt_ids"] == [1604, 3987, 46477, 24, 94, 727]
    result = jaxspec.generate(smollm2, fib["prompt"], max_new_tokens=32)
    assert result.token_ids[0][:16] == fib["greedy_new_ids"][:16]
    assert result.token_ids[0] == fib["greedy_new_ids"]
    # Every complete line of the completion is valid Python.
    source = fib["prompt"] + result.text[0]
    compile(source[: source.rindex("\n")], "<generated>", "exec")


@pytest.mark.real_model
def test_real_model_logits_match_independent_float32_run(smollm2, greedy_fixture):
    import jax.numpy as jnp

    fib = greedy_fixture["fibonacci"]
    module = smollm2.module
    ids = jnp.asarray([fib["prompt_ids"]], jnp.int32)
    out, _ = module(ids, jnp.arange(ids.shape[1])[None], module.new_cache(1, 16))
    last = np.asarray(out.logits[0, -1])
    np.testing.assert_allclose(last[fib["last_prompt_top20_ids"]], fib["last_prompt_top20_logits"], atol=2e-3)


@pytest.mark.real_model
def test_humaneval_batch_matches_batch1_reference(smollm2, greedy_fixture):
    """8 HumanEval prompts of different lengths in one batch equal transformers run one at a time."""
    rows = greedy_fixture["humaneval"]
    result = jaxspec.generate(smollm2, [r["prompt_ids"] for r in rows], max_new_tokens=32, ignore_eos=True)
    for r, got in zip(rows, result.token_ids):
        assert got == r["greedy_new_ids"], r["task_id"]
    alone = jaxspec.generate(smollm2, rows[3]["prompt_ids"], max_new_tokens=32, ignore_eos=True)
    assert alone.token_ids[0] == result.token_ids[3]


@pytest.mark.real_model
def test_text_prompts_chat_and_eos(smollm2):
    messages = [{"role": "user", "content": "Say hi."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages)
    result = jaxspec.generate(smollm2, [prompt], max_new_tokens=64)
    assert result.finish_reason == ["stop"]
    assert result.token_ids[0][-1] in smollm2.tokenizer.eos_token_ids
    assert result.text[0].strip() and "<|im_end|>" not in result.text[0]
    assert result.stats.prompt_tokens == len(smollm2.tokenizer.encode(prompt))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        jaxspec.generate(smollm2, ["def f():", ""], max_new_tokens=4)


# ------------------------------------------------------------------------------------------- tiny model

def _ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 97, n)]


def test_batch_independence_greedy(tiny_lm):
    prompts = [_ids(5, 0), _ids(23, 1), _ids(1, 2), _ids(12, 3)]
    batch = jaxspec.generate(tiny_lm, prompts, max_new_tokens=20)
    for p, got in zip(prompts, batch.token_ids):
        assert jaxspec.generate(tiny_lm, [p], max_new_tokens=20).token_ids[0] == got


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(tiny_lm):
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = jaxspec.generate(tiny_lm, [_ids(6, 4)], max_new_tokens=24, sampling=[mine])
    mixed = jaxspec.generate(
        tiny_lm, [_ids(9, 5), _ids(6, 4), _ids(3, 6)], max_new_tokens=24,
        sampling=[SamplingParams(), mine, SamplingParams(temperature=0.5, top_k=4, seed=9)])
    assert mixed.token_ids[1] == alone.token_ids[0]
    greedy_alone = jaxspec.generate(tiny_lm, [_ids(9, 5)], max_new_tokens=24)
    assert mixed.token_ids[0] == greedy_alone.token_ids[0]  # greedy rows unaffected by sampled neighbours
    other_seed = jaxspec.generate(tiny_lm, [_ids(6, 4)], max_new_tokens=24,
                                  sampling=[SamplingParams(temperature=1.0, top_p=0.9, seed=99)])
    assert other_seed.token_ids[0] != alone.token_ids[0]


def test_stop_tokens_end_rows_exactly_there(tiny_lm):
    prompts = [_ids(4, 7), _ids(8, 8)]
    free = jaxspec.generate(tiny_lm, prompts, max_new_tokens=16)
    assert free.finish_reason == ["length", "length"] and [len(t) for t in free.token_ids] == [16, 16]
    stop_a, stop_b = free.token_ids[0][2], free.token_ids[1][6]
    stopped = jaxspec.generate(tiny_lm, prompts, max_new_tokens=16, stop_token_ids=[[stop_a], [stop_b]])
    for row, free_row, stop in zip(stopped.token_ids, free.token_ids, (stop_a, stop_b)):
        end = free_row.index(stop) + 1
        assert row == free_row[:end]  # rows finish at different steps, the stop token is the last one
    assert stopped.finish_reason == ["stop", "stop"]
    assert stopped.stats.generated_tokens == sum(len(t) for t in stopped.token_ids)


def test_max_new_tokens_edge_cases(tiny_lm):
    assert jaxspec.generate(tiny_lm, [_ids(3, 9)], max_new_tokens=0).token_ids == [[]]
    one = jaxspec.generate(tiny_lm, [_ids(3, 9)], max_new_tokens=1)
    assert len(one.token_ids[0]) == 1 and one.stats.steps == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1, 2, 500]]), "token id 500"),
    (dict(prompts=[[1] * 250], max_new_tokens=10), "max_cache_len=256"),
    (dict(prompts=[[1] * 20], max_new_tokens=10, max_cache_len=16), "prompt 0 has 20 tokens"),
    (dict(prompts=[[1, 2]], max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(prompts=[[1, 2]], max_new_tokens=2.5), "max_new_tokens=2.5"),
    (dict(prompts=[[1, 2]], sampling=[SamplingParams(), SamplingParams()]), "sampling has 2 entries"),
    (dict(prompts=["text"]), "no tokenizer"),
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1]], attention_impl="cuda"), "attention_impl='cuda'"),
])
def test_bad_input_raises_value_error_naming_the_value(tiny_lm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(tiny_lm, **kwargs)


def test_bad_sampling_values_raise_before_generation(tiny_lm):
    with pytest.raises(ValueError, match="top_p=1.5"):
        jaxspec.generate(tiny_lm, [[1, 2]], sampling=SamplingParams(top_p=1.5))


# ------------------------------------------------------------------------------------------- stop strings


def test_stop_strings_split_across_tokens_and_accepted_blocks(smollm2, humaneval_prompts):
    """Text stop strings end a row exactly where plain decoding's text first holds one, also when the stop
    string starts inside a token and when speculation accepted the tokens around it in one block."""
    prompt = humaneval_prompts[2]
    plain = jaxspec.generate(smollm2, [prompt], max_new_tokens=64)
    text, tokens = plain.text[0], plain.token_ids[0]
    pieces = [smollm2.tokenizer.decode(tokens[:n]) for n in range(len(tokens) + 1)]
    # A stop string that starts one character into a token and ends inside a later one.
    start = next(len(pieces[n]) + 1 for n in range(8, len(tokens)) if len(pieces[n + 1]) - len(pieces[n]) >= 3)
    stop = text[start: start + 6]
    assert stop not in text[: start + 5]
    want_text = text[: start]
    want_tokens = next(tokens[:n] for n in range(len(tokens) + 1) if stop in pieces[n])
    for spec in (None, SpecConfig(method="sam"), SpecConfig(method="ngram")):
        out = jaxspec.generate(smollm2, [prompt, prompt], max_new_tokens=64, spec=spec, stop=[[stop, "@@@"], None],
                               prediction=[text, None] if spec is None else None)
        assert out.text[0] == want_text and out.token_ids[0] == want_tokens and out.finish_reason[0] == "stop"
        assert out.token_ids[1] == tokens and out.text[1] == text  # the row without stop strings
        assert out.num_tokens[0] == len(want_tokens) and (out.token_array[0, len(want_tokens):] == -1).all()
    with pytest.raises(ValueError, match=r"stop\[0\]"):
        jaxspec.generate(smollm2, [prompt], max_new_tokens=4, stop=[[""]])
    with pytest.raises(ValueError, match="tokenizer"):
        jaxspec.generate(jaxspec.LanguageModel.from_module(smollm2.module, name="no-tokenizer"), [[1, 2]],
                         max_new_tokens=4, stop="x")
