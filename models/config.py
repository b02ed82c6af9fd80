"""Static description of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

A `ModelConfig` is frozen and hashable: it is part of the compiled program (shapes, layer count, rope
constants), never a per-request value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Hugging Face `model_type`s this decoder implements, each with the `architectures` class its checkpoints name.
# Anything else (Gemma, mixtures of experts, ...) is refused by name rather than run as a Llama.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    # llama3: frequencies between these wavelengths are interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: ramp bounds in rotations (beta_fast, beta_slow) and the attention temperature.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # GGUF files of llama3-style models carry the per-frequency divisors as a tensor (rope_freqs.weight).
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not one of {ROPE_TYPES}")
        if self.theta <= 0:
            raise ValueError(f"rope theta={self.theta} must be positive")
        if self.factor <= 0:
            raise ValueError(f"rope factor={self.factor} must be positive")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head (head_dim features) before rotation
    # Mistral: a query at position p attends keys at positions p - sliding_window + 1 .. p only (every layer).
    sliding_window: int | None = None
    max_position_embeddings: int = 8192
    dtype: str = "float32"  # parameter and activation dtype; norms and softmax always run in float32

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be None or a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {tuple(_DTYPES)}")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, dtype: str = "float32", source: str = "config.json") -> "ModelConfig":
        """From a Hugging Face `config.json` dict of one of `HF_ARCHITECTURES` (a config without `model_type` is
        read as Llama's).

        Rotary settings come from `rope_parameters` (what transformers 5 writes) or `rope_theta` and
        `rope_scaling` (earlier releases). ValueError (`jaxspec.models.files.FileError`) naming `source` and the
        field: for another `model_type` or `architectures` (listing the supported ones), for what this decoder
        does not implement (another activation, MLP biases, windows on some layers only), and for a missing or
        mistyped field or a value the config refuses."""
        from .files import FileError, field, json_object

        cfg = json_object(cfg, source)
        model_type = _architecture(cfg, source)
        heads = field(cfg, "num_attention_heads", "int", source)
        hidden = field(cfg, "hidden_size", "int", source)
        if heads <= 0:
            raise FileError(f"{source}: field 'num_attention_heads'={heads} must be positive")
        head_dim = field(cfg, "head_dim", "int", source, hidden // heads)
        activation = field(cfg, "hidden_act", "str", source, "silu")
        if activation != "silu":
            raise FileError(f"{source}: field 'hidden_act'={activation!r}; this decoder's MLP is SwiGLU ('silu')")
        if field(cfg, "mlp_bias", "bool", source, False):
            raise FileError(f"{source}: field 'mlp_bias' is true; this decoder's MLP has no biases")
        if "rope_parameters" in cfg:  # transformers 5: theta and scaling in one dict
            where = f"{source} (rope_parameters)"
            scaling = field(cfg, "rope_parameters", "dict", source)
            theta = field(scaling, "rope_theta", "number", where, 10000.0)
        else:
            where = f"{source} (rope_scaling)"
            scaling = field(cfg, "rope_scaling", "dict", source, {})
            theta = field(cfg, "rope_theta", "number", source, 10000.0)
        rope_type = field(scaling, "rope_type", "str", where, field(scaling, "type", "str", where, "default"))
        num_layers = field(cfg, "num_hidden_layers", "int", source)
        try:
            rope = RopeConfig(
                theta=float(theta),
                rope_type=rope_type,
                factor=float(field(scaling, "factor", "number", where, 1.0)),
                low_freq_factor=float(field(scaling, "low_freq_factor", "number", where, 1.0)),
                high_freq_factor=float(field(scaling, "high_freq_factor", "number", where, 4.0)),
                original_max_position_embeddings=field(
                    scaling, "original_max_position_embeddings", "int", where,
                    field(cfg, "max_position_embeddings", "int", source, 8192)),
                beta_fast=float(field(scaling, "beta_fast", "number", where, 32.0)),
                beta_slow=float(field(scaling, "beta_slow", "number", where, 1.0)),
                attention_factor=field(scaling, "attention_factor", "number", where, None),
            )
            return cls(
                vocab_size=field(cfg, "vocab_size", "int", source),
                hidden_size=hidden,
                intermediate_size=field(cfg, "intermediate_size", "int", source),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=field(cfg, "num_key_value_heads", "int", source, heads),
                head_dim=head_dim,
                rms_norm_eps=float(field(cfg, "rms_norm_eps", "number", source, 1e-6)),
                rope=rope,
                tie_word_embeddings=field(cfg, "tie_word_embeddings", "bool", source, False),
                attention_bias=field(cfg, "attention_bias", "bool", source, model_type == "qwen2"),
                qk_norm=model_type == "qwen3",
                sliding_window=_sliding_window(cfg, model_type, num_layers, source),
                max_position_embeddings=field(cfg, "max_position_embeddings", "int", source, 8192),
                dtype=dtype,
            )
        except FileError:
            raise
        except ValueError as e:  # a value the config refuses (RopeConfig, ModelConfig.__post_init__)
            raise FileError(f"{source}: {e}") from None


def _architecture(cfg: dict[str, Any], source: str) -> str:
    """The config's `model_type`, checked against `HF_ARCHITECTURES` together with its `architectures` list."""
    from .files import FileError, field

    model_type = field(cfg, "model_type", "str", source, "llama")
    supported = ", ".join(f"{t} ({c})" for t, c in HF_ARCHITECTURES.items())
    if model_type not in HF_ARCHITECTURES:
        raise FileError(f"{source}: model_type {model_type!r} is not supported; jaxspec runs {supported}")
    classes = field(cfg, "architectures", "list", source, [HF_ARCHITECTURES[model_type]])
    other = [c for c in classes if c != HF_ARCHITECTURES[model_type]]
    if other:
        raise FileError(f"{source}: architectures {other!r} is not supported for model_type {model_type!r}; "
                        f"jaxspec runs {supported}")
    return model_type


def _sliding_window(cfg: dict[str, Any], model_type: str, num_layers: int, source: str) -> int | None:
    """The window every layer attends within, or None for full attention.

    Mistral windows every layer when `sliding_window` is set. Qwen2 and Qwen3 window the layers `layer_types`
    marks "sliding_attention" (transformers 5), or, in earlier configs, those from `max_window_layers` on when
    `use_sliding_window` is true. Windows on some layers only are refused: the layer stack is uniform."""
    from .files import FileError, field

    window = field(cfg, "sliding_window", "int", source, None)
    if model_type == "mistral":
        kinds = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        if "layer_types" in cfg:
            kinds = field(cfg, "layer_types", "list", source)
        elif field(cfg, "use_sliding_window", "bool", source, False):
            first = field(cfg, "max_window_layers", "int", source, num_layers)
            kinds = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
        else:
            kinds = ["full_attention"] * num_layers
    else:
        kinds = field(cfg, "layer_types", "list", source, ["full_attention"] * num_layers)
    unknown = sorted(set(map(str, kinds)) - {"full_attention", "sliding_attention"})
    if unknown:
        raise FileError(f"{source}: field 'layer_types' holds {unknown}; this decoder runs 'full_attention' and "
                        f"'sliding_attention' layers")
    if "sliding_attention" not in kinds:
        return None
    if "full_attention" in kinds:
        raise FileError(f"{source}: windowed attention on some layers only ({kinds.count('sliding_attention')} "
                        f"of {len(kinds)}) is not supported; every layer must attend alike")
    if window is None:
        raise FileError(f"{source}: field 'sliding_window' is missing; layers are 'sliding_attention'")
    return window
