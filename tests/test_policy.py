"""The draft policy (pure Python): the load rule, the gain model, the measured guard, settings.

The guard is driven by simulated chunks: ask the policy for the caps, "run" a chunk at a synthetic rate that
depends only on whether the caps let the active rows draft, and report it back.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.policy import ChunkReport, DraftingOverhead, DraftPolicy, GainModel, LoadLimit, SlowdownGuard, overhead_for

SLOTS, K = 8, 4


def _simulate(policy, *, spec_rate: float, plain_rate: float, chunks: int = 300, num_slots: int = SLOTS,
              active: int = 1, k: int = K, seconds: float = 0.05) -> list[bool]:
    """Run `chunks` chunks; returns, per chunk, whether it speculated. Rates are tokens/s per active row."""
    kinds = []
    for _ in range(chunks):
        caps = policy.draft_caps(num_slots, k)
        assert caps.shape == (num_slots + 1,) and caps.dtype == np.int32
        speculative = bool(caps[active] > 0)
        rate = spec_rate if speculative else plain_rate
        policy.observe(ChunkReport(num_slots=num_slots, active=active, max_cap=int(caps[active]),
                                   tokens=max(1, round(rate * seconds * active)), seconds=seconds))
        kinds.append(speculative)
    return kinds


def _gaps(kinds: list[bool], start: int) -> list[int]:
    """Plain chunks between consecutive speculative chunks, from chunk `start` on."""
    idx = [i for i, s in enumerate(kinds) if s and i >= start]
    return [b - a - 1 for a, b in zip(idx, idx[1:])]


# ---------------------------------------------------------------------- the load rule


def test_static_caps_full_k_then_halving_then_off():
    caps = DraftPolicy(load=LoadLimit(max_active=8)).ceiling(16, 8)  # full_k_active=1
    assert caps.dtype == np.int32 and caps.shape == (17,)
    # active:           0  1  2  3  4  5  6  7  8  9 .. 16
    assert caps.tolist() == [0, 8, 4, 2, 2, 1, 1, 1, 1] + [0] * 8  # index 0: no row active


def test_static_caps_full_k_active_and_max_active():
    p = DraftPolicy(load=LoadLimit(max_active=6, full_k_active=2))
    caps = p.ceiling(8, 8)
    assert len(caps) == 9
    assert caps[1] == caps[2] == 8  # up to full_k_active rows: the full K
    assert caps[3] == caps[4] == 4  # one doubling past full_k_active: K / 2
    assert caps[5] == caps[6] == 2  # two doublings: K / 4
    assert caps[7] == caps[8] == 0  # past max_active: off
    # Each doubling of the active rows halves K (floor), whatever K.
    for k in (1, 3, 5, 16):
        c = DraftPolicy(load=LoadLimit(max_active=64, full_k_active=1)).ceiling(64, k)
        for a in (1, 2, 4, 8, 16, 32):
            assert c[2 * a] == c[a] // 2, (k, a)
        assert np.all(np.diff(c[1:]) <= 0)  # never more drafts with more rows


def test_waiting_requests_count_as_load():
    """A queue means the server is saturated: with 8 slots full and requests waiting, nothing is drafted."""
    p = DraftPolicy(load=LoadLimit(max_active=8))
    assert p.ceiling(8, 8, waiting=0).tolist() == [0, 8, 4, 2, 2, 1, 1, 1, 1]
    assert p.ceiling(8, 8, waiting=1).tolist() == [0, 4, 2, 2, 1, 1, 1, 1, 0]
    assert p.draft_caps(8, 8, waiting=8).tolist() == [0] * 9
    assert p.draft_caps(8, 8, waiting=56).tolist() == [0] * 9


@pytest.mark.parametrize("num_slots", [1, 2, 8, 16, 64])
def test_static_caps_table_length(num_slots):
    for p in (DraftPolicy(), DraftPolicy("fixed"), DraftPolicy("off")):
        caps = p.draft_caps(num_slots, K)
        assert caps.shape == (num_slots + 1,) and caps.dtype == np.int32
    assert DraftPolicy().ceiling(num_slots, K).shape == (num_slots + 1,)


def test_fixed_and_off_tables():
    assert DraftPolicy("fixed").draft_caps(8, 5).tolist() == [5] * 9
    assert DraftPolicy("off").draft_caps(8, 5).tolist() == [0] * 9
    for p in (DraftPolicy("fixed"), DraftPolicy("off")):  # observing changes nothing
        before = p.draft_caps(4, 3).tolist()
        p.observe(ChunkReport(num_slots=4, active=2, max_cap=3, tokens=10, seconds=0.1))
        assert p.draft_caps(4, 3).tolist() == before


# ---------------------------------------------------------------------- the measured guard


def test_guard_switches_speculation_off_when_it_is_slower():
    p = DraftPolicy()
    kinds = _simulate(p, spec_rate=60.0, plain_rate=100.0)
    assert not p.speculating(SLOTS)
    assert kinds.count(False) >= 0.9 * len(kinds)
    # Warm-up alternates the kinds, starting with speculation, until each has min_chunks measurements.
    warm = 2 * p.guard.min_chunks
    assert kinds[:warm] == [True, False] * p.guard.min_chunks
    # Then speculation is probed once per interval, the interval growing while the loss is confirmed.
    assert kinds.index(True, warm) == warm + p.guard.probe_interval
    gaps = _gaps(kinds, warm)
    assert len(gaps) >= 3
    assert gaps == sorted(gaps), gaps
    assert gaps[0] > p.guard.probe_interval and max(gaps) == p.guard.max_probe_interval
    # The other batch sizes are still on (records are per num_slots).
    assert p.speculating(16) and p.draft_caps(16, K)[1] == K


def test_guard_probe_interval_doubles_up_to_its_maximum():
    p = DraftPolicy(guard=SlowdownGuard(probe_interval=2, max_probe_interval=64))
    kinds = _simulate(p, spec_rate=50.0, plain_rate=100.0, chunks=400)
    warm = 2 * p.guard.min_chunks
    # The first probe comes probe_interval plain chunks after the warm-up; each confirmation doubles the wait.
    assert kinds.index(True, warm) == warm + p.guard.probe_interval
    gaps = _gaps(kinds, warm)
    assert gaps[:5] == [4, 8, 16, 32, 64], gaps
    assert set(gaps[4:]) == {64}


def test_guard_keeps_speculation_on_when_it_is_faster():
    p = DraftPolicy()
    kinds = _simulate(p, spec_rate=160.0, plain_rate=100.0)
    assert p.speculating(SLOTS)
    assert kinds.count(True) >= 0.9 * len(kinds)
    # Plain decoding is still measured now and then, less often as the gain is confirmed.
    plain_idx = [i for i, s in enumerate(kinds) if not s and i >= 2 * p.guard.min_chunks]
    assert len(plain_idx) >= 3
    runs = [b - a - 1 for a, b in zip(plain_idx, plain_idx[1:])]
    assert runs == sorted(runs), runs


def test_guard_needs_a_clear_loss():
    # Within the margin (5% slower < 25%): speculation stays on; on a tie too.
    for spec_rate in (95.0, 100.0):
        p = DraftPolicy()
        kinds = _simulate(p, spec_rate=spec_rate, plain_rate=100.0)
        assert p.speculating(SLOTS)
        assert kinds.count(True) >= 0.9 * len(kinds)


@pytest.mark.parametrize("seed", range(6))
def test_guard_keeps_a_bursty_gain(seed):
    """What serving saw at batch 1: speculative chunks commit 7 tokens while the text does not repeat and 40
    when it does (one chunk in ten), a 22% gain on average; the machine adds +-15% noise to every chunk.
    The first guard (a fast average of per-chunk rates, 10% margin) switched speculation off here on most
    seeds; the gain must be kept."""
    rng = np.random.default_rng(seed)
    p = DraftPolicy()
    kinds = []
    for _ in range(400):
        caps = p.draft_caps(SLOTS, K)
        speculative = bool(caps[1] > 0)
        seconds = 0.4 * rng.uniform(0.85, 1.15)
        tokens = 8
        if speculative:  # 10.3 tokens per 0.42 s on average against 8 per 0.4 s
            tokens, seconds = int(rng.choice([7] * 9 + [40])), seconds * 1.05
        p.observe(ChunkReport(num_slots=SLOTS, active=1, max_cap=int(caps[1]), tokens=tokens, seconds=seconds))
        kinds.append(speculative)
    assert p.speculating(SLOTS)
    assert kinds.count(True) >= 0.9 * len(kinds)


def test_guard_margin_narrows_with_active_rows():
    """With 8 active rows a 15% loss is clear evidence (margin 0.25 / sqrt(8) ~ 9%); with one row it is not."""
    for active, expect_on in ((8, False), (1, True)):
        p = DraftPolicy(load=LoadLimit(max_active=8))
        _simulate(p, spec_rate=85.0, plain_rate=100.0, active=active, k=16)
        assert p.speculating(SLOTS) == expect_on, active


def test_guard_turns_speculation_back_on_when_it_pays_again():
    p = DraftPolicy()
    _simulate(p, spec_rate=60.0, plain_rate=100.0, chunks=200)
    assert not p.speculating(SLOTS)
    kinds = _simulate(p, spec_rate=200.0, plain_rate=100.0, chunks=300)
    assert p.speculating(SLOTS)
    assert kinds[-100:].count(True) >= 90


def test_fixed_policy_keeps_speculating_when_it_is_slower():
    """Negative control: without the guard the slow case speculates throughout."""
    p = DraftPolicy("fixed")
    kinds = _simulate(p, spec_rate=60.0, plain_rate=100.0)
    assert all(kinds)


def test_rates_are_compared_per_active_row():
    """Speculative chunks at 1 active row, plain chunks at 8 rows with the same (or a lower) rate per row: the
    plain chunks commit 8x the tokens per second in all, yet speculation is not slower per row and stays on."""
    p = DraftPolicy()
    for i in range(300):
        caps = p.draft_caps(SLOTS, K)
        speculative = bool(caps.any())  # the kind the policy asked for
        active = 1 if speculative else 8
        assert bool(caps[active] > 0) == speculative
        per_row = 100.0 if speculative else 95.0
        p.observe(ChunkReport(num_slots=SLOTS, active=active, max_cap=int(caps[active]),
                              tokens=round(per_row * 0.1 * active), seconds=0.1))
        assert p.speculating(SLOTS), i
    # The same reports with speculation slower per row do switch it off: the case above is not vacuous.
    q = DraftPolicy()
    for _ in range(100):
        caps = q.draft_caps(SLOTS, K)
        speculative = bool(caps.any())
        active = 1 if speculative else 8
        per_row = 50.0 if speculative else 100.0
        q.observe(ChunkReport(num_slots=SLOTS, active=active, max_cap=int(caps[active]),
                              tokens=round(per_row * 0.1 * active), seconds=0.1))
    assert not q.speculating(SLOTS)


def test_empty_or_degenerate_reports_are_ignored():
    p = DraftPolicy()
    for report in (ChunkReport(SLOTS, 1, K, 0, 0.1), ChunkReport(SLOTS, 1, K, 5, 0.0),
                   ChunkReport(SLOTS, 0, K, 5, 0.1)):
        p.observe(report)
    assert p.guard.measured(SLOTS) == p.guard.measured(16) == (0, 0)
    assert p.speculating(SLOTS)


def test_batch_size_beyond_max_active_never_drafts():
    """max_active=0: no count of active rows may draft, and nothing is learned from the (plain) chunks."""
    p = DraftPolicy(load=LoadLimit(max_active=0))
    for _ in range(50):
        caps = p.draft_caps(16, K)
        assert not caps[1:].any()
        p.observe(ChunkReport(num_slots=16, active=3, max_cap=0, tokens=30, seconds=0.1))
    # Index 0 (no active row) is never read for a chunk; the rule is about rows that generate.
    assert p.speculating(16)


def test_all_zero_static_caps_give_zeros_and_observe_is_a_no_op():
    p = DraftPolicy(load=LoadLimit(max_active=0))
    assert not p.ceiling(16, K).any()
    for _ in range(20):
        assert not p.draft_caps(16, K).any()
        p.observe(ChunkReport(num_slots=16, active=3, max_cap=0, tokens=30, seconds=0.1))
    assert p.guard.measured(SLOTS) == p.guard.measured(16) == (0, 0)


# ---------------------------------------------------------------------- the gain model (a rollout's policy)


def _gain_policy(costs, mode="adaptive", overhead=None):
    """A rollout's policy over verify widths (1, 3, 5, 9) and the cost tables `costs` (batch -> {w: c(w)})."""
    gain = GainModel((1, 3, 5, 9), lambda b: costs[b], overhead=DraftingOverhead() if overhead is None else overhead)
    return DraftPolicy.for_rollouts(mode, gain)


