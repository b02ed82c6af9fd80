"""What verification costs with XLA's matmul and with the CPU matmul kernel: `bench_kernel.py verify-cost`.

Speculative decoding verifies T = K + 1 tokens per row in one forward. Decode reads every weight once per
forward, so a forward over a few tokens should cost about what a one-token forward costs; with XLA:CPU's GEMM
it costs several (docs/cpu-performance.md). Two measurements, each path's calls alternating in one process:

1. The projection microbenchmark: thirty `w [1536, 576] @ x [576, T]` products over separate weight arrays
   (SmolLM2-135M's MLP shapes, one per layer), timed inside a jitted loop: XLA as `x^T @ w^T` (the row-major
   form), XLA as `w @ x` (the model's form), and the kernel (with its helper threads, on one thread, each loop
   form, and, on an AVX-512 CPU, its AVX2 path).
2. c(T): the default model's forward over T new tokens per row (logits at every token, a `--cache-len`-slot
   cache holding `--context` tokens, timed inside a jitted loop of `--forwards` forwards as a verify step runs
   it) divided by the one-token forward of the same path, for each `--impls` path; "vs xla T=1" divides by
   XLA's one-token forward instead.

Medians over `--repeats` interleaved rounds (each round visits every configuration, every other round in
reverse order); the load average is printed after each table, as this machine is often shared.

    python scripts/bench_kernel.py verify-cost                       # both parts, batch 1 and 8 (~15 min on 2 cores)
    python scripts/bench_kernel.py verify-cost --skip-model          # the microbenchmark alone (~1 min)
    python scripts/bench_kernel.py verify-cost --skip-micro --batch1-ts 1,2,4,8,16 --batch8-ts 1,9
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxspec
from benchkit import machine, page, tables
from benchkit.cli import ints
from benchkit.timing import interleave, timer
from jaxspec.kernels import cpu as cpu_kernels
from jaxspec.models.llama import set_matmul

MICRO_LAYERS, MICRO_OUT, MICRO_IN = 30, 1536, 576


def load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1 / 5 / 15 min)"


# ---- 1. the projection microbenchmark -----------------------------------------------------------------------

def micro_variants(kernel: bool) -> dict[str, callable]:
    """name -> product w [out, in], x [in, T] -> [out, T] (or its transpose, which is as good for timing)."""
    variants = {"xla x^T @ w^T": lambda w, x, wt: x.T @ wt, "xla w @ x": lambda w, x, wt: w @ x}
    if kernel:
        variants.update({
            "kernel": lambda w, x, wt: cpu_kernels.matmul(w, x),
            "kernel 1 thread": lambda w, x, wt: cpu_kernels.matmul(w, x, threads=1),
        })
        if cpu_kernels.isa() in ("avx512", "avx2"):
            variants.update({
                "kernel dot": lambda w, x, wt: cpu_kernels.matmul(w, x, form="dot"),
                "kernel broadcast": lambda w, x, wt: cpu_kernels.matmul(w, x, form="broadcast"),
            })
        if cpu_kernels.isa() == "avx512":
            variants.update({
                # The path of CPUs without AVX-512, timed here on an AVX-512 CPU.
                "kernel avx2": lambda w, x, wt: cpu_kernels.matmul(w, x, isa="avx2"),
            })
    return variants


def micro_fn(product, loops: int):
    """A jitted loop of `loops` passes over the thirty products; each pass feeds a scalar of the last into the
    next input, so nothing is hoisted. The barrier keeps XLA from narrowing a product to the one row read."""

    @jax.jit
    def run(ws, wts, x):  # ws: [out, in] each; wts: [in, out] each; x [in, T]
        def body(_, acc):
            xi = x + acc * 1e-30
            for w, wt in zip(ws, wts):
                acc = acc + jnp.sum(jax.lax.optimization_barrier(product(w, xi, wt))[:1])
            return acc

        return jax.lax.fori_loop(0, loops, body, jnp.zeros((), jnp.float32))

    return run


def micro(ts: list[int], repeats: int, loops: int, kernel: bool) -> None:
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((MICRO_OUT, MICRO_IN)), jnp.float32) for _ in range(MICRO_LAYERS)]
    wts = [jnp.asarray(np.asarray(w).T) for w in ws]  # the row-major [in, out] copies x^T @ w^T reads
    variants = micro_variants(kernel)
    runs = {}
    for name, product in variants.items():
        fn = micro_fn(product, loops)
        for t in ts:
            x = jnp.asarray(rng.standard_normal((MICRO_IN, t)), jnp.float32)
            runs[(name, t)] = timer(functools.partial(lambda fn, x: fn(ws, wts, x).block_until_ready(), fn, x))
    print(f"## Thirty [{MICRO_OUT}, {MICRO_IN}] x [{MICRO_IN}, T] products (ms per thirty; median of {repeats} "
          f"interleaved rounds, {loops} passes per timed call)\n")
    times = interleave(runs, repeats, alternate=True)
    ms = {key: 1000 * statistics.median(v) / loops for key, v in times.items()}
    best = {key: 1000 * min(v) / loops for key, v in times.items()}
    columns = list(variants)
    extra = ["kernel / xla w @ x"] if kernel else []
    print("(each cell: median / fastest call)\n")
    print(tables.head(["T", *columns, *extra]))
    for t in ts:
        ratio = [f"{ms[('kernel', t)] / ms[('xla w @ x', t)]:.2f}"] if kernel else []
        print(tables.row([t, *(f"{ms[(c, t)]:.2f} / {best[(c, t)]:.2f}" for c in columns), *ratio]), flush=True)
    print(f"\n{load()}\n")


# ---- 2. c(T) of the whole model -------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("graphdef", "num_forwards"), donate_argnames=("cache",))
def _forwards(graphdef, params, tokens, positions, cache, *, num_forwards: int):
    """`num_forwards` forwards as a verify step runs them (T new tokens per row, K/V written at each row's length,
    logits at every new token), in one jitted loop; the cache's lengths do not advance."""
    model = nnx.merge(graphdef, params)

    def body(_, carry):
        cache, acc = carry
        out, cache = model(tokens, positions, cache)
        return cache, acc + jnp.max(out.logits)  # every logit is used, as verification uses them

    return jax.lax.fori_loop(0, num_forwards, body, (cache, jnp.zeros((), jnp.float32)))


