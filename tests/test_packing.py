"""A packed prefill (the prompts' token-wise work over their tokens laid end to end, attention over the padded rows)
gives what a padded prefill gives: the same logits, layer features and KV cache at every real position, for the
architectures' variants (windows, q/k norms, Gemma's norms, experts) and both layer loops, and the same greedy
tokens on the default model, plainly and speculatively."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
import jaxspec.generation as generation
from conftest import TINY
from jaxspec import SpecConfig
from jaxspec.models.llama import Llama, set_layer_loop
from jaxspec.models.packing import Packing
from jaxspec.shapes import packed_width


def test_each_packed_position_names_its_row_and_column():
    packing = Packing.of(jnp.asarray([3, 1, 4], jnp.int32), width=4, packed=10)
    assert packing.rows.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]  # 3: padding past the last prompt
    assert packing.cols.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 0]
    x = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2) + 1
    packed = packing.pack(x)  # [1, 10, 2]
    assert packed.shape == (1, 10, 2) and packed[0, 3].tolist() == x[1, 0].tolist()
    real = (jnp.arange(4)[None, :] < jnp.asarray([3, 1, 4])[:, None])[..., None]
    np.testing.assert_array_equal(packing.unpack(packed), jnp.where(real, x, 0))  # padding never lands anywhere


def test_a_batch_packs_only_where_that_saves_positions():
    assert packed_width([125, 117, 114, 101, 74, 223, 101, 112], 256) == 1024  # of 8 x 256
    assert packed_width([200, 30], 256) == 256
    assert packed_width([100] * 8, 128) is None  # 800 tokens need 1024 positions, as padded
    assert packed_width([37], 64) is None  # one row is packed already


VARIANTS = {
    "llama": TINY,
    "windows": dataclasses.replace(TINY, num_layers=4, sliding_window=3,
                                   layer_types=("sliding_attention", "full_attention") * 2),
    "gemma": dataclasses.replace(TINY, qk_norm=True, gemma_norms=True, query_pre_attn_scalar=16.0,
                                 attn_logit_softcapping=20.0, hidden_act="gelu_pytorch_tanh"),
    "experts": dataclasses.replace(TINY, num_experts=4, experts_per_token=2),
}


@pytest.mark.parametrize("loop", ["unroll", "scan"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_packed_prefill_equals_the_padded_one(variant, loop):
    module = Llama(VARIANTS[variant], rngs=nnx.Rngs(2))
    set_layer_loop(module, loop)
    lens = jnp.asarray([5, 1, 11, 7], jnp.int32)
    width, slots = 16, 32
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(np.where(np.arange(width)[None] < np.asarray(lens)[:, None],
                                  rng.integers(1, TINY.vocab_size, (4, width)), 0), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (4, width))
    layers = (0, module.cfg.num_layers - 1)

    def prefill(packing):
        return module(tokens, positions, module.new_cache(4, slots), logits_at=(lens - 1)[:, None],
                      cached_slots=0, return_layers=layers, packing=packing)

    assert packed_width(lens.tolist(), width) == 32  # 24 tokens: half the padded positions
    (ref, ref_cache), (got, got_cache) = prefill(None), prefill(Packing.of(lens, width, 32))
    np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    real = np.arange(width)[None] < np.asarray(lens)[:, None]  # bool[B, W]
    for a, b in zip((got.hidden, *got.layer_hidden), (ref.hidden, *ref.layer_hidden)):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], rtol=1e-5, atol=1e-5)
        assert not np.asarray(a)[~real].any()  # padding positions were never computed
    for a, b in zip(_per_layer(got_cache), _per_layer(ref_cache)):  # [B, Hkv, S, hd] -> the real tokens' slots
        a, b = (np.moveaxis(np.asarray(x)[:, :, :width], 2, 1)[real] for x in (a, b))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _per_layer(cache):
    """Every layer's K and V [B, Hkv, S, hd], from either layout of the cache."""
    if cache.stacked:  # [B, L, Hkv, S, hd]
        return [x[:, i] for x in (cache.k, cache.v) for i in range(x.shape[1])]
    return [*cache.k, *cache.v]


def test_packing_is_refused_outside_a_prefill():
    module = Llama(TINY, rngs=nnx.Rngs(0))
    lens = jnp.asarray([2, 3], jnp.int32)
    tokens, positions = jnp.ones((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="cached_slots=None"):
        module(tokens, positions, module.new_cache(2, 8), packing=Packing.of(lens, 4, 8))


@pytest.fixture(scope="module")
def mixed_prompts(smollm2, humaneval_prompts):
    """Eight prompts of very different lengths (21-111 tokens: 503 tokens, padded to 8 x 128), cut from the ends of
    HumanEval's last eight."""
    texts = [p[-n:] for p, n in zip(humaneval_prompts[-8:], (40, 500, 120, 60, 300, 80, 200, 450))]
    ids = [smollm2.tokenizer.encode(t) for t in texts]
    lens = [len(i) for i in ids]
    width = max(16, 1 << (max(lens) - 1).bit_length())
    assert packed_width(lens, width) is not None, lens
    return texts


@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_the_default_model_decodes_the_same_tokens_packed(smollm2, mixed_prompts, monkeypatch, method):
    """generate packs a batch of uneven prompts (eagle3 reads the prefill's layer features too): its greedy
    tokens are those of the padded prefill."""
    spec = SpecConfig(method=method)
    packed = jaxspec.generate(smollm2, mixed_prompts, max_new_tokens=24, spec=spec)
    monkeypatch.setattr(generation, "packed_width", lambda lens, width: None)
    padded = jaxspec.generate(smollm2, mixed_prompts, max_new_tokens=24, spec=spec)
    assert packed.token_ids == padded.token_ids
    if method != "none":
        assert packed.stats.drafted > 0 and packed.stats.accepted > 0
