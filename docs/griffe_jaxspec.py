"""Griffe extensions for the API reference (mkdocs.yml loads both).

`PackageDirs`: pyproject.toml installs models/ and train/ inside the `jaxspec` namespace
(`[tool.setuptools.package-dir]`). Griffe reads source files and looks for subpackages only inside jaxspec/,
so without this the reference could neither render `jaxspec.models` and `jaxspec.train` nor resolve the
names `jaxspec/__init__.py` re-exports from `jaxspec.models.loading`.

`CommentDocstrings`: the code documents dataclass fields with comments (`tokens: jax.Array  # i32[B, K] ...`)
rather than attribute docstrings. A field without a docstring gets its trailing comment, or else the block
of comment lines right above it, as its docstring, so the reference shows the shapes and meanings.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import griffe

_ROOT = Path(__file__).resolve().parent.parent
# Subpackage name -> folder, as [tool.setuptools.package-dir] maps them.
_PACKAGE_DIRS = {"jaxspec": {"models": _ROOT / "models", "train": _ROOT / "train"}}


class PackageDirs(griffe.Extension):
    """Attaches each mapped folder to its parent package once that package has loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for name, path in _PACKAGE_DIRS.get(pkg.name, {}).items():
            if name not in pkg.members:
                # Griffe has no public call for "load this folder as a submodule of that package". The path is
                # the folder's __init__.py, so the source is read (never imported) and its submodules follow.
                pkg.set_member(name, loader._load_module(name, path / "__init__.py", parent=pkg))


def _comment(line: str) -> str | None:
    """The text after a line's `#` outside string literals, or None."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[i + 1:].strip()
    return None


class CommentDocstrings(griffe.Extension):
    """Gives an undocumented attribute the comment beside it (or the comment block above it) as its docstring."""

    def on_attribute_instance(self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute,
                              **kwargs: Any) -> None:
        if attr.docstring is not None or not isinstance(node, ast.AST) or attr.filepath is None:
            return
        try:
            lines = attr.lines_collection[attr.filepath]
        except KeyError:
            return
        start, end = node.lineno, getattr(node, "end_lineno", None) or node.lineno
        text = _comment(lines[end - 1])
        if not text:
            above = []
            i = start - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip()[1:].strip())
                i -= 1
            text = " ".join(above)
        if text:
            attr.docstring = griffe.Docstring(text, lineno=start, endlineno=end, parent=attr)
