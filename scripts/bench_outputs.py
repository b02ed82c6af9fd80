#!/usr/bin/env python
"""Predicted outputs and structured output on the default model: tokens/s against plain decoding, side by side.

edits: batch 1 greedy over HumanEval completions (the held-out split). The prediction is the target's own greedy
  output with a fraction f of its lines edited (an identifier renamed, a number changed, a comment added), as a
  capable model's edit would meet a prediction: f = 0, 0.1, 0.3, and `unrelated` (another prompt's output).
  Then the extractive chat requests (rename, type hints, docstring, re-indent; benchkit.workloads) with the
  original code as the prediction, reported as they come out.
json: extraction chat requests with a JSON schema each: free text (no constraint) against constrained decoding
  without any drafts (the mask's cost), with forced-token drafting, and with forced tokens + sam.

Every condition's output is checked: predicted outputs give the plain tokens; constrained outputs validate and
are identical across drafting modes. Tokens/s is over the decode loop (GenerateStats.decode_s); conditions run
interleaved per prompt, each timed on its second run (the first may compile a new prompt or prediction bucket),
so machine noise hits all alike; `--repeats N` times N rounds over the conditions and takes each one's median
rate. json's last ten passages are held out: written after its forced-text drafting was tuned on the first ten.

    python scripts/bench_outputs.py edits --prompts 20 --new-tokens 128
    python scripts/bench_outputs.py json --new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics

import jsonschema

import jaxspec
from benchkit import machine, page, tables, workloads
from jaxspec import SpecConfig

EDIT_FRACTIONS = (0.0, 0.1, 0.3)


def edit_lines(text: str, fraction: float, rng: random.Random) -> str:
    """`text` with round(fraction * non-empty lines) lines edited (at least one for fraction > 0)."""
    lines = text.split("\n")
    candidates = [i for i, line in enumerate(lines) if line.strip()]
    count = 0 if fraction == 0 else max(1, round(fraction * len(candidates)))
    for i in rng.sample(candidates, min(count, len(candidates))):
        line = lines[i]
        names = re.findall(r"\b[a-z_][a-z0-9_]*\b", line)
        if names and rng.random() < 0.5:
            old = rng.choice(names)
            lines[i] = re.sub(rf"\b{old}\b", old + "_new", line)
        elif re.search(r"\d", line):
            lines[i] = re.sub(r"\d+", lambda m: str(int(m.group()) + 1), line, count=1)
        else:
            lines[i] = line + "  # edited"
    return "\n".join(lines)


def _run(lm, prompt, n, **kwargs):
    """One greedy generation of one prompt."""
    return jaxspec.generate(lm, [prompt], max_new_tokens=n, **kwargs)


def _rate(out) -> float:
    return (out.stats.generated_tokens - 1) / out.stats.decode_s


def _median_rates(rounds: list[dict]) -> dict:
    """Each condition's median tokens/s over timed rounds (one {condition: output} dict per round)."""
    return {name: statistics.median(_rate(r[name]) for r in rounds) for name in rounds[0]}


def _geomean(values) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def bench_edits(lm, args) -> list[str]:
    prompts = workloads.held_out_texts(args.prompts)
    plain = [_run(lm, p, args.new_tokens) for p in prompts]  # the reference outputs (and warm-up)
    rng = random.Random(0)
    conditions = {f"f={f}": f for f in EDIT_FRACTIONS}
    conditions["unrelated"] = None
    rows, per = [], {name: [] for name in conditions}
    for i, (prompt, ref) in enumerate(zip(prompts, plain)):
        predictions = {name: (plain[(i + 1) % len(plain)].text[0] if f is None else edit_lines(ref.text[0], f, rng))
                       for name, f in conditions.items()}
        for prediction in predictions.values():
            _run(lm, prompt, args.new_tokens, prediction=prediction)  # a new prediction length may compile
        # Rounds over every condition; each condition's rate is its median over the rounds.
        rounds = [{"none": _run(lm, prompt, args.new_tokens),
                   **{name: _run(lm, prompt, args.new_tokens, prediction=prediction)
                      for name, prediction in predictions.items()}} for _ in range(args.repeats)]
        for name in rounds[0]:
            if any(r[name].token_ids != ref.token_ids for r in rounds):
                raise SystemExit(f"prompt {i} {name}: output differs from plain decoding")
        rate = _median_rates(rounds)
        base = rate["none"]
        line = [f"prompt {i}: none {base:.1f} tok/s"]
        for name in conditions:
            r = rounds[0][name].stats.rows[0]
            per[name].append((rate[name] / base, r.accepted_prediction_tokens, r.rejected_prediction_tokens,
                              r.steps, r.generated))
            line.append(f"{name} {rate[name] / base:.2f}x acc {r.accepted_prediction_tokens} "
                        f"rej {r.rejected_prediction_tokens} steps {r.steps}/{r.generated - 1}")
        print(" | ".join(line), flush=True)
    for name, values in per.items():
        ratio = _geomean([v[0] for v in values])
        tokens = sum(v[4] - 1 for v in values)
        rows.append([name, f"{ratio:.2f}x", sum(v[1] for v in values), sum(v[2] for v in values),
                     f"{tokens / sum(v[3] for v in values):.2f}"])
    table = tables.markdown(["prediction", "tokens/s vs none (geomean)", "accepted prediction tokens",
                             "rejected", "tokens per step"], rows)
    return [f"### Predicted outputs: {len(prompts)} held-out HumanEval completions, {args.new_tokens} tokens", "",
            table, "", *bench_edit_requests(lm, args)]


