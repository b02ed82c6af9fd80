#!/usr/bin/env python
"""The kernels and devices: verification attention on a GPU (Pallas against XLA), the CPU matmul kernel's verify
cost, the model on device meshes, a decode step against the device's roofline, a mixture of experts' MLP, and
loading a checkpoint onto devices.

    python scripts/bench_kernel.py [ARGS]               # verification attention on a GPU (below)
    python scripts/bench_kernel.py verify-cost [ARGS]   # c(T): XLA's matmul, the CPU kernel (benchkit/verify_cost.py)
    python scripts/bench_kernel.py mesh measure|layout|estimate [ARGS]   # device meshes (benchkit/mesh.py)
    python scripts/bench_kernel.py roofline [ARGS]      # a decode step against its roofline (benchkit/roofline.py)
    python scripts/bench_kernel.py profile [ARGS]       # where the time goes: a profiler trace (benchkit/profile.py)
    python scripts/bench_kernel.py moe [ARGS]           # a mixture of experts' MLP, three ways (benchkit/moe.py)
    python scripts/bench_kernel.py load [ARGS]          # a checkpoint's load: seconds, peak memory (benchkit/load.py)

Verification attention on a GPU: the Pallas kernel against XLA's attention, side by side.

`jaxspec.kernels.verify_attention` (Pallas, lowered through Triton) and `verify_attention_reference` (plain
jnp, compiled by XLA) compute the same thing: the T new tokens of each of B rows against that row's KV cache
of S slots, of which the row's committed `length` are in use. The reference reads every slot and materialises
the [B, Hq, T, S] scores; the kernel stops at `length + T` and keeps one block of scores in registers. So the
table is taken at two fills: a full cache (length = S - T) and an eighth-full one (length = S / 8, what a
row looks like early in a long bucket).

Shapes are the default model's attention (SmolLM2-135M: 9 query heads over 3 KV heads, head dim 64). Each
figure is the median over `--repeats` timings of a jitted `lax.fori_loop` of `--calls` dependent calls (each
call's output is the next call's queries, so nothing is hoisted or overlapped), divided by `--calls`: the
per-call time without host dispatch. The kernel runs with its automatic split-KV choice ("pallas") and at each
`--splits` count (default 1: unsplit, one program per row, KV head and query block). All take turns in every
round. Results are checked against XLA's before timing (the largest difference of any kernel setting).

    python scripts/bench_kernel.py                            # B 1,8,32 x T 4,16,64 x S 1k,8k,32k, bf16
    python scripts/bench_kernel.py --dtype float32 --batches 1,8 --caches 1024,8192
    python scripts/bench_kernel.py --tree                     # a random draft tree mask instead of a chain
    python scripts/bench_kernel.py --splits 1,4               # also time the kernel at fixed split-KV counts

On CPU the kernel only runs in the Pallas interpreter, which is a correctness tool: this script refuses to
time it there (pass --interpret to check that it runs at all).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchkit import machine, output, page, tables
from benchkit.cli import ints
from benchkit.timing import interleave, timer
from jaxspec.kernels.verify_attention import BlockSizes, ancestor_mask, verify_attention, verify_attention_reference

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 8, 32])
    p.add_argument("--widths", type=ints, default=[4, 16, 64], help="T, new tokens per row")
    p.add_argument("--caches", type=ints, default=[1024, 8192, 32768], help="S, cache slots per row")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--tree", action="store_true", help="a random draft-tree mask instead of the causal chain")
    p.add_argument("--splits", type=ints, default=[1],
                   help="fixed split-KV counts timed beside the automatic choice (BlockSizes.num_splits)")
    p.add_argument("--calls", type=int, default=20, help="dependent calls per timed loop")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--interpret", action="store_true", help="run the kernel in the interpreter (CPU check only)")
    p.add_argument("--out", type=Path, default=Path("bench_out/bench_kernel.json"))
    page.add_option(p, "kernel-attention")
    return p.parse_args(argv)


def random_tree_mask(rng: np.random.Generator, batch: int, num_new: int) -> jax.Array:
    """bool[B, T, T]: node i sees itself and its ancestors in a random forest (parent < child; -1 a root)."""
    parents = np.full((batch, num_new), -1, np.int32)
    for i in range(1, num_new):
        parents[:, i] = rng.integers(-1, i, size=batch)
    return ancestor_mask(jnp.asarray(parents))


def looped(attend, calls: int):
    """A jitted loop of `calls` attention calls, each one's output the next one's queries."""

    @jax.jit
    def run(q, k, v, lengths, mask):  # q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]
        return lax.fori_loop(0, calls, lambda _, x: attend(x, k, v, lengths, mask), q)

    return run


def blocking(call):
    """`call()`, returning only once the device has finished it."""
    return jax.block_until_ready(call())


def measure(args, batch: int, num_new: int, num_slots: int, rng: np.random.Generator) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    q = jnp.asarray(rng.standard_normal((batch, num_new, NUM_Q_HEADS, HEAD_DIM)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, NUM_KV_HEADS, num_slots, HEAD_DIM)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, NUM_KV_HEADS, num_slots, HEAD_DIM)), dtype)
    mask = random_tree_mask(rng, batch, num_new) if args.tree else None
    impls = {
        "xla": verify_attention_reference,
        "pallas": functools.partial(verify_attention, interpret=args.interpret),
        **{f"pallas split {n}": functools.partial(verify_attention, interpret=args.interpret,
                                                  block_sizes=BlockSizes(num_splits=n)) for n in args.splits},
    }
    loops = {name: looped(fn, args.calls) for name, fn in impls.items()}
    rows = []
    for fill, length in (("full", num_slots - num_new), ("1/8", num_slots // 8)):
        lengths = jnp.full((batch,), length, jnp.int32)
        # Same answer first (one call each); `interleave` compiles every loop before it times any.
        outs = {name: np.asarray(fn(q, k, v, lengths, mask), np.float32) for name, fn in impls.items()}
        error = max(float(np.max(np.abs(out - outs["xla"]))) for out in outs.values())
        runs = {name: timer(functools.partial(blocking, functools.partial(loop, q, k, v, lengths, mask)))
                for name, loop in loops.items()}
        times = interleave(runs, args.repeats, alternate=True)
        us = {name: statistics.median(t) / args.calls * 1e6 for name, t in times.items()}
        rows.append(dict(batch=batch, num_new=num_new, num_slots=num_slots, fill=fill, length=length, us=us,
                         speedup=us["xla"] / us["pallas"], max_abs_error=error))
    return rows


MODES = {"verify-cost": "benchkit.verify_cost", "mesh": "benchkit.mesh", "roofline": "benchkit.roofline",
         "profile": "benchkit.profile", "moe": "benchkit.moe", "load": "benchkit.load"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MODES:
        return importlib.import_module(MODES[argv[0]]).main(argv[1:])
    args = parse_args(argv)
    if jax.default_backend() == "cpu" and not args.interpret:
        print("bench_kernel times the compiled kernel, which needs a GPU; on CPU pass --interpret to check it runs",
              file=sys.stderr)
        return 2
    info = machine.info()
    print(f"# verification attention, Pallas vs XLA: {machine.line(info)}")
    print(f"# Hq {NUM_Q_HEADS}, Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, {args.dtype}, "
          f"{'tree' if args.tree else 'chain'} mask; us per call, median of {args.repeats} x {args.calls} calls")
    columns = (["B", "T", "S", "fill", "xla us", "pallas us"] + [f"split {n} us" for n in args.splits]
               + ["xla / pallas", "max abs diff"])
    print(tables.head(columns), flush=True)
    rng = np.random.default_rng(0)
    results, rows = [], []
    for batch in args.batches:
        for num_slots in args.caches:
            for num_new in args.widths:
                for r in measure(args, batch, num_new, num_slots, rng):
                    results.append(r)
                    rows.append([r["batch"], r["num_new"], r["num_slots"], r["fill"]]
                                + [tables.fmt(us, ".1f") for us in r["us"].values()]
                                + [tables.fmt(r["speedup"]), tables.fmt(r["max_abs_error"], ".1e")])
                    print(tables.row(rows[-1]), flush=True)
    output.save_json(args.out, info, args, results)
    if args.write_page:
        page.write(args.write_page, f"{args.dtype}, {'tree' if args.tree else 'chain'} mask, Hq {NUM_Q_HEADS}, Hkv "
                   f"{NUM_KV_HEADS}, D {HEAD_DIM}; us per call, median of {args.repeats} x {args.calls} calls\n\n"
                   + tables.markdown(columns, rows), info, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
