"""DFlash block drafting: lossless greedy and sampled decoding, the authors' checkpoint layout (names, shapes and
their forward), errors at the boundary, and the shipped drafter on the real model."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from scipy import stats

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.models.dflash import DFlashDrafter, block_visibility
from jaxspec.models.eagle_files import dflash_layer_ids, load_reference_dflash, save_reference_dflash
from jaxspec.models.heads import Readout, fill_params, flat_params, load_head, new_head, save_head
from jaxspec.train.prompts import humaneval_split
from test_draft_vocab import RewrittenQ
from test_hardening import _exact_pairs

VOCAB = 97  # the tiny model's
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2], [11, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82]]


@pytest.fixture(scope="module")
def drafter_file(tiny_lm, tmp_path_factory):
    """A random DFlash drafter of two layers and blocks of 6 for the tiny model, saved as a head file. Its weight
    matrices are scaled up from the initialisation's 0.02 and its final norm by 4, so its distributions are far
    from uniform (the tiny target's own are spread over the whole vocabulary)."""
    graphdef, state = nnx.split(new_head("dflash", tiny_lm.config, num_layers=2, block_size=6, seed=4))
    scaled = {k: v * (8.0 if v.ndim == 2 else 4.0 if k == "norm.weight" else 1.0)
              for k, v in flat_params(state).items()}
    fill_params(state, scaled, source="test", needed="the drafter")
    return save_head(tmp_path_factory.mktemp("dflash") / "drafter", nnx.merge(graphdef, state), kind="dflash")


@pytest.mark.parametrize("k", [5, 2])
def test_greedy_dflash_matches_plain_decoding(tiny_lm, drafter_file, k):
    plain = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=24, ignore_eos=True)
    spec = SpecConfig(method="dflash", head_path=str(drafter_file), num_speculative_tokens=k)
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=24, spec=spec, ignore_eos=True)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


@pytest.mark.parametrize("tree", [(2, 2), (1, 3)])
def test_a_dflash_tree_matches_plain_decoding(tiny_lm, drafter_file, tree):
    """A tree of the block's chain and the next best candidates at its first positions: the same greedy and
    seeded output as plain decoding (its nodes are deterministic: the point-mass rule), with nodes drafted."""
    depth, top_k = tree
    spec = SpecConfig(method="dflash", head_path=str(drafter_file), num_speculative_tokens=5, tree_depth=depth,
                      tree_top_k=top_k)
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=1.0, seed=8)]
    plain = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=24, ignore_eos=True, sampling=sampling)
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=24, spec=spec, ignore_eos=True, sampling=sampling)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0
    prepared = jaxspec.prepare(tiny_lm, PROMPTS, max_new_tokens=24, spec=spec)
    assert prepared.proposer.max_depth == 5 - depth * (top_k - 1)


def test_a_dflash_tree_that_leaves_no_chain_is_refused():
    with pytest.raises(ValueError, match="tree_depth=4, tree_top_k=3, num_speculative_tokens=7"):
        SpecConfig(method="dflash", num_speculative_tokens=7, tree_depth=4, tree_top_k=3)


def test_the_drafter_reads_its_context_and_attends_within_the_block(tiny_lm, drafter_file):
    """The block's outputs depend on the committed context (through the cached keys) and, bidirectionally, on
    every block position: changing the anchor changes position 1's output and the last one's alike."""
    drafter, _ = load_head(drafter_file, tiny_lm.config)
    readout = Readout.of(tiny_lm.params)
    width, n = drafter.block_size, 5
    features = jax.random.normal(jax.random.key(0), (1, n, len(drafter.feature_layers) * tiny_lm.config.hidden_size))
    cache = drafter.new_cache(1, n + width)
    cache = drafter.write_context(features, jnp.arange(n)[None], cache, jnp.zeros((1,), jnp.int32))
    start = jnp.array([n], jnp.int32)

    def run(cache, anchor):
        embeds = drafter.block_embeds(readout, jnp.array([anchor], jnp.int32), width)
        return drafter(embeds, start[:, None] + jnp.arange(width), cache, write_at=start,
                       visible=block_visibility(start, width, n + width))

    base = run(cache, 7)
    other_anchor = run(cache, 8)
    assert not np.allclose(base[0, 1], other_anchor[0, 1]) and not np.allclose(base[0, -1], other_anchor[0, -1])
    others = jax.random.normal(jax.random.key(1), features.shape)  # (a rescaled context would norm to the same)
    other_context = run(drafter.write_context(others, jnp.arange(n)[None], cache, jnp.zeros((1,), jnp.int32)), 7)
    assert not np.allclose(base[0, -1], other_context[0, -1])


