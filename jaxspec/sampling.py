"""From logits to the processed distribution that plain sampling draws from and verification judges by.

Order of operations (as Hugging Face and vLLM apply them): temperature, top-k, top-p, min-p; greedy rows
(temperature below `GREEDY_BELOW`, 0 included) become a point mass on the argmax. Excluded tokens get logit
-inf, so their probability is exactly zero, which lossless rejection sampling relies on. Thresholds compare
values, so tokens tied with the k-th (or the last top-p) token are kept too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampling_params import GREEDY_BELOW, SamplingParams


def is_greedy(temperature: jax.Array) -> jax.Array:
    """bool[...] rows that decode greedily: temperature below `GREEDY_BELOW`."""
    return jnp.asarray(temperature) < GREEDY_BELOW


def _per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """Per-row values [B] shaped to broadcast against like [B, ..., V]."""
    x = jnp.asarray(x)
    return jnp.reshape(x, x.shape + (1,) * (like.ndim - x.ndim))


# Top-k and top-p rank only the largest logits: `lax.top_k` of this many, not a sort of the vocabulary.
TOP_CANDIDATES = 256


def _kept_in_prefix(ranked: jax.Array, k: jax.Array, top_p: jax.Array, lse: jax.Array) -> jax.Array:
    """i32[B, ..., 1] how many of the largest logits top-k then top-p keep, counted within `ranked` f32[B, ..., n]
    (the n largest logits, descending), given lse f32[B, ..., 1] = log-sum-exp of the k largest."""
    in_top_k = jnp.arange(ranked.shape[-1]) < k
    probs = jnp.where(in_top_k, jnp.exp(ranked - lse), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The smallest prefix whose mass reaches top_p: a token is kept when the mass ranked above it is short.
    # top_p = 1 keeps every token outright: float32 running sums can reach 1 before the tail.
    return jnp.sum(in_top_k & ((mass_before < top_p) | (top_p >= 1)), axis=-1, keepdims=True)


def _top_k_top_p_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest logit kept by top-k then top-p: f32[B, ..., 1].

    Ranked from the `TOP_CANDIDATES` largest logits (`lax.top_k`), which decide it whenever top-k is at most
    that many, or there is no top-k and the top-p set ends within them; the mass of the whole vocabulary comes
    from one pass. Otherwise (any row) the batch bisects for it (`_bisected_threshold`). Why: on XLA:CPU a sort of
    49152 logits costs about fifty times a top-k of 256 (docs/cpu-performance.md); and at temperature 1 with
    top-p 0.95, 7.6% of the default model's positions on code keep more than 256 tokens, so nearly every
    verification step over 8 rows has such a position.
    """
    vocab = z.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # i32[B, ..., 1]
    n = min(vocab, TOP_CANDIDATES)
    top = jax.lax.top_k(z, n)[0]  # f32[B, ..., n] descending
    # log-sum-exp of the k largest: within the candidates when k <= n; the whole vocabulary when k = V.
    lse_top = jax.nn.logsumexp(jnp.where(jnp.arange(n) < k, top, -jnp.inf), axis=-1, keepdims=True)
    lse = jnp.where(k <= n, lse_top, jax.nn.logsumexp(z, axis=-1, keepdims=True))
    kept = _kept_in_prefix(top, k, top_p, lse)
    decided = (k <= n) | ((k == vocab) & (kept < n))

    def from_candidates():
        return jnp.take_along_axis(top, jnp.maximum(kept - 1, 0), axis=-1)

    return jax.lax.cond(jnp.all(decided), from_candidates, lambda: _bisected_threshold(z, k, top_p))


