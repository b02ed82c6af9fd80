"""The model's Pallas attention path (interpret mode on CPU, compiled on a GPU) against its XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.kernels.verify_attention import compiled_supports
from jaxspec.models import llama as llama_module


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_forward_pallas_equals_xla_chain_and_tree(tiny_lm, layer_loop):
    """Also with the layers as a scan, where the kernel reads its layer's slice of the stacked cache."""
    module = nnx.merge(tiny_lm.graphdef, tiny_lm.params, copy=True)
    llama_module.set_layer_loop(module, layer_loop)
    prefix = jnp.asarray([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]], jnp.int32)
    _, cache = module(prefix, jnp.broadcast_to(jnp.arange(5), (2, 5)), module.new_cache(2, 32))
    cache = cache.replace(lengths=jnp.asarray([5, 3], jnp.int32))
    new = jnp.asarray([[11, 12, 13, 14], [21, 22, 23, 24]], jnp.int32)
    chain_pos = cache.lengths[:, None] + jnp.arange(4)[None]
    tree = jnp.asarray(np.tril(np.ones((4, 4), bool)) & np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0],
                                                                   [1, 0, 1, 1]], bool))
    tree = jnp.broadcast_to(tree, (2, 4, 4))
    tree_pos = cache.lengths[:, None] + jnp.asarray([0, 1, 1, 2])[None]
    for mask, pos in ((None, chain_pos), (tree, tree_pos)):
        xla, _ = module(new, pos, cache, tree_mask=mask, attention_impl="xla")
        pallas, _ = module(new, pos, cache, tree_mask=mask, attention_impl="pallas")
        np.testing.assert_allclose(pallas.logits, xla.logits, atol=1e-4, rtol=1e-4)


def test_pallas_hint_uses_xla_where_the_compiled_kernel_cannot_take_the_head_dim(tiny_lm, monkeypatch):
    """On a GPU "pallas" is the default; a head dim Triton cannot take (the tiny model's 8, or 80) must fall back
    to XLA's attention there instead of failing. The GPU is simulated: the kernel must not even be called."""
    assert [d for d in (8, 16, 24, 64, 80, 96, 128, 256) if compiled_supports(d)] == [16, 64, 128, 256]
    assert not compiled_supports(tiny_lm.module.cfg.head_dim)
    module = tiny_lm.module
    prefix = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32)
    _, cache = module(prefix, jnp.arange(5)[None], module.new_cache(1, 32))
    new, pos = jnp.asarray([[11, 12, 13]], jnp.int32), 5 + jnp.arange(3)[None]
    xla, _ = module(new, pos, cache, attention_impl="xla")

    def kernel_called(*args, **kwargs):
        raise AssertionError("the compiled kernel was called with a head dim it cannot take")

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(llama_module, "verify_attention", kernel_called)
    hinted, _ = module(new, pos, cache, attention_impl="pallas")
    np.testing.assert_array_equal(hinted.logits, xla.logits)


def test_generate_pallas_equals_xla_tiny(tiny_lm):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    xla = jaxspec.generate(tiny_lm, prompts, max_new_tokens=8, attention_impl="xla")
    pallas = jaxspec.generate(tiny_lm, prompts, max_new_tokens=8, attention_impl="pallas")
    assert pallas.token_ids == xla.token_ids


@pytest.mark.real_model
def test_generate_pallas_equals_xla_real_model(smollm2):
    prompt = [1604, 3987, 46477, 24, 94, 727]
    xla = jaxspec.generate(smollm2, [prompt], max_new_tokens=6, attention_impl="xla")
    pallas = jaxspec.generate(smollm2, [prompt], max_new_tokens=6, attention_impl="pallas")
    assert pallas.token_ids == xla.token_ids