def uniform_q(probs, params):
    """Negative control: a uniform q in place of the distributions the drafts were drawn from (q lost on the way),
    so drafts are accepted as if any token were as likely. (Without any q the point-mass rule would stay lossless: a
    draft drawn with keys of its own is a fixed token to verification.)"""
    return jnp.full_like(probs, 1.0 / probs.shape[-1])


ROWS = 2048
PROMPT = [3, 14, 15, 92, 65]


def _exact_third(lm, prompt) -> np.ndarray:
    """f64[V]: the exact marginal of the third sampled token (temperature 1), by teacher-forced forwards over every
    pair of first two tokens."""
    pairs = _exact_pairs(lm, prompt, SamplingParams(temperature=1.0))
    rows = np.asarray([prompt + [a, b] for a, b in pairs], np.int32)
    positions = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
    out, _ = lm.module(jnp.asarray(rows), jnp.asarray(positions), lm.module.new_cache(len(rows), 16))
    third = np.asarray(jax.nn.softmax(out.logits[:, -1].astype(jnp.float32), axis=-1), np.float64)
    weights = np.asarray(list(pairs.values()))
    return weights @ third


def _chi_square(observed_tokens, exact) -> float:
    observed = np.bincount(observed_tokens, minlength=VOCAB).astype(np.float64)
    expected = ROWS * exact / exact.sum()
    small = expected < 5  # pooled into one cell
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(observed, expected).pvalue)


def _sampled(lm, spec):
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(ROWS)]
    return jaxspec.generate(lm, [PROMPT] * ROWS, max_new_tokens=4, sampling=sampling, spec=spec, ignore_eos=True)


def test_sampled_blocks_follow_the_target_distribution(tiny_lm, drafter_file):
    """2048 seeded rows at temperature 1, blocks of 2 drafts: the second and third generated tokens (the block's
    two positions, each drawn from its own q, independent of the other draft) follow the target's exact marginals
    by a chi-square test. The same blocks verified against a uniform q (negative control) fail it."""
    second = np.zeros(VOCAB)
    for (_, t1), prob in _exact_pairs(tiny_lm, PROMPT, SamplingParams(temperature=1.0)).items():
        second[t1] += prob
    third = _exact_third(tiny_lm, PROMPT)
    spec = SpecConfig(method="dflash", head_path=str(drafter_file), num_speculative_tokens=2)
    out = _sampled(tiny_lm, spec)
    assert out.stats.drafted > 0 and 0 < out.stats.accepted < out.stats.drafted
    assert out.stats.accepted_per_position[1] > 0  # second block positions were accepted too
    p_second = _chi_square([row[1] for row in out.token_ids], second)
    p_third = _chi_square([row[2] for row in out.token_ids], third)

    prepared = jaxspec.prepare(tiny_lm, [PROMPT] * ROWS, max_new_tokens=4, spec=spec)
    control = SpecConfig(method="custom", num_speculative_tokens=2, proposer=RewrittenQ(prepared.proposer, uniform_q),
                         proposer_params=prepared.proposer_params)
    control_out = _sampled(tiny_lm, control)
    control_p = min(_chi_square([row[1] for row in control_out.token_ids], second),
                    _chi_square([row[2] for row in control_out.token_ids], third))
    print(f"chi-square p: second {p_second:.3g}, third {p_third:.3g}; uniform-q control {control_p:.3g}")
    assert control_out.stats.drafted > 0
    assert p_second > 1e-3 and p_third > 1e-3
    assert control_p < 1e-6


def test_rollouts_draft_with_dflash_and_keep_the_greedy_samples(tiny_lm, drafter_file):
    spec = SpecConfig(method="dflash", head_path=str(drafter_file), num_speculative_tokens=5)
    plain = jaxspec.rollout(tiny_lm, PROMPTS, num_samples=2, max_new_tokens=16, sampling=SamplingParams(),
                            ignore_eos=True)
    out = jaxspec.rollout(tiny_lm, PROMPTS, num_samples=2, max_new_tokens=16, sampling=SamplingParams(), spec=spec,
                          speculation="fixed", ignore_eos=True)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


