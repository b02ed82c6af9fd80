"""Cost-aware verification: each step's verify width chosen from measured forward costs and acceptance.

A target forward over w new tokens per row costs c(w) plain decode steps. c(w) depends on the machine, the
backend, the batch and the cache, so it is measured for the compiled shapes (`measure_verify_cost`), cached
in memory and on disk, and never assumed. A chain draft is accepted up to its first rejection, so a row
whose drafts are accepted with probability a each and that has m of them scored commits in expectation

    E(m) = 1 + a + a^2 + ... + a^m          (the target always adds one token of its own)

Each step runs the compiled width w maximising  sum over the rows furthest behind of E(min(n_row, w - 1)) /
c(w):  a batch ends with its last row, so only the active rows with the most tokens left to generate count
(`furthest_behind`); drafts past w are not scored this step. A draft tree whose nodes come best first scores its
best w - 1 nodes, each expected to be accepted with its path's draft probability (`choose_tree_width`). A
shorter draft is still a draft, so the choice never changes what is committed, only how fast. The rate a is the
row's running acceptance (accepted / drafted so far), pulled towards a prior while the row has drafted little: a
row whose drafts keep failing stops paying for wide forwards, one whose drafts keep landing keeps them. The
choice uses the rate plus an exploration bonus that shrinks as 1 / sqrt(drafts scored) (an upper confidence
bound): the estimate only moves when drafts are scored, so a row whose prior rate never repays a wider forward
would otherwise never draft and never learn that its drafts land.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import sharding

PRIOR_RATE = 0.5  # a row's acceptance rate before it has drafted
PRIOR_WEIGHT = 4.0  # ... weighted as this many drafted tokens
EXPLORATION = 0.5  # the bonus: this over sqrt(drafted + PRIOR_WEIGHT), 0.25 before a row's first draft
CACHE_ENV = "JAXSPEC_VERIFY_COST"  # "off": never measure (narrowest width holding the drafts); else a directory

_MEMO: dict[str, tuple[float, ...]] = {}  # key -> c(w) for the sorted widths timed (1 first)
_SHAPES: dict[str, dict] = {}  # key -> the shapes it was measured at, for reports
_COMPILE_S = [0.0]  # seconds this process spent tracing, lowering and compiling (`compile_seconds`)


def _count_compile(event: str, duration_secs: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        _COMPILE_S[0] += duration_secs


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_seconds() -> float:
    """Seconds this process has spent so far tracing, lowering and compiling jitted programs (JAX's own
    compile events). A timer subtracts the difference over what it timed, so a chunk that compiled its program
    counts what it ran, not what it compiled."""
    return _COMPILE_S[0]


def acceptance_rate(accepted: jax.Array, drafted: jax.Array) -> jax.Array:
    """f32[B]: each row's running draft acceptance rate, with the prior (i32[B] counts so far)."""
    return (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)


def optimistic_rate(accepted: jax.Array, drafted: jax.Array) -> jax.Array:
    """f32[B]: the running rate plus the exploration bonus, at most 1: what the width choice assumes. From the
    prior it is 0.75; after 100 drafts at a true rate of 0.3 it is about 0.36, so a row stops drafting once its
    drafts have shown they do not repay the wider forward."""
    bonus = EXPLORATION / jnp.sqrt(drafted + PRIOR_WEIGHT)
    return jnp.minimum(acceptance_rate(accepted, drafted) + bonus, 1.0)


def expected_committed(rate: jax.Array, scored: jax.Array) -> jax.Array:
    """f32[...]: 1 + a + ... + a^m, the tokens a chain with m = `scored` drafts of acceptance `rate` commits."""
    rate = jnp.clip(rate, 0.0, 1.0 - 1e-6)  # a = 1 would divide by zero; the limit is m + 1
    return (1.0 - rate ** (scored + 1)) / (1.0 - rate)


def furthest_behind(remaining: jax.Array, active: jax.Array) -> jax.Array:
    """bool[B]: the active rows with the most tokens left to generate (remaining i32[B]), the ones the batch's
    last step waits for. A batch runs until its last row is done, so a draft scored for a row ahead of them
    commits tokens earlier without ending the batch any sooner, while the wider forward costs every row. The
    width choice weighs only these rows' expected tokens (a row that ends early on a stop token is not foreseen)."""
    most = jnp.max(jnp.where(active, remaining, jnp.iinfo(jnp.int32).min))
    return active & (remaining == most)


