#!/usr/bin/env python
"""Benchmark plain generation of the default model on this machine.

Reports prefill tokens/s for a 512-token prompt, decode tokens/s at several batch sizes, and decode time
as a multiple of the weight-bandwidth floor (bytes of weights read per step / measured bandwidth, both
measured here). With --peers, Hugging Face transformers on torch float32 runs the same HumanEval prompts
in the same process, and the report gives jaxspec / peer ratios and checks the greedy outputs agree.

    python scripts/bench.py                  # table on stdout, JSON in bench_out/bench.json
    python scripts/bench.py --peers          # needs: pip install -e ".[peers]"
    python scripts/bench.py --spec [ARGS]    # speculative decoding: runs scripts/bench_spec.py with ARGS
    python scripts/bench.py --heads [ARGS]   # trained heads (medusa, eagle, eagle2): scripts/bench_heads.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxspec
from benchkit import machine, page, peer_hf, tables, workloads
from benchkit.cli import ints
from benchkit.timing import repeat, timer
from jaxspec.models.loading import named_model_path


def measure_bandwidth(megabytes: int = 256, repeats: int = 15) -> float:
    """Bytes/s of a matrix-vector product over a large f32 matrix: what a decode step's weight reads can get."""
    cols = 32768
    rows = megabytes * 2**20 // (4 * cols)
    w = jnp.ones((rows, cols), jnp.float32) * 0.5
    v = jnp.ones((1, rows), jnp.float32)
    f = jax.jit(lambda v, w: v @ w)
    times = repeat(timer(lambda: f(v, w).block_until_ready()), repeats)
    return w.nbytes / statistics.median(times)


def weight_bytes_per_step(lm) -> int:
    """Every parameter is read once per decode step except the embedding table (one row per token)."""
    total = sum(x.nbytes for x in jax.tree.leaves(lm.params))
    return total - lm.module.embed[...].nbytes


def bench_prefill(lm, prompt_ids: list[int], repeats: int) -> dict:
    runs = repeat(lambda: jaxspec.generate(lm, [prompt_ids], max_new_tokens=1), repeats)
    seconds = statistics.median(r.stats.prefill_s for r in runs)
    return {"prompt_tokens": len(prompt_ids), "seconds": seconds, "tokens_per_s": len(prompt_ids) / seconds}


def bench_decode(lm, prompts: list[list[int]], batch: int, new_tokens: int, repeats: int) -> dict:
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    runs = repeat(lambda: jaxspec.generate(lm, rows, max_new_tokens=new_tokens, ignore_eos=True), repeats)
    return {"batch": batch, "new_tokens": new_tokens, "steps": runs[0].stats.steps,
            "tokens_per_s": statistics.median(r.stats.decode_tokens_per_s for r in runs),
            "ms_per_step": 1000 * statistics.median(r.stats.decode_s / r.stats.steps for r in runs)}


