"""The training loop both heads share: AdamW on the head's nnx state, one jitted step, orbax checkpoints.

Resuming is exact: a checkpoint holds the head's parameters, the optimizer state and the step; the batch of
step s is a pure function of s (`Batches.batch`), and the step's random key is fold_in(key(seed), s). A run
resumed from step s therefore computes the same losses as one that was never interrupted.

A run may also start from a trained head (`init`) instead of a random one: a finished run continued with a new
learning-rate schedule, or a head fine-tuned on other data. Its parameters' digest joins what a resumed run
must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads import Readout, fill_params, flat_params
from jaxspec.sharding import DATA, replicate

from .batches import Batch, Batches
from .evaluate import accumulate


class HeadTask(Protocol):
    """What differs between the heads; everything else (optimizer, checkpoints, loop) is shared."""

    kind: str  # "eagle" or "medusa": the head file's kind
    method: str  # the SpecConfig method that runs the head
    context: int  # window positions before the loss region
    lookahead: int  # positions past a window its labels read

    def feature_layers(self, cfg: ModelConfig) -> tuple[int, ...]: ...  # decoder layers the data records

    def new_head(self, cfg: ModelConfig, seed: int) -> nnx.Module: ...

    def loss(self, head, readout: Readout, batch: Batch, key: jax.Array) -> tuple[jax.Array, dict]: ...

    def eval_counts(self, head, readout: Readout, batch: Batch) -> dict[str, jax.Array]: ...

    def eval_summary(self, counts: dict[str, np.ndarray]) -> dict: ...

    def settings(self) -> dict: ...  # the head's training settings (part of what a resumed run must match)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run: schedule, batch shape, optimizer, checkpoints."""

    steps: int = 300  # optimizer steps of the whole run (the cosine schedule spans them)
    batch_size: int = 4  # windows per step
    seq_len: int = 128  # positions per window
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 20  # linear warm-up from 0 to lr, then cosine decay to 0 at `steps`
    weight_decay: float = 0.0  # AdamW decay of weight matrices (not biases or norm scales)
    clip: float = 1.0  # global gradient-norm clip
    save_every: int = 50  # checkpoint every N steps (and always at the last step)
    keep: int = 2  # checkpoints kept
    seed: int = 0  # head initialisation, window order and noise
    include_prompt: bool = False  # also train on prompt positions

    def __post_init__(self):
        checks = {"steps": self.steps >= 1, "batch_size": self.batch_size >= 1, "seq_len": self.seq_len >= 2,
                  "lr": self.lr > 0, "warmup_steps": 0 <= self.warmup_steps < self.steps,
                  "weight_decay": self.weight_decay >= 0, "clip": self.clip > 0, "save_every": self.save_every >= 1,
                  "keep": self.keep >= 1}
        for name, ok in checks.items():
            if not ok:
                value = getattr(self, name)
                rule = f"in [0, steps={self.steps})" if name == "warmup_steps" else (
                    ">= 0" if name == "weight_decay" else "> 0" if isinstance(value, float) else ">= 1")
                raise ValueError(f"{name}={value!r} must be {rule}")

    def identity(self) -> dict:
        """The settings a resumed run must share with the checkpoint (how often and how many to keep may change)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("save_every", "keep")}


@flax.struct.dataclass
class TrainState:
    params: Any  # nnx.State of the head
    opt_state: Any
    step: jax.Array  # i32[]: optimizer steps done


def _decays(path, leaf) -> bool:
    """Weight decay applies to weight matrices only, not to biases or norm scales."""
    names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
    names = [n for n in names if n not in (None, "value")]
    return leaf.ndim >= 2 and names[-1] not in ("b", "bias", "fc_bias")


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=config.lr,
                                                  warmup_steps=config.warmup_steps, decay_steps=config.steps,
                                                  end_value=0.0)
    return optax.chain(
        optax.clip_by_global_norm(config.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                    mask=lambda params: jax.tree_util.tree_map_with_path(_decays, params)),
    )


def make_train_step(graphdef, task: HeadTask, tx: optax.GradientTransformation, seed: int, mesh: Mesh | None = None):
    """The jitted step (state, readout, batch) -> (state, metrics); the state's buffers are donated.

    With a `mesh`, the batch comes split over its "data" axis (`place_batch`) and the state and readout
    replicated (`replicate`): each device computes the loss and gradients of its rows, XLA adds the gradients
    over "data" (an all-reduce), and every device applies the same update, so the state stays replicated.
    The step then takes exactly those shardings (a committed argument placed otherwise is an error, not a
    silent copy). Without a mesh it is the plain single-device jit.
    """

    def step(state: TrainState, readout: Readout, batch: Batch):
        key = jax.random.fold_in(jax.random.key(seed), state.step)

        def loss_fn(params):
            return task.loss(nnx.merge(graphdef, params), readout, batch, key)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), metrics

    if mesh is None:  # the single-device program, exactly as before meshes existed
        return jax.jit(step, donate_argnums=0)
    whole, rows = replicated(mesh), row_sharding(mesh)
    # Explicit shardings on both sides: the gradient of the (global mean) loss over rows split on "data" is a
    # sum of per-device partial gradients, which GSPMD turns into one all-reduce; pinning the new state to
    # `whole` makes every device apply that same update, so the donated state buffers are reused in place.
    return jax.jit(step, donate_argnums=0, in_shardings=(whole, whole, rows), out_shardings=(whole, whole))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of the mesh holds the whole array (head state, optimizer state, readout, metrics)."""
    return NamedSharding(mesh, P())


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Leading dimension (rows) over "data", the rest whole: a prefix spec, so it fits every `Batch` leaf
    (tokens [B, W], features [B, W, D], ...); replicated over any other mesh axis ("model")."""
    return NamedSharding(mesh, P(DATA))


def check_data_parallel(mesh: Mesh, batch_size: int) -> None:
    """ValueError naming the data axis, its size and the batch size when the axis does not divide the batch (or
    the mesh has no "data" axis). Reads only `mesh.shape`, so a `jax.sharding.AbstractMesh` works too."""
    if DATA not in mesh.shape:
        raise ValueError(f"mesh axes {dict(mesh.shape)} have no {DATA!r} axis to split batches over; build the mesh "
                         f"with jaxspec.sharding.make_mesh(data=N)")
    n = int(mesh.shape[DATA])
    if batch_size % n:
        raise ValueError(f"mesh axis {DATA!r} of size {n} does not divide batch_size={batch_size}: each device "
                         f"trains on batch_size / {n} windows; use a multiple of {n}")


def place_batch(batch: Batch, mesh: Mesh) -> Batch:
    """A host batch split by rows over the mesh's "data" axis: each device gets B / data rows of every leaf
    (B = batch_size), a copy of them on every device of its "model" row."""
    rows = row_sharding(mesh)
    return jax.tree.map(lambda x: jax.device_put(x, rows), batch)


class Checkpoints:
    """Orbax checkpoints of a TrainState plus JSON metadata (run settings, data position) under `directory`."""

    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        # Saves are synchronous: the state's buffers are donated to the next step, so an async writer could
        # read memory that step already reuses. A head's state is tens of MB: a save takes well under a second.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: dict):
        step = int(state.step)
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def close(self):
        self.manager.close()


@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the trained head and where the run stands."""

    head: nnx.Module  # the trained head
    graphdef: Any  # its nnx.GraphDef
    params: Any  # its nnx.State
    step: int  # optimizer steps done
    history: list[dict]  # per-step metrics of the steps this call ran
    resumed_from: int | None  # the checkpoint step this call started from


