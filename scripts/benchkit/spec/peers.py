"""transformers on the same token ids at batch 1: plain decoding and its prompt lookup (3 and 10 tokens)."""

from __future__ import annotations

import time

import jaxspec
from jaxspec.models.loading import named_model_path

from .. import peer_hf
from ..tables import fmt


def run_peers(peer, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int) -> dict:
    out = {}
    for name, lookup in (("plain", None), ("prompt_lookup_3", 3), ("prompt_lookup_10", 10)):
        r = peer_hf.run_peer(peer, prompts, max_new_tokens=new_tokens, batch_size=1, prompt_lookup_num_tokens=lookup,
                             temperature=temperature, seed=seed)
        out[name] = {"tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"],
                     "generated_tokens": sum(len(o) for o in r["outputs"]), "_outputs": r["outputs"]}
    return out


def subset_tokens_per_s(run: dict, count: int) -> float:
    """tokens/s of a batch-1 run over its first `count` prompts (one call per prompt)."""
    calls = run["_per_call"][:count]
    return sum(n for _, n in calls) / sum(s for s, _ in calls)


def compare_with_peers(runs_by_workload: dict[str, list[dict]], prompts: dict[str, list[list[int]]],
                       temperatures: list[float], count: int, new_tokens: int, seed: int, sam_label: str) -> list[dict]:
    """The peer on the first `count` prompts of each workload at each temperature, beside jaxspec's batch-1
    `none` and adaptive sam runs of the same prompts; greedy `none` must equal the peer's plain output."""
    path = named_model_path(jaxspec.DEFAULT_MODEL)
    peer = peer_hf.load_peer(str(path.parent), path.name)
    out = []
    for workload, ps in prompts.items():
        runs = runs_by_workload[workload]
        for temperature in temperatures:
            t0 = time.perf_counter()
            p = run_peers(peer, ps[:count], new_tokens, temperature, seed)
            p.update(workload=workload, temperature=temperature, prompts=count)
            best = max(p["prompt_lookup_3"]["tokens_per_s"], p["prompt_lookup_10"]["tokens_per_s"])
            none1 = next((r for r in runs if r["config"] == "none" and r["batch"] == 1
                          and r["temperature"] == temperature), None)
            sam1 = next((r for r in runs if r["config"] == sam_label and r["batch"] == 1
                         and r["temperature"] == temperature), None)
            if none1 is not None:
                p["jaxspec_none_tokens_per_s"] = subset_tokens_per_s(none1, count)
                if temperature == 0:
                    same = sum(a == b for a, b in zip(none1["_outputs"][:count], p["plain"]["_outputs"]))
                    p["none_equals_peer_plain"] = f"{same}/{count}"
            if sam1 is not None:
                p["jaxspec_sam_tokens_per_s"] = subset_tokens_per_s(sam1, count)
                p["sam_over_best_lookup"] = p["jaxspec_sam_tokens_per_s"] / best
            out.append(p)
            print(f"peer {workload:10s} T={temperature:g}: plain {p['plain']['tokens_per_s']:.1f}, lookup 3 "
                  f"{p['prompt_lookup_3']['tokens_per_s']:.1f}, lookup 10 "
                  f"{p['prompt_lookup_10']['tokens_per_s']:.1f}"
                  f" tok/s; sam / best lookup {fmt(p.get('sam_over_best_lookup'))}x; none == peer plain "
                  f"{p.get('none_equals_peer_plain', '-')} (+{time.perf_counter() - t0:.0f} s)", flush=True)
    return out
