"""Runs a configuration on a workload's prompts: compiled first, then timed, then summarised into one dict."""

from __future__ import annotations

import statistics
import time

import numpy as np

import jaxspec
from jaxspec import SamplingParams
from jaxspec.decode import decode as decode_jit
from jaxspec.decode import prefill as prefill_jit
from jaxspec.shapes import bucket_shapes

from ..acceptance import pooled_acceptance_length
from ..timing import clocked, repeat
from .configs import Config, Plan
from .cost import cost_of


def shape_key(rows: list[list[int]], new_tokens: int) -> tuple:
    """The shapes `jaxspec.generate` compiles for: batch, prompt, buffer, cache."""
    return (len(rows),) + bucket_shapes([len(p) for p in rows], new_tokens)


def compiled_programs() -> int:
    """Programs jit has compiled for the decode loop and prefill so far: a timed run must not add any."""
    return decode_jit._cache_size() + prefill_jit._cache_size()


class Runner:
    """Runs configurations on prompt batches, compiling each (configuration, shapes) once before timing."""

    def __init__(self, lm, new_tokens: int, ignore_eos: bool, seed: int, repeats: int, attention_impl: str):
        self.lm, self.new_tokens, self.ignore_eos, self.seed, self.repeats = lm, new_tokens, ignore_eos, seed, repeats
        self.attention_impl = attention_impl  # "xla" or "pallas", for every generation it runs
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

        A row whose greedy first token differs in this batch (a near tie) stops at the length limit instead: the
        smallest from half the output buffer up that keeps every shape (buffer and cache) of the timed run.
        """
        shapes = shape_key(rows, self.new_tokens)
        key = (config.spec, shapes)
        if key in self.warm:
            return
        self.learn_first_tokens(rows)
        stops = [[self.first_tokens[tuple(p)]] * self.stop_width for p in rows]
        bucket = bucket_shapes([1], self.new_tokens)[1]
        limit = next(n for n in range(min(self.new_tokens, bucket // 2 + 1), self.new_tokens + 1)
                     if shape_key(rows, n) == shapes)
        jaxspec.generate(self.lm, rows, max_new_tokens=limit, ignore_eos=True, stop_token_ids=stops,
                         spec=config.spec, attention_impl=self.attention_impl)
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

        def warm_up_all():
            for idx in calls:
                self.warm_up(config, [prompts[i] for i in idx])

        def all_calls():
            return [jaxspec.generate(self.lm, [prompts[i] for i in idx], max_new_tokens=self.new_tokens,
                                     sampling=self.sampling(temperature, idx), ignore_eos=self.ignore_eos,
                                     spec=config.spec, attention_impl=self.attention_impl) for idx in calls]

        warmup_s, _ = clocked(warm_up_all)
        before = compiled_programs()
        repeats = repeat(all_calls, self.repeats, warmup=0)  # warm_up compiled them, on cheaper generations
        compiled = compiled_programs() - before
        seconds = [sum(r.stats.prefill_s + r.stats.decode_s for r in results) for results in repeats]
        results = repeats[int(np.argsort(seconds)[len(seconds) // 2])]  # the median repeat
        out = summarise(config, batch, temperature, calls, results, statistics.median(seconds), compiled)
        out["warmup_s"] = warmup_s
        return out


def summarise(config: Config, batch: int, temperature: float, calls, results, seconds: float, compiled: int) -> dict:
    """One run's figures over all its calls; the `_` keys stay in memory only (kept out of the JSON)."""
    rows = [row for r in results for row in r.stats.rows]
    generated = sum(r.stats.generated_tokens for r in results)
    steps = sum(r.stats.steps for r in results)
    decode_s = sum(r.stats.decode_s for r in results)
    k = config.max_k
    drafted_at = np.sum([r.stats.drafted_per_position for r in results], axis=0) if k else np.zeros(0)
    accepted_at = np.sum([r.stats.accepted_per_position for r in results], axis=0) if k else np.zeros(0)
    row_steps = sum(r.stats.row_steps for r in results)
    return {
        "config": config.label, "method": config.method, "K": config.k, "max_K": k, "batch": batch,
        "temperature": temperature, "prompts": [i for idx in calls for i in idx], "generated_tokens": generated,
        "seconds": seconds, "tokens_per_s": generated / seconds,
        "decode_tokens_per_s": (generated - sum(r.stats.num_rows for r in results)) / decode_s,
        "steps": steps, "ms_per_step": 1000 * decode_s / steps if steps else float("nan"),
        "row_steps": row_steps, "mean_acceptance_length": pooled_acceptance_length(r.stats for r in results),
        "drafted": int(sum(r.stats.drafted for r in results)), "accepted": int(sum(r.stats.accepted for r in results)),
        "acceptance_rate_per_position": [float(a / d) if d else None for a, d in zip(accepted_at, drafted_at)],
        "compiled_during_timing": compiled,
        # kept in memory for the checks, the peers' subset and the plot; dropped from the JSON
        "_outputs": [t for r in results for t in r.token_ids],
        "_committed": [r.committed_per_step for r in rows],
        "_per_call": [(r.stats.prefill_s + r.stats.decode_s, r.stats.generated_tokens) for r in results],
    }


def run_workload(runner: Runner, workload: str, prompts: list[list[int]], configs: list[Config], plan: Plan,
                 costs: dict[int, list[dict]]) -> list[dict]:
    """Every configuration the plan puts at each batch and temperature, on one workload's prompts (batch 1 on
    the first `plan.batch1_limit` of them), with c(K + 1) from the measured curves. Progress on stdout."""
    runs = []
    runner.learn_first_tokens(prompts)
    for batch in plan.batches:
        use = prompts[: plan.batch1_limit] if batch == 1 else prompts
        for temperature in plan.temperatures:
            for config in configs:
                if not plan.runs(config, batch, temperature):
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
    return runs
