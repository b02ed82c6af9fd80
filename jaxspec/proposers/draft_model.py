"""A draft model proposer: a small language model with its own KV cache drafts K tokens autoregressively.

Drafts are sampled from the draft's processed distribution q (same sampling settings as the target; greedy
rows take the argmax), and q goes to verification, which accepts with min(1, p/q): lossless for any q.

Keeping the draft cache in step with the target costs no bookkeeping: each propose starts by re-feeding the
row's two newest tokens (positions P-1 and P, P = the target's committed length). Every draft token before
P-1 was either accepted (so its K/V, written while drafting, is right) or never drafted; the token at P-1 is
the one case that may be missing (all K drafts accepted: the last was never fed), and rewriting it when it
is present is harmless.

`self_draft_model` makes a draft from the target itself: its first N layers, final norm and LM head, sharing
the target's weight arrays (no copy), so the default model can speculate without a second checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..models.llama import Llama, set_layer_loop
from ..models.loading import LanguageModel
from ..sampling import processed_probs, sample
from ..target import check_target
from .base import ChainProposer, Committed, Context, Draft


@dataclasses.dataclass(frozen=True)
class DraftModelProposer(ChainProposer):
    """Drafts K tokens a step with a small model of the target's vocabulary, sampled from its q (sent along)."""

    num_speculative_tokens: int  # K: tokens drafted per step
    graphdef: Any  # nnx.GraphDef of the draft model; its params are the proposer params
    cache_len: int  # the draft cache's slots per row (the target's cache length is enough)
    prompt_width: int  # the prompt bucket P: init prefills history[:, :P]

    def init(self, params, ctx: Context) -> Any:
        """The draft's KV cache after a prefill of each row's prompt."""
        model = nnx.merge(self.graphdef, params)
        batch = ctx.history.shape[0]
        cache = model.new_cache(batch, self.cache_len)
        positions = jnp.broadcast_to(jnp.arange(self.prompt_width, dtype=jnp.int32), (batch, self.prompt_width))
        _, cache = model(ctx.history[:, : self.prompt_width], positions, cache, compute_logits=False,
                         cached_slots=0)
        return cache

    def propose(self, params, cache, ctx: Context, keys: jax.Array) -> tuple[Draft, Any]:
        """K draft tokens per row and the distributions q they were drawn from, and the advanced draft cache."""
        model = nnx.merge(self.graphdef, params)
        k = self.num_speculative_tokens
        newest = ctx.positions  # i32[B]: the newest token's position (== its index in the history)
        fed = jnp.take_along_axis(ctx.history, jnp.stack([newest - 1, newest], axis=1), axis=1)  # [B, 2]
        cache = cache.replace(lengths=newest - 1)
        out, cache = model(fed, cache.lengths[:, None] + jnp.arange(2), cache, logits_at=jnp.ones_like(fed[:, :1]))
        cache = cache.advance(2)

        def draw(i, logits):  # logits f32[B, V] -> draft token i32[B] and q f32[B, V]
            step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i)
            return sample(step_keys, logits, ctx.sampling), processed_probs(logits, ctx.sampling)

        token, q = draw(0, out.logits[:, 0])
        tokens = jnp.zeros((fed.shape[0], k), jnp.int32).at[:, 0].set(token)
        probs = jnp.zeros((fed.shape[0], k, q.shape[-1]), jnp.float32).at[:, 0].set(q)

        def step(i, carry):
            cache, tokens, probs = carry
            fed = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
            out, cache = model(fed, cache.lengths[:, None], cache)
            token, q = draw(i, out.logits[:, 0])
            return cache.advance(1), tokens.at[:, i].set(token), probs.at[:, i].set(q)

        cache, tokens, probs = jax.lax.fori_loop(1, k, step, (cache, tokens, probs))
        num_draft = jnp.minimum(ctx.max_draft, k)
        return Draft(tokens=tokens, num_draft=num_draft, probs=probs), cache

    def update(self, params, cache, ctx: Context, committed: Committed) -> Any:
        return cache  # the next propose re-syncs from the target's committed length


def self_draft_model(lm: LanguageModel, num_layers: int) -> LanguageModel:
    """The target's first `num_layers` decoder layers with its final norm and LM head, sharing its arrays (a
    scanned Llama's stacked layers are sliced, so those are copies).

    Any target following `jaxspec.target.SelfDraftTarget` works (the draft is the target's own class with fewer
    layers); ValueError naming what a target lacks otherwise.
    """
    check_target(lm, "self_draft", trace=False)  # its forward was traced when it was wrapped
    cfg = lm.config
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"self_draft_layers={num_layers!r} must be in [1, {cfg.num_layers}] for {lm.name!r}")
    small_cfg = dataclasses.replace(cfg, num_layers=num_layers)
    target = lm.module
    target_class = type(target)
    # A scanned Llama keeps its layers stacked [L, ...]: the draft's are the first num_layers of each (copies, a
    # slice of an array is not the array); unrolled layers are shared as they are.
    scanned = isinstance(target, Llama) and target.layer_loop == "scan"

    def build():
        model = target_class(small_cfg, rngs=nnx.Rngs(0))
        if isinstance(model, Llama):
            set_layer_loop(model, target.layer_loop)
        return model

    graphdef, shapes = nnx.split(nnx.eval_shape(build))
    layers = (jax.tree.map(lambda x: x[:num_layers], lm.params["layers"]) if scanned
              else nnx.State({i: lm.params["layers"][i] for i in range(num_layers)}))
    params = nnx.State({name: sub for name, sub in lm.params.items() if name != "layers"} | {"layers": layers})
    # Every array but the dropped layers' is shared, so the smaller instance must need exactly those arrays.
    want = {path: tuple(v.shape) for path, v in nnx.to_flat_state(shapes)}
    have = {path: tuple(v.shape) for path, v in nnx.to_flat_state(params)}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()), key=str)[:3]
        raise ValueError(f"method='self_draft' needs {target_class.__name__} with num_layers={num_layers} to hold "
                         f"the target's parameters minus the later layers; they differ at (path, shape) {diff}")
    return dataclasses.replace(lm, name=f"{lm.name}[:{num_layers}]", config=small_cfg, graphdef=graphdef,
                               params=params)