def with_matmul(lm, impl: str):
    """The graphdef of `lm` with every projection set to `impl` (a separate static jit argument per path)."""
    module = nnx.merge(lm.graphdef, lm.params)
    set_matmul(module, impl)
    return nnx.split(module)[0]


def cost_curves(lm, batch: int, ts: list[int], impls: list[str], args) -> dict[tuple[str, int], float]:
    """ms per forward for every (impl, T), measured side by side."""
    graphdefs = {impl: with_matmul(lm, impl) for impl in impls}
    carries = {impl: {"cache": lm.module.new_cache(batch, args.cache_len).replace(
        lengths=jnp.full((batch,), args.context, jnp.int32))} for impl in impls}

    def call(impl: str, t: int):
        rng = np.random.default_rng(t)
        tokens = jnp.asarray(rng.integers(100, 40000, (batch, t)), jnp.int32)
        positions = args.context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        carry = carries[impl]  # one cache per path threads through its calls (each donates it)

        def run():
            carry["cache"], acc = _forwards(graphdefs[impl], lm.params, tokens, positions, carry["cache"],
                                            num_forwards=args.forwards)
            acc.block_until_ready()

        return run

    runs = {(impl, t): timer(call(impl, t)) for impl in impls for t in ts}
    times = interleave(runs, args.repeats, alternate=True)  # the warm-up call compiles each configuration
    return {key: 1000 * statistics.median(v) / args.forwards for key, v in times.items()}


