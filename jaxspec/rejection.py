"""Lossless verification of a chain of drafted tokens: speculative sampling (Leviathan et al. 2023, Chen et al.
2023), vectorised over rows.

`rejection_sample` accepts drafts left to right against the processed target distribution and emits the
accepted drafts plus one target token (recovered or bonus). The rules, the proof that the output follows the
target distribution, and the random streams are in docs/concepts/losslessness.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .sampling import argmax, categorical, draw, is_greedy, process_logits
from .sampling_params import SamplingParams

_ACCEPT_STREAM = 0x5EC0DE  # far above any draft index, so no draft-model key coincides with it


def _num_leading(accept: jax.Array) -> jax.Array:
    """i32[B] length of each row's leading run of True in bool[B, K]."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def _emit(draft_tokens: jax.Array, n: jax.Array, last: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Drafts 0..n-1, then `last` i32[B] at position n, then -1: (i32[B, K+1], i32[B] n + 1)."""
    batch, k = draft_tokens.shape
    j = jnp.arange(k + 1)
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, K+1]
    tokens = jnp.where(j < n[:, None], drafts, jnp.where(j == n[:, None], last[:, None], -1))
    return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32)


def _shape_dtype(x) -> tuple[tuple[int, ...], object]:
    """(shape, dtype) of an array, a tracer or anything numpy converts; static, so it works under jit and vmap."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        x = np.asarray(x)
    return tuple(x.shape), x.dtype


_KIND_NAMES = {jnp.integer: "integers", jnp.floating: "floats"}


def _is_kind(dtype, kind) -> bool:
    """Whether `dtype` is a sub-dtype of `kind` (jnp.integer, jnp.floating); False for key dtypes."""
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and jnp.issubdtype(dtype, kind)


def _check_keys(keys, batch: int) -> None:
    """keys: key[B] typed keys (jax.random.key) or uint32[B, 2] raw keys (jax.random.PRNGKey); else ValueError."""
    shape, dtype = _shape_dtype(keys)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape != (batch,):
            raise ValueError(f"keys has shape {shape}; expected one typed key per row, shape ({batch},)")
        return
    if dtype != jnp.uint32 or len(shape) != 2 or shape[0] != batch:
        raise ValueError(f"keys has shape {shape} and dtype {dtype}; expected one key per row: typed keys "
                         f"key[{batch}] (jax.random.key) or raw keys uint32[{batch}, 2] (jax.random.PRNGKey)")


def _check_sampling(sampling, batch: int) -> None:
    """Each SamplingParams field a scalar or one value per row [B]; else ValueError naming the field."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling={sampling!r} must be a jaxspec.SamplingParams")
    for field in dataclasses.fields(sampling):
        shape, _ = _shape_dtype(getattr(sampling, field.name))
        if shape not in ((), (batch,)):
            raise ValueError(f"sampling.{field.name} has shape {shape}; expected a scalar or ({batch},), "
                             "one value per row")


def check_inputs(keys, target_logits, draft_tokens, draft_probs, num_draft, sampling, positions=None) -> None:
    """ValueError naming the first argument of `rejection_sample` whose rank, shape or dtype is wrong.

    Only shapes and dtypes are read, so this works on tracers too (under jit and vmap, at trace time); values
    (token ids in range, num_draft <= K) are not checked.
    """
    logits_shape, logits_dtype = _shape_dtype(target_logits)
    if len(logits_shape) != 3 or logits_shape[1] < 1 or not _is_kind(logits_dtype, jnp.floating):
        raise ValueError(f"target_logits has shape {logits_shape} and dtype {logits_dtype}; expected floats "
                         "[B, K+1, V]")
    batch, width, vocab = logits_shape
    k = width - 1
    expected = {"draft_tokens": ((batch, k), jnp.integer), "num_draft": ((batch,), jnp.integer)}
    if draft_probs is not None:
        expected["draft_probs"] = ((batch, k, vocab), jnp.floating)
    if positions is not None:
        expected["positions"] = ((batch,), jnp.integer)
    given = dict(draft_tokens=draft_tokens, num_draft=num_draft, draft_probs=draft_probs, positions=positions)
    for name, (want, kind) in expected.items():
        shape, dtype = _shape_dtype(given[name])
        if shape != want or not _is_kind(dtype, kind):
            raise ValueError(f"{name} has shape {shape} and dtype {dtype}; expected {_KIND_NAMES[kind]} {want} "
                             f"(B={batch}, K={k}, V={vocab} from target_logits {logits_shape} = [B, K+1, V])")
    _check_keys(keys, batch)
    _check_sampling(sampling, batch)


