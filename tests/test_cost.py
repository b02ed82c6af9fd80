"""Cost-aware verify widths (jaxspec.cost): the choice rule, the measured table and its cache, and that choosing
a narrower width never changes what is committed."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig, StaticSuffixAutomaton, cost
from test_speculative import OracleProposer
from test_tree_decode import TOPOLOGY, OracleTreeProposer, _known

K = 8
WIDTHS = (1, 5, 9)


def test_expected_committed_is_the_geometric_sum():
    for rate in (0.0, 0.3, 0.9):
        for m in range(6):
            got = float(cost.expected_committed(jnp.float32(rate), jnp.int32(m)))
            assert got == pytest.approx(sum(rate ** i for i in range(m + 1)), rel=1e-5)
    assert float(cost.expected_committed(jnp.float32(1.0), jnp.int32(4))) == pytest.approx(5.0, rel=1e-4)


def _choose(costs, num_draft, rate, active=None):
    num_draft = jnp.asarray(num_draft, jnp.int32)
    active = jnp.ones(num_draft.shape, bool) if active is None else jnp.asarray(active)
    return int(cost.choose_width(WIDTHS, jnp.asarray(costs, jnp.float32), num_draft,
                                 jnp.full(num_draft.shape, rate, jnp.float32), active))


def test_the_choice_weighs_expected_tokens_against_cost():
    assert _choose((1.0, 1.1, 1.2), [8, 8], 0.9) == 2  # cheap and accepted: the widest
    assert _choose((1.0, 1.1, 1.2), [8, 8], 0.0) == 0  # nothing gets accepted: plain steps
    assert _choose((1.0, 1.5, 9.0), [8, 8], 0.8) == 1  # width 9 too dear for its extra expected tokens
    assert _choose((1.0, 1.1, 1.2), [0, 0], 0.9) == 0  # nobody drafts: ties go to the narrowest
    # A finished row's drafts count for nothing.
    assert _choose((1.0, 1.5, 1.6), [8, 0], 0.9, active=[False, True]) == 0
    assert int(cost.narrowest_holding(WIDTHS, jnp.asarray([3, 0]))) == 1


def _choose_tree(costs, confidence, num_draft=None, active=None, widths=(1, 3, 5)):
    confidence = jnp.asarray(confidence, jnp.float32)
    batch, k = confidence.shape
    num_draft = jnp.full((batch,), k, jnp.int32) if num_draft is None else jnp.asarray(num_draft, jnp.int32)
    active = jnp.ones((batch,), bool) if active is None else jnp.asarray(active)
    return int(cost.choose_tree_width(widths, jnp.asarray(costs, jnp.float32), num_draft, confidence, active))


def test_the_tree_choice_weighs_the_best_nodes_confidence_against_cost():
    """A width w scores each row's w - 1 best nodes; they add their path probabilities to the one token the
    target always gives."""
    sure, unsure = [0.9, 0.8, 0.7, 0.6], [0.3, 0.1, 0.05, 0.01]
    assert _choose_tree((1.0, 1.2, 1.4), [sure]) == 2  # 4.0 / 1.4 beats 2.7 / 1.2 and 1
    assert _choose_tree((1.0, 1.2, 1.4), [unsure]) == 1  # 1.4 / 1.2 beats 1.46 / 1.4 and 1
    assert _choose_tree((1.0, 1.5, 2.0), [unsure]) == 0
    assert _choose_tree((1.0, 1.2, 1.4), [sure], num_draft=[1]) == 1  # one valid node: width 3 holds it
    assert _choose_tree((1.0, 1.2, 1.4), [sure], num_draft=[0]) == 0  # no node: ties go to the narrowest
    # Rows add up; a finished row's nodes count for nothing, its one token is not committed either.
    assert _choose_tree((1.0, 1.4, 1.6), [sure, unsure]) == 2
    assert _choose_tree((1.0, 1.4, 1.6), [sure, unsure], active=[False, True]) == 0
    # Widths past the tree's K score all of it.
    assert _choose_tree((1.0, 1.2, 2.0), [sure[:2]], widths=(1, 3, 9)) == 1


def test_only_the_rows_furthest_from_their_end_count():
    """The batch waits for its last row: drafts of rows ahead of it buy nothing (a finished row is never behind)."""
    behind = cost.furthest_behind(jnp.asarray([40, 52, 52, 60, 3]), jnp.asarray([True, True, True, False, True]))
    assert behind.tolist() == [False, True, True, False, False]
    assert not cost.furthest_behind(jnp.asarray([5, 5]), jnp.asarray([False, False])).any()


def test_the_running_rate_starts_at_the_prior_and_follows_the_counts():
    rate = cost.acceptance_rate(jnp.asarray([0, 90, 0]), jnp.asarray([0, 100, 100]))
    assert np.allclose(rate, [cost.PRIOR_RATE, (90 + 2) / 104, 2 / 104])


def test_an_untried_row_explores_and_a_failing_one_stops():
    """The prior alone (E(4) = 1.94 at rate 0.5) never repays a width-5 forward costing 2.2, so a row would never
    draft and its rate never move; the exploration bonus makes it try, and 100 scored drafts at 0.3 stop it."""
    costs = (1.0, 2.2, 3.0)
    assert _choose(costs, [8, 8], cost.PRIOR_RATE) == 0
    untried, failing, landing = np.asarray(cost.optimistic_rate(jnp.asarray([0, 30, 90]), jnp.asarray([0, 100, 100])))
    assert untried == cost.PRIOR_RATE + cost.EXPLORATION / np.sqrt(cost.PRIOR_WEIGHT)
    assert _choose(costs, [8, 8], untried) == 1
    assert _choose(costs, [8, 8], failing) == 0
    assert _choose(costs, [8, 8], landing) == 2  # 92 / 104 + 0.05: E(8) = 6.9 repays c(9) = 3
    assert float(cost.optimistic_rate(jnp.asarray(1000), jnp.asarray(1000))) == 1.0  # capped


def test_cost_aware_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="cost_aware='yes' must be True, False or None"):
        SpecConfig(method="sam", cost_aware="yes")


def test_unset_cost_awareness_means_above_one_row():
    auto, fixed, always = SpecConfig(method="sam"), SpecConfig(method="sam", cost_aware=False), \
        SpecConfig(method="sam", cost_aware=True)
    assert auto.cost_aware is None
    assert [auto.cost_aware_at(b) for b in (1, 2, 8)] == [False, True, True]
    assert not any(fixed.cost_aware_at(b) for b in (1, 8)) and all(always.cost_aware_at(b) for b in (1, 8))
    # A tree drafted best node first chooses by cost at one row too, unless told not to; so do drafts from a corpus.
    assert auto.cost_aware_at(1, ranked_tree=True) and not fixed.cost_aware_at(1, ranked_tree=True)
    assert auto.cost_aware_at(1, corpus=True) and not fixed.cost_aware_at(1, corpus=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cost.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost, "BACKGROUND", False)  # measured before the call that asks: these tests read the table
    cost.forget_measured()
    yield tmp_path
    cost.forget_measured()


def _oracle_run(lm, prompts, plain, sampling, cost_aware=True, drafts_per_row=None):
    width = max(len(p) for p in prompts) + 40 + K + 1
    spec = SpecConfig(method="custom", num_speculative_tokens=K, verify_widths=WIDTHS, cost_aware=cost_aware,
                      proposer=OracleProposer(K, drafts_per_row), proposer_params=_known(prompts, plain, width))
    return jaxspec.generate(lm, prompts, max_new_tokens=40, sampling=sampling, spec=spec)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 97, size=n).tolist() for n in (6, 19, 11)]


MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
         SamplingParams(temperature=1.0, top_p=0.9, seed=5)]


def test_measured_costs_keep_the_output_and_are_cached(tiny_lm, prompts, cache_dir, monkeypatch):
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=MIXED)
    out = _oracle_run(tiny_lm, prompts, plain, MIXED)
    assert out.token_ids == plain.token_ids  # seeded rows reproduce plain decoding token for token
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    table = json.loads((cache_dir / "verify_cost.json").read_text())
    assert len(table) == 1 and all(c > 0 for c in next(iter(table.values())))
    # The next process (an empty memo) reads the file instead of measuring.
    cost.forget_measured()
    monkeypatch.setattr(cost, "_measure", lambda *a, **k: pytest.fail("measured again despite the cache"))
    assert _oracle_run(tiny_lm, prompts, plain, MIXED).token_ids == plain.token_ids


def test_a_table_from_other_forward_code_is_measured_again(tiny_lm, cache_dir, monkeypatch):
    """The file's key holds a digest of the forward's source: a table measured before the attention or the
    matmul paths changed is not reused."""
    def measuring(value):
        def measure(lm, batch, cache_len, widths, cached, attention_impl, repeats, key):
            cost._store(key, tuple(value for _ in widths))  # as `_measure` stores what it timed
            return tuple(value for _ in widths)
        return measure

    monkeypatch.setattr(cost, "_measure", measuring(2.0))
    assert cost.measure_verify_cost(tiny_lm, batch=2, cache_len=64, widths=(1, 3), cached=8) == (2.0, 2.0)
    cost.forget_measured()  # a new process, same code: the file answers
    monkeypatch.setattr(cost, "_measure", lambda *a: pytest.fail("measured again under the same code"))
    assert cost.measure_verify_cost(tiny_lm, batch=2, cache_len=64, widths=(1, 3), cached=8) == (2.0, 2.0)
    cost.forget_measured()  # a new process, other code: measured again
    monkeypatch.setattr(cost, "forward_code", lambda model_type: "other code")
    monkeypatch.setattr(cost, "_measure", measuring(5.0))
    assert cost.measure_verify_cost(tiny_lm, batch=2, cache_len=64, widths=(1, 3), cached=8) == (5.0, 5.0)
    assert len(json.loads((cache_dir / "verify_cost.json").read_text())) == 2


def test_a_custom_targets_own_source_joins_the_forward_digest(tmp_path, monkeypatch):
    """A custom target's forward is its own code: an edit to the file defining its class changes the digest, so
    its tables are measured again too; the shipped Llama's digest is another."""
    import importlib.util

    from jaxspec.models.llama import Llama

    source = tmp_path / "my_target.py"

    def digest(text: str) -> str:
        source.write_text(text)
        spec = importlib.util.spec_from_file_location("my_target", source)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "my_target", module)  # as an imported module is: where its file is found
        spec.loader.exec_module(module)
        return cost.forward_code(module.MyTarget)

    first = digest("class MyTarget:\n    width = 1\n")
    assert first == digest("class MyTarget:\n    width = 1\n")  # same code, same digest
    assert first != digest("class MyTarget:\n    width = 2\n")
    assert cost.forward_code(Llama) != first
    assert cost.forward_code(type(None)) == cost.forward_code(int)  # no source file: jaxspec's code alone


