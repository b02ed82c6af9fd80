"""The target model contract (jaxspec.target): a non-Llama model runs the loop, models lacking a part of the
contract get a ValueError naming it (from check_target and from the places that use the part), and the
shipped Llama meets the contract of every method.

The non-Llama model is examples/custom_model.py's GPT-2-style `GPT` (learned positions, LayerNorm, GELU), so
the example's model is what these tests run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec import SpecConfig
from jaxspec.cache import KVCache
from jaxspec.methods import names
from jaxspec.models.heads import MedusaHeads, Readout, new_head, save_head
from jaxspec.target import check_config, check_target

ROOT = Path(__file__).resolve().parent.parent


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_model", ROOT / "examples" / "custom_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


cm = _load_example()
MAX_NEW = 40


@pytest.fixture(scope="module")
def gpt():
    return jaxspec.LanguageModel.from_module(cm.GPT(cm.GPTConfig(), rngs=nnx.Rngs(0)), name="gpt")


@pytest.fixture(scope="module")
def rows():
    return cm.prompts(cm.GPTConfig().vocab_size)


@pytest.fixture(scope="module")
def plain(gpt, rows):
    return jaxspec.generate(gpt, rows, max_new_tokens=MAX_NEW)


# ------------------------------------------------------------------------------------ the model itself


def test_the_custom_model_meets_the_contract_of_every_method_but_eagle(gpt):
    check_target(gpt, "medusa")  # traced with a tree mask and the hidden states: the most any method traces
    for method in ("none", "ngram", "sam", "draft_model", "custom", "self_draft"):
        check_target(gpt, method, trace=False)
    # EAGLE's head is a Llama decoder layer sized from a Llama config, which a GPT config is not.
    for method in ("eagle", "eagle2", "eagle3", "dflash"):
        with pytest.raises(ValueError, match=rf"method='{method}' needs cfg.intermediate_size"):
            check_target(gpt, method)


@functools.partial(jax.jit, static_argnames=("graphdef", "cached_slots"))
def _jitted_forward(graphdef, params, tokens, positions, cache, tree_mask, cached_slots):
    return nnx.merge(graphdef, params)(tokens, positions, cache, tree_mask=tree_mask, cached_slots=cached_slots)


def _forward(lm, tokens, positions, cache, *, tree_mask=None, cached_slots=None):
    """One jitted forward (eager dispatch of every op is slower than compiling the whole of it)."""
    return _jitted_forward(lm.graphdef, lm.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                           cache, tree_mask, cached_slots)


def test_the_custom_forward_writes_at_the_lengths_and_leaves_them(gpt):
    """The values behind the contract: a prefix then a chunk at per-row lengths gives the logits of one forward
    over the whole sequence; lengths are not advanced; a tree node sees only its ancestors."""
    rng = np.random.default_rng(1)
    seq = rng.integers(0, gpt.config.vocab_size, size=(2, 9))  # i32[B, N]
    full, _ = _forward(gpt, seq, np.broadcast_to(np.arange(9), (2, 9)), gpt.module.new_cache(2, 32), cached_slots=0)

    cache = gpt.module.new_cache(2, 32)
    _, cache = _forward(gpt, seq[:, :6], np.broadcast_to(np.arange(6), (2, 6)), cache, cached_slots=0)
    assert cache.lengths.tolist() == [0, 0]  # the forward wrote K/V but did not commit them
    # Row 0 commits 6 tokens, row 1 only 4: row 1's slots 4 and 5 are stale and must not be seen.
    cache = cache.advance(jnp.asarray([6, 4]))
    chunk = np.stack([seq[0, 6:9], seq[1, 4:7]])
    out, after = _forward(gpt, chunk, np.stack([np.arange(6, 9), np.arange(4, 7)]), cache)
    assert after.lengths.tolist() == [6, 4]
    np.testing.assert_allclose(out.logits[0], full.logits[0, 6:9], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.logits[1], full.logits[1, 4:7], atol=1e-4, rtol=1e-4)

    # A tree after 6 committed tokens: root seq[6], two siblings at depth 1 (seq[7] and another token). Each
    # sibling sees the root only, so the true sibling's logits are the sequence's, whatever the other holds.
    cache = cache.replace(lengths=jnp.asarray([6, 6]))
    other = (seq[0, 7] + 1) % gpt.config.vocab_size
    nodes = np.asarray([[seq[0, 6], other, seq[0, 7]]] * 2)  # root, then the siblings
    mask = jnp.asarray(np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool))[None].repeat(2, 0)  # bool[B, 3, 3]
    tree, _ = _forward(gpt, nodes, np.asarray([[6, 7, 7]] * 2), cache, tree_mask=mask)
    np.testing.assert_allclose(tree.logits[0, 2], full.logits[0, 7], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(tree.logits[0, 0], full.logits[0, 6], atol=1e-4, rtol=1e-4)


def test_the_custom_model_gives_finite_values_past_its_position_table(gpt):
    # Padding and finished rows feed positions past max_position_embeddings; their K/V must stay finite.
    far = gpt.config.max_position_embeddings + 5
    out, cache = _forward(gpt, [[1, 2]], [[far, far + 1]], gpt.module.new_cache(1, 8))
    assert np.isfinite(np.asarray(out.logits)).all() and all(np.isfinite(np.asarray(k)).all() for k in cache.k)


# ---------------------------------------------------------------------------------------- through the loop


@pytest.mark.parametrize("method", ["ngram", "sam", "draft_model", "self_draft"])
def test_greedy_speculative_equals_plain_on_the_custom_model(gpt, rows, plain, method):
    out = jaxspec.generate(gpt, rows, max_new_tokens=MAX_NEW, spec=cm.specs(gpt)[method])
    assert out.token_ids == plain.token_ids
    # It cannot pass by never drafting: drafts were made, some accepted, and fewer steps taken than plainly.
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert all(r.drafted > 0 for r in out.stats.rows)
    assert out.stats.row_steps < plain.stats.row_steps


def test_medusa_heads_run_on_the_custom_model(gpt, rows, plain, tmp_path):
    """Heads need only the features part of the contract (hidden states, embed, lm_head, cfg.hidden_size): a
    Medusa head file made for the GPT drafts trees its forward verifies under the tree mask."""
    heads = MedusaHeads(gpt.config, 2)
    heads.w[...] = 0.3 * jax.random.normal(jax.random.key(2), heads.w[...].shape)
    path = save_head(tmp_path / "gpt-medusa", heads, kind="medusa")
    spec = SpecConfig(method="medusa", num_speculative_tokens=6, verify_widths=(7,), head_path=str(path))
    out = jaxspec.generate(gpt, rows, max_new_tokens=MAX_NEW, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


# ------------------------------------------------------------------------- what is missing, and who says so


@dataclasses.dataclass(frozen=True)
class HFNamedConfig:
    """GPT-2's own field names (n_layer, n_embd): the config of the model that once failed with AttributeError."""

    vocab_size: int = 128
    max_position_embeddings: int = 256
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4


