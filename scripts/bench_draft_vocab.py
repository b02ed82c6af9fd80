#!/usr/bin/env python
"""Draft vocabularies (FR-Spec): what a head's drafting pass costs and what acceptance keeps, full vocabulary
against the first N tokens of the shipped ranking (`SpecConfig(draft_vocab=N)`), on the default model.

1. Drafting pass: the proposer's `propose` jitted alone (`jaxspec.decode.propose_once`, as the loop calls it)
   against one plain decode step (`spec_step` without a proposer, jitted), batch 1, both right after the prefill
   of a held-out HumanEval prompt. Every run takes turns in each round (benchkit.timing.interleave), and each is
   reported as its median over the rounds divided by the plain step's median of the same rounds.
2. Acceptance and speed: the held-out HumanEval prompts (never in the heads' training data), each alone, with
   each head at each N: mean acceptance length, and decode tokens/s against `none` measured in the same rounds
   (one head at a time: `none`, full, each N). Greedy outputs are checked against `none`'s (lossless).
3. Coverage: the share of plain decoding's greedy output tokens on those prompts whose id is among the first N
   ranked.

The machine may be shared: the load averages are recorded before and after parts 1 and 2.

    python scripts/bench_draft_vocab.py                          # ~50 min on 2 busy cores
    python scripts/bench_draft_vocab.py --parts drafting --repeats 100      # part 1 (and 3) only
    python scripts/bench_draft_vocab.py --sizes 4096 --limit 2 --new-tokens 32 --repeats 5 --rounds 1   # smoke

Outputs: bench_out/bench_draft_vocab.json and bench_out/bench_draft_vocab.md (the tables, also printed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys

import jax
import numpy as np

import jaxspec
from benchkit import machine, output, tables, workloads
from benchkit.acceptance import pooled_acceptance_length
from benchkit.cli import ints
from benchkit.timing import clocked, interleave, timer
from jaxspec import SamplingParams, SpecConfig
from jaxspec.decode import propose_once
from jaxspec.models.heads import WEIGHTS_DIR, load_draft_vocab

# label -> (SpecConfig settings, temperature): the methods' defaults (draft_vocab aside), the chain sampled too
# (its q is scattered back to the full vocabulary). `medusa` must stay greedy: coverage reads its `none` outputs.
HEADS = {
    "medusa": (dict(method="medusa"), 0.0),
    "eagle": (dict(method="eagle"), 0.0),
    "eagle T=0.8": (dict(method="eagle"), 0.8),
    "eagle2": (dict(method="eagle2"), 0.0),
}


def _load() -> tuple[float, float, float]:
    return os.getloadavg()


@functools.partial(jax.jit, static_argnames=("proposer",))
def _propose(proposer, params, state, sampling, limits):
    return propose_once(proposer, params, state, sampling, limits)


@functools.partial(jax.jit, static_argnames=("graphdef", "proposer", "widths"))
def _plain_step(graphdef, params, state, sampling, limits, proposer_params, *, proposer, widths):
    from flax import nnx

    return jaxspec.spec_step(nnx.merge(graphdef, params), proposer, proposer_params, state, sampling, limits, widths)


def _prefilled(lm, prompt, spec, temperature, new_tokens):
    """(Prepared, the state after prefill) of one prompt at batch 1."""
    p = jaxspec.prepare(lm, [prompt], max_new_tokens=new_tokens, spec=spec,
                        sampling=SamplingParams(temperature=temperature, seed=1))
    state = jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.sampling, p.limits,
                            p.proposer_params, proposer=p.proposer, cache_len=p.cache_len, buffer_len=p.buffer_len)
    return p, state


def spec_of(settings: dict, n: int | None, vocab: int) -> SpecConfig:
    """The head's default settings with draft vocabulary n (None: the full vocabulary)."""
    return SpecConfig(**settings, draft_vocab=vocab if n is None else n)


