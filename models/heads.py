"""Trained drafters that read the target's own features: Medusa heads and the EAGLE head (docs/concepts/proposers.md).

Both reuse the target's token embedding and LM head (frozen, never copied): a head predicts *features*, and
`Readout` turns features into logits exactly as the target does. So a head is small (Medusa: M residual
blocks of D x D; EAGLE: one fc plus one decoder layer) and ships inside the repository.

- `MedusaHeads`: head i maps the target's final hidden state h_t to h_t + SiLU(W_i h_t + b_i), whose logits
  under the target's LM head predict token t + 2 + i (the target's own head predicts t + 1). W_i starts at
  zero, so an untrained head is the target's next-token predictor (as in the Medusa paper). Sharing the LM
  head instead of training one [D, V] projection per head (28M parameters each for SmolLM2) keeps the heads
  at 0.3M parameters each: trainable on a small CPU and small enough to commit.
- `EagleHead`: at position i it fuses the target's feature f_i with the embedding of token x_{i+1} (fc on the
  concatenation), runs one decoder layer (its own KV cache over earlier positions) and a norm, and predicts
  f_{i+1}; the LM head turns that into the distribution of x_{i+2}. Drafting feeds its own predictions back.
- `Eagle3Head` (EAGLE-3): the same layer, but the target's feature at i is the fusion of three of its decoder
  layers' outputs (low, middle, high: `eagle3_layers`), each RMS-normed and projected together to D. Its output
  is not regressed onto any target feature: it is trained only to predict tokens, through steps 2..N of its
  own drafting as well ("training-time test"), and fed back as the next step's feature.
- `ReferenceEagleHead`, `ReferenceEagle3Head`: the EAGLE authors' EAGLE-1 and EAGLE-3 drafters, whose
  checkpoints vLLM and SGLang serve (`jaxspec.models.eagle_files` reads and writes their layout); trainable here.

Heads are saved as one safetensors file (float16, half the bytes; the maths runs in float32) plus JSON
metadata, and the ones trained for a named model are found by name (`named_head_path`). A frequency ranking of
the target's tokens (`save_draft_vocab`, made by `python -m jaxspec.train.draft_vocab`) lets a head draft over
its first N ids only (`Readout.restrict`): the LM head then costs N / V of a full pass.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.target import check_config, check_readout

from .config import ModelConfig
from .dflash import DFLASH_BLOCK, DFlashDrafter
from .files import REQUIRED, FileError, SafetensorsFile, describe, field, json_object, read_json
from .llama import MLP, Attention, DecoderLayer, RMSNorm, _dense_init, visibility_mask
from .rope import rope_tables

HeadKind = Literal["medusa", "eagle", "eagle3", "dflash"]
WEIGHTS_DIR = Path(__file__).parent / "weights"  # shipped heads: <model>.<kind>.safetensors (+ .json)


@flax.struct.dataclass
class Readout:
    """The target's token embedding and LM head, the two ends every head shares with it (no copies).

    A drafting readout may score only a draft vocabulary (`restrict`): the N most frequent target tokens
    (FR-Spec; EAGLE-3's draft-to-target map). Its LM head is then the N matching columns, logits and top-k
    indices run over those N, and `token_ids` maps an index back to the target's id.
    """

    embed: jax.Array  # [V, D]
    lm_head: jax.Array  # [D, V], or [D, N] over a draft vocabulary
    ids: jax.Array | None = None  # i32[N] the target id of each lm_head column; None: column j is id j
    # [D] the scale of an RMS norm applied to features before the LM head: set for a drafter whose features are
    # its residual stream before the final norm (an EAGLE-3 drafter in its authors' layout), None for features
    # that are already normed, as the target's final hidden states are.
    norm: jax.Array | None = None
    norm_eps: float = flax.struct.field(pytree_node=False, default=1e-6)

    @classmethod
    def of(cls, target_params) -> "Readout":
        """From a target's nnx state (`LanguageModel.params`): its `embed` [V, D] and `lm_head` [D, V]
        (`jaxspec.target.HeadTarget`); ValueError naming what it lacks."""
        check_readout(target_params)
        return cls(embed=target_params["embed"][...], lm_head=target_params["lm_head"][...])

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """[..., D] for i32[...] (negative ids, e.g. -1 padding, read row 0: callers mask them)."""
        return jnp.take(self.embed, jnp.maximum(tokens, 0), axis=0)

    def logits(self, features: jax.Array) -> jax.Array:
        """f32[..., V] (f32[..., N] when restricted) from features [..., D], as the target's own LM head computes
        them."""
        rows = features.reshape(-1, features.shape[-1])
        if self.norm is not None:
            rows = rows.astype(jnp.float32)
            rows = rows * jax.lax.rsqrt(jnp.mean(rows * rows, axis=-1, keepdims=True) + self.norm_eps) * self.norm
        out = jnp.dot(rows, self.lm_head, preferred_element_type=jnp.float32)
        return out.reshape(features.shape[:-1] + (out.shape[-1],))

    def restrict(self, ids) -> "Readout":
        """This readout scoring only the target tokens `ids` (i32[N], distinct, in [0, V)): its LM head becomes
        their columns [D, N], in that order. The embedding stays whole: drafted ids are fed back as target ids."""
        ids = jnp.asarray(ids, jnp.int32)
        return self.replace(lm_head=jnp.take(self.lm_head, ids, axis=1), ids=ids)

    def token_ids(self, index: jax.Array) -> jax.Array:
        """i32[...] target ids of logits columns `index` i32[...] (the identity over the full vocabulary)."""
        return index if self.ids is None else jnp.take(self.ids, index)

    def full_vocab(self, probs: jax.Array) -> jax.Array:
        """f32[..., V] from a distribution over the logits columns f32[..., N]: each column's mass at its target
        id, exactly zero at every id outside the draft vocabulary (the probability the draft gives it)."""
        if self.ids is None:
            return probs
        full = jnp.zeros(probs.shape[:-1] + (self.embed.shape[0],), probs.dtype)
        return full.at[..., self.ids].set(probs, unique_indices=True)


class MedusaHeads(nnx.Module):
    def __init__(self, cfg: ModelConfig, num_heads: int, *, rngs: nnx.Rngs | None = None):
        if num_heads < 1:
            raise ValueError(f"num_heads={num_heads!r} must be >= 1")
        d = cfg.hidden_size
        self.num_heads = num_heads
        # Zero weights: each head starts as the target's next-token predictor and learns its offset.
        self.w = nnx.Param(jnp.zeros((num_heads, d, d), jnp.float32))  # [M, D_out, D_in]
        self.b = nnx.Param(jnp.zeros((num_heads, d), jnp.float32))  # [M, D]

    def draft_readout(self, target: Readout) -> Readout:
        """The readout the heads' features are scored through: the target's `target`, as it is."""
        return target

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Features [..., M, D] from the target's final hidden states [..., D]."""
        h = hidden.astype(jnp.float32)
        pre = jnp.einsum("mod,...d->...mo", self.w[...], h) + self.b[...]
        return h[..., None, :] + jax.nn.silu(pre)


class EagleHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = _dense_init(rngs, (d, 2 * d), jnp.float32)  # [D, 2D]: [embedding; feature] -> D
        self.fc_bias = nnx.Param(jnp.zeros((d,), jnp.float32))
        # A Llama decoder layer whatever the target's own layers add (Qwen3's q/k norms, Mistral's window), as
        # EAGLE's and SpecForge's drafters for those targets are.
        self.layer = DecoderLayer(dataclasses.replace(cfg.llama_layers(), dtype="float32"), rngs)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)

    feature_layers: tuple[int, ...] = ()  # () : the head reads the target's final hidden state

    def target_features(self, features: jax.Array) -> jax.Array:
        """The feature [..., D] the head reads at a committed position from what the target gives there: its
        final hidden state [..., D], as it is."""
        return features

    def draft_readout(self, target: Readout) -> Readout:
        """The readout this head's outputs are scored and its tokens embedded through: the target's `target`
        (whole, or restricted to a draft vocabulary), since the head predicts the target's normed features."""
        return target

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.create(num_layers=1, batch=batch, num_kv_heads=cfg.num_kv_heads, max_len=max_len,
                              head_dim=cfg.head_dim, dtype=jnp.float32)

    def __call__(
        self,
        embeds: jax.Array,  # [B, T, D]  embeddings of tokens x_{i+1}
        features: jax.Array,  # [B, T, D]  features f_i (the target's, or the head's own predictions)
        positions: jax.Array,  # i32[B, T]  rotary positions i
        cache: KVCache,  # one layer; slots below `cache.lengths` are the committed positions
        *,
        write_at: jax.Array | None = None,  # i32[B]  first slot of the T new entries (default cache.lengths)
        visible: jax.Array | None = None,  # bool[B, T, S]  default: committed prefix + causal among the new
    ) -> tuple[jax.Array, KVCache]:
        """Predicted next features [B, T, D] and the cache with the new K/V written (lengths not advanced).

        Tree drafting writes each level's nodes at `write_at` past the committed slots and passes its own
        `visible` (prefix plus each node's ancestors), so one cache serves chains, trees and training.
        """
        B, T, D = embeds.shape
        write_at = cache.lengths if write_at is None else write_at
        if visible is None:
            visible = visibility_mask(write_at, T, cache.max_len)
        x = jnp.concatenate([embeds, features], axis=-1).astype(jnp.float32)  # [B, T, 2D]
        x = jnp.einsum("bti,oi->bto", x, self.fc[...]) + self.fc_bias[...]  # [B, T, D]
        cos, sin = rope_tables(positions, self.cfg.rope, self.cfg.head_dim)
        x, k, v = self.layer(x, cos, sin, cache.k[0], cache.v[0], write_at, visible, "xla", None)
        return self.norm(x), cache.replace(k=(k,), v=(v,))


