"""Held-out measures of a trained head: per-step (EAGLE) or per-head (Medusa) top-k accuracy, and the real
acceptance length of speculative decoding with the exported head.

Accuracies are counted on batches and summed on the host, so every held-out window counts once whatever the
batch size. A token is "right" when it is the target's own greedy choice at that position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.models.dflash import DFlashDrafter
from jaxspec.models.heads import EagleHead, MedusaHeads, Readout

from .batches import Batch
from .losses import dflash_blocks, dflash_labels, eagle_chains, medusa_targets, shift


def eagle_counts(head: EagleHead, readout: Readout, batch: Batch, *, depth: int) -> dict[str, jax.Array]:
    """Sums over a batch, for each drafting step s = 1..depth: chains whose step s is scored, those whose
    step-s token is the target's, and those whose steps 1..s are all the target's (see `losses.eagle_chains`)."""
    T = batch.inputs.shape[1]
    target = jnp.argmax(readout.logits(batch.features[:, 1:T + 1].astype(jnp.float32)), -1)  # [B, T]: x_{j+2}
    ok = batch.inputs & batch.label_ok[:, 1:T + 1]  # [B, T]
    draft = head.draft_readout(readout)
    counts, valid, prefix = {}, ok, None
    for s, pred in enumerate(eagle_chains(head, readout, batch, depth=depth), start=1):
        right = draft.token_ids(jnp.argmax(draft.logits(pred), -1)) == target
        if s > 1:  # the chain's start and every label along it must count
            valid = shift(valid, False) & ok
            prefix = shift(prefix, False) & right
        else:
            prefix = right
        counts[f"scored_{s}"] = jnp.sum(valid)
        counts[f"right_{s}"] = jnp.sum(right & valid)
        counts[f"all_right_{s}"] = jnp.sum(prefix & valid)
    return counts


def eagle_summary(counts: dict[str, float], depth: int) -> dict:
    acc = [counts[f"right_{s}"] / max(counts[f"scored_{s}"], 1) for s in range(1, depth + 1)]
    chain = [counts[f"all_right_{s}"] / max(counts[f"scored_{s}"], 1) for s in range(1, depth + 1)]
    return {
        "step_accuracy": [round(float(a), 4) for a in acc],  # step 1: true features; steps 2..: its own
        "chain_accuracy": [round(float(c), 4) for c in chain],  # P(steps 1..s all right)
        # Tokens a greedy chain of `depth` drafts would commit per step: the target's token + accepted drafts.
        "expected_acceptance_length": round(float(1 + sum(chain)), 4),
        "scored_positions": int(counts["scored_1"]),
    }


def dflash_counts(drafter: DFlashDrafter, readout: Readout, draft: Readout, batch: Batch, *,
                  stride: int) -> dict[str, jax.Array]:
    """Sums over a batch, as `eagle_counts` gives them for drafting steps, for block positions s = 1..K of blocks
    anchored at every `stride`-th window position of the loss region: a draft (scored through `draft`, the
    readout drafting uses) is right when it is the target's greedy token (over its whole vocabulary, `readout`)."""
    T = batch.inputs.shape[1]
    depth = drafter.block_size - 1
    anchors = jnp.broadcast_to(jnp.arange(0, T, stride, dtype=jnp.int32), (batch.inputs.shape[0], -(-T // stride)))
    eligible = jnp.take_along_axis(batch.inputs & batch.label_ok[:, 1:T + 1], anchors, axis=1)  # [B, M]
    target_logits, ok = dflash_labels(readout, batch, anchors, depth)
    hidden = dflash_blocks(drafter, readout, batch, anchors)[:, :, 1:]  # [B, M, K, D]
    right = draft.token_ids(jnp.argmax(draft.logits(hidden), -1)) == jnp.argmax(target_logits, -1)
    valid = eligible[..., None] & (jnp.cumsum(~ok, axis=2) == 0)  # the anchor and every label up to s count
    prefix = jnp.cumprod(right, axis=2).astype(bool)
    counts = {}
    for s in range(1, depth + 1):
        counts[f"scored_{s}"] = jnp.sum(valid[..., s - 1])
        counts[f"right_{s}"] = jnp.sum(right[..., s - 1] & valid[..., s - 1])
        counts[f"all_right_{s}"] = jnp.sum(prefix[..., s - 1] & valid[..., s - 1])
    return counts


def medusa_counts(heads: MedusaHeads, readout: Readout, batch: Batch, *, top_k: int) -> dict[str, jax.Array]:
    """Sums over a batch: per head, the scored positions [M] and how often the label had rank r [M, top_k]."""
    T = batch.inputs.shape[1]
    logits = readout.logits(heads(batch.features[:, :T].astype(jnp.float32)))  # f32[B, T, M, V]
    labels, mask = medusa_targets(batch, heads.num_heads)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)  # [B, T, M, 1]
    rank = jnp.sum(logits > label_logit, axis=-1)  # [B, T, M]: 0 = the head's top candidate
    at_rank = (rank[..., None] == jnp.arange(top_k)) & mask[..., None]  # [B, T, M, k]
    return {"scored": jnp.sum(mask, axis=(0, 1)), "at_rank": jnp.sum(at_rank, axis=(0, 1))}


def medusa_summary(counts: dict[str, np.ndarray]) -> dict:
    scored = np.maximum(np.asarray(counts["scored"], np.float64), 1)[:, None]
    rank_probs = np.asarray(counts["at_rank"], np.float64) / scored  # [M, k]
    return {
        "top_k_accuracy": np.round(np.cumsum(rank_probs, axis=1), 4).tolist(),  # [M][k]: top-1 .. top-k
        "rank_probs": np.round(rank_probs, 5).tolist(),  # [M][k]: P(head m's rank-r candidate is right)
        "scored_positions": int(np.asarray(counts["scored"])[0]),
    }


def accumulate(count_fn, batches: Iterable[Batch]) -> dict[str, np.ndarray]:
    """Host-side sums of `count_fn(batch)` over all batches."""
    total: dict[str, np.ndarray] = {}
    for batch in batches:
        for name, value in jax.device_get(count_fn(batch)).items():
            total[name] = total.get(name, 0) + np.asarray(value, np.float64)
    return total


def acceptance(lm, method: str, head_path: str | Path, prompts, *, max_new_tokens: int) -> dict | None:
    """Mean acceptance length of greedy speculative decoding with the head at `head_path` on `prompts`, its default
    draft scored whole: with widths chosen by measured cost (the default above one row) the figure would follow
    this machine's costs, not the head."""
    try:
        spec = jaxspec.SpecConfig(method=method, head_path=str(head_path), cost_aware=False)
    except (TypeError, ValueError) as e:  # SpecConfig without head_path support (being added)
        print(f"acceptance evaluation unavailable: SpecConfig(head_path=...) was rejected: {e}")
        return None
    s = jaxspec.generate(lm, list(prompts), max_new_tokens=max_new_tokens, spec=spec).stats
    # Speed is left out: this single call includes compiling the speculative loop (scripts/bench_heads.py
    # measures speed). Positions never drafted have no rate (None, not NaN: the metadata is strict JSON).
    return {"method": method, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "cost_aware": False,
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            "acceptance_rate_per_position": [None if a != a else round(a, 4) for a in s.acceptance_rate_per_position]}