def choose_width(widths: tuple[int, ...], verify_cost: jax.Array, num_draft: jax.Array, rate: jax.Array,
                 counted: jax.Array) -> jax.Array:
    """i32[] index into `widths` maximising expected committed tokens per unit of forward cost.

    verify_cost f32[W] is c(w) per compiled width; num_draft i32[B] the drafts each row proposed; rate f32[B]
    its acceptance estimate; counted bool[B] the rows whose tokens count (the loop passes `furthest_behind`;
    never a finished row). Ties go to the narrower width.
    """
    scored = jnp.minimum(num_draft[:, None], jnp.asarray(widths, jnp.int32)[None, :] - 1)  # i32[B, W]
    committed = jnp.sum(jnp.where(counted[:, None], expected_committed(rate[:, None], scored), 0.0), axis=0)  # [W]
    return jnp.argmax(committed / verify_cost).astype(jnp.int32)


def choose_tree_width(widths: tuple[int, ...], verify_cost: jax.Array, num_draft: jax.Array,
                      confidence: jax.Array, counted: jax.Array) -> jax.Array:
    """i32[] index into `widths` maximising expected committed tokens per unit of forward cost, for draft trees
    whose nodes come best first (`jaxspec.tree.select_nodes`), so a width w scores the best tree of w - 1 nodes.

    A node is accepted exactly when its whole path is, so a tree commits in expectation 1 + the sum over its
    nodes of the chance each path is accepted. The draft's own path probability (confidence f32[B, K]) is
    that chance if the head's distribution were the target's: the estimate EAGLE-2 grows its trees by.
    verify_cost f32[W] is c(w); num_draft i32[B] each row's valid nodes; counted bool[B] the rows whose tokens
    count, as in `choose_width`. Ties go to the narrower width.
    """
    k = confidence.shape[1]
    scored = jnp.arange(k)[None, :] < num_draft[:, None]  # bool[B, K]
    gained = jnp.cumsum(jnp.where(scored & counted[:, None], confidence, 0.0), axis=1)  # f32[B, K]
    # Committed over the batch with the first w - 1 nodes of each row: one token per counted row plus their
    # nodes' chances.
    nodes = jnp.asarray(widths, jnp.int32) - 1  # i32[W]
    prefix = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.sum(gained, axis=0)])  # f32[K+1]
    committed = jnp.sum(counted) + prefix[jnp.minimum(nodes, k)]  # f32[W]
    return jnp.argmax(committed / verify_cost).astype(jnp.int32)


def narrowest_holding(widths: tuple[int, ...], num_draft: jax.Array) -> jax.Array:
    """i32[] index of the narrowest width that holds the batch's longest draft (no cost table)."""
    return jnp.sum(jnp.asarray(widths[:-1]) < jnp.max(num_draft) + 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "attention_impl"), donate_argnames=("cache",))
def _forward(graphdef, params, cache, tokens: jax.Array, *, attention_impl: str):
    """One verify-shaped target forward over tokens i32[B, w] after the cache's rows; the cache is donated and
    returned (K/V written in place, lengths unchanged), as inside the decode loop."""
    model = nnx.merge(graphdef, params)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    out, cache = model(tokens, positions, cache, attention_impl=attention_impl)
    return out.logits, cache


@functools.cache
def _forward_code(model_type: type) -> str:
    """A digest of the source of the forward: jaxspec's (the model's layers and attention, the CPU matmul paths)
    and the file defining the target's own class (`model_type`, a custom target's module). A table measured under
    other code (another attention grouping, another kernel, an edited custom model) is measured again."""
    from .kernels import cpu
    from .models import llama
    files = [Path(llama.__file__), Path(cpu.__file__), Path(cpu.__file__).with_name("small_matmul.cc")]
    try:
        own = inspect.getsourcefile(model_type)
    except TypeError:  # a class without a source file (built-in, or defined where no file holds it)
        own = None
    if own is not None:
        files.append(Path(own))
    files = list(dict.fromkeys(f.resolve() for f in files))  # the shipped Llama's file counts once
    return hashlib.sha256(b"".join(f.read_bytes() for f in files if f.exists())).hexdigest()[:16]


