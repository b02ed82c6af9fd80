#!/usr/bin/env python
"""Draft-length rules for sam, priced by replaying the target's own greedy text (default model).

Greedy speculative decoding commits exactly the target's greedy text, so how a rule would fare can be replayed
without the target: at each step the row's text is a prefix of that text, the source drafts from it, the drafts
accepted are those equal to the text's next tokens, and the step costs c(w) plain steps for the verify width w it
needed. A rule is (min_match, draft_per_match, verify widths): nothing drafted below min_match matched tokens, at most
ceil(draft_per_match x match length) tokens, scored at the narrowest width holding them (the one-row rule for the
row's own text; with a corpus the loop chooses widths by cost, which the replay does not model). This
prices dozens of rules in a minute where an end-to-end run takes a quarter of an hour per rule; it leaves out what a
step costs beside the forward (drafting, the loop's switch), so confirm the choice end to end
(`bench_cost_aware.py --sam-lookup`).

`--sources both` also prices the shipped corpus of the target's own writing (`sam_source="both"`): at each step the
longer of the two matches drafts, as `SamProposer` chooses, and a corpus match drafts only from
`--static-min-matches` matched tokens up (a threshold of its own the loop does not have: it applies min_match to
both sources).

The prompts are tuning prompts: standard-library function heads completed as code and asked about in a chat
(jaxspec.train.prompts.stdlib_prompts), neither held out for the benchmarks nor in the shipped draft corpus.

    python scripts/bench_lookup_rules.py                                # 12 prompts of each kind, 100 rules
    python scripts/bench_lookup_rules.py --limit 4 --min-matches 2,4 --per-match 1,2 --widths "1,9,17"
    python scripts/bench_lookup_rules.py --sources dynamic,both --min-matches 1 --per-match 2 --widths "1,3,5,9,17"
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from benchkit import machine, tables
from benchkit.cli import floats, ints
from benchkit.workloads import chat_ask
from jaxspec import SamplingParams, SpecConfig
from jaxspec.cost import narrowest_holding
from jaxspec.methods import sam_source_for, shipped_static_sam
from jaxspec.proposers import suffix_automaton, suffix_match
from jaxspec.proposers.base import lookup_draft_count

# c(w), plain steps per verify forward at one row (session 29's stored table: 256-slot cache, 128 tokens cached)
DEFAULT_COSTS = "1:1.0,2:0.96,3:1.01,5:1.22,9:1.36,17:1.60"
K = 16  # sam's drafts per step


def parse_costs(text: str) -> dict[int, float]:
    """"1:1.0,9:1.36" -> {1: 1.0, 9: 1.36}."""
    return {int(w): float(c) for w, c in (item.split(":") for item in text.split(",") if item)}


def tuning_prompts(lm, limit: int) -> dict[str, list[list[int]]]:
    from jaxspec.train.prompts import stdlib_prompts  # jaxspec.train needs the [train] extra

    codes = stdlib_prompts(limit)
    chats = [lm.tokenizer.apply_chat_template([{"role": "user", "content": chat_ask(c)}], add_generation_prompt=True)
             for c in codes]
    return {"code": [lm.tokenizer.encode(t) for t in codes], "chat": [lm.tokenizer.encode(t) for t in chats]}


@functools.partial(jax.jit, static_argnames=("min_match", "per_match", "widths"))
def _plan(match: jax.Array, available: jax.Array, *, min_match: int, per_match: float, widths: tuple[int, ...]):
    """(drafts, verify width) of one row's step, by the loop's own rules: the lookup proposers' draft count and the
    narrowest width holding it."""
    num = lookup_draft_count(match[None], available[None], jnp.full((1,), widths[-1] - 1), K, min_match, per_match)
    return num[0], jnp.asarray(widths)[narrowest_holding(widths, num)]


def _corpus_draft(ssam, history: jax.Array, length: jax.Array):
    """The static source's (tokens i32[1, K], match_len, available) for one row's whole text."""
    match = suffix_automaton.static_feed_batch(ssam, suffix_automaton.StaticMatch.create(1), history, length)
    return suffix_automaton.static_draft_batch(ssam, match, K)


class Replay:
    """Each source's draft for each prefix of each text, computed once (the drafts depend only on the text)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], capacity: int, static_sam=None):
        self.prompts, self.outputs, self.capacity, self.static_sam = prompts, outputs, capacity, static_sam
        self._drafts: dict[tuple[int, int, bool], tuple[np.ndarray, int, int]] = {}
        self._draft = jax.jit(lambda h, n: suffix_match.draft_batch(suffix_match.build_batch(h, n, capacity), K))
        self._corpus_draft = jax.jit(_corpus_draft)

    def draft(self, row: int, done: int, corpus: bool = False) -> tuple[np.ndarray, int, int]:
        """(tokens [K], match length, tokens available) after the prompt and `done` output tokens, from the row's
        own text or (`corpus`) from the static corpus."""
        if (row, done, corpus) not in self._drafts:
            text = self.prompts[row] + self.outputs[row][:done]
            history = jnp.asarray([text + [0] * (self.capacity - len(text))], jnp.int32)
            length = jnp.asarray([len(text)], jnp.int32)
            tokens, match, available = (self._corpus_draft(self.static_sam, history, length) if corpus
                                        else self._draft(history, length))
            self._drafts[row, done, corpus] = (np.asarray(tokens[0]), int(match[0]), int(available[0]))
        return self._drafts[row, done, corpus]

    def price(self, row: int, min_match: int, per_match: float, widths: tuple[int, ...],
              costs: dict[int, float], static_min_match: int | None = None) -> tuple[int, float, int]:
        """(tokens the loop made, their cost in plain steps, steps) for one row under one rule; with
        `static_min_match` the corpus drafts too, where its match is the longer one and at least that long."""
        out = self.outputs[row]
        done, cost, steps = 1, 0.0, 0  # the first token comes from prefill
        while done < len(out):
            tokens, match, available = self.draft(row, done)
            if static_min_match is not None:
                s_tokens, s_match, s_available = self.draft(row, done, corpus=True)
                if s_match > match and s_match >= static_min_match:
                    tokens, match, available = s_tokens, s_match, s_available
            n, width = map(int, _plan(jnp.int32(match), jnp.int32(available), min_match=min_match,
                                      per_match=per_match, widths=widths))
            accepted = 0
            while accepted < n and done + accepted < len(out) and tokens[accepted] == out[done + accepted]:
                accepted += 1
            cost += costs[width]
            steps += 1
            done += accepted + 1
        return len(out) - 1, cost, steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=12, help="tuning prompts of each kind (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--costs", type=parse_costs, default=DEFAULT_COSTS,
                        help="c(w) per verify width, w:c pairs; every width of --widths needs one (default: "
                             "%(default)s)")
    parser.add_argument("--min-matches", type=ints, default="2,3,4,5,6", help="(default: %(default)s)")
    parser.add_argument("--per-match", type=floats, default="0.5,1,1.5,2,inf", help="(default: %(default)s)")
    parser.add_argument("--widths", default="1,9,17;1,5,9,17;1,3,5,9,17;1,9",
                        help="verify width sets separated by ';' (default: %(default)s)")
    parser.add_argument("--sources", default="dynamic", help="dynamic (the row's text) and/or both (with the "
                        "shipped corpus), comma-separated (default: %(default)s)")
    parser.add_argument("--static-min-matches", type=ints, default="1",
                        help="for source both: the corpus drafts from this many matched tokens up (default: "
                             "%(default)s)")
    args = parser.parse_args(argv)
    width_sets = [tuple(ints(t)) for t in args.widths.split(";") if t]
    if missing := {w for ws in width_sets for w in ws} - set(args.costs):
        parser.error(f"--costs has no c(w) for widths {sorted(missing)}")
    if args.limit < 1 or args.new_tokens < 2:
        parser.error("--limit must be >= 1 and --new-tokens >= 2")
    sources = [s for s in args.sources.split(",") if s]
    if not sources or set(sources) - {"dynamic", "both"}:
        parser.error(f"--sources {args.sources!r}: name dynamic and/or both")
    # (source, the corpus's min_match or None): the corpus rows once per threshold
    source_rules = [(s, t) for s in sources for t in ((None,) if s == "dynamic" else args.static_min_matches)]

    lm = jaxspec.load_model()
    print(machine.line(machine.info()))
    default = SpecConfig(method="sam")
    default_source = sam_source_for(lm, default)
    replays = {}
    for kind, prompts in tuning_prompts(lm, args.limit).items():
        outputs = []
        for i in range(0, len(prompts), 4):
            outputs += jaxspec.generate(lm, prompts[i: i + 4], max_new_tokens=args.new_tokens,
                                        sampling=SamplingParams(temperature=0.0)).token_ids
        capacity = max(len(p) for p in prompts) + args.new_tokens
        replays[kind] = Replay(prompts, outputs, capacity, shipped_static_sam(lm) if "both" in sources else None)
    print(f"greedy, {args.new_tokens} new tokens, {args.limit} tuning prompts of each kind; c(w): {args.costs}\n")

    rows = []
    for (source, static_min), min_match, per_match, widths in itertools.product(
            source_rules, args.min_matches, args.per_match, width_sets):
        cells = []
        for replay in replays.values():
            priced = [replay.price(r, min_match, per_match, widths, args.costs, static_min)
                      for r in range(len(replay.outputs))]
            tokens, cost, steps = (sum(p[i] for p in priced) for i in range(3))
            cells += [f"{tokens / cost:.3f}", f"{tokens / steps:.2f}"]
        # The loop's corpus threshold is its min_match; its width choice with the corpus is by cost, not replayed.
        is_default = default_source == "dynamic" == source and (min_match, per_match, widths) == (
            default.min_match, default.draft_per_match, default.verify_widths)
        label = source if static_min is None else f"both, corpus from {static_min}"
        rows.append([label, min_match, per_match, widths, *cells, "yes" if is_default else ""])
    rows.sort(key=lambda r: -float(r[4]))
    print(tables.markdown(["source", "min_match", "per match", "widths", *(f"{k} {m}" for k in replays for m in
                                                                         ("vs none", "tokens/step")), "default"],
                          rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
