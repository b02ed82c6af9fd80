"""Checkpoints of each architecture jaxspec runs, written by Hugging Face transformers, against transformers.

Each test model is a tiny random-weight checkpoint that transformers itself builds and saves (`save_pretrained`,
so config.json is in the layout the installed release writes); `load_model` reads the directory, and the logits,
greedy tokens and log-probabilities must be transformers' (torch, float32). Greedy speculative decoding on each
must equal greedy plain decoding. Architectures jaxspec does not implement must be refused by name.

The windowed checkpoints run past their window of WINDOW positions; Gemma 3, Gemma 2 and the windowed Qwen2 mix
windowed and full-attention layers, Gemma 3's kinds each with their rotary settings, Gemma 2 soft-caps its
attention scores and logits at caps small enough to bite.
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
from jaxspec.models.heads import EagleHead
from jaxspec.models.loading import load_model
from jaxspec.proposers.draft_model import self_draft_model

VOCAB = 96
WINDOW = 7  # the sliding window: a prompt of PROMPT tokens and NEW_TOKENS more run far past it
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
    # A window on the second layer only.
    "qwen2_windows": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                      dict(use_sliding_window=True, sliding_window=WINDOW,
                           layer_types=["full_attention", "sliding_attention"])),
    # A local layer (window, rope base 1e4) then a global one (rope base 1e6 with linear scaling), an attention
    # scalar other than head_dim, tied embeddings. Gemma's configs end generation at token 1 (eos_token_id):
    # transformers' reference must decode every step, as jaxspec does with ignore_eos.
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=24, tie_word_embeddings=True, eos_token_id=None,
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # transformers' default interleaving (a local layer, then a global one) and soft-capping of scores and logits.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                    final_logit_softcapping=4.0, eos_token_id=None)),
    # Mixtures of experts, 2 a token: Mixtral renormalises the two weights, this Qwen3-MoE (norm_topk_prob off)
    # keeps them as the softmax over all four gave them. Mixtral's 8 experts are gathered for one token a step
    # (3 N k <= E) and all run for more; Qwen3-MoE's 4 always all run.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=False, rope_theta=1e6)),
}
MIXED = ("qwen2_windows", "gemma3_text", "gemma2")  # windowed and full-attention layers
EXPERTS = ("mixtral", "qwen3_moe")  # mixtures of experts
WINDOWED = ("mistral",) + MIXED


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    """(architecture, the transformers model, its saved directory)."""
    config_class, model_class, extra = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    model = model_class(config_class(**{**_SHAPE, **extra})).eval()
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
    assert lm.config.qk_norm == (name in ("qwen3", "qwen3_moe", "gemma3_text"))
    assert lm.config.num_experts == {"mixtral": 8, "qwen3_moe": 4}.get(name, 0)
    assert lm.config.sliding_window == (WINDOW if name in WINDOWED else None)
    assert lm.config.layer_types == (tuple(model.config.layer_types) if name in MIXED else None)
    assert lm.config.gemma_norms == name.startswith("gemma")
    with torch.no_grad():
        want = model(torch.tensor(prompt)).logits.numpy()
    np.testing.assert_allclose(_jax_logits(lm, prompt), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_impl, layer_loop", [("xla", "unroll"), ("pallas", "unroll"), ("xla", "scan")])
def test_greedy_tokens_and_logprobs_equal_transformers(checkpoint, prompt, attention_impl, layer_loop):
    """Decoding from the cache, one token a step, up to 44 positions (past the window of 7). "pallas" runs the
    verification kernel (interpreted on a CPU) for the architectures that touch it: Qwen3's normed q/k enter it,
    Gemma 3's global layers take it with their own scale, and neither windows (Mistral, Gemma 3's local layers)
    nor Gemma 2's soft-capping are in its mask, so XLA's attention serves those layers instead. (The suite tests
    the kernel on Llama and Qwen2 shapes elsewhere.) "scan" decodes the models whose layers mix attention kinds
    with each layer's window and rotary tables scanned beside its weights, and the mixtures of experts, whose
    stacked experts a scan slices per layer."""
    name, model, path = checkpoint
    if attention_impl == "pallas" and name not in ("qwen3", "mistral", "gemma3_text", "gemma2"):
        pytest.skip("the kernel on Llama and Qwen2 shapes is tested elsewhere")
    if layer_loop == "scan" and name not in MIXED + EXPERTS:
        pytest.skip("a scanned stack of layers alike is tested elsewhere (tests/test_layer_loop.py)")
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = ref.sequences[0, PROMPT:].tolist()
    want_logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(ref.logits, want)]
    got = jaxspec.generate(load_model(path, layer_loop=layer_loop), [prompt[0].tolist()], max_new_tokens=NEW_TOKENS,
                           logprobs=0, ignore_eos=True, attention_impl=attention_impl)
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


# What each architecture's agreement rests on: the config fields a control drops, and whether the logits of the
# first WINDOW positions (where no query reaches past a window) must still agree.
_CONTROLS = {
    "mistral": [(dict(sliding_window=None), True)],
    "qwen2_windows": [(dict(sliding_window=None, layer_types=None), True)],
    "gemma3_text": [(dict(sliding_window=None, layer_types=None, sliding_rope=None), False),
                    (dict(sliding_rope=None), False)],
    "gemma2": [(dict(sliding_window=None, layer_types=None), True), (dict(attn_logit_softcapping=None), False),
               (dict(final_logit_softcapping=None), False)],
}


def test_windows_ropes_and_caps_are_what_make_them_agree(checkpoint, prompt):
    """Negative controls: the same weights with a window, the local layers' rotary settings or a soft-cap dropped
    give other logits (past the window, for a window), so the tests above would catch one that is ignored."""
    name, model, path = checkpoint
    if name not in _CONTROLS:
        pytest.skip("no window, rotary settings of its own or soft-cap to drop")
    with torch.no_grad():
        want = model(torch.tensor(prompt)).logits.numpy()
    graphdef, params = nnx.split(load_model(path).module)
    for dropped, early_agree in _CONTROLS[name]:
        changed = nnx.merge(graphdef, params)
        for _, sub in nnx.iter_graph(changed):
            if hasattr(sub, "cfg"):
                sub.cfg = dataclasses.replace(sub.cfg, **dropped)
        positions = np.arange(PROMPT, dtype=np.int32)[None]
        out, _ = changed(prompt.astype(np.int32), positions, changed.new_cache(1, PROMPT), cached_slots=0)
        got = np.asarray(out.logits)
        if early_agree:  # no query sees past the window
            np.testing.assert_allclose(got[:, :WINDOW], want[:, :WINDOW], atol=2e-4, rtol=1e-4)
        assert np.abs(got[:, WINDOW:] - want[:, WINDOW:]).max() > 0.1, dropped


def _config(**fields):
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    return {**base, **fields}


@pytest.mark.parametrize("config, message", [
    (_config(model_type="gemma", architectures=["GemmaForCausalLM"]),
     r"model_type 'gemma' is not supported; jaxspec runs llama \(LlamaForCausalLM\), mistral"),
    (_config(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
     r"model_type 'gemma3' is Gemma 3's image-and-text model \(Gemma3ForConditionalGeneration\), which is not "
     r"supported; jaxspec runs Gemma 3's text decoder from a 'gemma3_text' checkpoint \(Gemma3ForCausalLM\)"),
    (_config(model_type="gemma3_text", use_bidirectional_attention=True), "'use_bidirectional_attention' is true"),
    (_config(model_type="gemma2", hidden_activation="gelu"), r"'hidden_activation'='gelu'; this decoder's MLP gates"),
    (_config(model_type="gemma2", query_pre_attn_scalar=-1), "query_pre_attn_scalar=-1.0 must be None or a positive"),
    (_config(model_type="gemma3_text", layer_types=["sliding_attention"]),
     "field 'layer_types' has 1 entries; 'num_hidden_layers' is 2"),
    (_config(model_type="gemma3_text", layer_types=["sliding_attention", "chunked_attention"]),
     r"'layer_types' holds \['chunked_attention'\]"),
    (_config(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"]),
     "model_type 'deepseek_v3' is not supported"),
    (_config(model_type="mixtral", num_experts_per_tok=2), "field 'num_local_experts' is missing"),
    (_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5),
     r"experts_per_token=5 must be in \[1, num_experts=4\]"),
    (_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             mlp_only_layers=[0]), "layers with a dense MLP among the experts'"),
    (_config(model_type="llama", architectures=["LlamaForSequenceClassification"]),
     r"architectures \['LlamaForSequenceClassification'\] is not supported for model_type 'llama'"),
    (_config(model_type="llama", hidden_act="gelu"), r"'hidden_act'='gelu'; this decoder's MLP gates with one of"),
    (_config(model_type="llama", mlp_bias=True), "'mlp_bias' is true"),
    (_config(model_type="mistral", sliding_window=0), "sliding_window=0 must be None or a positive int"),
])
def test_other_architectures_are_refused_by_name(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_qwen_windows_are_read_as_transformers_reads_them():
    config = _config(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=0)
    assert (ModelConfig.from_hf(config).sliding_window, ModelConfig.from_hf(config).layer_types) == (16, None)
    assert ModelConfig.from_hf({**config, "use_sliding_window": False}).sliding_window is None
    mixed = ModelConfig.from_hf({**config, "max_window_layers": 1})
    assert (mixed.sliding_window, mixed.layer_types) == (16, ("full_attention", "sliding_attention"))
    assert [mixed.layer_window(i) for i in range(2)] == [None, 16]
    # transformers drops the window of every layer when use_sliding_window is false, whatever layer_types says.
    unused = {**config, "use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"]}
    assert ModelConfig.from_hf(unused).sliding_window is None


def test_gemma_configs_take_transformers_defaults():
    """What a Gemma config leaves out is what transformers' config classes fill in: the interleaving, window,
    attention scalar, soft-caps and (Gemma 3, earlier configs) rope_local_base_freq."""
    gemma3 = ModelConfig.from_hf(_config(model_type="gemma3_text", num_hidden_layers=7, head_dim=16,
                                         rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                         rope_local_base_freq=2e4))
    assert gemma3.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (gemma3.sliding_window, gemma3.query_pre_attn_scalar, gemma3.tie_word_embeddings) == (4096, 256.0, True)
    assert (gemma3.rope.theta, gemma3.rope.rope_type, gemma3.rope.factor) == (5e5, "linear", 8.0)
    assert (gemma3.sliding_rope.theta, gemma3.sliding_rope.rope_type) == (2e4, "default")
    assert gemma3.layer_rope(0) == gemma3.sliding_rope and gemma3.layer_rope(5) == gemma3.rope
    assert (gemma3.attn_logit_softcapping, gemma3.final_logit_softcapping, gemma3.hidden_act) == (
        None, None, "gelu_pytorch_tanh")
    gemma2 = ModelConfig.from_hf(_config(model_type="gemma2", num_hidden_layers=3))
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.sliding_rope) == (50.0, 30.0, None)
    uncapped = ModelConfig.from_hf(_config(model_type="gemma2", attn_logit_softcapping=None,
                                           final_logit_softcapping=None))
    assert (uncapped.attn_logit_softcapping, uncapped.final_logit_softcapping) == (None, None)


def test_fewer_layers_keep_the_first_layers_kinds():
    """A self-draft's config (`replace(cfg, num_layers=N)`) keeps the first N layers' kinds; one kind folds into
    the uniform form, with no window when every kept layer attends fully."""
    cfg = ModelConfig.from_hf(_config(model_type="gemma3_text", num_hidden_layers=3, sliding_window=8,
                                      layer_types=["full_attention", "sliding_attention", "full_attention"]))
    two = dataclasses.replace(cfg, num_layers=2)
    assert (two.layer_types, two.sliding_window) == (("full_attention", "sliding_attention"), 8)
    one = dataclasses.replace(cfg, num_layers=1)
    assert (one.layer_types, one.sliding_window, one.layer_rope(0)) == (None, None, cfg.rope)
    with pytest.raises(ValueError, match="layer_types has 3 entries; num_layers=4 needs one a layer"):
        dataclasses.replace(cfg, num_layers=4)
    with pytest.raises(ValueError, match="layer_types marks 'sliding_attention' layers, but sliding_window is None"):
        dataclasses.replace(cfg, sliding_window=None)


def test_an_eagle_head_on_gemma_is_a_llama_layer():
    cfg = ModelConfig.from_hf(_config(model_type="gemma2", head_dim=16))
    layer = EagleHead(cfg, rngs=nnx.Rngs(0)).layer
    assert layer.attn_output_norm is None and layer.mlp_output_norm is None and not layer.input_norm.plus_one
    assert layer.mlp.activation == "silu" and layer.attn.cfg.attention_scale == 16 ** -0.5
    assert layer.attn.cfg.attn_logit_softcapping is None


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_a_deferred_write_sees_the_window_as_a_written_one(checkpoint, prompt, layer_loop):
    """The multi-width verify reads the cache beside the new tokens' K/V instead of writing them first
    (`write_cache=False`): past the window both must mask the same keys."""
    name, _, path = checkpoint
    if name not in WINDOWED:
        pytest.skip("no window")
    model = load_model(path, layer_loop=layer_loop).module
    ids = prompt.astype(np.int32)
    _, cache = model(ids, np.arange(PROMPT, dtype=np.int32)[None], model.new_cache(1, 64), cached_slots=0)
    cache = cache.replace(lengths=cache.lengths + PROMPT)
    new = ids[:, :4]  # i32[1, 4] four more tokens at positions PROMPT..PROMPT+3
    positions = PROMPT + np.arange(4, dtype=np.int32)[None]
    written, _ = model(new, positions, cache)
    deferred, _ = model(new, positions, cache, write_cache=False)
    np.testing.assert_allclose(np.asarray(deferred.logits), np.asarray(written.logits), atol=1e-5, rtol=1e-5)


def _word_tokenizer(path, words: list[str]) -> None:
    """A word-level tokenizer.json over `words` (ids in order), as a checkpoint directory carries it."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def test_a_smaller_checkpoint_of_the_family_drafts(tmp_path):
    """draft_model with another checkpoint of the target's family and tokenizer, here a one-layer Qwen3 saved in
    its own directory beside the two-layer target (sharing its embeddings and first layer, so its drafts agree
    often): greedy equals plain with drafts accepted. The same draft with another tokenizer is refused."""
    config_class, model_class, extra = ARCHITECTURES["qwen3"]
    torch.manual_seed(0)
    target = model_class(config_class(**{**_SHAPE, **extra})).eval()
    small = model_class(config_class(**{**_SHAPE, **extra, "num_hidden_layers": 1})).eval()
    small.load_state_dict({k: v for k, v in target.state_dict().items() if ".layers.1." not in k})
    words = [f"w{i}" for i in range(VOCAB)]
    for model, name in ((target, "target"), (small, "draft")):
        model.save_pretrained(tmp_path / name)
        _word_tokenizer(tmp_path / name, words)
    lm, draft = load_model(tmp_path / "target"), load_model(tmp_path / "draft")
    assert draft.config.num_layers == 1 and draft.tokenizer is not None
    prompts = [" ".join(words[i] for i in np.random.default_rng(2).integers(0, VOCAB, PROMPT))]
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, draft_model=draft)
    plain = jaxspec.generate(lm, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    fast = jaxspec.generate(lm, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, spec=spec)
    assert fast.token_ids == plain.token_ids
    assert fast.stats.drafted > 0 and fast.stats.accepted > 0, fast.stats
    _word_tokenizer(tmp_path / "draft", words[:5] + ["other"] + words[6:])
    with pytest.raises(ValueError, match="has another tokenizer than the target"):
        jaxspec.generate(lm, prompts, max_new_tokens=4, spec=SpecConfig(method="draft_model",
                                                                         draft_model=load_model(tmp_path / "draft")))
