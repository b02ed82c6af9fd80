"""The device side of generation: prefill, and the whole decode as one jitted `lax.while_loop`.

The host calls `prefill` once and `decode` once; nothing crosses to the host between steps. Shapes are fixed
(batch B, prompt bucket P, output buffer N, cache S), rows finish independently, and per-request values
(sampling settings, seeds, limits, stop ids) are arrays, so a new request never recompiles.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from .cache import KVCache
from .config import SamplingParams
from .sampling import row_keys, sample


@flax.struct.dataclass
class RowLimits:
    max_new_tokens: jax.Array  # i32[B]  at least 1
    stop_ids: jax.Array  # i32[B, M]  token ids that end the row (EOS and user stop ids), -1 padded


@flax.struct.dataclass
class DecodeState:
    cache: KVCache
    tokens: jax.Array  # i32[B, N]  generated tokens; -1 past each row's end
    num_generated: jax.Array  # i32[B]
    done: jax.Array  # bool[B]
    steps: jax.Array  # i32[]  forward passes run by the loop

    @property
    def last_tokens(self) -> jax.Array:
        """i32[B]: each row's newest token, sampled but not yet in the cache."""
        rows = jnp.arange(self.tokens.shape[0])
        return self.tokens[rows, jnp.maximum(self.num_generated - 1, 0)]


def _is_stop(tokens: jax.Array, limits: RowLimits) -> jax.Array:
    return jnp.any(tokens[:, None] == limits.stop_ids, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "buffer_len"))
def prefill(graphdef, params, prompts: jax.Array, prompt_lens: jax.Array, sampling: SamplingParams,
            limits: RowLimits, *, cache_len: int, buffer_len: int) -> DecodeState:
    """Run the prompts (right-padded i32[B, P], true lengths i32[B]) and sample each row's first token.

    Padding tokens write K/V past a row's length; the length never covers them, so they are overwritten.
    """
    model = nnx.merge(graphdef, params)
    batch, width = prompts.shape
    cache = model.new_cache(batch, cache_len)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    # Prefill keeps the XLA attention: the kernel is built for the few new tokens of a verification step.
    out, cache = model(prompts, positions, cache, logits_at=(prompt_lens - 1)[:, None], attention_impl="xla")
    cache = cache.advance(prompt_lens)
    first = sample(row_keys(sampling.seed, cache.lengths), out.logits[:, 0], sampling)
    tokens = jnp.full((batch, buffer_len), -1, jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, limits) | (limits.max_new_tokens <= 1)
    return DecodeState(cache=cache, tokens=tokens, num_generated=jnp.ones((batch,), jnp.int32), done=done,
                       steps=jnp.zeros((), jnp.int32))


def decode_step(model, state: DecodeState, sampling: SamplingParams, limits: RowLimits,
                attention_impl: str = "xla") -> DecodeState:
    """One plain decode step for every row: feed the newest token, sample the next."""
    cache = state.cache
    last = state.last_tokens
    out, cache = model(last[:, None], cache.lengths[:, None], cache, attention_impl=attention_impl)
    active = ~state.done
    cache = cache.advance(active.astype(jnp.int32))
    # The token being sampled sits at position `lengths` (the one just written is at lengths - 1).
    nxt = sample(row_keys(sampling.seed, cache.lengths), out.logits[:, 0], sampling)
    rows = jnp.arange(last.shape[0])
    slot = jnp.where(active, state.num_generated, state.tokens.shape[1])  # out of bounds: dropped
    tokens = state.tokens.at[rows, slot].set(nxt, mode="drop")
    num_generated = state.num_generated + active
    done = state.done | (active & (_is_stop(nxt, limits) | (num_generated >= limits.max_new_tokens)))
    return state.replace(cache=cache, tokens=tokens, num_generated=num_generated, done=done,
                         steps=state.steps + 1)


@functools.partial(jax.jit, static_argnames=("graphdef", "attention_impl"), donate_argnames=("state",))
def decode(graphdef, params, state: DecodeState, sampling: SamplingParams, limits: RowLimits, *,
           attention_impl: str = "xla") -> DecodeState:
    """Decode until every row is done, as one `lax.while_loop` on the device."""
    model = nnx.merge(graphdef, params)
    buffer_len = state.tokens.shape[1]

    def cond(s: DecodeState):
        return ~jnp.all(s.done) & (s.steps < buffer_len)

    return jax.lax.while_loop(cond, lambda s: decode_step(model, s, sampling, limits, attention_impl), state)
