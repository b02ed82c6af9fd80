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

A shape's table is never waited for: until it is measured, `verify_cost` answers with a prior computed from the
model's sizes and the device (`prior_verify_cost`: bytes read and FLOPs per width, against the platform's balance
of the two) and measures the real table on a background thread while no generation runs, logging a line with the
time it took; later calls, and later processes (the table is kept on disk), get the measurement.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import inspect
import itertools
import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import sharding
from .cache import kv_bytes_per_slot
from .kernels import cpu
from .models import llama

PRIOR_RATE = 0.5  # a row's acceptance rate before it has drafted
PRIOR_WEIGHT = 4.0  # ... weighted as this many drafted tokens
EXPLORATION = 0.5  # the bonus: this over sqrt(drafted + PRIOR_WEIGHT), 0.25 before a row's first draft
COMPILE_GAIN = 0.03  # a verify width is compiled where it chooses this much better (`widths_worth_compiling`)
_RATES = np.linspace(0.0, 1.0, 41)  # the acceptance rates a width must pay at
CACHE_ENV = "JAXSPEC_VERIFY_COST"  # "off": never measure (narrowest width holding the drafts); else a directory
# An unmeasured shape: answer with the prior and measure in the background (True), or measure before answering.
BACKGROUND = True

_log = logging.getLogger(__name__)

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


@functools.lru_cache(maxsize=256)  # asked once per call; a shape's table and so its answer rarely change
def widths_worth_compiling(widths: tuple[int, ...], costs: tuple[float, ...], *, tree: bool = False,
                           gain: float = COMPILE_GAIN) -> tuple[int, ...]:
    """The fewest of `widths` (sorted, with c(w) `costs`) that choose within `gain` of the best of them all:
    for every draft length and acceptance rate, the best step among those kept commits at least 1 - `gain` of
    the best step's tokens per unit of cost. Width 1, the plain step, is kept wherever it is offered.

    Each width is one more target forward in the loop's program, and so seconds of compile before the first
    token. The width choice (`choose_width`, `choose_tree_width`) never runs a width that costs as much as a
    wider one, nor one whose extra drafts do not repay its cost at any rate; those are left out. A chain's m
    scored drafts commit E(m) = 1 + a + ... + a^m at rate a; a tree's best m nodes commit between that (nodes
    along one path) and 1 + m a (nodes side by side), so for trees both bounds are covered. One row stands for
    the batch: for rows that draft alike the choice's sum scales and the bound holds; a step whose rows draft
    very differently may lose somewhat more than `gain`.
    """
    if len(widths) != len(costs):
        raise ValueError(f"{len(costs)} costs for widths {widths!r}")
    w = np.asarray(widths)  # [W]
    scored = np.minimum(np.arange(w[-1])[:, None], w[None, :] - 1)  # [n drafts, W]: drafts each width scores
    a = _RATES[:, None, None]
    # `expected_committed` in NumPy: its jnp ops would compile on a process's first call (0.4 s) for a few ms of work.
    committed = [(1.0 - a ** (scored + 1)) / np.maximum(1.0 - a, 1e-9)]  # [A, n, W]; the a = 1 limit is m + 1
    committed[0][-1] = scored + 1
    if tree:
        committed.append(1.0 + a * scored)
    value = np.stack(committed) / np.asarray(costs)  # [families, A, n, W]
    best = value.max(axis=-1)
    required = [i for i, width in enumerate(widths) if width == 1]
    optional = [i for i in range(len(widths)) if i not in required]
    for size in range(0 if required else 1, len(optional) + 1):
        fits = []
        for extra in itertools.combinations(optional, size):
            keep = sorted((*required, *extra))
            worst = np.min(value[..., keep].max(axis=-1) / best)
            if worst >= 1.0 - gain:
                fits.append((worst, keep))
        if fits:
            return tuple(widths[i] for i in max(fits)[1])
    return tuple(widths)


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
def forward_code(model_type: type) -> str:
    """A digest of the source of the forward: jaxspec's (the model's layers and attention, the CPU matmul paths)
    and the file defining the target's own class (`model_type`, a custom target's module). A table measured under
    other code (another attention grouping, another kernel, an edited custom model) is measured again."""
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
             os.cpu_count(), batch, cache_len, widths, cached, attention_impl, forward_code(type(lm.module))]
    if lm.mesh is not None:  # a partitioned forward costs what its mesh and rules make it cost
        parts += [dict(lm.mesh.shape), lm.rules]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _table_key(lm, batch: int, cache_len: int, widths: tuple[int, ...], cached: int,
               attention_impl: str) -> tuple[tuple[int, ...], int, str]:
    """(the widths timed: 1 and `widths`, sorted; `cached` clamped so the widest forward fits the cache; the
    table's key)."""
    timed = tuple(sorted({1, *widths}))
    cached = max(0, min(cached, cache_len - max(timed)))
    return timed, cached, _key(lm, batch, cache_len, timed, cached, attention_impl)