def rejection_sample(keys: jax.Array, target_logits: jax.Array, draft_tokens: jax.Array,
                     draft_probs: jax.Array | None, num_draft: jax.Array, sampling: SamplingParams, *,
                     positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Verify each row's drafts against the target and emit the accepted drafts plus one target token.

    Greedy rows accept while the draft is the argmax; deterministic drafts (`draft_probs=None`) are accepted
    while they equal the target's own sample; probabilistic drafts with probability min(1, p/q). See
    docs/concepts/losslessness.md.

    Args:
      keys: key[B] typed keys, one base key per row (plain decoding's `jax.random.key(seed)`), or the same
        as raw uint32[B, 2] keys (`jax.random.PRNGKey(seed)`).
      target_logits: f32[B, K+1, V] raw target logits; position j judges draft j, position K gives the bonus.
      draft_tokens: i32[B, K]; entries at j >= num_draft are ignored.
      draft_probs: f32[B, K, V] the draft's (processed) distributions, or None for deterministic drafts.
      num_draft: i32[B] in [0, K].
      sampling: scalars or per-row arrays [B]; temperatures below GREEDY_BELOW (0 included) are greedy.
      positions: i32[B] absolute position of each row's first output token (None: 0).

    Returns:
      (output tokens i32[B, K+1] padded with -1, their count i32[B] in [1, num_draft + 1]).

    Raises:
      ValueError: naming the argument whose rank, shape or dtype does not fit the others (`check_inputs`).
        Only shapes are checked (at trace time under jit and vmap), never values.
    """
    check_inputs(keys, target_logits, draft_tokens, draft_probs, num_draft, sampling, positions)
    batch, width, vocab = target_logits.shape  # width = K + 1
    k = width - 1
    draft_tokens = draft_tokens.astype(jnp.int32)
    positions = jnp.zeros((batch,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
    num_draft = jnp.asarray(num_draft, jnp.int32)
    in_draft = jnp.arange(k) < num_draft[:, None]  # bool[B, K]: masks the garbage past num_draft

    def greedy():
        # p is a point mass on the argmax: both rules accept while the draft is the argmax, then emit it.
        best = argmax(target_logits)  # i32[B, K+1]
        n = _num_leading(in_draft & (draft_tokens == best[:, :k]))
        return _emit(draft_tokens, n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0])

    def sampled():
        pos = positions[:, None] + jnp.arange(width, dtype=jnp.int32)  # i32[B, K+1]
        pos_keys = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))(keys, pos)  # key[B, K+1]
        if draft_probs is None:
            t = draw(pos_keys, target_logits, sampling)  # i32[B, K+1]
            n = _num_leading(in_draft & (draft_tokens == t[:, :k]))
            return _emit(draft_tokens, n, jnp.take_along_axis(t, n[:, None], axis=1)[:, 0])

        z = process_logits(target_logits, sampling)  # f32[B, K+1, V], -inf outside the kept tokens

        # Probabilities only where needed: p_j(x_j) for the test, the full p_n at the one position n.
        lse = jax.nn.logsumexp(z, axis=-1)  # f32[B, K+1]
        x = jnp.clip(draft_tokens, 0, vocab - 1)[..., None]  # garbage drafts must still index safely
        p_x = jnp.exp(jnp.take_along_axis(z[:, :k], x, axis=-1)[..., 0] - lse[:, :k])  # f32[B, K]
        q_x = jnp.take_along_axis(draft_probs, x, axis=-1)[..., 0]  # f32[B, K]
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_STREAM))))(
            pos_keys[:, :k])  # f32[B, K] in [0, 1)
        # u < p/q without dividing: q(x) = 0 accepts iff p(x) > 0, and nothing is NaN for valid drafts.
        n = _num_leading(in_draft & (u * q_x < p_x))  # i32[B]

        z_n = jnp.take_along_axis(z, n[:, None, None], axis=1)[:, 0]  # f32[B, V]
        p_n = jnp.exp(z_n - jnp.take_along_axis(lse, n[:, None], axis=1))
        rejected = n < num_draft  # bool[B]: recovered token; otherwise the bonus token
        if k > 0:
            q_n = jnp.take_along_axis(draft_probs, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
            residual = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)  # f32[B, V]
        else:
            residual = p_n
        # Bonus rows, and rejected rows whose residual is empty (q >= p everywhere, as when p == q), draw from
        # z_n itself: a bonus token is bit for bit the token plain decoding would draw at that position.
        from_p = ~rejected | (jnp.sum(residual, axis=-1) <= 0)
        logits_n = jnp.where(from_p[:, None], z_n, jnp.log(residual))
        key_n = jax.vmap(jax.random.fold_in)(keys, positions + n)
        last = categorical(key_n, logits_n)
        return _emit(draft_tokens, n, last)

    # An all-greedy batch needs neither the processed distribution nor random numbers, as in `sample`.
    return jax.lax.cond(jnp.all(is_greedy(sampling.temperature)), greedy, sampled)