class HFNamedGPT(cm.GPT):
    """The example's GPT under a config with GPT-2's names: it meets the core contract, not self_draft's."""

    def new_cache(self, batch, max_len):
        cfg = self.cfg
        return KVCache.create(num_layers=cfg.n_layer, batch=batch, num_kv_heads=cfg.n_head, max_len=max_len,
                              head_dim=cfg.n_embd // cfg.n_head)


@dataclasses.dataclass(frozen=True)
class NoVocab:
    max_position_embeddings: int = 256


@dataclasses.dataclass(frozen=True)
class NoContext:
    vocab_size: int = 128


@dataclasses.dataclass  # not frozen: unhashable
class Mutable:
    vocab_size: int = 128
    max_position_embeddings: int = 256


def _gpt_with(cfg, cls=None):
    """A GPT (or subclass) built from the example's config, then given `cfg` as its config."""
    module = (cls or cm.GPT)(cm.GPTConfig(), rngs=nnx.Rngs(0))
    if cfg is not None:
        module.cfg = cfg
    return module


class Out(NamedTuple):
    logits: jax.Array


class NoHidden(cm.GPT):
    def __call__(self, *args, **kwargs):
        out, cache = super().__call__(*args, **kwargs)
        return Out(out.logits), cache


class IgnoresLogitsAt(cm.GPT):
    def __call__(self, tokens, positions, cache, *, logits_at=None, **kwargs):
        return super().__call__(tokens, positions, cache, **kwargs)


class NoCachedSlots(cm.GPT):
    def __call__(self, tokens, positions, cache, *, tree_mask=None, logits_at=None, compute_logits=True,
                 attention_impl="xla"):
        return super().__call__(tokens, positions, cache, tree_mask=tree_mask, logits_at=logits_at,
                                compute_logits=compute_logits)


class NoTreeMask(cm.GPT):
    def __call__(self, tokens, positions, cache, *, logits_at=None, compute_logits=True, attention_impl="xla",
                 cached_slots=None):
        return super().__call__(tokens, positions, cache, logits_at=logits_at, compute_logits=compute_logits,
                                cached_slots=cached_slots)


class HalfCache(cm.GPT):
    def __call__(self, *args, **kwargs):
        out, cache = super().__call__(*args, **kwargs)
        return out, cache.replace(v=tuple(v.astype(jnp.bfloat16) for v in cache.v))


class NoNewCache(cm.GPT):
    new_cache = None


class NoReturnLayers(jaxspec.models.llama.Llama):
    """A Llama whose forward cannot hand out its layers' outputs (EAGLE-3's features)."""

    def __call__(self, tokens, positions, cache, *, tree_mask=None, logits_at=None, compute_logits=True,
                 attention_impl="xla", cached_slots=None):
        return super().__call__(tokens, positions, cache, tree_mask=tree_mask, logits_at=logits_at,
                                compute_logits=compute_logits, attention_impl=attention_impl,
                                cached_slots=cached_slots)


def _llama_without_return_layers():
    cfg = jaxspec.models.config.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                                            num_heads=2, num_kv_heads=1, head_dim=16)
    return NoReturnLayers(cfg, rngs=nnx.Rngs(0))