def test_more_drafts_than_the_block_holds_are_refused(tiny_lm, drafter_file):
    spec = SpecConfig(method="dflash", head_path=str(drafter_file), num_speculative_tokens=6)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=6 must be in \[1, 5\]"):
        jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=4, spec=spec)


def test_head_metadata_errors_name_the_field(tiny_lm, drafter_file, tmp_path):
    meta = json.loads(drafter_file.with_suffix(".json").read_text())
    for name, value, message in [("mask_token_id", 97, "'mask_token_id'=97 must be in [0, 96]"),
                                 ("block_size", 1, "'block_size'=1 must be in [2, inf]"),
                                 ("num_layers", "two", "'num_layers'")]:
        broken = tmp_path / f"{name}.safetensors"
        broken.write_bytes(drafter_file.read_bytes())
        broken.with_suffix(".json").write_text(json.dumps({**meta, name: value}))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_head(broken, tiny_lm.config)


# --------------------------------------------------------------------------------- the authors' layout


def _reference_forward(tensors: dict, config: dict, context: np.ndarray, block: np.ndarray,
                       positions: np.ndarray) -> np.ndarray:
    """The DFlash authors' drafter forward, written out in numpy from their model code: context [C, L*D] at
    positions 0..C-1, block embeddings [W, D] at `positions` [W]; returns the block's normed output [W, D]."""
    eps = config["rms_norm_eps"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta = config["rope_theta"]

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    def rope(x, pos):  # x [T, h, hd]; HF's rotate_half convention
        inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
        ang = pos[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        half = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + half * sin

    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    ctx = norm(context @ t["fc.weight"].T, t["hidden_norm.weight"])  # [C, D]
    ctx_pos = np.arange(len(context))
    h = block.astype(np.float64)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = norm(h, t[p + "input_layernorm.weight"])
        q = norm((x @ t[p + "self_attn.q_proj.weight"].T).reshape(-1, heads, hd), t[p + "self_attn.q_norm.weight"])
        both = np.concatenate([ctx, x])
        k = norm((both @ t[p + "self_attn.k_proj.weight"].T).reshape(-1, kv, hd), t[p + "self_attn.k_norm.weight"])
        v = (both @ t[p + "self_attn.v_proj.weight"].T).reshape(-1, kv, hd)
        all_pos = np.concatenate([ctx_pos, positions])
        q, k = rope(q, positions), rope(k, all_pos)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)  # non-causal: every key visible
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(len(block), -1)
        h = h + attn @ t[p + "self_attn.o_proj.weight"].T
        y = norm(h, t[p + "post_attention_layernorm.weight"])
        gate, up = y @ t[p + "mlp.gate_proj.weight"].T, y @ t[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    return norm(h, t["norm.weight"])


def test_the_authors_layout_round_trips_and_runs_their_forward(tiny_lm, drafter_file, tmp_path):
    """Export to the authors' layout: their tensor names and shapes and their config fields; loading it back gives
    the same parameters; and the drafter computes what their model code computes, block and context alike."""
    drafter, _ = load_head(drafter_file, tiny_lm.config)
    cfg = tiny_lm.config
    directory = save_reference_dflash(tmp_path / "ref", drafter, cfg)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {"block_size": 6, "mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1]}
    tensors = load_file(str(directory / "model.safetensors"))
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    expected = {"fc.weight": (d, 2 * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(2):
        p = f"layers.{i}."
        expected.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                         p + "self_attn.q_proj.weight": (cfg.num_heads * hd, d),
                         p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, d),
                         p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, d),
                         p + "self_attn.o_proj.weight": (d, cfg.num_heads * hd),
                         p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                         p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                         p + "mlp.down_proj.weight": (d, f)})
    assert {k: v.shape for k, v in tensors.items()} == expected

    loaded, meta = load_reference_dflash(directory, cfg)
    assert meta["feature_layers"] == [0, 1] and meta["block_size"] == 6 and meta["mask_token_id"] == VOCAB - 1
    mine, theirs = flat_params(nnx.state(drafter)), flat_params(nnx.state(loaded))
    assert set(mine) == set(theirs) and all(np.array_equal(mine[k], theirs[k]) for k in mine)

    # Their forward on a context of 7 positions and a block at positions 7..12.
    rng = np.random.default_rng(1)
    n, width = 7, drafter.block_size
    context = rng.normal(size=(n, 2 * d)).astype(np.float32)
    readout = Readout.of(tiny_lm.params)
    block = np.asarray(loaded.block_embeds(readout, jnp.array([5], jnp.int32), width))[0]
    positions = np.arange(n, n + width)
    want = _reference_forward(tensors, config, context, block, positions)
    cache = loaded.write_context(jnp.asarray(context)[None], jnp.arange(n)[None], loaded.new_cache(1, n + width),
                                 jnp.zeros((1,), jnp.int32))
    start = jnp.array([n], jnp.int32)
    got = loaded(jnp.asarray(block)[None], jnp.asarray(positions)[None], cache, write_at=start,
                 visible=block_visibility(start, width, n + width))[0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_a_directory_in_the_authors_layout_drafts_losslessly(tiny_lm, drafter_file, tmp_path):
    drafter, _ = load_head(drafter_file, tiny_lm.config)
    directory = save_reference_dflash(tmp_path / "ref", drafter, tiny_lm.config, dtype="bfloat16")
    plain = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=16, ignore_eos=True)
    out = jaxspec.generate(tiny_lm, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           spec=SpecConfig(method="dflash", head_path=str(directory), num_speculative_tokens=5))
    assert out.token_ids == plain.token_ids and out.stats.drafted > 0


def _edit(directory, config=None, drop=None, reshape=None):
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if drop or reshape:
        tensors = load_file(str(directory / "model.safetensors"))
        tensors.pop(drop, None)
        if reshape:
            tensors[reshape] = np.zeros((3, 3), np.float32)
        save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("change, message", [
    (lambda c: {**c, "architectures": ["DFlash2DraftModel"]}, "names no DFlash drafter class jaxspec runs"),
    (lambda c: {**c, "vocab_size": 100}, "'vocab_size'=100, but the target has 97"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "mask_token_id": 500}}, "mask_token_id=500"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "target_layer_ids": [0, 5]}}, "target_layer_ids"),
    (lambda c: {**c, "layer_types": ["sliding_attention"] * 2}, "causal or windowed"),
    (lambda c: {**{k: v for k, v in c.items() if k != "dflash_config"}, "target_layer_ids": [0, 1]},
     "'mask_token_id' is missing"),
    ("drop", "missing \\['layers.1.mlp.up_proj.weight'\\]"),
    ("reshape", "norm.weight"),
])
def test_a_bad_checkpoint_is_a_value_error_naming_the_problem(tiny_lm, drafter_file, tmp_path, change, message):
    drafter, _ = load_head(drafter_file, tiny_lm.config)
    directory = save_reference_dflash(tmp_path / "ref", drafter, tiny_lm.config)
    if change == "drop":
        _edit(directory, drop="layers.1.mlp.up_proj.weight")
    elif change == "reshape":
        _edit(directory, reshape="norm.weight")
    else:
        _edit(directory, config=change(json.loads((directory / "config.json").read_text())))
    with pytest.raises(ValueError, match=message):
        load_reference_dflash(directory, tiny_lm.config)


