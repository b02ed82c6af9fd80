"""Several processes (one per host, or several on one host): `jax.distributed` and data-parallel generation.

`initialize()` joins this process to a group through `jax.distributed.initialize`, reading the coordinator's
address, the group size and this process's index from arguments or from the environment `scripts/launch.py`
sets (JAXSPEC_COORDINATOR, JAXSPEC_NUM_PROCESSES, JAXSPEC_PROCESS_ID). On CPU it selects gloo for the
collectives between processes.

`generate_data_parallel(lm, prompts)` is batch generation over the group: every process passes its own prompts,
runs its own jitted decode loop on its own devices, and the processes then exchange their results with
collectives (`multihost_utils.process_allgather`), so each one returns every prompt's output in process order.
Data parallelism needs no collective inside the loop: each process's `lax.while_loop` ends when its own rows
end, and a slow process never holds the others' steps back. Within a process, the model may itself span
devices (`load_model(mesh=...)`, `jaxspec.sharding`).

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

from .config import SamplingParams
from .generation import GenerateResult, generate, normalise_prompts, rng_seeds
from .models.loading import LanguageModel

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
               process_id: int | None = None) -> None:
    """Join this process to a group of `num_processes` through the coordinator at `coordinator_address`
    ("host:port", served by process 0) as process `process_id`; arguments left out come from the environment
    (`scripts/launch.py` sets it). ValueError naming a missing or bad value; a second call is a no-op when it
    names the same group."""
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
                               process_id=process_id)


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

    # Pad this process's rows to the largest process's count; texts travel as UTF-8 bytes.
    most = int(counts[:, 0].max())
    tokens = np.full((most, local.token_array.shape[1]), -1, np.int32)  # i32[most, N]
    tokens[: len(ids)] = local.token_array
    num = np.zeros((most,), np.int32)
    num[: len(ids)] = local.num_tokens
    reasons = np.zeros((most,), np.int32)
    reasons[: len(ids)] = [FINISH_REASONS.index(r) for r in local.finish_reason]
    encoded = [t.encode("utf-8") for t in local.text]
    width = int(_allgather(np.asarray([max(map(len, encoded), default=0)], np.int64)).max())
    text = np.zeros((most, max(width, 1)), np.uint8)  # u8[most, W]
    text_len = np.zeros((most,), np.int32)
    for i, e in enumerate(encoded):
        text[i, : len(e)] = np.frombuffer(e, np.uint8)
        text_len[i] = len(e)
    g_tokens, g_num, g_reasons, g_text, g_text_len = (_allgather(x) for x in (tokens, num, reasons, text, text_len))

    out_tokens, out_text, out_reasons, out_process = [], [], [], []
    for p, n in enumerate(counts[:, 0].tolist()):
        for i in range(n):
            out_tokens.append(g_tokens[p, i, : g_num[p, i]].tolist())
            out_text.append(bytes(g_text[p, i, : g_text_len[p, i]]).decode("utf-8"))
            out_reasons.append(FINISH_REASONS[int(g_reasons[p, i])])
            out_process.append(p)
    return GatheredResult(token_ids=out_tokens, text=out_text, finish_reason=out_reasons, process_index=out_process,
                          num_processes=jax.process_count(), local=local)