class ReferenceEagleHead(EagleHead):
    """The EAGLE authors' EAGLE-1 drafter (vLLM's `EagleLlamaForCausalLM`), so their checkpoints run here and heads
    trained here run there (`jaxspec.models.eagle_files`).

    Where `EagleHead` norms the layer's input and its output, this drafter feeds fc's output (with a bias where the
    checkpoint has one) straight into attention and returns the residual stream unnormed: its output predicts the
    target's normed final feature, scored by the target's own LM head.
    """

    def __init__(self, cfg: ModelConfig, *, fc_bias: bool = True, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = dataclasses.replace(cfg.llama_layers(), dtype="float32")
        self.fc = _dense_init(rngs, (d, 2 * d), jnp.float32)  # [D, 2D]: [embedding; feature] -> D
        self.fc_bias = nnx.Param(jnp.zeros((d,), jnp.float32)) if fc_bias else None
        self.attn = Attention(self.cfg, rngs)
        self.post_attention_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.mlp = MLP(self.cfg, rngs)

    def __call__(self, embeds, features, positions, cache: KVCache, *, write_at=None, visible=None):
        """As `EagleHead.__call__`: the predicted next features [B, T, D] and the cache with the new K/V."""
        B, T, D = embeds.shape
        write_at = cache.lengths if write_at is None else write_at
        if visible is None:
            visible = visibility_mask(write_at, T, cache.max_len)
        x = jnp.concatenate([embeds, features], axis=-1).astype(jnp.float32)  # [B, T, 2D]
        x = jnp.einsum("bti,oi->bto", x, self.fc[...])  # [B, T, D]
        if self.fc_bias is not None:
            x = x + self.fc_bias[...]
        cos, sin = rope_tables(positions, self.cfg.rope, self.cfg.head_dim)
        attn_out, k, v = self.attn(x, cos, sin, cache.k[0], cache.v[0], write_at, visible, "xla", None)
        x = x + attn_out
        return x + self.mlp(self.post_attention_norm(x)), cache.replace(k=(k,), v=(v,))


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """The decoder layers (0-based) whose outputs an EAGLE-3 head fuses for an L-layer target: EAGLE-3's low,
    middle and high choice, layers 2, L // 2 and L - 3 (clipped into range, and fewer when they coincide, for very
    shallow test models)."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be >= 1")
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2 if num_layers > 1 else 0, max(num_layers - 3, 0)}))


class Eagle3Head(EagleHead):
    def __init__(self, cfg: ModelConfig, feature_layers: tuple[int, ...], *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        if not feature_layers or any(not 0 <= i < cfg.num_layers for i in feature_layers):
            raise ValueError(f"feature_layers={feature_layers!r} must name decoder layers of this "
                             f"{cfg.num_layers}-layer model")
        d, n = cfg.hidden_size, len(feature_layers)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        # Each layer's output is RMS-normed on its own first: the residual stream grows with depth (SmolLM2-135M
        # on held-out text: median RMS 3.3, 7.1 and 26 at layers 2, 15 and 27, single coordinates up to ~24,000),
        # so in a raw concatenation the deepest layer's scale would dominate.
        self.fuse_norm = nnx.Param(jnp.ones((n, d), jnp.float32))  # [L, D] each layer's norm scale
        self.fuse = _dense_init(rngs, (d, n * d), jnp.float32)  # [D, L*D]

    def target_features(self, features: jax.Array) -> jax.Array:
        """The fused feature [..., D] from the target's chosen layers' outputs, concatenated [..., L*D]."""
        n, d = self.fuse_norm.shape
        x = features.astype(jnp.float32).reshape(features.shape[:-1] + (n, d))
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps) * self.fuse_norm[...]
        rows = x.reshape(-1, n * d)
        return (rows @ self.fuse[...].T).reshape(features.shape[:-1] + (d,))


class ReferenceEagle3Head(nnx.Module):
    """The EAGLE-3 authors' drafter (`LlamaForCausalLMEagle3`, as SpecForge trains it and vLLM and SGLang serve
    it), so its checkpoints run here and heads trained here run there (`jaxspec.models.eagle_files`).

    Where `Eagle3Head` normalises each target layer and fuses [embedding; feature] before a standard decoder layer,
    this drafter projects the raw concatenated layers (`fc`, no bias), and its one layer attends over
    [input_norm(embedding); hidden_norm(feature)] (2D wide) while its residual stream is the feature itself
    (`norm_before_residual`: the normed feature). Its output, fed back as the next step's feature, is that
    residual stream before the final norm; the norm belongs to its readout (`draft_readout`), which scores the
    draft's own LM head over its draft vocabulary (`lm_head`, `ids`), or the target's when it has none.
    """

    feature_layers: tuple[int, ...]

    def __init__(self, cfg: ModelConfig, feature_layers: tuple[int, ...], *, target_hidden: int,
                 draft_vocab: int | None = None, own_embedding: bool = False, norm_before_residual: bool = False,
                 rngs: nnx.Rngs):
        """`cfg`: the drafter layer's own config (its vocab_size the target's); `target_hidden`: the target's
        width D_t; `draft_vocab` N: an LM head of its own over N target ids (None: the target's is used);
        `own_embedding`: a token embedding of its own (else the target's)."""
        if not feature_layers:
            raise ValueError("feature_layers must name at least one target layer")
        d, n = cfg.hidden_size, len(feature_layers)
        self.cfg = dataclasses.replace(cfg.llama_layers(), dtype="float32")
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.norm_before_residual = norm_before_residual
        self.fc = _dense_init(rngs, (d, n * target_hidden), jnp.float32)  # [D, L*D_t]
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)  # the token embedding's
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)  # the feature's
        self.attn = Attention(self.cfg, rngs, in_features=2 * d)
        self.post_attention_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.mlp = MLP(self.cfg, rngs)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.lm_head = None if draft_vocab is None else _dense_init(rngs, (d, draft_vocab), jnp.float32)  # [D, N]
        # i32[N] the target id of each lm_head column (the checkpoints' d2t map, added to the column index).
        self.ids = None if draft_vocab is None else nnx.Variable(jnp.arange(draft_vocab, dtype=jnp.int32))
        self.embed = _dense_init(rngs, (cfg.vocab_size, d), jnp.float32) if own_embedding else None  # [V, D]

    def target_features(self, features: jax.Array) -> jax.Array:
        """The feature [..., D] from the target's chosen layers' outputs, concatenated [..., L*D_t]."""
        rows = features.astype(jnp.float32).reshape(-1, features.shape[-1])
        return (rows @ self.fc[...].T).reshape(features.shape[:-1] + (self.fc.shape[0],))

    def draft_readout(self, target: Readout) -> Readout:
        """This drafter's readout: its final norm, then its own LM head and ids (or the target's), and its own
        token embedding (or the target's)."""
        readout = target.replace(norm=self.norm.weight[...], norm_eps=self.norm.eps)
        if self.lm_head is not None:
            readout = readout.replace(lm_head=self.lm_head[...], ids=self.ids[...])
        if self.embed is not None:
            readout = readout.replace(embed=self.embed[...])
        return readout

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.create(num_layers=1, batch=batch, num_kv_heads=cfg.num_kv_heads, max_len=max_len,
                              head_dim=cfg.head_dim, dtype=jnp.float32)

    def __call__(self, embeds, features, positions, cache: KVCache, *, write_at=None, visible=None):
        """As `EagleHead.__call__`: embeds and features [B, T, D], positions i32[B, T]; returns the next features
        [B, T, D] (the residual stream before the final norm) and the cache with the new K/V written."""
        B, T, D = embeds.shape
        write_at = cache.lengths if write_at is None else write_at
        if visible is None:
            visible = visibility_mask(write_at, T, cache.max_len)
        feature = features.astype(jnp.float32)
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature  # [B, T, D]
        x = jnp.concatenate([self.input_norm(embeds.astype(jnp.float32)), normed], axis=-1)  # [B, T, 2D]
        cos, sin = rope_tables(positions, self.cfg.rope, self.cfg.head_dim)
        attn_out, k, v = self.attn(x, cos, sin, cache.k[0], cache.v[0], write_at, visible, "xla", None)
        residual = residual + attn_out
        return residual + self.mlp(self.post_attention_norm(residual)), cache.replace(k=(k,), v=(v,))


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------


