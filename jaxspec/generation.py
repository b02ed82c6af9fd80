"""`jaxspec.generate`: the host-side boundary of generation.

It validates input (clear `ValueError`s naming the bad value), tokenises, pads to bucketed shapes so that
similar requests reuse one compiled program, runs the device-side prefill and decode loop, and turns the
result back into token lists, text and timing.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import cost, predicted_outputs, sharding
from .builders import build_proposer
from .cache import kv_bytes_per_slot
from .constraints import rows as constraint_rows
from .decode import PrefillSpec, StepSpec, decode, prefill, propose_once
from .limits import check_prompt, eos_ids, is_token_list, stop_ids, stop_table
from .logprobs import TokenLogprob, to_host
from .methods import forced_token_budget
from .models.loading import LanguageModel
from .penalties import any_penalty
from .policy import ChunkReport, DraftPolicy
from .processors import ProcessorRequest
from .proposers.base import Draft, Proposer, drafts_chains
from .sampling_params import SamplingParams
from .shapes import (
    CACHE_ALIGN,
    bucket_shapes,
    packed_width,
    widths_for_cost_choice,
    widths_for_forced_text,
    widths_for_long_drafts,
)
from .spec_config import SpecConfig
from .state import RowLimits, RowParams, mean_acceptance_length
from .text import TextStream
from .validation import is_integer, short_repr


@dataclasses.dataclass(frozen=True)
class RowStats:
    """One row's decode-loop counts and timing, inside `GenerateStats.rows`."""

    steps: int  # loop steps in which the row was active (each one target forward)
    drafted: int  # draft tokens scored by the target
    accepted: int  # accepted drafts that were emitted
    generated: int  # new tokens, the first (from prefill) included
    committed_per_step: tuple[int, ...]  # tokens committed at each of the row's steps, in order
    decode_s: float = 0.0  # seconds of the decode loop (the whole batch's)
    # with generate's prediction=: prediction tokens drafted and accepted, and drafted and rejected (OpenAI's
    # usage fields); None without a prediction
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per step (`jaxspec.state.mean_acceptance_length`)."""
        return mean_acceptance_length(sum(self.committed_per_step), self.steps)

    @property
    def tokens_per_s(self) -> float:
        """Tokens the decode loop made for this row (its first came from prefill) per second."""
        return (self.generated - 1) / self.decode_s if self.decode_s > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """Counts and timings of one `generate` call, over all rows, with each row's own in `rows`."""

    prompt_tokens: int  # prompt tokens over all rows
    generated_tokens: int  # new tokens over all rows, each row's first (from prefill) included
    steps: int  # decode-loop forward passes (prefill not counted)
    prefill_s: float  # seconds of prefill
    decode_s: float  # seconds of the decode loop
    num_rows: int = 0  # each row's first token comes from prefill, not from the decode loop
    drafted: int = 0  # draft tokens scored by the target, over all rows
    accepted: int = 0  # accepted drafts that were emitted, over all rows
    drafted_per_position: tuple[int, ...] = ()  # steps (over rows) with a draft at position j
    accepted_per_position: tuple[int, ...] = ()  # ... whose draft at position j was accepted and emitted
    row_steps: int = 0  # sum over rows of the steps each was active
    rows: tuple[RowStats, ...] = ()  # one per prompt, in order

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of prefill."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens made by the decode loop (each row's first token comes from prefill) per second."""
        return (self.generated_tokens - self.num_rows) / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per active row-step over all rows (`jaxspec.state.mean_acceptance_length`)."""
        return mean_acceptance_length(sum(sum(r.committed_per_step) for r in self.rows), self.row_steps)

    @property
    def acceptance_rate_per_position(self) -> tuple[float, ...]:
        """P(draft j accepted | drafted), per draft position j."""
        return tuple(a / d if d else float("nan") for a, d in zip(self.accepted_per_position,
                                                                   self.drafted_per_position))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens over the whole run."""
        return self.accepted / self.drafted if self.drafted else float("nan")


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What `generate` returns: per prompt, the new tokens, their text, why the row ended; and the stats."""

    token_ids: list[list[int]]  # new tokens per prompt, including the stop token that ended a row
    text: list[str]  # decoded new text per prompt, without the stop token
    finish_reason: list[str]  # "stop" (EOS or a stop id) or "length" (max_new_tokens)
    stats: GenerateStats  # counts and timings of the whole call
    logprobs: list[list[TokenLogprob]] | None = None  # per prompt, one per token of token_ids (`logprobs=`)
    # The same new tokens as arrays: i32[B, max_new_tokens], row i's first num_tokens[i] entries, -1 after them.
    token_array: np.ndarray | None = dataclasses.field(default=None, compare=False)
    num_tokens: np.ndarray | None = dataclasses.field(default=None, compare=False)  # i32[B]


def default_attention_impl() -> str:
    """The Pallas kernel where a GPU runs it natively; XLA's attention on CPU (Pallas only interprets there)."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def _encode(lm: LanguageModel, i: int, text: str) -> list[int]:
    """Prompt i's text as token ids, or ValueError naming the prompt."""
    if lm.tokenizer is None:
        raise ValueError(f"prompt {i} is text but model {lm.name!r} has no tokenizer; pass token ids")
    try:
        text.encode("utf-8")  # lone surrogates ("\ud800") are not text the tokenizer can take
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt {i} is not valid Unicode text: {e.reason} at index {e.start} "
                         f"({text[e.start:e.end]!r})") from e
    try:
        return list(lm.tokenizer.encode(text))
    except (TypeError, ValueError, UnicodeError) as e:
        raise ValueError(f"prompt {i} could not be tokenised: {e}") from e


