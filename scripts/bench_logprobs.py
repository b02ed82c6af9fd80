#!/usr/bin/env python
"""What recording log-probabilities costs the decode loop (default model, HumanEval prompts).

Modes, timed side by side in one process, interleaved over repeats (ratios are to `off`):
- off: no buffers (generate without `logprobs`);
- idle: the buffers ride in the loop but no row asked (the serving engine's state when nobody asks);
- L=0, L=5, L=20: every row records its token's log-probability and the L most likely tokens.

    python scripts/bench_logprobs.py                      # batch 1 and 8, methods none and sam
    python scripts/bench_logprobs.py --batches 1 --methods sam --new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from benchkit import machine, tables, workloads
from benchkit.cli import ints
from benchkit.timing import clocked, interleave, ratios
from jaxspec.decode import RowLimits, decode, prefill
from jaxspec.methods import build_proposer
from jaxspec.shapes import bucket_shapes


def make_run(lm, prompts: list[list[int]], new_tokens: int, spec: jaxspec.SpecConfig, mode: str):
    """A callable that prefills and decodes once and returns (decode seconds, generated tokens)."""
    batch = len(prompts)
    lens = [len(p) for p in prompts]
    width, buffer_len, cache_len = bucket_shapes(lens, new_tokens)
    padded = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    sampling = jaxspec.SamplingParams().broadcast(batch)
    limits = RowLimits(max_new_tokens=jnp.full((batch,), new_tokens, jnp.int32),
                       stop_ids=jnp.full((batch, 1), -1, jnp.int32))  # no stops: every row makes new_tokens
    proposer, params = build_proposer(lm, spec, prompt_width=width, buffer_len=buffer_len, cache_len=cache_len)
    rows = None if mode == "off" else jnp.full((batch,), mode != "idle")
    top = int(mode[2:]) if mode.startswith("L=") else 0

    def run():
        prefilled = jax.block_until_ready(prefill(
            lm.graphdef, lm.params, jnp.asarray(padded), jnp.asarray(lens, jnp.int32), sampling, limits, params, rows,
            proposer=proposer, cache_len=cache_len, buffer_len=buffer_len, num_top_logprobs=top))
        seconds, state = clocked(lambda: jax.block_until_ready(decode(
            lm.graphdef, lm.params, prefilled, sampling, limits, params, proposer=proposer, widths=spec.verify_widths)))
        return seconds, int(jax.device_get(state.history_len - state.prompt_len).sum())

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default="1,8", help="batch sizes (default: %(default)s)")
    p.add_argument("--methods", default="none,sam", help="speculation methods (default: %(default)s)")
    p.add_argument("--modes", default="off,idle,L=0,L=5,L=20", help="what is recorded (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per row (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode, interleaved (default: %(default)s)")
    args = p.parse_args()

    lm = jaxspec.load_model("smollm2-135m")
    modes = args.modes.split(",")
    print(f"# cost of logprobs: {machine.line(machine.info())}; {args.new_tokens} tokens per row, median of "
          f"{args.repeats} interleaved rounds\n")
    print(tables.head(["method", "batch", *modes]))
    for method in args.methods.split(","):
        spec = jaxspec.SpecConfig(method=method)
        for batch in args.batches:
            prompts = workloads.free_form_prompts(lm.tokenizer, batch)
            runs = {m: make_run(lm, prompts, args.new_tokens, spec, m) for m in modes}
            samples = interleave(runs, args.repeats)  # the warm-up call compiles each mode
            rates = {m: [tokens / seconds for seconds, tokens in samples[m]] for m in modes}
            x_first = ratios(rates, modes[0])
            print(tables.row([method, batch, *(f"{statistics.median(rates[m]):.1f} tok/s ({x_first[m]:.3f}x)"
                                               for m in modes)]), flush=True)


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))
    main()
