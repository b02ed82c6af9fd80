"""Continuous batching with adaptive speculation: the engine behind `scripts/serve.py`.

Requests arrive at any time and leave at any time; the device sees fixed shapes only. The engine keeps one
`DecodeState` of B rows ("slots") on the device and, in a background thread, repeats:

1. retire rows that finished or were cancelled, and admit waiting requests into free rows: each admission is
   one prefill of the request alone, written into its row in place (its first token streams right away);
2. ask the speculation policy for the draft caps of this load (`jaxspec.policy`);
3. run the jitted speculative loop (`decode_chunk`) for up to `chunk_steps` steps: rows with different
   sampling settings, methods and draft budgets share every step;
4. read back what each row committed and hand it to the request's callback.

B is one of a few compiled sizes ("slot buckets", 1 and multiples of 8 by default): a lone request runs
at batch 1, and the state grows to the next bucket when the rows are full and shrinks when few rows remain.
A row's place changes only at such a regroup, which copies the kept rows once. Per-request values
(sampling settings, seeds, limits, stop ids, method, draft budget) are arrays, so nothing recompiles as
requests come and go.

Each request chooses a proposer among those the engine was built with (`none`, `ngram`, `sam`, run together
by a `MixedProposer`; or one trained head, `medusa`, `eagle` or `eagle2`, beside `none`); its row drafts at
most min(its own budget, the policy's cap for the load) tokens, or tree nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .config import InvalidSetting, SamplingParams, SpecConfig, is_integer
from .decode import DecodeState, RowLimits, SpecCounters, decode_chunk, prefill
from .generation import _next_pow2, build_proposer, default_attention_impl
from .logprobs import TokenLogprob, to_host, window
from .models.loading import LanguageModel
from .policy import AdaptivePolicy, ChunkReport, SpeculationPolicy
from .proposers.mixed import MixedParams, MixedProposer, MixedState

log = logging.getLogger("jaxspec.engine")

SERVABLE_METHODS = ("none", "ngram", "sam")  # deterministic chain proposers: any of them share one batch
HEAD_METHODS_SERVED = ("medusa", "eagle", "eagle2")  # trained heads: one of them at a time, beside "none"
_MAX_STOP_IDS = 8
_PROMPT_BUCKET_MIN = 16
_MAX_CONSECUTIVE_FAILURES = 3  # chunks failing in a row before the engine gives up (a broken device, not a request)


class InvalidRequest(ValueError):
    """A request the engine cannot serve; `field` names the `Request` field at fault (the server maps it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class QueueFull(RuntimeError):
    """The engine's waiting queue is at `max_waiting`."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of an `Engine`: slots, cache length, the methods compiled in, chunk size, queue size."""

    max_slots: int = 8  # the most requests decoded at once
    cache_len: int = 2048  # KV slots per row: prompt + output + K + 1 must fit
    spec: SpecConfig = dataclasses.field(default_factory=lambda: SpecConfig(method="sam"))  # default method, K
    methods: tuple[str, ...] = SERVABLE_METHODS  # proposers compiled in; each request picks one
    chunk_steps: int = 8  # decode steps between host visits (streaming granularity)
    max_waiting: int = 256  # requests queued beyond the free slots; more are refused (QueueFull). 0: no queue
    slot_buckets: tuple[int, ...] | None = None  # compiled batch sizes; default 1 and multiples of 8
    attention_impl: str | None = None  # "xla" or "pallas"; None: Pallas on GPU, XLA elsewhere
    max_logprobs: int | None = 20  # most likely tokens a request may ask for per position; None: no logprobs

    def __post_init__(self):
        if self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots!r} must be >= 1")
        if self.chunk_steps < 1:
            raise ValueError(f"chunk_steps={self.chunk_steps!r} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting!r} must be >= 0")
        if self.max_logprobs is not None and not 0 <= self.max_logprobs <= 1024:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be None or in [0, 1024]")
        bad = [m for m in self.methods if m not in SERVABLE_METHODS + HEAD_METHODS_SERVED]
        if bad or not self.methods:
            raise ValueError(f"methods={self.methods!r} must be a non-empty subset of "
                             f"{SERVABLE_METHODS + HEAD_METHODS_SERVED}")
        heads = [m for m in self.methods if m in HEAD_METHODS_SERVED]
        if heads and len(set(self.methods) - {"none"}) > 1:
            # A head reads the target's features and may draft a tree or a sampled chain: it cannot share a
            # step's verification rule with other proposers.
            raise ValueError(f"methods={self.methods!r}: {heads[0]!r} is served alone (with 'none' beside it)")
        if self.spec.method not in self.methods:
            raise ValueError(f"spec.method={self.spec.method!r} must be one of methods={self.methods!r}")
        k = self.num_speculative_tokens
        if self.cache_len < k + 2 + _PROMPT_BUCKET_MIN:
            raise ValueError(f"cache_len={self.cache_len!r} is too small for K={k}")
        if self.slot_buckets is None:
            # XLA:CPU runs forwards over 2-7 rows slower than over 8 (docs/cpu-performance.md,
            # docs/BENCHMARKS.md): batch 1 or a multiple of 8.
            buckets = {1, self.max_slots} | set(range(8, self.max_slots, 8))
            object.__setattr__(self, "slot_buckets", tuple(sorted(buckets)))
        buckets = tuple(sorted(set(self.slot_buckets)))
        if min(buckets) < 1 or max(buckets) != self.max_slots:
            raise ValueError(f"slot_buckets={self.slot_buckets!r} must be >= 1 and end at max_slots={self.max_slots}")
        object.__setattr__(self, "slot_buckets", buckets)

    @property
    def num_speculative_tokens(self) -> int:
        """K: the engine's draft budget (the default method's, or 8 when that method is `none`)."""
        return self.spec.num_speculative_tokens or 8

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens a row may hold: verification writes K + 1 slots past the newest token."""
        return self.cache_len - self.num_speculative_tokens - 1


@dataclasses.dataclass
class Request:
    """One generation request as the engine takes it: token ids in, settings beside them."""

    prompt_ids: list[int]  # the prompt, tokenized (chat template applied by the caller)
    max_tokens: int  # the most new tokens
    sampling: SamplingParams = SamplingParams()  # scalars
    stop_token_ids: tuple[int, ...] = ()  # beside the model's EOS
    ignore_eos: bool = False  # keep generating past the model's EOS (stop_token_ids still stop)
    method: str | None = None  # None: the engine's default method
    num_speculative_tokens: int | None = None  # None: the engine's K
    logprobs: int | None = None  # also return each token's log-probability and this many most likely tokens


@dataclasses.dataclass(frozen=True)
class RequestStats:
    """Counts and timings of one request, on its final `Output`."""

    steps: int  # decode steps the request's row was active in
    drafted: int  # draft tokens scored by the target
    accepted: int  # accepted drafts that were emitted
    queued_s: float  # from submission to admission
    prefill_s: float  # seconds of the request's prefill

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per step: accepted drafts plus the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else float("nan")


@dataclasses.dataclass(frozen=True)
class Output:
    """What a request's row committed since the last event; `finish_reason` is set on its final event."""

    token_ids: list[int]  # the tokens committed since the previous event
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    stats: RequestStats | None = None  # on the final event
    error: str | None = None  # what went wrong, with finish_reason "error"


