"""`bench_kernel.py moe`: one mixture-of-experts layer's MLP (`jaxspec.models.llama.MoE`), run three exact ways, side by
side, at the token counts a decode step, a verify step and a prefill chunk hand it.

- gathered: each token gathers its k experts' weights (`MoE.gathered`); it reads k experts per token, and its
  gathered weights grow as N * k experts, so it is timed only where N * k <= 2 E;
- dense: every expert runs on every token, combined by the routing weights (`MoE.dense`);
- ragged: tokens sorted by expert, `jax.lax.ragged_dot` over the groups (the grouped matmul that megablox and
  grouped-GEMM kernels implement on accelerators), unsorted and combined.

`MoE.__call__` takes gathered while 3 N k <= E and dense above; the "chosen" column names it. The shapes default to
one layer of Qwen3-30B-A3B (D 2048, 128 experts of 768 hidden units, 8 a token). Each figure is the median of
`--repeats` rounds in which the ways take turns; the outputs are checked against dense's first.

    python scripts/bench_kernel.py moe --tokens 1,8,64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchkit import machine, page, tables
from benchkit.cli import ints


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_kernel.py moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=ints, default=[1, 8, 64], help="N, tokens per call")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--per-token", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=768)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write-page", nargs="?", const="moe", default=None, help="write this block of the page")
    return p.parse_args(argv)


def _ragged(moe, rows, weights, experts):
    """The MoE by a sorted dispatch: token-expert pairs grouped by expert, two ragged products, scattered back."""
    import jax
    import jax.numpy as jnp

    n, k = experts.shape
    flat = experts.reshape(-1)  # [N k]
    order = jnp.argsort(flat)
    sizes = jnp.bincount(flat, length=moe.router.shape[0]).astype(jnp.int32)  # [E]
    pairs = jnp.repeat(rows, k, axis=0)[order]  # [N k, D], grouped by expert
    gate_up = jnp.swapaxes(moe.expert_gate_up[...], 1, 2)  # [E, D, 2F]
    h = moe._gated(jax.lax.ragged_dot(pairs, gate_up, sizes))  # [N k, F]
    out = jax.lax.ragged_dot(h, jnp.swapaxes(moe.expert_down[...], 1, 2), sizes)  # [N k, D]
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype))


def main(argv) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxspec.models.config import ModelConfig
    from jaxspec.models.llama import MoE

    args = parse_args(argv)
    info = machine.info()
    cfg = ModelConfig(vocab_size=8, hidden_size=args.hidden, intermediate_size=args.expert_width, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=2, num_experts=args.experts,
                      experts_per_token=args.per_token, dtype=args.dtype)
    moe = MoE(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(moe)
    ways = {"gathered": MoE.gathered, "dense": MoE.dense, "ragged": _ragged}

    def program(way):
        def run(params, rows):
            module = nnx.merge(graphdef, params)
            weights, experts = module.route(rows)
            return ways[way](module, rows, weights, experts)
        return jax.jit(run)

    title = (f"D {args.hidden}, {args.experts} experts of {args.expert_width}, {args.per_token} a token, {args.dtype}; "
             f"ms per call, median of {args.repeats} interleaved rounds")
    print(f"# one MoE layer's MLP: {machine.line(info)}\n# {title}")
    columns = ["N tokens", "gathered ms", "dense ms", "ragged ms", "chosen", "chosen vs best other"]
    print(tables.head(columns), flush=True)
    rows_out, report = [], []
    for n in args.tokens:
        x = jax.random.normal(jax.random.key(n), (n, args.hidden), jnp.float32).astype(cfg.jnp_dtype)
        chosen = "gathered" if 3 * n * args.per_token <= args.experts else "dense"
        names = [w for w in ways if w != "gathered" or n * args.per_token <= 2 * args.experts]
        programs = {w: program(w) for w in names}
        want = np.asarray(programs["dense"](params, x), np.float32)
        for w in names:  # compile and check
            got = np.asarray(programs[w](params, x), np.float32)
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))
        times = {w: [] for w in names}
        for _ in range(args.repeats):
            for w in names:
                start = time.perf_counter()
                programs[w](params, x).block_until_ready()
                times[w].append(1e3 * (time.perf_counter() - start))
        ms = {w: statistics.median(t) for w, t in times.items()}
        best_other = min(v for w, v in ms.items() if w != chosen)
        row = [n] + [tables.fmt(ms.get(w), ".1f") for w in ways] + [chosen, f"{best_other / ms[chosen]:.2f}x"]
        rows_out.append(row)
        report.append({"tokens": n, "ms": ms, "chosen": chosen})
        print(tables.row(row), flush=True)
    if args.write_page:
        page.write(args.write_page, f"{title}\n\n" + tables.markdown(columns, rows_out), info, report)
    return 0
