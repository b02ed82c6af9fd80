"""EAGLE-3 drafters in the layout their authors publish, SpecForge writes and vLLM and SGLang load: read and write.

A drafter is a directory: `config.json` (a Llama config of its one decoder layer, `architectures`
["LlamaForCausalLMEagle3"], `draft_vocab_size`, optionally `target_hidden_size`, `norm_before_residual` and the
target layers it reads, `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors weights:

    fc.weight                                   [D, 3 D_t]   the target's three layers, concatenated, to D
    midlayer.input_layernorm.weight             [D]          the token embedding's norm
    midlayer.hidden_norm.weight                 [D]          the feature's norm
    midlayer.self_attn.{q,k,v}_proj.weight      [heads hd, 2D]
    midlayer.self_attn.o_proj.weight            [D, H hd]
    midlayer.post_attention_layernorm.weight    [D]
    midlayer.mlp.{gate,up}_proj.weight          [F, D]; down_proj [D, F]
    norm.weight                                 [D]
    lm_head.weight                              [N, D]       over the draft vocabulary
    d2t                                         i64[N]       target id of draft column j: j + d2t[j]
    t2d                                         bool[V]      which target ids the draft vocabulary holds
    embed_tokens.weight                         [V, D]       optional: the target's embedding otherwise

(`layers.0.` for `midlayer.` and a leading `model.` are read too.) Layer ids count as vLLM and SpecForge do: id j
is the hidden state entering target layer j, the output of layer j - 1 (0 is the embedding), so id j is
jaxspec's feature layer j - 1. Without ids a drafter reads vLLM's default, ids 2, L // 2 and L - 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from .config import ModelConfig, RopeConfig
from .files import FileError, SafetensorsFile, describe, field, json_object, read_json
from .heads import Readout, ReferenceEagle3Head, check_shapes, fill_params, flat_params

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # the names vLLM registers for this drafter
WEIGHTS_FILE = "model.safetensors"

# Our parameter name -> the checkpoint's, for the tensors stored one to one. The fused projections (qkv, gate_up)
# are split into their three and two parts.
_NAMES = {
    "fc": "fc.weight",
    "input_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "attn.o": "midlayer.self_attn.o_proj.weight",
    "post_attention_norm.weight": "midlayer.post_attention_layernorm.weight",
    "mlp.down": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
}
_QKV = ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight")
_GATE_UP = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight")


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's layer ids for a drafter that names none: 2, L // 2 and L - 3 (inputs of those target layers)."""
    return (2, num_layers // 2, num_layers - 3)


def is_reference_eagle3(path: str | Path) -> bool:
    """Is `path` a directory holding a drafter in this layout (a config.json naming one of `ARCHITECTURES`)?"""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        classes = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(c in ARCHITECTURES for c in classes)


def _layer_config(cfg: dict, target: ModelConfig, source: str) -> ModelConfig:
    """The drafter layer's ModelConfig from its config.json, checked against the target's."""
    if field(cfg, "num_hidden_layers", "int", source) != 1:
        raise FileError(f"{source}: field 'num_hidden_layers'={cfg['num_hidden_layers']}; jaxspec runs EAGLE-3 "
                        f"drafters of one decoder layer")
    if field(cfg, "attention_bias", "bool", source, False):
        raise FileError(f"{source}: field 'attention_bias' is true; this drafter layer has no attention biases")
    vocab = field(cfg, "vocab_size", "int", source)
    if vocab != target.vocab_size:
        raise FileError(f"{source}: field 'vocab_size'={vocab}, but the target has {target.vocab_size} tokens: "
                        f"this drafter was made for another model")
    llama = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "layer_types")}
    return ModelConfig.from_hf({**llama, "model_type": "llama"}, source=source)


def _feature_layers(cfg: dict, target: ModelConfig, source: str) -> tuple[int, ...]:
    """jaxspec's feature layers (outputs of target layers) from the drafter's layer ids (inputs of layers)."""
    eagle = field(cfg, "eagle_config", "dict", source, {})
    ids = field(eagle, "eagle_aux_hidden_state_layer_ids", "list", f"{source} (eagle_config)",
                field(cfg, "eagle_aux_hidden_state_layer_ids", "list", source, None))
    if ids is None:
        ids = default_layer_ids(target.num_layers)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= target.num_layers
                          for i in ids):
        raise FileError(f"{source}: layer ids {describe(ids)} must each be in [1, {target.num_layers}] for this "
                        f"{target.num_layers}-layer target (id j reads the output of layer j - 1; the embedding, "
                        f"id 0, is not a feature jaxspec hands a drafter)")
    return tuple(i - 1 for i in ids)