def _without_layers():
    """The blocks kept under another name: nothing self_draft could shrink."""
    module = _gpt_with(None)
    module.blocks = module.layers
    del module.layers
    return module


def _unhashable_attribute():
    module = _gpt_with(None)
    module.notes = {"source": ["random"]}  # static (not an array) and unhashable: no jit could take the graph
    return module


def _fewer_layers():
    module = _gpt_with(None)
    module.layers = nnx.List(list(module.layers)[:1])  # cfg.num_layers still says 2
    return module


@pytest.mark.parametrize("module, method, message", [
    (lambda: _gpt_with(NoVocab()), None, "the decode loop needs cfg.vocab_size"),
    (lambda: _gpt_with(NoContext()), None, "the decode loop needs cfg.max_position_embeddings"),
    (lambda: _gpt_with(Mutable()), None, "hashable cfg"),
    (lambda: _gpt_with(None, NoNewCache), None, "new_cache"),
    (_unhashable_attribute, None, "every attribute that is not an array to be hashable"),
    (lambda: _gpt_with(None, NoCachedSlots), None, "take the keyword cached_slots"),
    (lambda: _gpt_with(None, IgnoresLogitsAt), None, r"output.logits, floats \[B, L, V\] = \[2, 1, 128\]"),
    (lambda: _gpt_with(None, HalfCache), None, "return the cache with the structure, shapes and dtypes"),
    (lambda: _gpt_with(None, NoTreeMask), "medusa", "method='medusa' needs the forward to take the keyword tree_mask"),
    (lambda: _gpt_with(None, NoHidden), "medusa", r"method='medusa' needs output.hidden \[B, T, D\]"),
    (lambda: _gpt_with(HFNamedConfig(), HFNamedGPT), "self_draft", "method='self_draft' needs cfg.num_layers"),
    (_without_layers, "self_draft", "method='self_draft' needs the attribute layers"),
    (_fewer_layers, "self_draft", r"method='self_draft' needs len\(layers\) == cfg.num_layers"),
    (lambda: _gpt_with(HFNamedConfig(), HFNamedGPT), "eagle", "method='eagle' needs cfg.hidden_size"),
    (_llama_without_return_layers, "eagle3", "method='eagle3' needs the forward to take the keyword return_layers"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_check_target_names_what_is_missing(module, method, message):
    with pytest.raises(ValueError, match=message):
        check_target(module(), method)


def test_the_core_contract_is_checked_when_a_model_is_wrapped():
    with pytest.raises(ValueError, match="model 'broken' .*needs cfg.vocab_size"):
        jaxspec.LanguageModel.from_module(_gpt_with(NoVocab()), name="broken")
    with pytest.raises(ValueError, match="take the keyword cached_slots"):
        jaxspec.LanguageModel.from_module(_gpt_with(None, NoCachedSlots))
    # Chain methods do not need tree_mask, so a model without it is wrapped (and only tree methods refuse it).
    jaxspec.LanguageModel.from_module(_gpt_with(None, NoTreeMask))


def test_self_draft_and_heads_refuse_a_model_lacking_their_part(tmp_path):
    """Through generate: the places that use the extra parts raise ValueError, never AttributeError."""
    lm = jaxspec.LanguageModel.from_module(_gpt_with(HFNamedConfig(), HFNamedGPT), name="hf-named")
    with pytest.raises(ValueError, match="method='self_draft' needs cfg.num_layers"):
        jaxspec.generate(lm, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="self_draft"))
    # A head file made for another model: loading it for this one names the field the head is sized from.
    eagle = save_head(tmp_path / "eagle", new_head("eagle", jaxspec.models.config.ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16)), kind="eagle")
    medusa = save_head(tmp_path / "medusa", MedusaHeads(cm.GPTConfig(), 2), kind="medusa")
    with pytest.raises(ValueError, match="method='eagle2' needs cfg.hidden_size"):
        jaxspec.generate(lm, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="eagle2", head_path=str(eagle)))
    with pytest.raises(ValueError, match="method='medusa' needs cfg.hidden_size"):
        jaxspec.generate(lm, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="medusa", head_path=str(medusa)))
    # The readout the heads share: a model whose token embedding is called `wte` has no params['embed'].
    renamed = nnx.State({("wte" if k == "embed" else k): v for k, v in nnx.state(_gpt_with(None)).items()})
    with pytest.raises(ValueError, match=r"a trained head \(medusa, eagle, eagle2, eagle3, dflash\) needs the "
                                         r"parameter 'embed'"):
        Readout.of(renamed)
    with pytest.raises(ValueError, match="method='medusa' needs cfg.hidden_size"):
        check_config(HFNamedConfig(), "medusa")


def test_unknown_methods_and_targets_are_refused(gpt):
    with pytest.raises(ValueError, match="method='lookahead' must be one of"):
        check_target(gpt, "lookahead")
    with pytest.raises(ValueError, match="must be a jaxspec.LanguageModel or an nnx.Module"):
        check_target(object())


# ------------------------------------------------------------------------------------- the shipped Llama


@pytest.mark.parametrize("fixture", ["tiny_lm", "smollm2"])
def test_llama_meets_the_contract_of_every_method(request, fixture):
    lm = request.getfixturevalue(fixture)
    check_target(lm, "eagle2")  # traced with a tree mask and hidden states: the most any method traces
    for method in names():
        check_target(lm, method, trace=False)
