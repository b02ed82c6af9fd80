"""Rotary position embeddings (Hugging Face "rotate half" layout) with the common scaling rules."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies f64[head_dim/2] and the attention scale that yarn applies to cos/sin."""
    inv_freq = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scale = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = np.where(wavelen > low_wavelen, inv_freq / rope.factor,
                            np.where(wavelen < high_wavelen, inv_freq, interpolated))
    elif rope.rope_type == "yarn":
        old_ctx = rope.original_max_position_embeddings

        def dim_for_rotations(rotations):
            return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low = max(math.floor(dim_for_rotations(rope.beta_fast)), 0)
        high = min(math.ceil(dim_for_rotations(rope.beta_slow)), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
        extrapolation = 1.0 - ramp  # 1 keeps the original frequency, 0 interpolates fully
        inv_freq = inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation
        scale = rope.attention_factor if rope.attention_factor is not None else 0.1 * math.log(rope.factor) + 1.0
    if rope.freq_factors is not None:
        inv_freq = inv_freq / np.asarray(rope.freq_factors, dtype=np.float64)
    return inv_freq, scale


def rope_tables(positions: jax.Array, rope: RopeConfig, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[B, T, head_dim] for integer positions i32[B, T]."""
    inv_freq, scale = inverse_frequencies(rope, head_dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, hd] rotated by cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
