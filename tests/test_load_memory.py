"""Loading a sharded Hugging Face checkpoint holds the model and about one tensor beside it, not a second copy.

The checkpoint is written here shard by shard (random float32 weights, a Llama layout without tied embeddings,
so the model holds exactly the checkpoint's bytes), and loaded in a fresh process, whose peak resident memory
above what it held before `load_model` must stay within 1.3x the parameter bytes. The default run loads a quarter
of a billion parameters, onto one device and onto a mesh of 8 forced CPU devices that split every matrix (each
tensor goes from the file to its devices' shards, never whole to one device first, scanned or unrolled); `-m slow`
runs the one-device load at 1.5 billion (Llama-3.2-1B's shapes with an untied head).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

LIMIT = 1.3  # peak resident bytes above the process's own, per parameter byte

# A child process: the baseline is taken once jax has started its CPU backend, so what remains is the load's. The
# peak is the process's own high-water mark (VmHWM), not getrusage's ru_maxrss, which Linux carries across exec
# from the forked parent: a child of a pytest worker holding 5 GB would report 5 GB before it loads anything.
CHILD = r"""
import sys
import jax.numpy as jnp
jnp.zeros(1).block_until_ready()
from jaxspec.models.loading import load_model
from jaxspec.sharding import make_mesh
def status(key):
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])
mesh = make_mesh(1, 8) if sys.argv[2] != "none" else None
before = status("VmRSS")
lm = load_model(sys.argv[1], mesh=mesh, layer_loop=sys.argv[3])
print(before, status("VmHWM"))
"""


def _write_sharded(path, *, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, shards) -> int:
    """A random Llama checkpoint in `shards` files with its index; returns its parameter bytes. One shard's
    tensors are in memory at a time."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def matrix(rows, cols):
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)

    weight_map, total = {}, 0
    for s in range(shards):
        tensors = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = matrix(vocab, hidden)
        for i in range(s * layers // shards, (s + 1) * layers // shards):
            p = f"model.layers.{i}."
            tensors.update({
                p + "input_layernorm.weight": np.ones(hidden, np.float32),
                p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": matrix(intermediate, hidden),
                p + "mlp.up_proj.weight": matrix(intermediate, hidden),
                p + "mlp.down_proj.weight": matrix(hidden, intermediate)})
        if s == shards - 1:
            tensors["model.norm.weight"] = np.ones(hidden, np.float32)
            tensors["lm_head.weight"] = matrix(vocab, hidden)
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path / name))
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def _peak_ratio(path, parameter_bytes: int, mesh: bool = False, layer_loop: str = "unroll") -> float:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu") if mesh else None
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), "1x8" if mesh else "none", layer_loop],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    before, peak = map(int, out.stdout.split())
    return (peak - before) / parameter_bytes


@pytest.fixture(scope="module")
def quarter_billion(tmp_path_factory):
    """(path, parameter bytes) of a quarter of a billion float32 parameters in 3 files."""
    path = tmp_path_factory.mktemp("quarter_billion")
    size = _write_sharded(path, vocab=32000, hidden=1024, intermediate=2816, layers=16, heads=16, kv_heads=8,
                          head_dim=64, shards=3)
    assert size > 10**9
    return path, size


def test_a_sharded_checkpoint_loads_without_a_second_copy(quarter_billion):
    ratio = _peak_ratio(*quarter_billion)
    assert ratio <= LIMIT, f"peak resident memory {ratio:.2f}x the parameter bytes"


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_a_sharded_checkpoint_loads_onto_a_mesh_without_a_second_copy(quarter_billion, layer_loop):
    """Loading whole onto one device and placing it then (`LanguageModel.on_mesh`) peaks near 2.6x unrolled and
    3.4x scanned: the whole model, its re-laid-out copy and the shards."""
    ratio = _peak_ratio(*quarter_billion, mesh=True, layer_loop=layer_loop)
    assert ratio <= LIMIT, f"peak resident memory {ratio:.2f}x the parameter bytes ({layer_loop}, 1x8 mesh)"


@pytest.mark.slow
def test_a_billion_parameter_checkpoint_loads_within_its_bytes(tmp_path):
    size = _write_sharded(tmp_path, vocab=128256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                          head_dim=64, shards=3)
    assert size > 5 * 10**9  # 1.5 billion float32 parameters
    ratio = _peak_ratio(tmp_path, size)
    assert ratio <= LIMIT, f"peak resident memory {ratio:.2f}x the parameter bytes"