def _chunk(cap, accepted_at, row_steps, *, batch=8, step_seconds=None):
    """A rollout chunk's report: `accepted_at` f64[8] accepted drafts per position over `row_steps`; timed (one
    step of `step_seconds`) when given."""
    return ChunkReport(num_slots=batch, active=batch, max_cap=cap, tokens=int(row_steps + np.sum(accepted_at)),
                       seconds=0.0 if step_seconds is None else step_seconds, steps=0 if step_seconds is None else 1,
                       accepted_at=np.asarray(accepted_at, np.float64), row_steps=row_steps)


def test_gain_model_speculates_where_the_measured_cost_pays():
    costs = {128: {1: 1.0, 3: 2.6, 5: 4.1, 9: 7.5}, 8: {1: 1.0, 3: 1.1, 5: 1.2, 9: 1.5}}
    policy = _gain_policy(costs)
    assert policy.cap(128, 8) == 0  # compute-bound: nothing pays at the prior acceptance
    assert policy.cap(8, 8) > 0
    # Measured: drafts at position 0 accepted in 60% of row-steps, decaying: K grows at the cheap batch.
    for _ in range(3):
        policy.observe(_chunk(8, np.array([0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3, 0.25]) * 100, 100))
    assert policy.cap(8, 8) == 8
    # Measured: almost nothing accepted: speculation goes off even where verifying is cheap.
    cold = _gain_policy(costs)
    for _ in range(3):
        cold.observe(_chunk(8, np.array([0.02, 0.01, 0, 0, 0, 0, 0, 0]) * 100, 100))
    assert cold.cap(8, 8) == 0
    assert _gain_policy(costs, mode="fixed").cap(128, 8) == 8
    assert _gain_policy(costs, mode="off").cap(8, 8) == 0
    unmeasured = GainModel((1, 9), lambda b: None)
    assert DraftPolicy.for_rollouts("adaptive", unmeasured).cap(8, 8) == 8  # no cost table: the full K


