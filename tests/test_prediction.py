"""Predicted outputs (jaxspec.proposers.prediction): the cursor follows accepted tokens, re-syncs by n-gram after
an edit, respects the prediction's end and max_draft, falls back to the inner proposer, counts accepted and
rejected prediction tokens; and end to end, greedy and seeded sampled output equals plain decoding.

Unit tests run the proposer's functions under jax.jit on hand-built contexts, with a host simulator standing in
for greedy verification: the "target" emits a known output, a draft is accepted while it matches it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.proposers.base import ChainProposer, Committed, Context, Draft
from jaxspec.proposers.ngram import NgramProposer
from jaxspec.proposers.prediction import PredictionProposer, pad_predictions, with_prediction

WIDTH = 96  # history width of the hand-built contexts
L = 64  # max_prediction_len of the unit-test proposers
P = list(range(10, 50))  # a prediction of 40 distinct tokens
K4 = PredictionProposer(4, max_prediction_len=L)


# ------------------------------------------------------------------------------------------------ helpers

def _ctx(prompts, outputs, max_draft, active=None) -> Context:
    """A Context for rows holding prompt + output (B = len(prompts))."""
    batch = len(prompts)
    hist = np.zeros((batch, WIDTH), np.int32)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        hist[b, : len(p) + len(o)] = p + o
    lens = jnp.asarray([len(p) + len(o) for p, o in zip(prompts, outputs)], jnp.int32)
    return Context(history=jnp.asarray(hist), history_len=lens, max_draft=jnp.asarray(max_draft, jnp.int32),
                   sampling=SamplingParams().broadcast(batch), positions=lens - 1,
                   active=None if active is None else jnp.asarray(active, bool))


@functools.partial(jax.jit, static_argnums=0)
def _init(proposer, params, ctx):
    return proposer.init(params, ctx)


@functools.partial(jax.jit, static_argnums=0)
def _propose(proposer, params, pstate, ctx):
    keys = jax.vmap(jax.random.key)(ctx.sampling.seed)
    return proposer.propose(params, pstate, ctx, keys)


@functools.partial(jax.jit, static_argnums=0)
def _update(proposer, params, pstate, ctx, committed):
    return proposer.update(params, pstate, ctx, committed)


_install = jax.jit(with_prediction)


def _start(proposer, prompts, outputs, predictions, params=None):
    """The state after init (ctx holds each row's prompt and its first output token) and with_prediction."""
    k = proposer.num_speculative_tokens
    ctx = _ctx(prompts, outputs, [k] * len(prompts))
    pstate = _init(proposer, params, ctx)
    tokens, lengths = pad_predictions(predictions, proposer.max_prediction_len)
    return _install(pstate, tokens, lengths, ctx.history, ctx.history_len,
                    jnp.asarray([len(p) for p in prompts], jnp.int32))


def _committed(rows, k) -> Committed:
    """Committed from one token list per row (each at most K + 1 long)."""
    tokens = np.full((len(rows), k + 1), -1, np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return Committed(tokens=jnp.asarray(tokens), num=jnp.asarray([len(r) for r in rows], jnp.int32))


def _drafts(draft: Draft) -> list[list[int]]:
    tokens, num = jax.device_get((draft.tokens, draft.num_draft))
    return [tokens[b, : num[b]].tolist() for b in range(len(num))]


def simulate(proposer, prompts, truths, predictions, params=None):
    """Decode every row to its known output `truth` with greedy verification on the host (drafts accepted while
    they match, then the truth's next token), through the jitted propose/update. Returns (per step the drafts
    of every row, the final state, per row the prediction drafts made and accepted as the simulator saw them)."""
    k = proposer.num_speculative_tokens
    outputs = [t[:1] for t in truths]
    pstate = _start(proposer, prompts, outputs, predictions, params)
    trace, drafted, accepted = [], np.zeros(len(truths), int), np.zeros(len(truths), int)
    while any(len(o) < len(t) for o, t in zip(outputs, truths)):
        active = [len(o) < len(t) for o, t in zip(outputs, truths)]
        max_draft = [min(k, len(t) - len(o) - 1) if a else 0 for o, t, a in zip(outputs, truths, active)]
        draft, pstate = _propose(proposer, params, pstate, _ctx(prompts, outputs, max_draft, active))
        rows, step = [], _drafts(draft)
        from_prediction = np.asarray(pstate.drafted)
        for b, (o, t, d) in enumerate(zip(outputs, truths, step)):
            if not active[b]:
                rows.append([])
                continue
            rest = t[len(o):]
            n = 0
            while n < len(d) and n < len(rest) - 1 and d[n] == rest[n]:
                n += 1
            rows.append(rest[: n + 1])
            if from_prediction[b]:
                assert from_prediction[b] == len(d)
                drafted[b] += len(d)
                accepted[b] += n
        for o, r in zip(outputs, rows):
            o.extend(r)
        pstate = _update(proposer, params, pstate, _ctx(prompts, outputs, [0] * len(prompts)),
                         _committed(rows, k))
        trace.append(step)
    assert outputs == truths
    return trace, pstate, drafted, accepted


# ------------------------------------------------------------------------------------------------ unit tests

def test_cursor_follows_accepted_tokens():
    """Row 0's first token is the prediction's first: every step drafts the next K tokens and all are accepted.
    Row 1's first token is not: its first step proposes the prediction's start."""
    truths = [P[:30], [99] + P[:29]]
    trace, pstate, drafted, accepted = simulate(K4, [[1, 2, 3], [4, 5]], truths, [P, P])
    # Each step commits K accepted drafts and the target's own token (which continues the prediction).
    assert [s[0] for s in trace[:5]] == [P[1 + 5 * i: 5 + 5 * i] for i in range(5)]
    assert trace[0][1] == P[0:4] and trace[1][1] == P[5:9]
    assert np.asarray(pstate.rejected).tolist() == [0, 0]
    np.testing.assert_array_equal(pstate.accepted, accepted)
    np.testing.assert_array_equal(np.asarray(pstate.accepted) + np.asarray(pstate.rejected), drafted)
    # The cursor sits after the last committed token in both rows.
    np.testing.assert_array_equal(pstate.cursor, [30, 29])
    assert bool(jnp.all(pstate.synced))


def test_resync_after_substitution_deletion_and_insertion():
    """K=4, n-grams of 4..2 output tokens. The edit sits at prediction index 9 (token 19); the step drafting
    16..19 has 3 accepted and 1 rejected, then the row drafts nothing (no output n-gram of >= 2 tokens occurs in
    the prediction) until its newest two tokens are a prediction bigram after the cursor."""
    substitution = P[:9] + [90] + P[10:]
    deletion = P[:9] + P[10:]
    insertion = P[:9] + [90] + P[9:]
    trace, pstate, drafted, accepted = simulate(K4, [[1, 2, 3]] * 3, [substitution, deletion, insertion], [P] * 3)
    sub, dele, ins = ([step[b] for step in trace] for b in range(3))
    for row in (sub, dele, ins):
        assert row[:2] == [P[1:5], P[6:10]]
    # substitution: output ..., 18, 90 | 20 | 21 -> "20 21" = P[10:12]: the cursor moves to 12
    assert sub[2:5] == [[], [], P[12:16]]
    # deletion: output ..., 18, 20 | 21 -> "20 21" at P[10]
    assert dele[2:4] == [[], P[12:16]]
    # insertion: output ..., 18, 90 | 19 | 20 -> "19 20" at P[9]
    assert ins[2:5] == [[], [], P[11:15]]
    # After re-syncing every draft is accepted: the one rejected draft is the edit's.
    np.testing.assert_array_equal(pstate.rejected, [1, 1, 1])
    np.testing.assert_array_equal(pstate.accepted, accepted)
    np.testing.assert_array_equal(np.asarray(pstate.accepted) + np.asarray(pstate.rejected), drafted)


def test_first_drafts_are_probes():
    """K=8, probe=2: the first draft from a prediction, and the first after each re-sync, takes 2 tokens; once a
    draft is accepted whole, drafts take 8. In an unrelated output a 4-gram shared with the prediction by chance
    re-syncs the row, and the false draft it makes is the 2-token probe, not 8 tokens."""
    k8 = PredictionProposer(8, max_prediction_len=L, probe=2)
    substitution = P[:9] + [90] + P[10:]
    chance = [99, 98, 10, 11, 12, 13, 97, 96, 95, 94, 93, 92]
    trace, pstate, drafted, accepted = simulate(k8, [[1, 2, 3]] * 2, [substitution, chance], [P, P])
    edited, unrelated = ([step[b] for step in trace] for b in range(2))
    # The edit: 90 at index 9 ends the second draft's run, then "P10 P11" re-syncs to index 12.
    assert edited[:6] == [P[1:3], P[4:12], [], [], P[12:14], P[15:23]]
    # The trusted start probes P's start (rejected outright: re-sync now needs 4 tokens); "10 11 12 13" re-syncs.
    assert unrelated[0] == P[0:2] and unrelated[5] == P[4:6] and not any(unrelated[6:])
    np.testing.assert_array_equal(pstate.rejected, [3, 4])
    np.testing.assert_array_equal(pstate.accepted, accepted)
    np.testing.assert_array_equal(np.asarray(pstate.accepted) + np.asarray(pstate.rejected), drafted)


def test_resync_takes_the_longest_ngram_first_at_or_after_the_cursor():
    pred = [1, 2, 3, 4, 7, 3, 4, 9, 3, 4, 5, 6]
    # Row 0, cursor 2: "7 3 4" (index 4) beats the earlier bigram "3 4" at index 2 -> drafts from 7.
    # Row 1, cursor 8: "2 3 4" (index 1) and "3 4" at 2 and 5 lie behind the cursor; "3 4" at 8 -> drafts from 10.
    # Row 2, cursor 0: the output is one token, shorter than min_match: no match, no drafts.
    prompts, outputs = [[60, 61], [60], [60, 61, 62]], [[50, 7, 3, 4], [2, 3, 4], [4]]
    pstate = _start(K4, prompts, outputs, [pred] * 3)
    pstate = pstate.replace(cursor=jnp.asarray([2, 8, 0], jnp.int32), synced=jnp.zeros((3,), bool))
    draft, new = _propose(K4, None, pstate, _ctx(prompts, outputs, [4, 4, 4]))
    assert _drafts(draft) == [[9, 3, 4, 5], [5, 6], []]
    np.testing.assert_array_equal(new.cursor, [7, 10, 0])
    np.testing.assert_array_equal(new.synced, [True, True, False])
    np.testing.assert_array_equal(new.drafted, [4, 2, 0])


def test_resync_looks_behind_the_cursor_only_when_nothing_lies_ahead():
    pred = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 8]
    # Row 0, cursor 3: "1 2" at 6 lies ahead: it wins over index 0 behind -> drafts from 3 at index 8.
    # Row 1, cursor 12 (the output ran a period behind the re-synced cursor): "4 5" lies only behind; the last
    # occurrence (index 9) puts the cursor at 11 -> drafts "6 8".
    # Row 2, cursor 13 (the prediction used up): "2 3" last occurs at 7 -> drafts from 4 at index 9.
    prompts, outputs = [[60], [60], [60]], [[9, 1, 2], [9, 4, 5], [9, 2, 3]]
    pstate = _start(K4, prompts, outputs, [pred] * 3)
    pstate = pstate.replace(cursor=jnp.asarray([3, 12, 13], jnp.int32), synced=jnp.zeros((3,), bool))
    draft, new = _propose(K4, None, pstate, _ctx(prompts, outputs, [4, 4, 4]))
    assert _drafts(draft) == [[3, 4, 5, 6], [6, 8], [4, 5, 6, 8]]
    np.testing.assert_array_equal(new.cursor, [8, 11, 9])
    np.testing.assert_array_equal(new.synced, [True, True, True])


def test_the_resync_ngram_lies_in_the_output():
    """A prompt ending in a prediction bigram does not re-sync a row whose output is a single token."""
    prompts, outputs = [[1, 2, 10]], [[11]]
    pstate = _start(K4, prompts, outputs, [P])
    pstate = pstate.replace(cursor=jnp.zeros((1,), jnp.int32), synced=jnp.zeros((1,), bool))
    draft, _ = _propose(K4, None, pstate, _ctx(prompts, outputs, [4]))
    assert _drafts(draft) == [[]]


def test_no_drafts_past_the_prediction_end_and_max_draft_respected():
    k8 = PredictionProposer(8, max_prediction_len=L)
    pred = [10, 11, 12, 13, 14, 15]
    prompts, outputs = [[1, 2], [1, 2], [3]], [[10], [10], [10]]
    pstate = _start(k8, prompts, outputs, [pred] * 3)
    np.testing.assert_array_equal(pstate.cursor, [1, 1, 1])
    draft, pstate = _propose(k8, None, pstate, _ctx(prompts, outputs, [8, 2, 0]))
    # Row 0: the 5 tokens left; row 1: its max_draft of 2; row 2: max_draft 0.
    assert _drafts(draft) == [pred[1:], pred[1:3], []]
    np.testing.assert_array_equal(pstate.drafted, [5, 2, 0])
    committed = [pred[1:] + [77], pred[1:4], pred[1:2]]
    outputs = [o + c for o, c in zip(outputs, committed)]
    pstate = _update(k8, None, pstate, _ctx(prompts, outputs, [8, 8, 8]), _committed(committed, 8))
    np.testing.assert_array_equal(pstate.accepted, [5, 2, 0])
    np.testing.assert_array_equal(pstate.rejected, [0, 0, 0])
    np.testing.assert_array_equal(pstate.cursor, [6, 4, 2])
    draft, pstate = _propose(k8, None, pstate, _ctx(prompts, outputs, [8, 8, 8]))
    # Row 0 used the whole prediction (and left it): nothing more.
    assert _drafts(draft) == [[], pred[4:], pred[2:]]


def test_rows_without_a_prediction_use_the_inner_proposer():
    inner = NgramProposer(4, ngram_max=3, min_match=2)
    proposer = PredictionProposer(4, max_prediction_len=L, inner=inner)
    loop = [30, 31, 32, 33, 34, 35]
    # Row 0: in sync with its prediction. Row 1: no prediction (its history repeats: the n-gram proposer
    # drafts). Row 2: a prediction, out of sync with no match: the n-gram proposer drafts too.
    prompts = [[1, 2], loop + [30], loop + [30]]
    outputs = [[10], [31], [31]]
    pstate = _start(proposer, prompts, outputs, [P, [], [70, 71, 72]])
    pstate = pstate.replace(synced=jnp.asarray([True, True, False]))
    ctx = _ctx(prompts, outputs, [4, 4, 4])
    draft, pstate = _propose(proposer, None, pstate, ctx)
    alone, _ = _propose(inner, None, (), ctx)
    got, want = _drafts(draft), _drafts(alone)
    assert got[0] == P[1:5]
    assert got[1] == want[1] == loop[2:6] and got[2] == want[2]
    assert draft.probs is None and draft.parents is None
    np.testing.assert_array_equal(pstate.drafted, [4, 0, 0])  # only prediction drafts are counted


def test_accepted_and_rejected_counts_with_a_width_capped_step():
    """Each row drafts 4 prediction tokens; spec_step scored only 2 of them (a verify width of 3)."""
    pred = [10, 11, 12, 13, 14, 15, 16]
    prompts = [[1]] * 5
    outputs = [[10]] * 5
    pstate = _start(K4, prompts, outputs, [pred] * 5)
    draft, pstate = _propose(K4, None, pstate, _ctx(prompts, outputs, [4, 4, 4, 0, 4],
                                                    active=[True, True, True, False, True]))
    np.testing.assert_array_equal(pstate.drafted, [4, 4, 4, 0, 4])
    committed = [
        [11, 12, 13],  # 2 scored and accepted; the target's own token happens to continue the prediction
        [11, 12, 50],  # 2 scored and accepted; the target's own token differs
        [11, 50],  # 1 accepted, the second rejected
        [],  # finished: commits nothing, counts nothing
        [11, 12, 13, 14, 15],  # all 4 accepted, then the target's token (continuing the prediction)
    ]
    outputs = [o + c for o, c in zip(outputs, committed)]
    pstate = _update(K4, None, pstate, _ctx(prompts, outputs, [4] * 5), _committed(committed, 4))
    np.testing.assert_array_equal(pstate.accepted, [3, 2, 1, 0, 4])
    np.testing.assert_array_equal(pstate.rejected, [1, 2, 3, 0, 0])
    np.testing.assert_array_equal(pstate.cursor, [4, 3, 2, 1, 6])
    np.testing.assert_array_equal(pstate.synced, [True, False, False, True, True])
    np.testing.assert_array_equal(pstate.drafted, [0] * 5)  # reset for the next step


def test_with_prediction_sets_the_cursor_from_the_output_so_far():
    prompts = [[1, 2], [1], [5, 6, 7], [1], [1]]
    outputs = [[10], [99], [10, 11, 12], [10, 11, 50], [10]]
    pstate = _start(K4, prompts, outputs, [P, P, P, P, []])
    np.testing.assert_array_equal(pstate.cursor, [1, 0, 3, 2, 0])
    np.testing.assert_array_equal(pstate.synced, [True, True, True, False, True])
    np.testing.assert_array_equal(pstate.length, [40, 40, 40, 40, 0])
    np.testing.assert_array_equal(pstate.prompt_len, [2, 1, 3, 1, 1])
    assert pstate.tokens.shape == (5, L)


def test_settings_and_inputs_are_checked():
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        PredictionProposer(0, max_prediction_len=8)
    with pytest.raises(ValueError, match="max_prediction_len=0"):
        PredictionProposer(4, max_prediction_len=0)
    with pytest.raises(ValueError, match="ngram=1 must be an integer >= min_match=2"):
        PredictionProposer(4, max_prediction_len=8, ngram=1)
    with pytest.raises(ValueError, match="probe=0 must be an integer >= 1"):
        PredictionProposer(4, max_prediction_len=8, probe=0)
    with pytest.raises(ValueError, match=r"inner has num_speculative_tokens=5; it must be an integer in \[0, 4\]"):
        PredictionProposer(4, max_prediction_len=8, inner=NgramProposer(5))
    with pytest.raises(ValueError, match="reads the target's features"):
        PredictionProposer(4, max_prediction_len=8, inner=_FeatureProposer(4))
    with pytest.raises(ValueError, match="prediction 1 has 9 tokens; max_prediction_len=8"):
        pad_predictions([[1, 2], list(range(9))], 8)
    table, lengths = pad_predictions([[1, 2], [], None, np.arange(8)], 8)
    assert table.shape == (4, 8) and table.dtype == np.int32 and lengths.tolist() == [2, 0, 0, 8]
    pstate = _init(K4, None, _ctx([[1]], [[2]], [4]))
    with pytest.raises(ValueError, match="tokens has shape"):
        with_prediction(pstate, np.zeros((1, L + 1), np.int32), [1], jnp.zeros((1, 8), jnp.int32), [2], [1])
    with pytest.raises(ValueError, match=r"lengths\[0\]=5"):
        with_prediction(pstate, np.zeros((1, 4), np.int32), [5], jnp.zeros((1, 8), jnp.int32), [2], [1])
    sampled = PredictionProposer(4, max_prediction_len=L, inner=_SampledProposer(4))
    with pytest.raises(ValueError, match="deterministic chains"):
        _propose(sampled, None, _init(sampled, None, _ctx([[1]], [[2]], [4])), _ctx([[1]], [[2]], [4]))


class _FeatureProposer(ChainProposer):
    needs_features = True

    def __init__(self, k):
        self.num_speculative_tokens = k

    def init(self, params, ctx):
        return ()

    propose = update = init


class _SampledProposer(ChainProposer):
    """Drafts with a distribution (as a draft model does)."""

    def __init__(self, k):
        self.num_speculative_tokens = k

    def init(self, params, ctx):
        return ()

    def propose(self, params, pstate, ctx, keys):
        b, k = ctx.history.shape[0], self.num_speculative_tokens
        return Draft(tokens=jnp.zeros((b, k), jnp.int32), num_draft=jnp.zeros((b,), jnp.int32),
                     probs=jnp.ones((b, k, 4)) / 4), pstate

    def update(self, params, pstate, ctx, committed):
        return pstate


# ------------------------------------------------------------------------------------------------ end to end

NEW = 48
VOCAB = 97  # the tiny model's


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 12)]