def _host(x, name: str = "prompts"):
    """A concrete jax array as a numpy array; anything else unchanged. ValueError for tracers and PRNG keys."""
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"{name} must be concrete token ids, not traced values inside jit")
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name} is an array of PRNG keys {x.dtype}; it must hold integer token ids")
    return np.asarray(x) if isinstance(x, jax.Array) else x


def _array_rows(prompts: np.ndarray, prompt_lengths) -> list[np.ndarray]:
    """Rows of a right-padded i32[B, P] prompt array, each cut to its length (default: all P), or ValueError."""
    if prompts.dtype.kind not in "iu":
        raise ValueError(f"prompts is a {prompts.dtype} array of shape {prompts.shape}; token ids must be integers")
    batch, width = prompts.shape
    if batch == 0 or width == 0:
        raise ValueError(f"prompts has shape {prompts.shape}: at least one row of at least one token is needed")
    if prompt_lengths is None:
        return list(prompts)
    lengths = _host(prompt_lengths, "prompt_lengths")
    if not is_token_list(lengths) or len(lengths) != batch:
        raise ValueError(f"prompt_lengths={prompt_lengths!r} must be {batch} integers, one per row of prompts "
                         f"{prompts.shape}")
    for i, n in enumerate(lengths):
        if not 1 <= n <= width:
            raise ValueError(f"prompt_lengths[{i}]={int(n)} must be in [1, {width}] (prompts has shape "
                             f"{prompts.shape})")
    return [row[: int(n)] for row, n in zip(prompts, lengths)]


def normalise_prompts(lm: LanguageModel, prompts, prompt_lengths=None) -> list[list[int]]:
    """Token-id lists from one prompt or a batch, strings encoded with the model's tokenizer, ids checked.

    A batch is a list of strings, token-id lists or 1-D integer arrays (numpy or jax), or one integer array
    i32[B, P] whose row i holds `prompt_lengths[i]` tokens followed by padding (default: all P are tokens).
    """
    prompts = _host(prompts)
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = _array_rows(prompts, prompt_lengths)
    elif prompt_lengths is not None:
        raise ValueError(f"prompt_lengths={prompt_lengths!r} needs prompts as one 2-D integer array [B, P]")
    elif isinstance(prompts, (list, tuple)):
        prompts = [_host(p, f"prompt {i}") for i, p in enumerate(prompts)]
    if isinstance(prompts, str) or (is_token_list(prompts) and len(prompts) > 0):
        prompts = [prompts]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings or token-id lists, or an "
                         "integer array [B, P]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = _encode(lm, i, p)
        elif not is_token_list(p):
            raise ValueError(f"prompt {i}={p!r} must be a string or a list of integer token ids")
        out.append(check_prompt(p, lm.config.vocab_size, f"prompt {i}"))
    return out


def _stop_ids(lm: LanguageModel, num_rows: int, stop_token_ids, ignore_eos: bool) -> np.ndarray:
    """i32[B, M] each row's stop ids (EOS unless ignore_eos, then the user's), -1 padded."""
    vocab = lm.config.vocab_size
    eos = () if ignore_eos else eos_ids(lm)
    per_prompt = (isinstance(stop_token_ids, (list, tuple)) and len(stop_token_ids) > 0
                  and all(isinstance(s, (list, tuple, np.ndarray)) for s in stop_token_ids))
    if per_prompt:
        if len(stop_token_ids) != num_rows:
            raise ValueError(f"stop_token_ids has {len(stop_token_ids)} lists for {num_rows} prompts")
        per_row = [stop_ids(s, eos, vocab, f"stop_token_ids[{i}]") for i, s in enumerate(stop_token_ids)]
    else:
        per_row = [stop_ids(stop_token_ids, eos, vocab)] * num_rows
    return stop_table(per_row)


def _row_sampling(sampling, batch: int) -> SamplingParams:
    """Per-row sampling arrays [B] from one SamplingParams or one per prompt, or ValueError."""
    if isinstance(sampling, SamplingParams):
        return sampling.broadcast(batch)
    if not isinstance(sampling, (list, tuple)):
        raise ValueError(f"sampling={sampling!r} must be a SamplingParams or a list of them, one per prompt")
    if len(sampling) != batch:
        raise ValueError(f"sampling has {len(sampling)} entries for {batch} prompts")
    for i, s in enumerate(sampling):
        if not isinstance(s, SamplingParams):
            raise ValueError(f"sampling[{i}]={s!r} must be a SamplingParams")
    return SamplingParams.stack(list(sampling))


def _check_scalars(lm: LanguageModel, *, max_new_tokens, logprobs, ignore_eos, max_cache_len) -> None:
    """ValueError naming the first bad scalar argument of `generate`."""
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if logprobs is not None and (not is_integer(logprobs) or not 0 <= logprobs <= lm.config.vocab_size):
        raise ValueError(f"logprobs={logprobs!r} must be None or an integer in [0, {lm.config.vocab_size}]")
    if not isinstance(ignore_eos, (bool, np.bool_)):
        raise ValueError(f"ignore_eos={ignore_eos!r} must be True or False")
    context = lm.config.max_position_embeddings
    if max_cache_len is not None and (not is_integer(max_cache_len) or not 1 <= max_cache_len <= context):
        raise ValueError(f"max_cache_len={max_cache_len!r} must be None or an integer in [1, {context}] "
                         f"(the context length of {lm.name!r})")


