"""EAGLE, EAGLE-3 and DFlash drafters in the layout their authors publish, SpecForge writes and vLLM and SGLang
load.

A drafter is a directory: `config.json`, a Llama config of its one decoder layer, and `model.safetensors`.

EAGLE-3 (`architectures` ["LlamaForCausalLMEagle3"]; `draft_vocab_size`, optionally `target_hidden_size`,
`norm_before_residual` and the target layers it reads, `eagle_config.eagle_aux_hidden_state_layer_ids`):

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

EAGLE-1 (`architectures` ["LlamaForCausalLM"] as the EAGLE authors ship it, or vLLM's "EagleLlamaForCausalLM";
told from a Llama model by its `fc.weight`): fc over [embedding; feature] and one layer without an input norm,
scored by the target's own LM head:

    fc.weight                                   [D, 2D]      (fc.bias [D] where the checkpoint has one)
    layers.0.self_attn.{q,k,v,o}_proj.weight    as a Llama layer's
    layers.0.post_attention_layernorm.weight    [D]
    layers.0.mlp.{gate,up,down}_proj.weight     as a Llama layer's
    embed_tokens.weight, layers.0.input_layernorm.weight    optional and unused: the target's embedding, and a
                                                            norm the drafter's first layer skips

DFlash (`architectures` ["DFlashDraftModel"], the DFlash authors'; `dflash_config` holds `mask_token_id`,
`target_layer_ids`, counted as jaxspec's feature layers are, and `block_size`): fc over the target layers'
outputs, then N Qwen3 decoder layers scored by the target's own LM head (`jaxspec.models.dflash`):

    fc.weight                                   [D, L D]     the target's L layers, concatenated, to D
    hidden_norm.weight                          [D]          the context's norm
    layers.i.input_layernorm.weight             [D]
    layers.i.self_attn.{q,k,v}_proj.weight      [heads hd, D]
    layers.i.self_attn.{q,k}_norm.weight        [hd]
    layers.i.self_attn.o_proj.weight            [D, H hd]
    layers.i.post_attention_layernorm.weight    [D]
    layers.i.mlp.{gate,up}_proj.weight          [F, D]; down_proj [D, F]
    norm.weight                                 [D]
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from .config import ModelConfig, RopeConfig
from .dflash import DFLASH_BLOCK, DFlashDrafter
from .files import REQUIRED, FileError, SafetensorsFile, describe, field, json_object, read_json
from .heads import Readout, ReferenceEagle3Head, ReferenceEagleHead, check_shapes, fill_params, flat_params

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # the names vLLM registers
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM")  # the EAGLE authors' name, vLLM's
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)  # the DFlash authors' (z-lab) drafter class
WEIGHTS_FILE = "model.safetensors"


def _layer_names(prefix: str) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """The checkpoint's names of a drafter layer stored under `prefix`: {our parameter: theirs} for the tensors
    stored one to one, and the parts of the fused projections (q, k, v; gate, up), in our rows' order."""
    one_to_one = {"attn.o": f"{prefix}self_attn.o_proj.weight",
                  "post_attention_norm.weight": f"{prefix}post_attention_layernorm.weight",
                  "mlp.down": f"{prefix}mlp.down_proj.weight"}
    return (one_to_one, tuple(f"{prefix}self_attn.{n}_proj.weight" for n in "qkv"),
            (f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"))


_LAYER3, _QKV3, _GATE_UP3 = _layer_names("midlayer.")
_NAMES3 = {"fc": "fc.weight", "input_norm.weight": "midlayer.input_layernorm.weight",
           "hidden_norm.weight": "midlayer.hidden_norm.weight", "norm.weight": "norm.weight", **_LAYER3}
_LAYER1, _QKV1, _GATE_UP1 = _layer_names("layers.0.")
_NAMES1 = {"fc": "fc.weight", **_LAYER1}
_UNUSED1 = ("embed_tokens.weight", "layers.0.input_layernorm.weight")  # read past: see the module's docstring


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's layer ids for a drafter that names none: 2, L // 2 and L - 3 (inputs of those target layers)."""
    return (2, num_layers // 2, num_layers - 3)


def drafter_kind(path: str | Path) -> str | None:
    """"eagle3", "eagle" or "dflash" when `path` is a directory holding a drafter in its authors' layout, else
    None: its config.json names an EAGLE-3 or DFlash class, or a Llama one with one layer beside weights holding
    `fc.weight`."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        classes = config.get("architectures") or []
        if any(c in EAGLE3_ARCHITECTURES for c in classes):
            return "eagle3"
        if any(c in DFLASH_ARCHITECTURES for c in classes):
            return "dflash"
        if (any(c in EAGLE_ARCHITECTURES for c in classes) and config.get("num_hidden_layers") == 1
                and "fc.weight" in SafetensorsFile(path / WEIGHTS_FILE).shapes):
            return "eagle"
    except (OSError, ValueError, AttributeError):
        return None
    return None


def load_reference_drafter(directory: str | Path, target: ModelConfig):
    """(drafter, metadata) from a directory in its authors' layout, EAGLE, EAGLE-3 or DFlash (`drafter_kind`);
    ValueError naming the directory when it is none of them."""
    kind = drafter_kind(directory)
    if kind is None:
        raise FileError(f"{str(directory)!r} holds no EAGLE, EAGLE-3 or DFlash drafter in its authors' layout "
                        f"(config.json naming one of "
                        f"{list(EAGLE3_ARCHITECTURES + EAGLE_ARCHITECTURES + DFLASH_ARCHITECTURES)} and "
                        f"{WEIGHTS_FILE})")
    load = {"eagle3": load_reference_eagle3, "eagle": load_reference_eagle, "dflash": load_reference_dflash}[kind]
    return load(directory, target)


def _layer_config(cfg: dict, target: ModelConfig, source: str) -> ModelConfig:
    """The drafter layer's ModelConfig from its config.json, checked against the target's."""
    if field(cfg, "num_hidden_layers", "int", source) != 1:
        raise FileError(f"{source}: field 'num_hidden_layers'={cfg['num_hidden_layers']}; jaxspec runs EAGLE "
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


def _drafter_config(directory: Path, what: str, architectures: tuple[str, ...]) -> tuple[str, dict]:
    """(how errors name it, the object) of a drafter's config.json, whose `architectures` must name one of
    `architectures`; FileError naming the file otherwise."""
    source = f"{what} drafter config {str(directory / 'config.json')!r}"
    cfg = json_object(read_json(directory / "config.json", f"{what} drafter config"), source)
    classes = field(cfg, "architectures", "list", source, [])
    if not any(c in architectures for c in classes):
        raise FileError(f"{source}: architectures {describe(classes)} names no {what} drafter class jaxspec runs "
                        f"in its authors' layout (one of {list(architectures)})")
    return source, cfg


def _weights(directory: Path, what: str) -> SafetensorsFile:
    path = directory / WEIGHTS_FILE
    if not path.exists():
        found = sorted(p.name for p in directory.iterdir())
        raise FileError(f"{what} {str(directory)!r} has no {WEIGHTS_FILE} (it holds {found}); weights saved by "
                        f"torch.save must be converted to safetensors first")
    return SafetensorsFile(path, f"{what} weights")


def _canonical(name: str) -> str:
    """An EAGLE-3 checkpoint's name as `_NAMES3` spells it (`model.` prefix and `layers.0.` for `midlayer.` read
    too)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def load_reference_eagle3(directory: str | Path, target: ModelConfig) -> tuple[ReferenceEagle3Head, dict]:
    """(drafter, metadata) from a directory in this layout, for a target of config `target`.

    FileError (a ValueError) naming the file and the problem for: another architecture, more than one layer,
    biases, another vocabulary or hidden size than the target's, layer ids outside the target, missing,
    unexpected or misshapen tensors, draft-to-target ids that are out of range or repeated, non-finite weights.
    """
    directory = Path(directory)
    source, cfg = _drafter_config(directory, "EAGLE-3", EAGLE3_ARCHITECTURES)
    layer = _layer_config(cfg, target, source)
    target_hidden = field(cfg, "target_hidden_size", "int", source, layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise FileError(f"{source}: target_hidden_size={target_hidden}, but the target's hidden size is "
                        f"{target.hidden_size}")
    layers = _feature_layers(cfg, target, source)
    draft_vocab = field(cfg, "draft_vocab_size", "int", source, target.vocab_size)

    weights = _weights(directory, "EAGLE-3 drafter")
    tensors = {_canonical(name): name for name in weights.shapes}
    own_embedding = "embed_tokens.weight" in tensors
    head = nnx.eval_shape(lambda: ReferenceEagle3Head(
        layer, layers, target_hidden=target_hidden, draft_vocab=draft_vocab, own_embedding=own_embedding,
        norm_before_residual=field(cfg, "norm_before_residual", "bool", source, False), rngs=nnx.Rngs(0)))
    needed = _eagle3_shapes(head)
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
    ours = _from_checkpoint(values, _NAMES3, _QKV3, _GATE_UP3)
    ours["lm_head"] = values["lm_head.weight"].T  # [D, N]
    if head.embed is not None:
        ours["embed"] = values["embed_tokens.weight"]
    fill_params(state, {**ours, "ids": ids}, source=weights.source, needed="this drafter")
    meta = {"kind": "eagle3", "architecture": "reference", "feature_layers": list(layers), "source": str(directory)}
    return nnx.merge(graphdef, state), meta


def _checkpoint_shapes(head, names: dict[str, str], qkv: tuple[str, ...], gate_up: tuple[str, ...],
                       qkv_in: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a drafter's checkpoint tensors named by `names`, `qkv` and `gate_up` for `head` (abstract or
    built), whose q/k/v projections read `qkv_in` features."""
    cfg = head.cfg
    shapes = {ckpt: tuple(_value(head, ours).shape) for ours, ckpt in names.items()}
    for name, heads in zip(qkv, (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)):
        shapes[name] = (heads * cfg.head_dim, qkv_in)
    for name in gate_up:
        shapes[name] = (cfg.intermediate_size, cfg.hidden_size)
    return shapes


def _eagle3_shapes(head: ReferenceEagle3Head) -> dict[str, tuple[int, ...]]:
    d = head.cfg.hidden_size
    shapes = _checkpoint_shapes(head, _NAMES3, _QKV3, _GATE_UP3, 2 * d)
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


def _from_checkpoint(values: dict[str, np.ndarray], names: dict[str, str], qkv: tuple[str, ...],
                     gate_up: tuple[str, ...], layer: str = "") -> dict[str, np.ndarray]:
    """Our parameters ({dotted name: array}, as `flat_params` names them) from a checkpoint's tensors; `layer` is
    the prefix of the fused projections' layer among ours ("" for a drafter of one layer, "layers.i.")."""
    ours = {name: values[ckpt] for name, ckpt in names.items()}
    ours[f"{layer}attn.qkv"] = np.concatenate([values[name] for name in qkv])  # rows [q; k; v]
    ours[f"{layer}mlp.gate_up"] = np.concatenate([values[name] for name in gate_up])  # rows [gate; up]
    return ours


def _to_checkpoint(head, names: dict[str, str], qkv: tuple[str, ...],
                   gate_up: tuple[str, ...], layer: str = "") -> dict[str, np.ndarray]:
    """The checkpoint's tensors named by `names`, `qkv` and `gate_up` from `head`'s parameters (`layer` as for
    `_from_checkpoint`)."""
    cfg = head.cfg
    ours = flat_params(nnx.state(head))
    tensors = {ckpt: ours[name] for name, ckpt in names.items()}
    h, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tensors.update(zip(qkv, np.split(ours[f"{layer}attn.qkv"], [h * hd, (h + hkv) * hd])))
    tensors.update(zip(gate_up, np.split(ours[f"{layer}mlp.gate_up"], 2)))
    return tensors


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


def _layer_config_json(cfg: ModelConfig) -> dict:
    """config.json's fields for a drafter layer of config `cfg` (a Llama layer)."""
    return {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
            "rope_theta": cfg.rope.theta, "rope_scaling": _rope_scaling(cfg.rope), "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": False, "attention_bias": False}


def _write(directory: str | Path, tensors: dict[str, np.ndarray], config: dict, dtype: str) -> Path:
    """config.json and model.safetensors in `directory`, float tensors in `dtype` ("float32", "float16" or
    "bfloat16"), integer and boolean ones as they are."""
    from safetensors.numpy import save_file

    float_type = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}.get(dtype)
    if float_type is None:
        raise ValueError(f"dtype={dtype!r} must be 'float32', 'float16' or 'bfloat16'")
    tensors = {k: np.ascontiguousarray(v, float_type if np.issubdtype(v.dtype, np.floating) else v.dtype)
               for k, v in tensors.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
    return directory


def save_reference_eagle3(directory: str | Path, head: ReferenceEagle3Head, target: Readout, *,
                          dtype: str = "float32") -> Path:
    """Write `head` to `directory` in the EAGLE-3 layout (config.json and model.safetensors); returns the directory.

    `target` is the target's readout: a drafter that shares the target's LM head (one trained here) gets a copy
    of it (over the target's draft vocabulary when the readout is restricted), as the layout needs its own.
    `dtype` "float32" (the default: loads back exactly), "float16" or "bfloat16" for the float tensors.
    """
    cfg = head.cfg
    readout = head.draft_readout(target)
    lm_head = np.asarray(readout.lm_head, np.float32)  # [D, N]
    n = lm_head.shape[1]
    ids = np.arange(n) if readout.ids is None else np.asarray(readout.ids, np.int64)
    tensors = _to_checkpoint(head, _NAMES3, _QKV3, _GATE_UP3)
    tensors["lm_head.weight"] = lm_head.T
    if head.embed is not None:
        tensors["embed_tokens.weight"] = np.asarray(head.embed[...])
    tensors["d2t"] = (ids - np.arange(n)).astype(np.int64)
    tensors["t2d"] = np.isin(np.arange(cfg.vocab_size), ids)
    config = {"architectures": [EAGLE3_ARCHITECTURES[0]], **_layer_config_json(cfg), "draft_vocab_size": n,
              "target_hidden_size": head.fc.shape[1] // len(head.feature_layers),
              "norm_before_residual": head.norm_before_residual,
              "eagle_config": {"use_aux_hidden_state": True,
                               "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.feature_layers]}}
    return _write(directory, tensors, config, dtype)


def load_reference_eagle(directory: str | Path, target: ModelConfig) -> tuple[ReferenceEagleHead, dict]:
    """(drafter, metadata) from a directory holding an EAGLE-1 drafter in its authors' layout, for a target of
    config `target`; FileError (a ValueError) naming the file and the problem for more than one layer, biases,
    another vocabulary or hidden size than the target's, missing, unexpected or misshapen tensors, non-finite
    weights."""
    directory = Path(directory)
    source = f"EAGLE drafter config {str(directory / 'config.json')!r}"
    cfg = json_object(read_json(directory / "config.json", "EAGLE drafter config"), source)
    layer = _layer_config(cfg, target, source)
    if layer.hidden_size != target.hidden_size:
        raise FileError(f"{source}: hidden_size={layer.hidden_size}, but the target's is {target.hidden_size}")
    weights = _weights(directory, "EAGLE drafter")
    tensors = {name.removeprefix("model."): name for name in weights.shapes}
    head = nnx.eval_shape(lambda: ReferenceEagleHead(layer, fc_bias="fc.bias" in tensors, rngs=nnx.Rngs(0)))
    names = {**_NAMES1, **({"fc_bias": "fc.bias"} if head.fc_bias is not None else {})}
    needed = _checkpoint_shapes(head, names, _QKV1, _GATE_UP1, layer.hidden_size)
    given = {name: weights.shapes[stored] for name, stored in tensors.items() if name not in _UNUSED1}
    check_shapes(given, needed, source=weights.source, needed="the drafter its config.json describes")
    values = {name: weights.read(tensors[name]) for name in needed}
    head = ReferenceEagleHead(layer, fc_bias=head.fc_bias is not None, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(head)
    fill_params(state, _from_checkpoint(values, names, _QKV1, _GATE_UP1), source=weights.source,
                needed="this drafter")
    meta = {"kind": "eagle", "architecture": "reference", "source": str(directory)}
    return nnx.merge(graphdef, state), meta


def save_reference_eagle(directory: str | Path, head: ReferenceEagleHead, *, dtype: str = "float32") -> Path:
    """Write `head` to `directory` in the EAGLE-1 layout (config.json and model.safetensors); returns the
    directory. `dtype` as for `save_reference_eagle3`."""
    names = {**_NAMES1, **({"fc_bias": "fc.bias"} if head.fc_bias is not None else {})}
    config = {"architectures": [EAGLE_ARCHITECTURES[0]], **_layer_config_json(head.cfg)}
    return _write(directory, _to_checkpoint(head, names, _QKV1, _GATE_UP1), config, dtype)


# --------------------------------------------------------------------------------------------
# DFlash
# --------------------------------------------------------------------------------------------


def _dflash_names(num_layers: int) -> tuple[dict[str, str], list[tuple[str, tuple[str, ...], tuple[str, ...]]]]:
    """A DFlash checkpoint's names: {our parameter: theirs} for the tensors stored one to one, and per layer its
    prefix among ours with the parts of its fused projections (q, k, v; gate, up)."""
    names = {"fc": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
    fused = []
    for i in range(num_layers):
        theirs, ours = f"layers.{i}.", f"layers.{i}."
        one_to_one, qkv, gate_up = _layer_names(theirs)
        names.update({ours + name: ckpt for name, ckpt in one_to_one.items()})
        names.update({f"{ours}input_norm.weight": f"{theirs}input_layernorm.weight",
                      f"{ours}attn.q_norm.weight": f"{theirs}self_attn.q_norm.weight",
                      f"{ours}attn.k_norm.weight": f"{theirs}self_attn.k_norm.weight"})
        fused.append((ours, qkv, gate_up))
    return names, fused


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The target layers a DFlash drafter reads when its config names none, as its authors choose them: one per
    drafter layer, evenly from layer 1 to layer L - 3 (the middle layer for a drafter of one layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 3 - 1
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _dflash_setting(cfg: dict, name: str, kind: str, source: str, default=REQUIRED):
    """A DFlash setting from `dflash_config`, where the authors' configs keep it, else from the top level."""
    inner = field(cfg, "dflash_config", "dict", source, {})
    if name in inner:
        return field(inner, name, kind, f"{source} (dflash_config)")
    return field(cfg, name, kind, source, default)


def load_reference_dflash(directory: str | Path, target: ModelConfig) -> tuple[DFlashDrafter, dict]:
    """(drafter, metadata) from a directory holding a DFlash drafter in its authors' layout (`DFlashDraftModel`:
    config.json with `dflash_config` {mask_token_id, target_layer_ids, block_size}, and model.safetensors), for a
    target of config `target`.

    Target layer ids count as jaxspec's feature layers do (id j is the output of decoder layer j). FileError (a
    ValueError) naming the file and the problem for: another architecture (DFlash2's convolutions and candidate
    selector are not run here), windowed or causal layers, biases, another vocabulary or hidden size than the
    target's, layer ids or a mask token outside the target, missing, unexpected or misshapen tensors, non-finite
    weights.
    """
    directory = Path(directory)
    source, cfg = _drafter_config(directory, "DFlash", DFLASH_ARCHITECTURES)
    if field(cfg, "attention_bias", "bool", source, False):
        raise FileError(f"{source}: field 'attention_bias' is true; this drafter's layers have no attention biases")
    if field(cfg, "is_causal", "bool", source, False) or "sliding_attention" in field(cfg, "layer_types", "list",
                                                                                       source, []):
        raise FileError(f"{source}: causal or windowed drafter layers; jaxspec runs DFlash drafters whose layers "
                        f"attend to the whole context and bidirectionally within the block")
    vocab = field(cfg, "vocab_size", "int", source)
    if vocab != target.vocab_size:
        raise FileError(f"{source}: field 'vocab_size'={vocab}, but the target has {target.vocab_size} tokens: "
                        f"this drafter was made for another model")
    layers = ModelConfig.from_hf({**{k: v for k, v in cfg.items() if k not in ("architectures", "layer_types")},
                                  "model_type": "qwen3"}, source=source)
    if layers.hidden_size != target.hidden_size:
        raise FileError(f"{source}: hidden_size={layers.hidden_size}, but the target's is {target.hidden_size}")
    ids = _dflash_setting(cfg, "target_layer_ids", "list", source, None)
    ids = dflash_layer_ids(target.num_layers, layers.num_layers) if ids is None else ids
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < target.num_layers
                          for i in ids) or len(set(ids)) != len(ids):
        raise FileError(f"{source}: target_layer_ids {describe(ids)} must be distinct decoder layers in "
                        f"[0, {target.num_layers}) of this {target.num_layers}-layer target")
    mask = _dflash_setting(cfg, "mask_token_id", "int", source)
    if not 0 <= mask < target.vocab_size:
        raise FileError(f"{source}: mask_token_id={mask} is not a token of the target, in [0, {target.vocab_size})")
    block = _dflash_setting(cfg, "block_size", "int", source, DFLASH_BLOCK)
    if block < 2:
        raise FileError(f"{source}: block_size={block} must be >= 2")

    def build():
        return DFlashDrafter(target, tuple(ids), num_layers=layers.num_layers, block_size=block, mask_token_id=mask,
                             layers=layers, rngs=nnx.Rngs(0))

    weights = _weights(directory, "DFlash drafter")
    tensors = {name.removeprefix("model."): name for name in weights.shapes}
    abstract = nnx.eval_shape(build)
    names, fused = _dflash_names(layers.num_layers)
    needed = {ckpt: tuple(_value(abstract, ours).shape) for ours, ckpt in names.items()}
    for _, qkv, gate_up in fused:
        needed.update(_checkpoint_shapes(abstract, {}, qkv, gate_up, layers.hidden_size))
    check_shapes({name: weights.shapes[stored] for name, stored in tensors.items()}, needed,
                 source=weights.source, needed="the drafter its config.json describes")
    values = {name: weights.read(tensors[name]) for name in needed}
    ours: dict[str, np.ndarray] = {}
    for prefix, qkv, gate_up in fused:
        ours.update(_from_checkpoint(values, {}, qkv, gate_up, layer=prefix))
    ours.update({name: values[ckpt] for name, ckpt in names.items()})
    graphdef, state = nnx.split(build())
    fill_params(state, ours, source=weights.source, needed="this drafter")
    meta = {"kind": "dflash", "architecture": "reference", "feature_layers": list(ids), "source": str(directory),
            "num_layers": layers.num_layers, "block_size": block, "mask_token_id": mask}
    return nnx.merge(graphdef, state), meta


def save_reference_dflash(directory: str | Path, drafter: DFlashDrafter, target: ModelConfig, *,
                          dtype: str = "float32") -> Path:
    """Write `drafter` to `directory` in its authors' DFlash layout (config.json and model.safetensors), for a
    target of config `target`; returns the directory. `dtype` as for `save_reference_eagle3`."""
    cfg = drafter.cfg
    names, fused = _dflash_names(drafter.num_layers)
    tensors: dict[str, np.ndarray] = {}
    for prefix, qkv, gate_up in fused:
        tensors.update(_to_checkpoint(drafter, {}, qkv, gate_up, layer=prefix))
    ours = flat_params(nnx.state(drafter))
    tensors.update({ckpt: ours[name] for name, ckpt in names.items()})
    settings = {"block_size": drafter.block_size, "mask_token_id": drafter.mask_token_id,
                "target_layer_ids": list(drafter.feature_layers)}
    config = {**_layer_config_json(cfg), "architectures": [DFLASH_ARCHITECTURES[0]], "model_type": "qwen3",
              "num_hidden_layers": drafter.num_layers, "num_target_layers": target.num_layers,
              "block_size": drafter.block_size, "is_causal": False, "dflash_config": settings}
    return _write(directory, tensors, config, dtype)


__all__ = ["DFLASH_ARCHITECTURES", "EAGLE3_ARCHITECTURES", "EAGLE_ARCHITECTURES", "default_layer_ids",
           "dflash_layer_ids", "drafter_kind", "load_reference_dflash", "load_reference_drafter",
           "load_reference_eagle", "load_reference_eagle3", "save_reference_dflash", "save_reference_eagle",
           "save_reference_eagle3"]