def test_prohibitive_costs_mean_plain_steps_and_the_same_output(tiny_lm, prompts, cache_dir, monkeypatch):
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(
        1.0 if w == 1 else 100.0 for w in widths))
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=MIXED)
    out = _oracle_run(tiny_lm, prompts, plain, MIXED)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted == 0 and out.stats.steps == plain.stats.steps


def test_cheap_wide_costs_let_an_accurate_proposer_draft_at_full_width(tiny_lm, prompts, cache_dir, monkeypatch):
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(1.0 for _ in widths))
    greedy = SamplingParams(temperature=0.0)
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=greedy)
    out = _oracle_run(tiny_lm, prompts, plain, greedy)
    assert out.token_ids == plain.token_ids
    # The oracle is always right: every step but the last ones commits K + 1 tokens.
    assert out.stats.mean_acceptance_length > 0.8 * (K + 1)


def test_drafts_of_rows_ahead_of_the_last_are_not_scored(tiny_lm, prompts, cache_dir, monkeypatch):
    """Every width costs one plain step, rows 0 and 1 always draft the right tokens and row 2 never drafts. The
    first step scores the drafts (every row is as far from its end); from then on row 2 is the one the batch
    waits for, and scoring the others' drafts would not end the batch sooner, so nothing more is scored."""
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(1.0 for _ in widths))
    greedy = SamplingParams(temperature=0.0)
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=greedy)
    out = _oracle_run(tiny_lm, prompts, plain, greedy, drafts_per_row=(K, K, 0))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted == 2 * K and out.stats.accepted == 2 * K
    assert out.stats.steps == plain.stats.steps


