"""The engine's slot operations (`jaxspec.engine.slots`) on the tiny model's states, without any thread.

Each pure function is checked row by row against the states it was given: `empty_state` copies, `insert`
writes one row, `regroup` moves the kept rows to the front of a smaller or larger batch in the given order,
`finish` marks rows done, `stack_settings` fills free rows with defaults; the runner's batched admission writes
each row where admitting it alone would. Then the `Runner` is driven by hand
(admissions into chosen slots, a compaction that swaps two rows mid-generation, a growth with a new request
joining) and every token, draft flag and count must equal what the threaded engine gives the same requests.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import SamplingParams
from jaxspec.engine import Engine, EngineMetrics, Request, slots
from jaxspec.engine.request import MAX_STOP_IDS, LiveRequest, validate
from jaxspec.engine.runner import Runner
from jaxspec.limits import eos_ids
from jaxspec.policy import DraftPolicy
from jaxspec.state import DecodeState
from test_engine import CONFIG, PROMPTS, K, N, offline, run_all


def new_metrics() -> EngineMetrics:
    return EngineMetrics(drafted_per_position=np.zeros(K, np.int64), accepted_per_position=np.zeros(K, np.int64))


@pytest.fixture(scope="module")
def runner(tiny_lm):
    return Runner(tiny_lm, CONFIG, new_metrics())


def one_row(runner: Runner, prompt: list[int], max_tokens: int = 8) -> DecodeState:
    """A one-row state: `prompt` prefilled alone, as the engine admits a request."""
    padded = np.zeros((1, 16), np.int32)  # i32[1, P]: PROMPTS fit the smallest prompt bucket
    padded[0, : len(prompt)] = prompt
    rows = slots.stack_settings([slots.RowSettings(SamplingParams(), max_tokens, ())], MAX_STOP_IDS)
    return runner.prefill(jnp.asarray(padded), jnp.asarray([len(prompt)], jnp.int32), rows, wants_logprobs=False)


def host(state: DecodeState) -> DecodeState:
    """A host copy (the slot functions donate their inputs)."""
    return jax.device_get(state)


def assert_row(got: DecodeState, i: int, want: DecodeState, j: int) -> None:
    """Row i of `got` equals row j of `want`, leaf by leaf (the step counter excepted)."""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        if np.ndim(a):
            np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b)[j], err_msg=jax.tree_util.keystr(path))


def test_empty_state_is_finished_copies_of_one_row(runner):
    row = host(one_row(runner, PROMPTS[0]))
    empty = host(slots.empty_state(row, 4))
    assert empty.done.tolist() == [True] * 4
    assert int(empty.steps) == int(row.steps)
    for i in range(4):
        assert_row(empty.replace(done=row.done.repeat(4)), i, row, 0)


def test_insert_writes_one_slot_in_place(runner):
    base = host(one_row(runner, PROMPTS[0]))
    row = host(one_row(runner, PROMPTS[1], max_tokens=5))
    state = slots.insert(slots.empty_state(base, 4), row, jnp.asarray(2, jnp.int32))
    state = host(state)
    assert_row(state, 2, row, 0)
    assert state.done.tolist() == [True, True, bool(row.done[0]), True]
    for i in (0, 1, 3):
        assert_row(state.replace(done=np.zeros(4, bool)), i, base.replace(done=np.zeros(1, bool)), 0)


def filled(runner: Runner, prompts: list[list[int]]) -> DecodeState:
    """A batch whose row i holds prompts[i], prefilled."""
    state = slots.empty_state(one_row(runner, [1]), len(prompts))
    for i, p in enumerate(prompts):
        state = slots.insert(state, one_row(runner, p), jnp.asarray(i, jnp.int32))
    return state


@pytest.mark.parametrize("keep, n", [([3, 1], 2), ([2], 1), ([1, 0], 4), ([0, 1, 2, 3], 4)])
def test_regroup_moves_the_kept_rows_to_the_front(runner, keep, n):
    """Compaction (4 rows into 2 or 1, reordered) and growth (into 4, with empty rows after the kept ones)."""
    state = host(filled(runner, PROMPTS[:4]))
    empty = host(slots.empty_state(one_row(runner, [1]), n))
    out = host(slots.regroup(state, keep, slots.empty_state(one_row(runner, [1]), n)))
    assert out.done.shape == (n,)
    assert int(out.steps) == int(state.steps)
    for new, old in enumerate(keep):
        assert_row(out, new, state, old)
    for new in range(len(keep), n):
        assert_row(out, new, empty, new)


def test_regroup_refuses_more_rows_than_the_new_batch(runner):
    state = filled(runner, PROMPTS[:2])
    with pytest.raises(ValueError, match="at most the 1 rows"):
        slots.regroup(state, [0, 1], slots.empty_state(one_row(runner, [1]), 1))


def test_finish_marks_only_those_rows(runner):
    state = filled(runner, PROMPTS[:4])
    before = host(state)
    out = host(slots.finish(state, [0, 2]))
    assert out.done.tolist() == [True, bool(before.done[1]), True, bool(before.done[3])]
    assert_row(out.replace(done=before.done), 1, before, 1)


def test_stack_settings_gives_free_rows_the_defaults():
    row = slots.RowSettings(SamplingParams(temperature=0.5, top_k=3, seed=7), max_new_tokens=9, stop_ids=(5, 6))
    rows = slots.stack_settings([None, row, None], num_stop_ids=4)
    sampling, limits = rows.sampling, rows.limits
    assert np.asarray(limits.max_new_tokens).tolist() == [1, 9, 1]
    assert np.asarray(limits.stop_ids).tolist() == [[-1] * 4, [5, 6, -1, -1], [-1] * 4]
    want = SamplingParams.stack([SamplingParams(), row.sampling, SamplingParams()])
    for a, b in zip(jax.tree.leaves(sampling), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_admit_batch_writes_each_request_where_admit_would(tiny_lm):
    """Three requests prefilled together (a 40-token prompt pads the others to its bucket; the batch of 3 is
    padded to 4, the dummy row dropped) into slots 3, 0 and 2 leave the batch as admitting them one by one
    does: every row equal, but for float rounding in the prompts' K/V and the first token's log-probability
    (another width and batch size) and the K/V of padding positions, which no step reads."""
    long = [13, 14, 15, 16, 17] * 8
    requests = [Request(PROMPTS[0], N, method="sam"),
                Request(long, 12, SamplingParams(temperature=0.8, seed=5), method="ngram", num_speculative_tokens=2,
                        logprobs=2),
                Request(PROMPTS[2], 20, method="none")]
    slots_ = [3, 0, 2]
    stops = [validate(r, CONFIG, vocab_size=tiny_lm.config.vocab_size, eos_ids=eos_ids(tiny_lm)) for r in requests]
    config = dataclasses.replace(CONFIG, max_prefill_batch=4)  # 1 by default on CPU
    together, alone = Runner(tiny_lm, config, new_metrics()), Runner(tiny_lm, config, new_metrics())
    together.reset(4)
    alone.reset(4)
    firsts = together.admit_batch([(i, r, r.method, st) for i, r, st in zip(slots_, requests, stops)])
    assert firsts == [alone.admit(i, r, r.method, st) for i, r, st in zip(slots_, requests, stops)]
    got, want = host(together.state), host(alone.state)

    def exact(state: DecodeState) -> DecodeState:
        return state.replace(cache=None, logprobs=state.logprobs.replace(token=None, top_ids=None, top=None))

    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(exact(got))[0], jax.tree.leaves(exact(want))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    for a, b in zip(jax.tree.leaves((got.cache.k, got.cache.v)), jax.tree.leaves((want.cache.k, want.cache.v))):
        for slot, r in zip(slots_, requests):
            n = len(r.prompt_ids)
            np.testing.assert_allclose(np.asarray(a)[slot, :, :n], np.asarray(b)[slot, :, :n], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])  # the free row: untouched
    n = len(long)
    np.testing.assert_allclose(got.logprobs.token[0, n], want.logprobs.token[0, n], atol=2e-5)
    np.testing.assert_array_equal(got.logprobs.top_ids[0, n], want.logprobs.top_ids[0, n])


# ---------------------------------------------------------------------- the runner by hand vs the engine

REQUESTS = [Request(PROMPTS[0], N, method="sam"), Request(PROMPTS[3], N, method="ngram", num_speculative_tokens=2),
            Request(PROMPTS[1], 20, method="none"), Request(PROMPTS[2], 14, method="sam", logprobs=2)]


class ByHand:
    """The scheduler's bookkeeping, written out: which request holds which slot, and what each one got."""

    def __init__(self, lm):
        self.lm = lm
        self.runner = Runner(lm, CONFIG, new_metrics())
        self.rows: list[LiveRequest | None] = []
        self.tokens: dict[int, list[int]] = {}
        self.from_draft: dict[int, list[bool]] = {}
        self.logprobs: dict[int, list] = {}
        self.final: dict[int, tuple[int, int, int]] = {}

    def reset(self, n: int) -> None:
        self.runner.reset(n)
        self.rows = [None] * n

    def admit(self, rid: int, slot: int) -> None:
        req = REQUESTS[rid]
        stops = validate(req, CONFIG, vocab_size=self.lm.config.vocab_size, eos_ids=eos_ids(self.lm))
        live = LiveRequest(rid, req, callback=lambda out: None, method=req.method, stop_ids=stops, submitted=0.0)
        first = self.runner.admit(slot, req, live.method, live.stop_ids)
        assert not first.done
        self.rows[slot] = live
        self._take(live, first)

    def regroup(self, keep: list[int], n: int) -> None:
        self.runner.regroup(keep, n)
        self.rows = [self.rows[i] for i in keep] + [None] * (n - len(keep))

    def chunk(self) -> None:
        caps = np.full((CONFIG.max_slots + 1,), K, np.int32)  # DraftPolicy("fixed")'s table
        result = self.runner.run_chunk(self.rows, caps)
        for i, update in result.rows.items():
            live = self.rows[i]
            live.counters = update.counters
            self._take(live, update)
            if update.done:
                self.rows[i] = None
                self.final[live.request_id] = update.counters

    def _take(self, live: LiveRequest, update) -> None:
        live.emitted += len(update.tokens)
        self.tokens.setdefault(live.request_id, []).extend(update.tokens)
        self.from_draft.setdefault(live.request_id, []).extend(update.from_draft)
        if update.logprobs is not None:
            self.logprobs.setdefault(live.request_id, []).extend(update.logprobs)