def available_memory() -> int:
    """Bytes the device can hold: its allocator's limit where it reports one (GPUs), else the host's memory."""
    stats = jax.local_devices()[0].memory_stats() or {}  # a process can read only its own devices
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rows_bytes(lm: LanguageModel, *, num_rows: int, cache_len: int, history_len: int, logprobs: bool) -> int:
    """Bytes `num_rows` decoding rows hold on the device: KV cache, token history, log-probabilities."""
    kv = num_rows * cache_len * kv_bytes_per_slot(lm.module)
    return kv + num_rows * history_len * (4 + 1 + (4 if logprobs else 0))


def _check_memory(lm: LanguageModel, ids: list[list[int]], max_new_tokens: int, logprobs: bool) -> None:
    """ValueError naming the batch and max_new_tokens, with the bytes needed and available, when the batch's rows
    would not fit in the device's memory; from the sizes alone, before anything is allocated per row."""
    width, buffer_len, cache_len = bucket_shapes([len(p) for p in ids], max(max_new_tokens, 1))
    need = rows_bytes(lm, num_rows=len(ids), cache_len=cache_len, history_len=width + buffer_len, logprobs=logprobs)
    need //= 1 if lm.mesh is None else lm.mesh.size  # on a mesh, at best spread evenly over its devices
    have = available_memory()
    if need > have:
        raise ValueError(f"{len(ids)} prompts with max_new_tokens={max_new_tokens} need about {need} bytes "
                         f"({need / 2**30:.2f} GiB of KV cache and history) but {have} bytes "
                         f"({have / 2**30:.2f} GiB) are available: pass fewer prompts or lower max_new_tokens")


_SEED_LIMIT = 2**32 - 1


def _rng_key(rng) -> jax.Array:
    """A typed PRNG key from `rng`: an integer in [0, 2**32 - 1], a `jax.random.key` or a `jax.random.PRNGKey`."""
    allowed = (f"rng={rng!r} must be None, an integer in [0, 2**32 - 1], one jax.random.key or one "
               "jax.random.PRNGKey")
    if isinstance(rng, jax.core.Tracer):
        raise ValueError(f"rng must be concrete, not a traced value inside jit: {allowed}")
    is_array = isinstance(rng, (jax.Array, np.ndarray))
    if is_array and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"rng has shape {rng.shape}: {allowed}")
        return rng
    if is_array and rng.ndim == 0 and rng.dtype.kind in "iu":
        rng = int(rng)  # a 0-d integer array: the integer it holds
    if is_integer(rng) and 0 <= rng <= _SEED_LIMIT:
        return jax.random.key(int(rng))
    if is_array and rng.dtype == np.uint32 and rng.ndim == 1:
        try:
            return jax.random.wrap_key_data(jnp.asarray(rng))
        except (TypeError, ValueError) as e:  # the wrong length for the default PRNG implementation
            raise ValueError(f"{allowed} ({e})") from e
    raise ValueError(allowed)


def rng_seeds(rng, batch: int) -> np.ndarray:
    """u32[B] the seeds `rng=` gives rows 0..B-1: row i gets `jax.random.bits(jax.random.fold_in(key, i), (),
    jnp.uint32)`, where key is `rng` itself or `jax.random.key(rng)` for an integer (a `PRNGKey`'s raw data is
    wrapped as a key first, so `PRNGKey(s)`, `key(s)` and `s` give the same seeds)."""
    key = _rng_key(rng)
    bits = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32))
    return np.asarray(bits(jnp.arange(batch, dtype=jnp.uint32)))


def _seeded(rows: SamplingParams, rng) -> SamplingParams:
    """Rows whose seed is 0 (SamplingParams' default) take their seed from `rng` (`rng_seeds`); rows with a
    seed of their own keep it. No `rng`: the rows unchanged."""
    if rng is None:
        return rows
    seeds = rng_seeds(rng, rows.seed.shape[0])  # u32[B]
    return rows.replace(seed=jnp.asarray(np.where(np.asarray(rows.seed) == 0, seeds, np.asarray(rows.seed))))


@dataclasses.dataclass(frozen=True)
class _Request:
    """`generate`'s and `prepare`'s arguments, validated and normalised on the host."""

    ids: list[list[int]]  # each prompt's token ids
    sampling: SamplingParams  # per-row arrays [B], seeds filled from rng
    stop_table: np.ndarray  # i32[B, M] stop ids, -1 padded
    spec: SpecConfig
    max_new_tokens: int
    logprobs: int | None
    attention_impl: str
    predictions: predicted_outputs.Predictions | None = None
    constraint: constraint_rows.ConstraintRows | None = None
    stop: tuple[tuple[str, ...], ...] | None = None  # per row, the stop strings (None: none anywhere)
    policy: DraftPolicy | None = None  # generate's policy=: caps the rows' drafts, told what the call achieved


