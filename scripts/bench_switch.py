#!/usr/bin/env python
"""What the loop's switch over verify widths costs when nobody drafts (default model).

A speculative loop compiles a `lax.switch` over its verify widths (sam: 1, 3, 5, 9, 17; predicted outputs: up to
33 or 65) so that a step with no drafts runs the one-token forward. That step should cost what a plain step
costs. Here a proposer with K = 32 that never drafts runs the jitted decode loop twice on the same prefilled
HumanEval rows: compiled with widths (1,) alone (the plain program) and with `--widths` (the speculative one),
interleaved over `--repeats` rounds; the median ms/step of each and their ratio are reported per batch size.

    python scripts/bench_switch.py                    # batch 1 and 8, widths 1,9,17,33
    python scripts/bench_switch.py --batches 8 --widths 1,9,17
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics

import jax
import jax.numpy as jnp

import jaxspec
from benchkit import machine, tables, workloads
from benchkit.cli import ints
from benchkit.timing import clocked, interleave
from jaxspec.decode import Draft, NoProposer, decode, prefill

K = 32


@dataclasses.dataclass(frozen=True)
class NeverDrafts(NoProposer):
    """K = 32 draft slots, never used: every step verifies at the narrowest width, 1."""

    num_speculative_tokens: int = K

    def propose(self, params, pstate, ctx, keys):
        batch = ctx.history.shape[0]
        return Draft(tokens=jnp.zeros((batch, K), jnp.int32), num_draft=jnp.zeros((batch,), jnp.int32)), pstate


def step_ms(lm, prepared, widths: tuple[int, ...]) -> float:
    """ms per step of one decode loop (prefill outside the clock)."""
    p = prepared
    state = prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.sampling, p.limits, None,
                    proposer=p.proposer, cache_len=p.cache_len, buffer_len=p.buffer_len)
    jax.block_until_ready(state.history)
    seconds, out = clocked(lambda: jax.block_until_ready(
        decode(lm.graphdef, lm.params, state, p.sampling, p.limits, proposer=p.proposer, widths=widths)))
    return seconds / int(out.steps) * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=ints, default="1,8", help="(default: %(default)s)")
    parser.add_argument("--widths", type=ints, default="1,9,17,33",
                        help="the speculative program's (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps timed (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (default: %(default)s)")
    args = parser.parse_args(argv)
    widths = tuple(sorted(args.widths))
    if widths[0] != 1 or widths[-1] > K + 1:
        parser.error(f"--widths {args.widths} must start at 1 and end at most at {K + 1}")
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))

    lm = jaxspec.load_model("smollm2-135m")
    texts = workloads.held_out_texts()
    print(f"# verify-width switch with no drafts: {machine.line(machine.info())}; {args.new_tokens} steps, "
          f"median of {args.repeats} interleaved rounds\n")
    print(tables.head(["batch", "widths (1,) ms/step", f"widths {widths} ms/step", "switch / plain"]))
    for batch in args.batches:
        # Sized for K = 32 drafts (cache and buffers), then the drafting proposer swapped for one that never does.
        prepared = jaxspec.prepare(lm, texts[:batch], max_new_tokens=args.new_tokens, ignore_eos=True,
                                   spec=jaxspec.SpecConfig(method="ngram", num_speculative_tokens=K))
        prepared = dataclasses.replace(prepared, proposer=NeverDrafts(), proposer_params=None)
        times = interleave({w: functools.partial(step_ms, lm, prepared, w) for w in ((1,), widths)}, args.repeats)
        plain, switch = statistics.median(times[(1,)]), statistics.median(times[widths])
        print(tables.row([batch, f"{plain:.1f}", f"{switch:.1f}", f"{switch / plain:.3f}"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
