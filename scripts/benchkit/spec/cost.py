"""c(T): what a target forward over T new tokens per row costs, as a multiple of the T = 1 decode forward.

Verifying K drafts costs c(K + 1) decode steps, so a method pays only when its mean acceptance length beats it.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..timing import interleave, timer


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
                       num_forwards: int, attention_impl: str) -> list[dict]:
    """ms per target forward over T new tokens per row with `context` tokens already cached, and c(T).

    Each timed call runs `num_forwards` forwards in one jitted loop. The calls go round-robin over the Ts
    (`repeats` rounds), so a burst of load on this shared machine hits every T alike; the median per T over the
    rounds, divided by `num_forwards`, is reported.
    """
    cache = lm.module.new_cache(batch, cache_len)
    # One cache threads through every call: each call donates it and gets the updated one back.
    carry = {"cache": cache.replace(lengths=jnp.full((batch,), context, jnp.int32))}

    def forwards(t: int):
        tokens = jnp.asarray(np.random.default_rng(t).integers(100, 40000, (batch, t)), jnp.int32)
        positions = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))

        def call():
            carry["cache"], acc = _forwards(lm.graphdef, lm.params, tokens, positions, carry["cache"],
                                            num_forwards=num_forwards, attention_impl=attention_impl)
            acc.block_until_ready()

        return call

    times = interleave({t: timer(forwards(t)) for t in ts}, repeats)  # the warm-up call compiles each T
    rows = [{"T": t, "ms": 1000 * statistics.median(times[t]) / num_forwards} for t in ts]
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


def cost_curves(lm, batches: list[int], ts: list[int], context: int, cache_len: int, repeats: int,
                num_forwards: int, attention_impl: str) -> dict[int, list[dict]]:
    """c(T) at each batch size (T = 1 always included, as the reference), with progress on stdout;
    `attention_impl` ("xla" or "pallas") is the attention of every forward."""
    ts = sorted(set(ts) | {1})
    curves = {}
    for batch in batches:
        t0 = time.perf_counter()
        curves[batch] = measure_cost_curve(lm, batch, ts, context, cache_len, repeats, num_forwards,
                                            attention_impl)
        print(f"c(T), batch {batch} ({time.perf_counter() - t0:.0f} s): "
              + ", ".join(f"c({r['T']})={r['c']:.2f}" for r in curves[batch]), flush=True)
    return curves