# An EAGLE or EAGLE-3 head's architecture: jaxspec's own (EagleHead, Eagle3Head), or the EAGLE authors' drafter in
# the layout vLLM and SGLang load (ReferenceEagleHead, ReferenceEagle3Head).
HEAD_ARCHITECTURES = ("jaxspec", "reference")


def new_head(kind: HeadKind, cfg: ModelConfig, *, num_heads: int = 4, seed: int = 0,
             feature_layers: tuple[int, ...] | None = None, architecture: str = "jaxspec", num_layers: int = 2,
             block_size: int = DFLASH_BLOCK, mask_token_id: int | None = None):
    """A freshly initialised head of `kind` for a target of config `cfg` (ValueError naming a field it lacks).
    An eagle3 head and a dflash drafter read `feature_layers` (default `eagle3_layers(cfg.num_layers)`). An eagle
    or eagle3 head's `architecture` is jaxspec's own ("jaxspec": `EagleHead`, `Eagle3Head`) or the EAGLE authors'
    ("reference": `ReferenceEagleHead`, `ReferenceEagle3Head`, sharing the target's LM head). A dflash drafter
    (`DFlashDrafter`) has `num_layers` decoder layers, drafts blocks of `block_size` (the anchor and
    block_size - 1 masks) and fills mask positions with the embedding of `mask_token_id` (default the last id of
    the target's vocabulary, a rare token)."""
    if architecture not in HEAD_ARCHITECTURES or (architecture != "jaxspec" and kind in ("medusa", "dflash")):
        raise ValueError(f"architecture={architecture!r} must be one of {HEAD_ARCHITECTURES} for an eagle or eagle3 "
                         f"head, 'jaxspec' for medusa and dflash")
    if kind == "dflash":
        check_config(cfg, "dflash")
        layers = eagle3_layers(cfg.num_layers) if feature_layers is None else tuple(feature_layers)
        mask = cfg.vocab_size - 1 if mask_token_id is None else mask_token_id
        return DFlashDrafter(cfg, layers, num_layers=num_layers, block_size=block_size, mask_token_id=mask,
                             rngs=nnx.Rngs(seed))
    if kind == "medusa":
        check_config(cfg, "medusa")  # the heads are sized from cfg.hidden_size
        return MedusaHeads(cfg, num_heads)
    if kind == "eagle":
        check_config(cfg, "eagle")  # the head is a Llama decoder layer sized from the target's config
        return (ReferenceEagleHead if architecture == "reference" else EagleHead)(cfg, rngs=nnx.Rngs(seed))
    if kind == "eagle3":
        check_config(cfg, "eagle3")
        layers = eagle3_layers(cfg.num_layers) if feature_layers is None else tuple(feature_layers)
        if architecture == "reference":
            return ReferenceEagle3Head(cfg, layers, target_hidden=cfg.hidden_size, rngs=nnx.Rngs(seed))
        return Eagle3Head(cfg, layers, rngs=nnx.Rngs(seed))
    raise ValueError(f"head kind={kind!r} must be one of {HEAD_KINDS}")


