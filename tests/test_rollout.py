"""`jaxspec.rollout`: groups of samples, grouped suffix-automaton speculation, tail compaction, log-probabilities.

On a tiny random model whose LM head is scaled up, so its distributions are peaked: sampled text then repeats
itself and siblings resemble each other, which gives the group automaton something to draft from (on a flat
distribution nothing would ever be drafted and the equality tests could pass without speculating). Every
speculative test asserts that drafts were made and some accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from contracts import programs_compiled
from jaxspec import SamplingParams, SpecConfig
from jaxspec.decode import NoProposer, decode_chunk
from jaxspec.policy import GainModel
from jaxspec.proposers.index.group_automaton import GroupAutomaton
from jaxspec.proposers.index.group_match import GroupMatch
from jaxspec.rollouts import batch_buckets, sample_seeds
from jaxspec.rollouts import inputs as rollout_inputs
from jaxspec.sampling import process_logits

PROMPTS = [[5, 6, 7, 8, 5, 6], [10, 11, 12, 13, 10, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
G, N = 4, 40
STOP = [93]  # a token some samples reach early and others late or never: the batch compacts
MIXED = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9),
         SamplingParams(temperature=0.0)]


@pytest.fixture(scope="module", autouse=True)
def _measured_costs(tmp_path_factory):
    """The draft policy weighs forward costs measured here, in a folder of this module's (the suite switches
    measuring off elsewhere), before the rollout that asks for them: each run sees the same table."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(jaxspec.cost.CACHE_ENV, str(tmp_path_factory.mktemp("verify_cost")))
        mp.setattr(jaxspec.cost, "BACKGROUND", False)
        yield


@pytest.fixture(scope="module")
def peaked_lm(tiny_lm):
    """The tiny model with its LM head scaled 40x: peaked next-token distributions."""
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 40.0 if "lm_head" in jax.tree_util.keystr(path) else x, tiny_lm.params)
    return jaxspec.LanguageModel(name="tiny-peaked", config=tiny_lm.config, graphdef=tiny_lm.graphdef,
                                 params=params, tokenizer=None)


def _run(lm, method, sam_index="auto", paths=None, **kw):
    spec = None if method == "none" else SpecConfig(method=method, sam_index=sam_index, tree_top_k=paths)
    kw.setdefault("sampling", MIXED)
    kw.setdefault("speculation", "fixed")
    kw.setdefault("stop_token_ids", STOP)
    return jaxspec.rollout(lm, PROMPTS, num_samples=G, max_new_tokens=N, spec=spec, seed=7, chunk_steps=4, **kw)


@pytest.fixture(scope="module")
def plain(peaked_lm):
    return _run(peaked_lm, "none")


@pytest.fixture(scope="module")
def grouped(peaked_lm):
    return _run(peaked_lm, "group_sam")


def test_result_layout(plain):
    assert len(plain.token_ids) == len(PROMPTS) and all(len(g) == G for g in plain.token_ids)
    assert plain.seeds.shape == (len(PROMPTS), G)
    for p in range(len(PROMPTS)):
        for g in range(G):
            tokens = plain.token_ids[p][g]
            assert 1 <= len(tokens) <= N
            assert plain.finish_reason[p][g] in ("stop", "length")
            assert len(plain.logprobs[p][g]) == len(tokens)
    # Samples of one sampled prompt differ (own seeds); the greedy prompt's samples are all the same.
    assert len({tuple(t) for t in plain.token_ids[0]}) > 1
    assert len({tuple(t) for t in plain.token_ids[2]}) == 1


def test_group_sam_reproduces_the_plain_rollout_token_for_token(plain, grouped):
    assert grouped.token_ids == plain.token_ids
    np.testing.assert_allclose(np.concatenate([np.ravel(x) for g in grouped.logprobs for x in g]),
                               np.concatenate([np.ravel(x) for g in plain.logprobs for x in g]), atol=2e-5)
    s = grouped.stats
    assert s.drafted > 0 and s.accepted > 0, "group_sam must draft and have drafts accepted"
    assert s.steps < plain.stats.steps
    assert s.mean_acceptance_length > 1.0
    assert plain.stats.drafted == 0 and plain.stats.mean_acceptance_length == pytest.approx(1.0)