def test_gain_model_learns_what_a_drafting_chunk_costs():
    # At 128 rows the verify forward alone predicts c(3) = 1.22, so the prior acceptance explores width 3; the
    # chunk then ran 1.61x the plain chunk beside it (drafting, sampling at 3 positions, the switch).
    costs = {128: {1: 1.0, 3: 1.22, 5: 1.55, 9: 2.25}, 64: {1: 1.0, 3: 1.2, 5: 1.5, 9: 2.2},
             8: {1: 1.0, 3: 1.05, 5: 1.1, 9: 1.3}}
    shared = DraftingOverhead()
    policy = _gain_policy(costs, overhead=shared)
    assert policy.cap(128, 8) == 2
    nothing = np.zeros(8)
    policy.observe(_chunk(2, nothing, 128 * 16, batch=128, step_seconds=1.61))
    assert shared.factor(128) == 1.0  # one chunk alone is no comparison
    policy.observe(_chunk(0, nothing, 128 * 16, batch=128, step_seconds=1.0))
    assert shared.factor(128) == pytest.approx(1.61 / 1.22)
    # Two plain chunks, or chunks at different batches, are not paired.
    policy.observe(_chunk(0, nothing, 128 * 16, batch=128, step_seconds=2.0))
    policy.observe(_chunk(1, nothing, 64 * 16, batch=64, step_seconds=9.0))
    policy.observe(_chunk(0, nothing, 32 * 16, batch=32, step_seconds=1.0))
    assert shared.factor(128) == pytest.approx(1.61 / 1.22)
    # A later rollout of the same shape knows it before its first chunk (an RL loop's next training step):
    # with nothing measured yet about acceptance, it no longer explores at 128 rows.
    later = _gain_policy(costs, overhead=shared)
    assert later.cap(128, 8) == 0
    assert later.gain.expected_gain(128, 8)[2] == pytest.approx((1 + 0.3 + 0.09) / (1.22 * 1.61 / 1.22))
    # At a batch never measured the last factor stands in; where drafting is cheap it still pays.
    assert shared.factor(8) == shared.factor(128)
    assert later.cap(8, 8) > 0
    # A chunk that drafted cheaper than predicted (rows rarely drafted, narrow widths) pulls the factor down.
    later.observe(_chunk(4, nothing + 50, 8 * 16, batch=8, step_seconds=0.9))
    later.observe(_chunk(0, nothing, 8 * 16, batch=8, step_seconds=1.0))
    assert shared.factor(8) == pytest.approx(0.9 / 1.1)
    assert shared.factor(128) == pytest.approx(1.61 / 1.22)  # each batch keeps its own
    assert overhead_for(("a shape",)) is overhead_for(("a shape",)) is not overhead_for(("another",))