def _weights_file(path: str | Path) -> Path:
    """`path` ending in .safetensors, appended (not substituted: "smollm2-135m.eagle" keeps its ".eagle")."""
    path = Path(path)
    return path if path.suffix == ".safetensors" else path.with_name(path.name + ".safetensors")


def flat_params(state: nnx.State) -> dict[str, np.ndarray]:
    """A head's state as {dotted parameter name: array}, the names its files use."""
    return {".".join(map(str, path)): np.asarray(v[...] if hasattr(v, "get_value") else v)
            for path, v in nnx.to_flat_state(state)}


def _flat(state: nnx.State) -> dict[str, Any]:
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


def check_shapes(given: dict[str, tuple[int, ...]], needed_shapes: dict[str, tuple[int, ...]], *, source: str,
                 needed: str) -> None:
    """ValueError naming `source` and the parameters missing from `given`, unexpected in it, or of other shapes
    than `needed` (a description of the head) has."""
    if set(given) != set(needed_shapes):
        raise ValueError(f"{source} does not fit {needed}: missing {sorted(set(needed_shapes) - set(given))}, "
                         f"unexpected {sorted(set(given) - set(needed_shapes))}")
    shapes = {name: (given[name], shape) for name, shape in needed_shapes.items() if given[name] != shape}
    if shapes:
        raise ValueError(f"{source}: parameters of other shapes than {needed} has, as (given, needed): "
                         f"{describe(shapes, 400)}")


