"""Several processes (one per host, or several on one host): `jax.distributed`, data-parallel generation and rollouts.

`initialize()` joins this process to a group through `jax.distributed.initialize`, reading the coordinator's
address, the group size and this process's index from arguments or from the environment `scripts/launch.py`
sets (JAXSPEC_COORDINATOR, JAXSPEC_NUM_PROCESSES, JAXSPEC_PROCESS_ID). On CPU it selects gloo for the
collectives between processes.

`generate_data_parallel(lm, prompts)` is batch generation over the group: every process passes its own prompts,
runs its own jitted decode loop on its own devices, and the processes then exchange their results with
collectives (`multihost_utils.process_allgather`), so each one returns every prompt's output in process order.
Data parallelism needs no collective inside the loop: each process's `lax.while_loop` ends when its own rows
end, and a slow process never holds the others' steps back. Within a process, the model may itself span
devices (`load_model(mesh=...)`, `jaxspec.sharding`). `rollout_data_parallel` does the same for an RL rollout
(`jaxspec.rollout`): a prompt's samples stay on one process, so group speculation needs nothing across them.

Seeds are global: row j of process p samples with the seed row `offset_p + j` of one call over every process's
prompts concatenated would get from `rng` (`jaxspec.generation.rng_seeds`), so a data-parallel run reproduces
the single-process run with the same `rng`, whatever the split.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import numpy as np

from .generation import GenerateResult, generate, normalise_prompts, rng_seeds
from .models.loading import LanguageModel
from .rollouts import RolloutResult, rollout
from .sampling_params import SamplingParams

ENV_COORDINATOR = "JAXSPEC_COORDINATOR"  # host:port of process 0's coordinator service
ENV_NUM_PROCESSES = "JAXSPEC_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSPEC_PROCESS_ID"
FINISH_REASONS = ("stop", "length")  # the codes finish reasons travel as


def _from_env(value, name: str, cast):
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return cast(raw)
    except ValueError as e:
        raise ValueError(f"${name}={raw!r} is not a valid {cast.__name__}") from e


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, shutdown_timeout_seconds: int = 300) -> None:
    """Join this process to a group of `num_processes` through the coordinator at `coordinator_address`
    ("host:port", served by process 0) as process `process_id`; arguments left out come from the environment
    (`scripts/launch.py` sets it). ValueError naming a missing or bad value; a second call is a no-op when it
    names the same group.

    At exit every process waits for the others up to `shutdown_timeout_seconds`, then the group fails: raise it
    when one process goes on working alone after the collective part (process 0 checking results, say)."""
    coordinator_address = _from_env(coordinator_address, ENV_COORDINATOR, str)
    num_processes = _from_env(num_processes, ENV_NUM_PROCESSES, int)
    process_id = _from_env(process_id, ENV_PROCESS_ID, int)
    if not coordinator_address or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address={coordinator_address!r} must be 'host:port' (or set ${ENV_COORDINATOR})")
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be an integer >= 1 (or set ${ENV_NUM_PROCESSES})")
    if not isinstance(process_id, int) or isinstance(process_id, bool) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id!r} must be an integer in [0, {num_processes}) "
                         f"(or set ${ENV_PROCESS_ID})")
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
            raise ValueError(f"this process already joined a group as process {jax.process_index()} of "
                             f"{jax.process_count()}; it cannot join as {process_id} of {num_processes}")
        return
    # CPU devices of different processes exchange data through gloo; without it a cross-process collective fails.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, shutdown_timeout_seconds=shutdown_timeout_seconds)


@dataclasses.dataclass(frozen=True)
class GatheredResult:
    """Every process's prompts' outputs, in process order (process 0's prompts first), on every process."""

    token_ids: list[list[int]]  # the new tokens of each prompt, as `GenerateResult.token_ids`
    text: list[str]  # their text, as `GenerateResult.text`
    finish_reason: list[str]  # "stop" or "length"
    process_index: list[int]  # the process that generated each prompt
    num_processes: int
    local: GenerateResult  # this process's own result, with its stats


def _allgather(x: np.ndarray) -> np.ndarray:
    """[num_processes, *x.shape]: every process's x (the same shape and dtype on every process)."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x))


def _global_seeds(sampling, rng, offset: int, rows: int, total: int) -> list[SamplingParams] | SamplingParams:
    """Per-row SamplingParams whose seed-0 rows take the seeds of rows offset.. of a `total`-row call with `rng`."""
    if rng is None:
        return sampling
    per_row = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * rows
    if len(per_row) != rows:
        raise ValueError(f"sampling has {len(per_row)} entries for {rows} prompts")
    seeds = rng_seeds(rng, total)[offset: offset + rows]
    return [s if not isinstance(s, SamplingParams) or s.seed != 0 else s.replace(seed=int(seed))
            for s, seed in zip(per_row, seeds)]


def generate_data_parallel(lm: LanguageModel, prompts, *, rng=None,
                           sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                           **generate_kwargs) -> GatheredResult:
    """`jaxspec.generate` over this process's own `prompts` (at least one), then every process's outputs
    gathered onto every process. Every process must call it, with the same `max_new_tokens` and settings;
    the prompts (and their number) may differ. `rng` seeds rows globally (see the module docstring); other
    keyword arguments are `generate`'s. ValueError when the processes disagree on `max_new_tokens`."""
    ids = normalise_prompts(lm, prompts, generate_kwargs.pop("prompt_lengths", None))
    counts = _allgather(np.asarray([len(ids), generate_kwargs.get("max_new_tokens", 128)], np.int64))  # [P, 2]
    if len(set(counts[:, 1].tolist())) != 1:
        raise ValueError(f"max_new_tokens differs between processes ({counts[:, 1].tolist()}); every process must "
                         "pass the same")
    me = jax.process_index()
    offset, total = int(counts[:me, 0].sum()), int(counts[:, 0].sum())
    local = generate(lm, ids, sampling=_global_seeds(sampling, rng, offset, len(ids), total), **generate_kwargs)

    rows = _gather_rows(local.token_ids, local.text, local.finish_reason, counts[:, 0])
    return GatheredResult(token_ids=rows["tokens"], text=rows["text"], finish_reason=rows["reason"],
                          process_index=rows["process"], num_processes=jax.process_count(), local=local)


def _padded(rows: Sequence[Sequence], most: int, dtype, fill) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows as one [most, width] array (width agreed across processes) and their lengths i32[most]."""
    width = int(_allgather(np.asarray([max(map(len, rows), default=0)], np.int64)).max())
    out = np.full((most, max(width, 1)), fill, dtype)
    lengths = np.zeros((most,), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
        lengths[i] = len(row)
    return out, lengths


def _gather_rows(tokens: Sequence[Sequence[int]], texts: Sequence[str], reasons: Sequence[str],
                 row_counts: np.ndarray, logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, list]:
    """Every process's rows (tokens, text, finish reason, optionally log-probabilities) in process order, each
    process's padded to the largest process's row count; texts travel as UTF-8 bytes."""
    most = int(row_counts.max())
    fields = {"tokens": _padded(tokens, most, np.int32, -1),
              "text": _padded([np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts], most, np.uint8, 0),
              "reason": _padded([[FINISH_REASONS.index(r)] for r in reasons], most, np.int32, 0)}
    if logprobs is not None:
        fields["logprobs"] = _padded(logprobs, most, np.float32, 0.0)
    gathered = {name: (_allgather(values), _allgather(lengths)) for name, (values, lengths) in fields.items()}
    decode = {"tokens": lambda row: row.tolist(), "text": lambda row: bytes(row).decode("utf-8"),
              "reason": lambda row: FINISH_REASONS[int(row[0])], "logprobs": lambda row: row.tolist()}
    out: dict[str, list] = {name: [] for name in gathered}
    out["process"] = []
    for p, n in enumerate(row_counts.tolist()):
        for i in range(n):
            for name, (values, lengths) in gathered.items():
                out[name].append(decode[name](values[p, i, : lengths[p, i]]))
            out["process"].append(p)
    return out


@dataclasses.dataclass(frozen=True)
class GatheredRollout:
    """Every process's rollout samples, prompts in process order: `[p][g]` is sample g of global prompt p."""

    token_ids: list[list[list[int]]]
    text: list[list[str]]
    finish_reason: list[list[str]]
    logprobs: list[list[list[float]]] | None  # None when the rollout recorded none
    process_index: list[int]  # per prompt, the process that sampled it
    num_processes: int
    local: RolloutResult  # this process's own rollout, with its stats and timeline


def rollout_data_parallel(lm: LanguageModel, prompts, *, num_samples: int, seed: int = 0,
                          **rollout_kwargs) -> GatheredRollout:
    """`jaxspec.rollout` over this process's own `prompts`, then every process's samples gathered onto every
    process (an RL rollout over a group of processes, each feeding its own prompts). Sample g of global prompt
    p (prompts in process order) is seeded by (`seed`, p, g), as in one rollout over all prompts, so the split
    does not change a sample. Every process must pass the same `num_samples`, `max_new_tokens` and `logprobs`."""
    ids = normalise_prompts(lm, prompts)
    settings = [len(ids), num_samples, rollout_kwargs.get("max_new_tokens", 0), int(rollout_kwargs.get("logprobs", 1))]
    counts = _allgather(np.asarray(settings, np.int64))  # [P, 4]
    for column, name in ((1, "num_samples"), (2, "max_new_tokens"), (3, "logprobs")):
        if len(set(counts[:, column].tolist())) != 1:
            raise ValueError(f"{name} differs between processes ({counts[:, column].tolist()}); every process must "
                             "pass the same")
    me = jax.process_index()
    local = rollout(lm, ids, num_samples=num_samples, seed=seed, prompt_offset=int(counts[:me, 0].sum()),
                    **rollout_kwargs)

    def flat(x):
        return [sample for group in x for sample in group]

    rows = _gather_rows(flat(local.token_ids), flat(local.text), flat(local.finish_reason),
                        counts[:, 0] * num_samples, None if local.logprobs is None else flat(local.logprobs))

    def grouped(values: list) -> list[list]:
        return [values[i: i + num_samples] for i in range(0, len(values), num_samples)]

    return GatheredRollout(token_ids=grouped(rows["tokens"]), text=grouped(rows["text"]),
                           finish_reason=grouped(rows["reason"]),
                           logprobs=grouped(rows["logprobs"]) if "logprobs" in rows else None,
                           process_index=rows["process"][::num_samples], num_processes=jax.process_count(),
                           local=local)