def test_group_sam_with_the_automaton_index_reproduces_the_plain_rollout(peaked_lm, plain, grouped):
    """The suffix-automaton index (the default takes the texts index) drafts and keeps the plain tokens. Its
    matches are never longer than the texts index's (tests/test_group_match.py); that it accepts no more on
    this rollout is what this seed shows, not an invariant: a shorter match may still draft better."""
    automaton = _run(peaked_lm, "group_sam", sam_index="automaton")
    assert automaton.token_ids == plain.token_ids
    assert automaton.stats.drafted > 0 and automaton.stats.accepted > 0
    assert automaton.stats.accepted <= grouped.stats.accepted


def test_group_sam_paths_draft_a_tree_and_reproduce_the_plain_rollout(peaked_lm, plain):
    """Two continuations per row that differ in their first token (a tree of 2 x 4 nodes): the plain tokens,
    drafts made and accepted, some of them on the second path."""
    from jaxspec.proposers.index import group_match

    seen = {"second": 0}
    draft_paths = group_match.draft_paths

    def spy(*args, **kw):  # counts rows whose second path had a match, traced into the compiled loop
        out = draft_paths(*args, **kw)
        jax.debug.callback(lambda m: seen.__setitem__("second", seen["second"] + int((m[:, 1] >= 2).sum())),
                           out[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(group_match, "draft_paths", spy)
        tree = _run(peaked_lm, "group_sam", paths=2)
    assert tree.token_ids == plain.token_ids
    assert tree.stats.drafted > 0 and tree.stats.accepted > 0
    assert seen["second"] > 0, "some rows drafted a second path"


def test_rollout_equals_generate_with_the_sample_seeds(peaked_lm, plain):
    """Compaction, grouped prefill and batch order change nothing: one generate batch of every sample (no
    compaction) with the rollout's seeds gives the same tokens."""
    seeds = sample_seeds(7, len(PROMPTS), G).reshape(-1)
    rows = [s for s in MIXED for _ in range(G)]
    sampling = [SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=int(seed))
                for s, seed in zip(rows, seeds)]
    ref = jaxspec.generate(peaked_lm, [p for p in PROMPTS for _ in range(G)], max_new_tokens=N, sampling=sampling,
                           stop_token_ids=STOP)
    assert [t for group in plain.token_ids for t in group] == ref.token_ids


def test_prefill_per_sample_gives_the_same_tokens(peaked_lm, plain):
    assert _run(peaked_lm, "none", shared_prefill=False).token_ids == plain.token_ids


def test_compaction_gives_the_same_tokens_as_none(peaked_lm, plain):
    whole = _run(peaked_lm, "none", compaction=False)
    assert whole.token_ids == plain.token_ids
    assert {c.batch for c in whole.stats.chunks} == {len(PROMPTS) * G}
    assert len({c.batch for c in plain.stats.chunks}) > 1, "rows finished early enough to compact"


def test_greedy_group_sam_equals_greedy_generate(peaked_lm):
    res = jaxspec.rollout(peaked_lm, PROMPTS, num_samples=2, max_new_tokens=N, sampling=SamplingParams(),
                          spec=SpecConfig(method="group_sam"), speculation="fixed", chunk_steps=4)
    ref = jaxspec.generate(peaked_lm, PROMPTS, max_new_tokens=N)
    for p, group in enumerate(res.token_ids):
        assert group == [ref.token_ids[p]] * 2
    assert res.stats.accepted > 0


def test_group_sam_alone_in_generate_is_per_row_sam(peaked_lm):
    plain = jaxspec.generate(peaked_lm, PROMPTS, max_new_tokens=N)
    spec = jaxspec.generate(peaked_lm, PROMPTS, max_new_tokens=N, spec=SpecConfig(method="group_sam"))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0


def _teacher_forced(lm, prompt, tokens, sampling):
    """(raw, processed) log-probabilities of `tokens` after `prompt` from one forward over the whole text."""
    seq = jnp.asarray([prompt + tokens], jnp.int32)
    model = nnx.merge(lm.graphdef, lm.params)
    out, _ = model(seq, jnp.arange(seq.shape[1], dtype=jnp.int32)[None], model.new_cache(1, seq.shape[1]),
                   attention_impl="xla")
    logits = out.logits[0, len(prompt) - 1: -1].astype(jnp.float32)[None]  # [1, n, V]
    idx = np.arange(len(tokens))
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))[0, idx, tokens]
    processed = np.asarray(jax.nn.log_softmax(process_logits(logits, sampling.broadcast(1)), axis=-1))[0, idx, tokens]
    return raw, processed