def _request(lm: LanguageModel, prompts, *, prompt_lengths, max_new_tokens, sampling, stop_token_ids, ignore_eos,
             max_cache_len, attention_impl, spec, logprobs, rng, prediction=None, constraint=None,
             stop=None, policy=None) -> _Request:
    """Every argument checked (ValueError naming the first bad one) and normalised."""
    spec = SpecConfig() if spec is None else spec
    if not isinstance(spec, SpecConfig):
        raise ValueError(f"spec={spec!r} must be a jaxspec.SpecConfig")
    _check_scalars(lm, max_new_tokens=max_new_tokens, logprobs=logprobs, ignore_eos=ignore_eos,
                   max_cache_len=max_cache_len)
    # numpy integers pass the checks; shapes and static jit arguments need Python ints.
    max_new_tokens, ignore_eos = int(max_new_tokens), bool(ignore_eos)
    logprobs = None if logprobs is None else int(logprobs)
    max_cache_len = None if max_cache_len is None else int(max_cache_len)
    if attention_impl is None:
        attention_impl = default_attention_impl()
    if not isinstance(attention_impl, str) or attention_impl not in ("xla", "pallas"):
        raise ValueError(f"attention_impl={attention_impl!r} must be None, 'xla' or 'pallas'")
    ids = normalise_prompts(lm, prompts, prompt_lengths)
    limit = lm.config.max_position_embeddings if max_cache_len is None else max_cache_len
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{len(p) + max_new_tokens} cache slots but max_cache_len={limit}")
    _check_memory(lm, ids, max_new_tokens, logprobs is not None)
    stop_table = _stop_ids(lm, len(ids), stop_token_ids, ignore_eos)
    rows = _seeded(_row_sampling(sampling, len(ids)), rng)
    predictions = predicted_outputs.normalise(lm, prediction, len(ids), lm.config.vocab_size)
    constraint = constraint_rows.rows_for(lm, constraint, len(ids))
    if policy is not None and not isinstance(policy, DraftPolicy):
        raise ValueError(f"policy={short_repr(policy)} must be None or a jaxspec.policy.DraftPolicy")
    if (policy is not None and predictions is None and constraint is None
            and policy.cap(len(ids), spec.num_speculative_tokens) == 0):
        spec = SpecConfig()  # nothing may draft: the plain program, no proposer built or run in the loop
    return _Request(ids=ids, sampling=rows, stop_table=stop_table, spec=spec, max_new_tokens=max_new_tokens,
                    logprobs=logprobs, attention_impl=attention_impl, predictions=predictions, constraint=constraint,
                    stop=check_stop_strings(lm, stop, len(ids)), policy=policy)


def _draft_cap(policy: DraftPolicy | None, batch: int, k: int) -> int | None:
    """The policy's cap on every row's drafts for a proposer of K drafts, or None when it allows all K (no row
    limit: the call compiles what it would without a policy)."""
    if policy is None:
        return None
    cap = policy.cap(batch, k)
    return None if cap >= k else cap


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """Everything `prefill` and `decode` take for one batch, built from plain inputs by `prepare`.

    Arrays live on the device; the rest are static arguments. `generate` runs exactly this:

        state = prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                        p.processors, spec=p.prefill_spec)
        if p.predictions is not None:
            state = jaxspec.predicted_outputs.install(state, p.predictions)
        state = decode(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step,
                       verify_cost=p.verify_cost)
        tokens, counts = p.new_tokens(state)
    """

    prompts: jax.Array  # i32[B, P]  right-padded with 0 to the prompt bucket P
    prompt_lens: jax.Array  # i32[B]  true prompt lengths
    sampling: SamplingParams  # per-row arrays [B] (seeds from rng filled in)
    limits: RowLimits  # token budget i32[B] and stop ids i32[B, M]
    proposer: Proposer  # static: NoProposer() for plain decoding
    proposer_params: Any  # the proposer's pytree (weights, a static automaton), or None
    cache_len: int  # KV cache slots S per row
    buffer_len: int  # output buffer N (a power of two >= max_new_tokens); the history is P + N wide
    widths: tuple[int, ...]  # verify widths, ending at K + 1
    max_new_tokens: int
    attention_impl: str = "xla"  # "xla" or "pallas" for verification
    verify_cost: jax.Array | None = None  # f32[len(widths)] measured c(w) (SpecConfig.cost_aware), or None
    logprob_rows: jax.Array | None = None  # bool[B] rows that record log-probabilities, or None
    num_top_logprobs: int = 0  # most likely tokens recorded per position (with logprob_rows)
    track_counts: bool = False  # some row has a penalty: the state counts tokens (`jaxspec.penalties`)
    # generate's prediction=: install them after prefill (`predicted_outputs.install`); the proposer drafts from them
    predictions: predicted_outputs.Predictions | None = None
    # generate's constraint=: each row's automaton state and the batch's automata (`Prepared.processors`)
    constraint: constraint_rows.ConstraintRows | None = None
    packed: int | None = None  # the prefill's packed positions (`PrefillSpec.packed`), or None: padded

    @property
    def batch_size(self) -> int:
        """B, the number of rows."""
        return self.prompts.shape[0]

    @property
    def rows(self) -> RowParams:
        """Each row's sampling settings and limits (`prefill`'s and `decode`'s `rows`)."""
        return RowParams(sampling=self.sampling, limits=self.limits)

    @property
    def processors(self) -> ProcessorRequest:
        """The processors the batch runs (`prefill`'s `processors`): log-probabilities, penalties, constraints."""
        return ProcessorRequest(logprob_rows=self.logprob_rows, constraint=self.constraint,
                                num_top_logprobs=self.num_top_logprobs, track_counts=self.track_counts)

    @property
    def prefill_spec(self) -> PrefillSpec:
        """How prefill lays out the batch (`prefill`'s `spec=`): the proposer, cache and output slots."""
        return PrefillSpec(cache_len=self.cache_len, buffer_len=self.buffer_len, proposer=self.proposer,
                           packed=self.packed)

    @property
    def step(self) -> StepSpec:
        """How each step runs (`decode`'s `step=`): the proposer, the verify widths and the attention."""
        return StepSpec(self.proposer, self.widths, self.attention_impl)

    def new_tokens(self, state) -> tuple[np.ndarray, np.ndarray]:
        """(i32[B, max_new_tokens] each row's new tokens, -1 after them; i32[B] how many) from a `DecodeState`."""
        history, history_len = jax.device_get((state.history, state.history_len))
        return _new_tokens(history, history_len, np.asarray(self.prompt_lens), self.max_new_tokens)


