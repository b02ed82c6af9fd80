#!/usr/bin/env python
"""`jaxspec.rejection_sample` in a loop of your own: speculative sampling from a toy model, checked exactly.

    python examples/rejection_sample_loop.py                      # V=5 tokens, K=2 drafts, 8 x 8192 sequences
    python examples/rejection_sample_loop.py --replicas 2 --rows 4096               # smaller and quicker

The target is a Markov chain over V tokens (the next token's logits depend on the previous token only), so
the exact distribution of the first T generated tokens is a product of transition probabilities, computed
here in closed form. The draft is another Markov chain, deliberately worse than the target. Each step drafts
K tokens from it, scores them with the target's logits at every drafted position, and lets
`rejection_sample` decide what to keep: the loop is jitted, and `jax.vmap` runs it over independent
replicas (one key each) of a batch of rows.

Five samplers produce N sequences each, and the total-variation distance between their empirical
distribution of the first T tokens and the exact one is printed:

- exact: the target chain sampled token by token (the noise floor: N finite samples are never at distance 0);
- speculative, sampled drafts: `rejection_sample` with the draft's probabilities (accepted with min(1, p/q));
- speculative, greedy drafts: the draft's argmax chain with `draft_probs=None` (accepted while it equals the
  target's own sample);
- naive (negative control): every draft accepted as it is; its output follows the draft, not the target;
- stale keys (negative control): sampled drafts verified without `positions=`, so every step reuses the
  same random numbers: the mistake a hand-written loop is most likely to make.

The two speculative samplers land at the noise floor; the two controls do not (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec

MODES = ("sampled", "greedy", "naive", "stale keys")
CONTROLS = ("naive", "stale keys")


def toy_chains(vocab: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """(target, draft) transition logits f32[V, V]: row a holds the logits of the token after a.

    The draft is the target blurred with noise and flattened (temperature 2): close enough to accept often,
    different enough that accepting it blindly is visibly wrong.
    """
    k_target, k_noise = jax.random.split(jax.random.key(seed))
    target = 1.5 * jax.random.normal(k_target, (vocab, vocab))
    draft = (target + 1.5 * jax.random.normal(k_noise, (vocab, vocab))) / 2.0
    return target, draft


def exact_distribution(target: jax.Array, start: int, length: int) -> np.ndarray:
    """f64[V**T]: P(x_1 .. x_T | x_0 = start) of the target chain, flattened in the order `encode` uses."""
    logits = np.asarray(target, np.float64)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)  # [V, V]: row a is P(next | a)
    joint = p[start]  # [V]
    for _ in range(length - 1):
        # The next token depends on the sequence's last token, its index modulo V (x_t least significant).
        last = np.arange(joint.size) % p.shape[0]  # [V**t]
        joint = (joint[:, None] * p[last]).reshape(-1)  # [V**t, V] -> [V**(t+1)]
    return joint


def encode(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """i64[N]: each row of tokens i32[N, T] as one base-V number (x_1 most significant)."""
    weights = vocab ** np.arange(tokens.shape[1] - 1, -1, -1)
    return tokens.astype(np.int64) @ weights


def total_variation(tokens: np.ndarray, exact: np.ndarray, vocab: int) -> float:
    """0.5 * sum |empirical - exact| over the V**T sequences of length T."""
    counts = np.bincount(encode(tokens, vocab), minlength=exact.size)
    return 0.5 * float(np.abs(counts / counts.sum() - exact).sum())


def exact_samples(key: jax.Array, target: jax.Array, start: int, rows: int, length: int) -> jax.Array:
    """i32[rows, T]: the target chain sampled token by token (what speculative sampling must reproduce)."""

    def step(prev, k):
        nxt = jax.random.categorical(k, target[prev]).astype(jnp.int32)  # i32[rows]
        return nxt, nxt

    _, tokens = jax.lax.scan(step, jnp.full((rows,), start, jnp.int32), jax.random.split(key, length))
    return tokens.T  # scan stacks time first: [T, rows] -> [rows, T]


def speculative_samples(key: jax.Array, target: jax.Array, draft: jax.Array, *, start: int, rows: int,
                        length: int, k: int, mode: str) -> tuple[jax.Array, jax.Array]:
    """(tokens i32[rows, T], tokens per step f32[]) from draft-then-verify steps until every row holds T tokens.

    Each row carries its committed tokens and their count; rows that are already done draft nothing
    (num_draft 0) and their extra output is never written.
    """
    k_draft, k_accept = jax.random.split(key)
    # One base key per row for the whole run, as generate's rows have: rejection_sample folds in the absolute
    # position of each output token (`positions=`), so every position draws its own numbers. Without
    # `positions` every step would reuse the numbers of positions 0..K and bias the output ("stale keys").
    accept_keys = jax.random.split(k_accept, rows)  # key[rows]
    # Drafts need numbers of their own, independent of verification's.
    draft_keys = jax.random.split(k_draft, rows)  # key[rows]
    sampling = jaxspec.SamplingParams(temperature=1.0)  # the target's raw distribution, unprocessed
    width = length + k + 1  # room for the last step's overshoot past T

    def body(carry):
        buf, count, last, step, row_steps = carry  # i32[rows, W], i32[rows], i32[rows], i32[], i32[rows]
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(draft_keys, step)  # key[rows]
        # Draft a chain of K tokens from the draft model, each conditioned on the previous one.
        prev, drafts, probs = last, [], []
        for j in range(k):
            logits = draft[prev]  # f32[rows, V]
            if mode == "greedy":
                tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            else:
                tok = jax.vmap(jax.random.categorical)(jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, j),
                                                       logits).astype(jnp.int32)
            drafts.append(tok)
            probs.append(jax.nn.softmax(logits, axis=-1))
            prev = tok
        draft_tokens = jnp.stack(drafts, axis=1)  # i32[rows, K]
        draft_probs = jnp.stack(probs, axis=1)  # f32[rows, K, V]
        # One "forward" of the target over [last, d_0 .. d_{K-1}]: the logits of the token after each of them.
        context = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # i32[rows, K+1]
        target_logits = target[context]  # f32[rows, K+1, V]
        num_draft = jnp.where(count < length, k, 0).astype(jnp.int32)  # i32[rows]

        if mode == "naive":
            # Negative control: keep every draft and skip the target's verdict.
            out = jnp.concatenate([draft_tokens, jnp.full((rows, 1), -1, jnp.int32)], axis=1)  # i32[rows, K+1]
            n = num_draft
        else:
            out, n = jaxspec.rejection_sample(accept_keys, target_logits, draft_tokens,
                                              None if mode == "greedy" else draft_probs, num_draft, sampling,
                                              positions=None if mode == "stale keys" else count)
            # out i32[rows, K+1] (-1 padded), n i32[rows]
            n = jnp.where(count < length, n, 0)  # done rows commit nothing
        # Commit: out[:, j] goes to slot count + j for j < n (slots past the buffer are dropped by the scatter).
        j = jnp.arange(k + 1)
        slots = jnp.where(j < n[:, None], count[:, None] + j, width)  # i32[rows, K+1]; width = out of range
        buf = buf.at[jnp.arange(rows)[:, None], slots].set(out, mode="drop")
        last = jnp.where(n > 0, jnp.take_along_axis(out, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], last)
        return buf, count + n, last, step + 1, row_steps + (num_draft > 0)

    init = (jnp.full((rows, width), -1, jnp.int32), jnp.zeros((rows,), jnp.int32),
            jnp.full((rows,), start, jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((rows,), jnp.int32))
    buf, count, _, _, row_steps = jax.lax.while_loop(lambda c: jnp.any(c[1] < length), body, init)
    # Committed tokens (the last step's overshoot past T included) per step a row took part in.
    return buf[:, :length], jnp.sum(count) / jnp.sum(row_steps)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=5, help="tokens V of the toy chains (default: %(default)s)")
    parser.add_argument("--length", type=int, default=4,
                        help="tokens T per sequence whose joint distribution is compared (V**T outcomes) "
                             "(default: %(default)s)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=2, help="drafts K per step "
                        "(default: %(default)s)")
    parser.add_argument("--rows", type=int, default=8192, help="rows per batch (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=8,
                        help="independent batches, one key each, run by jax.vmap (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    args = parser.parse_args(argv)
    v, t, k, rows, reps = args.vocab, args.length, args.num_speculative_tokens, args.rows, args.replicas

    target, draft = toy_chains(v, args.seed)
    start = 0
    exact = exact_distribution(target, start, t)
    keys = jax.random.split(jax.random.key(args.seed + 1), reps)  # key[R]
    n = rows * reps

    # Every sampler runs over R replicas with vmap; the output [R, rows, T] is pooled into N = R * rows rows.
    floor_tokens = jax.jit(jax.vmap(functools.partial(exact_samples, target=target, start=start, rows=rows,
                                                      length=t)))(keys)
    results = {"exact": {"tv": total_variation(np.asarray(floor_tokens).reshape(n, t), exact, v)}}
    print(f"target: a Markov chain over V={v} tokens; draft: a blurred copy; K={k}; N={n} sequences of T={t} "
          f"tokens ({reps} replicas x {rows} rows, vmapped)")
    print(f"{'sampler':<12} {'TV to exact':>12} {'tokens/step':>12}")
    print(f"{'exact':<12} {results['exact']['tv']:>12.4f} {1.0:>12.2f}   (the noise floor of N samples)")
    for mode in MODES:
        run = jax.jit(jax.vmap(functools.partial(speculative_samples, target=target, draft=draft, start=start,
                                                 rows=rows, length=t, k=k, mode=mode)))
        tokens, per_step = run(keys)  # i32[R, rows, T], f32[R]
        tokens = np.asarray(tokens).reshape(n, t)
        per_step = float(np.mean(per_step))
        results[mode] = {"tv": total_variation(tokens, exact, v), "tokens_per_step": per_step}
        print(f"{mode:<12} {results[mode]['tv']:>12.4f} {per_step:>12.2f}")

    floor = results["exact"]["tv"]
    # Twice the floor plus a margin holds for an unbiased sampler with overwhelming probability (the TV of N
    # samples concentrates around its mean); a biased sampler stays a fixed distance away however large N is.
    bound = 2 * floor + 0.01
    lossless = all(results[m]["tv"] <= bound for m in ("sampled", "greedy"))
    results.update(bound=bound, lossless=lossless, control_fails=all(results[m]["tv"] > bound for m in CONTROLS))
    print(f"speculative samplers within {bound:.4f} of the exact distribution: {lossless}; "
          f"both controls outside it: {results['control_fails']}")
    return results


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["lossless"] and out["control_fails"] else 1)