def model_table(lm, batch: int, ts: list[int], impls: list[str], args) -> None:
    ts = sorted(set(ts) | {1})
    print(f"## c(T) at batch {batch}: forward over T new tokens per row / one-token forward ({args.cache_len}-slot "
          f"cache, {args.context} tokens cached; median of {args.repeats} interleaved rounds of {args.forwards} "
          f"forwards)\n")
    ms = cost_curves(lm, batch, ts, impls, args)
    columns = ["T", "rows"]
    for impl in impls:
        columns += [f"{impl} ms", f"{impl} c(T)"] + ([f"{impl} vs xla T=1"] if impl != "xla" and "xla" in impls
                                                     else [])
    print(tables.head(columns))
    for t in ts:
        cells = [t, batch * t]
        for impl in impls:
            cells += [f"{ms[(impl, t)]:.1f}", f"{ms[(impl, t)] / ms[(impl, 1)]:.2f}"]
            if impl != "xla" and "xla" in impls:
                cells.append(f"{ms[(impl, t)] / ms[('xla', 1)]:.2f}")
        print(tables.row(cells), flush=True)
    print(f"\n{load()}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_kernel.py verify-cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-ts", type=ints, default=ints("1,2,4,8,16,32"),
                        help="columns T of the microbenchmark (default: 1,2,4,8,16,32)")
    parser.add_argument("--micro-repeats", type=int, default=30, help="(default: %(default)s)")
    parser.add_argument("--micro-loops", type=int, default=5, help="passes per timed call (default: %(default)s)")
    parser.add_argument("--batch1-ts", type=ints,
                        default=ints("1,2,3,4,5,6,7,8,9,12,16,17,24,32,33"),
                        help="T at batch 1 (default: 1-9,12,16,17,24,32,33)")
    parser.add_argument("--batch8-ts", type=ints, default=ints("1,5,9,17"),
                        help="T at batch 8 (default: 1,5,9,17; empty: skip)")
    parser.add_argument("--impls", default="xla,auto",
                        help="matmul paths compared in c(T): xla, auto, ffi (default: %(default)s)")
    parser.add_argument("--cache-len", type=int, default=1024, help="(default: %(default)s)")
    parser.add_argument("--context", type=int, default=384, help="tokens already cached (default: %(default)s)")
    parser.add_argument("--forwards", type=int, default=4, help="forwards per timed call (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    page.add_option(parser, "kernel-verify-cost")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    for impl in impls:
        if impl not in cpu_kernels.IMPLS:
            parser.error(f"--impls: {impl!r} is not one of {cpu_kernels.IMPLS}")
    jaxspec.enable_compilation_cache()

    with page.Tee() as printed:
        run(args, impls)
    if args.write_page:
        page.write(args.write_page, printed.text, machine.info())
    return 0


def run(args, impls: list[str]) -> None:
    kernel = cpu_kernels.available()
    print(f"# Verify cost, XLA matmul vs the CPU matmul kernel: {machine.line(machine.info())}")
    if kernel:
        columns = cpu_kernels.AUTO_COLUMNS.get(cpu_kernels.isa())
        taken = f"{columns.start}-{columns.stop - 1} columns" if columns else "no products"
        print(f"kernel: available, {cpu_kernels.isa()} path; auto takes it for {taken}\n")
    else:
        print(f"kernel: {cpu_kernels.unavailable_reason()}\n")
    if not kernel and any(i != "xla" for i in impls):
        print("(without the kernel, auto is XLA and ffi cannot run: comparing xla alone)\n")
        impls = ["xla"]
    if not args.skip_micro:
        micro(args.micro_ts, args.micro_repeats, args.micro_loops, kernel)
    if not args.skip_model:
        lm = jaxspec.load_model("smollm2-135m")
        for batch, ts in ((1, args.batch1_ts), (8, args.batch8_ts)):
            if ts:
                model_table(lm, batch, ts, impls, args)