def _new_tokens(history: np.ndarray, history_len: np.ndarray, prompt_lens: np.ndarray,
                max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Generated tokens i32[B, max_new_tokens] (-1 padded) and their counts i32[B] from host histories i32[B, H]."""
    counts = (history_len - prompt_lens).astype(np.int32)  # i32[B]
    cols = np.arange(max_new_tokens)
    idx = np.minimum(prompt_lens[:, None] + cols, history.shape[1] - 1)  # i32[B, N]
    tokens = np.where(cols < counts[:, None], np.take_along_axis(history, idx, axis=1), -1)
    return tokens.astype(np.int32), counts


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _first_draft(params, prompts, prompt_lens, rows, proposer_params, *, graphdef, spec: PrefillSpec):
    """What the proposer returns at the first decode step. Only its shapes are taken (`.eval_shape`): jit
    caches the trace, so a repeated call with the same shapes and proposer traces nothing."""
    state = prefill(graphdef, params, prompts, prompt_lens, rows, proposer_params, spec=spec)
    return propose_once(spec.proposer, proposer_params, state, rows)


def _check_draft_field(proposer, name: str, got, want: tuple[int, ...] | None, kind, optional: bool) -> None:
    """ValueError naming Draft.<name> unless its abstract value has shape `want` and a dtype of `kind`."""
    if got is None:
        if optional:
            return
        raise ValueError(f"proposer {short_repr(proposer)}: Draft.{name} is None; expected shape {want}")
    shape, dtype = tuple(getattr(got, "shape", ())), getattr(got, "dtype", None)
    if shape != want or dtype is None or not jnp.issubdtype(dtype, kind):
        kind_name = "integers" if kind is jnp.integer else "floats"
        raise ValueError(f"proposer {short_repr(proposer)}: Draft.{name} has shape {shape} and dtype {dtype}; "
                         f"expected {kind_name} of shape {want}" + (" or None" if optional else ""))


def check_draft_shapes(lm: LanguageModel, prepared: "Prepared") -> None:
    """Trace the proposer's `init` and `propose` on the real inputs (`jax.eval_shape`: nothing runs) and raise
    a ValueError naming the Draft field whose shape or dtype is wrong: tokens [B, K] int, num_draft [B] int,
    probs None or [B, K, V] float, parents None or [B, K] int, confidence None or [B, K] float."""
    p = prepared
    proposer = p.proposer
    out = _first_draft.eval_shape(lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                                  graphdef=lm.graphdef, spec=p.prefill_spec)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Draft)):
        raise ValueError(f"proposer {short_repr(proposer)}: propose must return (Draft, state); got {out!r}")
    draft = out[0]
    b, k, v = p.batch_size, proposer.num_speculative_tokens, lm.config.vocab_size
    for name, want, kind, optional in (("tokens", (b, k), jnp.integer, False),
                                       ("num_draft", (b,), jnp.integer, False),
                                       ("probs", (b, k, v), jnp.floating, True),
                                       ("parents", (b, k), jnp.integer, True),
                                       ("confidence", (b, k), jnp.floating, True)):
        _check_draft_field(proposer, name, getattr(draft, name), want, kind, optional)


def _prepare(lm: LanguageModel, req: _Request) -> Prepared:
    """The device inputs for a validated request with max_new_tokens >= 1."""
    batch = len(req.ids)
    prompt_lens = [len(p) for p in req.ids]
    width, buffer_len, cache_len = bucket_shapes(prompt_lens, req.max_new_tokens)
    padded = np.zeros((batch, width), np.int32)  # i32[B, P]
    for i, p in enumerate(req.ids):
        padded[i, : len(p)] = p
    proposer, proposer_params = build_proposer(lm, req.spec, prompt_width=width, buffer_len=buffer_len,
                                               cache_len=cache_len)
    widths = req.spec.verify_widths
    corpus = proposer.uses_corpus  # before a wrapper hides it
    if req.predictions is not None:
        proposer = predicted_outputs.wrap(proposer, req.spec, req.predictions)
    if req.constraint is not None:
        proposer = constraint_rows.wrap(proposer, forced_token_budget(req.spec))
    if proposer.num_speculative_tokens > req.spec.num_speculative_tokens:
        widths = widths_for_long_drafts(widths, proposer.num_speculative_tokens)
    if isinstance(proposer, constraint_rows.ForcedTokenProposer):
        widths = widths_for_forced_text(widths, proposer.num_speculative_tokens)
    # The policy caps the drafts of the proposer the loop runs, a prediction's or forced tokens' included.
    draft_cap = _draft_cap(req.policy, batch, proposer.num_speculative_tokens)
    limits = RowLimits(max_new_tokens=jnp.full((batch,), req.max_new_tokens, jnp.int32),
                       stop_ids=jnp.asarray(req.stop_table),
                       draft_cap=None if draft_cap is None else jnp.full((batch,), draft_cap, jnp.int32))
    verify_cost = None
    # Chains, and trees drafted best node first; the loop would ignore another tree's table.
    ranked = proposer.ranks_nodes
    if ((drafts_chains(proposer) or ranked) and req.spec.cost_aware_at(batch, ranked, corpus) and len(widths) > 1
            and cost.enabled()):
        widths = widths_for_cost_choice(widths, proposer.num_speculative_tokens, tree=ranked)
        # Costs at a cache about half filled with output, the middle of the run, rounded down to the cache's
        # alignment: the table is keyed by it, and calls whose prompts differ by a few tokens share one.
        middle = max(prompt_lens) + req.max_new_tokens // 2
        costs = dict(zip(widths, cost.verify_cost(lm, batch=batch, cache_len=cache_len, widths=widths,
                                                  cached=middle - middle % CACHE_ALIGN,
                                                  attention_impl=req.attention_impl)))
        # Only the widths the table says can pay are compiled: each is a whole forward in the loop's program.
        widths = cost.widths_worth_compiling(widths, tuple(costs.values()), tree=ranked)
        verify_cost = jnp.asarray([costs[w] for w in widths], jnp.float32)
    prepared = Prepared(
        prompts=jnp.asarray(padded), prompt_lens=jnp.asarray(prompt_lens, jnp.int32), sampling=req.sampling,
        limits=limits, proposer=proposer, proposer_params=proposer_params, cache_len=cache_len,
        buffer_len=buffer_len, widths=widths, max_new_tokens=req.max_new_tokens,
        attention_impl=req.attention_impl, verify_cost=verify_cost,
        logprob_rows=None if req.logprobs is None else jnp.ones((batch,), bool),
        num_top_logprobs=req.logprobs or 0,
        track_counts=bool(np.any(np.asarray(any_penalty(req.sampling)))), predictions=req.predictions,
        constraint=req.constraint,
        # Rows split over a mesh's devices prefill padded: the packed positions would sit in one row.
        packed=packed_width(prompt_lens, width) if lm.mesh is None else None)
    if lm.mesh is not None:
        prepared = _on_mesh(lm, prepared)
    if req.spec.method == "custom":
        with sharding.use_rules(lm.mesh, lm.rules):
            check_draft_shapes(lm, prepared)
    return prepared


def _on_mesh(lm: LanguageModel, p: Prepared) -> Prepared:
    """The prepared batch placed on the model's mesh: rows over its batch axis, shared arrays (the proposer's
    weights, a static automaton) replicated. ValueError when the batch axis does not divide the rows."""
    sharding.check_batch(lm.mesh, lm.rules, p.batch_size)
    fields = ("prompts", "prompt_lens", "sampling", "limits", "proposer_params", "verify_cost", "logprob_rows",
              "constraint")
    return dataclasses.replace(p, **{name: sharding.put_rows(getattr(p, name), lm.mesh, lm.rules, p.batch_size)
                                     for name in fields})


def prepare(
    lm: LanguageModel,
    prompts,
    *,
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    spec: SpecConfig | None = None,
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
    ignore_eos: bool = False,
    max_cache_len: int | None = None,
    prompt_lengths=None,
    rng=None,
    logprobs: int | None = None,
    attention_impl: str | None = None,
    prediction=None,
    constraint=None,
) -> Prepared:
    """Everything `jaxspec.prefill` and `jaxspec.decode` need, from the plain inputs `generate` takes.

    The arguments mean what they mean for `generate` (which calls this), and are checked the same way
    (ValueError naming the value); `max_new_tokens` must be at least 1. A custom proposer's `propose` is traced
    once on these inputs (nothing runs) and a Draft of the wrong shape raises a ValueError naming the field.
    Returns a `Prepared`: padded prompts, per-row sampling, limits, the proposer and its params, the static
    sizes; its docstring shows the loop `generate` runs with it.
    """
    if is_integer(max_new_tokens) and max_new_tokens == 0:
        raise ValueError("max_new_tokens=0 must be >= 1 for prepare: prefill always samples one token")
    req = _request(lm, prompts, prompt_lengths=prompt_lengths, max_new_tokens=max_new_tokens, sampling=sampling,
                   stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, max_cache_len=max_cache_len,
                   attention_impl=attention_impl, spec=spec, logprobs=logprobs, rng=rng, prediction=prediction,
                   constraint=constraint)
    return _prepare(lm, req)


def _empty_result(req: _Request) -> GenerateResult:
    """What max_new_tokens=0 returns: no tokens, no steps."""
    batch = len(req.ids)
    empty = GenerateStats(prompt_tokens=sum(len(p) for p in req.ids), generated_tokens=0, steps=0, prefill_s=0.0,
                          decode_s=0.0)
    return GenerateResult([[] for _ in req.ids], ["" for _ in req.ids], ["length"] * batch, empty,
                          None if req.logprobs is None else [[] for _ in req.ids],
                          token_array=np.full((batch, 0), -1, np.int32), num_tokens=np.zeros((batch,), np.int32))


def generate(
    lm: LanguageModel,
    prompts,
    *,
    max_new_tokens: int = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
    ignore_eos: bool = False,
    max_cache_len: int | None = None,
    attention_impl: str | None = None,
    spec: SpecConfig | None = None,
    logprobs: int | None = None,
    prompt_lengths=None,
    rng=None,
    prediction=None,
    constraint=None,
    stop=None,
    policy: DraftPolicy | None = None,
) -> GenerateResult:
    """Generate for a batch of prompts (strings, token-id lists or 1-D integer arrays, of different lengths;
    or one integer array i32[B, P] whose row i holds `prompt_lengths[i]` tokens, all P by default).

    `sampling` is one SamplingParams for every row or one per prompt (greedy and sampled rows may share a
    batch). `rng` (an integer, a `jax.random.key` or a `jax.random.PRNGKey`) seeds every row whose seed is 0,
    SamplingParams' default: row i gets `jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32)`
    (`rng_seeds`), so a call reproduces with the same rng and batch order; rows with a seed of their own keep
    it. Rows stop at EOS (unless `ignore_eos`), at any of `stop_token_ids` (one list for all rows or one
    per prompt), or after `max_new_tokens`. The cache holds at most `max_cache_len` tokens per row (default and
    upper bound: the model's context length). `attention_impl` is "xla" or "pallas" (the verification kernel, run in
    interpret mode on CPU); by default "pallas" on a GPU and "xla" elsewhere. `spec` chooses speculative
    decoding (a proposer and its draft budget); the default, method "none", decodes plainly through the same
    loop. Greedy output is the same with or without speculation; sampled output follows the same distribution.
    `logprobs=L` also returns each generated token's log-probability under the target (its raw distribution,
    before the sampling settings shape it) and the L most likely tokens at each position; None records nothing.
    `prediction` (predicted outputs, a speculative edit): a text or token ids the output is expected to mostly
    repeat, one for every row or one per row (None: none), such as the file an edit request rewrites. The row
    drafts up to `spec.prediction_tokens` tokens a step from it after a cursor that follows the output and
    re-synchronises after an edit (`jaxspec.proposers.prediction`); elsewhere it drafts with `spec`'s method
    (none, ngram, sam). Output is the same with or without a prediction; each row's stats report
    accepted_prediction_tokens and rejected_prediction_tokens.
    `constraint` (structured output): a `jaxspec.Regex`, `JsonSchema` or `Choice` for every row, or one (or None)
    per row. The row's output is drawn from the masked distribution at every position, speculative or not, and
    ends (at a stop id) only where the constraint is complete; tokens the constraint forces are drafted for free
    (up to `spec.forced_tokens` a step, beside methods none, ngram and sam). Constraints compile once per spec
    and tokenizer (`jaxspec.constraints`).
    `stop` (text): a string or list of strings for every row, or one list (or None) per row. A row ends at the
    first occurrence of any of them, also when one spans tokens or an accepted block: its tokens end with the one
    completing the stop string, its text ends before it, and its finish reason is "stop". (The loop finds them
    on the host after decoding; a row may decode past its stop string within the token budget.)
    `policy` (a `jaxspec.policy.DraftPolicy`, the one the serving engine and rollouts use) caps every row's
    drafts for the call's batch size and is told what the call achieved, so a policy kept across calls learns
    (its load rule, and its guard that turns speculation off where it measured slower than plain). None: every
    step may draft the proposer's full K.

    Returns a GenerateResult: per row the new tokens as lists (`token_ids`) and as one array
    (`token_array` i32[B, max_new_tokens], -1 padded, with `num_tokens` i32[B]), text, finish reasons, stats.
    The loop it runs is the one `prepare`, `prefill` and `decode` expose.
    """
    req = _request(lm, prompts, prompt_lengths=prompt_lengths, max_new_tokens=max_new_tokens, sampling=sampling,
                   stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, max_cache_len=max_cache_len,
                   attention_impl=attention_impl, spec=spec, logprobs=logprobs, rng=rng, prediction=prediction,
                   constraint=constraint, stop=stop, policy=policy)
    if req.max_new_tokens == 0:
        return _empty_result(req)
    # A background cost measurement waits from the moment `_prepare` asks for a table until the call returns.
    with cost.generating():
        return _generate(lm, req, _prepare(lm, req))


def _generate(lm: LanguageModel, req: _Request, p: Prepared) -> GenerateResult:
    """`generate`'s prefill and decode loop over a prepared request, and its result."""
    t0 = time.perf_counter()
    with sharding.use_rules(lm.mesh, lm.rules):
        state = prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params, p.processors,
                        spec=p.prefill_spec)
        if p.predictions is not None:
            state = predicted_outputs.install(state, p.predictions)
        jax.block_until_ready(state.history)
        t1, compiled = time.perf_counter(), cost.compile_seconds()
        state = decode(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step,
                       verify_cost=p.verify_cost)
        history, history_len, steps, counters, buffer, pstate = jax.device_get(
            (state.history, state.history_len, state.steps, state.counters, state.logprobs, state.pstate))
    t2 = time.perf_counter()
    if req.policy is not None:
        _report(req, p, steps, counters, seconds=t2 - t1 - (cost.compile_seconds() - compiled))
    return _result(lm, req, history, history_len, steps, counters, buffer, prefill_s=t1 - t0, decode_s=t2 - t1,
                   prediction_counts=predicted_outputs.counts(pstate) if req.predictions is not None else None)


