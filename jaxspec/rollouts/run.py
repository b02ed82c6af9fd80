"""`jaxspec.rollout`: P prompts x G samples, decoded on the device with a compacted long tail.

The loop:
1. Prefill each prompt once and copy its K/V into its G rows (`PrefillSpec(group_size=G)`); each row samples its
   first token with its own seed.
2. Decode in chunks of `chunk_steps` steps (`decode_chunk`, the jitted loop). Between chunks the host reads
   which rows finished (one small transfer; with stop strings, the rows' text too, and a sample whose text
   reached one is marked finished: `StopStrings`) and
   - compacts: when the samples still running fit a smaller compiled batch (powers of two from 8 below the
     first batch, and 1: XLA:CPU runs 2-7 rows no faster than 8), the finished rows are read back and the
     running ones move to the front of the smaller batch (`jaxspec.engine.slots.regroup`, the engine's own
     machinery; a group's automaton, being batch-shared, stays whole);
   - asks the draft policy for the next chunk's draft cap (`DraftPolicy.for_rollouts`: its gain model switches
     speculation on, and K grows, where the smaller batch's measured verify cost is repaid by the measured
     acceptance).
3. Read back what is left and build the result.

Every sample's tokens are keyed by its seed (from (seed, p, g)) and each token's position only, so neither
compaction, nor batch order, nor the speculation method changes a single token (lossless verification).
Everything compiled is keyed by shapes and the proposer, never by the weights: an RL loop that passes new
`params=` each step reuses the programs.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import cost, sharding
from ..builders import build_proposer
from ..decode import PrefillSpec, StepSpec, decode_chunk, prefill
from ..engine import slots
from ..generation import cut_at_stop_string, default_attention_impl
from ..models.loading import LanguageModel
from ..penalties import any_penalty
from ..policy import MODES, ChunkReport, DraftPolicy, GainModel, overhead_for
from ..processors import ProcessorRequest
from ..proposers.group_sam import GroupSamProposer
from ..shapes import bucket_shapes, packed_width
from ..spec_config import SpecConfig
from ..state import DecodeState, RowLimits, RowParams
from .inputs import RolloutInputs, check_memory, validate
from .result import ChunkRecord, RolloutResult, SampleRecord, timeline_stats
from .stops import StopStrings

MIN_COMPACT_BATCH = 8  # below 8 rows XLA:CPU runs a forward no faster than at 8 (docs/cpu-performance.md)


def batch_buckets(num_rows: int, multiple: int = 1) -> tuple[int, ...]:
    """The compiled batch sizes a rollout of `num_rows` samples compacts through, largest first: the first
    batch, the powers of two from 8 below it, and 1; on a mesh only multiples of its data axis (`multiple`),
    so every device keeps the same number of rows."""
    sizes = {num_rows, 1}
    size = MIN_COMPACT_BATCH
    while size < num_rows:
        sizes.add(size)
        size *= 2
    return tuple(sorted({-(-n // multiple) * multiple for n in sizes}, reverse=True))


def rollout(lm: LanguageModel, prompts, *, num_samples: int, max_new_tokens: int, sampling,
            spec: SpecConfig | None = None, params=None, references=None, logprobs: bool = True,
            logprobs_mode: str = "sampling", seed: int = 0, stop_token_ids=(), stop=None, ignore_eos: bool = False,
            compaction: bool = True, speculation: str = "adaptive",
            chunk_steps: int = 16, group_capacity: int | None = None, shared_prefill: bool = True,
            attention_impl: str | None = None, prompt_offset: int = 0) -> RolloutResult:
    """Sample `num_samples` completions of each prompt (an RL rollout) and return them with their
    log-probabilities and the rollout's timeline.

    prompts: strings or token-id lists (P of them). sampling: one SamplingParams for all samples or one per
    prompt; each sample's seed comes from (`seed`, p, g) (`sample_seeds`), whatever seed `sampling` holds.
    spec: the speculation method (default none); `SpecConfig(method="group_sam")` drafts from every sample of
    the prompt, and `references` (per prompt a list of earlier completions, text or ids) adds draft material.
    params: policy weights with the shapes of `lm.params` (an update from training), run without recompiling.
    logprobs: record each sampled token's log-probability, under the distribution it was sampled from
    (logprobs_mode="sampling": temperature, top-k, top-p, min-p applied, what a policy-gradient loss needs) or
    under the target's raw softmax ("raw"). stop: strings that end a sample (a string or list for every prompt,
    or one per prompt, as `generate`'s stop=): a sample leaves the batch after the chunk in which its text
    reaches one, and is cut after the token completing it, its text before it (finish reason "stop").
    compaction: move the running samples to smaller compiled batches as others finish. speculation:
    "adaptive" (draft where the measured cost pays, `DraftPolicy.for_rollouts`), "fixed" (the full K in every
    chunk) or "off". chunk_steps: decode steps between host visits. group_capacity (group_sam): the most
    tokens one group's index holds (default: all of them), given, the index is a suffix automaton (`spec.sam_index`
    "auto" or "automaton"); a full automaton stops drafting, decoding goes on.
    shared_prefill: run each prompt through the target once for its G samples (False: once per sample, to
    measure what sharing saves). prompt_offset: these prompts are prompts prompt_offset.. of a larger rollout
    (one process's share, `jaxspec.distributed.rollout_data_parallel`): their samples take those prompts' seeds.

    Bad input raises a ValueError naming the value.
    """
    inputs = validate(lm, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens, sampling=sampling,
                      spec=spec, params=params, references=references, logprobs=logprobs,
                      logprobs_mode=logprobs_mode, seed=seed, stop_token_ids=stop_token_ids, stop=stop,
                      ignore_eos=ignore_eos, prompt_offset=prompt_offset)
    for name, flag in (("compaction", compaction), ("shared_prefill", shared_prefill)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"{name}={flag!r} must be True or False")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"chunk_steps={chunk_steps!r} must be an integer >= 1")
    if group_capacity is not None:
        if isinstance(group_capacity, bool) or not isinstance(group_capacity, int) or group_capacity < 1:
            raise ValueError(f"group_capacity={group_capacity!r} must be None or an integer >= 1")
        if inputs.spec.method != "group_sam":
            raise ValueError(f"group_capacity={group_capacity} sizes method='group_sam' automata; spec.method="
                             f"{inputs.spec.method!r}")
    attention_impl = attention_impl or default_attention_impl()
    if attention_impl not in ("xla", "pallas"):
        raise ValueError(f"attention_impl={attention_impl!r} must be None, 'xla' or 'pallas'")
    if speculation not in MODES:
        raise ValueError(f"speculation={speculation!r} must be one of {MODES}")
    return _Rollout(lm, inputs, compaction=bool(compaction), speculation=speculation, chunk_steps=chunk_steps,
                    group_capacity=group_capacity, attention_impl=attention_impl).run(bool(shared_prefill))


class _Rollout:
    """One rollout's host-side state: the batch on the device, which sample each row holds, what finished."""

    def __init__(self, lm: LanguageModel, inputs: RolloutInputs, *, compaction: bool, speculation: str,
                 chunk_steps: int, group_capacity: int | None, attention_impl: str):
        self.lm, self.inputs = lm, inputs
        self.chunk_steps, self.attention_impl = chunk_steps, attention_impl
        spec = inputs.spec
        lens = [len(p) for p in inputs.ids]
        self.width, self.buffer_len, self.cache_len = bucket_shapes(lens, inputs.max_new_tokens)
        self.proposer, self.proposer_params = build_proposer(
            lm, spec, prompt_width=self.width, buffer_len=self.buffer_len, cache_len=self.cache_len,
            group_size=inputs.num_samples)
        if inputs.references is not None:
            self.proposer_params = inputs.references
        self.params = inputs.params
        if lm.mesh is not None:  # updated policy weights go where lm's own parameters are
            self.params = jax.device_put(inputs.params, jax.tree.map(lambda x: x.sharding, lm.params))
            self.proposer_params = sharding.replicate(self.proposer_params, lm.mesh)
        index_bytes = 0
        if isinstance(self.proposer, GroupSamProposer):
            if group_capacity is not None:  # the proposer refuses it where its index is not an automaton
                try:
                    self.proposer = dataclasses.replace(self.proposer, max_tokens=group_capacity)
                except ValueError as e:
                    raise ValueError(f"group_capacity={group_capacity} sizes a group automaton: {e}") from None
            refs = inputs.references
            num_refs, ref_len = (0, 0) if refs is None else refs.tokens.shape[1:]
            index_bytes = inputs.num_prompts * self.proposer.index_bytes(num_refs, ref_len)
        # A proposer whose indexes can catch up from the samples' texts (`GroupSamProposer.catch_up`) sits out
        # the chunks that do not speculate: they run rollout-none's plain program with its state set aside, so
        # a rollout whose policy never speculates (T = 1.0 at large batches) pays for the indexes only at
        # prefill. Any other proposer follows every committed token, drafting or not.
        self.sits_out = isinstance(self.proposer, GroupSamProposer)
        self.behind = False  # chunks ran without the proposer since its indexes last caught up
        self._settings_key, self._settings_value = None, None  # the last batch's settings (`_settings`)
        check_memory(lm, num_prompts=inputs.num_prompts, num_samples=inputs.num_samples,
                     max_new_tokens=inputs.max_new_tokens, logprobs=inputs.logprobs, cache_len=self.cache_len,
                     history_len=self.width + self.buffer_len, index_bytes=index_bytes)
        self.widths = spec.verify_widths
        sharding.check_batch(lm.mesh, lm.rules, inputs.num_rows)
        data = sharding.axis_size(lm.mesh, lm.rules.batch if lm.rules else None)
        self.buckets = batch_buckets(inputs.num_rows, data) if compaction else (inputs.num_rows,)
        # Rollouts of one shape share what drafting was measured to cost (`overhead_for`): an RL loop runs one
        # per training step, and only the first pays for learning it.
        shape = (lm.name, repr(lm.config), self.proposer, self.widths, self.cache_len, self.buffer_len,
                 chunk_steps, attention_impl, None if lm.mesh is None else tuple(lm.mesh.shape.items()))
        self.k = spec.num_speculative_tokens
        self.policy = DraftPolicy.for_rollouts(speculation, GainModel(self.widths, self._verify_cost,
                                                                      overhead=overhead_for(shape)))
        self.prompt_lens = np.asarray(lens, np.int32)
        self.max_new = np.full((inputs.num_rows,), inputs.max_new_tokens, np.int32)
        self.samples: dict[int, SampleRecord] = {}
        self.chunks: list[ChunkRecord] = []
        self.stops = (StopStrings(lm.tokenizer, inputs.stop, inputs.num_samples, self.prompt_lens)
                      if inputs.stop else None)

    # ------------------------------------------------------------------ per-row settings of a batch

    def _settings(self, rows: np.ndarray, cap: int) -> RowParams:
        """The sampling arrays and limits of a batch whose row i holds sample rows[i] (-1: a padding row).

        Reused while the rows and the cap stay the same (most chunks): building them anew costs a gather and an
        upload per field, and SamplingParams checks its values on the host, a device-to-host copy per field.
        """
        key = (rows.tobytes(), cap)
        if self._settings_key != key:
            self._settings_key, self._settings_value = key, self._build_settings(rows, cap)
        return self._settings_value

    def _build_settings(self, rows: np.ndarray, cap: int) -> RowParams:
        idx = jnp.asarray(np.maximum(rows, 0))
        sampling = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), self.inputs.sampling)
        limits = RowLimits(max_new_tokens=jnp.asarray(self.max_new[np.maximum(rows, 0)]),
                           stop_ids=jnp.asarray(self.inputs.stop_table[np.maximum(rows, 0)]),
                           draft_cap=jnp.full((len(rows),), cap, jnp.int32))
        return self._place(RowParams(sampling=sampling, limits=limits), len(rows))

    def _place(self, tree, batch: int):
        """On a mesh: arrays of `batch` rows over its data axis, the rest replicated (`jaxspec.sharding`)."""
        lm = self.lm
        if lm.mesh is None:
            return tree
        if batch % sharding.axis_size(lm.mesh, lm.rules.batch):
            return sharding.replicate(tree, lm.mesh)  # prompts that do not split evenly: each device runs all
        return sharding.put_rows(tree, lm.mesh, lm.rules, batch)

    def _verify_cost(self, batch: int) -> dict[int, float] | None:
        """c(w) at this batch size, measured once per machine and shape, the prior until then (`jaxspec.cost.
        verify_cost`; None when measuring is off)."""
        if not cost.enabled() or len(self.widths) < 2:
            return None
        cached = int(self.prompt_lens.max()) + self.inputs.max_new_tokens // 2
        costs = cost.verify_cost(self.lm, batch=batch, cache_len=self.cache_len, widths=self.widths,
                                 cached=cached, attention_impl=self.attention_impl)
        return dict(zip(self.widths, costs))

    # ------------------------------------------------------------------ the loop

    def run(self, shared_prefill: bool = True) -> RolloutResult:
        with sharding.use_rules(self.lm.mesh, self.lm.rules), cost.generating():  # nothing without a mesh
            return self._run(shared_prefill)

    def _run(self, shared_prefill: bool) -> RolloutResult:
        inputs, lm = self.inputs, self.lm
        t0 = time.perf_counter()
        prompts = np.zeros((inputs.num_prompts, self.width), np.int32)
        for i, p in enumerate(inputs.ids):
            prompts[i, : len(p)] = p
        prompt_lens, group_size = self.prompt_lens, inputs.num_samples
        if not shared_prefill:  # every sample's row runs its prompt itself
            prompts, prompt_lens = (np.repeat(x, group_size, axis=0) for x in (prompts, prompt_lens))
            group_size = 1
        rows = np.arange(inputs.num_rows)  # the sample each batch row holds (p * G + g), -1 for padding
        cap = self.policy.cap(len(rows), self.k)
        settings = self._settings(rows, cap)
        logprob_rows = jnp.ones((inputs.num_rows,), bool) if inputs.logprobs else None
        processed = jnp.full((inputs.num_rows,), inputs.logprobs_mode == "sampling") if inputs.logprobs else None
        logprob_rows, processed = self._place((logprob_rows, processed), inputs.num_rows)
        # The prompts pack end to end for the prefill, unless their rows are split over a mesh's devices.
        packed = packed_width(prompt_lens.tolist(), self.width) if lm.mesh is None else None
        prompts, prompt_lens = self._place((jnp.asarray(prompts), jnp.asarray(prompt_lens)), len(prompts))
        processors = ProcessorRequest(logprob_rows=logprob_rows, logprobs_processed=processed,
                                      track_counts=bool(np.any(np.asarray(any_penalty(settings.sampling)))))
        spec = PrefillSpec(cache_len=self.cache_len, buffer_len=self.buffer_len, proposer=self.proposer,
                           group_size=group_size, packed=packed)
        state = prefill(lm.graphdef, self.params, prompts, prompt_lens, settings, self.proposer_params, processors,
                        spec=spec)
        done = np.asarray(jax.device_get(state.done))
        prefill_s = time.perf_counter() - t0
        # What each sample had counted at the last readback (row-steps, accepted drafts per position), so a
        # chunk's progress is a difference per sample, whichever batch row holds it.
        seen_steps = np.zeros((inputs.num_rows,), np.int64)
        seen_accepted = np.zeros((inputs.num_rows, self.proposer.num_speculative_tokens))
        while True:
            live = rows >= 0
            running = int((live & ~done).sum())
            if running == 0:
                break
            target = min(b for b in self.buckets if b >= running)
            if target < len(rows):
                self._collect(state, rows, live & done)
                keep = np.nonzero(live & ~done)[0]
                state = slots.regroup(state, keep, slots.empty_like(state, target))
                rows = np.concatenate([rows[keep], np.full((target - len(keep),), -1)])
                done = np.concatenate([np.zeros((len(keep),), bool), np.ones((target - len(keep),), bool)])
                live = rows >= 0
            cap = self.policy.cap(len(rows), self.k)
            overhead = self.policy.gain.overhead.factor(len(rows))  # what drafting was taken to cost beside c(w)
            settings = self._settings(rows, cap)
            if cap and self.behind:
                state = self._catch_up(state, rows)
            self.behind |= not cap and self.sits_out
            started, compiled = time.perf_counter(), cost.compile_seconds()
            steps_before = self.chunks[-1].end_step if self.chunks else 0
            # A chunk that drafts nothing compiles width 1 alone: a `lax.switch` over the verify widths costs a
            # third of a plain step at batch 32 on XLA:CPU.
            if not cap and self.sits_out:
                # rollout-none's program: carrying the group indexes and K-wide draft arrays through the loop
                # cost 4% a step at 64 rows; the state rejoins after the chunk.
                held = state.pstate
                state = decode_chunk(lm.graphdef, self.params, state.replace(pstate=()), settings, None,
                                     step=StepSpec(attention_impl=self.attention_impl),
                                     num_steps=self.chunk_steps).replace(pstate=held)
            else:
                step = StepSpec(self.proposer, self.widths if cap else (1,), self.attention_impl)
                state = decode_chunk(lm.graphdef, self.params, state, settings, self.proposer_params, step=step,
                                     num_steps=self.chunk_steps)
            read = (state.done, state.steps, state.counters.steps, state.counters.accepted_at)
            if self.stops is not None:
                read += (state.history, state.history_len)
            done, step, row_steps, accepted_at, *texts = (np.asarray(x) for x in jax.device_get(read))  # one readback
            if self.stops is not None:
                reached = self.stops.reached(rows, live & ~done, *texts)
                if reached.any():  # these samples' text is complete: they leave at the next compaction
                    state, done = slots.finish(state, np.nonzero(reached)[0]), done | reached
            run_s = time.perf_counter() - started - (cost.compile_seconds() - compiled)
            self.chunks.append(ChunkRecord(end_step=int(step), end_s=time.perf_counter() - t0, batch=len(rows),
                                           active=running, draft_cap=cap, run_s=run_s,
                                           drafting_overhead=overhead))
            held = rows[live]
            accepted = (accepted_at[live] - seen_accepted[held]).sum(axis=0)
            chunk_row_steps = int((row_steps[live] - seen_steps[held]).sum())
            self.policy.observe(ChunkReport(num_slots=len(rows), active=running, max_cap=cap,
                                            tokens=int(accepted.sum()) + chunk_row_steps, seconds=run_s,
                                            steps=max(int(step) - steps_before, 1), accepted_at=accepted,
                                            row_steps=chunk_row_steps))
            seen_steps[held], seen_accepted[held] = row_steps[live], accepted_at[live]
        self._collect(state, rows, rows >= 0)
        wall_s = time.perf_counter() - t0
        return self._result(wall_s, prefill_s)

    def _catch_up(self, state: DecodeState, rows: np.ndarray) -> DecodeState:
        """`state` with its group automata given every token committed while they were not followed: each
        sample's text from its batch row (rows[i]: the sample row i holds, -1 for padding), or from its record
        once it has finished and left the batch."""
        history, history_len = (np.asarray(x) for x in jax.device_get((state.history, state.history_len)))
        texts = np.zeros((self.inputs.num_rows, history.shape[1]), np.int32)
        lengths = np.zeros((self.inputs.num_rows,), np.int32)
        g = self.inputs.num_samples
        for sample, record in self.samples.items():
            text = np.concatenate([np.asarray(self.inputs.ids[sample // g], np.int32), record.tokens])
            texts[sample, : len(text)], lengths[sample] = text, len(text)
        held = rows >= 0
        texts[rows[held]], lengths[rows[held]] = history[held], history_len[held]
        if self.lm.mesh is not None:  # beside the automata, which are replicated
            texts, lengths = sharding.replicate((texts, lengths), self.lm.mesh)
        self.behind = False
        return state.replace(pstate=self.proposer.catch_up(state.pstate, texts, lengths))

    def _collect(self, state: DecodeState, rows: np.ndarray, which: np.ndarray) -> None:
        """Read back the samples in batch rows `which` (bool[b]) that are not collected yet."""
        which = which & (rows >= 0) & ~np.isin(rows, list(self.samples))
        if not which.any():
            return
        c = state.counters
        history, history_len, steps, drafted, accepted, committed = (
            np.asarray(x) for x in jax.device_get((state.history, state.history_len, c.steps, c.drafted,
                                                   c.accepted, c.committed)))
        token_lp = None if state.logprobs is None else np.asarray(jax.device_get(state.logprobs.token))
        g = self.inputs.num_samples
        if self.stops is not None:
            self.stops.forget(rows[which])
        for i in np.nonzero(which)[0]:
            sample = int(rows[i])
            start, end = int(self.prompt_lens[sample // g]), int(history_len[i])
            self.samples[sample] = SampleRecord(
                tokens=history[i, start:end].tolist(),
                logprobs=None if token_lp is None else token_lp[i, start:end].tolist(),
                steps=int(steps[i]), drafted=int(drafted[i]), accepted=int(accepted[i]),
                committed=committed[i, : int(steps[i])].copy())

    def _finished(self, sample: SampleRecord, stop_ids: np.ndarray, stops: tuple[str, ...]):
        """(tokens, text, finish reason, log-probabilities) of one sample: its tokens end with a stop id, or
        with the token completing its first stop string (cut there, as `generate(stop=...)` cuts), or at the
        budget; the text leaves out the stop id, the stop string and special tokens."""
        tokens, tokenizer = sample.tokens, self.lm.tokenizer
        stopped = bool(tokens) and tokens[-1] in set(stop_ids.tolist()) - {-1}
        body = tokens[:-1] if stopped else tokens
        cut = cut_at_stop_string(self.lm, body, stops) if stops else None
        if cut is not None:
            tokens, text = cut
            stopped = True
        else:
            text = tokenizer.decode(body, skip_special_tokens=True) if tokenizer else ""
        lp = None if sample.logprobs is None else sample.logprobs[: len(tokens)]
        return tokens, text, "stop" if stopped else "length", lp

    def _result(self, wall_s: float, prefill_s: float) -> RolloutResult:
        inputs = self.inputs
        g = inputs.num_samples
        ordered = [self.samples[i] for i in range(inputs.num_rows)]
        token_ids, texts, reasons, logprobs = [], [], [], []
        for p in range(inputs.num_prompts):
            group = ordered[p * g: (p + 1) * g]
            finished = [self._finished(s, inputs.stop_table[p * g + j], inputs.stop[p] if inputs.stop else ())
                        for j, s in enumerate(group)]
            for out, column in zip((token_ids, texts, reasons, logprobs), zip(*finished)):
                out.append(list(column))
        stats = timeline_stats(ordered, self.chunks, wall_s=wall_s, prefill_s=prefill_s)
        seeds = np.asarray(inputs.sampling.seed).reshape(inputs.num_prompts, g)
        return RolloutResult(token_ids=token_ids, text=texts, finish_reason=reasons,
                             logprobs=logprobs if inputs.logprobs else None, stats=stats, seeds=seeds)