class Handle:
    """A submitted request: `cancel()` frees its row within one chunk (no further events after the final one)."""

    def __init__(self, engine: "Engine", request_id: int):
        self._engine = engine
        self.request_id = request_id  # the engine's id of the request

    def cancel(self) -> None:
        """Stop the request if it has not finished: its callback gets a final event, finish_reason "cancelled"."""
        self._engine._cancel(self.request_id)


@dataclasses.dataclass
class _Live:
    """Host-side bookkeeping of one admitted or waiting request."""

    request_id: int
    request: Request
    callback: Callable[[Output], None]
    method: str
    stop_ids: np.ndarray  # i32[_MAX_STOP_IDS]
    submitted: float
    admitted: float = 0.0
    prefill_s: float = 0.0
    emitted: int = 0  # generated tokens handed to the callback
    counters: tuple[int, int, int] = (0, 0, 0)  # steps, drafted, accepted at the last read


@dataclasses.dataclass
class EngineMetrics:
    """Running totals the server exports; read without a lock (monotone counters and gauges)."""

    requests_running: int = 0
    requests_waiting: int = 0
    num_slots: int = 0  # the compiled batch the last chunk ran at
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # decode loop steps (each one target forward)
    row_steps: int = 0  # active rows summed over steps
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: np.ndarray | None = None  # i64[K]
    accepted_per_position: np.ndarray | None = None
    speculating: bool = True