def _report(req: _Request, p: Prepared, steps, counters, *, seconds: float) -> None:
    """Tell the call's policy what its decode loop achieved, as one chunk over the whole batch."""
    row_steps = int(counters.steps.sum())
    k = p.proposer.num_speculative_tokens
    cap = k if p.limits.draft_cap is None else int(jax.device_get(p.limits.draft_cap)[0])
    req.policy.observe(ChunkReport(num_slots=p.batch_size, active=p.batch_size, max_cap=cap,
                                   tokens=row_steps + int(counters.accepted.sum()), seconds=seconds, steps=int(steps),
                                   accepted_at=np.asarray(counters.accepted_at, np.float64).sum(axis=0)[:k],
                                   row_steps=row_steps))


def check_stop_strings(lm: LanguageModel, stop, batch: int) -> tuple[tuple[str, ...], ...] | None:
    """`generate`'s `stop=`: None, a string or a list of strings for every row, or one list (or None) per row.
    ValueError naming the bad entry."""
    if stop is None:
        return None
    if isinstance(stop, str) or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        rows = [[stop] if isinstance(stop, str) else list(stop)] * batch
    elif isinstance(stop, (list, tuple)) and len(stop) == batch:
        rows = [[] if s is None else [s] if isinstance(s, str) else s for s in stop]
    else:
        raise ValueError(f"stop={short_repr(stop)} must be a string, a list of strings, or one of those (or None) "
                         f"per prompt: {batch} entries")
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or any(not isinstance(s, str) or not s for s in row):
            raise ValueError(f"stop[{i}]={short_repr(row)} must hold non-empty strings")
    if any(rows) and lm.tokenizer is None:
        raise ValueError("stop= strings need the model's tokenizer (the model has none; use stop_token_ids)")
    return tuple(tuple(r) for r in rows) if any(rows) else None