def _edited(tokens):
    """The output with a substitution (index 10), a deletion (25) and an insertion (before 36)."""
    t = list(tokens)
    return t[:10] + [(t[10] + 1) % VOCAB] + t[11:25] + t[26:36] + [(t[36] + 3) % VOCAB] + t[36:]


def _run(lm, prompts, proposer, predictions, sampling=SamplingParams()):
    """prepare, prefill, install the predictions (None: leave none), decode. Returns (tokens, final state)."""
    p = jaxspec.prepare(lm, prompts, max_new_tokens=NEW, spec=SpecConfig(method="custom", proposer=proposer),
                        sampling=sampling)
    state = jaxspec.prefill(lm.graphdef, lm.params, p.prompts, p.prompt_lens, p.rows, p.proposer_params,
                            spec=p.prefill_spec)
    if predictions is not None:
        tokens, lengths = pad_predictions(predictions, proposer.max_prediction_len)
        state = state.replace(pstate=with_prediction(state.pstate, tokens, lengths, state.history,
                                                     state.history_len, state.prompt_len))
    state = jaxspec.decode(lm.graphdef, lm.params, state, p.rows, p.proposer_params, step=p.step)
    tokens, counts = p.new_tokens(state)
    return [t[:n].tolist() for t, n in zip(tokens, counts)], jax.device_get(state)