def fill_params(state: nnx.State, values: dict[str, Any], *, source: str, needed: str) -> None:
    """Write `values` ({dotted name: array}, as `flat_params` gives) into `state` in place, as copies of the
    state's dtypes (float32 weights, integer id maps); ValueError naming `source` and the names missing,
    unexpected or of other shapes than `needed` has."""
    flat = _flat(state)
    check_shapes({name: tuple(v.shape) for name, v in values.items()},
                 {name: tuple(var.get_value().shape) for name, var in flat.items()}, source=source, needed=needed)
    for name, var in flat.items():  # the state's values may be abstract (`nnx.eval_shape`): only shape and dtype
        # A copy: a train step donates its state's buffers.
        var.set_value(jnp.array(values[name], var.get_value().dtype))


def save_head(path: str | Path, head, *, kind: HeadKind, metadata: dict[str, Any] | None = None) -> Path:
    """Write `head`'s parameters (float16) to `path` (.safetensors) and its metadata next to it (.json)."""
    from safetensors.numpy import save_file

    path = _weights_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(head)
    save_file({k: v.astype(np.float16) for k, v in flat_params(state).items()}, str(path))
    meta = {"kind": kind, "num_heads": getattr(head, "num_heads", None), **(metadata or {})}
    if getattr(head, "feature_layers", ()):
        meta["feature_layers"] = list(head.feature_layers)
    if isinstance(head, DFlashDrafter):
        meta.update(num_layers=head.num_layers, block_size=head.block_size, mask_token_id=head.mask_token_id)
    if isinstance(head, ReferenceEagle3Head) and (head.lm_head is not None or head.embed is not None
                                                  or head.norm_before_residual):
        raise ValueError("a drafter with its own LM head or embedding is saved in its authors' layout "
                         "(jaxspec.models.eagle_files.save_reference_eagle3)")
    if isinstance(head, (ReferenceEagleHead, ReferenceEagle3Head)):
        meta["architecture"] = "reference"
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return path