def test_the_default_measures_chains_of_several_rows_and_ranked_trees(tiny_lm, prompts, head_files, cache_dir,
                                                                      monkeypatch):
    timed, offered = [], []
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: timed.append(batch)
                        or offered.append(widths) or tuple(float(w) for w in widths))
    sam = SpecConfig(method="sam")
    assert jaxspec.prepare(tiny_lm, prompts[:1], max_new_tokens=8, spec=sam).verify_cost is None
    assert jaxspec.prepare(tiny_lm, prompts, max_new_tokens=8,
                           spec=SpecConfig(method="sam", cost_aware=False)).verify_cost is None
    tree = SpecConfig(method="medusa", head_path=head_files["medusa"], num_speculative_tokens=7, verify_widths=(1, 8))
    assert jaxspec.prepare(tiny_lm, prompts, max_new_tokens=8, spec=tree).verify_cost is None
    assert timed == []
    p = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=8, spec=sam)
    assert timed == [3]
    # The cost choice is offered the narrow widths too (shapes.COST_CHOICE_WIDTHS), each measured; a cost that
    # grows as the width repays no draft, so only the plain step is compiled.
    assert offered[-1] == (1, 2, 3, 5, 9, 17)
    assert p.widths == (1,) and p.verify_cost.tolist() == [1.0]
    # An EAGLE-2 tree ranks its nodes: measured at one row too, offered the tree widths 3, 5 and 9.
    eagle2 = SpecConfig(method="eagle2", head_path=head_files["eagle"], num_speculative_tokens=9, tree_depth=4,
                        tree_top_k=3, verify_widths=(1, 10))
    p = jaxspec.prepare(tiny_lm, prompts[:1], max_new_tokens=8, spec=eagle2)
    assert timed == [3, 1] and offered[-1] == (1, 3, 5, 9, 10) and p.verify_cost is not None
    # sam drafting from a corpus ("auto" takes the one given): measured at one row too.
    corpus = StaticSuffixAutomaton.build([prompts[0] * 2], separator=0)
    p = jaxspec.prepare(tiny_lm, prompts[:1], max_new_tokens=8, spec=SpecConfig(method="sam", static_sam=corpus))
    assert p.proposer.source == "both" and timed == [3, 1, 1] and p.verify_cost is not None