def test_gain_model_pairs_its_first_drafting_chunk_with_a_plain_one():
    """Acceptance high enough to keep drafting would never run the plain chunk the drafting cost is learned
    from (T = 0.7, 128 rows: seven drafting chunks in a row, 1.74x slower than plain). So, once per shape, the
    chunk after the first drafting one runs plain at the same batch; then the policy decides on what it learned."""
    costs = {128: {1: 1.0, 3: 1.22, 5: 1.55, 9: 2.25}, 32: {1: 1.0, 3: 1.05, 5: 1.1, 9: 1.3}}
    shared = DraftingOverhead()
    policy = _gain_policy(costs, overhead=shared)
    high = np.array([0.25 * 128 * 16, 0.15 * 128 * 16] + [0.0] * 6)  # 0.25 and 0.15 accepted per row-step
    assert policy.cap(128, 8) == 2
    policy.observe(_chunk(2, high, 128 * 16, batch=128, step_seconds=1.61))
    assert not shared.measured
    assert policy.gain.expected_gain(128, 8)[2] > 1  # acceptance alone would keep drafting
    assert policy.cap(128, 8) == 0  # the pairing chunk
    assert policy.cap(32, 8) > 0  # only at the batch that drafted
    policy.observe(_chunk(0, np.zeros(8), 128 * 16, batch=128, step_seconds=1.0))
    assert shared.measured and shared.factor(128) == pytest.approx(1.61 / 1.22)
    assert policy.cap(128, 8) == 0  # (1 + 0.4) / 1.61 < 1: drafting does not pay at 128 rows
    # Once measured, no more forced plain chunks: a drafting chunk at a cheap batch is followed by another.
    assert policy.cap(32, 8) > 0
    policy.observe(_chunk(2, high * 32 / 128, 32 * 16, batch=32, step_seconds=1.1))
    assert policy.cap(32, 8) > 0


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize("make, match", [
    (lambda: LoadLimit(max_active=-1), "max_active=-1"),
    (lambda: LoadLimit(full_k_active=0), "full_k_active=0"),
    (lambda: SlowdownGuard(smoothing=0), "smoothing=0"),
    (lambda: SlowdownGuard(smoothing=1.5), "smoothing=1.5"),
    (lambda: SlowdownGuard(probe_interval=0), "probe_interval=0"),
    (lambda: SlowdownGuard(min_chunks=0), "min_chunks=0"),
    (lambda: DraftPolicy("always"), "mode='always'"),
    (lambda: DraftPolicy.named("bogus"), "policy='bogus'"),
    (lambda: DraftPolicy.for_rollouts("bogus", GainModel((1, 9), lambda b: None)), "speculation='bogus'"),
])
def test_bad_settings_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_named():
    p = DraftPolicy.named("adaptive", max_active=3)
    assert p.mode == "adaptive" and p.load.max_active == 3 and p.guard is not None
    assert DraftPolicy.named("fixed").draft_caps(4, 5).tolist() == [5] * 5
    assert not DraftPolicy.named("off").drafts and not DraftPolicy.named("off").draft_caps(4, 5).any()
