#!/usr/bin/env python
"""What drawing and judging tokens cost: jaxspec's sampler and verification against JAX's own forms.

Every token jaxspec samples goes through `jaxspec.sampling.categorical` (an inverse transform in two levels:
a block of the vocabulary, then a token within it), and every greedy one through `jaxspec.sampling.argmax`.
This times both beside `jax.random.categorical` (Gumbel-max: a threefry draw and two logarithms per token)
and `jnp.argmax`, then `jaxspec.rejection_sample` greedy and sampled (deterministic drafts, as sam and ngram
verify), over logits [B, W, V]: B rows, W positions each (W = 1 is a plain decode step's draw, W = K + 1 the
verification of K drafts), V the default model's vocabulary (49152) unless --vocab says otherwise. No model
is loaded: the logits are random, which costs the same as real ones.

Each figure is ms per call: the median of --repeats timings of one jitted `fori_loop` of --calls calls,
divided by --calls, as the decode loop runs them (timed call by call, the same work cost up to 2.5x more, and
more the larger a conditional's untaken branches), the forms of one shape taking turns in every round.
"rejection top-p 0.9" shows what a request with top-p pays: the processed distribution sorts the vocabulary.
A check before timing: Gumbel and inverse-transform draws both follow softmax over a small support, and the two
argmax forms agree.

    python scripts/bench_sampling.py                          # B 1,8 x W 1,9,17: ~8 min on 2 cores
    python scripts/bench_sampling.py --batches 8 --widths 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from benchkit import machine, output, tables
from benchkit.cli import ints
from benchkit.timing import interleave, timer
from jaxspec import SamplingParams
from jaxspec.sampling import argmax, categorical


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 8], help="B (default: %(default)s)")
    p.add_argument("--widths", type=ints, default=[1, 9, 17], help="W, positions per row (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=49152, help="V (default: %(default)s, SmolLM2's)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled forms (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default: %(default)s)")
    p.add_argument("--calls", type=int, default=5, help="calls per timed loop (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench_out/bench_sampling.json"))
    return p.parse_args(argv)


def gumbel_categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """`jax.random.categorical` row by row: what jaxspec drew with before the inverse transform."""
    flat = jax.vmap(jax.random.categorical)(keys.reshape(-1), logits.reshape(-1, logits.shape[-1]))
    return flat.reshape(logits.shape[:-1]).astype(jnp.int32)


def check(vocab: int) -> None:
    """Both samplers follow softmax over a 6-token support spread over the vocabulary (TV < 0.02 from 20k draws),
    and both argmax forms agree on random rows; else AssertionError."""
    support = np.linspace(0, vocab - 1, 6).astype(int)
    logits = np.full(vocab, -np.inf, np.float32)
    logits[support] = np.arange(6, dtype=np.float32) * 0.4
    target = np.exp(logits[support] - logits[support].max())
    target /= target.sum()
    row = jnp.asarray(logits)[None]  # f32[1, V]
    keys = jax.random.split(jax.random.key(1), 20000)
    for draw in (categorical, gumbel_categorical):
        # 1000 rows of the vocabulary at a time: 20k at once would need several 4 GB temporaries.
        tokens = jax.jit(lambda keys, draw=draw: jax.lax.map(lambda key: draw(key[None], row)[0], keys,
                                                             batch_size=1000))(keys)
        counts = np.bincount(np.asarray(tokens), minlength=vocab)
        tv = 0.5 * np.abs(counts[support] / counts.sum() - target).sum()
        assert counts[support].sum() == counts.sum() and tv < 0.02, (draw.__name__, tv)
    z = jax.random.normal(jax.random.key(2), (4, 3, vocab))
    assert np.array_equal(jax.jit(argmax)(z), jnp.argmax(z, axis=-1))


def looped(fn, calls: int):
    """A jitted function of logits running `fn(logits, i)` for i in range(calls) in one `fori_loop`, as the
    decode loop runs a step's sampling. Each call gets logits nudged by i and keys that depend on i, so XLA
    cannot hoist any of the work (random numbers included) out of the loop."""
    def run(logits):
        def body(i, acc):
            out = fn(logits + i.astype(logits.dtype) * 1e-30, i)
            return acc + jnp.sum(out[0] if isinstance(out, tuple) else out)
        return jax.lax.fori_loop(0, calls, body, jnp.int32(0))
    return jax.jit(run)


def forms(batch: int, width: int, vocab: int, temperature: float, calls: int) -> dict:
    """name -> a timed call (seconds per sampling call) of each form over logits f32[batch, width, vocab]."""
    logits = 4.0 * jax.random.normal(jax.random.key(width), (batch, width, vocab), jnp.float32)
    keys = jax.random.split(jax.random.key(0), (batch, width))
    seeds = jax.vmap(jax.random.key)(jnp.arange(batch, dtype=jnp.uint32))
    drafts = jnp.zeros((batch, width - 1), jnp.int32)
    num_draft = jnp.full((batch,), width - 1, jnp.int32)
    positions = jnp.zeros((batch,), jnp.int32)

    def rejection(sampling):
        return lambda z, i: jaxspec.rejection_sample(seeds, z, drafts, None, num_draft, sampling.broadcast(batch),
                                                     positions=positions + width * i)

    def at(i):  # key[B, W] for call i
        return jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(0, None)), in_axes=(0, None))(keys, i)

    fns = {
        "categorical": lambda z, i: categorical(at(i), z),
        "jax.random.categorical": lambda z, i: gumbel_categorical(at(i), z),
        "argmax": lambda z, i: argmax(z),
        "jnp.argmax": lambda z, i: jnp.argmax(z, axis=-1),
        "rejection greedy": rejection(SamplingParams(temperature=0.0)),
        "rejection sampled": rejection(SamplingParams(temperature=temperature)),
        "rejection top-p 0.9": rejection(SamplingParams(temperature=temperature, top_p=0.9)),
        # Logits of unit spread: the top-p set holds tens of thousands of tokens, past the 256 candidates.
        "rejection top-p 0.95 flat": lambda z, i: rejection(SamplingParams(temperature=1.0, top_p=0.95))(z / 4, i),
    }
    timed = {}
    for name, fn in fns.items():
        run = looped(fn, calls)
        timed[name] = timer(lambda run=run: jax.block_until_ready(run(logits)))
    return timed


def main(argv=None) -> int:
    args = parse_args(argv)
    info = machine.info()
    print(f"# sampling and verification: {machine.line(info)}")
    check(args.vocab)
    print(f"# checked: both samplers follow softmax, both argmax forms agree. V {args.vocab}, sampled T "
          f"{args.temperature:g}; ms per call, median of {args.repeats}")
    names = list(forms(1, 1, 128, 1.0, 1))
    print(tables.head(["B", "W"] + names), flush=True)
    results = []
    for batch in args.batches:
        for width in args.widths:
            samples = interleave(forms(batch, width, args.vocab, args.temperature, args.calls), args.repeats,
                                 warmup=2, alternate=True)
            ms = {name: 1000 * statistics.median(s) / args.calls for name, s in samples.items()}
            results.append({"batch": batch, "width": width, "ms": ms})
            print(tables.row([batch, width] + [tables.fmt(ms[n]) for n in names]), flush=True)
    output.save_json(args.out, info, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
