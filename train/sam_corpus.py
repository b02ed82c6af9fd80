"""A draft corpus of the target's own writing, for the static suffix automaton: `python -m jaxspec.train.sam_corpus`.

The static source of `SpecConfig(method="sam", sam_source="both")` drafts what followed the longest match of a
row's suffix in a corpus. Text the target itself wrote predicts its next tokens best, so the corpus is the target's
greedy completions (prompt and completion, one sequence each) of prompts the benchmarks never ask:

- humaneval: HumanEval's training split as plain code to complete (`humaneval_split`);
- chat: the same tasks asked in a chat (`chat_prompts`, rendered with the model's chat template).

The held-out quarter of HumanEval, from which the benchmarks' prompts come, is never completed. The separator
between sequences is the model's end-of-sequence token, so a draft that runs past a completion's end proposes
the end of the answer.

    python -m jaxspec.train.sam_corpus --model smollm2-135m --out models/weights/smollm2-135m.sam_corpus.json
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Sequence

from .prompts import chat_prompts, humaneval_split

SOURCES = ("humaneval", "chat")


def corpus_prompts(lm, sources: Sequence[str] = SOURCES, limit: int | None = None) -> list[str]:
    """The prompts of each source, in order (`SOURCES`), the first `limit` of each (all by default)."""
    train, _ = humaneval_split()
    train = train[:limit]
    out: list[str] = []
    for source in sources:
        if source == "humaneval":
            out += train
        elif source == "chat":
            if lm.tokenizer is None or lm.tokenizer.chat_template is None:
                raise ValueError(f"source 'chat' needs a tokenizer with a chat template; {lm.name!r} has none")
            out += chat_prompts(lambda m: lm.tokenizer.apply_chat_template(m, add_generation_prompt=True), len(train))
        else:
            raise ValueError(f"source={source!r} must be one of {SOURCES}")
    return out


def complete(lm, prompts: Sequence[str], *, max_new_tokens: int, batch_size: int = 16,
             log=print) -> list[list[int]]:
    """Each prompt's token ids followed by the target's greedy completion (its stop token included).

    Greedy and lossless: sam drafts only to make it faster, the tokens are plain decoding's."""
    from jaxspec import SpecConfig, generate

    ids = [lm.tokenizer.encode(p) for p in prompts]
    out: list[list[int]] = []
    started = time.perf_counter()
    for i in range(0, len(ids), batch_size):
        batch = ids[i: i + batch_size]
        # A short last batch is padded with copies of its last prompt: one batch size, one compiled program.
        padded = batch + [batch[-1]] * (min(batch_size, len(ids)) - len(batch))
        result = generate(lm, padded, max_new_tokens=max_new_tokens, spec=SpecConfig(method="sam"))
        out += [p + t for p, t in zip(batch, result.token_ids)]
        log(f"{len(out)}/{len(ids)} prompts completed, {time.perf_counter() - started:.0f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    from jaxspec.limits import eos_ids
    from jaxspec.models.corpus import save_corpus
    from jaxspec.models.loading import load_model

    from .cli import model_file_parser

    parser = model_file_parser("python -m jaxspec.train.sam_corpus", __doc__,
                               "the file to write: models/weights/<model>.sam_corpus.json ships it for a named model")
    parser.add_argument("--sources", default=",".join(SOURCES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per completion (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of each source (default: all)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default: %(default)s)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    sources = tuple(s for s in args.sources.split(",") if s)
    for name, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--limit", 1 if args.limit is None else args.limit)):
        if value < 1:
            parser.error(f"{name}={value} must be >= 1")
    lm = load_model(args.model)
    if lm.tokenizer is None:
        parser.error(f"--model {args.model!r} has no tokenizer: the prompts are text")
    try:
        prompts = corpus_prompts(lm, sources, args.limit)
    except ValueError as e:
        parser.error(str(e))
    sequences = complete(lm, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    eos = eos_ids(lm)
    metadata = {"model": lm.name, "command": f"python -m jaxspec.train.sam_corpus {shlex.join(argv)}".strip(),
                "sources": {s: len(corpus_prompts(lm, (s,), args.limit)) for s in sources},
                "max_new_tokens": args.max_new_tokens}
    path = save_corpus(args.out, sequences, separator=int(eos[0]) if eos else 0, vocab_size=lm.config.vocab_size,
                       metadata=metadata)
    print(f"wrote {path}: {len(sequences)} sequences, {sum(map(len, sequences))} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