def test_the_default_declines_dear_widths_above_one_row(tiny_lm, prompts, cache_dir, monkeypatch):
    """Unset cost awareness at three rows: prohibitive measured costs mean plain steps, cheap ones let the
    oracle draft; at one row the narrowest-width rule drafts whatever the table would say."""
    greedy = SamplingParams(temperature=0.0)
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=greedy)
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(
        1.0 if w == 1 else 100.0 for w in widths))
    dear = _oracle_run(tiny_lm, prompts, plain, greedy, cost_aware=None)
    assert dear.token_ids == plain.token_ids
    assert dear.stats.drafted == 0 and dear.stats.steps == plain.stats.steps
    plain_one = jaxspec.generate(tiny_lm, prompts[:1], max_new_tokens=40, sampling=greedy)
    one = _oracle_run(tiny_lm, prompts[:1], plain_one, greedy, cost_aware=None)
    assert one.token_ids == plain_one.token_ids
    assert one.stats.drafted > 0 and one.stats.accepted > 0
    cost.forget_measured()
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(1.0 for _ in widths))
    cheap = _oracle_run(tiny_lm, prompts, plain, greedy, cost_aware=None)
    assert cheap.token_ids == plain.token_ids
    assert cheap.stats.drafted > 0 and cheap.stats.mean_acceptance_length > 0.8 * (K + 1)


@dataclasses.dataclass(frozen=True)
class RankedOracleTree(OracleTreeProposer):
    """The oracle tree (true tokens at rank 0 at every depth) declaring its nodes best first, with confidence
    falling by index: width 3 scores nodes (0,) and (1,), so a step commits 2 tokens; width 5 adds (0, 0) and
    (0, 1), 3 tokens; width 9 reaches (0, 0, 0, 0), 5 tokens."""

    ranks_nodes = True

    def propose(self, params, pstate, ctx, keys):
        draft, pstate = super().propose(params, pstate, ctx, keys)
        confidence = jnp.broadcast_to(0.9 ** jnp.arange(1, self.num_speculative_tokens + 1), draft.tokens.shape)
        return draft.replace(confidence=confidence.astype(jnp.float32)), pstate


