"""`jaxspec.generate`: the host-side boundary of generation.

It validates input (clear `ValueError`s naming the bad value), tokenises, pads to bucketed shapes so that
similar requests reuse one compiled program, runs the device-side prefill and decode loop, and turns the
result back into token lists, text and timing.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import HEAD_METHODS, SamplingParams, SpecConfig
from .decode import NoProposer, RowLimits, decode, prefill
from .logprobs import TokenLogprob, to_host
from .models.heads import Readout, load_head, named_head_path
from .models.loading import LanguageModel
from .proposers.base import Proposer
from .proposers.draft_model import DraftModelProposer, self_draft_model
from .proposers.eagle import EagleProposer
from .proposers.medusa import MedusaProposer
from .proposers.ngram import NgramProposer
from .proposers.sam import SamProposer
from .proposers.suffix_automaton import StaticSuffixAutomaton
from .tree import TreeTopology

_BUCKET_MIN = 16
_CACHE_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class RowStats:
    """One row's decode-loop counts and timing, inside `GenerateStats.rows`."""

    steps: int  # loop steps in which the row was active (each one target forward)
    drafted: int  # draft tokens scored by the target
    accepted: int  # accepted drafts that were emitted
    generated: int  # new tokens, the first (from prefill) included
    committed_per_step: tuple[int, ...]  # tokens committed at each of the row's steps, in order
    decode_s: float = 0.0  # seconds of the decode loop (the whole batch's)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per step: accepted drafts plus the target's own token."""
        return sum(self.committed_per_step) / self.steps if self.steps else float("nan")

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
        """Tokens committed per active row-step (accepted drafts + the target's token); 1.0 for plain decoding."""
        committed = sum(sum(r.committed_per_step) for r in self.rows)
        return committed / self.row_steps if self.row_steps else float("nan")

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


def default_attention_impl() -> str:
    """The Pallas kernel where a GPU runs it natively; XLA's attention on CPU (Pallas only interprets there)."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def _next_pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_token_list(x) -> bool:
    """A list, tuple or 1-D integer array of token ids (possibly empty): one prompt, not a batch."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and x.dtype.kind in "iu"
    return isinstance(x, (list, tuple)) and all(_is_int(t) for t in x)


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


def normalise_prompts(lm: LanguageModel, prompts) -> list[list[int]]:
    """Token-id lists from one prompt or a list (strings encoded with the model's tokenizer, ids checked)."""
    if isinstance(prompts, str) or (_is_token_list(prompts) and len(prompts) > 0):
        prompts = [prompts]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings or token-id lists")
    vocab = lm.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = _encode(lm, i, p)
        elif _is_token_list(p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i}={p!r} must be a string or a list of integer token ids")
        if not ids:
            raise ValueError(f"prompt {i} is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside [0, {vocab})")
        out.append(ids)
    return out


def _checked_stop_ids(ids, vocab: int, where: str) -> list[int]:
    """One list of stop ids, each an integer in [0, vocab), or ValueError naming `where`."""
    if not _is_token_list(ids):
        raise ValueError(f"{where}={ids!r} must be a list of integer token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where} has token id {bad[0]} outside [0, {vocab})")
    return [int(t) for t in ids]


def _stop_ids(lm: LanguageModel, num_rows: int, stop_token_ids, ignore_eos: bool) -> np.ndarray:
    """i32[B, M] each row's stop ids (EOS unless ignore_eos, then the user's), -1 padded."""
    vocab = lm.config.vocab_size
    eos = () if ignore_eos or lm.tokenizer is None else tuple(lm.tokenizer.eos_token_ids)
    per_prompt = (isinstance(stop_token_ids, (list, tuple)) and len(stop_token_ids) > 0
                  and all(isinstance(s, (list, tuple, np.ndarray)) for s in stop_token_ids))
    if per_prompt:
        if len(stop_token_ids) != num_rows:
            raise ValueError(f"stop_token_ids has {len(stop_token_ids)} lists for {num_rows} prompts")
        per_row = [list(eos) + _checked_stop_ids(s, vocab, f"stop_token_ids[{i}]")
                   for i, s in enumerate(stop_token_ids)]
    else:
        per_row = [list(eos) + _checked_stop_ids(stop_token_ids, vocab, "stop_token_ids")] * num_rows
    width = max(1, max(len(r) for r in per_row))
    table = np.full((num_rows, width), -1, np.int32)
    for i, r in enumerate(per_row):
        table[i, : len(r)] = r
    return table


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
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= lm.config.vocab_size):
        raise ValueError(f"logprobs={logprobs!r} must be None or an integer in [0, {lm.config.vocab_size}]")
    if not isinstance(ignore_eos, (bool, np.bool_)):
        raise ValueError(f"ignore_eos={ignore_eos!r} must be True or False")
    context = lm.config.max_position_embeddings
    if max_cache_len is not None and (not _is_int(max_cache_len) or not 1 <= max_cache_len <= context):
        raise ValueError(f"max_cache_len={max_cache_len!r} must be None or an integer in [1, {context}] "
                         f"(the context length of {lm.name!r})")