HEAD_KINDS = ("medusa", "eagle", "eagle3", "dflash")


def _head_settings(meta: Any, cfg: ModelConfig, source: str) -> tuple[HeadKind, dict[str, Any]]:
    """(kind, the settings `new_head` builds it with) from a head's metadata, each field checked for this
    target."""
    meta = json_object(meta, source)
    kind = field(meta, "kind", "str", source)
    if kind not in HEAD_KINDS:
        raise FileError(f"{source}: field 'kind'={describe(kind)} must be one of {HEAD_KINDS}")
    num_heads = field(meta, "num_heads", "int", source, None if kind != "medusa" else REQUIRED)
    if kind == "medusa" and num_heads < 1:
        raise FileError(f"{source}: field 'num_heads'={num_heads} must be >= 1")
    layers = field(meta, "feature_layers", "list", source, None)
    if kind in ("eagle3", "dflash") and layers is not None:
        if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.num_layers
                                 for i in layers) or len(set(layers)) != len(layers):
            raise FileError(f"{source}: field 'feature_layers' must list distinct decoder layers of this "
                            f"{cfg.num_layers}-layer model; got {describe(layers)}")
        layers = tuple(layers)
    architecture = field(meta, "architecture", "str", source, "jaxspec")
    if architecture not in HEAD_ARCHITECTURES or (architecture != "jaxspec" and kind in ("medusa", "dflash")):
        raise FileError(f"{source}: field 'architecture'={describe(architecture)} must be one of "
                        f"{HEAD_ARCHITECTURES} for an eagle or eagle3 head, absent for medusa and dflash")
    settings = {"num_heads": num_heads if kind == "medusa" else 1, "architecture": architecture,
                "feature_layers": layers if kind in ("eagle3", "dflash") else None}
    if kind == "dflash":
        for name, low, high in (("num_layers", 1, None), ("block_size", 2, None),
                                ("mask_token_id", 0, cfg.vocab_size - 1)):
            value = field(meta, name, "int", source)
            if value < low or (high is not None and value > high):
                raise FileError(f"{source}: field {name!r}={value} must be in [{low}, {high or 'inf'}]")
            settings[name] = value
    return kind, settings


