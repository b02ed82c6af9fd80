"""SPMD placement: device meshes, logical-axis sharding rules, and where each array of a model, its KV cache and a
batch lives.

jaxspec scales out with JAX's own SPMD: arrays carry a `NamedSharding` over a `Mesh` and the jitted loop is
partitioned by XLA (GSPMD). A mesh has two axes by default, "data" (rows of the batch and of the KV cache) and
"model" (tensor parallelism: attention heads, the MLP's hidden units or a mixture's experts, the vocabulary).
`ShardingRules` maps the model's logical axes to mesh axes; a rule of None replicates that axis.

    mesh = jaxspec.sharding.make_mesh(data=2, model=4)
    lm = jaxspec.load_model(mesh=mesh, rules=ShardingRules(heads=None))  # SmolLM2's 3 KV heads: keep attention whole
    jaxspec.generate(lm, prompts)  # rows over "data", MLP and vocabulary over "model"

Tensor parallelism follows Megatron: the fused q/k/v and gate/up projections are split by output rows (each
device computes its own heads and hidden units), the output and down projections by input columns (their
partial sums are added over "model"), the embedding table by vocabulary rows and the LM head by vocabulary
columns. For the row splits to hold whole heads, the fused weights are stored interleaved per device under a
mesh (`jaxspec.models.llama.set_blocks`); a model without a mesh keeps the layout the CPU runs fastest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"  # the default mesh axes


def make_mesh(data: int | None = None, model: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "model") mesh of `data` x `model` devices (default devices: all of `jax.devices()`; default
    data: as many as the devices allow). ValueError when the sizes do not fit the devices."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(model, int) or model < 1:
        raise ValueError(f"model={model!r} must be an integer >= 1")
    if data is None:
        data = len(devices) // model
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"data={data!r} must be an integer >= 1 (there are {len(devices)} devices for model={model})")
    if data * model > len(devices):
        raise ValueError(f"a mesh of data={data} x model={model} needs {data * model} devices; there are "
                         f"{len(devices)}")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), (DATA, MODEL))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axis each logical axis of the model is split over (None: replicated).

    The defaults suit Llama-family models on a ("data", "model") mesh: rows of the batch and cache over "data";
    attention heads (query and KV heads alike), the MLP's hidden units and the vocabulary over "model".
    """

    batch: str | None = DATA  # rows of the batch, the KV cache and the decode state
    heads: str | None = MODEL  # attention heads: q/k/v rows, the output projection's columns, the cache's heads
    mlp: str | None = MODEL  # the MLP's hidden units: gate/up rows, down columns
    vocab: str | None = MODEL  # the embedding's rows, the LM head's columns (and the logits)
    experts: str | None = MODEL  # a mixture of experts' experts: each device holds whole experts (expert parallel)

    def axes(self) -> dict[str, str | None]:
        """{logical axis: mesh axis or None}."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def fitting(cls, cfg, mesh: Mesh) -> "ShardingRules":
        """The default rules, with attention kept whole where the model axis does not divide the query and KV
        heads (SmolLM2-135M's 3 KV heads on a model axis of 2, 4 or 8): what a command line offers for any mesh."""
        n = axis_size(mesh, MODEL)
        return cls() if cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0 else cls(heads=None)


def parse_mesh(text: str) -> tuple[int, int]:
    """(data, model) from a command line's "DATAxMODEL" (e.g. "2x4"); ValueError naming the text otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"mesh={text!r} must be DATAxMODEL with positive integers, e.g. 2x4")
    return int(parts[0]), int(parts[1])


def axis_size(mesh: Mesh | None, axis: str | None) -> int:
    """How many devices a mesh axis spans (1 for None or no mesh)."""
    if mesh is None or axis is None:
        return 1
    return int(mesh.shape[axis])


def check_rules(mesh: Mesh, rules: ShardingRules, cfg, name: str = "the model") -> None:
    """ValueError naming the mesh axis and its size when it does not divide what a rule splits over it."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see jaxspec.sharding.make_mesh)")
    if not isinstance(rules, ShardingRules):
        raise ValueError(f"rules={rules!r} must be a jaxspec.sharding.ShardingRules")
    for logical, axis in rules.axes().items():
        if axis is not None and axis not in mesh.shape:
            raise ValueError(f"rules.{logical}={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    sizes = {"heads": (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)),
             "vocab": (("vocab_size", cfg.vocab_size),)}
    # A mixture of experts splits whole experts, a dense MLP its hidden units.
    if getattr(cfg, "num_experts", 0):
        sizes["experts"] = (("num_experts", cfg.num_experts),)
    else:
        sizes["mlp"] = (("intermediate_size", cfg.intermediate_size),)
    for logical, fields in sizes.items():
        axis = getattr(rules, logical)
        n = axis_size(mesh, axis)
        for field, value in fields:
            if value % n:
                hint = (" (or rules=ShardingRules(heads=None) to keep attention whole on each device)"
                        if logical == "heads" else "")
                raise ValueError(f"mesh axis {axis!r} of size {n} does not divide {field}={value} of {name}: "
                                 f"rules.{logical} splits it over that axis; use a mesh whose {axis!r} axis divides "
                                 f"{value}{hint}")


