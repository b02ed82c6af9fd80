"""The examples in examples/ run, at their smallest settings, and show what their docstrings claim.

Each example's `main(argv)` returns what it measured; the tests call it in this process (the session's
compilation cache applies) and assert on the numbers. The examples on the default model are skipped where it
is not installed (except under CI=true); train_eagle's pipeline runs on the tiny random model here, since data
generation, training and two speculative compiles on the real one take minutes.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.proposers import Committed, Context

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    """examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses resolve their string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["custom_proposer", "rejection_sample_loop", "serve_engine", "train_eagle"])
def test_example_says_what_it_shows_and_how_to_run_it(name):
    doc = ast.get_docstring(ast.parse((EXAMPLES / f"{name}.py").read_text()))
    assert doc and f"python examples/{name}.py" in doc


# ------------------------------------------------------------------------------------ rejection_sample_loop

def test_rejection_sample_loop_matches_the_target_and_the_controls_do_not(capsys):
    r = _example("rejection_sample_loop").main(["--replicas", "2", "--rows", "4096"])
    floor = r["exact"]["tv"]
    assert 0 < floor < 0.1  # 8192 sequences over 5**4 outcomes
    for mode in ("sampled", "greedy"):
        assert r[mode]["tv"] <= 2 * floor + 0.01, (mode, r[mode]["tv"], floor)
    # The controls are off by a distance that does not shrink with more samples.
    assert r["naive"]["tv"] > 0.3 and r["stale keys"]["tv"] > 0.1
    assert r["lossless"] and r["control_fails"]
    # Speculation commits more than one token per step; naive commits exactly K.
    assert r["sampled"]["tokens_per_step"] > 1.2 and r["greedy"]["tokens_per_step"] > 1.0
    assert r["naive"]["tokens_per_step"] == pytest.approx(2.0)
    assert "TV to exact" in capsys.readouterr().out


def test_rejection_sample_loop_exact_distribution_is_the_chain():
    ex = _example("rejection_sample_loop")
    target, _ = ex.toy_chains(3, seed=0)
    exact = ex.exact_distribution(target, start=1, length=2)
    p = np.asarray(jax.nn.softmax(target, axis=-1), np.float64)
    expected = np.array([p[1, a] * p[a, b] for a in range(3) for b in range(3)])  # x_1 most significant
    np.testing.assert_allclose(exact, expected, rtol=1e-6)
    assert ex.encode(np.array([[2, 1]]), 3).tolist() == [7]


# ------------------------------------------------------------------------------------------ custom_proposer

def test_custom_proposer_table_is_the_most_frequent_successor():
    ex = _example("custom_proposer")
    table = ex.corpus_table([[1, 2, 1, 3, 1, 3], [4, 0, 4, 2, 4, 0]], vocab=6)
    # 1 -> 3 twice beats 1 -> 2 once; 4 -> 0 twice; 2 -> 1 and 2 -> 4 tie: the smaller id; 5 never occurs.
    assert table.tolist() == [4, 3, 1, 1, 0, -1]


def _context(history: list[int], width: int = 12, max_draft: int = 4):
    """A one-row Context holding `history` (newest token last) in a buffer of `width`."""
    buf = np.full((1, width), -1, np.int32)
    buf[0, : len(history)] = history
    n = jnp.asarray([len(history)], jnp.int32)
    return Context(history=jnp.asarray(buf), history_len=n, max_draft=jnp.asarray([max_draft], jnp.int32),
                   sampling=jaxspec.SamplingParams().broadcast(1), positions=n - 1)


