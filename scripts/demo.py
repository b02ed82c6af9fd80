#!/usr/bin/env python
"""jaxspec in one run: the default model answers a few prompts plainly and speculatively, and the speedup.

    python scripts/demo.py                   # what `make demo` runs
    python scripts/demo.py --method ngram --max-new-tokens 64
    python scripts/demo.py --prompts scripts/demo_recheck.json   # six other prompts, written the same way
    python scripts/demo.py --prompts my_prompts.json             # your own: [{"name", "kind", "text"}, ...]

The prompts (PROMPTS below: four pieces of code to complete, two chat requests) were written for this demo.
None is in HumanEval, the standard library, any shipped artefact's sources (the draft corpus, the heads' and the
draft vocabulary's training data) or a benchmark workload, so the model has not written their answers before
and nothing here replays memorised text; tests/test_artefact_sources.py checks that. Expect a modest speedup:
lookup speculation (sam, ngram) gains where the answer repeats what is already in the text. scripts/demo_recheck.json
holds six more prompts written and checked the same way, so the mean speedup can be reproduced on text the demo
did not choose; `--prompts` takes any such file, yours included, to see what speculation gives on your own work.

Greedy decoding both ways; every prompt's text must be identical (exit status 1 if not). Each way first runs
untimed to compile, then each prompt is timed plainly and speculatively in turn, so the tokens/s compare decoding,
not compilation, under the same load.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import jaxspec
from benchkit import machine
from benchkit.timing import clocked
from jaxspec.methods import names
from jaxspec.shapes import bucket_shapes

# Methods that run from SpecConfig(method=...) alone (draft_model needs a second model, custom a proposer).
METHODS = names(kind="lookup") + ("self_draft",) + names(kind="head")

# (name, kind, text): "code" is completed as plain text, "chat" is the user's message in the model's chat template.
PROMPTS = (
    ("merge_intervals", "code",
     'def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n'
     '    """Merge overlapping closed intervals and return them sorted by their start.\n\n'
     '    >>> merge_intervals([(1, 3), (2, 6), (8, 10)])\n'
     '    [(1, 6), (8, 10)]\n'
     '    """\n'),
    ("parse_duration", "code",
     'def parse_duration(text: str) -> int:\n'
     '    """Convert a duration written like "1h30m", "45s" or "2h5m10s" into a number of seconds.\n\n'
     '    >>> parse_duration("1h30m")\n'
     '    5400\n'
     '    """\n'),
    ("LeastRecentCache", "code",
     'class LeastRecentCache:\n'
     '    """A cache of at most `capacity` items that evicts the least recently used key when full.\n\n'
     '    >>> cache = LeastRecentCache(2)\n'
     '    >>> cache.put("a", 1)\n'
     '    >>> cache.put("b", 2)\n'
     '    >>> cache.get("a")\n'
     '    1\n'
     '    >>> cache.put("c", 3)  # evicts "b", used less recently than "a"\n'
     '    >>> cache.get("b") is None\n'
     '    True\n'
     '    """\n\n'
     '    def __init__(self, capacity: int):\n'),
    ("csv_column_means", "code",
     'import csv\n\n\n'
     'def csv_column_means(path: str) -> dict[str, float]:\n'
     '    """Read a CSV file with a header row and return the mean of every column whose values are all numbers.\n\n'
     '    Columns with an empty or non-numeric cell are left out. The file is read once, row by row, so it may be\n'
     '    larger than memory.\n'
     '    """\n'),
    ("process_or_thread", "chat",
     "What is the difference between a process and a thread in an operating system? Explain it in a few "
     "sentences for a junior developer, then give one example where each is the better choice, and say what can "
     "go wrong when threads share memory."),
    ("meeting_email", "chat",
     "Write a short, friendly email to my team saying that Friday's planning meeting moves from 10 am to 3 pm in "
     "the same room, asking them to bring their estimates for the next sprint, and thanking them for last week's "
     "release."),
)


def read_prompts(path: str | Path) -> tuple[tuple[str, str, str], ...]:
    """(name, kind, text) prompts from a JSON file holding a list of {"name", "kind", "text"} objects, kind
    "code" or "chat". ValueError naming the file, the entry and the field when one is missing or wrong."""
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts {str(path)!r}: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--prompts {str(path)!r}: must hold a non-empty JSON list of prompts")
    prompts = []
    for i, entry in enumerate(entries):
        where = f"--prompts {str(path)!r}, entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be an object with name, kind and text, got {entry!r}")
        for field in ("name", "kind", "text"):
            if not isinstance(entry.get(field), str) or not entry[field]:
                raise ValueError(f"{where}: {field!r} must be a non-empty string, got {entry.get(field)!r}")
        if entry["kind"] not in ("code", "chat"):
            raise ValueError(f"{where}: kind {entry['kind']!r} must be 'code' or 'chat'")
        prompts.append((entry["name"], entry["kind"], entry["text"]))
    return tuple(prompts)