def check_batch(mesh: Mesh | None, rules: ShardingRules | None, batch: int) -> None:
    """ValueError naming the data axis when it does not divide the batch."""
    if mesh is None or rules is None:
        return
    n = axis_size(mesh, rules.batch)
    if batch % n:
        raise ValueError(f"mesh axis {rules.batch!r} of size {n} does not divide the batch of {batch} rows; "
                         f"pass a multiple of {n} prompts")


def param_spec(path: tuple, ndim: int, rules: ShardingRules) -> P:
    """The PartitionSpec of a Llama parameter at `path` (its keys in the NNX state). A scanned layer stack's
    parameters carry a leading [L] axis, which stays whole on every device."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    leaf = names[-1] if names[-1] not in ("value", "raw_value") else names[-2]
    spec = {
        "embed": (rules.vocab, None),  # [V, D]
        "lm_head": (None, rules.vocab),  # [D, V]
        "qkv": (rules.heads, None),  # [(H + 2 Hkv) hd, D], interleaved per device (`set_blocks`)
        "qkv_bias": (rules.heads,),
        "o": (None, rules.heads),  # [D, H hd]
        "gate_up": (rules.mlp, None),  # [2F, D], interleaved per device
        "down": (None, rules.mlp),  # [D, F]
        "expert_gate_up": (rules.experts, None, None),  # [E, 2F, D]
        "expert_down": (rules.experts, None, None),  # [E, D, F]
    }.get(leaf, ())  # norms, the experts' router and anything else: replicated
    return P(*([None] * (ndim - len(spec))), *spec)


def param_shardings(params: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """A NamedSharding for every leaf of a Llama's parameter state (same tree structure)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, param_spec(path, x.ndim, rules)),
                                            params)


def batch_spec(rules: ShardingRules | None, ndim: int) -> P:
    """Rows over the batch axis, everything else replicated."""
    return P(None if rules is None else rules.batch, *([None] * (ndim - 1)))


def put_rows(tree: Any, mesh: Mesh, rules: ShardingRules, batch: int) -> Any:
    """Place a pytree of host or device arrays: leaves whose leading dimension is the batch go over the batch
    axis, the rest (shared tables, scalars) are replicated."""

    def put(x):
        if not hasattr(x, "shape") or isinstance(x, jax.core.Tracer):
            return x
        if x.ndim >= 1 and x.shape[0] == batch and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(x, NamedSharding(mesh, batch_spec(rules, x.ndim)))
        return jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(put, tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every array leaf of `tree` copied to every device of the mesh."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())) if hasattr(x, "shape") else x, tree)


# ------------------------------------------------------------------------------------------- inside jitted code
# The rules in effect while a jitted function is traced. `generate`, `rollout` and the engine trace their
# programs under `use_rules(lm)`; arrays created inside the program (the KV cache, the history) are then pinned
# with `constrain`, which is a no-op for a model without a mesh.
# Per thread: the serving engine traces on its own loop thread.
_ACTIVE = threading.local()


@contextlib.contextmanager
def use_rules(mesh: Mesh | None, rules: ShardingRules | None):
    """Run (and trace) under `mesh` and `rules`: jax's mesh context plus the logical rules `constrain` reads.
    Nothing happens for mesh=None."""
    if mesh is None:
        yield
        return
    stack = _ACTIVE.__dict__.setdefault("stack", [])
    stack.append((mesh, rules or ShardingRules()))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        stack.pop()


def active() -> tuple[Mesh, ShardingRules] | None:
    """The (mesh, rules) this thread traces under, or None."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin x's sharding to the mesh axes its logical axes map to (one name or None per dimension, "batch",
    "heads", "mlp", "vocab"); x itself outside `use_rules` or for a mesh of one device. A dimension its mesh
    axis does not divide (the serving engine prefills one request at a time) stays whole on every device."""
    current = active()
    if current is None or mesh_size(current[0]) == 1:
        return x
    mesh, rules = current
    axes = rules.axes()

    def axis(dim: int, name: str | None) -> str | None:
        mesh_axis = None if name is None else axes[name]
        return mesh_axis if x.shape[dim] % axis_size(mesh, mesh_axis) == 0 else None

    spec = P(*(axis(d, name) for d, name in enumerate(logical)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def mesh_size(mesh: Mesh) -> int:
    """The number of devices in the mesh."""
    return math.prod(mesh.shape.values())


def constrain_rows(tree: Any, batch: int) -> Any:
    """`tree` with every array whose leading dimension is the batch pinned to the batch axis (the rest of each
    such array replicated); unchanged outside `use_rules`."""
    if active() is None:
        return tree
    return jax.tree.map(lambda x: constrain(x, "batch", *([None] * (x.ndim - 1)))
                        if getattr(x, "ndim", 0) >= 1 and x.shape[0] == batch else x, tree)