def test_custom_proposer_drafts_from_the_rows_history_then_the_table():
    ex = _example("custom_proposer")
    table = np.full((16,), -1, np.int32)
    table[[8, 5, 2]] = [5, 2, -1]  # the corpus: 8 -> 5 -> 2, then nothing
    params = jnp.asarray(table)
    history = [5, 6, 7, 5, 9, 8]  # the row: 5 -> 6 and later 5 -> 9, 9 -> 8; 8 is never continued
    proposer = ex.BigramProposer(4)
    assert proposer.needs_features is False and proposer.max_depth == 4
    ctx = _context(history)
    draft, _ = proposer.propose(params, proposer.init(params, ctx), ctx, None)
    # 8 from the table, then the row's latest successors (5 -> 9, not 5 -> 6), 9 -> 8, 8 from the table.
    assert draft.tokens[0].tolist() == [5, 9, 8, 5] and int(draft.num_draft[0]) == 4 and draft.probs is None
    capped, _ = proposer.propose(params, proposer.init(params, ctx), _context(history, max_draft=1), None)
    assert int(capped.num_draft[0]) == 1
    corpus_only = ex.BigramProposer(4, use_history=False)
    draft, _ = corpus_only.propose(params, corpus_only.init(params, ctx), ctx, None)
    assert draft.tokens[0, :2].tolist() == [5, 2] and int(draft.num_draft[0]) == 2  # 2 has no successor


def test_custom_proposer_update_equals_init_on_the_extended_history():
    ex = _example("custom_proposer")
    params = jnp.full((16,), -1, jnp.int32)
    proposer = ex.BigramProposer(4)
    before, added = [5, 6, 7, 5, 9, 8], [5, 3, 5]
    pstate = proposer.init(params, _context(before))
    committed = Committed(tokens=jnp.asarray([added + [-1, -1]], jnp.int32), num=jnp.asarray([3], jnp.int32))
    updated = proposer.update(params, pstate, _context(before + added), committed)
    np.testing.assert_array_equal(updated, proposer.init(params, _context(before + added)))
    # 5 occurs at 0, 3, 6 and 8: the newest (8) has no successor yet, so 6 is the latest that counts.
    assert int(updated[0, 5]) == 6 and int(updated[0, 8]) == 5 and int(updated[0, 3]) == 7


def test_custom_proposer_on_the_default_model(default_model_installed, capsys):
    r = _example("custom_proposer").main(["--problems", "HumanEval/3", "--max-new-tokens", "24", "-k", "4"])
    assert r["identical"]
    assert r["drafted"] > 0 and r["accepted"] > 0 and r["steps"] < r["plain_steps"]
    assert "identical to plain decoding: True" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- train_eagle

def test_train_eagle_pipeline_on_the_tiny_model(tiny_lm, tmp_path, capsys):
    ex = _example("train_eagle")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny_lm.config.vocab_size, size=n).tolist() for n in (9, 12, 15, 18)]
    held_out = [rng.integers(0, tiny_lm.config.vocab_size, size=n).tolist() for n in (10, 14)]
    r = ex.train_and_generate(tiny_lm, prompts, held_out, tmp_path, gen_tokens=24, steps=6, batch_size=2,
                              seq_len=16, lr=3e-3, max_new_tokens=12, progress=False)
    assert len(r["losses"]) == 6 and all(math.isfinite(x) for x in r["losses"])
    assert len(r["eval"]["step_accuracy"]) == 4
    head = Path(r["head_path"])
    assert head.exists() and json.loads(head.with_suffix(".json").read_text())["steps"] == 6
    run = r["runs"]["trained here"]
    assert run["identical"] and run["drafted"] > 0
    assert r["identical"] and "identical to plain: True" in capsys.readouterr().out


def test_train_eagle_cli_parses_its_defaults():
    with pytest.raises(SystemExit) as e:
        _example("train_eagle").main(["--help"])
    assert e.value.code == 0


# --------------------------------------------------------------------------------------------- serve_engine

def test_serve_engine_streams_cancels_and_matches(default_model_installed, capsys):
    r = _example("serve_engine").main(["--max-tokens", "16", "--chunk-steps", "4", "--cancel-after", "4",
                                       "--cache-len", "256"])
    assert r["identical"] and r["cancel_ok"]
    assert r["cancelled"]["finish_reason"] == "cancelled" and len(r["cancelled"]["tokens"]) < 16 + 4 * 9
    for name in ("plain", "sam", "sampled"):
        assert r[name]["finish_reason"] in ("length", "stop") and len(r[name]["tokens"]) <= 16
        assert r[name]["events"] >= 2  # streamed: the first token, then chunks
    assert r["plain"]["drafted"] == 0 and r["sam"]["drafted"] > 0 and r["sam"]["accepted"] > 0
    assert "plain and sam identical: True" in capsys.readouterr().out