class Engine:
    """Continuous batching over slots. `start()` launches the loop thread; `submit()` is thread-safe."""

    def __init__(self, lm: LanguageModel, config: EngineConfig = EngineConfig(),
                 policy: SpeculationPolicy | None = None,
                 observers: Sequence[Callable[[str, dict], None]] = ()):
        context = lm.config.max_position_embeddings
        if config.cache_len > context:
            raise ValueError(f"cache_len={config.cache_len} exceeds the {context} positions model {lm.name!r} "
                             f"was trained for (max_position_embeddings); choose cache_len <= {context}")
        self.lm = lm
        self.eos_ids = tuple(lm.tokenizer.eos_token_ids) if lm.tokenizer is not None else ()
        self.config = config
        self.policy = policy if policy is not None else AdaptivePolicy()
        self.observers = list(observers)  # called from the loop thread: ("chunk" | "admit" | "finish", info)
        self.attention_impl = config.attention_impl or default_attention_impl()
        k = config.num_speculative_tokens
        self.k = k
        self.widths = self._widths(config)
        # Rows of method "none" draft nothing (their budget is 0); the others pick a member proposer.
        self._drafting = tuple(m for m in config.methods if m != "none")
        members, member_params = [], []
        for method in self._drafting or ("ngram",):  # with no drafting method, a member that never drafts
            spec = config.spec if method == config.spec.method else SpecConfig(method=method)
            proposer, params = build_proposer(lm, dataclasses.replace(spec, num_speculative_tokens=k,
                                                                      verify_widths=None),
                                              prompt_width=0, buffer_len=config.cache_len,
                                              cache_len=config.cache_len)
            members.append(proposer)
            member_params.append(params)
        self.proposer = MixedProposer(tuple(members), k)
        self._member_params = tuple(member_params)
        self.metrics = EngineMetrics(drafted_per_position=np.zeros(k, np.int64),
                                     accepted_per_position=np.zeros(k, np.int64))

        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: list[_Live] = []
        self._cancelled: set[int] = set()
        self._slots: list[_Live | None] = []
        self._state: DecodeState | None = None
        self._empty_row: DecodeState | None = None
        self._steps_read = 0  # the loop's step counter at the last read (a regroup keeps the larger state's)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True
        self.ready = threading.Event()
        self.failed: BaseException | None = None

    # ------------------------------------------------------------------ configuration

    @staticmethod
    def _widths(config: EngineConfig) -> tuple[int, ...]:
        k = config.num_speculative_tokens
        widths = config.spec.verify_widths if config.spec.method != "none" else (1, k + 1)
        return tuple(sorted({1, *widths, k + 1}))

    @property
    def _logprob_window(self) -> int:
        """History slots read back per row after a chunk: a chunk commits at most chunk_steps * (K + 1)
        tokens a row, so one fixed-size window (one compiled program per slot bucket) always holds them."""
        return min(self.config.chunk_steps * (self.k + 1), self.config.cache_len)

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens a request may hold (within the model's context by construction)."""
        return self.config.max_context

    def check_method(self, method: str) -> None:
        """Raise InvalidRequest when this engine was not built with `method`."""
        if method not in self.config.methods:
            raise InvalidRequest("method", f"method={method!r} is not served; choose one of {self.config.methods}")

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest (a ValueError) naming the bad value and its field; the server answers 400."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequest("prompt_ids", "prompt is empty: at least one token is needed")
        vocab = self.lm.config.vocab_size
        if not all(is_integer(t) for t in request.prompt_ids):
            raise InvalidRequest("prompt_ids", "prompt_ids must be integers")
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest("prompt_ids", f"prompt has token id {bad[0]} outside [0, {vocab})")
        limit = self.config.max_context
        if n >= limit:
            raise InvalidRequest("prompt_ids",
                                 f"prompt has {n} tokens; the context holds {limit} (prompt + max_tokens)")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"max_tokens={request.max_tokens!r} must be an integer >= 1")
        if n + request.max_tokens > limit:
            raise InvalidRequest("max_tokens", f"max_tokens={request.max_tokens} with a {n}-token prompt needs "
                             f"{n + request.max_tokens} tokens of context; the context holds {limit}")
        self.check_method(request.method or self.config.spec.method)
        self._check_sampling(request.sampling)
        top = request.logprobs
        if top is not None:
            most = self.config.max_logprobs
            if most is None:
                raise InvalidRequest("logprobs",
                                     "logprobs are not served (the engine was built with max_logprobs=None)")
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= most:
                raise InvalidRequest("logprobs", f"logprobs={top!r} must be an integer in [0, {most}]")
        k = request.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.k):
            raise InvalidRequest("num_speculative_tokens",
                                 f"num_speculative_tokens={k!r} must be an integer in [0, {self.k}]")
        stops = list(request.stop_token_ids) + ([] if request.ignore_eos else list(self.eos_ids))
        if len(stops) > _MAX_STOP_IDS:
            raise InvalidRequest("stop_token_ids", f"stop_token_ids has {len(request.stop_token_ids)} ids; at most "
                             f"{_MAX_STOP_IDS - len(self.eos_ids)} are allowed")
        if not all(is_integer(t) for t in request.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "stop_token_ids must be integers")
        bad = [t for t in request.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest("stop_token_ids", f"stop_token_ids has id {bad[0]} outside [0, {vocab})")

    @staticmethod
    def _check_sampling(sampling: SamplingParams) -> None:
        """The settings must stack into a row of the batch's arrays: the engine thread stacks every row each
        chunk, so a value that failed there would fail the whole batch."""
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest("sampling", f"sampling={sampling!r} must be a jaxspec.SamplingParams")
        try:
            SamplingParams.stack([sampling])
        except InvalidSetting as e:
            raise InvalidRequest(f"sampling.{e.field}", str(e)) from None
        except ValueError as e:
            raise InvalidRequest("sampling", str(e)) from None

    # ------------------------------------------------------------------ public API

    def start(self, warmup: bool = True) -> "Engine":
        """Launch the loop thread (compiling every slot bucket first with `warmup`); returns the engine."""
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="jaxspec-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, request: Request, callback: Callable[[Output], None]) -> Handle:
        """Queue a request; `callback` receives its outputs on the engine thread (keep it quick)."""
        self.validate(request)
        method = request.method or self.config.spec.method
        eos = () if request.ignore_eos else self.eos_ids
        stop_ids = np.full((_MAX_STOP_IDS,), -1, np.int32)
        ids = list(eos) + [int(t) for t in request.stop_token_ids]
        stop_ids[: len(ids)] = ids
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
            live = _Live(request_id=next(self._ids), request=request, callback=callback, method=method,
                         stop_ids=stop_ids, submitted=time.perf_counter())
            self._waiting.append(live)
            self.metrics.requests_waiting = len(self._waiting)
            self._wakeup.notify()
        return Handle(self, live.request_id)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish in-flight ones (`drain`) or fail them with finish_reason "cancelled"."""
        with self._lock:
            self._stopping = True
            self._drain = drain
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        else:  # never started: no loop will run or fail the queued requests, so fail them here
            self._fail_all("cancelled")

    @property
    def num_active(self) -> int:
        """Requests holding a slot now."""
        return sum(s is not None for s in self._slots)

    # ------------------------------------------------------------------ the loop thread

    def _cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def _run(self, warmup: bool) -> None:
        try:
            self._resize(self.config.slot_buckets[0])
            if warmup:
                self._warmup()
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
                    log.exception("decode chunk failed; failing the %d running requests", self.num_active)
                    self._reset(f"decoding failed: {e!r}")
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear about it
            log.exception("engine loop failed")
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

    def _warmup(self) -> None:
        """Compile before the first request: the loop for every slot bucket, the prefill for every prompt bucket."""
        t0 = time.perf_counter()

        def dummy(prompt_len: int) -> _Live:
            return _Live(-1, Request([1] * prompt_len, 2), lambda o: None, self.config.spec.method,
                         np.full((_MAX_STOP_IDS,), -1, np.int32), time.perf_counter())

        for n in self.config.slot_buckets:
            self._resize(n)
            self._admit_one(0, dummy(3))
            self._slots[0] = None
            self._run_chunk(np.zeros(self.config.max_slots + 1, np.int32))
            if self._state.logprobs is not None:
                window(self._state.logprobs, jnp.zeros((n,), jnp.int32), size=self._logprob_window)
        self._resize(self.config.slot_buckets[0])
        width = _PROMPT_BUCKET_MIN * 2
        while width // 2 < self.config.max_context - 1:
            self._admit_one(0, dummy(min(width, self.config.max_context - 2)))
            self._slots[0] = None
            width *= 2
        self._state = self._state.replace(done=jnp.ones_like(self._state.done))
        log.info("compiled %d slot buckets and the prefill in %.1f s", len(self.config.slot_buckets),
                 time.perf_counter() - t0)

    # --------------------------------------------------------------- state on the device

    def _empty_state(self, n: int) -> DecodeState:
        """n finished rows: copies of a one-token prefill (a valid proposer state too), marked done."""
        if self._empty_row is None:
            limits = RowLimits(max_new_tokens=jnp.ones((1,), jnp.int32),
                               stop_ids=jnp.full((1, _MAX_STOP_IDS), -1, jnp.int32))
            self._empty_row = self._prefill(jnp.zeros((1, _PROMPT_BUCKET_MIN), jnp.int32), jnp.ones((1,), jnp.int32),
                                            SamplingParams().broadcast(1), limits, wants_logprobs=False)
        return _tile(self._empty_row, n)

    def _prefill(self, prompts, prompt_lens, sampling, limits, wants_logprobs: bool) -> DecodeState:
        width = prompts.shape[1]
        caps = jnp.zeros((self.config.max_slots + 1,), jnp.int32)
        # Every row carries the log-probability buffers (one state shape); only rows that asked fill them.
        top = self.config.max_logprobs
        rows = None if top is None else jnp.full((prompts.shape[0],), wants_logprobs)
        state = prefill(self.lm.graphdef, self.lm.params, prompts, prompt_lens, sampling, limits,
                        MixedParams(caps, self._member_params), rows, proposer=self.proposer,
                        cache_len=self.config.cache_len, buffer_len=self.config.cache_len - width,
                        num_top_logprobs=top or 0)
        # Per-request counters only: the engine reads totals, not each step's commit count.
        return state.replace(counters=SpecCounters.zeros(prompts.shape[0], self.k, 1))

    def _resize(self, n: int) -> None:
        """Regroup the rows into a state of n rows: the active rows first, then empty ones."""
        keep = [i for i, s in enumerate(self._slots) if s is not None]
        assert len(keep) <= n
        if self._state is not None and len(self._slots) == n and keep == list(range(len(keep))):
            return
        if self._state is None or not keep:
            self._state = self._empty_state(n)  # its step counter starts at 0
            self._steps_read = 0
        else:
            self._state = _regroup(self._state, self._empty_state(n), jnp.asarray(keep, jnp.int32))
        self._slots = [self._slots[i] for i in keep] + [None] * (n - len(keep))

    def _admit_one(self, slot: int, live: _Live) -> None:
        req = live.request
        t0 = time.perf_counter()
        n = len(req.prompt_ids)
        width = min(_next_pow2(n, _PROMPT_BUCKET_MIN), self.config.cache_len)
        prompt = np.zeros((1, width), np.int32)
        prompt[0, :n] = req.prompt_ids
        limits = RowLimits(max_new_tokens=jnp.asarray([req.max_tokens], jnp.int32),
                           stop_ids=jnp.asarray(live.stop_ids[None]))
        row = self._prefill(jnp.asarray(prompt), jnp.asarray([n], jnp.int32), SamplingParams.stack([req.sampling]),
                            limits, wants_logprobs=req.logprobs is not None)
        k = self.k if req.num_speculative_tokens is None else req.num_speculative_tokens
        choice = self._drafting.index(live.method) if live.method in self._drafting else 0
        if live.method == "none":
            k = 0
        pstate: MixedState = row.pstate
        row = row.replace(pstate=pstate.replace(choice=jnp.asarray([choice], jnp.int32),
                                                max_draft=jnp.asarray([k], jnp.int32)))
        self._state = _insert(self._state, row, jnp.asarray(slot, jnp.int32))
        first, done = jax.device_get((row.history[0, n], row.done[0]))
        logprobs = None
        if req.logprobs is not None:
            buffer = jax.device_get(row.logprobs)
            logprobs = to_host([int(first)], buffer.token[0, n:n + 1], buffer.top_ids[0, n:n + 1],
                               buffer.top[0, n:n + 1], req.logprobs)
        live.admitted = time.perf_counter()
        live.prefill_s = live.admitted - t0
        live.counters = (0, 0, 0)
        # A row done at its first token (a stop token, or max_tokens = 1) frees its slot at once.
        self._slots[slot] = None if done else live
        if live.request_id >= 0:
            self.metrics.prompt_tokens += n
            self._emit(live, [int(first)], bool(done), logprobs)

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or (self._stopping and not self._drain):
                    return
                free = [i for i, s in enumerate(self._slots) if s is None]
                if not free and len(self._slots) == self.config.max_slots:
                    return
                live = self._waiting.pop(0)
                self.metrics.requests_waiting = len(self._waiting)
                cancelled = live.request_id in self._cancelled
                self._cancelled.discard(live.request_id)
            if cancelled:
                self._finish(live, [], "cancelled")
                continue
            try:
                if not free:
                    bigger = next(b for b in self.config.slot_buckets if b > len(self._slots))
                    self._resize(bigger)
                    free = [i for i, s in enumerate(self._slots) if s is None]
                self._admit_one(free[0], live)
            except Exception as e:  # noqa: BLE001 - a request that cannot be admitted fails alone, and is answered
                self._admission_failed(live, e)
                continue
            for observer in self.observers:
                observer("admit", {"queued_s": live.admitted - live.submitted - live.prefill_s,
                                   "prefill_s": live.prefill_s, "prompt_tokens": len(live.request.prompt_ids)})
            self.metrics.requests_running = self.num_active

    def _admission_failed(self, live: _Live, error: Exception) -> None:
        log.exception("request %d: admission failed; failing that request", live.request_id)
        self._slots = [None if s is live else s for s in self._slots]
        self._finish(live, [], "error", error=f"admission failed: {error!r}")
        if self._state is None or any(x.is_deleted() for x in jax.tree.leaves(self._state)):
            # The failure struck after the state was donated to a device program: the rows are gone.
            self._reset(f"the batch was lost while admitting request {live.request_id}: {error!r}")
        self.metrics.requests_running = self.num_active

    def _reset(self, error: str) -> None:
        """Fail every running request and start over from an empty state of the smallest batch."""
        for live in self._slots:
            if live is not None:
                self._finish(live, [], "error", error=error)
        self._slots = []
        self._state = None
        self._resize(self.config.slot_buckets[0])
        self.metrics.requests_running = 0

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
            self._state = self._state.replace(done=self._state.done.at[jnp.asarray(done_rows)].set(True))
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

    def _run_chunk(self, caps: np.ndarray) -> DecodeState:
        sampling, limits = self._row_settings()
        self._state = decode_chunk(self.lm.graphdef, self.lm.params, self._state, sampling, limits,
                                   MixedParams(jnp.asarray(caps), self._member_params), proposer=self.proposer,
                                   widths=self.widths, attention_impl=self.attention_impl,
                                   num_steps=self.config.chunk_steps)
        return self._state

    def _row_settings(self) -> tuple[SamplingParams, RowLimits]:
        n = len(self._slots)
        rows = [s.request.sampling if s is not None else SamplingParams() for s in self._slots]
        max_new = np.ones((n,), np.int32)
        stop_ids = np.full((n, _MAX_STOP_IDS), -1, np.int32)
        for i, s in enumerate(self._slots):
            if s is not None:
                max_new[i] = s.request.max_tokens
                stop_ids[i] = s.stop_ids
        return SamplingParams.stack(rows), RowLimits(max_new_tokens=jnp.asarray(max_new),
                                                     stop_ids=jnp.asarray(stop_ids))

    def _chunk(self) -> None:
        n = len(self._slots)
        active = self.num_active
        caps = np.zeros((self.config.max_slots + 1,), np.int32)
        caps[: n + 1] = self.policy.draft_caps(n, self.k, waiting=len(self._waiting))
        t0 = time.perf_counter()
        state = self._run_chunk(caps)
        host = jax.device_get({"history": state.history, "history_len": state.history_len, "done": state.done,
                               "prompt_len": state.prompt_len, "steps": state.steps,
                               "row_steps": state.counters.steps, "drafted": state.counters.drafted,
                               "accepted": state.counters.accepted, "drafted_at": state.counters.drafted_at,
                               "accepted_at": state.counters.accepted_at})
        seconds = time.perf_counter() - t0
        logprobs = self._read_logprobs(state, host)
        steps = int(host["steps"]) - self._steps_read
        self._steps_read = int(host["steps"])
        committed = 0
        for i, live in enumerate(self._slots):
            if live is None:
                continue
            generated = int(host["history_len"][i] - host["prompt_len"][i])
            start = int(host["prompt_len"][i]) + live.emitted
            new = host["history"][i, start: start + generated - live.emitted].tolist()
            committed += len(new)
            row = (int(host["row_steps"][i]), int(host["drafted"][i]), int(host["accepted"][i]))
            self.metrics.row_steps += row[0] - live.counters[0]
            self.metrics.drafted += row[1] - live.counters[1]
            self.metrics.accepted += row[2] - live.counters[2]
            live.counters = row
            done = bool(host["done"][i])
            if done:
                self.metrics.drafted_per_position += host["drafted_at"][i]
                self.metrics.accepted_per_position += host["accepted_at"][i]
                self._slots[i] = None
            self._emit(live, new, done, logprobs.get(i))
        self.metrics.steps += steps
        self.metrics.num_slots = n
        self.metrics.requests_running = self.num_active
        report = ChunkReport(num_slots=n, active=active, max_cap=int(caps[active]), tokens=committed, seconds=seconds)
        self.policy.observe(report)
        speculating = getattr(self.policy, "speculating", None)
        self.metrics.speculating = bool(caps[active] > 0) if speculating is None else speculating(n)
        for observer in self.observers:
            observer("chunk", {"seconds": seconds, "steps": steps, "active": active, "slots": n,
                               "tokens": committed, "max_cap": int(caps[active])})

    def _read_logprobs(self, state: DecodeState, host: dict) -> dict[int, list[TokenLogprob]]:
        """Per slot that asked for them, the log-probabilities of the tokens it committed in this chunk."""
        rows = {i: live for i, live in enumerate(self._slots) if live is not None and live.request.logprobs is not None}
        if not rows:
            return {}
        size = self._logprob_window
        last = host["history"].shape[1] - size
        starts = np.zeros(len(self._slots), np.int32)
        for i, live in rows.items():
            starts[i] = min(int(host["prompt_len"][i]) + live.emitted, last)
        read = jax.device_get(window(state.logprobs, jnp.asarray(starts), size=size))
        out = {}
        for i, live in rows.items():
            begin = int(host["prompt_len"][i]) + live.emitted - int(starts[i])
            count = int(host["history_len"][i] - host["prompt_len"][i]) - live.emitted
            tokens = host["history"][i, starts[i] + begin: starts[i] + begin + count].tolist()
            out[i] = to_host(tokens, *(x[i, begin: begin + count] for x in (read.token, read.top_ids, read.top)),
                             live.request.logprobs)
        return out

    def _emit(self, live: _Live, tokens: list[int], done: bool,
              logprobs: list[TokenLogprob] | None = None) -> None:
        live.emitted += len(tokens)
        self.metrics.generated_tokens += len(tokens)
        if not done:
            if tokens:
                try:
                    live.callback(Output(token_ids=tokens, logprobs=logprobs))
                except Exception:  # noqa: BLE001 - one client's callback must not stop the others
                    log.exception("request %d: callback failed; cancelling it", live.request_id)
                    self._cancel(live.request_id)
            return
        stopped = bool(tokens) and tokens[-1] in set(live.stop_ids.tolist()) - {-1}
        self._finish(live, tokens, "stop" if stopped else "length", logprobs=logprobs)

    def _finish(self, live: _Live, tokens: list[int], reason: str, error: str | None = None,
                logprobs: list[TokenLogprob] | None = None) -> None:
        steps, drafted, accepted = live.counters
        stats = RequestStats(steps=steps, drafted=drafted, accepted=accepted,
                             queued_s=max(live.admitted - live.submitted - live.prefill_s, 0.0),
                             prefill_s=live.prefill_s)
        if live.request_id < 0:
            return
        for observer in self.observers:
            observer("finish", {"reason": reason, "stats": stats, "generated": live.emitted})
        try:
            live.callback(Output(token_ids=tokens, finish_reason=reason, stats=stats, error=error,
                                 logprobs=(logprobs or []) if live.request.logprobs is not None else None))
        except Exception:  # noqa: BLE001 - one client's callback must not stop the others
            log.exception("request %d: callback failed", live.request_id)


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: DecodeState, row: DecodeState, slot: jax.Array) -> DecodeState:
    """Write the one-row state `row` into row `slot` of `state`, in place."""
    def put(big, small):
        if big.ndim == 0:
            return big  # the loop's step counter
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)

    return jax.tree.map(put, state, row)


@functools.partial(jax.jit, donate_argnames=("empty",))
def _regroup(state: DecodeState, empty: DecodeState, keep: jax.Array) -> DecodeState:
    """`empty` (n finished rows) with its first len(keep) rows replaced by rows `keep` of `state`."""
    def put(new, old):
        if new.ndim == 0:
            return old
        return jax.lax.dynamic_update_slice_in_dim(new, jnp.take(old, keep, axis=0).astype(new.dtype), 0, axis=0)

    return jax.tree.map(put, empty, state)


@functools.partial(jax.jit, static_argnames=("n",))
def _tile(row: DecodeState, n: int) -> DecodeState:
    """n copies of the one-row state `row`, every one marked done."""
    state = jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, n, axis=0), row)
    return state.replace(done=jnp.ones((n,), bool))
