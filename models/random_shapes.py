"""Random-weight models in the shapes of real checkpoints: `load_model("random:<name>")`, for cost and memory.

A decode step on an accelerator is bound by reading the weights and the KV cache, so what it costs depends on the
model's shapes and dtype, not on its values. These models have the shapes of published Llama-family checkpoints
(`RANDOM_SHAPES`) and normally distributed weights: their output is meaningless, and they exist to measure step
times, rooflines, c(T) and memory at sizes no package ships (an 8B model in bfloat16 holds 16 GB).

Each tensor is drawn on the default device by one fused elementwise program (a counter-based hash of each
element's index, turned into a uniform value of the wanted standard deviation and cast to the model's dtype), so a
bfloat16 model never has a float32 copy, on the host or on the device, and the host never holds the weights. The
hash (MurmurHash3's 32-bit finaliser over a Weyl sequence) is what makes this fast: `jax.random`'s threefry costs
about fifteen times as much per value on a CPU, some forty seconds for the 1B model's 1.5 billion.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxspec.sharding import ShardingRules, axis_size, check_rules, param_spec

from .config import ModelConfig, RopeConfig
from .llama import LayerLoop, Llama, abstract_llama, interleave_blocks, set_matmul

PREFIX = "random:"

_LLAMA3_ROPE = dict(theta=500000.0, rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def _gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's interleaving: `pattern` - 1 local (sliding) layers, then a global one, repeated."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


# Shapes of published checkpoints (their config.json), by the name after "random:".
RANDOM_SHAPES: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's shapes.
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope=RopeConfig(theta=100000.0), tie_word_embeddings=True,
                                max_position_embeddings=8192),
    # meta-llama/Llama-3.2-1B.
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                                rope=RopeConfig(factor=32.0, **_LLAMA3_ROPE), tie_word_embeddings=True,
                                max_position_embeddings=131072),
    # meta-llama/Llama-3.1-8B.
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                rope=RopeConfig(factor=8.0, **_LLAMA3_ROPE), tie_word_embeddings=False,
                                max_position_embeddings=131072),
    # Qwen/Qwen3-8B: per-head q/k norms, head_dim 128.
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope=RopeConfig(theta=1000000.0), tie_word_embeddings=False, qk_norm=True,
                            max_position_embeddings=40960),
    # google/gemma-3-12b-pt's text decoder (its config.json's text_config, with transformers' Gemma 3 defaults for
    # what it leaves out): 5 local layers of window 1024 (rope base 1e4) to each global one (rope base 1e6,
    # linear scaling by 8), q/k norms, query_pre_attn_scalar 256, GeGLU, tied embeddings.
    "gemma-3-12b": ModelConfig(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48,
                               num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6,
                               rope=RopeConfig(theta=1000000.0, rope_type="linear", factor=8.0),
                               sliding_rope=RopeConfig(theta=10000.0), sliding_window=1024,
                               layer_types=_gemma3_layer_types(48), tie_word_embeddings=True, qk_norm=True,
                               gemma_norms=True, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=256.0,
                               max_position_embeddings=131072),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768 hidden units in every layer, 8 a token (norm_topk_prob), q/k norms.
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=768, num_layers=48,
                                 num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                                 rope=RopeConfig(theta=1000000.0), tie_word_embeddings=False, qk_norm=True,
                                 max_position_embeddings=40960, num_experts=128, experts_per_token=8),
}


def is_random(name: str) -> bool:
    """Whether `name` asks for a random-weight model ("random:<shape name>")."""
    return name.startswith(PREFIX)


def random_config(name: str, dtype: str = "float32") -> ModelConfig:
    """The config of `random:<name>` in `dtype`; ValueError naming the known shapes for any other name."""
    shape = name[len(PREFIX):] if is_random(name) else name
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model {name!r}: known are "
                         f"{', '.join(PREFIX + n for n in RANDOM_SHAPES)}")
    return dataclasses.replace(RANDOM_SHAPES[shape], dtype=dtype)


def _uniform(seed: jax.Array, *, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    """[*shape] in `dtype`: values uniform on [-sqrt(3), sqrt(3)) x `scale` (standard deviation `scale`), from
    seed u32[]; one fused elementwise program, so no wider intermediate is stored."""
    h = jax.lax.iota(jnp.uint32, math.prod(shape)) * jnp.uint32(0x9E3779B9) + seed  # u32[n], n < 2^32
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    unit = (h >> 8).astype(jnp.float32) * (2.0 ** -23) - 1.0  # f32[n] in [-1, 1), 24 random bits each
    return (unit * (scale * math.sqrt(3.0))).astype(dtype).reshape(shape)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale", "parts", "blocks", "sharding"))
def _draw(seeds: jax.Array, *, shape: tuple[int, ...], dtype, scale: float, parts: tuple[int, ...] | None,
          blocks: int, sharding: NamedSharding | None) -> jax.Array:
    """One tensor [*shape] (seeds u32[]), or a scanned stack [L, *shape] of one per layer (seeds u32[L]), its rows
    re-laid out as `blocks` per-device blocks of `parts` where given, and made in `sharding`'s shards."""
    def one(seed):
        w = _uniform(seed, shape=shape, dtype=dtype, scale=scale)
        return w if parts is None else interleave_blocks(w, parts, blocks)

    w = jax.vmap(one)(seeds) if seeds.ndim else one(seeds)
    return w if sharding is None else jax.lax.with_sharding_constraint(w, sharding)


