"""Markdown tables as the reports print them (and docs/benchmarks.md holds them), and number formatting.

`head` and `row` are separate so a long benchmark can print each row as soon as it is measured.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def fmt(x, spec: str = ".2f") -> str:
    """`x` formatted with `spec`, or "-" for a value that was not measured (None, nan, inf)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def row(cells: Sequence) -> str:
    """One table row; the cells are printed with str()."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def head(columns: Sequence[str]) -> str:
    """The header row and the separator row."""
    return row(columns) + "\n" + "|" + "---|" * len(columns)


def markdown(columns: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A whole table, without a trailing newline."""
    return "\n".join([head(columns)] + [row(r) for r in rows])
