"""An independent, plain-numpy forward pass of a Llama-family decoder (Llama, SmolLM, Qwen2).

This module is a *test oracle*.  It shares no code with ``jaxspec``: it reads a Hugging Face
style weight dict (the tensor names of a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` checkpoint)
and a Hugging Face style config dict, and computes everything in float64 with explicit loops
where that makes the maths easier to check by eye.  It is slow on purpose; use it on tiny models
and short sequences.

What it implements:

* RMSNorm: ``x / sqrt(mean(x**2) + eps) * w``.
* Rotary position embeddings in the Hugging Face "rotate_half" layout (the first half of a head
  is paired with the second half), positions ``0 .. T-1``, with the ``rope_scaling`` variants
  ``None``, ``{"rope_type": "linear", "factor"}`` and ``{"rope_type": "llama3", ...}``.
* Causal multi-head attention with grouped KV heads: query head ``h`` reads KV head
  ``h // (H // Hkv)``.  Scores are scaled by ``1 / sqrt(head_dim)``.  Any ``.bias`` tensor present
  for a projection is added (Qwen2 has biases on q/k/v).
* SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.
* ``lm_head`` falls back to ``model.embed_tokens.weight`` when absent (``tie_word_embeddings``).

It also provides :func:`random_hf_checkpoint`, which writes a small random checkpoint in the
Hugging Face on-disk layout (``config.json`` plus one ``model.safetensors`` or a sharded set with
``model.safetensors.index.json``) so loaders can be tested without downloading anything.

The oracle was checked against ``transformers`` 5.23 (``AutoModelForCausalLM``, torch float32) on
tiny random checkpoints made by :func:`random_hf_checkpoint` (Llama GQA with an explicit head_dim,
tied and sharded Llama, Qwen2 with q/k/v biases, llama3 and linear rope_scaling): max abs logit
differences 2e-6 .. 7e-6, per-layer hidden states within 4e-6.  On SmolLM2-135M (GGUF Q4_1
de-quantized to float32) the last-position logits agreed within 5e-5 (|logits| up to 36).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

__all__ = [
    "complete_config",
    "rope_inverse_frequencies",
    "rms_norm",
    "reference_forward",
    "random_hf_checkpoint",
]


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


def complete_config(config: dict) -> dict:
    """Return a copy of ``config`` with the optional keys filled with Hugging Face defaults."""
    cfg = dict(config)
    cfg.setdefault("head_dim", None)
    if cfg["head_dim"] is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rope_scaling", None)
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("attention_bias", False)
    return cfg


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    x = np.asarray(x, dtype=np.float64)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(mean_square + eps) * np.asarray(weight, dtype=np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> np.ndarray:
    """The ``head_dim // 2`` rotary inverse frequencies, after any ``rope_scaling``.

    Unscaled: ``inv_freq[i] = theta ** (-(2 i) / head_dim)``.

    ``linear``: every frequency divided by ``factor`` (the same as dividing positions by it).

    ``llama3``: with wavelength ``w = 2 pi / inv_freq`` and
    ``low = original_max_position_embeddings / low_freq_factor``,
    ``high = original_max_position_embeddings / high_freq_factor``:
    ``w < high`` keeps the frequency, ``w > low`` divides it by ``factor``, and in between the
    frequency is interpolated with ``s = (original / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor)`` as ``(1 - s) * f / factor + s * f``.
    """
    half = head_dim // 2
    inv_freq = np.zeros(half, dtype=np.float64)
    for i in range(half):
        inv_freq[i] = 1.0 / (float(theta) ** ((2.0 * i) / head_dim))

    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = original / low_freq_factor
        high_freq_wavelen = original / high_freq_factor
        out = np.zeros_like(inv_freq)
        for i, f in enumerate(inv_freq):
            wavelen = 2.0 * math.pi / f
            if wavelen < high_freq_wavelen:  # high frequency: unchanged
                out[i] = f
            elif wavelen > low_freq_wavelen:  # low frequency: fully scaled
                out[i] = f / factor
            else:  # in between: interpolate
                s = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                out[i] = (1.0 - s) * f / factor + s * f
        return out
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported by the reference")


def apply_rope(x: np.ndarray, position: int, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate one head vector ``x`` [head_dim] at ``position`` (rotate_half convention).

    Pair ``(x[i], x[i + half])`` is rotated by angle ``position * inv_freq[i]``:
    ``out[i] = x[i] cos - x[i + half] sin`` and ``out[i + half] = x[i + half] cos + x[i] sin``.
    """
    half = x.shape[-1] // 2
    out = np.empty_like(x, dtype=np.float64)
    for i in range(half):
        angle = position * inv_freq[i]
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[i], x[i + half]
        out[i] = a * c - b * s
        out[i + half] = b * c + a * s
    return out


