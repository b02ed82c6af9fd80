"""The device side of the engine: one batched `DecodeState`, and the programs that fill, advance and read it.

The `Runner` belongs to the engine's loop thread. It prefills the requests admitted together with one call (their
prompts padded to one prompt bucket, the batch to a compiled prefill size) and writes each one's row into its
slot (`admit_batch`), regroups the batch into another compiled size (`regroup`), runs a chunk of decode steps
over every row and reads back what each occupied row committed, with the draft flags and, for rows that asked,
the log-probabilities (`run_chunk`). `warmup` compiles what the first requests need (plain chunks by default)
and leaves speculation to a compiling thread, and `EngineMetrics` keeps the running totals the server exports.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import sharding
from ..builders import build_proposer
from ..constraints import FREE, stack
from ..constraints.rows import ConstraintRows, ForcedTokenProposer
from ..constraints.tables import check_key_range
from ..decode import PrefillSpec, StepSpec, decode_chunk, pinned, prefill
from ..generation import default_attention_impl
from ..logprobs import TokenLogprob, to_host, window
from ..models.loading import LanguageModel
from ..predicted_outputs import RESYNC_MIN_MATCH, RESYNC_NGRAM
from ..processors import ProcessorRequest
from ..proposers.base import BatchShared
from ..proposers.mixed import MixedParams, MixedProposer, MixedState
from ..proposers.prediction import PredictionProposer, PredictionState, pad_predictions, with_prediction
from ..shapes import BUCKET_MIN, prompt_bucket
from ..spec_config import SpecConfig
from ..state import DecodeState, RowParams, SpecCounters
from . import slots
from .config import EngineConfig
from .request import MAX_STOP_IDS, LiveRequest, Request, compiled_constraint

_log = logging.getLogger("jaxspec.engine")


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """What one row committed since the engine last read it."""

    tokens: list[int]  # the new tokens
    from_draft: list[bool]  # one per token: an accepted draft (True) or the target's own token (False)
    done: bool  # the row finished (a stop id or its token budget)
    logprobs: list[TokenLogprob] | None = None  # one per token, for a request that asked
    counters: tuple[int, int, int] = (0, 0, 0)  # the row's steps, drafted, accepted since its admission
    drafted_at: np.ndarray | None = None  # i32[K] the row's drafts at each position since its admission
    accepted_at: np.ndarray | None = None  # i32[K] of those, the accepted ones
    prediction: tuple[int, int] | None = None  # accepted and rejected prediction tokens since its admission


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """What one chunk of decode steps did."""

    rows: dict[int, RowUpdate]  # by slot: every row a request held when the chunk started
    steps: int  # decode steps the chunk ran (each one target forward)
    seconds: float  # wall time, readback included

    @property
    def tokens(self) -> int:
        """Tokens committed by all rows."""
        return sum(len(u.tokens) for u in self.rows.values())


@dataclasses.dataclass
class EngineMetrics:
    """Running totals the server exports; read without a lock (monotone counters and gauges)."""

    requests_running: int = 0  # requests holding a slot
    requests_waiting: int = 0  # requests queued for a slot
    num_slots: int = 0  # the compiled batch the last chunk ran at
    prompt_tokens: int = 0  # prompt tokens prefilled
    prefills: int = 0  # prefill calls that admitted requests (each admits up to max_prefill_batch of them)
    generated_tokens: int = 0  # tokens handed to callbacks (each request's first, from prefill, included)
    steps: int = 0  # decode loop steps (each one target forward)
    row_steps: int = 0  # active rows summed over steps
    committed: int = 0  # tokens committed by decode steps (each request's first token, from prefill, not counted)
    drafted: int = 0  # draft tokens scored by the target
    accepted: int = 0  # accepted drafts
    drafted_per_position: np.ndarray | None = None  # i64[K] drafts at each position, of finished requests
    accepted_per_position: np.ndarray | None = None  # i64[K] accepted drafts at each position, of finished requests
    speculating: bool = True  # the policy lets the current batch size draft

    def record_chunk(self, rows: Sequence[LiveRequest | None], chunk: ChunkResult) -> None:
        """Add what `chunk` did; `rows` (the batch's slots) still hold each request's counters of the read before."""
        for i, update in chunk.rows.items():
            before = rows[i].counters
            self.row_steps += update.counters[0] - before[0]
            self.drafted += update.counters[1] - before[1]
            self.accepted += update.counters[2] - before[2]
            if update.done:
                self.drafted_per_position += update.drafted_at
                self.accepted_per_position += update.accepted_at
        self.steps += chunk.steps
        self.committed += chunk.tokens
        self.num_slots = len(rows)


# Compiling threads alive in this process (`Runner.warmup`), each with its runner's stop event as `.stop`.
_COMPILING: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


@atexit.register
def _finish_compiling() -> None:
    """At exit, stop every compiling thread after the program in hand and wait for it: Python's finalisation while
    XLA compiles on another thread crashes the process (a server that must not wait ends with os._exit)."""
    for thread in list(_COMPILING):
        thread.stop.set()
        thread.join()


def _shapes(tree):
    """The arrays of `tree` as shapes (dtype, weak type and placement kept): what a program is lowered against on
    the compiling thread, which must not hold the batch's arrays (the loop's chunks donate them)."""
    def shape(x):
        if not isinstance(x, jax.Array):
            return x
        # An array not committed to its device lowers without a placement, as jit lowers it for the loop's call:
        # the same program, so the persistent cache's entry serves that call.
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None,
                                    weak_type=x.weak_type)

    return jax.tree.map(shape, tree)


def _requests(count: int, length: int) -> list[Request]:
    """`count` dummy requests of `length`-token prompts and two new tokens: what warm-up runs to compile."""
    return [Request([1] * length, 2) for _ in range(count)]


class Runner:
    """The engine's batch on the device and the programs over it; only the engine's loop thread calls it."""

    def __init__(self, lm: LanguageModel, config: EngineConfig, metrics: EngineMetrics, speculates: bool = True):
        self.lm = lm  # the target model
        self.config = config  # the engine's settings
        self.metrics = metrics  # the engine's totals, which `run_chunk` adds to
        self.k = config.num_speculative_tokens  # K, the most drafts per row and step
        # The target-forward widths compiled in: width 1 alone when no row will ever draft (`speculates` False).
        self.widths = config.verify_widths if speculates else (1,)
        self.attention_impl = config.attention_impl or default_attention_impl()  # "xla" or "pallas"
        # Rows of method "none" draft nothing (their budget is 0); the others pick a member proposer.
        self._drafting = tuple(m for m in config.methods if m != "none")
        members, member_params = [], []
        for method in self._drafting or ("ngram",):  # with no drafting method, a member that never drafts
            spec = config.spec if method == config.spec.method else SpecConfig(method=method)
            proposer, params = build_proposer(lm, dataclasses.replace(spec, num_speculative_tokens=self.k,
                                                                      verify_widths=None),
                                              prompt_width=0, buffer_len=config.cache_len,
                                              cache_len=config.cache_len)
            members.append(proposer)
            member_params.append(params)
        self.proposer = MixedProposer(tuple(members), self.k)  # every row picks one member (or drafts nothing)
        self.loop_k = config.loop_k  # the loop's draft budget: K, or the prediction budget when larger
        if config.max_prediction_len:
            # Rows with a prediction draft from it first; the member proposers draft for every other row.
            self.proposer = PredictionProposer(self.loop_k, config.max_prediction_len, ngram=RESYNC_NGRAM,
                                               min_match=RESYNC_MIN_MATCH, inner=self.proposer)
        if config.constraints:  # every stacked key state * V + token must fit int32
            try:
                check_key_range(config.constraint_states, lm.config.vocab_size)
            except ValueError as e:
                raise ValueError(f"constraint_states={config.constraint_states}: {e}") from None
        if config.constraints and not self.proposer.needs_features:
            # Constrained rows draft the tokens (and JSON keys) their constraint forces, within the loop's K.
            self.proposer = ForcedTokenProposer(self.loop_k, inner=self.proposer)
        self._member_params = tuple(member_params)
        # The batch: B rows, B one of config.slot_buckets. The loop thread donates it to every program, so read
        # it from elsewhere only while the engine idles.
        self.state: DecodeState | None = None
        self._empty_row: DecodeState | None = None
        # Constraints: each slot's automaton (None: free), and each stacked automaton's initial state in the
        # batch's current stack (`jaxspec.constraints.stack`), keyed by id (the automata are kept alive here).
        self._row_automata: list = []
        self._stack_initial: dict[int, int] = {}
        self._stacked: list = []
        self._steps_read = 0  # the loop's step counter at the last read (a regroup keeps the old batch's)
        self._settings = (None, None)  # (key, RowParams) of the last chunk's rows (`batch_settings`)
        # Slot buckets whose speculative chunk the compiling thread has compiled (`warmup`). Until a bucket is here,
        # `_decode` runs its chunk at verify width 1 (`_plain_until_compiled`): every row decodes plainly, and the
        # proposers keep their state, so the first chunk that speculates drafts from the whole text.
        self._speculating: set[int] = set()
        self._plain_until_compiled = False
        # The largest slot bucket the batch may grow to (`largest_bucket`): every bucket, unless `warmup` left the
        # larger buckets' programs compiling on its thread, which raises it as each bucket becomes ready (an int,
        # assigned whole: the loop thread reads it between chunks).
        self._largest_ready = config.slot_buckets[-1]
        self._compiling: threading.Thread | None = None
        self._stop_compiling = threading.Event()

    @property
    def num_slots(self) -> int:
        """B, the rows of the batch (0 before the first `reset`)."""
        return 0 if self.state is None else self.state.done.shape[0]

    @property
    def logprob_window(self) -> int:
        """History slots read back per row after a chunk: a chunk commits at most chunk_steps * (K + 1) tokens
        a row, so one fixed-size window (one compiled program per slot bucket) always holds them."""
        return min(self.config.chunk_steps * (self.loop_k + 1), self.config.cache_len)

    # ------------------------------------------------------------------ the batch

    def prefill(self, prompts: jax.Array, prompt_lens: jax.Array, rows: RowParams, wants_logprobs: bool | np.ndarray,
                initial: Sequence[int] | None = None, own_batch: bool = False) -> DecodeState:
        """A state of prompts.shape[0] rows (prompts i32[B, P], prompt_lens i32[B]) in the batch's row shape;
        `wants_logprobs` for every row, or bool[B] one per row; `initial` each row's constraint state in the
        batch's stacked automata (None: every row free). `own_batch`: for a batch other than the engine's (the
        compiling thread's), with a stack of automata of its own."""
        args, kwargs = self._prefill_args(prompts, prompt_lens, rows, wants_logprobs, initial, own_batch)
        state = prefill(*args, **kwargs)
        # Per-request counters only: the engine reads totals, not each step's commit count.
        return state.replace(counters=SpecCounters.zeros(prompts.shape[0], self.loop_k, 1))

    def _prefill_args(self, prompts: jax.Array, prompt_lens: jax.Array, rows: RowParams,
                      wants_logprobs: bool | np.ndarray, initial: Sequence[int] | None = None,
                      own_batch: bool = False) -> tuple[tuple, dict]:
        """The arguments of `jaxspec.decode.prefill` for `prefill` (and for compiling it ahead, `warmup`)."""
        width = prompts.shape[1]
        caps = jnp.zeros((self.config.max_slots + 1,), jnp.int32)
        # Every row carries the log-probability buffers (one state shape); only rows that asked fill them.
        top = self.config.max_logprobs
        wanted = None if top is None else jnp.asarray(np.broadcast_to(wants_logprobs, (prompts.shape[0],)))
        # Every row counts its tokens too (one state shape), so any request may ask for penalties.
        processors = ProcessorRequest(logprob_rows=wanted,
                                      constraint=self._constraint_rows(prompts.shape[0], initial, own_batch),
                                      num_top_logprobs=top or 0, track_counts=True)
        args = (self.lm.graphdef, self.lm.params, prompts, prompt_lens, rows, MixedParams(caps, self._member_params),
                processors)
        spec = PrefillSpec(cache_len=self.config.cache_len, buffer_len=self.config.cache_len - width,
                           proposer=self.proposer)
        return args, dict(spec=spec)

    def _constraint_rows(self, batch: int, initial: Sequence[int] | None,
                         own_batch: bool = False) -> ConstraintRows | None:
        """The prefill's constraints: rows in the batch's current stack of automata (a free one before any, or
        for `own_batch`: the compiling thread must not read the batch, whose arrays the loop's chunks donate)."""
        if not self.config.constraints:
            return None
        if own_batch or self.state is None or self.state.constraint is None:
            automaton = BatchShared(self._stack([None])[0])
        else:
            automaton = self.state.constraint.automaton
        states = np.full((batch,), FREE, np.int32) if initial is None else np.asarray(initial, np.int32)
        return ConstraintRows(state=jnp.asarray(states), automaton=automaton)

    def _stack(self, automata: Sequence) -> tuple:
        """`stack` at the engine's fixed capacity: every stack has one shape, so no automaton compiles a program."""
        return stack(automata, vocab_size=self.lm.config.vocab_size,
                     capacity=(self.config.constraint_states, self.config.constraint_edges))

    def _restack(self, slots_: Sequence[int], requests: Sequence[Request],
                 occupied: Sequence[bool] | None = None) -> list[int]:
        """Record the admitted requests' automata in their slots, restacking the batch's automata (and moving
        the live rows' states to their automaton's new place) when one is new; returns each request's initial
        state. Rows not `occupied` (None: all are) drop their automata, so finished rows take no capacity.
        A request's constraint is its compiled automaton by now (`Engine.submit`): a cache hit at worst."""
        automata = list(self._row_automata)
        if occupied is not None:
            automata = [a if busy else None for a, busy in zip(automata, occupied)]
        for slot, r in zip(slots_, requests):
            automata[slot] = compiled_constraint(r.constraint, self.config, self.lm.tokenizer,
                                                 self.lm.config.vocab_size)
        if any(a is not None and id(a) not in self._stack_initial for a in automata):
            aut, initial = self._stack(automata)
            initial = np.asarray(initial)
            new_map = {id(a): int(initial[i]) for i, a in enumerate(automata) if a is not None}
            delta = np.zeros((len(automata),), np.int32)  # i32[B] each live row's shift to the new stack
            kept = np.zeros((len(automata),), bool)  # bool[B] the row's automaton is in the new stack
            for i, a in enumerate(self._row_automata):
                if a is not None and id(a) in new_map:
                    delta[i] = new_map[id(a)] - self._stack_initial[id(a)]
                    kept[i] = True
            old = self.state.constraint.state  # i32[B]; a row whose automaton left the stack decodes free
            moved = jnp.where(jnp.asarray(kept), old + jnp.asarray(delta), FREE)
            self.state = self.state.replace(constraint=ConstraintRows(
                state=jnp.where(old >= 0, moved, old), automaton=BatchShared(aut)))
            self._stack_initial = new_map
            self._stacked = [a for a in automata if a is not None]
        self._row_automata = automata
        return [FREE if automata[s] is None else self._stack_initial[id(automata[s])] for s in slots_]

    def empty_state(self, n: int) -> DecodeState:
        """n finished rows: copies of a one-token prefill (a valid proposer state too), marked done, laid out on
        the model's mesh as the decode loop lays out its state (the one row's copies would otherwise sit whole
        on every device until the next chunk re-lays them)."""
        if self._empty_row is None:
            self._empty_row = self.prefill(jnp.zeros((1, BUCKET_MIN), jnp.int32), jnp.ones((1,), jnp.int32),
                                           slots.stack_settings([None], MAX_STOP_IDS), wants_logprobs=False)
        return pinned(slots.empty_state(self._empty_row, n))

    def reset(self, n: int) -> None:
        """Start over from n finished rows (its step counter at 0)."""
        self.state = self.empty_state(n)
        self._steps_read = 0
        self._row_automata, self._stack_initial, self._stacked = [None] * n, {}, []

    def regroup(self, keep: list[int], n: int) -> None:
        """Regroup the batch into n rows: rows `keep` first, in that order, then finished ones."""
        if self.state is not None and self.num_slots == n and keep == list(range(len(keep))):
            return
        if self.state is None or not keep:
            self.reset(n)
        else:
            self.state = slots.regroup(self.state, keep, self.empty_state(n))
            self._row_automata = [self._row_automata[k] for k in keep] + [None] * (n - len(keep))

    def lost(self) -> bool:
        """Whether the batch is gone: never built, or donated to a device program that then failed."""
        return self.state is None or any(x.is_deleted() for x in jax.tree.leaves(self.state))

    def finish_rows(self, rows: list[int]) -> None:
        """Mark rows done on the device (cancelled requests): the loop stops advancing them."""
        self.state = slots.finish(self.state, rows)

    def prefill_size(self, n: int) -> int:
        """The compiled prefill batch size that n requests admitted together are padded to."""
        fits = [b for b in self.config.prefill_batch_sizes if b >= n]
        if not fits:
            raise ValueError(f"{n} requests exceed max_prefill_batch={self.config.max_prefill_batch}")
        return fits[0]

    def prefill_requests(self, requests: Sequence[Request], methods: Sequence[str],
                         stop_ids: Sequence[Sequence[int]], initial: Sequence[int] | None = None,
                         own_batch: bool = False) -> DecodeState:
        """One prefill of `requests` together: a state of `prefill_size(len(requests))` rows, row i request i's
        (its method's proposer chosen, its own draft budget), then dummy rows (one-token prompts, done at once)
        whose results nobody reads. The prompts are padded to the prompt bucket of the longest. Each row's
        values are its own request's (sampling, seed, budget, stop ids, log-probabilities): a row's prefill does
        not depend on the rows beside it."""
        if initial is not None:  # dummy rows decode free
            initial = list(initial) + [FREE] * (self.prefill_size(len(requests)) - len(requests))
        rows = self.prefill(*self._prefill_inputs(requests, stop_ids), initial=initial, own_batch=own_batch)
        choice = np.zeros((rows.done.shape[0],), np.int32)  # i32[B] each row's member proposer
        budget = np.zeros((rows.done.shape[0],), np.int32)  # i32[B] each row's own draft budget (0: none)
        for i, (r, method) in enumerate(zip(requests, methods)):
            choice[i] = self._drafting.index(method) if method in self._drafting else 0
            if method != "none":
                budget[i] = self.k if r.num_speculative_tokens is None else r.num_speculative_tokens
        predicting = isinstance(rows.pstate, PredictionState)
        mixed: MixedState = rows.pstate.inner if predicting else rows.pstate
        pstate = mixed.replace(choice=jnp.asarray(choice), max_draft=jnp.asarray(budget))
        if predicting:
            ids = [r.prediction_ids for r in requests] + [None] * (len(choice) - len(requests))  # dummy rows: none
            tokens, lengths = pad_predictions(ids, self.config.max_prediction_len)
            pstate = with_prediction(rows.pstate.replace(inner=pstate), tokens, lengths, rows.history,
                                     rows.history_len, rows.prompt_len, trust_start=False)
        return rows.replace(pstate=pstate)

    def _prefill_inputs(self, requests: Sequence[Request], stop_ids: Sequence[Sequence[int]]) -> tuple:
        """`prefill`'s arguments for `requests` padded with dummy rows to a compiled prefill batch size."""
        n = len(requests)
        pad = self.prefill_size(n) - n
        lens = [len(r.prompt_ids) for r in requests] + [1] * pad
        prompts = np.zeros((n + pad, prompt_bucket(max(lens), self.config.cache_len)), np.int32)  # i32[B, P]
        for i, r in enumerate(requests):
            prompts[i, :lens[i]] = r.prompt_ids
        rows = slots.stack_settings([slots.RowSettings(r.sampling, r.max_tokens, s) for r, s in zip(requests, stop_ids)]
                                    + [None] * pad, MAX_STOP_IDS)
        wants = np.asarray([r.logprobs is not None for r in requests] + [False] * pad)
        return jnp.asarray(prompts), jnp.asarray(lens, jnp.int32), rows, wants

    def admit_batch(self, admissions: Sequence[tuple[int, Request, str, Sequence[int]]],
                    occupied: Sequence[bool] | None = None) -> list[RowUpdate]:
        """Prefill requests together (`prefill_requests`) and write each one's row into its slot: `admissions`
        holds (slot, request, method, stop ids) per request, at most max(config.prefill_batch_sizes) of them,
        into distinct free slots. Returns each request's first token, which prefill samples (done when that
        token is a stop id or the budget is one token). `occupied`: which slots hold a live request (None: all),
        so that finished rows' automata leave the batch's stack."""
        slots_, requests, methods, stop_ids = zip(*admissions)
        initial = self._restack(slots_, requests, occupied) if self.config.constraints else None
        rows = self.prefill_requests(requests, methods, stop_ids, initial)
        self.state = self._write_rows(self.state, rows, slots_)
        history, done = jax.device_get((rows.history, rows.done))
        buffer = None
        if any(r.logprobs is not None for r in requests):
            buffer = jax.device_get(rows.logprobs)
        updates = []
        for i, r in enumerate(requests):
            n = len(r.prompt_ids)
            first = int(history[i, n])
            logprobs = None
            if r.logprobs is not None:
                logprobs = to_host([first], buffer.token[i, n:n + 1], buffer.top_ids[i, n:n + 1],
                                   buffer.top[i, n:n + 1], r.logprobs)
            updates.append(RowUpdate(tokens=[first], from_draft=[False], done=bool(done[i]), logprobs=logprobs))
        return updates

    @staticmethod
    def _write_rows(state: DecodeState, rows: DecodeState, slots_: Sequence[int]) -> DecodeState:
        """`state` (donated) with prefilled row i written into slot slots_[i]; the dummy rows padding `rows` to
        a prefill batch size go to rows B, B + 1, ... (out of range: dropped; distinct, as the scatter's unique
        indices promise)."""
        if rows.done.shape[0] == 1:  # one request: written as it always was
            return slots.insert(state, rows, jnp.asarray(slots_[0], jnp.int32))
        dest = state.done.shape[0] + np.arange(rows.done.shape[0], dtype=np.int32)  # i32[size]
        dest[:len(slots_)] = slots_
        return slots.insert_rows(state, rows, jnp.asarray(dest))

    def admit(self, slot: int, request: Request, method: str, stop_ids: Sequence[int]) -> RowUpdate:
        """Prefill `request` alone and write its row into `slot` (`admit_batch` of one)."""
        return self.admit_batch([(slot, request, method, stop_ids)])[0]

    # ------------------------------------------------------------------ decoding

    def batch_settings(self, rows: Sequence[LiveRequest | None]) -> RowParams:
        """The batch arrays of the rows' settings, reused while every slot holds the same values: stacking them
        checks each row's values and uploads each field, a host cost per chunk that grows with the slots and that
        a GPU's chunk of a few milliseconds a step cannot hide."""
        settings = [None if r is None else slots.RowSettings(r.request.sampling, r.request.max_tokens, r.stop_ids)
                    for r in rows]
        key = tuple(None if s is None else (s.sampling, s.max_new_tokens, tuple(s.stop_ids)) for s in settings)
        try:
            if key == self._settings[0]:
                return self._settings[1]
        except (TypeError, ValueError):  # per-row arrays in a SamplingParams: not comparable, build anew
            key = None
        value = slots.stack_settings(settings, MAX_STOP_IDS)
        self._settings = (key, value)
        return value

    def _decode(self, rows: Sequence[LiveRequest | None], caps: np.ndarray) -> DecodeState:
        """Up to chunk_steps decode steps over the batch; caps i32[max_slots + 1] (`DraftPolicy.draft_caps`)."""
        plain = self._plain_until_compiled and self.num_slots not in self._speculating
        self.state = decode_chunk(self.lm.graphdef, self.lm.params, self.state, self.batch_settings(rows),
                                  MixedParams(jnp.asarray(caps), self._member_params), **self._chunk_settings(plain))
        return self.state

    def _chunk_settings(self, plain: bool) -> dict:
        """`decode_chunk`'s static settings: every verify width, or (plain) width 1 alone."""
        return dict(step=StepSpec(self.proposer, (1,) if plain else self.widths, self.attention_impl),
                    num_steps=self.config.chunk_steps)

    @property
    def speculating(self) -> tuple[int, ...]:
        """The slot buckets whose chunks score drafts now (all of them, unless `warmup` left some compiling)."""
        if not self._plain_until_compiled:
            return self.config.slot_buckets
        return tuple(n for n in self.config.slot_buckets if n in self._speculating)

    def run_chunk(self, rows: Sequence[LiveRequest | None], caps: np.ndarray) -> ChunkResult:
        """Run a chunk over the batch whose slots hold `rows`, read back what each occupied row committed since
        the last read (`LiveRequest.emitted`), and add it to the metrics."""
        t0 = time.perf_counter()
        state = self._decode(rows, caps)
        predicting = isinstance(state.pstate, PredictionState)
        host = jax.device_get({"history": state.history, "from_draft": state.from_draft,
                               **({"pred_accepted": state.pstate.accepted, "pred_rejected": state.pstate.rejected}
                                  if predicting else {}),
                               "history_len": state.history_len, "done": state.done,
                               "prompt_len": state.prompt_len, "steps": state.steps,
                               "row_steps": state.counters.steps, "drafted": state.counters.drafted,
                               "accepted": state.counters.accepted, "drafted_at": state.counters.drafted_at,
                               "accepted_at": state.counters.accepted_at})
        seconds = time.perf_counter() - t0
        logprobs = self._read_logprobs(rows, state, host)
        steps = int(host["steps"]) - self._steps_read
        self._steps_read = int(host["steps"])
        updates = {}
        for i, live in enumerate(rows):
            if live is None:
                continue
            generated = int(host["history_len"][i] - host["prompt_len"][i])
            start = int(host["prompt_len"][i]) + live.emitted
            new = host["history"][i, start: start + generated - live.emitted].tolist()
            updates[i] = RowUpdate(
                tokens=new, from_draft=host["from_draft"][i, start: start + len(new)].tolist(),
                done=bool(host["done"][i]), logprobs=logprobs.get(i),
                counters=(int(host["row_steps"][i]), int(host["drafted"][i]), int(host["accepted"][i])),
                drafted_at=host["drafted_at"][i], accepted_at=host["accepted_at"][i],
                prediction=(int(host["pred_accepted"][i]), int(host["pred_rejected"][i])) if predicting else None)
        chunk = ChunkResult(rows=updates, steps=steps, seconds=seconds)
        self.metrics.record_chunk(rows, chunk)
        return chunk

    def _read_logprobs(self, rows: Sequence[LiveRequest | None], state: DecodeState,
                       host: dict) -> dict[int, list[TokenLogprob]]:
        """Per slot that asked for them, the log-probabilities of the tokens it committed in this chunk."""
        asked = {i: live for i, live in enumerate(rows) if live is not None and live.request.logprobs is not None}
        if not asked:
            return {}
        size = self.logprob_window
        last = host["history"].shape[1] - size
        starts = np.zeros(len(rows), np.int32)  # i32[B] each row's first history slot read
        for i, live in asked.items():
            starts[i] = min(int(host["prompt_len"][i]) + live.emitted, last)
        read = jax.device_get(window(state.logprobs, jnp.asarray(starts), size=size))
        out = {}
        for i, live in asked.items():
            begin = int(host["prompt_len"][i]) + live.emitted - int(starts[i])
            count = int(host["history_len"][i] - host["prompt_len"][i]) - live.emitted
            tokens = host["history"][i, starts[i] + begin: starts[i] + begin + count].tolist()
            out[i] = to_host(tokens, *(x[i, begin: begin + count] for x in (read.token, read.top_ids, read.top)),
                             live.request.logprobs)
        return out

    # ------------------------------------------------------------------ compiling ahead

    def warmup(self, background: bool = True) -> None:
        """Compile what the first requests need: for every slot bucket a chunk and its log-probability readback,
        and the prefill of the smallest prompt bucket at every prefill batch size with its writes. Leaves a batch
        of the smallest bucket, every row finished.

        With `background`, only the smallest slot bucket is compiled here, and its chunk scores at width 1 alone
        (one target forward per program instead of one per width), so the engine serves, plainly and a request
        at a time, within the time one plain program takes to compile. The rest compiles on a thread of its own
        while requests are served, each used from its next call once compiled: first each larger bucket's plain
        chunk, prefills and writes, after which the batch may grow to it (`largest_bucket`); then every bucket's
        speculative chunk (every width), after which that bucket speculates; then the prefills of longer prompts.
        Without `background` all of it compiles here, before returning."""
        t0 = time.perf_counter()
        buckets = self.config.slot_buckets
        self._plain_until_compiled = background and len(self.widths) > 1
        now = buckets[:1] if background else buckets
        _log.info("compiling the chunk of slot bucket%s %s (verify widths %s) and the prefill; /health answers when "
                  "done", "s" if len(now) > 1 else "", ", ".join(map(str, now)),
                  (1,) if self._plain_until_compiled else self.widths)
        ahead = []  # what `_compile_ahead` compiles once the engine serves
        for n in now:
            self.regroup([], n)
            self.state = self._fill_bucket(n)
        if background:
            self._largest_ready = buckets[0]
            ahead += [("bucket", n) for n in buckets[1:]]
        if self._plain_until_compiled:
            ahead += [("chunk", n) for n in buckets]
        self.regroup([], buckets[0])
        method, sizes = self.config.spec.method, self.config.prefill_batch_sizes
        width = BUCKET_MIN * 2
        while width // 2 < self.config.max_context - 1:
            length = min(width, self.config.max_context - 2)
            if background:  # shapes only: the thread must not read the batch's arrays, which chunks donate
                for size in sizes:
                    args, kwargs = self._prefill_args(*self._prefill_inputs(_requests(size, length), [()] * size))
                    ahead.append(("prefill", (args[0], *_shapes(args[1:])), kwargs))
            else:
                self.admit(0, _requests(1, length)[0], method, ())
                for size in sizes[1:]:  # compiled, not run: a prefill of many long prompts takes a while
                    args, kwargs = self._prefill_args(*self._prefill_inputs(_requests(size, length), [()] * size))
                    prefill.lower(*args, **kwargs).compile()
            width *= 2
        self.state = self.state.replace(done=jnp.ones_like(self.state.done))
        _log.info("compiled slot bucket%s %s and the prefill (batch sizes %s) in %.1f s%s",
                  "s" if len(now) > 1 else "", ", ".join(map(str, now)), sizes, time.perf_counter() - t0,
                  "; larger buckets, speculation and longer prompts compile in the background" if ahead else "")
        if ahead:
            self._compiling = threading.Thread(target=self._compile_ahead, args=(ahead,), daemon=True,
                                               name="jaxspec-engine-compile")
            self._compiling.stop = self._stop_compiling
            _COMPILING.add(self._compiling)
            self._compiling.start()

    def _fill_bucket(self, n: int, state: DecodeState | None = None) -> DecodeState:
        """Run what serving at slot bucket n calls, so each of its programs is compiled: the prefill of the
        smallest prompt bucket at each prefill batch size a batch of n rows admits, each writing its rows into
        the batch, a chunk (width 1 while `_plain_until_compiled`, else every width) and the log-probability
        readback. On the engine's batch of n finished rows (state None, the loop thread: `warmup`), or on
        `state`, n finished rows of the compiling thread's own (donated), admitted with automata of their own, so
        nothing read is the engine's. Returns the batch after the chunk."""
        own_batch = state is not None
        sizes = self.config.prefill_batch_sizes
        fewest = dict(zip(sizes, (1, *(s + 1 for s in sizes[:-1]))))  # the fewest requests padded to each size
        method = self.config.spec.method
        for count in (fewest[size] for size in sizes if fewest[size] <= n):
            if own_batch:
                initial = [FREE] * count if self.config.constraints else None
                rows = self.prefill_requests(_requests(count, 3), [method] * count, [()] * count, initial, True)
                state = self._write_rows(state, rows, range(count))
            else:  # the engine's batch, its automata recorded as an admission records them
                self.admit_batch([(i, r, method, ()) for i, r in enumerate(_requests(count, 3))])
        if not own_batch:
            state = self.state
        caps = MixedParams(jnp.zeros(self.config.max_slots + 1, jnp.int32), self._member_params)
        state = decode_chunk(self.lm.graphdef, self.lm.params, state, slots.stack_settings([None] * n, MAX_STOP_IDS),
                             caps,
                             **self._chunk_settings(plain=self._plain_until_compiled))
        if state.logprobs is not None:
            window(state.logprobs, jnp.zeros((n,), jnp.int32), size=self.logprob_window)
        return state

    @property
    def largest_bucket(self) -> int:
        """The largest slot bucket the batch may grow to now: the largest there is, unless `warmup` left larger
        buckets compiling in the background (the scheduler admits no more rows than this holds)."""
        return self._largest_ready

    def _compile_ahead(self, work: list[tuple]) -> None:
        """On the compiling thread: ("bucket", B) runs what serving at slot bucket B calls (`_fill_bucket`) on B
        rows of its own, then lets the batch grow to B; ("chunk", B) runs the speculative chunk once over B
        finished rows of its own (the loop ends at once; it compiles the program into the jit cache the loop
        thread calls, at the batch's own shapes and placement), then marks the bucket speculating; ("prefill",
        shapes, static) compiles a prefill of those argument shapes ahead of time (into the persistent
        compilation cache where one is on; without one, the first such request compiles it again)."""
        t0 = time.perf_counter()
        with sharding.use_rules(self.lm.mesh, self.lm.rules):  # as the loop thread traces (nothing without a mesh)
            for item in work:
                if self._stop_compiling.is_set():
                    return
                try:
                    if item[0] == "bucket":
                        n = item[1]
                        try:
                            self._fill_bucket(n, self.empty_state(n))
                        finally:  # compiled, or (failed) compiled by the loop when it first grows to n
                            self._largest_ready = n
                        _log.info("serving up to %d slots: its programs compiled in the background in %.1f s", n,
                                  time.perf_counter() - t0)
                    elif item[0] == "chunk":
                        n = item[1]
                        caps = MixedParams(jnp.zeros(self.config.max_slots + 1, jnp.int32), self._member_params)
                        decode_chunk(self.lm.graphdef, self.lm.params, pinned(slots.empty_state(self._empty_row, n)),
                                     slots.stack_settings([None] * n, MAX_STOP_IDS), caps,
                                     **self._chunk_settings(plain=False))
                        self._speculating.add(n)
                        _log.info("speculation on at %d slots: its chunk compiled in the background in %.1f s", n,
                                  time.perf_counter() - t0)
                    else:
                        _, args, kwargs = item
                        prefill.lower(*args, **kwargs).compile()
                except Exception:  # noqa: BLE001 - the loop compiles it on demand instead
                    _log.exception("compiling %s ahead failed; it compiles when first needed", item)
        _log.info("compiled larger buckets, speculation and the prefills in the background in %.1f s",
                  time.perf_counter() - t0)

    def stop_compiling(self, wait: bool = True) -> None:
        """Stop the compiling thread after the program it compiles now, and (`wait`) wait for that one: a process
        whose interpreter finalises in the middle of an XLA compile on another thread crashes on its way out."""
        self._stop_compiling.set()
        if wait and self._compiling is not None:
            self._compiling.join()

    def compiling(self) -> bool:
        """Whether the compiling thread is alive (compiling a program, or about to stop)."""
        return self._compiling is not None and self._compiling.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the programs `warmup` left compiling are ready (True), or `timeout` seconds pass."""
        if self._compiling is not None:
            self._compiling.join(timeout)
            return not self._compiling.is_alive()
        return True