def _cache_file() -> Path | None:
    where = os.environ.get(CACHE_ENV, "")
    if where == "off":
        return None
    base = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxspec"
    return base / "verify_cost.json"


def enabled() -> bool:
    """False when the environment switches measuring off (JAXSPEC_VERIFY_COST=off)."""
    return os.environ.get(CACHE_ENV, "") != "off"


# FLOPs per byte read at which a forward turns from bound by memory to bound by compute: an accelerator's peak
# matmul rate over its memory bandwidth (a few hundred on current GPUs and TPUs), and on a CPU what XLA's and the
# matmul kernel's products reach on a few cores. Only the prior uses it; a measured table replaces the prior.
_BALANCE = {"cpu": 16.0, "gpu": 200.0, "tpu": 200.0}


def prior_verify_cost(lm, *, batch: int, widths: tuple[int, ...], cached: int) -> tuple[float, ...]:
    """c(w) predicted from the model's sizes alone, nothing compiled or run: a forward over w new tokens per row
    reads every weight once and each row's K/V of `cached` + w slots, and does 2 FLOPs per weight and new token
    plus attention's over those slots. It takes as long as the larger of its bytes and its FLOPs over the
    platform's balance (`_BALANCE`) make it; c(w) is that over a one-token forward's. So a forward bound by
    memory costs about one plain step at any width, and one bound by compute grows with w (wide widths at many
    rows, on a CPU)."""
    leaves = jax.tree.leaves(lm.params)
    params = sum(x.size for x in leaves)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    kv_bytes = kv_bytes_per_slot(lm.module)  # one row, one slot
    kv_elements = kv_bytes / max(1, max(x.dtype.itemsize for x in leaves))
    queries_per_kv = getattr(lm.config, "q_per_kv", 1)
    balance = _BALANCE.get(jax.devices()[0].platform, _BALANCE["gpu"])

    def seconds(w: int) -> float:  # in units of one byte's read time
        slots = cached + w
        memory = weight_bytes + batch * slots * kv_bytes
        flops = 2.0 * batch * w * (params + slots * kv_elements * queries_per_kv)
        return max(memory, flops / balance)

    one = seconds(1)
    return tuple(float(np.float32(seconds(w) / one)) for w in widths)


def verify_cost(lm, *, batch: int, cache_len: int, widths: tuple[int, ...], cached: int,
                attention_impl: str = "xla") -> tuple[float, ...]:
    """c(w) for each width, without waiting for a measurement: the measured table where this process or the disk
    holds one (`measure_verify_cost`), else the prior (`prior_verify_cost`) while the table is measured on a
    background thread, between generations (`generating`); with BACKGROUND False, measured before answering."""
    timed, clamped, key = _table_key(lm, batch, cache_len, widths, cached, attention_impl)
    measure = functools.partial(measure_verify_cost, lm, batch=batch, cache_len=cache_len, widths=widths,
                                cached=cached, attention_impl=attention_impl)
    if not BACKGROUND or _known_table(key, batch, cache_len, timed, clamped) is not None:
        return measure()
    _BACKGROUND_JOBS.submit(key, measure, f"batch {batch}, cache {cache_len}, {clamped} cached, widths {timed}")
    return prior_verify_cost(lm, batch=batch, widths=widths, cached=clamped)


def measure_verify_cost(lm, *, batch: int, cache_len: int, widths: tuple[int, ...], cached: int,
                        attention_impl: str = "xla", repeats: int = 7) -> tuple[float, ...]:
    """c(w) for each width: the time of a target forward over w new tokens per row divided by the time of a
    forward over one, at this batch and cache size with `cached` tokens in every row's cache.

    Widths are timed interleaved (median of `repeats` rounds), so a load change on a shared machine hits them
    alike. The result is remembered for the process and in a JSON file under ~/.cache/jaxspec (or the
    directory in JAXSPEC_VERIFY_COST), keyed by model, machine, software and shapes.
    """
    timed, cached, key = _table_key(lm, batch, cache_len, widths, cached, attention_impl)
    table = _known_table(key, batch, cache_len, timed, cached)
    if table is None:
        table = _measure(lm, batch, cache_len, timed, cached, attention_impl, repeats, key)
        _remember(key, table, batch, cache_len, timed, cached)
    costs = dict(zip(timed, table))
    return tuple(costs[w] for w in widths)


def _remember(key: str, table: tuple[float, ...], batch: int, cache_len: int, timed: tuple[int, ...],
              cached: int) -> None:
    _MEMO[key] = table
    _SHAPES[key] = dict(batch=batch, cache_len=cache_len, widths=timed, cached=cached)