def _linear(weights: dict, prefix: str, x: np.ndarray) -> np.ndarray:
    """``x @ W.T (+ b)`` for a HF linear layer stored as ``prefix.weight`` [out, in]."""
    w = np.asarray(weights[prefix + ".weight"], dtype=np.float64)
    y = x @ w.T
    bias = weights.get(prefix + ".bias")
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    return y


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


def _attention(weights: dict, cfg: dict, layer: int, x: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Causal GQA self-attention of one layer on normed input ``x`` [T, D]."""
    T = x.shape[0]
    H = cfg["num_attention_heads"]
    Hkv = cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    group = H // Hkv
    p = f"model.layers.{layer}.self_attn."

    q = _linear(weights, p + "q_proj", x).reshape(T, H, hd)
    k = _linear(weights, p + "k_proj", x).reshape(T, Hkv, hd)
    v = _linear(weights, p + "v_proj", x).reshape(T, Hkv, hd)

    for t in range(T):
        for h in range(H):
            q[t, h] = apply_rope(q[t, h], t, inv_freq)
        for g in range(Hkv):
            k[t, g] = apply_rope(k[t, g], t, inv_freq)

    scale = 1.0 / math.sqrt(hd)
    out = np.zeros((T, H, hd), dtype=np.float64)
    for h in range(H):
        g = h // group  # the KV head this query head reads
        for t in range(T):
            # Causal: position t attends to positions 0..t.
            scores = np.array([np.dot(q[t, h], k[s, g]) * scale for s in range(t + 1)])
            scores = scores - scores.max()
            probs = np.exp(scores)
            probs = probs / probs.sum()
            for s in range(t + 1):
                out[t, h] += probs[s] * v[s, g]
    return _linear(weights, p + "o_proj", out.reshape(T, H * hd))


def _mlp(weights: dict, layer: int, x: np.ndarray) -> np.ndarray:
    p = f"model.layers.{layer}.mlp."
    gate = _linear(weights, p + "gate_proj", x)
    up = _linear(weights, p + "up_proj", x)
    return _linear(weights, p + "down_proj", silu(gate) * up)


def reference_forward(weights: dict, config: dict, token_ids: list[int]) -> dict:
    """Run the decoder on ``token_ids`` (positions 0..T-1) in float64.

    Returns a dict with
      ``logits`` [T, V]: lm_head applied to the final normed state,
      ``hidden`` [T, D]: the final normed state,
      ``layers`` [L + 1, T, D]: the embedding output, then each decoder layer's output (the
      residual stream before the final norm).
    """
    cfg = complete_config(config)
    eps = float(cfg["rms_norm_eps"])
    L = int(cfg["num_hidden_layers"])
    inv_freq = rope_inverse_frequencies(cfg["head_dim"], cfg["rope_theta"], cfg["rope_scaling"])

    embed = np.asarray(weights["model.embed_tokens.weight"], dtype=np.float64)
    x = np.stack([embed[int(t)] for t in token_ids])  # [T, D]
    layers = [x.copy()]

    for i in range(L):
        p = f"model.layers.{i}."
        h = rms_norm(x, weights[p + "input_layernorm.weight"], eps)
        x = x + _attention(weights, cfg, i, h, inv_freq)
        h = rms_norm(x, weights[p + "post_attention_layernorm.weight"], eps)
        x = x + _mlp(weights, i, h)
        layers.append(x.copy())

    hidden = rms_norm(x, weights["model.norm.weight"], eps)
    if "lm_head.weight" in weights:
        lm_head = np.asarray(weights["lm_head.weight"], dtype=np.float64)
    else:  # tied embeddings
        lm_head = embed
    logits = hidden @ lm_head.T
    return {"logits": logits, "hidden": hidden, "layers": np.stack(layers)}


# --------------------------------------------------------------------------------------------
# random checkpoints in the Hugging Face layout
# --------------------------------------------------------------------------------------------


def _hf_config_json(cfg: dict, dtype) -> dict:
    qwen2 = bool(cfg["attention_bias"])
    out = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": int(cfg["num_attention_heads"]),
        "num_key_value_heads": int(cfg["num_key_value_heads"]),
        "head_dim": int(cfg["head_dim"]),
        "hidden_act": "silu",
        "rms_norm_eps": float(cfg["rms_norm_eps"]),
        "rope_theta": float(cfg["rope_theta"]),
        "rope_scaling": cfg["rope_scaling"],
        "tie_word_embeddings": bool(cfg["tie_word_embeddings"]),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
        "bos_token_id": int(cfg.get("bos_token_id", 1)),
        "eos_token_id": int(cfg.get("eos_token_id", 2)),
        "torch_dtype": {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(
            np.dtype(dtype), "float32"
        ),
    }
    if qwen2:
        out["use_sliding_window"] = False
    else:
        out["attention_bias"] = False
        out["mlp_bias"] = False
    # Keep any extra keys the caller gave (they win over the defaults above).
    for key, value in cfg.items():
        if key not in out:
            out[key] = value
    return out


def random_hf_checkpoint(tmp_dir, config: dict, seed: int, shards: int = 1, dtype=np.float32) -> dict:
    """Write a random Llama/Qwen2 checkpoint in the Hugging Face layout and return its weights.

    ``tmp_dir`` gets ``config.json`` (``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` when
    ``attention_bias``) and either ``model.safetensors`` or, when ``shards > 1``,
    ``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json`` with a
    ``weight_map``.  Linear weights are normal with std ``1/sqrt(fan_in)`` so every projection keeps
    activations O(1); embeddings have std 0.25, norm weights are ``1 + 0.1 N(0, 1)``, biases have
    std 0.1.  ``lm_head.weight`` is written only when embeddings are not tied.
    """
    from safetensors.numpy import save_file

    cfg = complete_config(config)
    rng = np.random.default_rng(seed)
    V, D, F = int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    H, Hkv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    L = int(cfg["num_hidden_layers"])

    def linear(out_features, in_features):
        return rng.normal(0.0, 1.0 / math.sqrt(in_features), size=(out_features, in_features))

    def norm(n):
        return 1.0 + 0.1 * rng.normal(size=(n,))

    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = rng.normal(0.0, 0.25, size=(V, D))
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(D)
        w[p + "self_attn.q_proj.weight"] = linear(H * hd, D)
        w[p + "self_attn.k_proj.weight"] = linear(Hkv * hd, D)
        w[p + "self_attn.v_proj.weight"] = linear(Hkv * hd, D)
        w[p + "self_attn.o_proj.weight"] = linear(D, H * hd)
        if cfg["attention_bias"]:
            w[p + "self_attn.q_proj.bias"] = rng.normal(0.0, 0.1, size=(H * hd,))
            w[p + "self_attn.k_proj.bias"] = rng.normal(0.0, 0.1, size=(Hkv * hd,))
            w[p + "self_attn.v_proj.bias"] = rng.normal(0.0, 0.1, size=(Hkv * hd,))
        w[p + "post_attention_layernorm.weight"] = norm(D)
        w[p + "mlp.gate_proj.weight"] = linear(F, D)
        w[p + "mlp.up_proj.weight"] = linear(F, D)
        w[p + "mlp.down_proj.weight"] = linear(D, F)
    w["model.norm.weight"] = norm(D)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(V, D)

    w = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in w.items()}

    os.makedirs(tmp_dir, exist_ok=True)
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(_hf_config_json(cfg, dtype), f, indent=2)

    metadata = {"format": "pt"}
    if shards <= 1:
        save_file(w, os.path.join(tmp_dir, "model.safetensors"), metadata=metadata)
        return w

    names = list(w)
    shards = min(int(shards), len(names))
    # Split the tensor list into `shards` contiguous, non-empty groups.
    bounds = [round(k * len(names) / shards) for k in range(shards + 1)]
    weight_map: dict[str, str] = {}
    total_size = 0
    for k in range(shards):
        file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: w[name] for name in names[bounds[k] : bounds[k + 1]]}
        save_file(part, os.path.join(tmp_dir, file_name), metadata=metadata)
        for name, arr in part.items():
            weight_map[name] = file_name
            total_size += arr.nbytes
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return w
