"""`jaxspec.graphdefs`: a model's graph definition hashed once, and still an ordinary static jit argument."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import jaxspec
from jaxspec.graphdefs import HashedGraphDef, hashed


def test_hashed_graphdef_equals_the_original_and_keeps_its_hash(tiny_lm, monkeypatch):
    plain, _ = nnx.split(tiny_lm.module)
    g = hashed(plain)
    assert isinstance(g, HashedGraphDef) and hashed(g) is g
    assert hash(g) == hash(plain) and g == hashed(plain)
    calls = []
    original = nnx.GraphDef.__hash__
    monkeypatch.setattr(nnx.GraphDef, "__hash__", lambda self: calls.append(1) or original(self))
    fresh = hashed(plain)
    for _ in range(3):
        hash(fresh)
    assert len(calls) == 1  # the node walk ran once, not per call
    assert hashed(None) is None and hashed("not a graphdef") == "not a graphdef"


def test_language_models_hold_hashed_graphdefs_that_jit_takes_as_static(tiny_lm):
    assert isinstance(tiny_lm.graphdef, HashedGraphDef)
    copy = jaxspec.LanguageModel.from_module(tiny_lm.module, name="copy")
    assert isinstance(copy.graphdef, HashedGraphDef) and copy.graphdef == tiny_lm.graphdef
    traces = []

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def logits_sum(graphdef, params, x):
        traces.append(1)
        return nnx.merge(graphdef, params).embed[...][x].sum()

    x = jnp.arange(3)
    a = logits_sum(tiny_lm.graphdef, tiny_lm.params, x)
    b = logits_sum(copy.graphdef, copy.params, x)  # an equal definition: the same compiled program
    assert len(traces) == 1 and float(a) == float(b)