def test_generate_with_a_prediction_is_lossless_greedy(tiny_lm, prompts):
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW).token_ids
    proposer = PredictionProposer(16, max_prediction_len=64)
    # Row 0 predicts an edited copy of its output; row 1 its exact output.
    got, state = _run(tiny_lm, prompts, proposer, [_edited(plain[0]), plain[1]])
    assert got == plain
    pred, counters = state.pstate, state.counters
    assert (counters.drafted > 0).all()
    # No inner proposer and no verify width below the longest draft: every draft came from the prediction and
    # the state's counts agree with the loop's.
    np.testing.assert_array_equal(pred.accepted, counters.accepted)
    np.testing.assert_array_equal(pred.accepted + pred.rejected, counters.drafted)
    # The exact prediction commits probe + 1 = 9 tokens in the first step, then K + 1 a step: 47 tokens after
    # the first in 4 steps, all drafts accepted.
    assert proposer.probe == 8 and counters.steps[1] == 1 + -(-(NEW - 1 - 9) // 17)
    assert pred.rejected[1] == 0 and pred.accepted[1] == NEW - 1 - counters.steps[1]
    # The random model's greedy output is periodic (period 9 for row 0): an n-gram ending at an edit finds its
    # next occurrence a period later, so the re-synced cursor runs ahead (and re-syncs behind once nothing is
    # left ahead).
    # The first steps still accept the 9 tokens before the first edit (the seeded sampled test below shows
    # re-sync on text without a period).
    assert pred.accepted[0] >= 9 and pred.rejected[0] >= 1


def test_seeded_sampled_row_is_the_same_with_and_without_the_prediction(tiny_lm, prompts):
    """Row 0 samples (seeded) and predicts an edited copy of its plain output; row 1 is greedy with no
    prediction, drafting from the inner n-gram proposer."""
    sampling = [SamplingParams(temperature=0.8, seed=5), SamplingParams()]
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=NEW, sampling=sampling).token_ids
    proposer = PredictionProposer(8, max_prediction_len=64, inner=NgramProposer(8, ngram_max=3, min_match=1))
    got, state = _run(tiny_lm, prompts, proposer, [_edited(plain[0]), []], sampling)
    assert got == plain
    pred, counters = state.pstate, state.counters
    # Three edits cost a few rejected drafts each; most of the output is accepted prediction.
    assert pred.accepted[0] >= NEW // 2 and pred.rejected[0] >= 3
    # Row 0 also takes inner drafts on steps without a match: the prediction's share is part of the loop's.
    assert pred.accepted[0] <= counters.accepted[0] and pred.accepted[0] + pred.rejected[0] <= counters.drafted[0]
    assert pred.accepted[1] == pred.rejected[1] == 0
    assert state.counters.drafted[1] > 0  # the inner proposer drafted for the row without a prediction
    without, state = _run(tiny_lm, prompts, proposer, None, sampling)  # no prediction installed: inner only
    assert without == plain
    assert (state.pstate.accepted == 0).all()