def bucket_shapes(prompt_lens: Sequence[int], max_new_tokens: int, k: int) -> tuple[int, int, int]:
    """(prompt width P, output buffer N, cache slots S) that a batch compiles for.

    A power of two for the prompt and output buffers, the cache aligned to 128 slots, so similar requests
    reuse one program; verification writes up to K draft slots past a row's last token.
    """
    width = _next_pow2(max(prompt_lens), _BUCKET_MIN)
    buffer_len = _next_pow2(max_new_tokens, _BUCKET_MIN)
    return width, buffer_len, _round_up(max(width, max(prompt_lens) + buffer_len + k + 1), _CACHE_ALIGN)


_HEADS: dict = {}  # (path, modification time, target config) -> (graphdef, params, metadata)


def trained_head(lm: LanguageModel, spec: SpecConfig):
    """(graphdef, params, metadata) of the head `spec` runs: its `head_path`, or the one shipped for `lm`."""
    kind = HEAD_METHODS[spec.method]
    path = Path(spec.head_path) if spec.head_path is not None else named_head_path(lm.name, kind)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    if not path.exists():
        raise ValueError(f"head_path={str(spec.head_path)!r}: no head file at {str(path)!r}")
    key = (str(path.resolve()), path.stat().st_mtime_ns, lm.config)
    if key not in _HEADS:
        head, meta = load_head(path, lm.config)
        _HEADS[key] = (*nnx.split(head), meta)
    meta = _HEADS[key][2]
    if meta.get("kind") != kind:
        raise ValueError(f"head_path={str(path)!r} holds a {meta.get('kind')!r} head; method="
                         f"{spec.method!r} needs a {kind!r} head")
    return _HEADS[key]


def medusa_topology(meta: dict, budget: int) -> TreeTopology:
    """The static tree for a Medusa head: best-first over its measured rank accuracies (`rank_probs`, stored
    by training), or the default prior when the file has none."""
    if meta.get("rank_probs"):
        return TreeTopology.best_first(meta["rank_probs"], budget)
    return TreeTopology.default(depth=int(meta["num_heads"]), top_k=4, budget=budget)


def _check_static_sam(lm: LanguageModel, static_sam) -> None:
    """A static automaton must hold only token ids the target can embed."""
    if not isinstance(static_sam, StaticSuffixAutomaton):
        raise ValueError(f"static_sam={static_sam!r} must be a jaxspec.StaticSuffixAutomaton")
    vocab = lm.config.vocab_size
    low, high = static_sam.min_token_id(), static_sam.max_token_id()
    if low < 0 or high >= vocab:
        raise ValueError(f"static_sam holds token id {low if low < 0 else high} outside [0, {vocab}): its corpus "
                         f"must come from the vocabulary of {lm.name!r}")


