"""Checkpoints of each architecture jaxspec runs, written by Hugging Face transformers, against transformers.

Each test model is a tiny random-weight checkpoint that transformers itself builds and saves (`save_pretrained`,
so config.json is in the layout the installed release writes); `load_model` reads the directory, and the logits,
greedy tokens and log-probabilities must be transformers' (torch, float32). Greedy speculative decoding on each
must equal greedy plain decoding. Architectures jaxspec does not implement must be refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxspec
from jaxspec import SpecConfig
from jaxspec.models.config import ModelConfig
from jaxspec.models.loading import load_model
from jaxspec.proposers.draft_model import self_draft_model

VOCAB = 96
WINDOW = 7  # Mistral's sliding window: a prompt of PROMPT tokens and NEW_TOKENS more run far past it
PROMPT, NEW_TOKENS = 20, 24
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
ARCHITECTURES = {
    # Llama 3's rope scaling and a theta of its own: both travel in `rope_parameters` in transformers 5.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_theta=50000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, rope_theta=1e6)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(head_dim=16, sliding_window=WINDOW)),
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    """(architecture, the transformers model, its saved directory)."""
    config_class, model_class, extra = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    model = model_class(config_class(**_SHAPE, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init, so the layers change the logits visibly
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, size=(1, PROMPT))  # i64[1, PROMPT]


def _jax_logits(lm, ids: np.ndarray) -> np.ndarray:
    """Logits f32[1, T, V] of one prefill forward over ids [1, T]."""
    model = lm.module
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    out, _ = model(ids.astype(np.int32), positions, model.new_cache(1, ids.shape[1]), cached_slots=0)
    return np.asarray(out.logits)


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_logits_equal_transformers(checkpoint, prompt, layer_loop):
    name, model, path = checkpoint
    lm = load_model(path, layer_loop=layer_loop)
    assert lm.config.qk_norm == (name == "qwen3")
    assert lm.config.sliding_window == (WINDOW if name == "mistral" else None)
    with torch.no_grad():
        want = model(torch.tensor(prompt)).logits.numpy()
    np.testing.assert_allclose(_jax_logits(lm, prompt), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_greedy_tokens_and_logprobs_equal_transformers(checkpoint, prompt, attention_impl):
    """Decoding from the cache, one token a step, up to 44 positions (past Mistral's window of 7). "pallas" runs
    the verification kernel (interpreted on a CPU) for the two architectures that touch it: Qwen3's normed q/k
    enter it, and Mistral's window is not in its mask, so XLA's attention serves that model instead. (The suite
    tests the kernel on Llama and Qwen2 shapes elsewhere.)"""
    name, model, path = checkpoint
    if attention_impl == "pallas" and name not in ("qwen3", "mistral"):
        pytest.skip("the kernel on Llama and Qwen2 shapes is tested elsewhere")
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = ref.sequences[0, PROMPT:].tolist()
    want_logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(ref.logits, want)]
    got = jaxspec.generate(load_model(path), [prompt[0].tolist()], max_new_tokens=NEW_TOKENS, logprobs=0,
                           ignore_eos=True, attention_impl=attention_impl)
    assert got.token_ids[0] == want
    np.testing.assert_allclose([t.logprob for t in got.logprobs[0]], want_logprobs, atol=2e-4)


@pytest.mark.parametrize("method", ["ngram", "sam", "draft_model"])
def test_greedy_speculative_equals_plain(checkpoint, prompt, method):
    _, _, path = checkpoint
    lm = load_model(path)
    prompts = [prompt[0].tolist(), prompt[0, ::-1].tolist()]
    spec = {"ngram": SpecConfig(method="ngram", num_speculative_tokens=4),
            "sam": SpecConfig(method="sam", num_speculative_tokens=4, min_match=2),
            # The target's own layers as the draft: a shallower random-weight draft may never agree with it.
            "draft_model": SpecConfig(method="draft_model", num_speculative_tokens=3,
                                      draft_model=self_draft_model(lm, lm.config.num_layers))}[method]
    plain = jaxspec.generate(lm, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    fast = jaxspec.generate(lm, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, spec=spec)
    assert fast.token_ids == plain.token_ids
    assert fast.stats.drafted > 0 and fast.stats.accepted > 0, fast.stats


def test_the_window_is_what_makes_mistral_agree(checkpoint, prompt):
    """Negative control: the same Mistral weights with the window dropped give other logits past the window, so
    the tests above would catch a window that is ignored."""
    name, model, path = checkpoint
    if name != "mistral":
        pytest.skip("the window control is Mistral's")
    lm = load_model(path)
    graphdef, params = nnx.split(lm.module)
    unwindowed = nnx.merge(graphdef, params)
    for _, sub in nnx.iter_graph(unwindowed):
        if hasattr(sub, "cfg"):
            sub.cfg = dataclasses.replace(sub.cfg, sliding_window=None)
    with torch.no_grad():
        want = model(torch.tensor(prompt)).logits.numpy()
    positions = np.arange(PROMPT, dtype=np.int32)[None]
    out, _ = unwindowed(prompt.astype(np.int32), positions, unwindowed.new_cache(1, PROMPT), cached_slots=0)
    got = np.asarray(out.logits)
    np.testing.assert_allclose(got[:, :WINDOW], want[:, :WINDOW], atol=2e-4, rtol=1e-4)  # no query sees past it
    assert np.abs(got[:, WINDOW:] - want[:, WINDOW:]).max() > 0.1


def _config(**fields):
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    return {**base, **fields}


@pytest.mark.parametrize("config, message", [
    (_config(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"]),
     r"model_type 'gemma3_text' is not supported; jaxspec runs llama \(LlamaForCausalLM\), mistral"),
    (_config(model_type="mixtral", architectures=["MixtralForCausalLM"]), "model_type 'mixtral' is not supported"),
    (_config(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]), "model_type 'qwen3_moe'"),
    (_config(model_type="llama", architectures=["LlamaForSequenceClassification"]),
     r"architectures \['LlamaForSequenceClassification'\] is not supported for model_type 'llama'"),
    (_config(model_type="llama", hidden_act="gelu"), r"'hidden_act'='gelu'; this decoder's MLP is SwiGLU"),
    (_config(model_type="llama", mlp_bias=True), "'mlp_bias' is true"),
    (_config(model_type="qwen2", sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
     r"windowed attention on some layers only \(1 of 2\)"),
    (_config(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1),
     r"windowed attention on some layers only \(1 of 2\)"),
    (_config(model_type="mistral", sliding_window=0), "sliding_window=0 must be None or a positive int"),
])
def test_other_architectures_are_refused_by_name(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_qwen_windows_on_every_layer_are_read():
    config = _config(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=0)
    assert ModelConfig.from_hf(config).sliding_window == 16
    assert ModelConfig.from_hf({**config, "use_sliding_window": False}).sliding_window is None


def test_a_deferred_write_sees_the_window_as_a_written_one(checkpoint, prompt):
    """The multi-width verify reads the cache beside the new tokens' K/V instead of writing them first
    (`write_cache=False`): past the window both must mask the same keys."""
    name, _, path = checkpoint
    if name != "mistral":
        pytest.skip("the window is Mistral's")
    model = load_model(path).module
    ids = prompt.astype(np.int32)
    _, cache = model(ids, np.arange(PROMPT, dtype=np.int32)[None], model.new_cache(1, 64), cached_slots=0)
    cache = cache.replace(lengths=cache.lengths + PROMPT)
    new = ids[:, :4]  # i32[1, 4] four more tokens at positions PROMPT..PROMPT+3
    positions = PROMPT + np.arange(4, dtype=np.int32)[None]
    written, _ = model(new, positions, cache)
    deferred, _ = model(new, positions, cache, write_cache=False)
    np.testing.assert_allclose(np.asarray(deferred.logits), np.asarray(written.logits), atol=1e-5, rtol=1e-5)
