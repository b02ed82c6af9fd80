"""What one drafting pass of a feature-reading drafter (EAGLE-2/3 trees, DFlash blocks) costs on its own."""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import SamplingParams
from jaxspec.builders import build_proposer
from jaxspec.proposers.base import Context
from jaxspec.sampling import row_keys
from jaxspec.verification import feature_layers, layer_request, target_features

from .timing import repeat, timer


@functools.partial(jax.jit, static_argnames=("proposer",))
def _propose(proposer, params, pstate, ctx: Context, keys):
    return proposer.propose(params, pstate, ctx, keys)


def drafting_pass_ms(lm, spec, prompt: list[int], *, repeats: int = 20, new_tokens: int = 128) -> float:
    """Median ms of one `propose` (jitted, blocked on) of `spec`'s proposer at batch 1, after the prompt's
    prefill: the drafter's own forwards and its readout over the draft, nothing of verification."""
    width = len(prompt)
    cache_len = width + new_tokens + 32
    proposer, params = build_proposer(lm, spec, prompt_width=width, buffer_len=new_tokens, cache_len=cache_len)
    layers = feature_layers(proposer)
    tokens = jnp.asarray([prompt], jnp.int32)
    out, _ = jax.jit(lambda p, t: lm.module(t, jnp.arange(width)[None], lm.module.new_cache(1, cache_len),
                                            **layer_request(layers)))(lm.params, tokens)
    history = np.zeros((1, width + new_tokens), np.int32)
    history[0, :width] = prompt
    history[0, width] = int(jnp.argmax(out.logits[0, -1]))
    sampling = SamplingParams().broadcast(1)
    k = proposer.num_speculative_tokens
    ctx = Context(history=jnp.asarray(history), history_len=jnp.asarray([width + 1], jnp.int32),
                  max_draft=jnp.full((1,), k, jnp.int32), sampling=sampling, positions=jnp.asarray([width], jnp.int32),
                  features=target_features(out, layers))
    pstate = jax.jit(proposer.init)(params, ctx)
    keys = row_keys(sampling.seed, ctx.positions)
    ctx = ctx.replace(features=None)
    times = repeat(timer(lambda: jax.block_until_ready(_propose(proposer, params, pstate, ctx, keys))), repeats,
                   warmup=2)
    return 1000 * statistics.median(times)
