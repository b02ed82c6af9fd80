"""The decoder layers as a `lax.scan` over stacked weights give what the unrolled layers give: the same logits and
the same greedy tokens on the default model, for plain decoding and for speculative methods (chains with deferred
cache writes, trees, EAGLE-3's layer features), with the same KV cache contents in its stacked layout."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from conftest import TINY
from jaxspec import SpecConfig
from jaxspec.cache import KVCache, write_new
from jaxspec.models.llama import LAYER_LOOP_ENV, DecoderLayer, Llama, default_layer_loop, set_layer_loop
from jaxspec.models.rope import rope_tables

PROMPTS = ["def fibonacci(n):\n", "Write a short note inviting the team to a planning meeting."]


def _with_loop(lm: jaxspec.LanguageModel, loop: str) -> jaxspec.LanguageModel:
    module = nnx.merge(lm.graphdef, lm.params, copy=True)
    set_layer_loop(module, loop)
    return jaxspec.LanguageModel.from_module(module, lm.tokenizer, name=lm.name)


@pytest.fixture(scope="module")
def scanned(smollm2):
    assert smollm2.module.layer_loop == "unroll", "the CPU's default"
    return _with_loop(smollm2, "scan")


def test_the_platform_chooses_the_loop_and_the_environment_overrides_it(monkeypatch):
    assert default_layer_loop() == ("unroll" if jax.default_backend() == "cpu" else "scan")
    monkeypatch.setenv(LAYER_LOOP_ENV, "scan")
    assert default_layer_loop() == "scan"
    monkeypatch.setenv(LAYER_LOOP_ENV, "sideways")
    with pytest.raises(ValueError, match="sideways"):
        default_layer_loop()
    with pytest.raises(ValueError, match="layer_loop='sideways'"):
        jaxspec.load_model("random:smollm2-135m", layer_loop="sideways")


def test_stacking_and_unstacking_keep_every_weight(tiny_lm):
    module = nnx.merge(tiny_lm.graphdef, tiny_lm.params, copy=True)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(module.layers[1]))]
    set_layer_loop(module, "scan")
    qkv = module.layers.attn.qkv[...]
    assert qkv.shape[0] == tiny_lm.config.num_layers and module.new_cache(2, 16).stacked
    assert module.new_cache(2, 16).k.shape == (2, tiny_lm.config.num_layers, tiny_lm.config.num_kv_heads, 16,
                                               tiny_lm.config.head_dim)
    set_layer_loop(module, "unroll")
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(module.layers[1]))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match="layer_loop='loop'"):
        set_layer_loop(module, "loop")



@pytest.mark.parametrize("kinds", [None, ("sliding_attention", "full_attention") * 2])
def test_an_unrolled_stack_traces_each_kind_of_layer_once(monkeypatch, kinds):
    """Unrolled layers alike share one trace (a first call traces one layer per verify width, not num_layers of
    them), and layers of different windows trace apart: same logits as calling each layer in turn."""
    cfg = dataclasses.replace(TINY, num_layers=4, sliding_window=3 if kinds else None, layer_types=kinds)
    module = Llama(cfg, rngs=nnx.Rngs(1))
    assert module.layer_loop == "unroll"
    traced = []
    call = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__", lambda self, *a, **k: traced.append(1) or call(self, *a, **k))
    jax.clear_caches()
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    out, _ = module(tokens, positions, module.new_cache(1, 16))
    assert len(traced) == (2 if kinds else 1)

    traced.clear()
    x, cache = module.embed_tokens(tokens), module.new_cache(1, 16)  # the layers by hand, each traced apart
    cos, sin = rope_tables(positions, cfg.layer_rope(0), cfg.head_dim)
    for i, layer in enumerate(module.layers):
        window = None if cfg.layer_window(i) is None else (positions, cfg.layer_window(i))
        x, _, _ = layer(x, cos, sin, cache.k[i], cache.v[i], cache.lengths, None, "xla", None, window=window)
    assert len(traced) == cfg.num_layers
    np.testing.assert_allclose(out.logits, module.logits(module.norm(x)), rtol=1e-5, atol=1e-5)

def test_write_new_into_a_stacked_layer_equals_the_layer_write():
    rng = np.random.default_rng(0)
    stacked = jnp.asarray(rng.normal(size=(2, 3, 2, 8, 4)), jnp.float32)  # [B, L, Hkv, S, hd]
    new = jnp.asarray(rng.normal(size=(2, 2, 3, 4)), jnp.float32)  # [B, Hkv, T, hd]
    start = jnp.asarray([2, 6])  # row 1 runs past the last slot: its third token is dropped
    got = write_new(stacked, new, start, jnp.int32(1))
    expected = stacked.at[:, 1].set(write_new(stacked[:, 1], new, start))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert np.array_equal(np.asarray(got[:, 0]), np.asarray(stacked[:, 0]))


def test_scan_gives_the_unrolled_logits_and_cache(smollm2, scanned):
    tokens = jnp.asarray([smollm2.tokenizer.encode(PROMPTS[1])[:12]] * 2, jnp.int32)  # [2, 12]
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))

    def forward(lm, cache_len=32):
        model = lm.module
        out, cache = model(tokens, positions, model.new_cache(2, cache_len), return_layers=(3, 17))
        return out, cache

    (ref, ref_cache), (got, got_cache) = forward(smollm2), forward(scanned)
    assert isinstance(got_cache, KVCache) and got_cache.stacked and not ref_cache.stacked
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), rtol=1e-4, atol=2e-3)
    for a, b in zip(got.layer_hidden, ref.layer_hidden):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(got_cache.k[:, 5]), np.asarray(ref_cache.k[5]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_cache.v[:, 29]), np.asarray(ref_cache.v[29]), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def unrolled_tokens(smollm2):
    return jaxspec.generate(smollm2, PROMPTS, max_new_tokens=40).token_ids


@pytest.mark.parametrize("method", ["none", "sam", "eagle3", "self_draft"])
def test_scan_decodes_the_unrolled_greedy_tokens(scanned, unrolled_tokens, method):
    """Greedy speculative decoding with scanned layers gives plain decoding's tokens (sam: chains at several
    widths with deferred cache writes; eagle3: a tree and the target's layer features)."""
    spec = (None if method == "none" else SpecConfig(method=method, self_draft_layers=8) if method == "self_draft"
            else SpecConfig(method=method))
    got = jaxspec.generate(scanned, PROMPTS, max_new_tokens=40, spec=spec)
    assert got.token_ids == unrolled_tokens
    if spec is not None:
        assert got.stats.drafted > 0 and got.stats.accepted > 0


