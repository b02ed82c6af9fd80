"""Command-line argument types the benchmark scripts share."""

from __future__ import annotations


def ints(text: str) -> list[int]:
    """"1,8,32" -> [1, 8, 32] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    """"0,0.8" -> [0.0, 0.8] (empty items skipped)."""
    return [float(x) for x in text.split(",") if x]


def names(text: str) -> list[str]:
    """"none,sam" -> ["none", "sam"] (spaces and empty items dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]
