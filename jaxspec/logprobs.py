"""The target's log-probabilities of the tokens rows commit (OpenAI's `logprobs`), recorded inside the loop.

Each committed token came from the target's logits at its position: plain decoding's one-token forward, a
chain's verify forward, or a tree node's row of the tree forward. By default the values are those logits' own
log-softmax, before temperature, top-k, top-p or min-p shape them ("raw" log-probabilities, vLLM's default),
so they describe the model whatever the sampling setting and whichever proposer drafted the token. A row marked
`processed` records the log-softmax of the processed logits instead (`jaxspec.sampling.process_logits`): the
log-probability under the distribution the token was actually drawn from, which a policy-gradient loss needs
(`jaxspec.rollout`). Lossless verification commits tokens with exactly that distribution, so both modes mean
the same under speculation as under plain decoding.

The buffers sit beside `DecodeState.history` (slot i holds the values of history token i) and are filled
only while some active row asked for them: `record` skips the log-sum-exp and the top-L search otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .sampling import process_logits
from .sampling_params import SamplingParams


@flax.struct.dataclass
class LogprobBuffer:
    wanted: jax.Array  # bool[B]  rows that asked for log-probabilities
    token: jax.Array  # f32[B, H]  log p(history[b, i] | history[b, :i]); 0 at prompt slots
    top_ids: jax.Array  # i32[B, H, L]  the L most likely tokens at slot i, most likely first
    top: jax.Array  # f32[B, H, L]  their log-probabilities
    processed: jax.Array  # bool[B]  rows recording the sampling distribution's values instead of the raw ones

    @classmethod
    def zeros(cls, wanted: jax.Array, history_len: int, num_top: int,
              processed: jax.Array | None = None) -> "LogprobBuffer":
        batch = wanted.shape[0]
        processed = jnp.zeros((batch,), bool) if processed is None else jnp.asarray(processed, bool)
        return cls(wanted=wanted, token=jnp.zeros((batch, history_len), jnp.float32),
                   top_ids=jnp.zeros((batch, history_len, num_top), jnp.int32),
                   top=jnp.zeros((batch, history_len, num_top), jnp.float32), processed=processed)

    @property
    def num_top(self) -> int:
        return self.top.shape[-1]


@flax.struct.dataclass
class Scored:
    """Log-probabilities of W tokens per row (one step's outputs), before they are written to the buffer."""

    token: jax.Array  # f32[B, W]
    top_ids: jax.Array  # i32[B, W, L]
    top: jax.Array  # f32[B, W, L]

    def pad(self, width: int) -> "Scored":
        """Padded along W to `width` (a step's K + 1 output slots)."""
        extra = width - self.token.shape[1]

        def pad(x):
            return jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2))

        return Scored(token=pad(self.token), top_ids=pad(self.top_ids), top=pad(self.top))


def score(logits: jax.Array, tokens: jax.Array, num_top: int, sampling: SamplingParams | None = None,
          processed: jax.Array | None = None, adjusted: jax.Array | None = None) -> Scored:
    """Log-probabilities of `tokens` i32[B, W] (-1: none) under `logits` f32[B, W, V], and the top `num_top`;
    rows marked in `processed` (bool[B], with their `sampling` arrays [B]) score under the processed logits:
    `adjusted` f32[B, W, V] (the logits after penalties; default `logits`) through the sampling settings."""
    logits = logits.astype(jnp.float32)
    if processed is not None:
        adjusted = logits if adjusted is None else adjusted.astype(jnp.float32)
        # The processing (a vocabulary sort for top-k/top-p) runs only when some row asks for it.
        logits = jax.lax.cond(jnp.any(processed),
                              lambda z, a: jnp.where(processed[:, None, None], process_logits(a, sampling), z),
                              lambda z, a: z, logits, adjusted)
    norm = jax.nn.logsumexp(logits, axis=-1)  # f32[B, W]
    chosen = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0] - norm
    if num_top:
        top, top_ids = jax.lax.top_k(logits, num_top)
        top = top - norm[..., None]
    else:
        top = jnp.zeros(tokens.shape + (0,), jnp.float32)
        top_ids = jnp.zeros(tokens.shape + (0,), jnp.int32)
    return Scored(token=chosen, top_ids=top_ids.astype(jnp.int32), top=top)


def record(buffer: LogprobBuffer, active: jax.Array, compute: Callable[[], Scored]) -> Scored:
    """`compute()` (a `score` call), or zeros of its shape when no active row bool[B] wants log-probabilities:
    then the step skips the log-sum-exp and the top-L search (and any gather of logits inside `compute`)."""
    def skip() -> Scored:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(compute))

    return jax.lax.cond(jnp.any(buffer.wanted & active), compute, skip)


def write(buffer: LogprobBuffer, slots: jax.Array, scored: Scored) -> LogprobBuffer:
    """Store step outputs at history slots i32[B, W] (slots past the buffer are dropped, as in `history`)."""
    rows = jnp.arange(slots.shape[0])[:, None]
    return buffer.replace(token=buffer.token.at[rows, slots].set(scored.token, mode="drop"),
                          top_ids=buffer.top_ids.at[rows, slots].set(scored.top_ids, mode="drop"),
                          top=buffer.top.at[rows, slots].set(scored.top, mode="drop"))


@functools.partial(jax.jit, static_argnames=("size",))
def window(buffer: LogprobBuffer, starts: jax.Array, *, size: int) -> Scored:
    """`size` slots of every row from `starts` i32[B] on: what the host reads after a chunk.

    A start past H - size is moved back to H - size (as `lax.dynamic_slice` does); the caller offsets by it.
    """
    take = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, size, axis=0))
    return Scored(token=take(buffer.token, starts), top_ids=take(buffer.top_ids, starts), top=take(buffer.top, starts))


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def to_host(token_ids: Sequence[int], token: np.ndarray, top_ids: np.ndarray, top: np.ndarray,
            num_top: int) -> list[TokenLogprob]:
    """TokenLogprobs of `token_ids` from read-back slots (token f32[n], top_ids i32[n, L], top f32[n, L]),
    keeping each position's `num_top` <= L most likely tokens."""
    return [TokenLogprob(int(t), float(token[i]),
                         tuple(zip(top_ids[i, :num_top].tolist(), top[i, :num_top].tolist())))
            for i, t in enumerate(token_ids)]
