"""Checks shared by the library's boundaries: what counts as an integer, and how a bad value is quoted."""

from __future__ import annotations

import numbers

import numpy as np


def is_integer(x) -> bool:
    """A Python or numpy integer, not a bool (True as a count, id or rank is always a bug)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def short_repr(value, limit: int = 160) -> str:
    """repr(value), cut to `limit` characters (a proposer may hold whole arrays)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