def drafting_costs(lm, prompt, sizes, repeats: int, new_tokens: int) -> dict:
    """ms of a drafting pass per head and N, and of a plain step, interleaved; ratios to the plain step."""
    vocab = lm.config.vocab_size
    p, state = _prefilled(lm, prompt, None, 0.0, new_tokens)
    runs = {"plain step": timer(lambda p=p, state=state: jax.block_until_ready(_plain_step(
        lm.graphdef, lm.params, state, p.sampling, p.limits, p.proposer_params, proposer=p.proposer,
        widths=p.widths)))}
    for label, (settings, temperature) in HEADS.items():
        for n in [None, *sizes]:
            p, state = _prefilled(lm, prompt, spec_of(settings, n, vocab), temperature, new_tokens)
            runs[f"{label} N={n or 'full'}"] = timer(lambda p=p, state=state: jax.block_until_ready(_propose(
                p.proposer, p.proposer_params, state, p.sampling, p.limits)))
    before = _load()
    samples = interleave(runs, repeats, warmup=2, alternate=True)
    base = statistics.median(samples["plain step"])
    return {"load_before": before, "load_after": _load(), "repeats": repeats,
            "runs": {name: {"median_ms": 1000 * statistics.median(s), "min_ms": 1000 * min(s),
                            "x_plain_step": statistics.median(s) / base} for name, s in samples.items()}}


def _generate_all(lm, prompts, spec, temperature, new_tokens):
    """Each prompt alone: (decode seconds, generated tokens after the first, stats, outputs)."""
    results = [jaxspec.generate(lm, [q], max_new_tokens=new_tokens, spec=spec,
                                sampling=SamplingParams(temperature=temperature, seed=i))
               for i, q in enumerate(prompts)]
    stats = [r.stats for r in results]
    return (sum(s.decode_s for s in stats), sum(s.generated_tokens - 1 for s in stats), stats,
            [r.token_ids[0] for r in results])


def _release_programs() -> None:
    """Drop every compiled program: XLA:CPU maps memory regions per kernel of each live executable, and a few
    dozen decode loops exceed Linux's vm.max_map_count (tests/conftest.py tells the story)."""
    jax.clear_caches()
    gc.collect()


def acceptance(lm, prompts, sizes, rounds: int, new_tokens: int) -> dict:
    """Per head: `none`, the head over the full vocabulary and over each N, interleaved in `rounds` rounds: mean
    acceptance length, and decode tokens/s over `none`'s in the same rounds. One head at a time, so only its
    programs are alive."""
    vocab = lm.config.vocab_size
    by_head = {}
    for label, (settings, temperature) in HEADS.items():
        specs = {"none": None} | {f"N={n or 'full'}": spec_of(settings, n, vocab) for n in [None, *sizes]}
        runs = {name: functools.partial(clocked, functools.partial(_generate_all, lm, prompts, spec, temperature,
                                                                    new_tokens))
                for name, spec in specs.items()}
        before = _load()
        samples = interleave(runs, rounds, warmup=1, alternate=True)
        rows = {}
        for name, results in samples.items():
            _, (_, _, stats, outputs) = results[0]
            speed = statistics.median(tokens / decode_s for _, (decode_s, tokens, _, _) in results)
            rows[name] = {"mean_acceptance_length": pooled_acceptance_length(stats), "tokens_per_s": speed,
                          "drafted": sum(s.drafted for s in stats), "accepted": sum(s.accepted for s in stats),
                          "outputs": outputs}
        for r in rows.values():
            r["x_none"] = r["tokens_per_s"] / rows["none"]["tokens_per_s"]
            if temperature == 0:
                r["same_as_none"] = r["outputs"] == rows["none"]["outputs"]
        by_head[label] = {"temperature": temperature, "load_before": before, "load_after": _load(),
                          "rounds": rounds, "runs": rows}
        print(f"{label}: " + ", ".join(f"{name} {r['mean_acceptance_length']:.2f} ({r['x_none']:.2f}x)"
                                       for name, r in rows.items()), flush=True)
        _release_programs()
    return by_head


