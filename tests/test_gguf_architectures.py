"""GGUF files of each architecture the GGUF loader runs, written from a transformers checkpoint under llama.cpp's
own tensor names (`gguf.get_tensor_name_map`) and metadata keys, give transformers' logits; other architectures
are refused by name.

llama.cpp's converter interleaves the rotary halves of Llama's Q and K rows and keeps Qwen's as they are; the
test writes them the same way, so the loader's undoing of that is checked too.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from jaxspec.models.loading import load_model

VOCAB, PROMPT = 64, 12
_SHAPE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0),
              gguf.MODEL_ARCH.LLAMA),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6), gguf.MODEL_ARCH.QWEN2),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=1e6, head_dim=16),
              gguf.MODEL_ARCH.QWEN3),
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for a Llama Q or K weight [heads * hd, ...]: each head's two halves
    interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, name: str, model, config) -> None:
    arch = ARCHITECTURES[name][3]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(ARCHITECTURES[name][2]["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().numpy().astype(np.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and (".q_proj." in hf_name or ".k_proj." in hf_name):
            value = _permute(value, config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads)
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_gguf_file_gives_transformers_logits(tmp_path, name):
    config_class, model_class, extra, _ = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = config_class(**_SHAPE, **extra)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    _write_gguf(tmp_path / "model.gguf", name, model, config)
    lm = load_model(tmp_path / "model.gguf")
    assert lm.config.qk_norm == (name == "qwen3") and lm.config.attention_bias == (name == "qwen2")
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(1, PROMPT))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    module = lm.module
    out, _ = module(np.asarray(tokens, np.int32), np.arange(PROMPT, dtype=np.int32)[None], module.new_cache(1, 32))
    got = out.logits
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_another_gguf_architecture_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gemma3' is not supported \(supported: \('llama', 'qwen2', "
                                         r"'qwen3'\)\)"):
        load_model(tmp_path / "gemma.gguf")
