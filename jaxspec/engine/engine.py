"""The `Engine`: requests in from any thread, a loop thread that schedules them onto the device's slots.

`submit` checks a request and queues it; the loop thread, at each visit, retires cancelled rows, admits waiting
requests into free slots (up to `max_prefill_batch` with one prefill call, growing the batch to a bucket that
holds them), asks the policy for draft caps, runs one chunk through the `Runner` and hands each request what its
row committed, and shrinks the batch when few rows remain. A failure stays with what caused it: a request that
cannot be admitted (alone: requests prefilled together are tried again one by one), or a callback that raises,
fails that request alone; a chunk that fails fails the running requests and the engine starts over from an
empty batch; only chunks failing again and again (a broken device) stop the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from .. import sharding
from ..limits import eos_ids
from ..logprobs import TokenLogprob
from ..models.loading import LanguageModel
from ..policy import ChunkReport, DraftPolicy
from .config import EngineConfig
from .request import (
    EngineStopped,
    Handle,
    LiveRequest,
    Output,
    QueueFull,
    Request,
    check_method,
    compiled_constraint,
    fits,
    validate,
)
from .runner import EngineMetrics, RowUpdate, Runner

_log = logging.getLogger("jaxspec.engine")

_MAX_CONSECUTIVE_FAILURES = 3  # chunks failing in a row before the engine gives up (a broken device, not a request)


class Engine:
    """Continuous batching over slots. `start()` launches the loop thread; `submit()` is thread-safe.

    `config` defaults to `EngineConfig()`, `policy` to `DraftPolicy()`; `observers` are called on the loop
    thread with ("admit" | "chunk" | "finish", info).
    """

    def __init__(self, lm: LanguageModel, config: EngineConfig | None = None,
                 policy: DraftPolicy | None = None,
                 observers: Sequence[Callable[[str, dict], None]] = ()):
        config = EngineConfig() if config is None else config
        if lm.mesh is not None:  # rows split over the mesh's data axis: batch sizes it divides
            config = config.on_data_axis(sharding.axis_size(lm.mesh, lm.rules.batch))
        context = lm.config.max_position_embeddings
        if config.cache_len > context:
            raise ValueError(f"cache_len={config.cache_len} exceeds the {context} positions model {lm.name!r} "
                             f"was trained for (max_position_embeddings); choose cache_len <= {context}")
        self.lm = lm  # the target model
        self.eos_ids = eos_ids(lm)  # the model's EOS ids: every request stops at them unless it ignores them
        self.config = config  # the static settings
        if policy is not None and not isinstance(policy, DraftPolicy):
            raise ValueError(f"policy={policy!r} must be a jaxspec.policy.DraftPolicy")
        self.policy = policy if policy is not None else DraftPolicy()  # draft caps by load
        self.observers = list(observers)  # called from the loop thread: ("chunk" | "admit" | "finish", info)
        k = config.loop_k
        # Running totals, read by the server's /metrics.
        self.metrics = EngineMetrics(drafted_per_position=np.zeros(k, np.int64),
                                     accepted_per_position=np.zeros(k, np.int64))
        # The device side; the loop thread's alone once started. Under the off policy no row ever drafts, so the
        # runner compiles its chunks at verify width 1 alone (one target forward per program, not one per width).
        self.runner = Runner(lm, config, self.metrics, speculates=self.policy.drafts)
        self.ready = threading.Event()  # set once the loop serves (or failed to start)
        self.failed: BaseException | None = None  # what stopped the loop, if anything did

        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the queue, the cancellations and the stopping flags
        self._wakeup = threading.Condition(self._lock)
        self._waiting: list[LiveRequest] = []
        self._cancelled: set[int] = set()
        # The request holding each row of the runner's batch, or None: the loop thread's alone.
        self._slots: list[LiveRequest | None] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True

    # ------------------------------------------------------------------ public API

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens a request may hold (within the model's context by construction)."""
        return self.config.max_context

    def check_method(self, method: str) -> None:
        """Raise InvalidRequest when this engine was not built with `method`."""
        check_method(method, self.config)

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest (a ValueError) naming the bad value and its field; the server answers 400."""
        validate(request, self.config, vocab_size=self.lm.config.vocab_size, eos_ids=self.eos_ids,
                 tokenizer=self.lm.tokenizer)

    def start(self, warmup: bool = True) -> "Engine":
        """Launch the loop thread (compiling first what serving needs with `warmup`: the smallest slot bucket, or
        every one without `EngineConfig.background_compile`); returns the engine."""
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="jaxspec-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, request: Request, callback: Callable[[Output], None]) -> Handle:
        """Queue a request; `callback` receives its outputs on the engine thread (keep it quick)."""
        stop_ids = validate(request, self.config, vocab_size=self.lm.config.vocab_size, eos_ids=self.eos_ids,
                            tokenizer=self.lm.tokenizer)
        if request.constraint is not None:  # compiled here (a cache hit after validate): never on the loop thread
            automaton = compiled_constraint(request.constraint, self.config, self.lm.tokenizer,
                                            self.lm.config.vocab_size)
            request = dataclasses.replace(request, constraint=automaton)
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if self.failed is not None:
                raise EngineStopped(f"the engine failed: {self.failed!r}")
            # Waiting requests that free slots will take at the next visit are not queued for long: only
            # the rest count against max_waiting, so max_waiting=0 still serves up to max_slots at once.
            # (The engine thread fills slots; a count that is one visit stale only shifts this by a chunk.)
            free = self.config.max_slots - self.num_active
            if len(self._waiting) - free >= self.config.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for {free} free slots (max_waiting="
                                f"{self.config.max_waiting}); retry later")
            live = LiveRequest(request_id=next(self._ids), request=request, callback=callback,
                               method=request.method or self.config.spec.method, stop_ids=stop_ids,
                               submitted=time.perf_counter())
            self._waiting.append(live)
            self.metrics.requests_waiting = len(self._waiting)
            self._wakeup.notify()
        return Handle(live.request_id, self._cancel)

    def shutdown(self, drain: bool = True, timeout: float | None = None, wait_compiling: bool = True) -> None:
        """Stop taking requests; finish in-flight ones (`drain`) or fail them with finish_reason "cancelled".

        Programs warm-up left compiling stop after the one in hand, which `wait_compiling` waits for: a process
        that exits (Python's own finalisation) while XLA compiles on another thread can crash. A caller that
        does not wait must end its process with `os._exit` while `compiling()` is True (the server does)."""
        with self._lock:
            self._stopping = True
            self._drain = drain
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        else:  # never started: no loop will run or fail the queued requests, so fail them here
            self._fail_all("cancelled")
        self.runner.stop_compiling(wait=wait_compiling)

    def compiling(self) -> bool:
        """Whether the compiling thread warm-up started is still compiling a program."""
        return self.runner.compiling()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the programs warm-up left compiling in the background (`EngineConfig.background_compile`)
        are ready, every slot bucket serves and speculates (True), or `timeout` seconds pass (False)."""
        if not self.ready.wait(timeout):
            return False
        return self.runner.wait_compiled(timeout)

    @property
    def started(self) -> bool:
        """Whether `start()` was called (the loop may since have stopped: `is_alive()`)."""
        return self._thread is not None

    def is_alive(self) -> bool:
        """Whether the loop thread runs now: started, and neither shut down nor failed."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        """Requests holding a slot now."""
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot now."""
        with self._lock:
            return len(self._waiting)

    def occupancy(self) -> tuple[int | None, ...]:
        """Per row of the batch the device runs now (its length is the slot bucket in use), the id of the request
        holding it (`Handle.request_id`) or None. A snapshot of the loop thread's table, which changes between
        chunks."""
        return tuple(None if s is None else s.request_id for s in self._slots)

    # ------------------------------------------------------------------ the loop thread

    def _cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def _run(self, warmup: bool) -> None:
        with sharding.use_rules(self.lm.mesh, self.lm.rules):  # the loop thread traces under the model's mesh
            self._serve(warmup)

    def _serve(self, warmup: bool) -> None:
        try:
            self._resize(self.config.slot_buckets[0])
            if warmup:
                self.runner.warmup(background=self.config.background_compile)  # ends at the smallest bucket
            self.ready.set()
            failures = 0  # chunks failed in a row
            while True:
                with self._lock:
                    stop_now = self._stopping and (not self._drain or (not self._waiting and not self.num_active))
                    if not stop_now and not self._waiting and not self.num_active and not self._cancelled:
                        self._wakeup.wait(timeout=0.5)
                        continue
                if stop_now:
                    break
                self._retire_cancelled()
                self._admit()
                if not self.num_active:
                    continue
                try:
                    self._chunk()
                    self._maybe_shrink()
                    failures = 0
                except Exception as e:  # noqa: BLE001 - the running requests fail; the engine serves on
                    failures += 1
                    if failures >= _MAX_CONSECUTIVE_FAILURES:
                        raise
                    _log.exception("decode chunk failed; failing the %d running requests", self.num_active)
                    self._reset(f"decoding failed: {e!r}")
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear about it
            _log.exception("engine loop failed")
            self.failed = e
            self.ready.set()
        finally:
            self._fail_all("error" if self.failed is not None else "cancelled")

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), []
            self._stopping = True
        error = None if self.failed is None else repr(self.failed)
        for live in waiting + [s for s in self._slots if s is not None]:
            self._finish(live, [], reason, error=error)
        self._slots = [None] * len(self._slots)

    def _resize(self, n: int) -> None:
        """Regroup the batch into n rows: the occupied rows first, then free ones."""
        keep = [i for i, s in enumerate(self._slots) if s is not None]
        self.runner.regroup(keep, n)
        self._slots = [self._slots[i] for i in keep] + [None] * (n - len(keep))

    def _reset(self, error: str) -> None:
        """Fail every running request and start over from an empty batch of the smallest bucket."""
        for live in self._slots:
            if live is not None:
                self._finish(live, [], "error", error=error)
        n = self.config.slot_buckets[0]
        self.runner.reset(n)
        self._slots = [None] * n
        self.metrics.requests_running = 0

    # ------------------------------------------------------------------ admission and cancellation

    def _admit(self) -> None:
        """Admit waiting requests into free slots, up to `max_prefill_batch` of them with each prefill call."""
        while True:
            with self._lock:
                if not self._waiting or (self._stopping and not self._drain):
                    return
                # Up to the largest slot bucket compiled: while warm-up compiles the larger ones in the
                # background, requests wait for a slot of those that serve.
                room = min(self.runner.largest_bucket - self.num_active, self.config.max_prefill_batch)
                if room <= 0:
                    return
                batch, cancelled, later = [], [], []
                # The live rows' automata and the batch's share the stack's fixed capacity: a constrained
                # request that does not fit beside them waits (in its place) for rows to finish, and those
                # behind it that fit go first.
                automata = [s.request.constraint for s in self._slots if s is not None]
                while self._waiting and len(batch) < room:
                    live = self._waiting.pop(0)
                    if live.request_id in self._cancelled:
                        self._cancelled.discard(live.request_id)
                        cancelled.append(live)
                    elif live.request.constraint is None or fits(automata + [live.request.constraint], self.config):
                        batch.append(live)
                        automata.append(live.request.constraint)
                    else:
                        later.append(live)
                self._waiting[:0] = later
                self.metrics.requests_waiting = len(self._waiting)
            for live in cancelled:
                self._finish(live, [], "cancelled")
            if not batch:  # every waiting request was looked at: none fits now
                return
            self._admit_batch(batch)

    def _admit_batch(self, batch: list[LiveRequest]) -> None:
        """Prefill `batch` together into free slots (growing the batch to a bucket that holds them). When that
        fails for several requests, each is tried again alone, so a request that cannot be admitted fails alone."""
        t0 = time.perf_counter()
        try:
            free = [i for i, s in enumerate(self._slots) if s is None]
            if len(free) < len(batch):
                self._resize(next(b for b in self.config.slot_buckets if b >= self.num_active + len(batch)))
                free = [i for i, s in enumerate(self._slots) if s is None]
            slots = free[:len(batch)]
            firsts = self.runner.admit_batch([(slot, live.request, live.method, live.stop_ids)
                                              for slot, live in zip(slots, batch)],
                                             occupied=[s is not None for s in self._slots])
        except Exception as e:  # noqa: BLE001 - a request that cannot be admitted fails alone, and is answered
            if len(batch) > 1 and not self.runner.lost():
                _log.exception("admitting %d requests together failed; admitting them one by one", len(batch))
                for live in batch:
                    self._admit_batch([live])
                return
            for live in batch:
                self._admission_failed(live, e)
            return
        admitted = time.perf_counter()
        self.metrics.prefills += 1
        for slot, live, first in zip(slots, batch, firsts):
            live.admitted = admitted
            live.prefill_s = admitted - t0
            # A row done at its first token (a stop token, or max_tokens = 1) frees its slot at once.
            self._slots[slot] = None if first.done else live
            self.metrics.prompt_tokens += len(live.request.prompt_ids)
            self._emit(live, first)
            for observer in self.observers:
                observer("admit", {"queued_s": live.queued_s, "prefill_s": live.prefill_s,
                                   "prompt_tokens": len(live.request.prompt_ids), "prefill_batch": len(batch)})
        self.metrics.requests_running = self.num_active

    def _admission_failed(self, live: LiveRequest, error: Exception) -> None:
        _log.exception("request %d: admission failed; failing that request", live.request_id)
        self._slots = [None if s is live else s for s in self._slots]
        self._finish(live, [], "error", error=f"admission failed: {error!r}")
        if self.runner.lost():
            # The failure struck after the batch was donated to a device program: the rows are gone.
            self._reset(f"the batch was lost while admitting request {live.request_id}: {error!r}")
        self.metrics.requests_running = self.num_active

    def _retire_cancelled(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        still = set()
        done_rows = []
        for rid in cancelled:
            slot = next((i for i, s in enumerate(self._slots) if s is not None and s.request_id == rid), None)
            if slot is None:
                still.add(rid)  # maybe still waiting: `_admit` drops it
                continue
            done_rows.append(slot)
            live = self._slots[slot]
            self._slots[slot] = None
            self._finish(live, [], "cancelled")
        if done_rows:
            self.runner.finish_rows(done_rows)
        with self._lock:
            waiting_ids = {w.request_id for w in self._waiting}
            self._cancelled |= {rid for rid in still if rid in waiting_ids}
        self.metrics.requests_running = self.num_active

    def _maybe_shrink(self) -> None:
        with self._lock:
            waiting = bool(self._waiting)
        active = self.num_active
        smaller = [b for b in self.config.slot_buckets if b >= max(active, 1)]
        if not waiting and smaller and smaller[0] < len(self._slots):
            self._resize(smaller[0])

    # ------------------------------------------------------------------ chunks and events

    def _chunk(self) -> None:
        n = len(self._slots)
        active = self.num_active
        caps = np.zeros((self.config.max_slots + 1,), np.int32)  # i32[max_slots + 1] by active rows
        caps[: n + 1] = self.policy.draft_caps(n, self.runner.k, waiting=len(self._waiting))
        chunk = self.runner.run_chunk(self._slots, caps)
        for i, update in chunk.rows.items():
            live = self._slots[i]
            live.counters = update.counters
            live.prediction = update.prediction
            if update.done:
                self._slots[i] = None
            self._emit(live, update)
        self.metrics.requests_running = self.num_active
        max_cap = int(caps[active])
        self.policy.observe(ChunkReport(num_slots=n, active=active, max_cap=max_cap, tokens=chunk.tokens,
                                        seconds=chunk.seconds, steps=chunk.steps))
        self.metrics.speculating = self.policy.speculating(n)
        for observer in self.observers:
            observer("chunk", {"seconds": chunk.seconds, "steps": chunk.steps, "active": active, "slots": n,
                               "tokens": chunk.tokens, "max_cap": max_cap})

    def _emit(self, live: LiveRequest, update: RowUpdate) -> None:
        """Hand a row's new tokens to its request's callback; the final event when the row is done."""
        tokens = update.tokens
        live.emitted += len(tokens)
        self.metrics.generated_tokens += len(tokens)
        if not update.done:
            if tokens:
                try:
                    live.callback(Output(token_ids=tokens, from_draft=update.from_draft, logprobs=update.logprobs))
                except Exception:  # noqa: BLE001 - one client's callback must not stop the others
                    _log.exception("request %d: callback failed; cancelling it", live.request_id)
                    self._cancel(live.request_id)
            return
        stopped = bool(tokens) and tokens[-1] in live.stop_ids
        self._finish(live, tokens, "stop" if stopped else "length", from_draft=update.from_draft,
                     logprobs=update.logprobs)

    def _finish(self, live: LiveRequest, tokens: list[int], reason: str, error: str | None = None,
                from_draft: list[bool] | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        """The request's final event (its callback hears nothing after it)."""
        stats = live.stats()
        for observer in self.observers:
            observer("finish", {"reason": reason, "stats": stats, "generated": live.emitted})
        try:
            live.callback(Output(token_ids=tokens, finish_reason=reason, stats=stats, error=error,
                                 from_draft=from_draft or [False] * len(tokens),
                                 logprobs=(logprobs or []) if live.request.logprobs is not None else None))
        except Exception:  # noqa: BLE001 - one client's callback must not stop the others
            _log.exception("request %d: callback failed", live.request_id)