@pytest.mark.parametrize("costs, compiled, tokens_per_step", [
    ({1: 1.0, 3: 1.0, 5: 1.0, 9: 1.0, 10: 1.0}, (1, 10), (4.0, 5.0)),  # everything cheap: the whole tree
    ({1: 1.0, 3: 1.0, 5: 100.0, 9: 100.0, 10: 100.0}, (1, 3), (1.6, 2.0)),  # only width 3 affordable: 2 nodes
    ({1: 1.0, 3: 100.0, 5: 100.0, 9: 100.0, 10: 100.0}, (1,), (1.0, 1.0)),  # nothing repays a draft: plain steps
])
def test_a_ranked_tree_scores_the_best_nodes_its_costs_afford(tiny_lm, prompts, cache_dir, monkeypatch, costs,
                                                              compiled, tokens_per_step):
    """A tree drafted best node first is scored by the width its measured costs favour (offered the tree widths
    beside its own, compiled only where they pay), and greedy and seeded rows still reproduce plain decoding
    token for token."""
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(costs[w] for w in widths))
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=MIXED)
    tree = RankedOracleTree(TOPOLOGY.num_nodes, TOPOLOGY, (0, 0, 0, 0), vocab=97)
    spec = SpecConfig(method="custom", num_speculative_tokens=TOPOLOGY.num_nodes, verify_widths=(1, 10),
                      cost_aware=True, proposer=tree, proposer_params=_known(prompts, plain, 128))
    assert jaxspec.prepare(tiny_lm, prompts, max_new_tokens=40, sampling=MIXED, spec=spec).widths == compiled
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=40, sampling=MIXED, spec=spec)
    assert out.token_ids == plain.token_ids
    low, high = tokens_per_step
    assert low <= out.stats.mean_acceptance_length <= high
    if high > 1:
        assert out.stats.drafted > 0 and out.stats.accepted > 0
    else:
        assert out.stats.drafted == 0 and out.stats.steps == plain.stats.steps


def test_switched_off_by_the_environment(tiny_lm, prompts, monkeypatch):
    monkeypatch.setenv(cost.CACHE_ENV, "off")
    monkeypatch.setattr(cost, "_measure", lambda *a, **k: pytest.fail("measured although switched off"))
    p = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=8,
                        spec=SpecConfig(method="sam", cost_aware=True))
    assert p.verify_cost is None


def test_the_prior_is_one_plain_step_when_memory_bounds_and_grows_when_compute_does(tiny_lm):
    """The prior from the model's sizes: c(1) = 1, never below one plain step, never falling with the width; at
    many rows the FLOPs of a wide forward outweigh its reads and c(w) grows towards w."""
    widths = (1, 2, 3, 5, 9, 17)
    one_row = cost.prior_verify_cost(tiny_lm, batch=1, widths=widths, cached=32)
    many = cost.prior_verify_cost(tiny_lm, batch=512, widths=widths, cached=32)
    for table in (one_row, many):
        assert table[0] == 1.0 and all(c >= 1.0 for c in table)
        assert all(a <= b for a, b in zip(table, table[1:]))
    assert many[-1] > 2 * one_row[-1]
    assert many[-1] <= 17.5


@pytest.mark.parametrize("costs, tree, kept", [
    ({1: 1.0, 3: 1.0, 5: 1.0, 9: 1.0, 17: 1.0}, False, (1, 17)),  # bound by memory: the widest costs no more
    ({1: 1.0, 3: 3.0, 5: 5.0, 9: 9.0, 17: 17.0}, False, (1,)),  # cost grows as the width: no draft repays it
    ({1: 1.0, 2: 1.0, 3: 0.98, 5: 1.06, 9: 1.37, 17: 2.79}, False, (1, 3, 5, 9)),  # measured on a 2-core CPU
    ({1: 1.0, 3: 1.0, 5: 1.0, 9: 1.0, 16: 1.0}, True, (1, 16)),
    ({1: 1.0, 3: 1.0, 5: 100.0, 9: 100.0, 10: 100.0}, True, (1, 3)),
    ({5: 1.0, 9: 1.0}, False, (9,)),  # widths without the plain step keep what pays
])
def test_only_widths_the_choice_can_pay_for_are_compiled(costs, tree, kept):
    assert cost.widths_worth_compiling(tuple(costs), tuple(costs.values()), tree=tree) == kept


def test_a_width_without_its_cost_is_an_error():
    with pytest.raises(ValueError, match="2 costs for widths"):
        cost.widths_worth_compiling((1, 5, 9), (1.0, 1.2))


