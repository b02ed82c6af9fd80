#!/usr/bin/env python
"""What a plain decode step costs against the cache size and the tokens the rows hold (default model).

A step must cost what the rows hold, not what the cache could hold: at a 2048-slot cache with 300 tokens used,
a batch-1 step should cost about what it costs at a 256-slot cache. Each configuration (prompt tokens P, cache
slots S) prefills HumanEval text to P tokens and times the jitted decode loop over `--new-tokens` steps
(EOS ignored); the configurations run interleaved over `--repeats` rounds and the median ms/step is reported,
with each one's ratio to the first configuration.

    python scripts/bench_context.py                                   # batch 1 and 8
    python scripts/bench_context.py --configs 200:256,300:2048 --batches 1
    python scripts/bench_context.py --read-micro 32    # attention alone: a cache prefix against a whole cache

`--read-micro B` times the attention of one new token per row over the default model's 30 layers (separate
per-layer K/V arrays, as the model holds them) at batch B, reading the whole cache or a prefix of it, for the
(cache slots, slots read) pairs of `--read-pairs`: what a read bucket costs, and what slicing a prefix adds.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from benchkit import machine, tables, workloads
from benchkit.cli import ints
from benchkit.timing import clocked, interleave, ratios, timer
from jaxspec.decode import RowLimits, decode, prefill

DEFAULT_CONFIGS = "200:256,300:512,300:1024,300:2048,1000:2048,1800:2048"


def step_ms(lm, tokens: list[int], prompt_len: int, cache_len: int, batch: int, new_tokens: int) -> float:
    """ms per decode-loop step of one prefill + decode (the decode loop alone is timed)."""
    width = 1 << (prompt_len - 1).bit_length()
    prompts = np.zeros((batch, width), np.int32)
    prompts[:, :prompt_len] = tokens[:prompt_len]
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    sampling = jaxspec.SamplingParams().broadcast(batch)
    limits = RowLimits(max_new_tokens=jnp.full((batch,), new_tokens, jnp.int32),
                       stop_ids=jnp.full((batch, 1), -1, jnp.int32))
    buffer = 1 << (new_tokens - 1).bit_length()
    prefilled = prefill(lm.graphdef, lm.params, jnp.asarray(prompts), lens, sampling, limits, cache_len=cache_len,
                        buffer_len=buffer)
    jax.block_until_ready(prefilled.history)
    seconds, state = clocked(lambda: jax.block_until_ready(decode(lm.graphdef, lm.params, prefilled, sampling,
                                                                  limits)))
    return seconds / int(state.steps) * 1000


def read_micro(lm, batch: int, pairs: list[tuple[int, int]], repeats: int) -> None:
    """ms of 30 layers' attention for one new token per row, reading `read` of `slots` cache slots."""
    from jaxspec.models.llama import _xla_attention

    cfg = lm.config
    hd, kv = cfg.head_dim, cfg.num_kv_heads
    q = jnp.ones((batch, 1, cfg.num_heads, hd), jnp.float32)
    rng = np.random.default_rng(0)

    def layers(q, ks, vs, read):
        out = jnp.zeros_like(q)
        for k, v in zip(ks, vs):
            visible = jnp.ones((batch, 1, read), bool)
            out = out + _xla_attention(q + out, k[:, :, :read], v[:, :, :read], visible, cfg)
        return out

    fn = jax.jit(layers, static_argnums=3)
    calls = {}
    for slots, read in pairs:
        ks = [jnp.asarray(rng.standard_normal((batch, kv, slots, hd), np.float32)) for _ in range(cfg.num_layers)]
        vs = [x + 1 for x in ks]
        calls[(slots, read)] = timer(lambda ks=ks, vs=vs, read=read: jax.block_until_ready(fn(q, ks, vs, read)))
    times = interleave(calls, repeats)
    print(f"# attention read, batch {batch}, {cfg.num_layers} layers: {machine.line(machine.info())}; median of "
          f"{repeats} interleaved rounds\n")
    print(tables.head(["cache slots", "slots read", "ms"]))
    for slots, read in pairs:
        print(tables.row([slots, read, f"{statistics.median(times[(slots, read)]) * 1000:.1f}"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="prompt tokens:cache slots, comma-separated; the first is the baseline "
                             "(default: %(default)s)")
    parser.add_argument("--batches", type=ints, default="1,8", help="(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=48, help="decode steps timed (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--read-micro", type=int, metavar="BATCH",
                        help="time the attention read alone at this batch instead (see above)")
    parser.add_argument("--read-pairs", default="256:256,384:256,384:384,512:384,512:512",
                        help="cache slots:slots read, for --read-micro (default: %(default)s)")
    args = parser.parse_args(argv)
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))
    if args.read_micro:
        pairs = [tuple(int(x) for x in c.split(":")) for c in args.read_pairs.split(",")]
        read_micro(jaxspec.load_model("smollm2-135m"), args.read_micro, pairs, max(args.repeats, 9))
        return 0
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    for p, s in configs:
        if p + args.new_tokens + 1 > s:
            parser.error(f"config {p}:{s}: {p} prompt tokens + {args.new_tokens} new tokens do not fit {s} slots")

    lm = jaxspec.load_model("smollm2-135m")
    tokens = lm.tokenizer.encode("".join(workloads.free_form_texts()))
    print(f"# decode step vs cache size: {machine.line(machine.info())}; {args.new_tokens} steps, median of "
          f"{args.repeats} interleaved rounds\n")
    print(tables.head(["batch", "prompt tokens", "cache slots", "ms/step", "x first"]))
    for batch in args.batches:
        # Every configuration compiles (its warm-up call) before any is timed.
        times = interleave({(p, s): functools.partial(step_ms, lm, tokens, p, s, batch, args.new_tokens)
                            for p, s in configs}, args.repeats)
        x_first = ratios(times, configs[0])
        for p, s in configs:
            print(tables.row([batch, p, s, f"{statistics.median(times[(p, s)]):.1f}", f"{x_first[(p, s)]:.2f}"]),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
