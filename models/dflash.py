"""DFlash: a block drafter that predicts K tokens in one forward, conditioned on the target's hidden states.

DFlash ("Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036) drafts a whole block at once: the
newest committed token (the anchor) followed by K mask tokens, at positions n .. n + K, runs through a few
decoder layers that attend bidirectionally within the block and to a context built from the target's own
hidden states at every committed position; the output at block position i (1..K) is scored by the target's LM
head as the draft for position n + i. Its cost is one fixed-shape forward of K + 1 positions whatever K is:
no loop, which on an accelerator is one launch sequence instead of K.

The context is the outputs of a few target layers (low to high, as EAGLE-3 reads them) concatenated and projected
to D (`fc`, then `hidden_norm`): c_j for each committed position j. In every layer the block's queries attend to
the keys and values of the context (that layer's k/v projections of c_j, rotated at position j) and of the block
itself (of the block's own normed hidden states); context keys never change once written, so each layer keeps
them in a KV cache over the committed positions, advanced after every verification. The architecture and
parameter names follow the authors' Qwen3-style drafter (q/k norms, SwiGLU), so their checkpoints load
(`jaxspec.models.eagle_files`) and drafters trained here export to their layout.

The mask token is one of the target's own token ids (`mask_token_id`): its embedding, frozen like the rest of
the target's, is what the block's mask positions read, as in the authors' drafters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache, write_new

from .config import ModelConfig
from .llama import MLP, Attention, RMSNorm, _dense_init
from .rope import rope_tables

DFLASH_BLOCK = 16  # anchor + 15 masks: the authors' "b16" drafters, and verify width 16


def drafter_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The decoder-layer config of a DFlash drafter for a target of config `cfg`: the target's widths and rotary
    settings, `num_layers` full-attention layers with per-head q/k norms (the authors' Qwen3 layer), float32."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be >= 1")
    return dataclasses.replace(cfg.llama_layers(), num_layers=num_layers, qk_norm=True, dtype="float32",
                               attention_bias=False)


class DFlashLayer(nnx.Module):
    """A pre-norm decoder layer whose queries come from the block and whose keys and values come from the
    context (cached) and the block."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.attn = Attention(cfg, rngs)
        self.post_attention_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, k_cache, v_cache, write_at, visible):
        """x [B, T, D] block hidden states -> [B, T, D], and the caches with the block's K/V written at
        `write_at` i32[B] (scratch slots past the committed ones); `visible` bool[B, T, S]."""
        attn_out, k_cache, v_cache = self.attn(self.input_norm(x), cos, sin, k_cache, v_cache, write_at, visible,
                                               "xla", None)
        x = x + attn_out
        return x + self.mlp(self.post_attention_norm(x)), k_cache, v_cache


class DFlashDrafter(nnx.Module):
    """The block drafter: `fc` and `hidden_norm` build the context, `layers` run the block, `norm` ends it.

    `feature_layers` are the target's decoder layers (0-based) whose outputs it reads, `block_size` the block it
    was trained for (anchor + K masks), `mask_token_id` the target token whose embedding fills mask positions.
    """

    def __init__(self, cfg: ModelConfig, feature_layers: tuple[int, ...], *, num_layers: int = 2,
                 block_size: int = DFLASH_BLOCK, mask_token_id: int, rngs: nnx.Rngs,
                 layers: ModelConfig | None = None):
        if not feature_layers or any(not 0 <= i < cfg.num_layers for i in feature_layers):
            raise ValueError(f"feature_layers={feature_layers!r} must name decoder layers of this "
                             f"{cfg.num_layers}-layer model")
        if block_size < 2:
            raise ValueError(f"block_size={block_size!r} must be >= 2 (the anchor and at least one mask)")
        if not 0 <= mask_token_id < cfg.vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id!r} must be a token id of the target, in "
                             f"[0, {cfg.vocab_size})")
        # `layers`: the decoder-layer config a checkpoint's config.json gives (`jaxspec.models.eagle_files`);
        # one trained here takes the target's widths.
        self.cfg = drafter_config(cfg if layers is None else layers, num_layers)
        if self.cfg.hidden_size != cfg.hidden_size:
            raise ValueError(f"the drafter's hidden_size={self.cfg.hidden_size} must be the target's, "
                             f"{cfg.hidden_size}: it reads the target's embeddings and LM head")
        d, n = cfg.hidden_size, len(feature_layers)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self.fc = _dense_init(rngs, (d, n * d), jnp.float32)  # [D, L*D]: the target's layers, concatenated, to D
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.layers = nnx.List([DFlashLayer(self.cfg, rngs) for _ in range(num_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def draft_readout(self, target):
        """The readout the block's outputs are scored through and its tokens embedded with: the target's."""
        return target

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.create(num_layers=self.num_layers, batch=batch, num_kv_heads=cfg.num_kv_heads,
                              max_len=max_len, head_dim=cfg.head_dim, dtype=jnp.float32)

    def context(self, features: jax.Array) -> jax.Array:
        """c [..., D] from the target's chosen layers' outputs side by side [..., L*D]."""
        x = features.astype(jnp.float32)
        return self.hidden_norm(jnp.einsum("...i,oi->...o", x, self.fc[...]))

    def write_context(self, features: jax.Array, positions: jax.Array, cache: KVCache, write_at: jax.Array
                      ) -> KVCache:
        """The cache with every layer's keys and values of the context at the T positions i32[B, T] written at
        slots `write_at` i32[B] onward, from the target's layer outputs there [B, T, L*D] (lengths unchanged)."""
        c = self.context(features)  # [B, T, D]
        cos, sin = rope_tables(positions, self.cfg.rope, self.cfg.head_dim)
        ks, vs = [], []
        for layer, k_buf, v_buf in zip(self.layers, cache.k, cache.v):
            _, k, v = layer.attn.project(c, cos, sin)  # [B, Hkv, T, hd]
            ks.append(write_new(k_buf, k, write_at))
            vs.append(write_new(v_buf, v, write_at))
        return cache.replace(k=tuple(ks), v=tuple(vs))

    def __call__(self, embeds: jax.Array, positions: jax.Array, cache: KVCache, *, write_at: jax.Array,
                 visible: jax.Array) -> jax.Array:
        """The block's final hidden states [B, T, D] (normed: the LM head reads them) from its embeddings
        [B, T, D] at positions i32[B, T]; its keys and values go to scratch slots from `write_at` i32[B], and
        query t sees slot s where visible[b, t, s] (the committed context and its own block)."""
        cos, sin = rope_tables(positions, self.cfg.rope, self.cfg.head_dim)
        x = embeds.astype(jnp.float32)
        for layer, k_buf, v_buf in zip(self.layers, cache.k, cache.v):
            x, _, _ = layer(x, cos, sin, k_buf, v_buf, write_at, visible)
        return self.norm(x)

    def block_embeds(self, readout, anchor: jax.Array, width: int) -> jax.Array:
        """[B, width, D]: the anchor tokens' embeddings i32[B] followed by width - 1 mask embeddings."""
        tokens = jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], width - 1), self.mask_token_id,
                                                            jnp.int32)], axis=1)
        return readout.embed_tokens(tokens)


def block_visibility(committed: jax.Array, width: int, slots: int) -> jax.Array:
    """bool[B, width, S]: each block query sees the committed slots (below `committed` i32[B]) and the block's own
    `width` slots written right after them, all of them (bidirectional within the block)."""
    rel = jnp.arange(slots)[None, :] - committed[:, None]  # [B, S]
    return jnp.broadcast_to((rel < width)[:, None, :], (committed.shape[0], width, slots))