def _host(metrics: dict) -> dict:
    return {k: (float(v) if np.ndim(v) == 0 else np.asarray(v).round(5).tolist())
            for k, v in jax.device_get(metrics).items()}


def train(task: HeadTask, cfg: ModelConfig, readout: Readout, batches: Batches, config: TrainConfig,
          out_dir: str | Path, *, run_identity: dict | None = None, restart: bool = False,
          stop_after: int | None = None, progress: bool = True, mesh: Mesh | None = None,
          init: nnx.Module | None = None) -> TrainResult:
    """Train `task`'s head to `config.steps`, resuming from the latest checkpoint in `out_dir`/checkpoints.

    With a `mesh` (`jaxspec.sharding.make_mesh(data=N)`), training is data parallel over its "data" axis: each
    step's windows are split over the devices and the gradients added over them (`make_train_step`); losses and
    parameters equal single-device training up to float summation order, and checkpoints are interchangeable
    between runs with and without a mesh. ValueError when the data axis does not divide the batch size.

    `run_identity` (model, data) joins the config and the task's settings in what a checkpoint must match to
    be resumed; a mismatch is a ValueError naming the differences. `restart` deletes the checkpoints first.
    `stop_after` ends the call after that many total steps without saving (an interruption, for tests).
    `init` (a head of the task's kind and shapes, e.g. from `load_head`) replaces the random initialisation;
    ValueError naming the parameters that differ when it does not fit. Its digest joins the run's identity, so a
    checkpoint of a run from another start is not resumed.
    Steps are logged to `out_dir`/train_log.jsonl.
    """
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints"
    if restart and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    if mesh is not None:
        check_data_parallel(mesh, config.batch_size)
    identity = {"config": config.identity(), "task": task.settings(), **(run_identity or {})}
    graphdef, params = nnx.split(task.new_head(cfg, config.seed))
    if init is not None:
        fill_params(params, flat_params(nnx.split(init)[1]), source="init head", needed="this task's head")
        identity["init"] = params_digest(params)
    tx = make_optimizer(config)
    state = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))
    if mesh is not None:  # before a restore: orbax restores into the shardings of the state it is given
        state, readout = replicate((state, readout), mesh)
    checkpoints = Checkpoints(ckpt_dir, config.keep)
    resumed_from = checkpoints.latest_step()
    if resumed_from is not None:
        state, meta = checkpoints.restore(resumed_from, state)
        if meta["identity"] != json.loads(json.dumps(identity)):
            differ = _differences(meta["identity"], identity)
            checkpoints.close()
            raise ValueError(f"checkpoint {resumed_from} in {str(ckpt_dir)!r} belongs to a run with other settings "
                             f"({differ}, as (checkpoint, now)); use the same settings, or --restart to start over")
    step_fn = make_train_step(graphdef, task, tx, config.seed, mesh)
    start = int(state.step)
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    history: list[dict] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "train_log.jsonl"
    _truncate_log(log_path, start)

    def meta_for(s: int) -> dict:
        epoch, i = divmod(s, batches.steps_per_epoch)
        return {"identity": identity, "step": s, "epoch": epoch, "batch_in_epoch": i}

    bar = tqdm(total=end, initial=start, desc=f"train {task.kind}", unit="step", disable=not progress)
    try:
        with open(log_path, "a") as log:
            for s in range(start, end):
                t0 = time.perf_counter()
                batch = batches.batch(s)
                state, metrics = step_fn(state, readout, batch if mesh is None else place_batch(batch, mesh))
                m = _host(metrics)  # waits for the step: the bar shows finished work
                seconds = time.perf_counter() - t0
                m.update(step=s + 1, seconds=round(seconds, 4))
                history.append(m)
                log.write(json.dumps(m) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m['accuracy']:.3f}",
                                tok_s=f"{m['tokens'] / seconds:.0f}")
                if (s + 1) % config.save_every == 0 or s + 1 == config.steps:
                    checkpoints.save(state, meta_for(s + 1))
    except KeyboardInterrupt:
        try:  # keep the finished steps (the state may already be donated to an unfinished step)
            checkpoints.save(state, meta_for(int(state.step)))
            print(f"\ninterrupted: saved step {int(state.step)} in {ckpt_dir}")
        except RuntimeError:
            print(f"\ninterrupted: the last checkpoint in {ckpt_dir} is where training resumes")
        raise
    finally:
        bar.close()
        checkpoints.close()
    return TrainResult(head=nnx.merge(graphdef, state.params), graphdef=graphdef, params=state.params,
                       step=int(state.step), history=history, resumed_from=resumed_from)


