"""Mean acceptance length over several `generate` calls, from the library's one definition of it.

`GenerateStats.mean_acceptance_length` gives it for one call (tokens committed per active row-step). Over
several calls each call's value is weighted by its row-steps: the committed tokens of all calls over all their
row-steps, without restating the definition here.
"""

from __future__ import annotations

from typing import Iterable


def pooled_acceptance_length(stats: Iterable) -> float:
    """Mean acceptance length over calls with these `jaxspec.GenerateStats`; nan when no row took a step."""
    weighted = [(s.mean_acceptance_length, s.row_steps) for s in stats if s.row_steps]
    row_steps = sum(w for _, w in weighted)
    return sum(m * w for m, w in weighted) / row_steps if row_steps else float("nan")