def _weights(directory: Path) -> SafetensorsFile:
    path = directory / WEIGHTS_FILE
    if not path.exists():
        found = sorted(p.name for p in directory.iterdir())
        raise FileError(f"EAGLE-3 drafter {str(directory)!r} has no {WEIGHTS_FILE} (it holds {found}); "
                        f"weights saved by torch.save must be converted to safetensors first")
    return SafetensorsFile(path, "EAGLE-3 drafter weights")


def _canonical(name: str) -> str:
    """A checkpoint name as `_NAMES` spells it (`model.` prefix and `layers.0.` for `midlayer.` read too)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def load_reference_eagle3(directory: str | Path, target: ModelConfig) -> tuple[ReferenceEagle3Head, dict]:
    """(drafter, metadata) from a directory in this layout, for a target of config `target`.

    FileError (a ValueError) naming the file and the problem for: another architecture, more than one layer,
    biases, another vocabulary or hidden size than the target's, layer ids outside the target, missing,
    unexpected or misshapen tensors, draft-to-target ids that are out of range or repeated, non-finite weights.
    """
    directory = Path(directory)
    source = f"EAGLE-3 drafter config {str(directory / 'config.json')!r}"
    cfg = json_object(read_json(directory / "config.json", "EAGLE-3 drafter config"), source)
    classes = field(cfg, "architectures", "list", source, [])
    if not any(c in ARCHITECTURES for c in classes):
        raise FileError(f"{source}: architectures {describe(classes)} is not an EAGLE-3 drafter in its authors' "
                        f"layout (one of {list(ARCHITECTURES)})")
    layer = _layer_config(cfg, target, source)
    target_hidden = field(cfg, "target_hidden_size", "int", source, layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise FileError(f"{source}: target_hidden_size={target_hidden}, but the target's hidden size is "
                        f"{target.hidden_size}")
    layers = _feature_layers(cfg, target, source)
    draft_vocab = field(cfg, "draft_vocab_size", "int", source, target.vocab_size)

    weights = _weights(directory)
    tensors = {_canonical(name): name for name in weights.shapes}
    own_embedding = "embed_tokens.weight" in tensors
    head = nnx.eval_shape(lambda: ReferenceEagle3Head(
        layer, layers, target_hidden=target_hidden, draft_vocab=draft_vocab, own_embedding=own_embedding,
        norm_before_residual=field(cfg, "norm_before_residual", "bool", source, False), rngs=nnx.Rngs(0)))
    needed = _checkpoint_shapes(head)
    given = {name: weights.shapes[tensors[name]] for name in tensors if name != "t2d"}
    check_shapes(given, needed, source=weights.source, needed="the drafter its config.json describes")
    values = {name: weights.read(tensors[name]) for name in needed if name != "d2t"}
    ids = np.arange(draft_vocab) + weights.read_integers(tensors["d2t"])
    if ids.min() < 0 or ids.max() >= target.vocab_size or len(np.unique(ids)) != len(ids):
        raise FileError(f"{weights.source}: d2t maps draft ids to target ids outside [0, {target.vocab_size}) or "
                        f"to one id twice")
    head = ReferenceEagle3Head(layer, layers, target_hidden=target_hidden, draft_vocab=draft_vocab,
                               own_embedding=own_embedding, norm_before_residual=head.norm_before_residual,
                               rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(head)
    ours = _from_checkpoint(values, head)
    fill_params(state, {**ours, "ids": ids}, source=weights.source, needed="this drafter")
    meta = {"kind": "eagle3", "architecture": "reference", "feature_layers": list(layers), "source": str(directory)}
    return nnx.merge(graphdef, state), meta


def _checkpoint_shapes(head: ReferenceEagle3Head) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor shapes for `head` (abstract or built)."""
    cfg = head.cfg
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {ckpt: tuple(_value(head, ours).shape) for ours, ckpt in _NAMES.items()}
    for name, heads in zip(_QKV, (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)):
        shapes[name] = (heads * hd, 2 * d)
    for name in _GATE_UP:
        shapes[name] = (cfg.intermediate_size, d)
    n = head.lm_head.shape[1]
    shapes["lm_head.weight"], shapes["d2t"] = (n, d), (n,)
    if head.embed is not None:
        shapes["embed_tokens.weight"] = tuple(head.embed.shape)
    return shapes


