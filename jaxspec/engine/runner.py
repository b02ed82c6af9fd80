"""The device side of the engine: one batched `DecodeState`, and the programs that fill, advance and read it.

The `Runner` belongs to the engine's loop thread. It prefills each admitted request alone and writes its row
into a slot (`admit`), regroups the batch into another compiled size (`regroup`), runs a chunk of decode steps
over every row and reads back what each occupied row committed, with the draft flags and, for rows that asked,
the log-probabilities (`run_chunk`). `warmup` compiles all of that before the first request, and
`EngineMetrics` keeps the running totals the server exports.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import SamplingParams, SpecConfig
from ..decode import DecodeState, RowLimits, SpecCounters, decode_chunk, prefill
from ..generation import default_attention_impl
from ..limits import stop_table
from ..logprobs import TokenLogprob, to_host, window
from ..methods import build_proposer
from ..models.loading import LanguageModel
from ..proposers.mixed import MixedParams, MixedProposer, MixedState
from ..shapes import BUCKET_MIN, prompt_bucket
from . import slots
from .config import EngineConfig
from .request import MAX_STOP_IDS, LiveRequest, Request

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


class Runner:
    """The engine's batch on the device and the programs over it; only the engine's loop thread calls it."""

    def __init__(self, lm: LanguageModel, config: EngineConfig, metrics: EngineMetrics):
        self.lm = lm  # the target model
        self.config = config  # the engine's settings
        self.metrics = metrics  # the engine's totals, which `run_chunk` adds to
        self.k = config.num_speculative_tokens  # K, the most drafts per row and step
        self.widths = config.verify_widths  # the target-forward widths compiled in
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
        self._member_params = tuple(member_params)
        # The batch: B rows, B one of config.slot_buckets. The loop thread donates it to every program, so read
        # it from elsewhere only while the engine idles.
        self.state: DecodeState | None = None
        self._empty_row: DecodeState | None = None
        self._steps_read = 0  # the loop's step counter at the last read (a regroup keeps the old batch's)

    @property
    def num_slots(self) -> int:
        """B, the rows of the batch (0 before the first `reset`)."""
        return 0 if self.state is None else self.state.done.shape[0]

    @property
    def logprob_window(self) -> int:
        """History slots read back per row after a chunk: a chunk commits at most chunk_steps * (K + 1) tokens
        a row, so one fixed-size window (one compiled program per slot bucket) always holds them."""
        return min(self.config.chunk_steps * (self.k + 1), self.config.cache_len)

    # ------------------------------------------------------------------ the batch

    def prefill(self, prompts: jax.Array, prompt_lens: jax.Array, sampling: SamplingParams, limits: RowLimits,
                wants_logprobs: bool) -> DecodeState:
        """A state of prompts.shape[0] rows (prompts i32[B, P], prompt_lens i32[B]) in the batch's row shape."""
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

    def empty_state(self, n: int) -> DecodeState:
        """n finished rows: copies of a one-token prefill (a valid proposer state too), marked done."""
        if self._empty_row is None:
            limits = RowLimits(max_new_tokens=jnp.ones((1,), jnp.int32),
                               stop_ids=jnp.full((1, MAX_STOP_IDS), -1, jnp.int32))
            self._empty_row = self.prefill(jnp.zeros((1, BUCKET_MIN), jnp.int32), jnp.ones((1,), jnp.int32),
                                           SamplingParams().broadcast(1), limits, wants_logprobs=False)
        return slots.empty_state(self._empty_row, n)

    def reset(self, n: int) -> None:
        """Start over from n finished rows (its step counter at 0)."""
        self.state = self.empty_state(n)
        self._steps_read = 0

    def regroup(self, keep: list[int], n: int) -> None:
        """Regroup the batch into n rows: rows `keep` first, in that order, then finished ones."""
        if self.state is not None and self.num_slots == n and keep == list(range(len(keep))):
            return
        if self.state is None or not keep:
            self.reset(n)
        else:
            self.state = slots.regroup(self.state, keep, self.empty_state(n))

    def lost(self) -> bool:
        """Whether the batch is gone: never built, or donated to a device program that then failed."""
        return self.state is None or any(x.is_deleted() for x in jax.tree.leaves(self.state))

    def finish_rows(self, rows: list[int]) -> None:
        """Mark rows done on the device (cancelled requests): the loop stops advancing them."""
        self.state = slots.finish(self.state, rows)

    def admit(self, slot: int, request: Request, method: str, stop_ids: Sequence[int]) -> RowUpdate:
        """Prefill `request` alone and write its row into `slot`; returns its first token, which prefill samples
        (done when that token is a stop id or the budget is one token)."""
        n = len(request.prompt_ids)
        prompt = np.zeros((1, prompt_bucket(n, self.config.cache_len)), np.int32)  # i32[1, P]
        prompt[0, :n] = request.prompt_ids
        limits = RowLimits(max_new_tokens=jnp.asarray([request.max_tokens], jnp.int32),
                           stop_ids=jnp.asarray(stop_table([stop_ids], MAX_STOP_IDS)))
        row = self.prefill(jnp.asarray(prompt), jnp.asarray([n], jnp.int32), SamplingParams.stack([request.sampling]),
                           limits, wants_logprobs=request.logprobs is not None)
        k = self.k if request.num_speculative_tokens is None else request.num_speculative_tokens
        choice = self._drafting.index(method) if method in self._drafting else 0
        if method == "none":
            k = 0
        pstate: MixedState = row.pstate
        row = row.replace(pstate=pstate.replace(choice=jnp.asarray([choice], jnp.int32),
                                                max_draft=jnp.asarray([k], jnp.int32)))
        self.state = slots.insert(self.state, row, jnp.asarray(slot, jnp.int32))
        first, done = jax.device_get((row.history[0, n], row.done[0]))
        logprobs = None
        if request.logprobs is not None:
            buffer = jax.device_get(row.logprobs)
            logprobs = to_host([int(first)], buffer.token[0, n:n + 1], buffer.top_ids[0, n:n + 1],
                               buffer.top[0, n:n + 1], request.logprobs)
        return RowUpdate(tokens=[int(first)], from_draft=[False], done=bool(done), logprobs=logprobs)

    # ------------------------------------------------------------------ decoding

    def _decode(self, rows: Sequence[LiveRequest | None], caps: np.ndarray) -> DecodeState:
        """Up to chunk_steps decode steps over the batch; caps i32[max_slots + 1] (`SpeculationPolicy`)."""
        settings = [None if r is None else slots.RowSettings(r.request.sampling, r.request.max_tokens, r.stop_ids)
                    for r in rows]
        sampling, limits = slots.stack_settings(settings, MAX_STOP_IDS)
        self.state = decode_chunk(self.lm.graphdef, self.lm.params, self.state, sampling, limits,
                                  MixedParams(jnp.asarray(caps), self._member_params), proposer=self.proposer,
                                  widths=self.widths, attention_impl=self.attention_impl,
                                  num_steps=self.config.chunk_steps)
        return self.state

    def run_chunk(self, rows: Sequence[LiveRequest | None], caps: np.ndarray) -> ChunkResult:
        """Run a chunk over the batch whose slots hold `rows`, read back what each occupied row committed since
        the last read (`LiveRequest.emitted`), and add it to the metrics."""
        t0 = time.perf_counter()
        state = self._decode(rows, caps)
        host = jax.device_get({"history": state.history, "from_draft": state.from_draft,
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
                drafted_at=host["drafted_at"][i], accepted_at=host["accepted_at"][i])
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

    def warmup(self) -> None:
        """Compile before the first request: the chunk (and its log-probability readback) for every slot bucket,
        the prefill for every prompt bucket. Leaves a batch of the smallest bucket, every row finished."""
        t0 = time.perf_counter()
        method = self.config.spec.method
        for n in self.config.slot_buckets:
            self.regroup([], n)
            self.admit(0, Request([1] * 3, 2), method, ())
            self._decode([None] * n, np.zeros(self.config.max_slots + 1, np.int32))
            if self.state.logprobs is not None:
                window(self.state.logprobs, jnp.zeros((n,), jnp.int32), size=self.logprob_window)
        self.regroup([], self.config.slot_buckets[0])
        width = BUCKET_MIN * 2
        while width // 2 < self.config.max_context - 1:
            self.admit(0, Request([1] * min(width, self.config.max_context - 2), 2), method, ())
            width *= 2
        self.state = self.state.replace(done=jnp.ones_like(self.state.done))
        _log.info("compiled %d slot buckets and the prefill in %.1f s", len(self.config.slot_buckets),
                 time.perf_counter() - t0)