def build_proposer(lm: LanguageModel, spec: SpecConfig, *, prompt_width: int, buffer_len: int,
                   cache_len: int) -> tuple[Proposer, object]:
    """The proposer (static settings) and its params (a pytree passed to the device) for `spec`."""
    k = spec.num_speculative_tokens
    if spec.method == "none":
        return NoProposer(), None
    if spec.method == "custom":
        return spec.proposer, spec.proposer_params
    if spec.method == "ngram":
        return NgramProposer(k, ngram_max=spec.ngram_max, min_match=spec.min_match,
                             draft_per_match=spec.draft_per_match), None
    if spec.method == "sam":
        if spec.sam_source != "dynamic":
            _check_static_sam(lm, spec.static_sam)
        return SamProposer(k, max_text_len=prompt_width + buffer_len, source=spec.sam_source,
                           min_match=spec.min_match, draft_per_match=spec.draft_per_match), spec.static_sam
    if spec.method in HEAD_METHODS:
        graphdef, head_params, meta = trained_head(lm, spec)
        params = {"head": head_params, "readout": Readout.of(lm.params)}
        if spec.method == "medusa":
            return MedusaProposer(k, graphdef, medusa_topology(meta, k)), params
        if spec.method == "eagle2":
            return EagleProposer(k, graphdef, cache_len=cache_len, mode="tree", depth=spec.tree_depth,
                                 top_k=spec.tree_top_k), params
        if spec.tree_depth is not None:
            return EagleProposer(k, graphdef, cache_len=cache_len, mode="static",
                                 topology=TreeTopology.default(spec.tree_depth, spec.tree_top_k, k)), params
        return EagleProposer(k, graphdef, cache_len=cache_len), params
    draft = spec.draft_model if spec.method == "draft_model" else self_draft_model(lm, spec.self_draft_layers)
    if draft.config.vocab_size != lm.config.vocab_size:
        raise ValueError(f"draft_model {draft.name!r} has vocab_size={draft.config.vocab_size}; the target "
                         f"{lm.name!r} has {lm.config.vocab_size}: they must share one vocabulary")
    return DraftModelProposer(k, draft.graphdef, cache_len=cache_len, prompt_width=prompt_width), draft.params


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
) -> GenerateResult:
    """Generate for a batch of prompts (strings or token-id lists, of different lengths).

    `sampling` is one SamplingParams for every row or one per prompt (greedy and sampled rows may share a
    batch). Rows stop at EOS (unless `ignore_eos`), at any of `stop_token_ids` (one list for all rows or one
    per prompt), or after `max_new_tokens`. The cache holds at most `max_cache_len` tokens per row (default and
    upper bound: the model's context length). `attention_impl` is "xla" or "pallas" (the verification kernel, run in
    interpret mode on CPU); by default "pallas" on a GPU and "xla" elsewhere. `spec` chooses speculative
    decoding (a proposer and its draft budget); the default, method "none", decodes plainly through the same
    loop. Greedy output is the same with or without speculation; sampled output follows the same distribution.
    `logprobs=L` also returns each generated token's log-probability under the target (its raw distribution,
    before the sampling settings shape it) and the L most likely tokens at each position; None records nothing.
    """
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
    ids = normalise_prompts(lm, prompts)
    batch = len(ids)
    limit = lm.config.max_position_embeddings if max_cache_len is None else max_cache_len
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{len(p) + max_new_tokens} cache slots but max_cache_len={limit}")
    stop_table = _stop_ids(lm, batch, stop_token_ids, ignore_eos)
    rows = _row_sampling(sampling, batch)
    prompt_lens = [len(p) for p in ids]
    if max_new_tokens == 0:
        empty = GenerateStats(prompt_tokens=sum(prompt_lens), generated_tokens=0, steps=0, prefill_s=0.0, decode_s=0.0)
        return GenerateResult([[] for _ in ids], ["" for _ in ids], ["length"] * batch, empty,
                              None if logprobs is None else [[] for _ in ids])

    width, buffer_len, cache_len = bucket_shapes(prompt_lens, max_new_tokens, spec.num_speculative_tokens)
    padded = np.zeros((batch, width), np.int32)
    for i, p in enumerate(ids):
        padded[i, : len(p)] = p
    limits = RowLimits(max_new_tokens=jnp.full((batch,), max_new_tokens, jnp.int32),
                       stop_ids=jnp.asarray(stop_table))

    proposer, proposer_params = build_proposer(lm, spec, prompt_width=width, buffer_len=buffer_len,
                                               cache_len=cache_len)
    widths = spec.verify_widths

    t0 = time.perf_counter()
    logprob_rows = None if logprobs is None else jnp.ones((batch,), bool)
    state = prefill(lm.graphdef, lm.params, jnp.asarray(padded), jnp.asarray(prompt_lens, jnp.int32), rows,
                    limits, proposer_params, logprob_rows, proposer=proposer, cache_len=cache_len,
                    buffer_len=buffer_len, num_top_logprobs=logprobs or 0)
    jax.block_until_ready(state.history)
    t1 = time.perf_counter()
    state = decode(lm.graphdef, lm.params, state, rows, limits, proposer_params, proposer=proposer, widths=widths,
                   attention_impl=attention_impl)
    history, history_len, steps, counters, buffer = jax.device_get(
        (state.history, state.history_len, state.steps, state.counters, state.logprobs))
    t2 = time.perf_counter()

    token_ids, texts, reasons, row_stats = [], [], [], []
    for i in range(batch):
        row = history[i, prompt_lens[i]: history_len[i]].tolist()
        stopped = bool(row) and row[-1] in stop_table[i]
        token_ids.append(row)
        reasons.append("stop" if stopped else "length")
        body = row[:-1] if stopped else row
        texts.append(lm.tokenizer.decode(body, skip_special_tokens=True) if lm.tokenizer else "")
        n = int(counters.steps[i])
        row_stats.append(RowStats(steps=n, drafted=int(counters.drafted[i]), accepted=int(counters.accepted[i]),
                                  generated=len(row), committed_per_step=tuple(counters.committed[i, :n].tolist()),
                                  decode_s=t2 - t1))
    stats = GenerateStats(
        prompt_tokens=sum(prompt_lens), generated_tokens=sum(len(r) for r in token_ids), steps=int(steps),
        prefill_s=t1 - t0, decode_s=t2 - t1, num_rows=batch, drafted=int(counters.drafted.sum()),
        accepted=int(counters.accepted.sum()), drafted_per_position=tuple(counters.drafted_at.sum(0).tolist()),
        accepted_per_position=tuple(counters.accepted_at.sum(0).tolist()), row_steps=int(counters.steps.sum()),
        rows=tuple(row_stats))
    row_logprobs = None
    if buffer is not None:
        row_logprobs = [to_host(row, *(x[i, prompt_lens[i]: history_len[i]] for x in
                                       (buffer.token, buffer.top_ids, buffer.top)), logprobs)
                        for i, row in enumerate(token_ids)]
    return GenerateResult(token_ids=token_ids, text=texts, finish_reason=reasons, stats=stats,
                          logprobs=row_logprobs)
