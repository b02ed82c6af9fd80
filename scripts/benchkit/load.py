"""`bench_kernel.py load`: loading a sharded Hugging Face checkpoint, its seconds and its peak resident memory, onto
one device and onto a mesh, each way a user can.

A random Llama checkpoint (float32, untied head, so the model holds exactly the checkpoint's bytes) is written to
`--dir` in `--shards` files, then loaded in a fresh process per run, which reports the seconds `load_model` took
and its peak resident memory above what it held before (VmHWM - VmRSS, both the process's own): the ratio to the
parameter bytes is what a host needs beside its baseline. The ways:

- one device, the layers unrolled or scanned (`load_model(path, layer_loop=...)`);
- a mesh of `--devices` forced CPU devices splitting every matrix over "model" (`load_model(path, mesh=...)`),
  each tensor sent from the file straight to its shards;
- the same mesh reached by loading whole and then placing (`load_model(path).on_mesh(mesh)`), what a model
  built in code goes through: the whole model, its re-laid-out copy and the shards.

    python scripts/bench_kernel.py load                       # a quarter of a billion parameters, 3 files
    python scripts/bench_kernel.py load --shape 1b            # Llama-3.2-1B's shapes, untied: 1.5 billion
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchkit import machine, page, tables

# Llama-family shapes of a float32 checkpoint: a quarter of a billion parameters (1 GB), and Llama-3.2-1B's
# with an untied head (1.5 billion, 6 GB).
SHAPES = {
    "250m": dict(vocab=32000, hidden=1024, intermediate=2816, layers=16, heads=16, kv_heads=8, head_dim=64),
    "1b": dict(vocab=128256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64),
}
WAYS = ("one device", "mesh", "whole, then on_mesh")

# The child: the baseline is taken once jax has started its backend, so what remains is the load's. The peak is
# the process's own high-water mark (VmHWM), not getrusage's ru_maxrss, which Linux carries across exec from the
# parent: a child of a process holding 5 GB would report 5 GB before it loads anything.
CHILD = r"""
import json, sys, time
import jax.numpy as jnp
jnp.zeros(1).block_until_ready()
from jaxspec.models.loading import load_model
from jaxspec.sharding import make_mesh
def status(key):
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])
path, way, layer_loop, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mesh = None if way == "one device" else make_mesh(1, devices)
before = status("VmRSS")
start = time.perf_counter()
if way == "mesh":
    lm = load_model(path, mesh=mesh, layer_loop=layer_loop)
else:
    lm = load_model(path, layer_loop=layer_loop)
    if mesh is not None:
        lm = lm.on_mesh(mesh)
seconds = time.perf_counter() - start
print(json.dumps({"before": before, "peak": status("VmHWM"), "seconds": seconds}))
"""


def write_checkpoint(path, *, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, shards) -> int:
    """A random Llama checkpoint in `shards` files with its index; returns its parameter bytes. One shard's
    tensors are in memory at a time."""
    import numpy as np
    from safetensors.numpy import save_file

    path = Path(path)
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


def measure_load(path, parameter_bytes: int, way: str = "one device", layer_loop: str = "unroll",
                 devices: int = 8) -> dict:
    """{"seconds", "ratio"} of one load of the checkpoint at `path` in a fresh process, `way` one of `WAYS`: the
    seconds `load_model` (and `on_mesh`) took, and the peak resident bytes above the process's own before it, per
    parameter byte."""
    if way not in WAYS:
        raise ValueError(f"way={way!r} must be one of {WAYS}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if way != "one device":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), way, layer_loop, str(devices)], capture_output=True,
                         text=True, timeout=1200, env=env)
    if out.returncode:
        raise RuntimeError(f"loading {path} ({way}, {layer_loop}) failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"seconds": got["seconds"], "ratio": (got["peak"] - got["before"]) / parameter_bytes}


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_kernel.py load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="250m", help="the checkpoint's shapes")
    p.add_argument("--shards", type=int, default=3, help="safetensors files the checkpoint is written in")
    p.add_argument("--devices", type=int, default=8, help="forced CPU devices of the (1, N) mesh")
    p.add_argument("--repeats", type=int, default=3, help="loads per way; the table has the median seconds and "
                                                          "the largest ratio")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    p.add_argument("--write-page", nargs="?", const="load", default=None, help="write this block of the page")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    info = machine.info()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.dir or tmp)
        size = write_checkpoint(path, **SHAPES[args.shape], shards=args.shards)
        title = (f"a {size / 4e9:.2f}-billion-parameter float32 Llama checkpoint ({size / 1e9:.2f} GB) in "
                 f"{args.shards} files; a mesh is (1, {args.devices}) forced CPU devices; median seconds and largest "
                 f"peak of {args.repeats} loads, each in a fresh process")
        print(f"# loading a checkpoint: {machine.line(info)}\n# {title}")
        columns = ["way", "layers", "load s", "peak RSS / parameter bytes"]
        print(tables.head(columns), flush=True)
        rows, report = [], []
        for way in WAYS:
            for layer_loop in ("unroll", "scan"):
                runs = [measure_load(path, size, way, layer_loop, args.devices) for _ in range(args.repeats)]
                seconds = statistics.median(r["seconds"] for r in runs)
                ratio = max(r["ratio"] for r in runs)
                row = [way, layer_loop, f"{seconds:.1f}", f"{ratio:.2f}x"]
                rows.append(row)
                report.append({"way": way, "layer_loop": layer_loop, "seconds": seconds, "ratio": ratio,
                               "runs": runs})
                print(tables.row(row), flush=True)
    if args.write_page:
        page.write(args.write_page, f"{title}\n\n" + tables.markdown(columns, rows), info,
                   {"parameter_bytes": size, "rows": report})
    return 0