def prompt_texts(lm, prompts=PROMPTS) -> list[str]:
    """The prompts as the model reads them: code as is, chat requests rendered with its chat template."""
    if any(kind == "chat" for _, kind, _ in prompts) and (lm.tokenizer is None or lm.tokenizer.chat_template is None):
        raise ValueError(f"the demo's chat prompts need a tokenizer with a chat template; {lm.name!r} has none")
    return [text if kind == "code" else
            lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            for _, kind, text in prompts]


def warm_up(run, lm, prompts: list[str], max_new_tokens: int) -> float:
    """One untimed call per compiled shape the prompts need (prompts of other lengths may fall in other shape
    buckets; the demo's all fit one): the seconds those first calls took, compiling included."""
    first = {bucket_shapes([len(lm.tokenizer.encode(p))], max_new_tokens): p for p in prompts}
    return sum(clocked(lambda p=p: run([p]))[0] for p in first.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default: %(default)s)")
    parser.add_argument("--method", default="sam", choices=METHODS,
                        help="speculative method, with its default settings (default: %(default)s)")
    parser.add_argument("--prompts", metavar="FILE",
                        help='a JSON list of {"name", "kind": "code" or "chat", "text"} prompts to run instead of '
                             "the demo's own")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    try:
        chosen = PROMPTS if args.prompts is None else read_prompts(args.prompts)
    except ValueError as e:
        parser.error(str(e))

    jaxspec.enable_compilation_cache()  # a second demo skips most of the compiling
    load_s, lm = clocked(lambda: jaxspec.load_model(args.model))
    try:
        prompts = prompt_texts(lm, chosen)
    except ValueError as e:
        parser.error(str(e))
    print(f"# {machine.line(machine.info())}")
    which = ("prompts written for this demo (in no corpus, training set or benchmark)" if args.prompts is None
             else f"prompts from {args.prompts}")
    print(f"{args.model} loaded in {load_s:.1f} s; {len(prompts)} {which}, greedy, up to {args.max_new_tokens} "
          "new tokens each", flush=True)

    runs = {label: functools.partial(jaxspec.generate, lm, max_new_tokens=args.max_new_tokens,
                                     sampling=jaxspec.SamplingParams(temperature=0.0),
                                     spec=jaxspec.SpecConfig(method=method))
            for label, method in (("plain", "none"), (args.method, args.method))}
    for label, run in runs.items():
        print(f"  {label}: compiled ({warm_up(run, lm, prompts, args.max_new_tokens):.1f} s of first calls)",
              flush=True)
    # Each prompt plainly, then speculatively, one after the other: both see the same load on a shared machine.
    plain, spec = [], []
    for p in prompts:
        plain.append(runs["plain"]([p]))
        spec.append(runs[args.method]([p]))

    name, kind, text = chosen[0]
    print(f"\n--- {name} ({kind}): prompt and completion, plain and {args.method} alike " + "-" * 22)
    print((text + plain[0].text[0]).rstrip())
    print("-" * 79)

    w = max(len("prompt"), *(len(name) for name, _, _ in chosen)) + 2
    print(f"\n{'prompt':<{w}}{'kind':<6}{'tokens':>7}{'plain tok/s':>13}{args.method + ' tok/s':>13}"
          f"{'speedup':>9}{'accept len':>12}{'accepted':>11}  same text")
    speedups, lengths, mismatched = [], [], []
    for i, ((name, kind, _), p, s) in enumerate(zip(chosen, plain, spec)):
        speedup = s.stats.decode_tokens_per_s / p.stats.decode_tokens_per_s
        same = s.token_ids == p.token_ids and s.text == p.text
        speedups.append(speedup)
        lengths.append(s.stats.mean_acceptance_length)
        if not same:
            mismatched.append(i)
        print(f"{name:<{w}}{kind:<6}{len(p.token_ids[0]):>7}{p.stats.decode_tokens_per_s:>13.1f}"
              f"{s.stats.decode_tokens_per_s:>13.1f}{speedup:>8.2f}x{s.stats.mean_acceptance_length:>12.2f}"
              f"{f'{s.stats.accepted}/{s.stats.drafted}':>11}  {'yes' if same else 'NO'}")

    # The geometric mean: speedups are ratios, and one prompt that repeats itself should not stand for the rest.
    print(f"\nspeedup ({args.method} vs plain, decode tokens/s): geometric mean "
          f"{statistics.geometric_mean(speedups):.2f}x (min {min(speedups):.2f}x, max {max(speedups):.2f}x, "
          f"std {statistics.pstdev(speedups):.2f}) over "
          f"{len(speedups)} prompts; mean acceptance length {statistics.fmean(lengths):.2f} tokens per step")
    for k in ("code", "chat"):
        part = [x for (_, kind, _), x in zip(chosen, speedups) if kind == k]
        if part:
            print(f"  {k}: geometric mean {statistics.geometric_mean(part):.2f}x over {len(part)} prompts")
    if mismatched:
        for i in mismatched:
            print(f"MISMATCH: {args.method} output differs from plain decoding on {chosen[i][0]}:\n"
                  f"{spec[i].text[0]}", file=sys.stderr)
        return 1
    print(f"output identical: yes (all {len(chosen)} prompts, token for token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