# ------------------------------------------------------------------------------------- generate(prediction=)


@pytest.mark.parametrize("spec", [None, SpecConfig(method="sam", num_speculative_tokens=4, min_match=1)],
                         ids=["none", "sam"])
def test_generate_prediction_argument(tiny_lm, prompts, spec):
    """`generate(prediction=...)`: one prediction per row (None: the row drafts with the method alone), output
    the same as without it, greedy and seeded sampled rows, and the per-row prediction counts reported."""
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams()]
    rows = prompts + [prompts[0][:3]]
    plain = jaxspec.generate(tiny_lm, rows, max_new_tokens=NEW, sampling=sampling)
    predictions = [_edited(plain.token_ids[0]), list(plain.token_ids[1]), None]
    out = jaxspec.generate(tiny_lm, rows, max_new_tokens=NEW, sampling=sampling, spec=spec, prediction=predictions)
    assert out.token_ids == plain.token_ids
    first, second, third = out.stats.rows
    assert first.accepted_prediction_tokens > 0 and first.rejected_prediction_tokens > 0  # the edits
    # The whole output verified in blocks of up to 33: every token but the first (prefill's) and the target's
    # own one per step came from the prediction.
    assert second.steps <= 3
    assert second.accepted_prediction_tokens == NEW - 1 - second.steps and second.rejected_prediction_tokens == 0
    assert third.accepted_prediction_tokens is None and third.rejected_prediction_tokens is None
    for r in (first, second):
        assert r.accepted_prediction_tokens <= r.accepted <= r.drafted


