"""The NNX model against an independent numpy forward, and incremental decoding against a full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models.loading import load_model
from reference_numpy import random_hf_checkpoint, reference_forward

CONFIGS = {
    "llama_gqa_tied": dict(vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                           rope_scaling=None, tie_word_embeddings=True, attention_bias=False),
    "qwen2_bias_untied": dict(vocab_size=89, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                              num_attention_heads=6, num_key_value_heads=3, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False,
                              attention_bias=True),
    "llama3_rope_scaling": dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                                rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear_rope_scaling": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                                rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                tie_word_embeddings=True, attention_bias=False),
}


def _forward_all(lm, tokens, return_layers=()):
    """One forward over the whole sequence [1, T] from an empty cache."""
    module = lm.module
    T = len(tokens)
    cache = module.new_cache(1, 64)
    out, _ = module(jnp.asarray([tokens], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None], cache,
                    return_layers=return_layers)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shards", [1, 2])
def test_matches_numpy_reference(tmp_path, name, shards):
    weights = random_hf_checkpoint(tmp_path, CONFIGS[name], seed=len(name), shards=shards)
    lm = load_model(tmp_path)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, CONFIGS[name]["vocab_size"], 11)]
    layers = tuple(range(lm.config.num_layers))
    out = _forward_all(lm, tokens, return_layers=layers)
    ref = reference_forward(weights, CONFIGS[name], tokens)
    np.testing.assert_allclose(out.logits[0], ref["logits"], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(out.hidden[0], ref["hidden"], atol=2e-4, rtol=2e-4)
    for i in layers:  # reference "layers" starts with the embedding output
        np.testing.assert_allclose(out.layer_hidden[i][0], ref["layers"][i + 1], atol=2e-4, rtol=2e-4)


def test_bfloat16_close_to_float32(tmp_path):
    random_hf_checkpoint(tmp_path, CONFIGS["llama_gqa_tied"], seed=3)
    tokens = [5, 17, 3, 99, 42, 7]
    f32 = _forward_all(load_model(tmp_path), tokens)
    bf16 = _forward_all(load_model(tmp_path, dtype="bfloat16"), tokens)
    assert bf16.hidden.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16.logits[0], np.float32), f32.logits[0], atol=0.15, rtol=0.05)


def test_incremental_decoding_equals_full_forward(tiny_lm):
    """Logits of token t from prefill + t single-token steps equal one forward over the whole sequence."""
    module = tiny_lm.module
    tokens = np.random.default_rng(1).integers(0, 97, size=(2, 14)).astype(np.int32)
    full = module(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(14), (2, 14)), module.new_cache(2, 32))[0]
    prompt = 5
    out, cache = module(jnp.asarray(tokens[:, :prompt]), jnp.broadcast_to(jnp.arange(prompt), (2, prompt)),
                        module.new_cache(2, 32))
    cache = cache.advance(prompt)
    step_logits = [out.logits[:, -1]]
    for t in range(prompt, 14):
        out, cache = module(jnp.asarray(tokens[:, t:t + 1]), cache.lengths[:, None], cache)
        cache = cache.advance(1)
        step_logits.append(out.logits[:, 0])
    np.testing.assert_allclose(np.stack(step_logits, 1), full.logits[:, prompt - 1:], atol=1e-5, rtol=1e-5)


def test_per_row_lengths_and_multi_token_steps(tiny_lm):
    """Rows at different lengths take T=3 new tokens at once (the verification shape)."""
    module = tiny_lm.module
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 97, n).astype(np.int32) for n in (7, 12)]
    cache = module.new_cache(2, 32)
    prompts = np.zeros((2, 9), np.int32)
    prompts[0, :4], prompts[1, :9] = seqs[0][:4], seqs[1][:9]
    _, cache = module(jnp.asarray(prompts), jnp.broadcast_to(jnp.arange(9), (2, 9)), cache)
    cache = cache.replace(lengths=jnp.asarray([4, 9], jnp.int32))
    new = np.stack([seqs[0][4:7], seqs[1][9:12]])
    out, _ = module(jnp.asarray(new), cache.lengths[:, None] + jnp.arange(3)[None], cache)
    for b, s in enumerate(seqs):
        ref = module(jnp.asarray(s[None]), jnp.arange(len(s))[None], module.new_cache(1, 32))[0]
        np.testing.assert_allclose(out.logits[b], ref.logits[0, -3:], atol=1e-5, rtol=1e-5)


def test_tree_mask_scores_each_branch_as_its_own_sequence(tiny_lm):
    """With an ancestor mask and depth positions, each tree node sees exactly its root-to-node path."""
    module = tiny_lm.module
    prefix = jnp.asarray([[3, 14, 15, 92]], jnp.int32)
    # Tree over 4 nodes: 0 is the root, 1 and 2 are children of 0, 3 is a child of 2.
    nodes = jnp.asarray([[10, 20, 30, 40]], jnp.int32)
    parents = [-1, 0, 0, 2]
    depth = jnp.asarray([[0, 1, 1, 2]])
    mask = np.zeros((1, 4, 4), bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    _, cache = module(prefix, jnp.arange(4)[None], module.new_cache(1, 16))
    cache = cache.advance(4)
    out, _ = module(nodes, 4 + depth, cache, tree_mask=jnp.asarray(mask))
    for node, path in {1: [10, 20], 2: [10, 30], 3: [10, 30, 40]}.items():
        seq = jnp.concatenate([prefix, jnp.asarray([path], jnp.int32)], axis=1)
        ref = module(seq, jnp.arange(seq.shape[1])[None], module.new_cache(1, 16))[0]
        np.testing.assert_allclose(out.logits[0, node], ref.logits[0, -1], atol=1e-5, rtol=1e-5)


def test_logits_at_selects_positions(tiny_lm):
    module = tiny_lm.module
    tokens = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    full = module(tokens, pos, module.new_cache(2, 16))[0]
    picked = module(tokens, pos, module.new_cache(2, 16), logits_at=jnp.asarray([[4], [2]]))[0]
    np.testing.assert_allclose(picked.logits[:, 0], np.stack([full.logits[0, 4], full.logits[1, 2]]), atol=1e-6)


def test_params_are_jit_arguments_not_constants(tiny_lm):
    """A jitted forward over (graphdef, params) takes every weight as an argument and bakes none in."""
    import re

    from flax import nnx

    def fwd(params, tokens):
        module = nnx.merge(tiny_lm.graphdef, params)
        return module(tokens, jnp.zeros_like(tokens), module.new_cache(1, 8))[0].logits

    hlo = jax.jit(fwd).lower(tiny_lm.params, jnp.zeros((1, 1), jnp.int32)).as_text()
    signature = hlo[hlo.index("func.func public @main"):].split("{", 1)[0]
    assert signature.count("%arg") == len(jax.tree.leaves(tiny_lm.params)) + 1
    constant_sizes = [int(np.prod([int(d) for d in m.split("x")[:-1]] or [1]))
                      for m in re.findall(r"stablehlo.constant dense<[^>]*> : tensor<([^>]*)>", hlo)]
    assert max(constant_sizes, default=0) < 64, "a weight-sized constant was baked into the program"


def test_load_model_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        jaxspec.load_model("no-such-model")
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        jaxspec.load_model(tmp_path / "x.bin")
    with pytest.raises(ValueError, match="no config.json"):
        jaxspec.load_model(tmp_path)


def test_checkpoint_shape_mismatch_is_named(tmp_path):
    import json

    random_hf_checkpoint(tmp_path, CONFIGS["llama_gqa_tied"], seed=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # Named by the checkpoint's tensor and the config field its shape comes from, before any weight is read.
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight is \[112, 64\], the config needs \[128, 64\] "
                                         r"\(intermediate_size, hidden_size\)"):
        jaxspec.load_model(tmp_path)


def test_the_default_dtype_is_the_platforms(monkeypatch):
    """float32 on a CPU (bfloat16 products run in software there); bfloat16 on accelerators, where it halves the
    bytes a decode step reads. An explicit dtype wins either way."""
    from jaxspec.models import loading

    assert loading.default_dtype() == "float32"
    assert jaxspec.load_model("random:smollm2-135m").config.dtype == "float32"
    monkeypatch.setattr(loading.jax, "default_backend", lambda: "gpu")
    assert loading.default_dtype() == "bfloat16"
    lm = jaxspec.load_model("random:smollm2-135m", layer_loop="unroll")
    assert lm.config.dtype == "bfloat16" and lm.params["embed"][...].dtype == jnp.bfloat16
    assert jaxspec.load_model("random:smollm2-135m", dtype="float32", layer_loop="unroll").config.dtype == "float32"
    with pytest.raises(ValueError, match="dtype='float16' must be None, 'float32' or 'bfloat16'"):
        jaxspec.load_model("random:smollm2-135m", dtype="float16")


def test_the_two_ways_to_run_experts_agree():
    """A mixture's MLP gathers each token's experts when few tokens come (3 N k <= E) and runs them all otherwise:
    the two give the same outputs, and the router's renormalisation is the one the config asks for."""
    from flax import nnx

    from jaxspec.models.config import ModelConfig
    from jaxspec.models.llama import MoE

    for normalize in (True, False):
        cfg = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=12, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, num_experts=12, experts_per_token=2,
                          normalize_expert_weights=normalize)
        moe = MoE(cfg, nnx.Rngs(0))
        moe.router[...] = moe.router[...] * 50  # routing far from uniform
        rows = jax.random.normal(jax.random.key(1), (5, 16))
        weights, experts = moe.route(rows)
        assert np.allclose(np.asarray(weights.sum(-1)), 1.0) == normalize
        np.testing.assert_allclose(np.asarray(moe.gathered(rows, weights, experts)),
                                   np.asarray(moe.dense(rows, weights, experts)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(moe(rows[None, :2])[0]), np.asarray(moe.gathered(rows[:2], *moe.route(
            rows[:2]))), rtol=1e-6, atol=1e-7)  # two tokens: 3 * 2 * 2 <= 12, gathered