def test_a_scanned_model_serves_in_the_engine(tiny_lm):
    """The engine admits rows into its batch, regroups them and speculates with the stacked cache: every request
    gets generate's greedy tokens."""
    from jaxspec.engine import Engine, EngineConfig, Request
    from jaxspec.policy import DraftPolicy

    scanned = _with_loop(tiny_lm, "scan")
    prompts = [[5, 6, 7, 8] * 3, [10, 11, 12] * 4, [3, 1, 4, 1, 5, 9] * 2]
    config = EngineConfig(max_slots=4, cache_len=128, chunk_steps=4, slot_buckets=(1, 2, 4),
                          spec=SpecConfig(method="sam", num_speculative_tokens=4, min_match=2))
    engine = Engine(scanned, config, policy=DraftPolicy("fixed")).start(warmup=False)
    try:
        outputs = [[] for _ in prompts]
        finished = [threading.Event() for _ in prompts]

        def collect(i):
            def on_output(out):
                outputs[i].extend(out.token_ids)
                if out.finish_reason is not None:
                    finished[i].set()
            return on_output

        for i, p in enumerate(prompts):
            engine.submit(Request(p, 20), collect(i))
        assert all(f.wait(300) for f in finished)
    finally:
        engine.shutdown(drain=False, timeout=60)
    assert engine.failed is None
    ref = jaxspec.generate(tiny_lm, prompts, max_new_tokens=20)
    assert outputs == ref.token_ids
    assert engine.metrics.drafted > 0


def test_a_scanned_model_rolls_out(tiny_lm):
    """Rows move between the rollout's compacted batches with the stacked cache: group_sam gives the unrolled
    model's plain samples."""
    scanned = _with_loop(tiny_lm, "scan")
    prompts = [[5, 6, 7, 8, 5, 6], [10, 11, 12, 13, 10, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    kw = dict(num_samples=3, max_new_tokens=24, sampling=jaxspec.SamplingParams(temperature=0.8), seed=1,
              chunk_steps=4, stop_token_ids=[93])
    ref = jaxspec.rollout(tiny_lm, prompts, **kw)
    got = jaxspec.rollout(scanned, prompts, spec=SpecConfig(method="group_sam"), speculation="fixed", **kw)
    assert got.token_ids == ref.token_ids and got.stats.drafted > 0
    batches = [c.batch for c in got.stats.chunks]
    assert min(batches) < batches[0], batches  # finished rows left the batch: the stacked cache was compacted


def test_a_new_llama_takes_the_platform_default():
    cfg = jaxspec.models.config.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                                            num_heads=2, num_kv_heads=1, head_dim=8)
    assert Llama(cfg, rngs=nnx.Rngs(0)).layer_loop == default_layer_loop()
    assert Llama(cfg, rngs=nnx.Rngs(0), layer_loop="scan").new_cache(1, 8).stacked
