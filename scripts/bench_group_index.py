#!/usr/bin/env python
"""What the lookup indexes cost a decode step: sam's per-row match-length array against its suffix automaton,
and group_sam's group texts against its group automaton. No model is loaded.

Each step drafts K tokens for every row and appends the tokens a step commits, as the decode loop does; S
steps run in one jitted `fori_loop` and the figure is ms per step, the median of --repeats timings. Texts are
strung from a few dozen random 12-token phrases, so suffixes recur and drafts find matches.

* sam: B rows, each its own text of capacity T (--sam-text), built from a prompt of --sam-prompt tokens;
  appends of --sam-append tokens a step.
* group_sam: P groups of G samples (--groups, --samples), prompts bucketed to --prompt-width tokens and
  buffers of --buffer tokens (T = their sum), each sample already 200 tokens in; B rows of them (all, or a
  random subset: a rollout's tail), appends of 2 tokens a step; the texts index at each --max-match.

    python scripts/bench_group_index.py                        # both, B = 128, 32, 8 for groups; ~2 min
    python scripts/bench_group_index.py --only group --max-match 16,32
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchkit import machine, output, tables
from benchkit.cli import ints
from jaxspec.proposers import group_automaton, group_match, suffix_automaton, suffix_match

OPTIONS = (  # flag, type, default, help
    ("--sam-batches", ints, [1, 8, 32], "sam rows"),
    ("--sam-text", int, 2048, "sam's text capacity T"),
    ("--sam-prompt", int, 1000, "sam's prompt tokens"),
    ("--sam-append", ints, [7, 15], "tokens a sam step appends"),
    ("--group-batches", ints, [128, 32, 8], "group_sam rows"),
    ("--groups", int, 16, "P prompts"),
    ("--samples", int, 8, "G samples per prompt"),
    ("--prompt-width", int, 512, "prompt bucket"),
    ("--buffer", int, 256, "output buffer"),
    ("--max-match", ints, [32], "the texts index's max_match"),
    ("--draft", int, 8, "K, tokens drafted a step"),
    ("--steps", int, 16, "S, steps per timed loop"),
    ("--repeats", int, 5, "timed loops"),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("sam", "group"), help="time one family (default: both)")
    for flag, kind, default, text in OPTIONS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    return p.parse_args(argv)


class Texts:
    """Random texts strung from 40 phrases of 12 tokens."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.phrases = self.rng.integers(0, 49152, (40, 12))

    def __call__(self, n: int) -> np.ndarray:
        picks = self.rng.integers(0, len(self.phrases), n // 12 + 1)
        return np.concatenate([self.phrases[i] for i in picks])[:n].astype(np.int32)

    def stack(self, rows: int, n: int) -> jax.Array:
        return jnp.asarray(np.stack([self(n) for _ in range(rows)]))


def per_step_ms(step, state, stream, repeats: int) -> float:
    """Median ms per step of `step(state, stream[i])` over the steps of `stream` (i32[S, ...]) in one loop."""

    @jax.jit
    def run(state, stream):
        def body(i, carry):
            state, acc = carry
            state, out = step(state, stream[i])
            return state, acc + out
        return jax.lax.fori_loop(0, stream.shape[0], body, (state, jnp.int32(0)))

    jax.block_until_ready(run(state, stream))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(state, stream))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / stream.shape[0] * 1e3


def sam_rows(args, texts: Texts) -> list[tuple]:
    rows = []
    t, k = args.sam_text, args.draft
    for batch in args.sam_batches:
        history = texts.stack(batch, args.sam_prompt)
        length = jnp.full((batch,), args.sam_prompt, jnp.int32)
        for m in args.sam_append:
            stream = texts.stack(batch, args.steps * m).reshape(batch, args.steps, m).transpose(1, 0, 2)
            cost, num = {}, jnp.full((batch,), m, jnp.int32)
            for name, build, draft, append in (
                    ("automaton", suffix_automaton.build_dynamic_batch, suffix_automaton.dynamic_draft_batch,
                     suffix_automaton.extend_many_batch),
                    ("match", suffix_match.build_batch, suffix_match.draft_batch, suffix_match.append_batch)):
                index = jax.jit(build, static_argnums=2)(history, length, t)

                def step(index, tokens, draft=draft, append=append, num=num):
                    drafted, match_len, _ = draft(index, k)
                    index = append(index, tokens, num)
                    return index, drafted.sum() + match_len.sum()

                cost[name] = per_step_ms(step, index, stream, args.repeats)
            rows.append(("sam", batch, m, f"T={t}", f"{cost['automaton']:.3f}", f"{cost['match']:.3f}"))
            print(tables.row(rows[-1]), flush=True)
    return rows


def group_rows(args, texts: Texts) -> list[tuple]:
    rows = []
    p, g, k = args.groups, args.samples, args.draft
    width = args.prompt_width + args.buffer
    prefix = texts.stack(p, args.prompt_width)
    prefix_len = jnp.full((p,), min(300, args.prompt_width), jnp.int32)
    written = texts.stack(p * g, 200)
    every_group = jnp.repeat(jnp.arange(p, dtype=jnp.int32), g)
    every_string = jnp.tile(jnp.arange(g, dtype=jnp.int32), p)
    rng = np.random.default_rng(1)
    for batch in args.group_batches:
        held = np.arange(p * g) if batch >= p * g else np.sort(rng.choice(p * g, batch, replace=False))
        group, string = jnp.asarray(held // g, jnp.int32), jnp.asarray(held % g, jnp.int32)
        stream = texts.stack(len(held), args.steps * 2).reshape(len(held), args.steps, 2).transpose(1, 0, 2)
        two = jnp.full((len(held),), 2, jnp.int32)
        cost = {}
        for name, lib, index, kws in (
                ("automaton", group_automaton, group_automaton.GroupAutomaton.create(p, g, width), [{}]),
                ("texts", group_match, group_match.GroupMatch.create(p, g, width),
                 [{"max_match": c} for c in args.max_match])):
            index = jax.jit(lib.start)(index, prefix, prefix_len)
            index = jax.jit(lib.extend_rows)(index, every_group, every_string, written,
                                             jnp.full((p * g,), 200, jnp.int32))
            for kw in kws:
                def step(index, tokens, lib=lib, kw=kw, rows=(group, string), num=two):
                    drafted, match_len, _ = lib.draft_rows(index, *rows, k, **kw)
                    return lib.extend_rows(index, *rows, tokens, num), drafted.sum() + match_len.sum()

                cost[name + "".join(f" {v}" for v in kw.values())] = per_step_ms(step, index, stream, args.repeats)
        texts_cols = [f"{cost[f'texts {c}']:.3f}" for c in args.max_match]
        rows.append(("group_sam", len(held), 2, f"{p}x{g}, T={width}", f"{cost['automaton']:.3f}",
                     " / ".join(texts_cols)))
        print(tables.row(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    info = machine.info()
    texts = Texts()
    print(machine.line(info), flush=True)
    print(tables.head(("family", "rows", "appended", "texts", "automaton ms/step",
                       f"array/texts ms/step (max_match {'/'.join(map(str, args.max_match))} for groups)")))
    rows = []
    if args.only in (None, "sam"):
        rows += sam_rows(args, texts)
    if args.only in (None, "group"):
        rows += group_rows(args, texts)
    report = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    output.write(args.out, "bench_group_index", report, tables.markdown(
        ("family", "rows", "appended", "texts", "automaton ms/step", "array/texts ms/step"), rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
