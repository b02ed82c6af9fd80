"""The repository's text says what is true now: no narrative of past work in docs, docstrings or comments.

Sessions, issue numbers, run counters and dates tell when and by whom something was found; that history is in
git. Docs and code state the behaviour and the reason for it. Dates are allowed only where they record
provenance: the machine header of each generated block of docs/benchmarks.md, and the files in
`DATES_ALLOWED`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()
SCANNED = ["docs", "jaxspec", "models", "train", "scripts", "tests", "examples", "README.md", "Makefile",
           "pyproject.toml", "mkdocs.yml"]
NOT_SCANNED = ("models/weights/",)  # shipped weights and their metadata, whose "created" field is provenance

# Units and nouns that make "run 8 ..." a count of things run, not the number of a run.
_RUN_OBJECTS = (r"rows?|tokens?|steps?|times?|prompts?|requests?|workers?|threads?|chunks?|batch(?:es)?|layers?"
                r"|iterations?|rounds?|seconds?|minutes?|hours?|drafts?|positions?|slots?|columns?|forwards?"
                r"|jobs?|processes|cores?|epochs?|heads?|models?|programs?")
NARRATIVE = {
    "session or visit number": re.compile(r"\b(?:session|visit)s? #?\d+", re.IGNORECASE),
    "issue number": re.compile(r"\bissues? #?\d+\b", re.IGNORECASE),
    "pull request number": re.compile(r"\b(?:PR|pull request)s? #?\d+\b", re.IGNORECASE),
    "parenthesised #number": re.compile(r"\(#\d+\)"),
    "run counter": re.compile(rf"\bruns? #?\d+(?:-\d+)?\b(?![.\d%-])(?! ?(?:x|ms|s|µs|us)\b)"
                              rf"(?! (?:\w+ )?(?:{_RUN_OBJECTS})\b)", re.IGNORECASE),
    "first-time story": re.compile(r"\bfor the first time\b|\bfirst time on (?:a|an|the|this)\b", re.IGNORECASE),
    "relative date": re.compile(r"\b(?:\d+|a|an|one|two|three|few|several) (?:days?|weeks?|months?|years?) ago\b"
                                r"|\byesterday\b|\b(?:last|previous) session\b", re.IGNORECASE),
}
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Files whose dates are data, each with why.
DATES_ALLOWED = {
    # Its tests of benchkit.page and benchkit.machine feed a machine record through the generated
    # "Measured on ..., <date>:" header, whose format ends in a date.
    "tests/test_benchkit.py",
}
BENCH_PAGE = "docs/benchmarks.md"
_BENCH_BLOCK = re.compile(r"<!-- bench:([\w-]+) -->.*?<!-- /bench:\1 -->", re.DOTALL)


def _tracked_texts() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z", "--", *SCANNED], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    texts = {}
    for name in filter(None, names):
        if name == THIS or name.startswith(NOT_SCANNED) or not (REPO / name).is_file():
            continue
        try:
            texts[name] = (REPO / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binary files
            continue
    return texts


def _outside_bench_blocks(text: str) -> str:
    """The page with each generated block blanked (newlines kept, so line numbers stay right)."""
    return _BENCH_BLOCK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def narrative_lines(texts: dict[str, str]) -> list[str]:
    """'path:line: kind: text' for every line of narrative in `texts` (path -> contents)."""
    found = []
    for name, text in sorted(texts.items()):
        dated = "" if name in DATES_ALLOWED else (_outside_bench_blocks(text) if name == BENCH_PAGE else text)
        dated_lines = dated.splitlines()
        for number, line in enumerate(text.splitlines(), 1):
            kinds = [kind for kind, pattern in NARRATIVE.items() if pattern.search(line)]
            if number <= len(dated_lines) and DATE.search(dated_lines[number - 1]):
                kinds.append("date")
            found += [f"{name}:{number}: {kind}: {line.strip()}" for kind in kinds]
    return found


def test_patterns_catch_narrative_and_spare_ordinary_text():
    n = 14  # the samples' numbers are filled in here, so this file's own text narrates nothing
    caught = [f"as measured in session {n}.", f"Hardening (#{n}): bad input", f"Issue #{n}: top_k overflowed",
              "| XLA, run 2 | 1.00 |", "ran for the first time on a card", "fixed two weeks ago",
              f"(measured 2026-11-{n})", f"see issues {n} and 15", f"between visits {n} and 4", "runs 1 and 2 agree"]
    spared = ["one run of the suite", "a run of 64 tokens", "engine.run(prompts)", "host visits (streaming)",
              "a second run skips most of the compiling", "XLA:CPU runs 2-7 rows no faster than 8",
              "c(2) to c(17) run 0.96 to 1.1 plain steps", "workers run 2 processes", "loaded once per session",
              "minutes on a small CPU the first time", "the run took 3 s"]
    assert len(narrative_lines({f"c{i}.md": line for i, line in enumerate(caught)})) == len(caught)
    assert narrative_lines({f"s{i}.md": line for i, line in enumerate(spared)}) == []
    page = "<!-- bench:a -->\nMeasured on x, 2026-11-28:\n<!-- /bench:a -->\nout 2026-11-28\n"
    assert narrative_lines({BENCH_PAGE: page}) == [f"{BENCH_PAGE}:4: date: out 2026-11-28"]


def test_tracked_text_has_no_narrative():
    texts = _tracked_texts()
    assert "jaxspec/__init__.py" in texts and BENCH_PAGE in texts  # the listing found the tree
    found = narrative_lines(texts)
    assert not found, ("say what is true now and why (history belongs in git; one machine's figures in "
                       "docs/benchmarks.md):\n" + "\n".join(found))
