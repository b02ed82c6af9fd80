#!/usr/bin/env python
"""Generate text with jaxspec from the command line.

    python scripts/generate.py "def fibonacci(n):"
    python scripts/generate.py --chat "Write a haiku about JAX." --temperature 0.7 --seed 1
"""

from __future__ import annotations

import argparse
import sys

import jaxspec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the prompt text (or the user message with --chat)")
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL,
                        help=f"named model ({', '.join(jaxspec.NAMED_MODELS)}), a .gguf file or a Hugging Face "
                             "directory (default: %(default)s)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="in (0, 1] (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0, help="in [0, 1] (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--spec", choices=("none", "ngram", "sam", "self_draft"), default="none",
                        help="speculative decoding method; output is the same, speed differs (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="K, the most drafts per step (default: the method's)")
    args = parser.parse_args(argv)

    try:
        sampling = jaxspec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          min_p=args.min_p, seed=args.seed)
        lm = jaxspec.load_model(args.model, dtype=args.dtype)
        prompt = args.prompt
        if args.chat:
            if lm.tokenizer is None:
                raise ValueError(f"--chat needs a tokenizer with a chat template; model {lm.name!r} has none")
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt = lm.tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
        spec = jaxspec.SpecConfig(method=args.spec, num_speculative_tokens=args.num_speculative_tokens)
        result = jaxspec.generate(lm, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling, spec=spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = result.stats
    print(("" if args.chat else prompt) + result.text[0])
    print(f"\n[{s.generated_tokens} tokens, finish: {result.finish_reason[0]}; prefill {s.prompt_tokens} tokens in "
          f"{s.prefill_s:.2f} s; decode {s.decode_tokens_per_s:.1f} tokens/s (first call includes compilation)]",
          file=sys.stderr)
    if args.spec != "none":
        print(f"[{args.spec}: {s.steps} steps, {s.accepted}/{s.drafted} drafts accepted, "
              f"{s.mean_acceptance_length:.2f} tokens per step]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
