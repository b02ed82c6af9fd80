#!/usr/bin/env python
"""A model of your own in jaxspec's decode loop: a GPT-2-style NNX model, plain and speculative.

    python examples/custom_model.py                  # random weights; ~30 s on 2 CPU cores, mostly compiling
    python examples/custom_model.py --max-new-tokens 64

This is an API example: the weights are random, so the tokens mean nothing. What it shows is the target
contract (`jaxspec.target`, docs/concepts/model-contract.md) met by a model that is not the shipped Llama:
learned absolute position embeddings, LayerNorm with biases, a GELU MLP, multi-head attention over a KV cache
that writes each new token's K/V at its row's cache length and leaves the lengths alone.

`GPT` is wrapped with `jaxspec.LanguageModel.from_module` (which checks the contract) and decoded greedily
with `none`, `ngram`, `sam`, `draft_model` (a one-layer `GPT` started from the target's weights) and
`self_draft` (the target's first layer: `GPT` builds itself from a config and keeps its blocks in `layers`, so
`self_draft` can shrink it). Every speculative run prints its acceptance and must reproduce the plain tokens
exactly (exit status 1 if one does not). Last, the contract check explains why `eagle` cannot run here: its
head is a Llama decoder layer sized from a Llama config, which a GPT config does not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxspec
from jaxspec.cache import KVCache, write_new
from jaxspec.models.llama import ModelOutput, visibility_mask

_MASKED = -1e30  # finite, so a fully masked row could never turn into NaN


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT-2-style decoder's static settings. Frozen (hashable): the config is part of each compiled program."""

    vocab_size: int = 128  # V
    max_position_embeddings: int = 256  # rows of the learned position table: the context length
    hidden_size: int = 64  # D
    num_layers: int = 2
    num_heads: int = 4
    layer_norm_eps: float = 1e-5
    init_scale: float = 0.3  # std of the random weights (GPT-2 trains from 0.02; larger makes attention matter)

    @property
    def head_dim(self) -> int:
        """Features per attention head, D / H."""
        return self.hidden_size // self.num_heads


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], scale: float) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, jnp.float32))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: multi-head attention over the KV cache, then a GELU MLP."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, s = cfg.hidden_size, cfg.init_scale
        self.cfg = cfg
        self.ln_1 = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.qkv = _normal(rngs, (d, 3 * d), s / math.sqrt(d))  # [D, 3D]
        self.qkv_bias = nnx.Param(jnp.zeros((3 * d,), jnp.float32))
        self.proj = _normal(rngs, (d, d), s / math.sqrt(d))  # [D, D]
        self.ln_2 = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)  # [D] -> [4D]
        self.fc_out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, k_cache, v_cache, lengths, tree_mask, slots: int):
        """x f32[B, T, D], this layer's cache buffers [B, H, S, hd], lengths i32[B] -> (x, k_cache, v_cache).

        Reads only the first `slots` cache slots (a static bound on what any row holds plus the T new tokens).
        """
        B, T, D = x.shape
        H, hd = self.cfg.num_heads, self.cfg.head_dim
        qkv = self.ln_1(x) @ self.qkv[...] + self.qkv_bias[...]  # f32[B, T, 3D]
        q, k, v = (a.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, axis=-1))  # [B, H, T, hd]
        # The contract: new token t's K/V go to slot lengths[b] + t, whatever its position (a tree node's position
        # is its depth), and the lengths stay where they are: the loop advances them when it commits.
        k_cache, v_cache = write_new(k_cache, k, lengths), write_new(v_cache, v, lengths)
        # Committed slots, plus the new tokens causally or as the tree mask says; stale slots past a row's length
        # (rejected drafts, padding) get exactly zero weight from the masked softmax.
        visible = visibility_mask(lengths, T, slots, tree_mask)  # bool[B, T, slots]
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k_cache[:, :, :slots]) / math.sqrt(hd)  # f32[B, H, T, slots]
        probs = jax.nn.softmax(jnp.where(visible[:, None], scores, _MASKED), axis=-1)
        attn = jnp.einsum("bhts,bhsd->bhtd", probs, v_cache[:, :, :slots])  # [B, H, T, hd]
        x = x + attn.transpose(0, 2, 1, 3).reshape(B, T, D) @ self.proj[...]
        x = x + self.fc_out(jax.nn.gelu(self.fc(self.ln_2(x))))
        return x, k_cache, v_cache