@pytest.mark.parametrize("mode", ["sampling", "raw"])
def test_logprobs_equal_a_teacher_forced_forward(peaked_lm, grouped, mode):
    res = grouped if mode == "sampling" else _run(peaked_lm, "group_sam", logprobs_mode="raw")
    assert res.stats.accepted > 0
    for p, prompt in enumerate(PROMPTS):
        for g in (0, G - 1):
            tokens = res.token_ids[p][g]
            raw, processed = _teacher_forced(peaked_lm, prompt, tokens, MIXED[p])
            np.testing.assert_allclose(res.logprobs[p][g], processed if mode == "sampling" else raw, atol=1e-4)
    # The modes differ where the sampling settings reshape the distribution (temperature 0.7 here).
    raw0, processed0 = _teacher_forced(peaked_lm, PROMPTS[0], res.token_ids[0][0], MIXED[0])
    assert not np.allclose(raw0, processed0, atol=1e-3)


@pytest.mark.contract
def test_new_params_run_without_recompiling(peaked_lm, caplog):
    perturbed = [jax.tree.map(lambda x, s=s: x * s, peaked_lm.params) for s in (1.0, 0.97, 1.03)]
    kw = dict(num_samples=G, max_new_tokens=16, sampling=SamplingParams(temperature=0.8),
              spec=SpecConfig(method="group_sam"), speculation="fixed", chunk_steps=4, seed=1)
    first = jaxspec.rollout(peaked_lm, PROMPTS, params=perturbed[0], **kw)
    outs = []
    assert programs_compiled(caplog, lambda: outs.extend(jaxspec.rollout(peaked_lm, PROMPTS, params=p, **kw)
                                                         for p in perturbed[1:])) == {}, "new params recompiled"
    assert outs[0].token_ids != first.token_ids or outs[1].token_ids != first.token_ids, "params were not used"


@pytest.mark.parametrize("index", ["match", "automaton"])
def test_automata_catch_up_when_speculation_turns_on(peaked_lm, plain, monkeypatch, index):
    """Chunks that do not speculate leave the group indexes alone (they run the plain program); when the
    policy turns speculation on, every sample's string catches up, samples that finished meanwhile included,
    so each string ends as its sample's whole text and the tokens are the plain rollout's. Both indexes."""
    from jaxspec.rollouts import run as rollout_run

    calls = {"finished_at_catch_up": []}

    def cap(self, batch, k):  # no drafts until the batch compacts, then the full K
        return 0 if batch == len(PROMPTS) * G else k

    catch_up, collect = rollout_run._Rollout._catch_up, rollout_run._Rollout._collect

    def spy_catch_up(self, state, rows):
        calls["finished_at_catch_up"].append(len(self.samples) + int(np.sum(rows < 0)))
        return catch_up(self, state, rows)

    def spy_collect(self, state, rows, which):
        calls["state"], calls["rows"] = state, rows.copy()
        return collect(self, state, rows, which)

    monkeypatch.setattr(GainModel, "cap", cap)
    monkeypatch.setattr(rollout_run._Rollout, "_catch_up", spy_catch_up)
    monkeypatch.setattr(rollout_run._Rollout, "_collect", spy_collect)
    res = _run(peaked_lm, "group_sam", sam_index=index, speculation="adaptive")
    assert res.token_ids == plain.token_ids
    assert res.stats.drafted > 0 and res.stats.accepted > 0
    assert len(calls["finished_at_catch_up"]) == 1, "one catch-up, when drafting began"
    assert calls["finished_at_catch_up"][0] > 0, "samples finished and left the batch before it"
    automata = calls["state"].pstate.automata.value
    assert isinstance(automata, GroupMatch if index == "match" else GroupAutomaton)
    texts, text_len = np.asarray(automata.texts), np.asarray(automata.text_len)
    for p, prompt in enumerate(PROMPTS):
        for g in range(G):
            text = prompt + res.token_ids[p][g]
            assert text_len[p, g] == len(text) and texts[p, g, : len(text)].tolist() == text, (p, g)