def _best_choice(widths, table, num_draft, rate, tree):
    """Tokens per unit of cost that the loop's choice among `widths` (costs {w: c(w)}) expects for one row with
    `num_draft` drafts at acceptance `rate` (a tree's nodes ranked with path probabilities rate, rate^2, ...)."""
    costs = jnp.asarray([table[w] for w in widths], jnp.float32)
    n, counted = jnp.asarray([num_draft], jnp.int32), jnp.ones((1,), bool)
    if tree:
        confidence = jnp.asarray([rate ** np.arange(1, 17)], jnp.float32)
        w = widths[int(cost.choose_tree_width(widths, costs, n, confidence, counted))]
        return (1 + float(jnp.sum(confidence[0, : min(num_draft, w - 1)]))) / table[w]
    w = widths[int(cost.choose_width(widths, costs, n, jnp.asarray([rate], jnp.float32), counted))]
    return sum(rate ** i for i in range(min(num_draft, w - 1) + 1)) / table[w]


@pytest.mark.parametrize("tree", [False, True])
def test_the_kept_widths_choose_within_the_gain_of_all_widths(tree):
    """Against the loop's own choice (`choose_width`, `choose_tree_width`) on random cost tables, draft lengths
    and rates: choosing among the kept widths commits at least 1 - COMPILE_GAIN of what the best of all widths
    commits per unit of cost, one row at a time."""
    rng = np.random.default_rng(0)
    widths = (1, 2, 3, 5, 9, 17)
    dropped = 0
    for _ in range(40):
        steps = rng.exponential(0.4, 5) * rng.uniform(0.0, 1.0, 5)
        table = dict(zip(widths, np.concatenate([[1.0], 1.0 + steps.cumsum()]).tolist()))
        kept = cost.widths_worth_compiling(widths, tuple(table.values()), tree=tree)
        dropped += len(widths) - len(kept)
        for num_draft in (0, 1, 2, 4, 8, 16):
            for rate in (0.1, 0.4, 0.7, 0.95):
                best = _best_choice(widths, table, num_draft, rate, tree)
                assert _best_choice(kept, table, num_draft, rate, tree) >= (1 - cost.COMPILE_GAIN) * best - 1e-6
    assert dropped > 0  # the tables left widths out, so the check compared different sets


def test_an_unmeasured_shape_answers_with_the_prior_and_measures_between_calls(tiny_lm, prompts, tmp_path,
                                                                                 monkeypatch):
    """`prepare` never waits for a measurement: the first call of a shape gets the prior at once, the table is
    measured on the background thread (only while no generation runs), and the next call gets the measurement."""
    import threading

    monkeypatch.setenv(cost.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost, "BACKGROUND", True)  # the library's default (benchkit, if imported, turns it off)
    cost.forget_measured()
    started, release, threads = threading.Event(), threading.Event(), []

    def measure(lm, batch, cache_len, widths, cached, attention_impl, repeats, key):
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(30)
        cost._store(key, tuple(float(w) for w in widths))
        return tuple(float(w) for w in widths)

    monkeypatch.setattr(cost, "_measure", measure)
    sam = SpecConfig(method="sam")
    with cost.generating():  # a generation in flight: nothing is measured beside it
        p = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=8, spec=sam)
        prior = cost.prior_verify_cost(tiny_lm, batch=len(prompts), widths=p.widths, cached=0)
        assert p.verify_cost.tolist() == pytest.approx(list(prior))  # the prior (a cache this short: 0 cached)
        assert not started.wait(1.0)
    assert started.wait(30)  # the generation ended: the measurement starts
    assert cost.wait_measured(timeout=0.1) is False
    release.set()
    assert cost.wait_measured(timeout=30)
    assert threads == ["jaxspec-verify-cost"]
    p = jaxspec.prepare(tiny_lm, prompts, max_new_tokens=8, spec=sam)
    assert p.verify_cost.tolist() == [float(w) for w in p.widths]  # measured: what `_measure` returned
    cost.forget_measured()


def test_a_call_holds_the_measurement_off_from_the_moment_it_asks_for_a_table(tiny_lm, prompts, tmp_path,
                                                                                monkeypatch):
    """`generate` counts as generating before it asks for a table, so the background thread cannot slip a
    timing forward's compile in between the question and the decoding."""
    monkeypatch.setenv(cost.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost, "BACKGROUND", True)  # the library's default (benchkit turns it off)
    cost.forget_measured()
    in_flight = []
    monkeypatch.setattr(cost._BACKGROUND_JOBS, "submit", lambda *a: in_flight.append(cost._BACKGROUND_JOBS._busy))
    out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=8, spec=SpecConfig(method="sam"),
                           sampling=SamplingParams(temperature=0.0))
    assert in_flight == [1] and out.stats.steps > 0
    cost.forget_measured()
