"""The roofline of a plain decode step: `bench_kernel.py roofline`.

A decode step of one new token per row reads every weight once and each row's KV cache, and does two FLOPs per
weight per row plus its attention. Its least possible time on a device is the larger of

    bytes read / the device's memory bandwidth   and   FLOPs / the device's matmul throughput,

both measured here on the device itself: bandwidth as a jitted elementwise pass over a large array (`x * a + b`
in place, counted as its bytes read plus its bytes written), throughput as a large square matmul in the model's
dtype (2 N^3 FLOPs). Each model's measured plain step (its forward at T = 1 over a KV cache holding `--context`
tokens, logits included, in a jitted loop as the decode loop runs it: `benchkit.spec.cost`) is reported against
that bound, as the fraction of the roofline it reaches, with c(T) = step(T) / step(1) at each `--ts`: the price of
verifying T - 1 drafts, in plain steps.

What a step must read (`step_bytes`): every projection, the norms, the LM head [D, V] (a tied model included:
the logits read the whole table), the embedding rows of the new tokens, and K and V of the `--context` cached
tokens of every row in every layer (the model reads the smallest of its cache buckets holding them, so the cache is
`--context` plus the largest T slots: no more is read than is needed). Writes of the new K/V are counted too.

Models are named as `jaxspec.load_model` takes them: `smollm2-135m` (the default model, its real weights) and
`random:<name>` (random weights in a real checkpoint's shapes, `jaxspec.models.random_shapes`).

    python scripts/bench_kernel.py roofline                                       # default model and 1B, f32
    python scripts/bench_kernel.py roofline --models random:llama-3.1-8b --dtype bfloat16 --rows 1,8,64
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.generation import default_attention_impl
from jaxspec.models.config import ModelConfig
from jaxspec.models.loading import LanguageModel

from . import machine, output, page, tables
from .cli import ints, names
from .spec.cost import measure_cost_curve
from .timing import repeat, timer

DEFAULT_MODELS = "smollm2-135m,random:llama-3.2-1b"


# ---- what a step must read and compute -------------------------------------------------------------------------

def weight_count(config: ModelConfig) -> dict[str, int]:
    """Parameters a one-token step reads, by part: `layers` (projections and norms), `head` (the final norm and
    the LM head [D, V], read whole); the embedding table is only gathered from (`step_bytes` counts its rows)."""
    D, F, H, Hkv, hd = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                        config.head_dim)
    qkv = (H + 2 * Hkv) * hd
    per_layer = qkv * D + D * H * hd + 3 * D * F + 2 * D + (qkv if config.attention_bias else 0)
    return {"layers": config.num_layers * per_layer, "head": D * config.vocab_size + D}


def matmul_weights(config: ModelConfig) -> int:
    """Weights that multiply each new token (projections and LM head): a step does 2 FLOPs per weight per token."""
    D, F, H, Hkv, hd = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                        config.head_dim)
    return config.num_layers * ((H + 2 * Hkv) * hd * D + D * H * hd + 3 * D * F) + D * config.vocab_size


def step_bytes(config: ModelConfig, rows: int, context: int, num_new: int = 1) -> dict[str, int]:
    """Bytes a forward over `num_new` tokens for each of `rows` rows, with `context` tokens cached per row, must
    move: `weights` (read once, whatever the rows), `kv` (the cached K and V read, the new ones written),
    `embedding` (the new tokens' rows of the table)."""
    item = jnp.dtype(config.jnp_dtype).itemsize
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * item  # K and V, every layer
    return {"weights": sum(weight_count(config).values()) * item,
            "kv": rows * (context + num_new) * kv_token,
            "embedding": rows * num_new * config.hidden_size * item}


def step_flops(config: ModelConfig, rows: int, context: int, num_new: int = 1) -> float:
    """FLOPs of that forward: 2 per matmul weight per token, and attention's two products (scores, then the
    weighted sum of V) of 2 H hd FLOPs per token per visible slot in each layer."""
    tokens = rows * num_new
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * tokens * (context + num_new)
    return 2.0 * matmul_weights(config) * tokens + attention


# ---- the device's peaks ------------------------------------------------------------------------------------------

@functools.partial(jax.jit, donate_argnums=0)
def _stream(x: jax.Array) -> jax.Array:
    """One elementwise pass: reads x [N] once, writes [N] once, into x's own buffer (donated: a fresh output
    buffer would also be timed faulting in its pages, which halved the figure on a CPU)."""
    return x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(1.0, x.dtype)


@jax.jit
def _product(a: jax.Array, b: jax.Array) -> jax.Array:
    return a @ b  # [N, N] x [N, N]


def measure_bandwidth(mib: int, repeats: int) -> dict:
    """Bytes per second of an elementwise pass over a float32 array of `mib` MiB (read + written), the median of
    `repeats` passes after a compiling one."""
    carry = {"x": jnp.ones((mib << 20) // 4, jnp.float32)}  # each pass donates the array and gets it back

    def one_pass():
        carry["x"] = _stream(carry["x"])
        carry["x"].block_until_ready()

    seconds = statistics.median(repeat(timer(one_pass), repeats))
    return {"bytes_per_s": 2 * carry["x"].nbytes / seconds, "array_mib": mib, "seconds": seconds}


def measure_matmul(size: int, dtype: str, repeats: int) -> dict:
    """FLOPs per second of a [size, size] x [size, size] matmul in `dtype` (2 size^3 FLOPs), median of `repeats`."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((size, size)), dtype) for _ in range(2))
    seconds = statistics.median(repeat(timer(lambda: _product(a, b).block_until_ready()), repeats))
    return {"flops_per_s": 2 * size ** 3 / seconds, "size": size, "dtype": dtype, "seconds": seconds}


def device_peaks(bandwidth_mib: int, matmul_size: int, dtype: str, repeats: int) -> dict:
    """The measured memory bandwidth and matmul throughput the roofline is drawn from."""
    return {"bandwidth": measure_bandwidth(bandwidth_mib, repeats),
            "matmul": measure_matmul(matmul_size, dtype, repeats)}


# ---- a model against it --------------------------------------------------------------------------------------------

def bound(config: ModelConfig, rows: int, context: int, peaks: dict) -> dict:
    """The step's least possible time: memory-bound and compute-bound ms, and which is the larger."""
    moved = step_bytes(config, rows, context)
    memory_ms = 1000 * sum(moved.values()) / peaks["bandwidth"]["bytes_per_s"]
    compute_ms = 1000 * step_flops(config, rows, context) / peaks["matmul"]["flops_per_s"]
    return {"moved": moved, "flops": step_flops(config, rows, context), "memory_ms": memory_ms,
            "compute_ms": compute_ms, "bound_ms": max(memory_ms, compute_ms),
            "bound_by": "memory" if memory_ms >= compute_ms else "compute"}


def model_roofline(lm, rows_list: list[int], ts: list[int], context: int, peaks: dict, *, repeats: int,
                   forwards: int, max_row_tokens: int | None = None) -> list[dict]:
    """For each row count: the bound, the measured plain step (ms), the fraction of the roofline it reaches, and
    c(T) at each T of `ts` (those whose rows x T exceed `max_row_tokens` are left out)."""
    ts = sorted(set(ts) | {1})
    results = []
    for rows in rows_list:
        measured_ts = [t for t in ts if t == 1 or max_row_tokens is None or rows * t <= max_row_tokens]
        start = time.perf_counter()
        curve = measure_cost_curve(lm, rows, measured_ts, context, context + max(measured_ts), repeats, forwards,
                                   default_attention_impl())
        step_ms = curve[0]["ms"]
        b = bound(lm.config, rows, context, peaks)
        results.append({"rows": rows, **b, "step_ms": step_ms, "fraction": b["bound_ms"] / step_ms,
                        "cost": {r["T"]: {"ms": r["ms"], "c": r["c"]} for r in curve},
                        "seconds": time.perf_counter() - start})
        print(f"  {lm.name} rows {rows}: step {step_ms:.2f} ms, bound {b['bound_ms']:.2f} ms ({b['bound_by']}), "
              f"{b['bound_ms'] / step_ms:.0%} of the roofline; "
              + ", ".join(f"c({r['T']})={r['c']:.2f}" for r in curve[1:]), flush=True)
    return results


def run_models(models: list[str], dtype: str, rows: list[int], ts: list[int], context: int, peaks: dict, *,
               repeats: int, forwards: int, max_row_tokens: int | None = None,
               load: Callable[..., LanguageModel] = jaxspec.load_model) -> list[dict]:
    """`model_roofline` for each named model in turn (each loaded by `load(name, dtype=dtype)`, dropped before
    the next)."""
    out = []
    for name in models:
        start = time.perf_counter()
        lm = load(name, dtype=dtype)
        jax.block_until_ready(lm.params)
        load_s = time.perf_counter() - start
        out.append({"model": lm.name, "dtype": dtype, "context": context, "load_s": load_s,
                    "parameters": sum(weight_count(lm.config).values()),
                    "results": model_roofline(lm, rows, ts, context, peaks, repeats=repeats, forwards=forwards,
                                              max_row_tokens=max_row_tokens)})
        del lm
        gc.collect()
        jax.clear_caches()  # the next model's programs replace this one's
    return out


def peaks_line(peaks: dict) -> str:
    bw, mm = peaks["bandwidth"], peaks["matmul"]
    return (f"measured: memory bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s (elementwise pass over {bw['array_mib']} "
            f"MiB, read + written), matmul {mm['flops_per_s'] / 1e12:.3f} TFLOP/s ([{mm['size']}, {mm['size']}] "
            f"squared, {mm['dtype']})")


def markdown(peaks: dict, models: list[dict], repeats: int, forwards: int) -> str:
    """The roofline tables: one per model, a row per row count, c(T) in the last columns."""
    lines = [peaks_line(peaks), "",
             f"Plain step: the forward over 1 new token per row, logits included, median of {repeats} interleaved "
             f"rounds of {forwards} forwards in a jitted loop; bound: max(bytes / bandwidth, FLOPs / matmul "
             "throughput); fraction: bound / step; c(T): the forward over T tokens per row / the plain step.", ""]
    for m in models:
        ts = sorted({t for r in m["results"] for t in r["cost"] if t != 1})
        lines += [f"### {m['model']}, {m['dtype']}, {m['parameters'] / 1e9:.3f} B parameters read per step, "
                  f"context {m['context']}", "",
                  tables.head(["rows", "weights MiB", "KV MiB", "GFLOP", "bound ms", "bound by", "step ms",
                               "fraction of roofline", *(f"c({t})" for t in ts)])]
        for r in m["results"]:
            moved = r["moved"]
            lines.append(tables.row([r["rows"], f"{moved['weights'] / 2 ** 20:.0f}", f"{moved['kv'] / 2 ** 20:.1f}",
                                     f"{r['flops'] / 1e9:.1f}", f"{r['bound_ms']:.2f}", r["bound_by"],
                                     f"{r['step_ms']:.2f}", f"{r['fraction']:.2f}",
                                     *(tables.fmt(r["cost"].get(t, {}).get("c")) for t in ts)]))
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_kernel.py roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=names, default=names(DEFAULT_MODELS), help="(default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=ints, default=ints("1,8,64"), help="(default: 1,8,64)")
    parser.add_argument("--ts", type=ints, default=ints("1,2,5,9"), help="T of c(T) (default: 1,2,5,9)")
    parser.add_argument("--max-row-tokens", type=int, default=None,
                        help="leave out c(T) where rows x T exceeds this (default: none left out)")
    parser.add_argument("--context", type=int, default=512, help="tokens cached per row (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--forwards", type=int, default=2, help="forwards per timed call (default: %(default)s)")
    parser.add_argument("--bandwidth-mib", type=int, default=None,
                        help="array for the bandwidth pass (default: 512 on a CPU, 4096 on an accelerator)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="N of the N x N matmul (default: 2048 on a CPU, 8192 on an accelerator)")
    parser.add_argument("--out", default="bench_out/roofline.json", help="the JSON without --write-page")
    page.add_option(parser, "roofline")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    jaxspec.enable_compilation_cache()
    cpu = jax.default_backend() == "cpu"
    info = machine.info()
    print(f"# Roofline of a plain decode step: {machine.line(info)}", flush=True)
    peaks = device_peaks(args.bandwidth_mib or (512 if cpu else 4096), args.matmul_size or (2048 if cpu else 8192),
                         args.dtype, args.repeats)
    print(peaks_line(peaks), flush=True)
    models = run_models(args.models, args.dtype, args.rows, args.ts, args.context, peaks, repeats=args.repeats,
                        forwards=args.forwards, max_row_tokens=args.max_row_tokens)
    text = markdown(peaks, models, args.repeats, args.forwards)
    print(text)
    report = {"peaks": peaks, "models": models}
    if args.write_page:
        page.write(args.write_page, text, info, report)
    else:
        output.save_json(Path(args.out), info, args, [report])
    return 0
