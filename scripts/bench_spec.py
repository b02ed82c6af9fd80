#!/usr/bin/env python
"""Benchmark speculative decoding of the default model on this machine.

What it measures, all in one process, each figure next to the verification cost that bounds it:

1. c(T): the target forward over T new tokens per row (KV cache of realistic length, timed inside a jitted
   loop as the decode loop runs it, median of repeated calls), as a multiple of the T = 1 decode forward, at
   each batch size. Verifying K drafts costs c(K + 1) decode steps, so a method pays only when its mean
   acceptance length beats it.
2. Two workloads (scripts/workloads.py): free-form (HumanEval prompts, plain text completion) and extractive
   (chat requests to rewrite a HumanEval function: answers that mostly copy the input), greedy and sampled.
   The core configurations (none, ngram default, sam adaptive = `SpecConfig.adaptive_sam()`) run at every
   batch and temperature; the K sweep (ngram and sam at fixed K, self_draft) at --sweep-batches and
   --sweep-temperatures (--full: everywhere). Same prompts, batch and sampling for every method: tokens/s,
   speedup over `none`, mean acceptance length (tokens committed per active row-step), acceptance rate per
   draft position, ms per step.
3. Proposer + rejection-sampling cost, standalone: jitted propose + update of each proposer and
   `jaxspec.rejection_sample` at the real shapes (batch 8, at each verify width), as a share of the measured
   step time of that configuration at batch 8: a range, from every step verifying at the narrowest width to
   every step at the widest (the loop does not record which width each step took).
4. With --peers: transformers' prompt-lookup decoding (prompt_lookup_num_tokens 3 and 10) and its plain
   decoding on the same token ids at batch 1, and the greedy output checks (jaxspec none == peer plain;
   every jaxspec speculative run == jaxspec none: they must).

Every configuration is compiled once before it is timed (a generation with the same shapes whose rows stop
at their first token), and a counter of compiled programs confirms that no timed run compiled.

    python scripts/bench_spec.py              # default run: ~37 min on an idle 2-core VM (~30 with a warm
                                              # compile cache), + ~7 min with --peers
    python scripts/bench_spec.py --peers      # + transformers peers (pip install -e ".[peers]")
    python scripts/bench_spec.py --ks 1,3 --methods none,ngram,sam        # narrower: ~27 min
    python scripts/bench_spec.py --workloads ""                           # c(T) alone: ~3 min
    python scripts/bench_spec.py --limit 2 --batch1-limit 1 --new-tokens 16 --ks 3 --cost-ts 1,9   # smoke test
    python scripts/bench.py --spec ...        # the same, through scripts/bench.py

Outputs: bench_out/bench_spec.json, bench_out/bench_spec.md (the tables, also printed) and
bench_out/acceptance_vs_position.png (mean acceptance length against position in the output).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
import jaxspec  # noqa: E402
import workloads  # noqa: E402
from jaxspec import SamplingParams, SpecConfig  # noqa: E402
from jaxspec.decode import decode as decode_jit  # noqa: E402
from jaxspec.decode import prefill as prefill_jit  # noqa: E402
from jaxspec.generation import bucket_shapes, build_proposer, default_attention_impl  # noqa: E402
from jaxspec.proposers.base import Committed, Context  # noqa: E402
from jaxspec.sampling import row_keys  # noqa: E402

DEFAULT = "default"  # in --ks: the method's own default setting, SpecConfig(method=...); sam's is the adaptive one
METHODS = ("none", "ngram", "sam", "self_draft")
DEFAULT_COST_TS = "1,2,3,4,5,6,8,9,16,17,32"


def adaptive_sam() -> SpecConfig:
    """The default (adaptive) sam setting, the one the targets are about."""
    return SpecConfig.adaptive_sam()


# ----------------------------------------------------------------------------------------------- configs

@dataclasses.dataclass(frozen=True)
class Config:
    method: str
    k: int | str  # an int (a fixed draft budget), or DEFAULT (the method's default setting)
    spec: SpecConfig
    core: bool  # runs at every batch and temperature; the others (the K sweep) only where --sweep-* say

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        if self.k == DEFAULT:
            return "sam adaptive" if self.method == "sam" else f"{self.method} default"
        return f"{self.method} K={self.k}"

    @property
    def max_k(self) -> int:
        return self.spec.num_speculative_tokens


def make_configs(methods: list[str], ks: list, self_draft_ks: list, self_draft_layers: int) -> list[Config]:
    """Core: none, and ngram and sam at their default settings (sam's is the adaptive one: draft length tied to
    match length). Sweep: ngram and sam at each fixed K (draft K tokens whenever the last 2+ tokens occurred
    before; 'default' in `ks` is the core one, skipped), self_draft at each of `self_draft_ks`."""
    configs = []
    for method in methods:
        if method == "none":
            configs.append(Config("none", 0, SpecConfig(), core=True))
            continue
        if method == "self_draft":
            for k in self_draft_ks:
                spec = SpecConfig(method="self_draft", self_draft_layers=self_draft_layers,
                                  num_speculative_tokens=None if k == DEFAULT else k)
                configs.append(Config(method, k, spec, core=False))
            continue
        configs.append(Config(method, DEFAULT, adaptive_sam() if method == "sam" else SpecConfig(method=method),
                              core=True))
        for k in (k for k in ks if k != DEFAULT):
            spec = SpecConfig(method=method, num_speculative_tokens=k, min_match=2, draft_per_match=math.inf)
            configs.append(Config(method, k, spec, core=False))
    return configs


def drop_duplicates(configs: list[Config]) -> tuple[list[Config], dict[str, str]]:
    """Configurations with distinct settings (the first of equals kept), and {dropped label: kept label}."""
    kept, aliases = [], {}
    for c in configs:
        same = next((k for k in kept if k.spec == c.spec), None)
        if same is None:
            kept.append(c)
        else:
            aliases[c.label] = same.label
    return kept, aliases


def config_settings(spec: SpecConfig) -> str:
    if spec.method == "none":
        return "plain decoding through the speculative loop"
    text = f"K={spec.num_speculative_tokens}, verify widths {spec.verify_widths}"
    if spec.method in ("ngram", "sam"):
        text += f", min_match={spec.min_match}, draft_per_match={spec.draft_per_match}"
    if spec.method == "ngram":
        text += f", ngram_max={spec.ngram_max}"
    if spec.method == "self_draft":
        text += f", the target's first {spec.self_draft_layers} layers"
    return text


def parse_ks(text: str) -> list:
    return [p if p == DEFAULT else int(p) for p in (p.strip() for p in text.split(",")) if p]


# ----------------------------------------------------------------------------------------------- c(T)

@functools.partial(jax.jit, static_argnames=("graphdef", "num_forwards", "attention_impl"),
                   donate_argnames=("cache",))
def _forwards(graphdef, params, tokens, positions, cache, *, num_forwards: int, attention_impl: str):
    """`num_forwards` target forwards as a verify step runs them (T new tokens per row, K/V written at the row's
    length, logits at every new token), inside one jitted loop as in the decode loop.

    Timed per host call instead, a forward carries a fixed extra cost (20-35 ms at batch 1 on this CPU, more
    than half a decode step) that the decode loop never pays, and c(T) comes out flattened towards 1.
    """
    model = nnx.merge(graphdef, params)

    def body(_, carry):
        cache, acc = carry
        out, cache = model(tokens, positions, cache, attention_impl=attention_impl)
        return cache, acc + jnp.max(out.logits)  # every logit is used, as verification uses them

    return jax.lax.fori_loop(0, num_forwards, body, (cache, jnp.zeros((), jnp.float32)))


def measure_cost_curve(lm, batch: int, ts: list[int], context: int, cache_len: int, repeats: int,
                       num_forwards: int) -> list[dict]:
    """ms per target forward over T new tokens per row with `context` tokens already cached, and c(T).

    Each timed call runs `num_forwards` forwards in one jitted loop. The calls go round-robin over the Ts
    (`repeats` rounds), so a burst of load on this shared machine hits every T alike; the median per T over the
    rounds, divided by `num_forwards`, is reported.
    """
    impl = default_attention_impl()
    cache = lm.module.new_cache(batch, cache_len)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    runs = {}
    for t in ts:
        tokens = jnp.asarray(np.random.default_rng(t).integers(100, 40000, (batch, t)), jnp.int32)
        positions = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        runs[t] = functools.partial(_forwards, lm.graphdef, lm.params, tokens, positions, num_forwards=num_forwards,
                                    attention_impl=impl)
        cache, acc = runs[t](cache)  # compile
        acc.block_until_ready()
    times = {t: [] for t in ts}
    for _ in range(repeats):
        for t in ts:
            start = time.perf_counter()
            cache, acc = runs[t](cache)
            acc.block_until_ready()
            times[t].append((time.perf_counter() - start) / num_forwards)
    rows = [{"T": t, "ms": 1000 * statistics.median(times[t])} for t in ts]
    base = next(r["ms"] for r in rows if r["T"] == 1)
    for r in rows:
        r["c"] = r["ms"] / base
    return rows


def cost_of(curve: list[dict] | None, t: int) -> float:
    """c(t) from a measured curve (linear between measured T), or nan when not measured."""
    if not curve:
        return float("nan")
    ts = [r["T"] for r in curve]
    if not ts[0] <= t <= ts[-1]:
        return float("nan")
    return float(np.interp(t, ts, [r["c"] for r in curve]))


# ----------------------------------------------------------------------------------------------- runs

def shape_key(rows: list[list[int]], new_tokens: int, k: int) -> tuple:
    """The shapes `jaxspec.generate` compiles for: batch, prompt, buffer, cache."""
    return (len(rows),) + bucket_shapes([len(p) for p in rows], new_tokens, k)


def compiled_programs() -> int:
    return decode_jit._cache_size() + prefill_jit._cache_size()


class Runner:
    """Runs configurations on prompt batches, compiling each (configuration, shapes) once before timing."""

    def __init__(self, lm, new_tokens: int, ignore_eos: bool, seed: int, repeats: int):
        self.lm, self.new_tokens, self.ignore_eos, self.seed, self.repeats = lm, new_tokens, ignore_eos, seed, repeats
        self.warm: set = set()
        self.first_tokens: dict[tuple, int] = {}  # prompt ids -> greedy first token
        self.stop_width = 1 if ignore_eos else max(1, len(lm.tokenizer.eos_token_ids))

    def learn_first_tokens(self, prompts: list[list[int]]) -> None:
        """Each prompt's greedy first token (one generation of all prompts, one new token each): what lets a
        warm-up stop every row at once. Call it with all of a workload's prompts (one compile)."""
        todo = [p for p in prompts if tuple(p) not in self.first_tokens]
        if todo:
            r = jaxspec.generate(self.lm, todo, max_new_tokens=1, ignore_eos=True)
            self.first_tokens.update({tuple(p): t[0] for p, t in zip(todo, r.token_ids)})

    def warm_up(self, config: Config, rows: list[list[int]]) -> None:
        """Compile for these shapes: same batch, buckets and stop-table width; each row stops at its first token.

        A row whose greedy first token differs in this batch (a near tie) stops at the length limit instead,
        which is kept within the same output bucket.
        """
        key = (config.spec, shape_key(rows, self.new_tokens, config.max_k))
        if key in self.warm:
            return
        self.learn_first_tokens(rows)
        stops = [[self.first_tokens[tuple(p)]] * self.stop_width for p in rows]
        bucket = bucket_shapes([1], self.new_tokens, 0)[1]
        limit = min(self.new_tokens, bucket // 2 + 1)
        jaxspec.generate(self.lm, rows, max_new_tokens=limit, ignore_eos=True, stop_token_ids=stops,
                         spec=config.spec)
        self.warm.add(key)

    def sampling(self, temperature: float, indices: list[int]) -> list[SamplingParams]:
        """One seed per prompt (its index in the workload), so a row samples alike at every batch size."""
        return [SamplingParams(temperature=temperature, seed=self.seed + i) for i in indices]

    def run(self, config: Config, prompts: list[list[int]], batch: int, temperature: float) -> dict:
        indices = list(range(len(prompts)))
        if len(indices) < batch:  # too few prompts for one batch: cycle them
            indices = [i % len(prompts) for i in range(batch)]
        indices = indices[: len(indices) - len(indices) % batch]
        calls = [indices[i: i + batch] for i in range(0, len(indices), batch)]
        start = time.perf_counter()
        for idx in calls:
            self.warm_up(config, [prompts[i] for i in idx])
        warmup_s = time.perf_counter() - start
        before = compiled_programs()
        repeats = []
        for _ in range(self.repeats):
            results = []
            for idx in calls:
                results.append(jaxspec.generate(self.lm, [prompts[i] for i in idx], max_new_tokens=self.new_tokens,
                                                sampling=self.sampling(temperature, idx), ignore_eos=self.ignore_eos,
                                                spec=config.spec))
            repeats.append(results)
        compiled = compiled_programs() - before
        seconds = [sum(r.stats.prefill_s + r.stats.decode_s for r in results) for results in repeats]
        results = repeats[int(np.argsort(seconds)[len(seconds) // 2])]  # the median repeat
        out = summarise(config, batch, temperature, calls, results, statistics.median(seconds), compiled)
        out["warmup_s"] = warmup_s
        return out


def summarise(config: Config, batch: int, temperature: float, calls, results, seconds: float, compiled: int) -> dict:
    rows = [row for r in results for row in r.stats.rows]
    generated = sum(r.stats.generated_tokens for r in results)
    steps = sum(r.stats.steps for r in results)
    decode_s = sum(r.stats.decode_s for r in results)
    k = config.max_k
    drafted_at = np.sum([r.stats.drafted_per_position for r in results], axis=0) if k else np.zeros(0)
    accepted_at = np.sum([r.stats.accepted_per_position for r in results], axis=0) if k else np.zeros(0)
    committed = sum(sum(r.committed_per_step) for r in rows)
    row_steps = sum(r.stats.row_steps for r in results)
    return {
        "config": config.label, "method": config.method, "K": config.k, "max_K": k, "batch": batch,
        "temperature": temperature, "prompts": [i for idx in calls for i in idx], "generated_tokens": generated,
        "seconds": seconds, "tokens_per_s": generated / seconds,
        "decode_tokens_per_s": (generated - sum(r.stats.num_rows for r in results)) / decode_s,
        "steps": steps, "ms_per_step": 1000 * decode_s / steps if steps else float("nan"),
        "row_steps": row_steps, "mean_acceptance_length": committed / row_steps if row_steps else float("nan"),
        "drafted": int(sum(r.stats.drafted for r in results)), "accepted": int(sum(r.stats.accepted for r in results)),
        "acceptance_rate_per_position": [float(a / d) if d else None for a, d in zip(accepted_at, drafted_at)],
        "compiled_during_timing": compiled,
        # kept in memory for the checks, the peers' subset and the plot; dropped from the JSON
        "_outputs": [t for r in results for t in r.token_ids],
        "_committed": [r.committed_per_step for r in rows],
        "_per_call": [(r.stats.prefill_s + r.stats.decode_s, r.stats.generated_tokens) for r in results],
    }


# ----------------------------------------------------------------------------------------------- overhead

@functools.partial(jax.jit, static_argnames=("proposer",))
def _propose_update(proposer, params, pstate, ctx: Context, keys):
    """One step's proposer work as the loop does it: propose, commit the drafts plus one token, update."""
    draft, pstate = proposer.propose(params, pstate, ctx, keys)
    k = proposer.num_speculative_tokens
    batch, width = ctx.history.shape
    num = jnp.minimum(draft.num_draft, ctx.max_draft) + 1
    j = jnp.arange(k + 1)
    tokens = jnp.where(j < num[:, None], jnp.pad(draft.tokens, ((0, 0), (0, 1)), constant_values=7), -1)
    slots = jnp.where(j < num[:, None], ctx.history_len[:, None] + j, width)
    history = ctx.history.at[jnp.arange(batch)[:, None], slots].set(tokens, mode="drop")
    after = ctx.replace(history=history, history_len=ctx.history_len + num, positions=ctx.positions + num)
    pstate = proposer.update(params, pstate, after, Committed(tokens=tokens, num=num))
    return draft, pstate


@functools.cache
def _rejection_jit():
    return jax.jit(jaxspec.rejection_sample)


def _median_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure_overhead(lm, config: Config, rows: list[list[int]], outputs: list[list[int]], new_tokens: int,
                     temperatures: list[float], repeats: int) -> dict:
    """ms of propose + update and of rejection sampling at the real shapes, per temperature.

    The rows' histories hold their prompt and the first half of a real output (the `none` run's), so lookups
    search realistic text. Rejection sampling is timed at each verify width the configuration compiles (the
    loop picks the narrowest one holding the batch's longest draft).
    """
    batch, width, buffer_len, cache_len = shape_key(rows, new_tokens, config.max_k)
    proposer, params = build_proposer(lm, config.spec, prompt_width=width, buffer_len=buffer_len, cache_len=cache_len)
    k = proposer.num_speculative_tokens
    history = np.zeros((batch, width + buffer_len), np.int32)
    lens = []
    for i, (p, out) in enumerate(zip(rows, outputs)):
        done = out[: max(1, min(len(out), new_tokens) // 2)]
        history[i, : len(p)] = p
        history[i, len(p): len(p) + len(done)] = done
        lens.append(len(p) + len(done))
    history_len = jnp.asarray(lens, jnp.int32)
    result = {"config": config.label, "batch": batch}
    for temperature in temperatures:
        sampling = SamplingParams(temperature=temperature, seed=0).broadcast(batch)
        ctx = Context(history=jnp.asarray(history), history_len=history_len,
                      max_draft=jnp.full((batch,), k, jnp.int32), sampling=sampling, positions=history_len - 1)
        keys = row_keys(sampling.seed, ctx.positions)
        pstate = proposer.init(params, ctx)
        propose_ms = _median_ms(lambda pstate=pstate, ctx=ctx, keys=keys:
                                _propose_update(proposer, params, pstate, ctx, keys), repeats)
        draft, _ = _propose_update(proposer, params, pstate, ctx, keys)
        seeds = jax.vmap(jax.random.key)(sampling.seed)
        by_width = {}
        for w in config.spec.verify_widths:
            logits = 4.0 * jax.random.normal(jax.random.key(w), (batch, w, lm.config.vocab_size), jnp.float32)
            probs = None if draft.probs is None else draft.probs[:, : w - 1]

            def rejection(seeds=seeds, logits=logits, draft=draft, w=w, probs=probs, sampling=sampling, ctx=ctx):
                return _rejection_jit()(seeds, logits, draft.tokens[:, : w - 1], probs,
                                        jnp.minimum(draft.num_draft, w - 1), sampling, positions=ctx.positions + 1)

            by_width[w] = _median_ms(rejection, repeats)
        result[str(temperature)] = {"propose_update_ms": propose_ms, "rejection_ms_by_width": by_width,
                                    "rejection_ms_min": min(by_width.values()), "rejection_ms": max(by_width.values())}
    return result


# ----------------------------------------------------------------------------------------------- peers

def run_peers(peer, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int) -> dict:
    import peer_hf

    out = {}
    for name, lookup in (("plain", None), ("prompt_lookup_3", 3), ("prompt_lookup_10", 10)):
        r = peer_hf.run_peer(peer, prompts, max_new_tokens=new_tokens, batch_size=1, prompt_lookup_num_tokens=lookup,
                             temperature=temperature, seed=seed)
        out[name] = {"tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"],
                     "generated_tokens": sum(len(o) for o in r["outputs"]), "_outputs": r["outputs"]}
    return out


def subset_tokens_per_s(run: dict, count: int) -> float:
    """tokens/s of a batch-1 run over its first `count` prompts (one call per prompt)."""
    calls = run["_per_call"][:count]
    return sum(n for _, n in calls) / sum(s for s, _ in calls)


def copied_fraction(prompt: list[int], output: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that occur in the prompt: how extractive the output is."""
    grams = {tuple(prompt[i: i + n]) for i in range(len(prompt) - n + 1)}
    outs = [tuple(output[i: i + n]) for i in range(len(output) - n + 1)]
    return sum(g in grams for g in outs) / len(outs) if outs else float("nan")


# ----------------------------------------------------------------------------------------------- plot

def acceptance_by_position(committed_rows: list[tuple[int, ...]], bin_size: int) -> list[dict]:
    """Mean tokens committed per step, binned by the output position where the step started."""
    sums, counts = {}, {}
    for committed in committed_rows:
        position = 1  # the first output token comes from prefill
        for c in committed:
            b = position // bin_size
            sums[b] = sums.get(b, 0) + c
            counts[b] = counts.get(b, 0) + 1
            position += c
    return [{"start": b * bin_size, "steps": counts[b], "mean_acceptance_length": sums[b] / counts[b]}
            for b in sorted(counts)]


def plot_acceptance(curves: list[dict], cost_curve: list[dict] | None, widths: tuple[int, ...], batch: int,
                    path: Path, bin_size: int) -> None:
    """One line per curve; dotted lines at c(w) for the adaptive sam's verify widths w > 1 at `batch`: the
    acceptance length a step verified at width w must beat to pay for itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = {}  # one colour per workload and configuration; greedy solid, sampled dashed
    for c in curves:
        colour = colours.setdefault((c["workload"], c["config"]), f"C{len(colours)}")
        xs = [b["start"] + bin_size / 2 for b in c["bins"]]
        ax.plot(xs, [b["mean_acceptance_length"] for b in c["bins"]], marker="o", markersize=3, color=colour,
                linestyle="-" if c["temperature"] == 0 else "--",
                label=f"{c['workload']}, {c['config']}, T={c['temperature']:g}, batch {c['batch']}")
    for w in (w for w in widths if w > 1):
        cw = cost_of(cost_curve, w)
        if np.isfinite(cw):
            ax.axhline(cw, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"c({w}) = {cw:.2f}", (1.0, cw), xycoords=("axes fraction", "data"), fontsize=8,
                        color="grey", xytext=(3, -3), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel(f"position in the output (tokens, {bin_size}-token bins)")
    ax.set_ylabel("mean acceptance length (tokens committed per step)")
    ax.set_title(f"Acceptance against output position; dotted: c(w), the cost of a width-w verify in decode "
                 f"steps (batch {batch})", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- report

def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def markdown(report: dict) -> str:
    lines = [f"# jaxspec speculative decoding, {report['model']}, {report['machine']}, jax {report['jax']}, "
             f"{report['date']}", "",
             f"{report['new_tokens']} new tokens per prompt, "
             f"stopping at EOS{' (ignored)' if report['ignore_eos'] else ''}; "
             f"tokens/s over prefill + decode of all calls (median of {report['repeats']} repeat(s)); "
             ""]
    lines += ["Configurations (fixed K: draft K tokens whenever the last 2+ tokens occurred before; `default`: "
              "`SpecConfig(method=...)`, for sam the adaptive `SpecConfig.adaptive_sam()`):", ""]
    lines += [f"- {label}: {settings}" for label, settings in report["configs"].items()]
    lines.append("")
    if report.get("copied_4grams"):
        lines += ["Share of the greedy `none` outputs' 4-grams that occur in their prompt: " + ", ".join(
            f"{w} {v:.0%}" for w, v in report["copied_4grams"].items()) + ".", ""]
    costs = report["cost_curve"]
    if costs:
        lines += [f"## c(T): target forward over T new tokens per row / the T = 1 forward, timed inside a jitted loop "
                  f"({report['cost_context']} tokens cached, cache of {report['cost_cache_len']} slots)", ""]
        batches = list(costs)
        lines.append("| T | " + " | ".join(f"batch {b} ms | c" for b in batches) + " |")
        lines.append("|---|" + "---|---|" * len(batches))
        for i, row in enumerate(costs[batches[0]]):
            lines.append(f"| {row['T']} | " + " | ".join(f"{costs[b][i]['ms']:.1f} | {costs[b][i]['c']:.2f}"
                                                        for b in batches) + " |")
        lines.append("")
    lines += ["## Runs", "",
              "MAL: mean acceptance length (tokens committed per active row-step). c(K+1): the cost of the widest "
              "verify in decode steps; MAL / c(K+1) is the speedup were every step verified at that width. "
              "tokens/s and speedup: prefill + decode, as a user sees them (the targets use these); decode "
              "speedup: the decode loop alone (prefill is the same work for every method). "
              "Overhead: standalone propose + update, and rejection sampling at the narrowest..widest verify "
              "width, at batch 8, in ms and as a share of this configuration's measured batch-8 step (a range: "
              "the loop does not record which width each step took). Greedy == none: identical output rows.", ""]
    for workload, runs in report["runs"].items():
        for temperature in report["temperatures"]:
            lines += [f"### {workload}, temperature {temperature:g}", "",
                      "| batch | config | tokens/s | speedup vs none | decode speedup | MAL | c(K+1) | MAL / c(K+1) | "
                      "ms/step | steps | acceptance by position | overhead ms (share) | greedy == none |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in (r for r in runs if r["temperature"] == temperature):
                rates = " ".join(fmt(a, ".2f") for a in r["acceptance_rate_per_position"][:8])
                rates += " ..." if len(r["acceptance_rate_per_position"]) > 8 else ""
                ov = r.get("overhead")
                ov_text = "-" if ov is None else (
                    f"{ov['propose_update_ms']:.2f} + {ov['rejection_ms_min']:.1f}..{ov['rejection_ms']:.1f} "
                    f"({fmt(ov['share_min'], '.1%')}..{fmt(ov['share'], '.1%')})")
                lines.append(f"| {r['batch']} | {r['config']} | {r['tokens_per_s']:.1f} | {fmt(r.get('speedup'))}x | "
                             f"{fmt(r.get('decode_speedup'))}x | "
                             f"{fmt(r['mean_acceptance_length'])} | {fmt(r.get('c_verify'))} | "
                             f"{fmt(r.get('mal_over_c'))} | {r['ms_per_step']:.1f} | {r['steps']} | {rates or '-'} | "
                             f"{ov_text} | {r.get('greedy_equals_none', '-')} |")
            lines.append("")
    if report.get("peers"):
        lines += ["## transformers peer (batch 1, same token ids)", "",
                  "| workload | T | prompts | plain tokens/s | prompt lookup 3 | prompt lookup 10 | jaxspec none | "
                  "jaxspec sam adaptive | sam / best prompt lookup | jaxspec none == peer plain (greedy) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in report["peers"]:
            lines.append(f"| {p['workload']} | {p['temperature']:g} | {p['prompts']} | "
                         f"{p['plain']['tokens_per_s']:.1f} | {p['prompt_lookup_3']['tokens_per_s']:.1f} | "
                         f"{p['prompt_lookup_10']['tokens_per_s']:.1f} | "
                         f"{fmt(p.get('jaxspec_none_tokens_per_s'), '.1f')} | "
                         f"{fmt(p.get('jaxspec_sam_tokens_per_s'), '.1f')} | {fmt(p.get('sam_over_best_lookup'))}x | "
                         f"{p.get('none_equals_peer_plain', '-')} |")
        lines.append("")
    if report.get("mismatches"):
        lines += ["## Greedy mismatches (speculative != none)", ""]
        lines += [f"- {m}" for m in report["mismatches"]]
        lines.append("")
    lines += ["## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {t['target']}: {t['value']} -> {t['status']}")
    lines.append("")
    return "\n".join(lines)


def evaluate_targets(report: dict, sam_label: str) -> list[dict]:
    targets = []

    def add(target, value, ok):
        status = ok if isinstance(ok, str) else "met" if ok else "NOT met"
        targets.append({"target": target, "value": value, "status": status})

    for p in report.get("peers", []):
        ratio = p.get("sam_over_best_lookup")
        if ratio is not None:
            add(f"{sam_label} >= 1.5x the peer's best prompt lookup ({p['workload']}, T={p['temperature']:g}, batch 1)",
                f"{ratio:.2f}x", ratio >= 1.5)
    for workload, runs in report["runs"].items():
        for r in runs:
            if r["config"] != sam_label or r.get("speedup") is None:
                continue
            where = f"{workload}, T={r['temperature']:g}, batch {r['batch']}"
            if workload == "extractive":
                add(f"{sam_label} >= 2x none ({where})",
                    f"{r['speedup']:.2f}x (decode alone {r['decode_speedup']:.2f}x)", r["speedup"] >= 2.0)
            if workload == "free-form":
                add(f"{sam_label} >= 0.97x none ({where})",
                    f"{r['speedup']:.2f}x (decode alone {r['decode_speedup']:.2f}x)", r["speedup"] >= 0.97)
            ov = r.get("overhead")
            if r["batch"] == 8 and ov is not None:
                low, high = ov["share_min"], ov["share"]
                add(f"{sam_label} proposer + rejection sampling < 5% of the step ({where})",
                    f"{low:.1%} (every step at the narrowest width) .. {high:.1%} (at the widest)",
                    "met" if high < 0.05 else "NOT met" if low >= 0.05 else
                    "met only if most steps verify at the narrow widths")
    if not report.get("peers"):
        targets.append({"target": f"{sam_label} >= 1.5x the peer's best prompt lookup", "value": "-",
                        "status": "not measured (run with --peers)"})
    return targets


# ----------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="free-form,extractive", help="(default: %(default)s)")
    parser.add_argument("--limit", type=int, default=8, help="prompts per workload (default: %(default)s)")
    parser.add_argument("--batch1-limit", type=int, default=4,
                        help="prompts (the first of --limit) for batch-1 runs and the peers (default: %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS), help="(default: %(default)s)")
    parser.add_argument("--ks", default="1,3,5,8", help="the K sweep: fixed K for ngram and sam; their default "
                        "settings (sam adaptive) always run (default: %(default)s)")
    parser.add_argument("--self-draft-ks", default="3", help="the K sweep for self_draft; 'default' is its default "
                        "setting (default: %(default)s)")
    parser.add_argument("--self-draft-layers", type=int, default=SpecConfig.self_draft_layers,
                        help="(default: %(default)s)")
    parser.add_argument("--batches", default="1,8", help="batches of the core configurations: none, ngram default, "
                        "sam adaptive (default: %(default)s)")
    parser.add_argument("--temperatures", default="0,0.8", help="0 is greedy (default: %(default)s)")
    parser.add_argument("--sweep-batches", default="8", help="batches of the K sweep (default: %(default)s)")
    parser.add_argument("--sweep-temperatures", default="0", help="temperatures of the K sweep (default: "
                        "%(default)s)")
    parser.add_argument("--full", action="store_true", help="the K sweep at every batch and temperature too")
    parser.add_argument("--new-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate all --new-tokens (default: stop at EOS)")
    parser.add_argument("--seed", type=int, default=0, help="row i samples with seed + i (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per run; the median is reported "
                        "(default: %(default)s)")
    parser.add_argument("--cost-ts", default=DEFAULT_COST_TS, help="T for c(T); empty to skip (default: %(default)s)")
    parser.add_argument("--cost-context", type=int, default=384, help="tokens cached for c(T) (default: %(default)s)")
    parser.add_argument("--cost-cache-len", type=int, default=640, help="cache slots for c(T) (default: %(default)s)")
    parser.add_argument("--cost-repeats", type=int, default=7, help="timed calls per T, round-robin over the Ts "
                        "(default: %(default)s)")
    parser.add_argument("--cost-forwards", type=int, default=4, help="forwards per timed call, in one jitted loop "
                        "(default: %(default)s)")
    parser.add_argument("--overhead-repeats", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--peers", action="store_true", help="also run transformers (the [peers] extra)")
    parser.add_argument("--peer-limit", type=int, default=None, help="prompts for the peers (default: the batch-1 "
                        "prompts)")
    parser.add_argument("--plot-methods", default="sam,ngram", help="methods whose default setting is plotted "
                        "(default: %(default)s)")
    parser.add_argument("--plot-bin", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--plot-batch", type=int, default=1, help="the batch whose runs are plotted (default: "
                        "%(default)s, else the first of --batches)")
    parser.add_argument("--show-outputs", type=int, default=2, help="greedy none outputs to print per workload "
                        "(default: %(default)s)")
    parser.add_argument("--compile-cache", default="bench_out/jax_cache", metavar="DIR",
                        help="JAX's persistent compilation cache (a few MB): a rerun skips the compiles of unchanged "
                        "programs; empty to switch it off (default: %(default)s)")
    parser.add_argument("--out", default="bench_out/bench_spec.json", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    started = time.perf_counter()
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            parser.error(f"--methods: {m!r} is not one of {METHODS}")
    if "none" not in methods:
        methods.insert(0, "none")  # speedups and the greedy checks are measured against it
    batches = [int(b) for b in args.batches.split(",") if b]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    sweep_batches = batches if args.full else [int(b) for b in args.sweep_batches.split(",") if b]
    sweep_temperatures = temperatures if args.full else [float(t) for t in args.sweep_temperatures.split(",") if t]
    core_temperatures = list(temperatures)
    batches += [b for b in sweep_batches if b not in batches]
    temperatures += [t for t in sweep_temperatures if t not in temperatures]
    configs, aliases = drop_duplicates(make_configs(methods, parse_ks(args.ks), parse_ks(args.self_draft_ks),
                                                    args.self_draft_layers))
    sam_label = Config("sam", DEFAULT, adaptive_sam(), core=True).label
    out_json = Path(args.out)
    out_json.parent.mkdir(parents=True, exist_ok=True)

    lm = jaxspec.load_model(jaxspec.DEFAULT_MODEL)
    prompts = {w: workloads.load_workload(w, lm.tokenizer, args.limit) for w in args.workloads.split(",") if w}
    b1_limit = min(args.batch1_limit, args.limit)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "jax": jax.__version__, "backend": jax.default_backend(), "model": lm.name,
              "new_tokens": args.new_tokens, "ignore_eos": args.ignore_eos, "repeats": args.repeats,
              "temperatures": temperatures, "batches": batches, "args": vars(args),
              "configs": {c.label: config_settings(c.spec) for c in configs}
              | {a: f"the same settings as {b} (not run twice)" for a, b in aliases.items()},
              "prompt_tokens": {w: [len(p) for p in ps] for w, ps in prompts.items()},
              "cost_context": args.cost_context, "cost_cache_len": args.cost_cache_len}
    print(f"# {lm.name}: workloads {list(prompts)}, {len(configs)} configs {[c.label for c in configs]}, "
          f"batches {batches}, temperatures {temperatures}", flush=True)

    # 1. c(T)
    cost_ts = [int(t) for t in args.cost_ts.split(",") if t]
    costs = {}
    if cost_ts:
        if 1 not in cost_ts:
            cost_ts.insert(0, 1)
        for batch in batches:
            t0 = time.perf_counter()
            costs[batch] = measure_cost_curve(lm, batch, sorted(cost_ts), args.cost_context, args.cost_cache_len,
                                              args.cost_repeats, args.cost_forwards)
            print(f"c(T), batch {batch} ({time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"c({r['T']})={r['c']:.2f}" for r in costs[batch]), flush=True)
    report["cost_curve"] = costs

    # 2. the runs
    runner = Runner(lm, args.new_tokens, args.ignore_eos, args.seed, args.repeats)
    report["runs"] = {}
    for workload, ps in prompts.items():
        runs = report["runs"][workload] = []
        runner.learn_first_tokens(ps)
        for batch in batches:
            use = ps[:b1_limit] if batch == 1 else ps
            for temperature in temperatures:
                for config in configs:
                    if not (config.core or (batch in sweep_batches and temperature in sweep_temperatures)):
                        continue
                    t0 = time.perf_counter()
                    r = runner.run(config, use, batch, temperature)
                    r["workload"] = workload
                    r["c_verify"] = cost_of(costs.get(batch), config.max_k + 1) if config.max_k else 1.0
                    r["mal_over_c"] = r["mean_acceptance_length"] / r["c_verify"]
                    runs.append(r)
                    warn = f"  WARNING: {r['compiled_during_timing']} compile(s) while timed" \
                        if r["compiled_during_timing"] else ""
                    print(f"{workload:10s} batch {batch} T={temperature:g} {config.label:18s} "
                          f"{r['tokens_per_s']:7.1f} tok/s  MAL {r['mean_acceptance_length']:.2f}  "
                          f"{r['ms_per_step']:6.1f} ms/step  {r['steps']:5d} steps  "
                          f"(+{time.perf_counter() - t0:.0f} s, warm-up {r['warmup_s']:.0f} s){warn}", flush=True)
        none_greedy = next((r for r in runs if r["method"] == "none" and r["temperature"] == 0), None)
        if none_greedy is not None:
            copied = [copied_fraction(ps[i], out) for i, out in zip(none_greedy["prompts"], none_greedy["_outputs"])]
            report.setdefault("copied_4grams", {})[workload] = float(np.nanmean(copied))
            print(f"--- {workload}: {np.nanmean(copied):.0%} of the greedy none outputs' 4-grams occur in their "
                  f"prompt; output lengths {[len(o) for o in none_greedy['_outputs']]}", flush=True)
            report.setdefault("sample_outputs", {})[workload] = [
                lm.tokenizer.decode(out) for out in none_greedy["_outputs"][: args.show_outputs]]
            for i, out in enumerate(none_greedy["_outputs"][: args.show_outputs]):
                print(f"--- {workload} greedy none output {i} (batch {none_greedy['batch']}): "
                      f"{lm.tokenizer.decode(out)[:200]!r}", flush=True)

    # speedups and greedy checks, within (workload, batch, temperature)
    mismatches = []
    for workload, runs in report["runs"].items():
        for r in runs:
            base = next(b for b in runs if b["method"] == "none" and b["batch"] == r["batch"]
                        and b["temperature"] == r["temperature"])
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["decode_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            if r["temperature"] == 0 and r["method"] != "none":
                same = sum(a == b for a, b in zip(r["_outputs"], base["_outputs"]))
                r["greedy_equals_none"] = f"{same}/{len(base['_outputs'])}"
                for i, (a, b) in enumerate(zip(r["_outputs"], base["_outputs"])):
                    if a != b:
                        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        mismatches.append(f"{workload}, batch {r['batch']}, {r['config']}, prompt "
                                          f"{r['prompts'][i]}: first difference at output token {at} "
                                          f"(spec {a[at:at + 5]} vs none {b[at:at + 5]}; lengths {len(a)}, {len(b)})")
        b1 = next((r for r in runs if r["method"] == "none" and r["batch"] == 1 and r["temperature"] == 0), None)
        for r in runs:
            if r["method"] == "none" and r["batch"] > 1 and r["temperature"] == 0 and b1 is not None:
                pairs = [(b1["_outputs"][b1["prompts"].index(i)], out) for i, out in zip(r["prompts"], r["_outputs"])
                         if i in b1["prompts"]]
                r["greedy_equals_batch1"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    report["mismatches"] = mismatches
    for m in mismatches:
        print(f"MISMATCH: {m}")

    # 3. proposer + rejection overhead at batch 8
    if 8 in batches:
        for workload, runs in report["runs"].items():
            none8 = next(r for r in runs if r["method"] == "none" and r["batch"] == 8)
            rows = [prompts[workload][i] for i in none8["prompts"][:8]]
            for config in (c for c in configs if c.method != "none"):
                at8 = [r for r in runs if r["config"] == config.label and r["batch"] == 8]
                if not at8:
                    continue
                t0 = time.perf_counter()
                temps = [r["temperature"] for r in at8]
                ov = measure_overhead(lm, config, rows, none8["_outputs"][:8], args.new_tokens, temps,
                                      args.overhead_repeats)
                for r in at8:
                    o = dict(ov[str(r["temperature"])])
                    o["share_min"] = (o["propose_update_ms"] + o["rejection_ms_min"]) / r["ms_per_step"]
                    o["share"] = (o["propose_update_ms"] + o["rejection_ms"]) / r["ms_per_step"]
                    r["overhead"] = o
                print(f"overhead {workload:10s} {config.label:18s} " + ", ".join(
                    f"T={t:g}: propose+update {ov[str(t)]['propose_update_ms']:.2f} ms, rejection by verify width "
                    + ", ".join(f"{w}: {ms:.2f}" for w, ms in ov[str(t)]["rejection_ms_by_width"].items()) + " ms"
                    for t in temps) + f" (+{time.perf_counter() - t0:.0f} s)", flush=True)

    # 4. peers
    report["peers"] = []
    if args.peers:
        import peer_hf
        from jaxspec.models.loading import named_model_path

        path = named_model_path(jaxspec.DEFAULT_MODEL)
        peer = peer_hf.load_peer(str(path.parent), path.name)
        for workload, ps in prompts.items():
            count = min(args.peer_limit or b1_limit, b1_limit)
            for temperature in core_temperatures:
                t0 = time.perf_counter()
                p = run_peers(peer, ps[:count], args.new_tokens, temperature, args.seed)
                p.update(workload=workload, temperature=temperature, prompts=count)
                best = max(p["prompt_lookup_3"]["tokens_per_s"], p["prompt_lookup_10"]["tokens_per_s"])
                runs = report["runs"][workload]
                none1 = next((r for r in runs if r["config"] == "none" and r["batch"] == 1
                              and r["temperature"] == temperature), None)
                sam1 = next((r for r in runs if r["config"] == sam_label and r["batch"] == 1
                             and r["temperature"] == temperature), None)
                if none1 is not None:
                    p["jaxspec_none_tokens_per_s"] = subset_tokens_per_s(none1, count)
                    if temperature == 0:
                        same = sum(a == b for a, b in zip(none1["_outputs"][:count], p["plain"]["_outputs"]))
                        p["none_equals_peer_plain"] = f"{same}/{count}"
                if sam1 is not None:
                    p["jaxspec_sam_tokens_per_s"] = subset_tokens_per_s(sam1, count)
                    p["sam_over_best_lookup"] = p["jaxspec_sam_tokens_per_s"] / best
                report["peers"].append(p)
                print(f"peer {workload:10s} T={temperature:g}: plain {p['plain']['tokens_per_s']:.1f}, lookup 3 "
                      f"{p['prompt_lookup_3']['tokens_per_s']:.1f}, lookup 10 "
                      f"{p['prompt_lookup_10']['tokens_per_s']:.1f}"
                      f" tok/s; sam / best lookup {fmt(p.get('sam_over_best_lookup'))}x; none == peer plain "
                      f"{p.get('none_equals_peer_plain', '-')} (+{time.perf_counter() - t0:.0f} s)", flush=True)

    # 5. the plot: adaptive configs, at batch 1 where it ran (else the first batch)
    plot_batch = args.plot_batch if args.plot_batch in batches else batches[0]
    curves = []
    for workload, runs in report["runs"].items():
        for r in runs:
            if r["method"] in args.plot_methods.split(",") and r["K"] == DEFAULT and r["batch"] == plot_batch:
                curves.append({"workload": workload, "config": r["config"], "temperature": r["temperature"],
                               "batch": r["batch"], "bins": acceptance_by_position(r["_committed"], args.plot_bin)})
    report["acceptance_vs_position"] = curves
    png = out_json.parent / "acceptance_vs_position.png"
    if curves:
        plot_acceptance(curves, costs.get(plot_batch), adaptive_sam().verify_widths, plot_batch, png, args.plot_bin)

    report["targets"] = evaluate_targets(report, sam_label)
    report["total_s"] = time.perf_counter() - started
    text = markdown(report) + f"\nTotal run time: {report['total_s'] / 60:.1f} min.\n"
    print("\n" + text)
    md = out_json.with_suffix(".md")
    md.write_text(text)

    def public(x):
        if isinstance(x, dict):
            return {k: public(v) for k, v in x.items() if not str(k).startswith("_")}
        if isinstance(x, list):
            return [public(v) for v in x]
        if isinstance(x, float) and not np.isfinite(x):
            return None
        return x

    out_json.write_text(json.dumps(public(report), indent=2, default=str))
    print(f"JSON: {out_json}\nmarkdown: {md}" + (f"\nplot: {png}" if curves else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
