"""`load_model("random:<name>")`: random weights in the shapes of real checkpoints (models/random_shapes.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.models.llama import Llama
from jaxspec.models.loading import gguf_config, named_model_path
from jaxspec.models.random_shapes import RANDOM_SHAPES, _draw, random_config

# Parameter counts of the published checkpoints (a tied head counted once).
# Qwen3-8B: its safetensors index's total_size, 16,381,470,720 bytes of bfloat16.
# Gemma-3-12B's text decoder (the checkpoint also holds a vision tower, not counted): from its config.json,
# V D + L (D (H + 2 Hkv) hd + H hd D + 3 D F + 4 D + 2 hd) + D with V=262208, D=3840, L=48, H=16, Hkv=8, hd=256,
# F=15360 (embedding tied; per layer q/k/v/o, gate/up/down, four norms and the q/k norms; the final norm), which
# is also what transformers' Gemma3ForCausalLM of that config holds, less its tied head.
# Qwen3-30B-A3B: its safetensors index's total_size, 61,064,245,248 bytes of bfloat16.
PUBLISHED_PARAMETERS = {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
                        "qwen3-8b": 8_190_735_360, "gemma-3-12b": 11_766_034_176,
                        "qwen3-30b-a3b": 30_532_122_624}


def parameter_count(name: str) -> int:
    """Parameters of the random model's module, from shapes alone (nothing allocated)."""
    config = random_config(name)
    state = nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    return total - (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_shapes_hold_the_published_checkpoints_parameters(name):
    assert parameter_count(name) == PUBLISHED_PARAMETERS[name]


def test_llama3_shapes_use_llama3_rope_scaling():
    for name, factor in (("llama-3.2-1b", 32.0), ("llama-3.1-8b", 8.0)):
        rope = RANDOM_SHAPES[name].rope
        assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, factor)
    assert RANDOM_SHAPES["llama-3.2-1b"].tie_word_embeddings and not RANDOM_SHAPES["llama-3.1-8b"].tie_word_embeddings


def test_the_default_models_shapes_match_its_file():
    real = gguf_config(__import__("gguf").GGUFReader(named_model_path("smollm2-135m")))
    fake = random_config("random:smollm2-135m")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "tie_word_embeddings", "attention_bias", "max_position_embeddings"):
        assert getattr(fake, field) == getattr(real, field), field
    assert fake.rope.theta == real.rope.theta and fake.rope.rope_type == real.rope.rope_type


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="random:llama-3.2-1b") as e:
        jaxspec.load_model("random:llama-9b")
    assert "random:llama-9b" in str(e.value) and "random:smollm2-135m" in str(e.value)


@pytest.fixture(scope="module")
def bf16_model():
    return jaxspec.load_model("random:smollm2-135m", dtype="bfloat16")


def test_weights_are_random_in_the_asked_dtype(bf16_model):
    lm = bf16_model
    assert {x.dtype for x in jax.tree.leaves(lm.params)} == {jnp.dtype(jnp.bfloat16)}
    down = np.asarray(lm.params["layers"][0]["mlp"]["down"][...], np.float32)
    assert np.all(np.isfinite(down)) and abs(down.std() - 0.02) < 0.001 and abs(down.mean()) < 0.001
    other = np.asarray(lm.params["layers"][1]["mlp"]["down"][...], np.float32)
    assert not np.array_equal(down, other)  # each tensor its own draw
    np.testing.assert_array_equal(np.asarray(lm.params["lm_head"][...]), np.asarray(lm.params["embed"][...]).T)
    assert np.all(np.asarray(lm.params["norm"]["weight"][...]) == 1)


@pytest.mark.parametrize("seeds", [jnp.uint32(1), jnp.arange(4, dtype=jnp.uint32)], ids=["tensor", "stack"])
def test_drawing_a_bfloat16_tensor_stores_no_wider_copy(seeds):
    """A tensor, or a scanned stack of one per layer, is drawn in its own dtype: no float32 copy of it is stored."""
    compiled = _draw.lower(seeds, shape=(4096, 1024), dtype=jnp.bfloat16, scale=0.02, parts=None, blocks=1,
                           sharding=None).compile()
    memory = compiled.memory_analysis()
    assert memory.output_size_in_bytes == seeds.size * 4096 * 1024 * 2
    assert memory.temp_size_in_bytes < 4096 * 1024  # below one float32 copy of a layer (0 on XLA:CPU)


def test_the_same_name_draws_the_same_weights(bf16_model):
    again = jaxspec.load_model("random:smollm2-135m", dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(bf16_model.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_it_generates_with_the_default_models_tokenizer(bf16_model):
    lm = bf16_model
    assert lm.tokenizer is not None and lm.tokenizer.vocab_size == lm.config.vocab_size
    out = jaxspec.generate(lm, ["def f(x):", "Hello"], max_new_tokens=3)
    assert [len(t) for t in out.token_ids] == [3, 3]
    spec = jaxspec.generate(lm, ["def f(x):", "Hello"], max_new_tokens=3, spec=jaxspec.SpecConfig(method="ngram"))
    assert spec.token_ids == out.token_ids


@pytest.mark.slow
def test_the_1b_model_runs_on_token_ids_without_a_tokenizer():
    """About 5 GB in float32; slow-marked (`pytest -m slow`)."""
    lm = jaxspec.load_model("random:llama-3.2-1b")
    assert lm.tokenizer is None and lm.config.vocab_size == 128256
    with pytest.raises(ValueError, match="no tokenizer"):
        jaxspec.generate(lm, "text", max_new_tokens=2)
    out = jaxspec.generate(lm, [[1, 2, 3]], max_new_tokens=2)
    assert len(out.token_ids[0]) == 2 and out.text == [""]