def coverage(ranking: np.ndarray, outputs: list[list[int]], sizes) -> dict[str, float]:
    """{N: share of the output tokens among the first N ranked ids}."""
    tokens = np.asarray([t for out in outputs for t in out], np.int64)
    return {str(n): float(np.isin(tokens, ranking[:n]).mean()) for n in sizes}


def markdown(report: dict) -> str:
    lines = [f"{machine.line(report)}; prompts: {report['num_prompts']} held-out HumanEval, "
             f"{report['new_tokens']} new tokens, batch 1."]
    if "drafting" in report:
        d = report["drafting"]
        lines += ["", f"### Drafting pass vs a plain decode step ({d['repeats']} interleaved rounds; load average "
                      f"{d['load_before'][0]:.1f} before, {d['load_after'][0]:.1f} after)", "",
                  tables.head(["run", "median ms", "min ms", "x plain step"])]
        lines += [tables.row([name, f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['x_plain_step']:.3f}"])
                  for name, r in d["runs"].items()]
    for label, block in report.get("acceptance", {}).items():
        lines += ["", f"### {label}, temperature {block['temperature']} ({block['rounds']} interleaved rounds; load "
                      f"average {block['load_before'][0]:.1f} before, {block['load_after'][0]:.1f} after)", "",
                  tables.head(["run", "mean acceptance length", "accepted / drafted", "tokens/s", "x none",
                               "output == none"])]
        lines += [tables.row([name, f"{r['mean_acceptance_length']:.3f}", f"{r['accepted']} / {r['drafted']}",
                              f"{r['tokens_per_s']:.1f}", f"{r['x_none']:.2f}x", r.get("same_as_none", "")])
                  for name, r in block["runs"].items()]
    lines += ["", "### Coverage of plain decoding's greedy output tokens by the first N ranked ids", "",
              tables.head(["N", "coverage"])]
    lines += [tables.row([n, f"{c:.4f}"]) for n, c in report["coverage"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=ints, default="2048,4096,8192,16384",
                        help="draft vocabularies N compared with the full one (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=8, help="held-out prompts (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=40,
                        help="interleaved rounds of the drafting-pass timing (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds of the generation runs (default: %(default)s)")
    parser.add_argument("--parts", default="drafting,acceptance",
                        help="which parts to run, comma-separated; coverage always runs (default: %(default)s)")
    parser.add_argument("--out-dir", default="bench_out", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    sizes = args.sizes
    if args.limit < 1 or args.new_tokens < 2 or args.repeats < 1 or args.rounds < 1:
        parser.error("--limit, --repeats and --rounds must be >= 1 and --new-tokens >= 2")
    parts = set(args.parts.split(","))
    if not parts <= {"drafting", "acceptance"}:
        parser.error(f"--parts={args.parts!r} takes drafting and/or acceptance")
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    lm = jaxspec.load_model(jaxspec.DEFAULT_MODEL)
    ranking = load_draft_vocab(WEIGHTS_DIR / f"{lm.name}.draft_vocab.json", lm.config.vocab_size)
    prompts = workloads.held_out_prompts(lm.tokenizer, args.limit)
    report = machine.info() | {"model": lm.name, "num_prompts": len(prompts), "new_tokens": args.new_tokens,
                               "sizes": sizes}
    plain = jaxspec.generate(lm, prompts, max_new_tokens=args.new_tokens)
    report["coverage"] = coverage(ranking, plain.token_ids, sizes)
    if "drafting" in parts:
        report["drafting"] = drafting_costs(lm, prompts[0], sizes, args.repeats, args.new_tokens)
        print(json.dumps(report["drafting"], indent=1), flush=True)
        _release_programs()
    if "acceptance" in parts:
        report["acceptance"] = acceptance(lm, prompts, sizes, args.rounds, args.new_tokens)
    output.write(args.out_dir, "bench_draft_vocab", report, markdown(report))
    return output.exit_status([name for block in report.get("acceptance", {}).values()
                               for name, r in block["runs"].items() if r.get("same_as_none") is False])


if __name__ == "__main__":
    sys.exit(main())