def bench_peers(lm, prompts: list[list[int]], new_tokens: int, batches: list[int]) -> list[dict]:
    path = named_model_path(jaxspec.DEFAULT_MODEL)
    peer = peer_hf.load_peer(str(path.parent), path.name)
    rows = []
    for batch in batches:
        theirs = peer_hf.run_peer(peer, prompts, max_new_tokens=new_tokens, batch_size=batch)
        ours_outputs, seconds = [], 0.0
        jaxspec.generate(lm, prompts[:batch], max_new_tokens=new_tokens)  # compile
        for i in range(0, len(prompts), batch):
            r = jaxspec.generate(lm, prompts[i:i + batch], max_new_tokens=new_tokens)
            ours_outputs += r.token_ids
            seconds += r.stats.prefill_s + r.stats.decode_s
        ours_tps = sum(len(t) for t in ours_outputs) / seconds
        same = sum(a == b for a, b in zip(ours_outputs, theirs["outputs"]))
        rows.append({"batch": batch, "prompts": len(prompts), "new_tokens": new_tokens,
                     "jaxspec_tokens_per_s": ours_tps, "peer_tokens_per_s": theirs["tokens_per_s"],
                     "ratio": ours_tps / theirs["tokens_per_s"], "identical_outputs": f"{same}/{len(prompts)}"})
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--spec" in argv:  # before parsing: bench_spec shares flag names (--peers, --batches, ...) with this parser
        import bench_spec

        return bench_spec.main([a for a in argv if a != "--spec"])
    if "--heads" in argv:
        import bench_heads

        return bench_heads.main([a for a in argv if a != "--heads"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", action="store_true",
                        help="benchmark speculative decoding instead: the other arguments go to scripts/bench_spec.py")
    parser.add_argument("--heads", action="store_true",
                        help="benchmark the trained heads instead: the other arguments go to scripts/bench_heads.py")
    parser.add_argument("--batches", type=ints, default="1,8,32", help="decode batch sizes (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default: %(default)s)")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="prefill prompt length (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (default: %(default)s)")
    parser.add_argument("--peers", action="store_true", help="also run transformers on torch (the [peers] extra)")
    parser.add_argument("--peer-prompts", type=int, default=8,
                        help="HumanEval prompts for --peers (default: %(default)s)")
    parser.add_argument("--out", default="bench_out/bench.json", help="JSON output (default: %(default)s)")
    page.add_option(parser, "plain")
    args = parser.parse_args(argv)
    jaxspec.enable_compilation_cache()  # every figure is taken after a warm-up: a cached compile only shortens the run

    lm = jaxspec.load_model(jaxspec.DEFAULT_MODEL)
    prompts = workloads.free_form_prompts(lm.tokenizer)
    report = machine.info() | {"model": lm.name}

    bandwidth = measure_bandwidth()
    step_bytes = weight_bytes_per_step(lm)
    floor_ms = 1000 * step_bytes / bandwidth
    report["bandwidth_GBps"] = bandwidth / 1e9
    report["weight_MB_per_step"] = step_bytes / 1e6
    report["floor_ms_per_step"] = floor_ms

    long_prompt = [t for p in prompts for t in p][: args.prefill_tokens]
    report["prefill"] = bench_prefill(lm, long_prompt, args.repeats)
    report["decode"] = []
    for batch in args.batches:
        row = bench_decode(lm, prompts, batch, args.new_tokens, args.repeats)
        row["x_floor"] = row["ms_per_step"] / floor_ms
        report["decode"].append(row)
    if args.peers:
        report["peers"] = bench_peers(lm, prompts[: args.peer_prompts], args.new_tokens, [1, 8])

    lines = [f"# jaxspec plain generation, {report['model']}, {machine.line(report)}",
             f"\nweights read per decode step {report['weight_MB_per_step']:.0f} MB; matvec bandwidth "
             f"{report['bandwidth_GBps']:.1f} GB/s; floor {floor_ms:.1f} ms/step"]
    p = report["prefill"]
    lines.append(f"\nprefill: {p['prompt_tokens']} tokens in {p['seconds'] * 1000:.0f} ms = "
                 f"{p['tokens_per_s']:.0f} tokens/s")
    lines.append("\n" + tables.markdown(["batch", "decode tokens/s", "ms/step", "x floor"], [
        [r["batch"], f"{r['tokens_per_s']:.1f}", f"{r['ms_per_step']:.1f}", f"{r['x_floor']:.2f}"]
        for r in report["decode"]]))
    if args.peers:
        lines.append("\n" + tables.markdown(
            ["batch", "jaxspec tokens/s", "transformers tokens/s", "ratio", "identical greedy outputs"],
            [[r["batch"], f"{r['jaxspec_tokens_per_s']:.1f}", f"{r['peer_tokens_per_s']:.1f}", f"{r['ratio']:.2f}x",
              r["identical_outputs"]] for r in report["peers"]]))
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {args.out}")
    if args.write_page:
        page.write(args.write_page, text, report, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