def _known_table(key: str, batch: int, cache_len: int, timed: tuple[int, ...],
                 cached: int) -> tuple[float, ...] | None:
    """The table of `key` this process holds, else the one on disk (then held), else None."""
    table = _MEMO.get(key)
    if table is None:
        table = _load(key)
        if table is not None:
            _remember(key, table, batch, cache_len, timed, cached)
    return table


def measured() -> list[dict]:
    """The cost tables this process measured or loaded: batch, cache_len, widths, cached and costs c(w)."""
    return [dict(shape, costs=_MEMO[key]) for key, shape in list(_SHAPES.items()) if key in _MEMO]


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
        _BACKGROUND_JOBS.pause_while_generating()
        run(w)
        run(w)
    samples = {w: [] for w in widths}
    while len(samples[1]) < repeats:  # rounds that overlapped a generation timed the contention: timed again
        started = _BACKGROUND_JOBS.pause_while_generating()
        round_ = {w: run(w) for w in widths}
        if _BACKGROUND_JOBS.undisturbed_since(started):
            for w in widths:
                samples[w].append(round_[w])
    base = statistics.median(samples[1])
    costs = tuple(float(np.float32(statistics.median(samples[w]) / base)) for w in widths)
    _store(key, costs)
    return costs


class _Stopped(Exception):
    """The process is exiting: a background measurement gives up between forwards."""


class _BackgroundMeasurements:
    """Verify-cost tables measured on one daemon thread, one shape at a time, while no generation runs.

    A generation in flight (`generating`) pauses the thread before each compile and each timing round, and a
    round it overlapped is timed again: a forward timed beside a decode loop measures the contention. At exit
    the thread stops between forwards (it is joined, so no compile is cut off mid-way)."""

    def __init__(self):
        self._lock = threading.Condition()
        self._jobs: dict[str, tuple] = {}  # key -> (measure, what), in submission order
        self._thread: threading.Thread | None = None
        self._busy = 0  # generations in flight
        self._started = 0  # generations started so far
        self._stopping = False

    def submit(self, key: str, measure, what: str) -> None:
        with self._lock:
            if key in self._jobs or self._stopping:
                return
            self._jobs[key] = (measure, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxspec-verify-cost", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted table is measured (True) or `timeout` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    @contextlib.contextmanager
    def generating(self):
        with self._lock:
            self._busy += 1
            self._started += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()

    def pause_while_generating(self) -> int:
        """On the measuring thread: wait until no generation runs; returns the count of generations started so
        far. Elsewhere (a measurement asked for directly) returns at once."""
        if threading.current_thread() is not self._thread:
            return 0
        with self._lock:
            while self._busy and not self._stopping:
                self._lock.wait(0.5)
            if self._stopping:
                raise _Stopped
            return self._started

    def undisturbed_since(self, started: int) -> bool:
        """Whether no generation ran since `pause_while_generating` returned `started` (always, off the thread)."""
        if threading.current_thread() is not self._thread:
            return True
        with self._lock:
            return self._busy == 0 and self._started == started

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs or self._stopping:
                    self._thread = None
                    self._jobs.clear()
                    self._lock.notify_all()
                    return
                key, (measure, what) = next(iter(self._jobs.items()))
            try:
                self.pause_while_generating()  # nothing, not even a compile, beside a generation
                t0 = time.perf_counter()
                costs = measure()
                _log.info("measured the verify cost c(w) = %s at %s in %.1f s",
                          ", ".join(f"{c:.2f}" for c in costs), what, time.perf_counter() - t0)
            except _Stopped:
                pass
            except Exception:  # the prior stays in use; the next process measures again
                _log.warning("measuring the verify cost at %s failed", what, exc_info=True)
            with self._lock:
                self._jobs.pop(key, None)
                self._lock.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
            self._lock.notify_all()
        if thread is not None:
            thread.join()


_BACKGROUND_JOBS = _BackgroundMeasurements()
atexit.register(_BACKGROUND_JOBS.stop)


def generating():
    """A context manager marking a generation in flight (`generate`, a rollout): background measurements pause."""
    return _BACKGROUND_JOBS.generating()


def forget_measured() -> None:
    """Forget the verify-cost tables this process holds, so the next call that needs one reads the cache file
    again (`CACHE_ENV`), or measures where the file has none: after the machine's load changed, or after the
    file was replaced. The file itself is left as it is."""
    _MEMO.clear()
    _SHAPES.clear()


def wait_measured(timeout: float | None = None) -> bool:
    """Block until every verify-cost table started in the background is measured (True), or `timeout` seconds
    pass (False). A benchmark calls it after its warm-up, so that its timed calls run with measured tables and
    no measurement beside them."""
    return _BACKGROUND_JOBS.wait(timeout)
