"""What a step's proposer work and rejection sampling cost on their own, at the real shapes."""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import SamplingParams
from jaxspec.builders import build_proposer
from jaxspec.proposers.base import Committed, Context
from jaxspec.sampling import row_keys

from ..timing import repeat, timer
from .configs import Config
from .runner import shape_key


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
    """Median ms of `fn` (blocked on), after two calls: the first compiles, the second settles caches."""
    return 1000 * statistics.median(repeat(timer(lambda: jax.block_until_ready(fn())), repeats, warmup=2))


def measure_overhead(lm, config: Config, rows: list[list[int]], outputs: list[list[int]], new_tokens: int,
                     temperatures: list[float], repeats: int) -> dict:
    """ms of propose + update and of rejection sampling at the real shapes, per temperature.

    The rows' histories hold their prompt and the first half of a real output (the `none` run's), so lookups
    search realistic text. Rejection sampling is timed at each verify width the configuration compiles (the
    loop picks the narrowest one holding the batch's longest draft).
    """
    batch, width, buffer_len, cache_len = shape_key(rows, new_tokens)
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


def add_overheads(lm, runs_by_workload: dict[str, list[dict]], prompts: dict[str, list[list[int]]],
                  configs: list[Config], new_tokens: int, repeats: int) -> None:
    """Adds `overhead` to every batch-8 run of a speculative configuration: its standalone costs, in ms and as a
    share of the run's measured step, on the batch-8 `none` run's prompts and outputs. Progress on stdout."""
    for workload, runs in runs_by_workload.items():
        none8 = next(r for r in runs if r["method"] == "none" and r["batch"] == 8)
        rows = [prompts[workload][i] for i in none8["prompts"][:8]]
        for config in (c for c in configs if c.method != "none"):
            at8 = [r for r in runs if r["config"] == config.label and r["batch"] == 8]
            if not at8:
                continue
            temps = [r["temperature"] for r in at8]
            t0 = time.perf_counter()
            ov = measure_overhead(lm, config, rows, none8["_outputs"][:8], new_tokens, temps, repeats)
            for r in at8:
                o = dict(ov[str(r["temperature"])])
                o["share_min"] = (o["propose_update_ms"] + o["rejection_ms_min"]) / r["ms_per_step"]
                o["share"] = (o["propose_update_ms"] + o["rejection_ms"]) / r["ms_per_step"]
                r["overhead"] = o
            print(f"overhead {workload:10s} {config.label:18s} " + ", ".join(
                f"T={t:g}: propose+update {ov[str(t)]['propose_update_ms']:.2f} ms, rejection by verify width "
                + ", ".join(f"{w}: {ms:.2f}" for w, ms in ov[str(t)]["rejection_ms_by_width"].items()) + " ms"
                for t in temps) + f" (+{time.perf_counter() - t0:.0f} s)", flush=True)