def _key(lm, batch: int, cache_len: int, widths: tuple[int, ...], cached: int, attention_impl: str) -> str:
    device = jax.devices()[0]
    parts = [lm.name, repr(lm.config), jax.__version__, device.platform, getattr(device, "device_kind", ""),
             os.cpu_count(), batch, cache_len, widths, cached, attention_impl, _forward_code(type(lm.module))]
    if lm.mesh is not None:  # a partitioned forward costs what its mesh and rules make it cost
        parts += [dict(lm.mesh.shape), lm.rules]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _cache_file() -> Path | None:
    where = os.environ.get(CACHE_ENV, "")
    if where == "off":
        return None
    base = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxspec"
    return base / "verify_cost.json"


def enabled() -> bool:
    """False when the environment switches measuring off (JAXSPEC_VERIFY_COST=off)."""
    return os.environ.get(CACHE_ENV, "") != "off"


def measure_verify_cost(lm, *, batch: int, cache_len: int, widths: tuple[int, ...], cached: int,
                        attention_impl: str = "xla", repeats: int = 7) -> tuple[float, ...]:
    """c(w) for each width: the time of a target forward over w new tokens per row divided by the time of a
    forward over one, at this batch and cache size with `cached` tokens in every row's cache.

    Widths are timed interleaved (median of `repeats` rounds), so a load change on a shared machine hits them
    alike. The result is remembered for the process and in a JSON file under ~/.cache/jaxspec (or the
    directory in JAXSPEC_VERIFY_COST), keyed by model, machine, software and shapes.
    """
    timed = tuple(sorted({1, *widths}))
    cached = max(0, min(cached, cache_len - max(timed)))
    key = _key(lm, batch, cache_len, timed, cached, attention_impl)
    if key not in _MEMO:
        _MEMO[key] = _load(key) or _measure(lm, batch, cache_len, timed, cached, attention_impl, repeats, key)
        _SHAPES[key] = dict(batch=batch, cache_len=cache_len, widths=timed, cached=cached)
    costs = dict(zip(timed, _MEMO[key]))
    return tuple(costs[w] for w in widths)


def measured() -> list[dict]:
    """The cost tables this process measured or loaded: batch, cache_len, widths, cached and costs c(w)."""
    return [dict(_SHAPES[key], costs=_MEMO[key]) for key in _SHAPES]


def _load(key: str) -> tuple[float, ...] | None:
    path = _cache_file()
    try:
        entry = json.loads(path.read_text()).get(key) if path is not None and path.exists() else None
    except (OSError, ValueError):
        return None  # a damaged or unreadable cache is measured again
    return tuple(float(c) for c in entry) if entry else None


def _store(key: str, costs: tuple[float, ...]) -> None:
    path = _cache_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = json.loads(path.read_text()) if path.exists() else {}
        table[key] = list(costs)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(path)  # atomic: concurrent processes never read half a file
    except (OSError, ValueError):
        pass  # the cache only saves time; measuring again next process is correct


def _measure(lm, batch: int, cache_len: int, widths: tuple[int, ...], cached: int, attention_impl: str,
             repeats: int, key: str) -> tuple[float, ...]:
    cache = nnx.merge(lm.graphdef, lm.params).new_cache(batch, cache_len)
    cache = cache.replace(lengths=jnp.full((batch,), cached, jnp.int32))
    if lm.mesh is not None:  # rows where a decode on the model's mesh keeps them
        cache = sharding.put_rows(cache, lm.mesh, lm.rules, batch)

    def run(width: int) -> float:
        nonlocal cache
        tokens = jnp.zeros((batch, width), jnp.int32)
        if lm.mesh is not None:
            tokens = sharding.put_rows(tokens, lm.mesh, lm.rules, batch)
        t0 = time.perf_counter()
        logits, cache = _forward(lm.graphdef, lm.params, cache, tokens, attention_impl=attention_impl)
        logits.block_until_ready()
        return time.perf_counter() - t0

    for w in widths:  # compile and warm each width first
        run(w)
        run(w)
    samples = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            samples[w].append(run(w))
    base = statistics.median(samples[1])
    costs = tuple(float(np.float32(statistics.median(samples[w]) / base)) for w in widths)
    _store(key, costs)
    return costs
