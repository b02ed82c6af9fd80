"""How many programs a call compiles, and how many target forwards its decode loop holds, per method.

Compile time is what a user meets first, and what multiplies it is the number of programs (one per shape, per
verify width set, per row count) and of target forwards inside each (one per verify width). A change that adds
a program to a call, compiles again on a second call of the same shapes, or adds widths to a method's default
fails here, before it costs every user minutes of compile.
"""

from __future__ import annotations

import jax
import pytest

import jaxspec
from contracts import programs_compiled
from jaxspec import SamplingParams, SpecConfig

pytestmark = pytest.mark.contract

PROMPTS = [[5, 6, 7, 8] * 3, [10, 11, 12] * 4, [3, 1, 4, 1, 5, 9] * 2]


def _spec(method: str, head_files) -> SpecConfig | None:
    if method == "none":
        return None
    if method in ("eagle3", "eagle2"):
        return SpecConfig(method=method, head_path=head_files[method if method == "eagle3" else "eagle"])
    return SpecConfig(method=method)


# (method, rows) -> the verify widths its decode loop compiles: one target forward each. Chains at one row take
# their method's own widths; above one row (and trees drafted best node first, at any row count) the cost choice
# is offered the narrow ones too (jaxspec.shapes) and compiles those its table (here the prior) says can pay
# (`cost.widths_worth_compiling`).
WIDTHS = {("none", 1): (1,), ("none", 3): (1,),
          ("ngram", 1): (1, 9), ("ngram", 3): (1, 9),
          ("sam", 1): (1, 5, 9, 17), ("sam", 3): (1, 9, 17),
          ("eagle3", 1): (1, 16), ("eagle3", 3): (1, 9, 16)}
# Compiled (each compile costs seconds here): one call per kind of program; the rest check their widths only.
COMPILED = {("none", 1), ("sam", 3), ("eagle3", 1)}


@pytest.mark.parametrize("method, rows", sorted(WIDTHS))
def test_a_call_compiles_one_prefill_and_one_loop_with_the_methods_widths(tiny_lm, head_files, caplog, monkeypatch,
                                                                         tmp_path, method, rows):
    """A first call compiles the prefill and the decode loop once each, and nothing that times a forward (the
    verify-cost table is the prior until the background thread has measured it; here nothing is measured); the
    second call of the same shapes compiles nothing."""
    monkeypatch.setenv(jaxspec.cost.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(jaxspec.cost, "BACKGROUND", True)  # the library's default (benchkit turns it off)
    monkeypatch.setattr(jaxspec.cost._BACKGROUND_JOBS, "submit", lambda *a: None)
    jaxspec.cost.forget_measured()
    spec = _spec(method, head_files)
    prepared = jaxspec.prepare(tiny_lm, PROMPTS[:rows], max_new_tokens=24, spec=spec)
    assert prepared.widths == WIDTHS[method, rows]
    if (method, rows) not in COMPILED:
        return
    jax.clear_caches()
    greedy = SamplingParams(temperature=0.0)

    def call():
        return jaxspec.generate(tiny_lm, PROMPTS[:rows], max_new_tokens=24, spec=spec, sampling=greedy)

    assert programs_compiled(caplog, call) == {"prefill": 1, "decode": 1}
    assert programs_compiled(caplog, call) == {}


def test_a_cost_aware_call_compiles_no_timing_forward_before_decoding(tiny_lm, caplog, monkeypatch, tmp_path):
    """With measuring on (the library's default), a first call at several rows takes the prior and compiles the
    same two programs; the forwards that time each width compile on the background thread, after the call."""
    monkeypatch.setenv(jaxspec.cost.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(jaxspec.cost, "BACKGROUND", True)  # the library's default (benchkit turns it off)
    jaxspec.cost.forget_measured()
    jax.clear_caches()
    spec = SpecConfig(method="sam")

    def call():
        with jaxspec.cost.generating():  # held until the counts are read: the measurement waits for it
            return jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=24, spec=spec,
                                    sampling=SamplingParams(temperature=0.0))

    assert programs_compiled(caplog, call) == {"prefill": 1, "decode": 1}
    assert jaxspec.cost.wait_measured(timeout=300)
    assert len(jaxspec.cost.measured()) >= 1
    jaxspec.cost.forget_measured()