def test_chunks_that_do_not_speculate_run_the_plain_program(peaked_lm, plain, monkeypatch):
    """With speculation off a group_sam rollout runs exactly rollout-none's decode program, its group indexes
    set aside (an idle proposer's state rides no loop), and gives its tokens."""
    from jaxspec.rollouts import run as rollout_run

    used = []

    def spy(*args, step, **kwargs):
        used.append((step.proposer, step.widths, args[2].pstate))
        return decode_chunk(*args, step=step, **kwargs)

    monkeypatch.setattr(rollout_run, "decode_chunk", spy)
    res = _run(peaked_lm, "group_sam", speculation="off")
    assert res.token_ids == plain.token_ids
    assert used and all(p == NoProposer() and w == (1,) and s == () for p, w, s in used)


def test_references_are_draft_material_only(peaked_lm, plain, grouped):
    refs = [[t for t in plain.token_ids[p]] for p in range(len(PROMPTS))]
    with_refs = _run(peaked_lm, "group_sam", references=refs)
    assert with_refs.token_ids == plain.token_ids
    assert with_refs.stats.accepted > grouped.stats.accepted, "the samples themselves as references draft more"


def test_a_full_group_automaton_stops_drafting_not_decoding(peaked_lm, plain):
    tight = _run(peaked_lm, "group_sam", group_capacity=12)
    assert tight.token_ids == plain.token_ids
    assert tight.stats.drafted < _run(peaked_lm, "group_sam").stats.drafted


def test_memory_bound_names_the_setting(peaked_lm, monkeypatch):
    monkeypatch.setattr(rollout_inputs, "available_memory", lambda: 1 << 14)
    with pytest.raises(ValueError, match="num_samples"):
        _run(peaked_lm, "group_sam")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=0), "num_samples=0"),
    (dict(prompts=[]), "prompts"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(references=[[[1, 2]]]), "references must be a list of 3"),
    (dict(references=[[1, 2], [[3]], [[4]]]), r"references\[0\]"),
    (dict(references=[[[1, 200]], [[3]], [[4]]]), r"references\[0\]\[0\]"),
    (dict(spec=SpecConfig(method="sam"), references=[[[1]], [[3]], [[4]]]), "group_sam"),
    (dict(sampling=[SamplingParams()]), "sampling"),
    (dict(logprobs_mode="tempered"), "logprobs_mode"),
    (dict(speculation="sometimes"), "speculation"),
    (dict(seed=-1), "seed"),
    (dict(stop="\n"), "tokenizer"),
    (dict(stop=["a", ""]), r"stop\[0\]"),
    (dict(group_capacity=0), "group_capacity"),
    (dict(spec=None, group_capacity=64), "group_capacity"),
    (dict(spec=SpecConfig(method="group_sam", sam_index="match"), group_capacity=64), "group_capacity=64"),
    (dict(spec=SpecConfig(method="group_sam", tree_top_k=2), group_capacity=64), "group_capacity=64"),
])
def test_bad_input_names_the_value(peaked_lm, kwargs, match):
    args = dict(prompts=PROMPTS, num_samples=G, max_new_tokens=8, sampling=SamplingParams(),
                spec=SpecConfig(method="group_sam"))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jaxspec.rollout(peaked_lm, args.pop("prompts"), **args)