def test_default_target_layers_follow_the_authors_rule():
    assert dflash_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's drafter
    assert dflash_layer_ids(30, 1) == (15,)


def test_the_drafter_refuses_settings_that_cannot_run(tiny_lm):
    with pytest.raises(ValueError, match="mask_token_id=97"):
        DFlashDrafter(tiny_lm.config, (0, 1), mask_token_id=97, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="block_size=1"):
        DFlashDrafter(tiny_lm.config, (0, 1), block_size=1, mask_token_id=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="feature_layers=\\(0, 2\\)"):
        DFlashDrafter(tiny_lm.config, (0, 2), mask_token_id=3, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------------------------ the real model


@pytest.mark.real_model
def test_the_shipped_drafter_is_lossless_and_accepted_on_held_out_prompts(smollm2):
    """The drafter shipped for the default model, on held-out HumanEval prompts (never in its training data):
    greedy output equals plain decoding, and it drafts and gets drafts accepted."""
    _, held_out = humaneval_split()
    prompts = held_out[:3]
    plain = jaxspec.generate(smollm2, prompts, max_new_tokens=48)
    out = jaxspec.generate(smollm2, prompts, max_new_tokens=48, spec=SpecConfig(method="dflash"))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    # Its held-out figure is 1.64 tokens a step (models/weights/smollm2-135m.dflash.json): well above one token.
    assert out.stats.mean_acceptance_length > 1.3