def _value(head, dotted: str):
    obj = head
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _from_checkpoint(values: dict[str, np.ndarray], head: ReferenceEagle3Head) -> dict[str, np.ndarray]:
    """Our parameters ({dotted name: array}, as `flat_params` names them) from the checkpoint's tensors."""
    ours = {name: values[ckpt] for name, ckpt in _NAMES.items()}
    ours["attn.qkv"] = np.concatenate([values[name] for name in _QKV])  # rows [q; k; v]
    ours["mlp.gate_up"] = np.concatenate([values[name] for name in _GATE_UP])  # rows [gate; up]
    ours["lm_head"] = values["lm_head.weight"].T  # [D, N]
    if head.embed is not None:
        ours["embed"] = values["embed_tokens.weight"]
    return ours


def _rope_scaling(rope: RopeConfig) -> dict | None:
    """transformers' `rope_scaling` for `rope` (None for plain rotary positions)."""
    if rope.freq_factors is not None:
        raise ValueError("rope frequencies given per dimension (a GGUF rope_freqs tensor) have no config.json form")
    if rope.rope_type == "default":
        return None
    out = {"rope_type": rope.rope_type, "factor": rope.factor}
    if rope.rope_type == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    elif rope.rope_type == "yarn":
        out.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
        if rope.attention_factor is not None:
            out["attention_factor"] = rope.attention_factor
    return out


def save_reference_eagle3(directory: str | Path, head: ReferenceEagle3Head, target: Readout, *,
                          dtype: str = "float32") -> Path:
    """Write `head` to `directory` in this layout (config.json and model.safetensors); returns the directory.

    `target` is the target's readout: a drafter that shares the target's LM head (one trained here) gets a copy
    of it (over the target's draft vocabulary when the readout is restricted), as the layout needs its own.
    `dtype` "float32" (the default: loads back exactly), "float16" or "bfloat16" for the float tensors.
    """
    from safetensors.numpy import save_file

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} must be 'float32', 'float16' or 'bfloat16'")
    cfg = head.cfg
    readout = head.draft_readout(target)
    lm_head = np.asarray(readout.lm_head, np.float32)  # [D, N]
    n = lm_head.shape[1]
    ids = np.arange(n) if readout.ids is None else np.asarray(readout.ids, np.int64)
    ours = flat_params(nnx.state(head))
    tensors = {ckpt: ours[name] for name, ckpt in _NAMES.items()}
    h, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tensors.update(zip(_QKV, np.split(ours["attn.qkv"], [h * hd, (h + hkv) * hd])))
    tensors.update(zip(_GATE_UP, np.split(ours["mlp.gate_up"], 2)))
    tensors["lm_head.weight"] = lm_head.T
    if head.embed is not None:
        tensors["embed_tokens.weight"] = ours["embed"]
    float_type = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if float_type is None:
        import ml_dtypes

        float_type = ml_dtypes.bfloat16
    tensors = {k: np.ascontiguousarray(v, float_type) for k, v in tensors.items()}
    tensors["d2t"] = (ids - np.arange(n)).astype(np.int64)
    t2d = np.zeros(cfg.vocab_size, np.bool_)
    t2d[ids] = True
    tensors["t2d"] = t2d
    config = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": h, "num_key_value_heads": hkv, "head_dim": hd, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope.theta, "rope_scaling": _rope_scaling(cfg.rope),
        "vocab_size": cfg.vocab_size, "draft_vocab_size": n, "target_hidden_size": head.fc.shape[1] // len(
            head.feature_layers), "tie_word_embeddings": False, "attention_bias": False,
        "norm_before_residual": head.norm_before_residual, "torch_dtype": dtype,
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.feature_layers]},
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


__all__ = ["ARCHITECTURES", "default_layer_ids", "is_reference_eagle3", "load_reference_eagle3",
           "save_reference_eagle3"]