STOP_STRINGS = ["\n\n", "."]


def test_stop_strings_end_samples_early_and_cut_as_generate_does(smollm2):
    """A sample whose text reaches a stop string leaves the batch after that chunk (the rest run on in a smaller
    one) and is cut where `generate(stop=...)` cuts it, with the same seeds."""
    prompts = ["def add(a, b):\n", "Write a haiku about rain."]
    sampling = SamplingParams(temperature=0.7)
    kw = dict(num_samples=3, max_new_tokens=48, sampling=sampling, stop=STOP_STRINGS, chunk_steps=8, seed=3)
    res = jaxspec.rollout(smollm2, prompts, **kw)
    seeds = sample_seeds(3, len(prompts), 3).reshape(-1)
    ref = jaxspec.generate(smollm2, [p for p in prompts for _ in range(3)], max_new_tokens=48, stop=STOP_STRINGS,
                           sampling=[SamplingParams(temperature=0.7, seed=int(s)) for s in seeds])
    assert [t for group in res.token_ids for t in group] == ref.token_ids
    assert [t for group in res.text for t in group] == ref.text
    assert [r for group in res.finish_reason for r in group] == ref.finish_reason
    assert all(not any(s in t for s in STOP_STRINGS) for group in res.text for t in group)
    lengths = [len(t) for group in res.token_ids for t in group]
    assert min(lengths) < 48 and sum(r == "stop" for g in res.finish_reason for r in g) >= 2, lengths
    assert [len(lp) for group in res.logprobs for lp in group] == lengths
    # The stopped samples left the batch: after the first chunk no chunk ran all six rows.
    assert res.stats.chunks[-1].batch < 6 and res.stats.chunks[-1].active < 6


def test_params_of_other_shapes_are_refused(peaked_lm):
    bad = jax.tree_util.tree_map_with_path(
        lambda path, x: x[:-1] if "embed" in jax.tree_util.keystr(path) else x, peaked_lm.params)
    with pytest.raises(ValueError, match=r"params.*embed.*shape"):
        jaxspec.rollout(peaked_lm, PROMPTS, num_samples=2, max_new_tokens=4, sampling=SamplingParams(), params=bad)
    with pytest.raises(ValueError, match="params"):
        jaxspec.rollout(peaked_lm, PROMPTS, num_samples=2, max_new_tokens=4, sampling=SamplingParams(),
                        params={"not": "the model"})


def test_stats_are_consistent(plain, grouped):
    for res in (plain, grouped):
        s = res.stats
        assert s.num_samples == len(PROMPTS) * G
        assert 0 < s.prefill_s <= s.time_to_50_s <= s.time_to_90_s <= s.time_to_100_s <= s.wall_s
        assert s.tail_s >= 0
        active = np.asarray(s.active_per_step)
        assert active[0] <= s.num_samples and np.all(np.diff(active) <= 0)
        assert sum(s.committed_per_step) == s.committed == sum(len(t) - 1 for g in res.token_ids for t in g)
        assert s.row_steps == active.sum() and len(s.step_end_s) == s.steps
        assert s.tail_row_steps <= s.row_steps
        # Each chunk's run time excludes compiling (these rollouts compiled their programs in their chunks).
        assert all(c.run_s > 0 for c in s.chunks) and sum(c.run_s for c in s.chunks) < s.wall_s - s.prefill_s
        # Both never switch between drafting and plain chunks (K = 0; speculation="fixed"), so no pair of
        # chunks teaches the policy a drafting cost within them.
        assert len({c.drafting_overhead for c in s.chunks}) == 1


def test_batch_buckets():
    assert batch_buckets(128) == (128, 64, 32, 16, 8, 1)
    assert batch_buckets(12) == (12, 8, 1)
    assert batch_buckets(5) == (5, 1)
    assert batch_buckets(1) == (1,)