def _order_key(x: jax.Array) -> jax.Array:
    """i32[...] keys ordered as the float32 values x are (-0 just below +0): the bits, with a negative value's
    magnitude bits flipped so that larger magnitudes sort lower."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_value(key: jax.Array) -> jax.Array:
    """f32[...] the value whose `_order_key` is key."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _smallest_key_where(holds, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """i32[...] the smallest key t in (lo, hi] with holds(t), for a predicate that is false at lo, true at hi and
    monotone in between: 32 halvings of the interval, each one pass over the vocabulary."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without int32 overflow
        ok = holds(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _bisected_threshold(z: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[B, ..., 1] the smallest logit kept by top-k then top-p, found by bisecting over the float order rather
    than sorting: the k-th largest logit is the smallest key t with fewer than k logits above t, and the top-p
    set is every token whose top-k tokens above it hold less than top_p of the top-k mass (as ranking them would
    give; ties with the last kept token are kept). 64 passes over the vocabulary, still several times cheaper
    than a sort on XLA:CPU (docs/cpu-performance.md). Its masses are sums over the vocabulary rather than a
    float32 running sum over 49152 ranked tokens, so where they differ at the boundary it agrees with a float64
    ranking."""
    keys = _order_key(z)  # i32[B, ..., V]
    below_min = jnp.min(keys, axis=-1, keepdims=True) - 1
    top = jnp.max(keys, axis=-1, keepdims=True)
    # Fewer than k logits above t, i.e. t is at or above the k-th largest: false below the minimum, true at the top.
    kth = _smallest_key_where(lambda t: jnp.sum(keys > t, axis=-1, keepdims=True) < k, below_min, top)
    best = jnp.max(z, axis=-1, keepdims=True)
    weight = jnp.exp(z - best)  # f32[B, ..., V] unnormalised probabilities
    above = keys > kth
    # The top-k mass is that of exactly k tokens, as ranking them gives: those above the k-th logit and as many
    # of its ties as make up k.
    ties = k - jnp.sum(above, axis=-1, keepdims=True)
    top_k_mass = jnp.sum(jnp.where(above, weight, 0.0), axis=-1, keepdims=True) + ties * jnp.exp(_key_value(kth) - best)

    def short_above(t):  # the top-k mass above t is short of top_p: tokens from t up are kept
        return jnp.sum(jnp.where(keys > t, weight, 0.0), axis=-1, keepdims=True) < top_p * top_k_mass

    kept_from = _smallest_key_where(short_above, kth - 1, top)
    # top_p = 1 keeps every top-k token outright: float32 sums can reach 1 before the tail.
    return _key_value(jnp.where(top_p >= 1, kth, jnp.maximum(kept_from, kth)))


def process_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """f32[B, ..., V] logits of the processed distribution; `sampling` fields are scalars or arrays [B]."""
    z = logits.astype(jnp.float32)
    temperature = _per_row(sampling.temperature, z)
    top_k, top_p = _per_row(sampling.top_k, z), _per_row(sampling.top_p, z)
    min_p = _per_row(sampling.min_p, z)
    greedy = is_greedy(temperature)
    z = z / jnp.where(greedy, 1.0, temperature)  # finite: non-greedy temperatures are >= GREEDY_BELOW

    # Sorting the vocabulary is the costly part: skip it when no row asks for top-k or top-p.
    needs_sort = jnp.any((top_k > 0) | (top_p < 1))
    threshold = jax.lax.cond(needs_sort, lambda: _top_k_top_p_threshold(z, top_k, top_p),
                             lambda: jnp.full(z.shape[:-1] + (1,), -jnp.inf))
    z = jnp.where(z >= threshold, z, -jnp.inf)

    best = jnp.max(z, axis=-1, keepdims=True)
    # min-p keeps tokens whose probability is at least min_p times the most likely one's.
    z = jnp.where((min_p > 0) & (z - best < jnp.log(jnp.maximum(min_p, 1e-38))), -jnp.inf, z)

    one_hot = jnp.where(jnp.arange(z.shape[-1]) == argmax(z)[..., None], 0.0, -jnp.inf)
    return jnp.where(greedy, one_hot, z)


def processed_probs(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """f32[B, ..., V] probabilities of the processed distribution."""
    return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row from its own seed u32[B] and token position i32[B], nothing else.

    Keys never depend on the slot or the batch neighbours, so a seeded request samples the same tokens
    alone, in any batch, and with or without speculation.
    """
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


# `argmax` and `categorical` work over the vocabulary in blocks of the largest of these sizes that divides it.
VOCAB_BLOCKS = (512, 256, 128)


def _vocab_block(vocab: int) -> int | None:
    """The block size for a vocabulary of `vocab` tokens, or None to work over it whole (no size divides it, or
    it is small: fewer than four blocks save nothing)."""
    return next((b for b in VOCAB_BLOCKS if vocab % b == 0 and vocab >= 4 * b), None)


def _argmax_flat(logits: jax.Array) -> jax.Array:
    """i32[...] the first index of the largest logit, as two plain reductions: XLA:CPU lowers `jnp.argmax` to a
    variadic (value, index) reduction that does not vectorise."""
    best = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(logits == best, index, logits.shape[-1]), axis=-1)


def argmax(logits: jax.Array) -> jax.Array:
    """i32[...] index of the largest logit (the first on ties).

    In two levels: the maximum of each block of logits (`VOCAB_BLOCKS`; one pass over the vocabulary, a plain
    reduction that vectorises), the first block holding the overall maximum, then the first index of it within
    that block. A vocabulary that no block size divides, or a small one, is searched whole. On XLA:CPU
    `jnp.argmax` lowers to a (value, index) reduction that does not vectorise, and a max then a min over matching
    indices is two passes over the whole vocabulary; at the shapes of verify steps both cost several times this
    (docs/cpu-performance.md). On a GPU `jnp.argmax` is as fast or faster, so there it is used; both give the
    same index.
    """
    if jax.default_backend() != "cpu":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    block = _vocab_block(vocab)
    if block is None:
        return _argmax_flat(logits)
    blocks = logits.reshape(logits.shape[:-1] + (vocab // block, block))
    first = _argmax_flat(jnp.max(blocks, axis=-1))  # i32[...] the first block holding the maximum
    within = jnp.take_along_axis(blocks, first[..., None, None], axis=-2)[..., 0, :]  # [..., block]
    return first * block + _argmax_flat(within)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """i32[...] the index whose interval of the running sum of weights f32[..., n] (>= 0) holds u * total, u
    f32[...] in [0, 1).

    The first index whose running sum exceeds u * total always has a positive weight (a zero weight does not
    raise the sum), so a token of probability zero is never drawn. When rounding puts u * total at the total
    itself, no running sum exceeds it: then the last index with a positive weight.
    """
    running = jnp.cumsum(weights, axis=-1)  # f32[..., n], non-decreasing in float32 too
    index = jnp.sum(running <= (u * running[..., -1])[..., None], axis=-1, dtype=jnp.int32)
    last_positive = jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[-1], dtype=jnp.int32), 0), axis=-1)
    return jnp.minimum(index, last_positive)


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """i32[...] one token per row drawn from softmax(logits f32[..., V]), with key[...] (or raw uint32[..., 2])
    one key per row. Every sampled token in jaxspec is drawn here: plain decoding, verification, drafting.

    By inverse transform in two levels, with two uniforms per row: the block of the vocabulary (`VOCAB_BLOCKS`)
    with probability its share of the mass, then the token within the block with probability its share of the
    block's. Both levels together draw token i with probability exp(z_i) / sum exp(z), exactly as
    `jax.random.categorical`, up to float32 rounding of the running sums (intervals move by about 1e-7 of the
    mass; Gumbel-max in float32 likewise never draws a token more than about 20 nats below the best). The reason
    is cost: `jax.random.categorical` draws Gumbel noise, a threefry draw and two logarithms for every token of
    the vocabulary. On XLA:CPU, inside a jitted loop as the decode loop runs it, that is a noticeable share of a
    sampled decode step and, over [8, 9, 49152] (verifying 8 drafts), more than a whole plain step; this costs
    about a tenth to a twentieth of it (docs/cpu-performance.md): one exponential per token, block sums and two
    short running sums.
    """
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)  # raw uint32[..., 2] keys (jax.random.PRNGKey)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    z = logits.astype(jnp.float32)
    best = jnp.max(z, axis=-1, keepdims=True)
    weights = jnp.exp(z - jnp.where(jnp.isfinite(best), best, 0.0))  # f32[..., V], 0 at excluded tokens
    u = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys.reshape(-1)).reshape(lead + (2,))
    block = _vocab_block(vocab)
    if block is None:
        return _inverse_cdf(weights, u[..., 0])
    blocks = weights.reshape(lead + (vocab // block, block))  # f32[..., V / block, block]
    chosen = _inverse_cdf(jnp.sum(blocks, axis=-1), u[..., 0])  # i32[...]
    within = jnp.take_along_axis(blocks, chosen[..., None, None], axis=-2)[..., 0, :]  # f32[..., block]
    return chosen * block + _inverse_cdf(within, u[..., 1])


def draw(keys: jax.Array, logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """i32[B, ...] one token per row and position from the processed distribution of logits f32[B, ..., V], with
    key[B, ...]: `categorical(keys, process_logits(logits, sampling))`, token for token.

    A batch whose rows all sample at a temperature alone (no greedy row, no top-k, top-p or min-p) draws from
    logits / temperature directly, which is what processing computes for such rows. The reason is cost: the
    processing's passes over the vocabulary, behind conditionals that XLA:CPU does not fuse across, more than
    double the cost of rejection sampling at [8, 9, 49152]; with this shortcut, inside a loop, it costs little
    more than greedy verification.
    """
    temperature = _per_row(sampling.temperature, logits)
    plain = ~is_greedy(temperature) & (_per_row(sampling.top_k, logits) <= 0) \
        & (_per_row(sampling.top_p, logits) >= 1) & (_per_row(sampling.min_p, logits) <= 0)

    def at_temperature():
        return categorical(keys, logits.astype(jnp.float32) / jnp.where(plain, temperature, 1.0))

    return jax.lax.cond(jnp.all(plain), at_temperature, lambda: categorical(keys, process_logits(logits, sampling)))


def sample(keys: jax.Array, logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """i32[B] tokens drawn from the processed distribution of logits [B, V], key [B] per row."""
    # An all-greedy batch needs neither the processed distribution nor random numbers over the vocabulary.
    return jax.lax.cond(jnp.all(is_greedy(sampling.temperature)), lambda: argmax(logits),
                        lambda: draw(keys, logits, sampling))
