"""Static description of a Llama-family decoder (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, SmolLM2, Gemma 2,
Gemma 3 text).

A `ModelConfig` is frozen and hashable: it is part of the compiled program (shapes, layer count, rope
constants), never a per-request value.

The architectures are one decoder with switches: q/k/v biases (Qwen2), per-head q/k norms (Qwen3, Gemma 3), a
sliding attention window on every layer (Mistral) or on the layers `layer_types` marks (Qwen2 and Qwen3 configs
that say so, Gemma's interleaved local and global layers, each kind with its own rotary settings), and Gemma's
additions: (1 + w) norm scales, norms around each block's output as well as its input, embeddings scaled by
sqrt(hidden_size), a GELU-gated MLP, its own attention scale (`query_pre_attn_scalar`) and, in Gemma 2, tanh
soft-capping of the attention scores and the final logits. Mixtures of experts (Mixtral, Qwen3-MoE) replace every
layer's MLP by routed experts (`num_experts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from .files import FileError, field, json_object

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's: SwiGLU's, and Gemma's tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names for a layer's attention kind
# Hugging Face `model_type`s this decoder implements, each with the `architectures` class its checkpoints name.
# Anything else (Gemma 1, DeepSeek, ...) is refused by name rather than run as a Llama.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
# A full-attention layer inside a scanned stack of mixed layers attends within this window: wider than any
# position, so it never hides a key.
FULL_WINDOW = 1 << 30


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
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each query and key head (head_dim features) before rotation
    # A windowed layer's query at position p attends keys at positions p - sliding_window + 1 .. p only.
    sliding_window: int | None = None
    # Each layer's attention kind, one of LAYER_TYPES (Hugging Face's `layer_types`): "sliding_attention" layers
    # attend within `sliding_window`, "full_attention" layers over every earlier key. None: every layer alike,
    # windowed where `sliding_window` is set (Mistral). Entries past num_layers are dropped, so a config of fewer
    # layers (a self-draft's `replace(cfg, num_layers=N)`) keeps the first layers' kinds; a tuple of one kind
    # becomes None (with no window when that kind is full attention).
    layer_types: tuple[str, ...] | None = None
    sliding_rope: RopeConfig | None = None  # Gemma 3: the windowed layers' rotary settings; None: `rope` for all
    max_position_embeddings: int = 8192
    dtype: str = "float32"  # parameter and activation dtype; norms and softmax always run in float32
    # Gemma: every RMSNorm scales by (1 + w), each layer also norms its attention and MLP outputs before adding them
    # to the residual stream (4 norms a layer), and token embeddings are scaled by sqrt(hidden_size).
    gemma_norms: bool = False
    hidden_act: str = "silu"  # the MLP gate's activation, one of ACTIVATIONS
    query_pre_attn_scalar: float | None = None  # Gemma: scores scale by its inverse square root; None: head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores become tanh(s / c) * c before the mask
    final_logit_softcapping: float | None = None  # Gemma 2: logits become tanh(l / c) * c
    # Mixtures of experts (Mixtral, Qwen3-MoE): every layer's MLP is `num_experts` gated experts of
    # `intermediate_size` hidden units, of which a router runs `experts_per_token` per token; their weights are
    # renormalised over those k (`normalize_expert_weights`, Mixtral's rule and Qwen3-MoE's `norm_topk_prob`).
    # 0 experts: one dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    normalize_expert_weights: bool = True

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
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {ACTIVATIONS}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name}={value!r} must be None or a positive number")
        if self.sliding_rope is not None and not isinstance(self.sliding_rope, RopeConfig):
            raise ValueError(f"sliding_rope={self.sliding_rope!r} must be None or a RopeConfig")
        if self.layer_types is not None:
            self._check_layer_types()
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token!r} must be in [1, num_experts="
                             f"{self.num_experts}]")

    def _check_layer_types(self):
        """Validate `layer_types`, keep its first num_layers entries, and fold a single kind into None."""
        kinds = self.layer_types
        if not isinstance(kinds, tuple) or any(k not in LAYER_TYPES for k in kinds):
            raise ValueError(f"layer_types={kinds!r} must be a tuple of {LAYER_TYPES}")
        if len(kinds) < self.num_layers:
            raise ValueError(f"layer_types has {len(kinds)} entries; num_layers={self.num_layers} needs one a layer")
        kinds = kinds[:self.num_layers]
        if "sliding_attention" in kinds and self.sliding_window is None:
            raise ValueError("layer_types marks 'sliding_attention' layers, but sliding_window is None")
        if len(set(kinds)) == 1:  # every layer alike: what sliding_window alone says
            if kinds[0] == "full_attention":
                object.__setattr__(self, "sliding_window", None)
            kinds = None
        object.__setattr__(self, "layer_types", kinds)

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        """What the query-key products are multiplied by: 1/sqrt(query_pre_attn_scalar), or 1/sqrt(head_dim)."""
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The window decoder layer `layer` attends within; None for full attention."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary settings of decoder layer `layer`: `sliding_rope` for a windowed layer where set, else `rope`."""
        if self.sliding_rope is not None and self.layer_window(layer) is not None:
            return self.sliding_rope
        return self.rope

    def llama_layers(self) -> "ModelConfig":
        """This config with its layers as Llama's, for a drafter's layer on any target: no q/k norms, windows, Gemma
        norms, GELU, attention scalar, soft-capping or experts (a dense MLP of `intermediate_size` units); the
        widths, `rope` and q/k/v biases stay."""
        return dataclasses.replace(self, qk_norm=False, sliding_window=None, layer_types=None, sliding_rope=None,
                                   gemma_norms=False, hidden_act="silu", query_pre_attn_scalar=None,
                                   attn_logit_softcapping=None, final_logit_softcapping=None, num_experts=0,
                                   experts_per_token=0)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, dtype: str = "float32", source: str = "config.json") -> "ModelConfig":
        """From a Hugging Face `config.json` dict of one of `HF_ARCHITECTURES` (a config without `model_type` is
        read as Llama's).

        Rotary settings come from `rope_parameters` (what transformers 5 writes; per layer kind for Gemma 3) or
        `rope_theta`, `rope_scaling` and Gemma 3's `rope_local_base_freq` (earlier releases). Missing Gemma fields
        take transformers' defaults. Gemma 3's `attn_logit_softcapping` is not read: transformers' Gemma 3 applies
        no attention soft-capping. ValueError (`jaxspec.models.files.FileError`) naming `source` and the field: for
        another `model_type` or `architectures` (listing the supported ones), for what this decoder does not
        implement (another activation, MLP biases, bidirectional attention), and for a missing or mistyped field or
        a value the config refuses."""

        cfg = json_object(cfg, source)
        model_type = _architecture(cfg, source)
        gemma = model_type in GEMMA
        heads = field(cfg, "num_attention_heads", "int", source)
        hidden = field(cfg, "hidden_size", "int", source)
        if heads <= 0:
            raise FileError(f"{source}: field 'num_attention_heads'={heads} must be positive")
        head_dim = field(cfg, "head_dim", "int", source, hidden // heads)
        if field(cfg, "mlp_bias", "bool", source, False):
            raise FileError(f"{source}: field 'mlp_bias' is true; this decoder's MLP has no biases")
        if gemma and field(cfg, "use_bidirectional_attention", "bool", source, False):
            raise FileError(f"{source}: field 'use_bidirectional_attention' is true; this decoder is causal")
        num_layers = field(cfg, "num_hidden_layers", "int", source)
        num_experts, per_token, normalize, expert_width = _experts(cfg, model_type, num_layers, source)
        try:
            rope, sliding_rope = _ropes(cfg, model_type, source)
            sliding_window, layer_types = _attention_kinds(cfg, model_type, num_layers, source)
            return cls(
                vocab_size=field(cfg, "vocab_size", "int", source),
                hidden_size=hidden,
                intermediate_size=expert_width or field(cfg, "intermediate_size", "int", source),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=field(cfg, "num_key_value_heads", "int", source, heads),
                head_dim=head_dim,
                rms_norm_eps=float(field(cfg, "rms_norm_eps", "number", source, 1e-6)),
                rope=rope,
                tie_word_embeddings=field(cfg, "tie_word_embeddings", "bool", source, gemma),
                attention_bias=field(cfg, "attention_bias", "bool", source, model_type == "qwen2"),
                qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
                sliding_window=sliding_window,
                layer_types=layer_types,
                sliding_rope=sliding_rope,
                max_position_embeddings=field(cfg, "max_position_embeddings", "int", source, 8192),
                dtype=dtype,
                gemma_norms=gemma,
                hidden_act=_activation(cfg, gemma, source),
                # transformers' defaults where a Gemma config leaves these out.
                query_pre_attn_scalar=(float(field(cfg, "query_pre_attn_scalar", "number", source, 256))
                                       if gemma else None),
                attn_logit_softcapping=_softcap(cfg, "attn_logit_softcapping", model_type == "gemma2", 50.0, source),
                final_logit_softcapping=_softcap(cfg, "final_logit_softcapping", gemma, 30.0 if model_type == "gemma2"
                                                 else None, source),
                num_experts=num_experts,
                experts_per_token=per_token,
                normalize_expert_weights=normalize,
            )
        except FileError:
            raise
        except ValueError as e:  # a value the config refuses (RopeConfig, ModelConfig.__post_init__)
            raise FileError(f"{source}: {e}") from None


def _architecture(cfg: dict[str, Any], source: str) -> str:
    """The config's `model_type`, checked against `HF_ARCHITECTURES` together with its `architectures` list."""

    model_type = field(cfg, "model_type", "str", source, "llama")
    supported = ", ".join(f"{t} ({c})" for t, c in HF_ARCHITECTURES.items())
    if model_type == "gemma3":
        raise FileError(f"{source}: model_type 'gemma3' is Gemma 3's image-and-text model "
                        f"(Gemma3ForConditionalGeneration), which is not supported; jaxspec runs Gemma 3's text "
                        f"decoder from a 'gemma3_text' checkpoint (Gemma3ForCausalLM), and {supported}")
    if model_type not in HF_ARCHITECTURES:
        raise FileError(f"{source}: model_type {model_type!r} is not supported; jaxspec runs {supported}")
    classes = field(cfg, "architectures", "list", source, [HF_ARCHITECTURES[model_type]])
    other = [c for c in classes if c != HF_ARCHITECTURES[model_type]]
    if other:
        raise FileError(f"{source}: architectures {other!r} is not supported for model_type {model_type!r}; "
                        f"jaxspec runs {supported}")
    return model_type


def _experts(cfg: dict[str, Any], model_type: str, num_layers: int,
             source: str) -> tuple[int, int, bool, int | None]:
    """(num_experts, experts_per_token, normalize_expert_weights, each expert's hidden width) of a mixture of
    experts; (0, 0, True, None) for a dense model.

    Mixtral names its experts `num_local_experts` and always renormalises the k weights; Qwen3-MoE names them
    `num_experts` (`num_local_experts` in what transformers 5 writes), its experts' width `moe_intermediate_size`
    and its rule `norm_topk_prob`. Qwen3-MoE configs whose layers mix dense MLPs and experts (`mlp_only_layers`,
    `decoder_sparse_step`) are refused: the layer stack is uniform."""

    if model_type not in ("mixtral", "qwen3_moe"):
        return 0, 0, True, None
    if model_type == "mixtral":
        experts = field(cfg, "num_local_experts", "int", source)
        return experts, field(cfg, "num_experts_per_tok", "int", source), True, None
    name = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts = field(cfg, name, "int", source)
    step = field(cfg, "decoder_sparse_step", "int", source, 1)
    dense = field(cfg, "mlp_only_layers", "list", source, [])
    if experts <= 0 or step != 1 or dense:
        raise FileError(f"{source}: layers with a dense MLP among the experts' ({name}={experts}, "
                        f"decoder_sparse_step={step}, mlp_only_layers={dense}) are not supported; every layer "
                        f"must be a mixture of experts")
    return (experts, field(cfg, "num_experts_per_tok", "int", source),
            field(cfg, "norm_topk_prob", "bool", source, False), field(cfg, "moe_intermediate_size", "int", source))


def _activation(cfg: dict[str, Any], gemma: bool, source: str) -> str:
    """The MLP gate's activation: Gemma's `hidden_activation` (older configs: `hidden_act`), others' `hidden_act`."""

    name = "hidden_act"
    if gemma:
        name = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
    activation = field(cfg, name, "str", source, "gelu_pytorch_tanh" if gemma else "silu")
    if activation not in ACTIVATIONS:
        raise FileError(f"{source}: field {name!r}={activation!r}; this decoder's MLP gates with one of {ACTIVATIONS}")
    return activation


def _softcap(cfg: dict[str, Any], name: str, read: bool, default: float | None, source: str) -> float | None:
    """Field `name` (a soft-capping constant; null for none) where the architecture applies it, else None;
    `default` where the config leaves it out."""

    if not read:
        return None
    if name not in cfg:
        return default
    value = field(cfg, name, "number", source, None)
    return None if value is None else float(value)


def _ropes(cfg: dict[str, Any], model_type: str, source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary settings of full-attention layers, and of windowed ones where they differ (Gemma 3).

    transformers 5 writes `rope_parameters`: one dict, or one per layer kind ("full_attention",
    "sliding_attention", Gemma 3's); earlier releases `rope_theta` and `rope_scaling`, and Gemma 3
    `rope_local_base_freq` for its local layers. Gemma 3's default thetas are transformers': 1e6 for global
    layers, 1e4 for local ones."""

    gemma3 = model_type == "gemma3_text"
    full_theta = 1e6 if gemma3 else 10000.0
    local_theta = float(field(cfg, "rope_local_base_freq", "number", source, 10000.0))
    if "rope_parameters" in cfg:
        parameters = field(cfg, "rope_parameters", "dict", source)
        where = f"{source} (rope_parameters)"
        if any(kind in parameters for kind in LAYER_TYPES):
            full = _rope(cfg, field(parameters, "full_attention", "dict", where, {}), full_theta,
                         f"{where}['full_attention']", source)
            sliding = _rope(cfg, field(parameters, "sliding_attention", "dict", where, {}), local_theta,
                            f"{where}['sliding_attention']", source)
            return full, (None if sliding == full else sliding)
        full = _rope(cfg, parameters, full_theta, where, source)
    else:
        scaling = field(cfg, "rope_scaling", "dict", source, {})
        theta = field(cfg, "rope_theta", "number", source, full_theta)
        full = _rope(cfg, {**scaling, "rope_theta": theta}, full_theta, f"{source} (rope_scaling)", source)
    return full, (RopeConfig(theta=local_theta) if gemma3 else None)


def _rope(cfg: dict[str, Any], scaling: dict[str, Any], default_theta: float, where: str, source: str) -> RopeConfig:
    """A RopeConfig from one dict of rotary settings (theta, rope_type or type, and the scaling fields)."""

    rope_type = field(scaling, "rope_type", "str", where, field(scaling, "type", "str", where, "default"))
    return RopeConfig(
        theta=float(field(scaling, "rope_theta", "number", where, default_theta)),
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


def _attention_kinds(cfg: dict[str, Any], model_type: str, num_layers: int,
                     source: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as `ModelConfig` holds them: the window, and each layer's kind where they mix.

    Mistral and Mixtral window every layer when `sliding_window` is set. Qwen2, Qwen3 and Qwen3-MoE window only with
    `use_sliding_window` true (transformers drops the window otherwise), the layers `layer_types` marks
    "sliding_attention" or, in earlier configs, those from `max_window_layers` on. Gemma windows the layers
    `layer_types` marks, by default every other layer from the first (Gemma 2) or all but every
    `sliding_window_pattern`-th (Gemma 3, pattern 6), within transformers' default window of 4096."""

    gemma = model_type in GEMMA
    window = field(cfg, "sliding_window", "int", source, 4096 if gemma else None)
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not field(cfg, "use_sliding_window", "bool", source, False):
        return None, None
    if model_type in ("mistral", "mixtral"):
        kinds = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif "layer_types" in cfg:
        kinds = field(cfg, "layer_types", "list", source)
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = field(cfg, "max_window_layers", "int", source, num_layers)
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    elif model_type == "gemma2":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    elif model_type == "gemma3_text":
        pattern = field(cfg, "sliding_window_pattern", "int", source, 6)
        if pattern <= 0:
            raise FileError(f"{source}: field 'sliding_window_pattern'={pattern} must be positive")
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    else:
        kinds = ["full_attention"] * num_layers
    unknown = sorted(set(map(str, kinds)) - set(LAYER_TYPES))
    if unknown:
        raise FileError(f"{source}: field 'layer_types' holds {unknown}; this decoder runs {LAYER_TYPES} layers")
    if len(kinds) != num_layers:
        raise FileError(f"{source}: field 'layer_types' has {len(kinds)} entries; 'num_hidden_layers' is {num_layers}")
    if "sliding_attention" not in kinds:
        return None, None
    if window is None:
        raise FileError(f"{source}: field 'sliding_window' is missing; layers are 'sliding_attention'")
    return window, (tuple(kinds) if "full_attention" in kinds else None)