def test_runner_by_hand_equals_the_threaded_engine(tiny_lm):
    """Requests 0 and 1 go into slots 3 and 1 of 4 rows; after a chunk the batch is compacted to 2 rows with
    their order swapped; after another it grows back to 4 and requests 2 and 3 join; then it shrinks as rows
    finish. Every request's tokens, draft flags, log-probabilities and counts equal the threaded engine's."""
    hand = ByHand(tiny_lm)
    hand.reset(4)
    hand.admit(0, 3)
    hand.admit(1, 1)
    hand.chunk()
    hand.regroup([3, 1], 2)
    assert [r.request_id for r in hand.rows] == [0, 1]
    hand.chunk()
    hand.regroup([0, 1], 4)
    hand.admit(2, 2)
    hand.admit(3, 3)
    while any(hand.rows):
        hand.chunk()
        keep = [i for i, r in enumerate(hand.rows) if r is not None]
        smallest = next(b for b in CONFIG.slot_buckets if b >= max(len(keep), 1))
        if keep and smallest < len(hand.rows):  # as the engine shrinks
            hand.regroup(keep, smallest)
    assert sorted(hand.final) == [0, 1, 2, 3]

    engine = Engine(tiny_lm, CONFIG, policy=DraftPolicy("fixed")).start(warmup=False)
    try:
        results = run_all(engine, REQUESTS)
    finally:
        engine.shutdown(drain=False, timeout=60)
    for rid, (req, c) in enumerate(zip(REQUESTS, results)):
        assert hand.tokens[rid] == c.tokens == offline(tiny_lm, req.prompt_ids, n=req.max_tokens), rid
        assert hand.from_draft[rid] == [f for o in c.outputs for f in o.from_draft], rid
        stats = c.final.stats
        assert hand.final[rid] == (stats.steps, stats.drafted, stats.accepted), rid
    assert sum(hand.final[rid][1] for rid in hand.final) > 0  # the sam and ngram rows drafted
    got, want = hand.logprobs[3], [e for o in results[3].outputs for e in o.logprobs]
    assert len(got) == len(want) == REQUESTS[3].max_tokens
    assert [(e.token_id, [t for t, _ in e.top]) for e in got] == [(e.token_id, [t for t, _ in e.top]) for e in want]
    # Rows of other batches verify at other widths: the same values, up to float rounding.
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=2e-5)


def test_batch_settings_are_reused_until_a_slot_changes(runner):
    """The runner stacks the slots' settings once and reuses them while every slot holds the same values; a new
    seed in one slot, or a freed slot, builds them anew."""
    def live(temperature, seed):
        request = types.SimpleNamespace(sampling=SamplingParams(temperature=temperature, seed=seed), max_tokens=5)
        return types.SimpleNamespace(request=request, stop_ids=[1])

    first = runner.batch_settings([live(0.7, 1), None, live(0.0, 2)])
    assert runner.batch_settings([live(0.7, 1), None, live(0.0, 2)]) is first
    rows = runner.batch_settings([live(0.7, 3), None, live(0.0, 2)])
    sampling, limits = rows.sampling, rows.limits
    assert sampling.seed.tolist() == [3, 0, 2] and limits.max_new_tokens.tolist() == [5, 1, 5]
    rows = runner.batch_settings([live(0.7, 3), None, None])
    sampling, limits = rows.sampling, rows.limits
    assert sampling.seed.tolist() == [3, 0, 0] and limits.max_new_tokens.tolist() == [5, 1, 1]
