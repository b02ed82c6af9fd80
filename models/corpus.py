"""Draft corpora for the static suffix automaton: token sequences a model is likely to write again.

`SpecConfig(method="sam", sam_source="static" | "both")` drafts from the suffix automaton of a corpus
(`jaxspec.StaticSuffixAutomaton`). A corpus can be passed as `static_sam=...`; without one, the corpus shipped for
a named model (models/weights/<model>.sam_corpus.json, written by `python -m jaxspec.train.sam_corpus`) is used.
A file holds the sequences as token ids of one vocabulary and the separator put between them when the automaton
is built; what made them (command, prompts, model) rides along as metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .heads import WEIGHTS_DIR, read_vocab_file

CORPUS_KIND = "sam_corpus"  # the `kind` a corpus file declares
CORPUS_SUFFIX = ".sam_corpus.json"


def has_shipped_corpus(model_name: str) -> bool:
    """Whether a corpus is shipped for the named model (a model loaded from a path has none)."""
    return Path(model_name).name == model_name and (WEIGHTS_DIR / f"{model_name}{CORPUS_SUFFIX}").exists()


def shipped_corpus_path(model_name: str) -> Path:
    """The corpus shipped for the named model; ValueError saying how to make one when there is none."""
    path = WEIGHTS_DIR / f"{model_name}{CORPUS_SUFFIX}"
    if not has_shipped_corpus(model_name):
        raise ValueError(f"sam_source needs a corpus: static_sam is unset and no draft corpus is shipped for model "
                         f"{model_name!r}; pass static_sam=jaxspec.StaticSuffixAutomaton.build(...) or write one "
                         f"with `python -m jaxspec.train.sam_corpus --model ... --out ...` and load it "
                         f"(`jaxspec.models.corpus.load_corpus`)")
    return path


def save_corpus(path: str | Path, sequences: Sequence[Sequence[int]], *, separator: int, vocab_size: int,
                metadata: dict[str, Any] | None = None) -> Path:
    """Write token sequences (ids in [0, vocab_size)) and the separator that joins them, one sequence a line."""
    seqs = [[_plain_int(t) for t in s] for s in sequences]  # numpy ids as ints; anything else is refused below
    separator = _plain_int(separator)
    _check(seqs, separator, vocab_size, str(path))
    head = {"kind": CORPUS_KIND, "vocab_size": int(vocab_size), "separator": separator,
            "num_sequences": len(seqs), "num_tokens": sum(map(len, seqs)), **(metadata or {})}
    text = json.dumps(head, indent=2)
    body = ",\n    ".join(json.dumps(s, separators=(",", ":")) for s in seqs)
    text = text[: text.rindex("}")].rstrip() + ',\n  "sequences": [\n    ' + body + "\n  ]\n}\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def load_corpus(path: str | Path, vocab_size: int) -> tuple[list[list[int]], int]:
    """(sequences, separator) of a file written by `save_corpus`, for a model of `vocab_size` tokens; ValueError
    when it was made for another vocabulary size or is malformed."""
    path = Path(path)
    data = read_vocab_file(path, CORPUS_KIND, vocab_size, "sequences", what="draft corpus",
                           writer="jaxspec.train.sam_corpus")
    seqs, separator = data["sequences"], data.get("separator")
    _check(seqs, separator, vocab_size, str(path))
    return seqs, separator


def _plain_int(token):
    return int(token) if isinstance(token, (int, np.integer)) and not isinstance(token, bool) else token


def _check(seqs, separator, vocab_size: int, where: str) -> None:
    if not seqs or not all(isinstance(s, list) and s for s in seqs):
        raise ValueError(f"draft corpus {where!r} must hold at least one sequence, none of them empty")
    ids = [separator] + [t for s in seqs for t in s]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"draft corpus {where!r}: token ids and the separator must be integers")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"draft corpus {where!r} holds token id {bad} outside [0, {vocab_size})")