def params_digest(params) -> str:
    """A short SHA-256 of a head's parameters (names, shapes, values): what a run started from."""
    h = hashlib.sha256()
    for name, value in sorted(flat_params(params).items()):
        h.update(f"{name}:{value.dtype}:{value.shape};".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:16]


def _truncate_log(path: Path, step: int):
    """Keep the log lines of steps up to `step` (a resumed run recomputes the ones after it)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in lines))


def load_checkpointed_head(task: HeadTask, cfg: ModelConfig, config: TrainConfig, out_dir: str | Path):
    """(head, step, checkpoint metadata) from the latest checkpoint in `out_dir`/checkpoints, or None."""
    ckpt_dir = Path(out_dir) / "checkpoints"
    if not ckpt_dir.exists():
        return None
    checkpoints = Checkpoints(ckpt_dir, config.keep)
    try:
        step = checkpoints.latest_step()
        if step is None:
            return None
        graphdef, params = nnx.split(task.new_head(cfg, config.seed))
        tx = make_optimizer(config)
        like = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))
        state, meta = checkpoints.restore(step, like)
        return nnx.merge(graphdef, state.params), step, meta
    finally:
        checkpoints.close()


def evaluate_head(task: HeadTask, head, readout: Readout, batches: Batches) -> dict:
    """The task's held-out summary over every window of `batches` (one jitted program for all batches)."""
    graphdef, params = nnx.split(head)
    count = jax.jit(lambda p, r, b: task.eval_counts(nnx.merge(graphdef, p), r, b))
    return task.eval_summary(accumulate(lambda b: count(params, readout, b), batches.in_order()))


def _differences(found: dict, now: dict, prefix: str = "") -> dict:
    now = json.loads(json.dumps(now))
    out = {}
    for k in sorted(set(found) | set(now)):
        a, b = found.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_differences(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = (a, b)
    return out
