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
    def from_hf(cls, cfg: dict[str, Any], *, dtype: str = "float32") -> "ModelConfig":
        """From a Hugging Face `config.json` dict (LlamaForCausalLM, Qwen2ForCausalLM and kin)."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        scaling = cfg.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope = RopeConfig(
            theta=float(cfg.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))),
            beta_fast=float(scaling.get("beta_fast", 32.0)),
            beta_slow=float(scaling.get("beta_slow", 1.0)),
            attention_factor=scaling.get("attention_factor"),
        )
        model_type = cfg.get("model_type", "llama")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            dtype=dtype,
        )