def cut_at_stop_string(lm: LanguageModel, tokens: list[int], stops: Sequence[str]) -> tuple[list[int], str] | None:
    """(the tokens up to and including the one completing the first stop string, the text before the stop
    string), or None when no stop string occurs. A stop string may span tokens and end mid-token."""
    stream = TextStream(lm.tokenizer, stops)
    stream.add(tokens)
    stream.finish()
    return (tokens[: stream.num_tokens], stream.text) if stream.stopped else None


def _result(lm: LanguageModel, req: _Request, history, history_len, steps, counters, buffer, *, prefill_s: float,
            decode_s: float, prediction_counts: tuple[np.ndarray, np.ndarray] | None = None) -> GenerateResult:
    """The host-side result from the decoded state's arrays (already on the host)."""
    prompt_lens = np.asarray([len(p) for p in req.ids], np.int32)
    token_array, num_tokens = _new_tokens(history, history_len, prompt_lens, req.max_new_tokens)
    token_ids, texts, reasons, row_stats = [], [], [], []
    for i in range(len(req.ids)):
        row = token_array[i, : num_tokens[i]].tolist()
        stopped = bool(row) and row[-1] in req.stop_table[i]
        token_ids.append(row)
        reasons.append("stop" if stopped else "length")
        body = row[:-1] if stopped else row
        text = lm.tokenizer.decode(body, skip_special_tokens=True) if lm.tokenizer else ""
        cut = cut_at_stop_string(lm, body, req.stop[i]) if req.stop is not None and req.stop[i] else None
        if cut is not None:  # a stop string: the row ends with the token completing it, the text before it
            row, text = cut
            token_ids[i] = row
            reasons[i] = "stop"
            token_array[i, len(row):] = -1
            num_tokens[i] = len(row)
        texts.append(text)
        n = int(counters.steps[i])
        with_prediction = prediction_counts is not None and req.predictions.ids[i] is not None
        row_stats.append(RowStats(steps=n, drafted=int(counters.drafted[i]), accepted=int(counters.accepted[i]),
                                  generated=len(row), committed_per_step=tuple(counters.committed[i, :n].tolist()),
                                  decode_s=decode_s,
                                  accepted_prediction_tokens=int(prediction_counts[0][i]) if with_prediction else None,
                                  rejected_prediction_tokens=int(prediction_counts[1][i]) if with_prediction else None))
    stats = GenerateStats(
        prompt_tokens=int(prompt_lens.sum()), generated_tokens=sum(len(r) for r in token_ids), steps=int(steps),
        prefill_s=prefill_s, decode_s=decode_s, num_rows=len(req.ids), drafted=int(counters.drafted.sum()),
        accepted=int(counters.accepted.sum()), drafted_per_position=tuple(counters.drafted_at.sum(0).tolist()),
        accepted_per_position=tuple(counters.accepted_at.sum(0).tolist()), row_steps=int(counters.steps.sum()),
        rows=tuple(row_stats))
    row_logprobs = None
    if buffer is not None:
        row_logprobs = [to_host(row, *(x[i, prompt_lens[i]: prompt_lens[i] + len(row)] for x in
                                       (buffer.token, buffer.top_ids, buffer.top)), req.logprobs)
                        for i, row in enumerate(token_ids)]
    return GenerateResult(token_ids=token_ids, text=texts, finish_reason=reasons, stats=stats,
                          logprobs=row_logprobs, token_array=token_array, num_tokens=num_tokens)