def test_generate_prediction_errors(tiny_lm, prompts, head_files):
    with pytest.raises(ValueError, match="3 entries"):
        jaxspec.generate(tiny_lm, prompts + [[1]], max_new_tokens=4, prediction=[[1, 2]])
    with pytest.raises(ValueError, match=r"prediction\[1\] holds token id 97"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4, prediction=[[1], [2, 97]])
    with pytest.raises(ValueError, match="has no tokenizer"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4, prediction="def f():")
    with pytest.raises(ValueError, match=r"prediction\[0\]=3\.5"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4, prediction=[3.5, None])
    with pytest.raises(ValueError, match="prediction_tokens=0"):
        SpecConfig(prediction_tokens=0)
    spec = SpecConfig(method="medusa", head_path=str(head_files["medusa"]))
    with pytest.raises(ValueError, match="beside a chain proposer"):
        jaxspec.generate(tiny_lm, prompts, max_new_tokens=4, spec=spec, prediction=[[1], [2]])


def test_an_edit_of_the_default_model_output_is_verified_in_long_runs(smollm2, humaneval_prompts):
    """The real model and a real prompt: the prediction is the model's own greedy completion with one line
    changed, passed as text. Output is identical, most of it comes from accepted prediction drafts, and the
    loop takes far fewer steps than tokens."""
    prompt = humaneval_prompts[2]
    plain = jaxspec.generate(smollm2, [prompt], max_new_tokens=96)
    lines = plain.text[0].split("\n")
    edited = max(range(len(lines)), key=lambda i: len(lines[i]))
    lines[edited] = lines[edited].replace(" ", "  ", 1) + "  # edited"
    out = jaxspec.generate(smollm2, [prompt], max_new_tokens=96, prediction="\n".join(lines))
    assert out.token_ids == plain.token_ids
    row = out.stats.rows[0]
    assert row.accepted_prediction_tokens >= 0.6 * len(plain.token_ids[0])
    assert row.steps <= len(plain.token_ids[0]) // 4