def bench_edit_requests(lm, args) -> list[str]:
    requests = workloads.extractive_requests(args.requests)
    texts = workloads.extractive_texts(lm.tokenizer, args.requests)
    rows = []
    for r, text in zip(requests, texts):
        _run(lm, text, args.new_tokens)  # warm-up of this prompt's shape, plainly and with the prediction
        _run(lm, text, args.new_tokens, prediction=r["code"])
        none = _run(lm, text, args.new_tokens)
        out = _run(lm, text, args.new_tokens, prediction=r["code"])
        if out.token_ids != none.token_ids:
            raise SystemExit(f"{r['task_id']}: output differs with the prediction")
        row = out.stats.rows[0]
        rows.append([r["task_id"], r["kind"], f"{_rate(out) / _rate(none):.2f}x", row.accepted_prediction_tokens,
                     row.rejected_prediction_tokens, f"{(row.generated - 1) / max(row.steps, 1):.2f}"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    table = tables.markdown(["request", "kind", "tokens/s vs none", "accepted", "rejected", "tokens per step"], rows)
    geo = _geomean([float(r[2][:-1]) for r in rows])
    return [f"### Edit requests as they come out ({len(rows)} extractive chat requests, prediction = the code)", "",
            table, "", f"Geometric mean: {geo:.2f}x."]


# Schema families (field -> kind), and two passages for each.
FAMILIES = {
    "pet": {"name": "string", "age": "integer", "colour": "string", "indoor": "boolean", "city": "string"},
    "product": {"product": "string", "price": "integer", "weight_kg": "number", "in_stock": "boolean"},
    "person": {"name": "string", "age": "integer", "job": "string", "city": "string", "languages": "array"},
    "event": {"event": "string", "time": "string", "date": "string", "venue": "string", "price": "integer"},
    "job": {"title": "string", "city": "string", "full_time": "boolean", "salary": "integer", "remote": "boolean"},
}
PASSAGES = [
    ("Tom is a 3 year old grey cat who lives indoors in Oslo.", "pet"),
    ("Rex, a 7 year old brown dog, lives outside on a farm near Lyon.", "pet"),
    ("The Acme X200 laptop costs 1299 dollars, weighs 1.4 kg and is in stock.", "product"),
    ("The Zen kettle sells for 45 dollars, weighs 0.9 kg and is sold out.", "product"),
    ("Maria Lopez, 34, works as a nurse in Madrid and speaks Spanish and English.", "person"),
    ("Ken Sato, 51, is a chef in Osaka who speaks Japanese.", "person"),
    ("The jazz concert starts at 8 pm on June 3 at the Blue Hall; tickets are 20 euros.", "event"),
    ("A chess tournament opens at 10 am on May 9 at City Library; entry is 5 euros.", "event"),
    ("We are hiring a senior Python developer in Berlin, full time, salary 80000 euros, remote allowed.", "job"),
    ("Part-time barista wanted in Dublin, 12 euros per hour, no remote work.", "job"),
    # Held out: written after the forced-text drafting was tuned on the ten above, and measured only with it.
    ("Luna, a white rabbit aged 2, lives in a hutch in the garden of a house in Porto.", "pet"),
    ("Our parrot Kiwi is 15 years old, green, and stays inside our flat in Vienna.", "pet"),
    ("The Orbit 5 e-bike is priced at 2100 dollars, weighs 21.5 kg and ships today.", "product"),
    ("This steel water bottle costs 18 dollars and weighs 0.35 kg; it is currently unavailable.", "product"),
    ("Amina Diallo is a 28 year old architect based in Dakar; she speaks French, Wolof and English.", "person"),
    ("Lars Berg, aged 62, teaches history in Bergen and speaks Norwegian and German.", "person"),
    ("The film festival opens on October 12 at 7 pm in the Rex Cinema, with tickets at 15 euros.", "event"),
    ("Join the spring marathon on April 20 at 9 am from Central Park; registration costs 40 dollars.", "event"),
    ("Data analyst position in Toronto, full-time, 65000 dollars a year, hybrid remote work possible.", "job"),
    ("Seasonal fruit picker needed near Valencia for the summer, part-time, paid 900 euros a month, on site.",
     "job"),
]
HELD_OUT = 10  # PASSAGES[HELD_OUT:] were not used to tune what is measured


def schema_of(fields: dict) -> dict:
    props = {}
    for name, kind in fields.items():
        if kind == "array":
            props[name] = {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}
        elif kind == "string":
            props[name] = {"type": "string", "maxLength": 30}
        else:
            props[name] = {"type": kind}
    return {"type": "object", "properties": props, "required": list(fields)}


def bench_json(lm, args) -> list[str]:
    conditions = {"free": {}, "json/none": {"spec": SpecConfig(forced_tokens=0)}, "json/forced": {"spec": SpecConfig()},
                  "json/forced+sam": {"spec": SpecConfig(method="sam")}, "free/sam": {"spec": SpecConfig(method="sam")}}
    per = {name: [] for name in conditions}  # per prompt: (rate vs free, time vs free, steps, tokens, s/step)
    chosen = list(enumerate(PASSAGES))[args.skip: args.skip + args.prompts]  # (index in PASSAGES, passage)
    for i, (passage, family) in chosen:
        fields = FAMILIES[family]
        schema = schema_of(fields)
        message = f"Extract the fields {', '.join(fields)} from this text as JSON.\n\n{passage}"
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        kwargs = {name: dict(kw, constraint=jaxspec.JsonSchema(schema) if name.startswith("json") else None)
                  for name, kw in conditions.items()}
        for kw in kwargs.values():
            _run(lm, prompt, args.new_tokens, **kw)  # warm-up of this shape
        rounds = [{name: _run(lm, prompt, args.new_tokens, **kw) for name, kw in kwargs.items()}
                  for _ in range(args.repeats)]
        runs = rounds[0]
        outs = [r[n] for r in rounds for n in conditions if n.startswith("json")]
        if any(o.token_ids != outs[0].token_ids for o in outs):
            raise SystemExit(f"prompt {i}: constrained outputs differ between drafting modes")
        if outs[0].finish_reason[0] == "stop":
            jsonschema.validate(json.loads(outs[0].text[0]), schema)
        # Each condition's median over the rounds, of its rate and of its decode time.
        rate = _median_rates(rounds)
        decode_s = {n: statistics.median(r[n].stats.decode_s for r in rounds) for n in conditions}
        for name, out in runs.items():
            per[name].append((rate[name] / rate["free"], decode_s[name] / decode_s["free"], out.stats.steps,
                              out.stats.generated_tokens - 1, decode_s[name] / max(out.stats.steps, 1)))
        print(f"prompt {i}: " + " | ".join(f"{n} {per[n][-1][0]:.2f}x ({per[n][-1][2]} steps)" for n in conditions)
              + f" | {outs[0].text[0]}", flush=True)

    def table(picked: list[int]) -> str:
        rows = []
        for name, values in per.items():
            v = [values[k] for k in picked]
            rows.append([name, f"{_geomean([x[0] for x in v]):.2f}x", f"{_geomean([x[1] for x in v]):.2f}",
                         f"{sum(x[3] for x in v) / sum(x[2] for x in v):.2f}",
                         f"{1000 * statistics.fmean(x[4] for x in v):.1f}"])
        return tables.markdown(["condition", "tokens/s vs free (geomean)", "time per completion vs free",
                                "tokens per step", "ms per step"], rows)

    n = len(chosen)
    held = [k for k, (i, _) in enumerate(chosen) if i >= HELD_OUT]
    lines = [f"### Structured output: {n} extraction requests with a JSON schema (passages {chosen[0][0]}-"
             f"{chosen[-1][0]}, {len(held)} of them held out), up to {args.new_tokens} tokens, median of "
             f"{args.repeats} round(s)", "", table(list(range(n)))]
    if 0 < len(held) < n:
        lines += ["", f"The {len(held)} held-out requests alone:", "", table(held)]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=("edits", "json"))
    p.add_argument("--prompts", type=int, default=20, help="prompts (default: %(default)s)")
    p.add_argument("--skip", type=int, default=0,
                   help=f"json: start after this many passages ({HELD_OUT} measures the held-out ones only; "
                        "default: %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="edit requests (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per completion (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed rounds over the conditions per prompt, median rate (default: %(default)s)")
    p.add_argument("--out", help="also write the markdown tables to this file")
    page.add_option(p, "outputs-WORKLOAD")
    args = p.parse_args(argv)
    if not 0 <= args.skip < len(PASSAGES) or args.prompts < 1:
        p.error(f"--skip {args.skip} must be in 0..{len(PASSAGES) - 1} and --prompts {args.prompts} >= 1")
    if args.write_page == "outputs-WORKLOAD":
        args.write_page = f"outputs-{args.workload}"
    jaxspec.enable_compilation_cache()  # every figure is taken after a warm-up: a cached compile only shortens the run
    lm = jaxspec.load_model()
    info = machine.info()
    print(machine.line(info), flush=True)
    lines = bench_edits(lm, args) if args.workload == "edits" else bench_json(lm, args)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.write_page:
        page.write(args.write_page, text, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