def load_head(path: str | Path, cfg: ModelConfig):
    """(head module, metadata) from a file written by `save_head`, for a target of config `cfg`.

    `path` is the .safetensors file (or its name without the suffix); its metadata is the .json beside it.
    Everything is checked before the head is built: a missing file, bad JSON (with its position), a missing or
    mistyped field (`kind`, Medusa's `num_heads`, EAGLE-3's `feature_layers`), parameters missing, unexpected or
    of other shapes than this target's head needs (compared from the file's header, so nothing is allocated for
    a corrupt one), a truncated file, non-float dtypes and NaN or infinite values each raise a ValueError
    (`jaxspec.models.files.FileError`) naming the file and the problem.
    """
    path = _weights_file(path)
    if not path.exists():
        raise FileError(f"head file {str(path)!r} does not exist")
    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        raise FileError(f"head metadata {str(meta_path)!r} does not exist (save_head writes it beside "
                        f"{path.name!r})")
    meta = read_json(meta_path, "head metadata")
    kind, settings = _head_settings(meta, cfg, f"head metadata {str(meta_path)!r}")
    weights = SafetensorsFile(path, "head file")
    weights.check_float()
    needed = f"a {kind} head for this model (hidden_size={cfg.hidden_size}"
    needed += f", num_heads={settings['num_heads']})" if kind == "medusa" else ")"
    def build():
        return new_head(kind, cfg, **settings)

    abstract = nnx.eval_shape(build)
    shapes = {name: tuple(var.get_value().shape) for name, var in _flat(nnx.state(abstract)).items()}
    check_shapes(weights.shapes, shapes, source=weights.source, needed=needed)
    values = {name: weights.read(name) for name in shapes}
    graphdef, state = nnx.split(abstract)  # every variable comes from the file: nothing to draw at random first
    fill_params(state, values, source=weights.source, needed=needed)
    return nnx.merge(graphdef, state), meta


