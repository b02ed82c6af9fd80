"""Static description of a Llama-family decoder (Llama, Qwen2, SmolLM2).

A `ModelConfig` is frozen and hashable: it is part of the compiled program (shapes, layer count, rope
constants), never a per-request value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    max_position_embeddings: int = 8192
    dtype: str = "float32"  # parameter and activation dtype; norms and softmax always run in float32

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
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
        """From a Hugging Face `config.json` dict (LlamaForCausalLM, Qwen2ForCausalLM and kin).

        ValueError (`jaxspec.models.files.FileError`) naming `source`, the field, the type it must have and the
        value, for a missing or mistyped field or a value the config refuses."""
        from .files import FileError, field, json_object

        cfg = json_object(cfg, source)
        heads = field(cfg, "num_attention_heads", "int", source)
        hidden = field(cfg, "hidden_size", "int", source)
        if heads <= 0:
            raise FileError(f"{source}: field 'num_attention_heads'={heads} must be positive")
        head_dim = field(cfg, "head_dim", "int", source, hidden // heads)
        scaling = field(cfg, "rope_scaling", "dict", source, {})
        where = f"{source} (rope_scaling)"
        rope_type = field(scaling, "rope_type", "str", where, field(scaling, "type", "str", where, "default"))
        try:
            rope = RopeConfig(
                theta=float(field(cfg, "rope_theta", "number", source, 10000.0)),
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
            model_type = field(cfg, "model_type", "str", source, "llama")
            return cls(
                vocab_size=field(cfg, "vocab_size", "int", source),
                hidden_size=hidden,
                intermediate_size=field(cfg, "intermediate_size", "int", source),
                num_layers=field(cfg, "num_hidden_layers", "int", source),
                num_heads=heads,
                num_kv_heads=field(cfg, "num_key_value_heads", "int", source, heads),
                head_dim=head_dim,
                rms_norm_eps=float(field(cfg, "rms_norm_eps", "number", source, 1e-6)),
                rope=rope,
                tie_word_embeddings=field(cfg, "tie_word_embeddings", "bool", source, False),
                attention_bias=field(cfg, "attention_bias", "bool", source, model_type == "qwen2"),
                max_position_embeddings=field(cfg, "max_position_embeddings", "int", source, 8192),
                dtype=dtype,
            )
        except FileError:
            raise
        except ValueError as e:  # a value the config refuses (RopeConfig, ModelConfig.__post_init__)
            raise FileError(f"{source}: {e}") from None
