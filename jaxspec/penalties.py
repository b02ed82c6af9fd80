"""Repetition penalties at every verified position, exactly as plain decoding would apply them.

A penalty changes the target distribution from the history: presence and frequency penalties subtract from
the logit of each token the output holds so far (once, and once per occurrence: OpenAI's definitions), and
the repetition penalty divides positive logits and multiplies negative ones of each token seen in the prompt
or the output (the CTRL rule of Hugging Face and vLLM). They apply to the raw logits, before temperature and
truncation (`jaxspec.sampling`).

Under speculation the history differs at each scored position: position j of a chain follows the row's
committed history *and the drafts before j*, and a tree node follows its ancestors. So the counts each
position sees are the committed counts plus the draft tokens on its path (`path_counts`), and a draft is
judged by the distribution plain decoding would have had at its place: greedy speculative output equals plain
greedy output, and sampled output follows the same penalised distribution.

The committed counts (`TokenCounts`) live in the decode state, one vocabulary-wide row per batch row, and
grow by each step's committed tokens.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from .sampling_params import SamplingParams

LOGIT_BOUND = 1e30  # penalised logits are clipped to [-LOGIT_BOUND, LOGIT_BOUND]


@flax.struct.dataclass
class TokenCounts:
    """Per row: how often each token occurs in the output so far, and which tokens the prompt holds."""

    output: jax.Array  # i32[B, V]  occurrences in the generated tokens (the newest, not yet cached, included)
    in_prompt: jax.Array  # bool[B, V]

    @classmethod
    def of_prompts(cls, prompts: jax.Array, prompt_lens: jax.Array, vocab: int) -> "TokenCounts":
        """Counts for right-padded prompts i32[B, W] of lengths i32[B], before any output."""
        batch, width = prompts.shape
        real = jnp.arange(width) < prompt_lens[:, None]  # bool[B, W]
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], prompts.shape)
        in_prompt = jnp.zeros((batch, vocab), bool).at[rows, jnp.where(real, prompts, vocab)].set(True, mode="drop")
        return cls(output=jnp.zeros((batch, vocab), jnp.int32), in_prompt=in_prompt)

    def add(self, tokens: jax.Array, num: jax.Array) -> "TokenCounts":
        """The counts after appending the first num i32[B] of tokens i32[B, T] to each row's output."""
        vocab = self.output.shape[1]
        kept = jnp.arange(tokens.shape[1]) < num[:, None]  # bool[B, T]
        rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
        ids = jnp.where(kept & (tokens >= 0), tokens, vocab)  # dropped: past the vocabulary
        return self.replace(output=self.output.at[rows, ids].add(1, mode="drop"))


def any_penalty(sampling: SamplingParams) -> jax.Array:
    """bool[B]: rows with a penalty that changes their distribution."""
    return ((jnp.asarray(sampling.presence_penalty) != 0) | (jnp.asarray(sampling.frequency_penalty) != 0)
            | (jnp.asarray(sampling.repetition_penalty) != 1))


def penalize(logits: jax.Array, output_counts: jax.Array, in_prompt: jax.Array,
             sampling: SamplingParams) -> jax.Array:
    """f32[B, W, V] logits after the penalties, from logits [B, W, V], the output counts i32[B, W, V] each
    position sees and the prompt's tokens bool[B, V]."""
    z = logits.astype(jnp.float32)
    count = output_counts.astype(jnp.float32)
    presence = jnp.reshape(sampling.presence_penalty, (-1, 1, 1))
    frequency = jnp.reshape(sampling.frequency_penalty, (-1, 1, 1))
    repetition = jnp.reshape(sampling.repetition_penalty, (-1, 1, 1))
    seen = (count > 0) | in_prompt[:, None, :]
    z = jnp.where(seen, jnp.where(z > 0, z / repetition, z * repetition), z)
    z = z - frequency * count - presence * (count > 0)
    # A tiny or huge repetition penalty can overflow float32; +-1e30 stays finite through any temperature
    # (`jaxspec.sampling.GREEDY_BELOW`), so sampling never meets inf - inf.
    return jnp.clip(z, -LOGIT_BOUND, LOGIT_BOUND)


def path_counts(counts: TokenCounts, fed: jax.Array, on_path: jax.Array | None) -> jax.Array:
    """i32[B, W, V]: the output counts at each scored position, fed i32[B, W] being the newest token then the
    drafts. Position i sees the committed counts plus the fed tokens 1.. on its path: `on_path` bool[B, W, W]
    (row i: the positions at or above node i, `jaxspec.tree.tree_ancestor_mask`) for a tree, None for a chain
    (positions 1..i)."""
    batch, width = fed.shape
    vocab = counts.output.shape[1]
    if width == 1:
        # No drafts. Also a workaround: with a zero-sized one-hot in the program, this jax/XLA drops the typed-FFI
        # attributes of the CPU matmul's custom calls and the compile fails ("untyped custom call").
        return counts.output[:, None, :]
    if on_path is None:
        on_path = jnp.broadcast_to(jnp.tril(jnp.ones((width, width), bool)), (batch, width, width))
    drafts = jax.nn.one_hot(fed[:, 1:], vocab, dtype=jnp.float32)  # f32[B, W-1, V]; the newest is counted
    extra = jnp.einsum("bij,bjv->biv", on_path[:, :, 1:].astype(jnp.float32), drafts)  # f32[B, W, V]
    return counts.output[:, None, :] + extra.astype(jnp.int32)


def penalize_scored(logits: jax.Array, counts: TokenCounts | None, fed: jax.Array, on_path: jax.Array | None,
                    sampling: SamplingParams) -> jax.Array:
    """The verify forward's logits f32[B, W, V] as plain decoding would see them at each position: penalised
    for rows that ask, untouched (and nothing computed) when no row does or counts are not tracked."""
    if counts is None:
        return logits

    def apply(z):
        penalized = penalize(z, path_counts(counts, fed, on_path), counts.in_prompt, sampling)
        return jnp.where(any_penalty(sampling)[:, None, None], penalized, z.astype(jnp.float32))

    return jax.lax.cond(jnp.any(any_penalty(sampling)), apply, lambda z: z.astype(jnp.float32), logits)