def named_head_path(model_name: str, kind: HeadKind) -> Path:
    """The shipped head of `kind` for the named model; ValueError naming what exists when there is none."""
    path = WEIGHTS_DIR / f"{model_name}.{kind}.safetensors"
    if not path.exists():
        shipped = sorted(p.name for p in WEIGHTS_DIR.glob("*.safetensors")) if WEIGHTS_DIR.exists() else []
        raise ValueError(f"no shipped {kind} head for model {model_name!r} (shipped: {shipped}); "
                         f"train one with `python -m jaxspec.train.{kind}` and pass its path")
    return path


# --------------------------------------------------------------------------------------------
# draft vocabularies
# --------------------------------------------------------------------------------------------

DRAFT_VOCAB_KIND = "draft_vocab"  # the `kind` a draft-vocabulary file declares
DRAFT_VOCAB_SUFFIX = ".draft_vocab.json"


def save_draft_vocab(path: str | Path, ids, *, vocab_size: int, metadata: dict[str, Any] | None = None) -> Path:
    """Write a ranking of target token ids (most useful first; distinct, in [0, vocab_size)) and how it was made.

    The metadata is indented for reading; the ids go on one line (a whole vocabulary is ~50k of them).
    """
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    _check_ranking(ids, vocab_size, str(path))
    head = {"kind": DRAFT_VOCAB_KIND, "vocab_size": int(vocab_size), "num_ids": len(ids), **(metadata or {})}
    text = json.dumps(head, indent=2)
    text = text[: text.rindex("}")].rstrip() + ',\n  "ids": ' + json.dumps(ids, separators=(",", ":")) + "\n}\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _check_ranking(ids: list[int], vocab_size: int, where: str) -> None:
    if not ids:
        raise ValueError(f"draft vocabulary {where!r} holds no token ids")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise ValueError(f"draft vocabulary {where!r} holds token id {bad} outside [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"draft vocabulary {where!r} repeats token ids: each column must map to its own id")


def read_vocab_file(path: Path, kind: str, vocab_size: int, field: str, *, what: str, writer: str) -> dict:
    """The JSON object of a file declaring `kind`, made for `vocab_size` tokens, whose `field` is a list (the
    shipped files beside the heads); ValueError naming the file when it cannot be read, is of another kind (made
    by `python -m <writer>`, it names), or was made for another vocabulary size."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {e}") from e
    if not isinstance(data, dict) or data.get("kind") != kind or not isinstance(data.get(field), list):
        raise ValueError(f"{str(path)!r} is not a {what} (python -m {writer} writes them)")
    if data.get("vocab_size") != vocab_size:
        raise ValueError(f"{what} {str(path)!r} was made for vocab_size={data.get('vocab_size')!r}; "
                         f"this model has {vocab_size}")
    return data


def load_draft_vocab(path: str | Path, vocab_size: int) -> np.ndarray:
    """i32[R] the ranked target ids of a file written by `save_draft_vocab`, for a target of `vocab_size`
    tokens; ValueError when it was made for another vocabulary size or is malformed."""
    path = Path(path)
    ids = read_vocab_file(path, DRAFT_VOCAB_KIND, vocab_size, "ids", what="draft vocabulary",
                          writer="jaxspec.train.draft_vocab")["ids"]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"draft vocabulary {str(path)!r}: ids must be integers")
    _check_ranking(ids, vocab_size, str(path))
    return np.asarray(ids, np.int32)


def draft_vocab_path(head_file: str | Path, model_name: str) -> Path:
    """The ranking a head drafts over with `SpecConfig(draft_vocab=N)`: `<head>.draft_vocab.json` beside the
    head file when there is one (your own head), else the one shipped for the named model
    (models/weights/<model>.draft_vocab.json); ValueError naming both when neither exists."""
    beside = _weights_file(head_file).with_suffix(DRAFT_VOCAB_SUFFIX)
    if beside.exists():
        return beside
    shipped = WEIGHTS_DIR / f"{model_name}{DRAFT_VOCAB_SUFFIX}"
    if Path(model_name).name == model_name and shipped.exists():  # a model loaded from a path has no shipped one
        return shipped
    raise ValueError(f"draft_vocab needs a token ranking: none beside the head ({str(beside)!r}) and none shipped "
                     f"for model {model_name!r}; write one with `python -m jaxspec.train.draft_vocab --model ... "
                     f"--out {str(beside)}`")