class GPT(nnx.Module):
    """A GPT-2-style decoder following jaxspec's target contract (`jaxspec.target.TargetModel`), with the
    attributes `self_draft` (`layers`, a dataclass config with `num_layers`) and Medusa heads (`embed`,
    `lm_head`, the final hidden state as `hidden`) use."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, s = cfg.hidden_size, cfg.init_scale
        self.embed = _normal(rngs, (cfg.vocab_size, d), 1.0)  # [V, D]  token embedding (GPT-2's wte)
        self.wpe = _normal(rngs, (cfg.max_position_embeddings, d), s)  # [P, D]  learned absolute positions
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.ln_f = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.lm_head = _normal(rngs, (d, cfg.vocab_size), 1.0 / math.sqrt(d))  # [D, V]  logits = hidden @ lm_head

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache: per layer K and V buffers [batch, H, max_len, hd], every row's length 0."""
        cfg = self.cfg
        return KVCache.create(num_layers=cfg.num_layers, batch=batch, num_kv_heads=cfg.num_heads, max_len=max_len,
                              head_dim=cfg.head_dim, dtype=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]  new tokens
        positions: jax.Array,  # i32[B, T]  their positions
        cache: KVCache,
        *,
        tree_mask: jax.Array | None = None,  # bool[B, T, T]  among the new tokens; None = causal
        logits_at: jax.Array | None = None,  # i32[B, L]  new-token indices to compute logits at; None = all
        compute_logits: bool = True,
        attention_impl: str = "xla",  # the loop's hint; this model always uses its own attention
        cached_slots: int | None = None,  # static bound on cache.lengths (0 for a prefill); None: unknown
    ) -> tuple[ModelOutput, KVCache]:
        """(logits f32[B, L, V] and final hidden states [B, T, D], the cache with the new K/V written)."""
        B, T = tokens.shape
        max_len = cache.k[0].shape[2]
        slots = max_len if cached_slots is None else min(max_len, cached_slots + T)
        # Padding and finished rows feed positions up to the cache size, past the table: clip them so those
        # positions still give finite values (their outputs are never used, but their K/V are masked, not absent).
        pos = jnp.clip(positions, 0, self.cfg.max_position_embeddings - 1)
        x = jnp.take(self.embed[...], tokens, axis=0) + jnp.take(self.wpe[...], pos, axis=0)  # f32[B, T, D]
        ks, vs = list(cache.k), list(cache.v)
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, ks[i], vs[i], cache.lengths, tree_mask, slots)
        hidden = self.ln_f(x)  # f32[B, T, D]
        logits = None
        if compute_logits:
            picked = hidden if logits_at is None else jnp.take_along_axis(hidden, logits_at[..., None], axis=1)
            logits = jnp.dot(picked, self.lm_head[...], preferred_element_type=jnp.float32)  # f32[B, L, V]
        return ModelOutput(logits=logits, hidden=hidden), cache.replace(k=tuple(ks), v=tuple(vs))


def small_draft(target: jaxspec.LanguageModel, seed: int = 1) -> jaxspec.LanguageModel:
    """A one-layer `GPT` started from the target: its embeddings, final norm and LM head, and its last block.

    Dropping layers is a common way to start a draft before distilling it; with random weights it is what makes
    the draft agree with the target at all (an independent random draft would almost never be accepted).
    """
    draft = GPT(dataclasses.replace(target.config, num_layers=1), rngs=nnx.Rngs(seed))
    weights = target.params  # the target's nnx state: embed, wpe, layers, ln_f, lm_head
    for name in ("embed", "wpe", "lm_head", "ln_f"):
        nnx.update(draft, nnx.State({name: weights[name]}))
    nnx.update(draft, nnx.State({"layers": {0: weights["layers"][target.config.num_layers - 1]}}))
    return jaxspec.LanguageModel.from_module(draft, name="gpt-draft")


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Four token-id prompts of different lengths, each repeating a short random phrase (lookup proposers
    draft from repeats; a random model's own output also falls into loops they can copy)."""
    rng = np.random.default_rng(seed)
    out = []
    for length in (7, 19, 30, 12):
        phrase = rng.integers(0, vocab, size=5).tolist()
        out.append((phrase * length)[:length])
    return out


def specs(target: jaxspec.LanguageModel) -> dict[str, jaxspec.SpecConfig]:
    """The speculative settings this example runs, by method. One verify width each (K + 1): every width is a
    compiled forward, and compiling, not decoding, is what takes the time at this size."""
    return {
        "ngram": jaxspec.SpecConfig(method="ngram", num_speculative_tokens=4, min_match=1, verify_widths=(5,)),
        "sam": jaxspec.SpecConfig(method="sam", num_speculative_tokens=4, min_match=1, verify_widths=(5,)),
        "draft_model": jaxspec.SpecConfig(method="draft_model", num_speculative_tokens=3, verify_widths=(4,),
                                          draft_model=small_draft(target)),
        "self_draft": jaxspec.SpecConfig(method="self_draft", num_speculative_tokens=3, verify_widths=(4,),
                                         self_draft_layers=1),
    }


def run(max_new_tokens: int = 48) -> bool:
    """Decode the prompts plainly and with every method the model supports; print the acceptance of each.
    Returns whether every speculative run gave exactly the plain tokens."""
    target = jaxspec.LanguageModel.from_module(GPT(GPTConfig(), rngs=nnx.Rngs(0)), name="gpt-random")
    rows = prompts(target.config.vocab_size)
    plain = jaxspec.generate(target, rows, max_new_tokens=max_new_tokens)
    print(f"{'method':<12} {'same':<5} {'drafted':>7} {'accepted':>8} {'rate':>5} {'tokens/step':>11} {'steps':>5}")
    print(f"{'none':<12} {'-':<5} {0:>7} {0:>8} {'-':>5} {1.0:>11.2f} {plain.stats.row_steps:>5}")
    all_same = True
    for method, spec in specs(target).items():
        out = jaxspec.generate(target, rows, max_new_tokens=max_new_tokens, spec=spec)
        s = out.stats
        same = out.token_ids == plain.token_ids
        all_same &= same
        print(f"{method:<12} {str(same):<5} {s.drafted:>7} {s.accepted:>8} {s.acceptance_rate:>5.2f} "
              f"{s.mean_acceptance_length:>11.2f} {s.row_steps:>5}")
    try:
        jaxspec.check_target(target, "eagle")
    except ValueError as e:
        print(f"\nmethod='eagle' is not for this model; the contract check says:\n  {e}")
    return all_same


def main(argv=None) -> int:
    """The command line: exit status 0 when every speculative run reproduced the plain tokens, else 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="default: %(default)s")
    args = parser.parse_args(argv)
    return 0 if run(args.max_new_tokens) else 1


if __name__ == "__main__":
    raise SystemExit(main())