def random_module(config: ModelConfig, seed: int = 0, *, layer_loop: LayerLoop = "unroll", mesh: Mesh | None = None,
                  rules: ShardingRules | None = None) -> Llama:
    """A Llama of `config` with random weights: embeddings of standard deviation 1, projections of 0.02 (the
    scales `Llama` initialises with), unit norm scales (zero weights for Gemma's 1 + w), zero biases.

    Each weight's seed is a hash of `seed` and the weight's path (a scanned stack's layer i: that of layer i
    unrolled), so a tensor depends neither on the order the others are drawn in nor on `layer_loop`; a tied LM
    head is the embedding's transpose, as `build_module` lays it out. Each tensor is drawn where it lives: a
    scanned stack [L, ...] at once, never stacked from a second copy, and with a `mesh` straight into the shards
    `rules` (default `ShardingRules()`) give it, its fused projections in their per-device blocks: the model
    `LanguageModel.on_mesh` makes of the one-device draw, without a device ever holding more than its share.
    """
    rules = ShardingRules() if mesh is not None and rules is None else rules
    if mesh is not None:
        check_rules(mesh, rules, config)
    heads, mlp = axis_size(mesh, rules and rules.heads), axis_size(mesh, rules and rules.mlp)
    module = abstract_llama(config, layer_loop, heads, mlp)  # drawn tensor by tensor
    dtype = config.jnp_dtype
    qkv = (config.num_heads * config.head_dim,) + (config.num_kv_heads * config.head_dim,) * 2
    blocked = {"qkv": (qkv, heads), "gate_up": ((config.intermediate_size,) * 2, mlp)}
    for path, param in nnx.iter_graph(module):
        if not isinstance(param, nnx.Param):
            continue
        name = ".".join(str(p) for p in path)
        if name == "lm_head" and config.tie_word_embeddings:
            continue
        shape = tuple(param.get_value().shape)
        sharding = None if mesh is None else NamedSharding(mesh, param_spec(path, len(shape), rules))
        stacked = layer_loop == "scan" and path[0] == "layers"  # [L, ...]: one layer's tensor per layer
        if name.endswith("weight") and len(shape) == 1 + stacked:  # RMSNorm scales
            param.set_value(jnp.full(shape, 0.0 if config.gemma_norms else 1.0, dtype, device=sharding))
        elif name.endswith("bias"):
            param.set_value(jnp.zeros(shape, dtype, device=sharding))
        else:
            names = [f"layers.{i}.{name[len('layers.'):]}" for i in range(config.num_layers)] if stacked else [name]
            seeds = jnp.asarray([zlib.crc32(f"{seed}:{n}".encode()) for n in names], jnp.uint32)
            parts, blocks = blocked.get(str(path[-1]), (None, 1))
            value = _draw(seeds if stacked else seeds[0], shape=shape[stacked:], dtype=dtype,
                          scale=1.0 if name == "embed" else 0.02, parts=parts, blocks=blocks, sharding=sharding)
            # Drawn in place already; this names the sharding as `param_spec` writes it (a compiled program
            # drops trailing Nones), so models placed either way are alike down to their jit cache keys.
            param.set_value(value if sharding is None else jax.device_put(value, sharding))
    if config.tie_word_embeddings:
        module.lm_head.set_value(module.embed[...].T)
    if mesh is not None and mesh.size > 1:
        set_matmul(module, "xla")  # as `LanguageModel.on_mesh` does: XLA partitions its own product
    return module
