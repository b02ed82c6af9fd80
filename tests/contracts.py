"""The compiled-program contracts, checked in one way wherever a test checks one.

What a user pays for in compile time is the number of programs (one per shape, per verify width set, per row
count), and what a step pays for in memory traffic is any copy of a whole buffer that XLA inserts where a write
is not in place. Tests of either carry the `contract` marker (`pytest -m contract` runs them all) and use these
helpers:
- `programs_compiled(caplog, call)`: {program: times compiled} while `call()` runs, for the loop's programs
  (from JAX's "Compiling jit(name)" log, so it sees every thread: the engine's, the background measurements').
  A test asserting {} relies on that log naming programs; test_compile_count and test_server_echo assert
  programs that do compile, so a JAX whose log reads otherwise fails there instead of passing here unseen;
- `whole_copies(hlo, shape)`: the instructions of a compiled program's HLO text that copy a whole array.
"""

from __future__ import annotations

import logging
import re

_COMPILING = re.compile(r"Compiling jit\((\w+)\)")
# The programs of a call; the rest are small helpers (array setup, a gather) compiled in milliseconds.
LOOP_PROGRAMS = frozenset({"prefill", "decode", "decode_chunk", "_forward", "score_arrays"})


def programs_compiled(caplog, call, names=LOOP_PROGRAMS) -> dict[str, int]:
    """{program: times compiled} while `call()` runs, for the programs named in `names` (`caplog` is pytest's)."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="jax._src.interpreters.pxla"):
        call()
    counts: dict[str, int] = {}
    for record in caplog.records:
        m = _COMPILING.search(record.getMessage())
        if m and m.group(1) in names:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def whole_copies(hlo: str, shape: str) -> list[str]:
    """The lines of compiled HLO text `hlo` whose instruction copies a whole array of `shape` (as XLA prints it,
    e.g. "f32[2,4,64,16]"), copies of constants aside."""
    pattern = re.compile(rf"= {re.escape(shape)}\S* copy\((?!%constant)")
    return [line for line in hlo.splitlines() if pattern.search(line)]
