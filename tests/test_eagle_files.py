"""EAGLE-3 drafters in the layout their authors publish and vLLM and SGLang load (`jaxspec.models.eagle_files`).

Checkpoints are written here tensor by tensor under the published names (as SpecForge saves them), so the test
depends on the layout, not on jaxspec's own writer: the drafter's forward must equal a numpy transcription of the
reference forward (vLLM's `llama_eagle3.py`: the layer over [input_norm(embedding); hidden_norm(feature)], the
feature as residual, the final norm before an LM head over the draft vocabulary mapped by `d2t`); on the default
model such a drafter drafts, is accepted and is lossless; what the layout cannot describe is refused by name.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.models.config import ModelConfig
from jaxspec.models.eagle_files import (
    drafter_kind,
    load_reference_eagle,
    load_reference_eagle3,
    save_reference_eagle,
    save_reference_eagle3,
)
from jaxspec.models.heads import Readout
from reference_numpy import apply_rope, rms_norm, rope_inverse_frequencies, silu

TARGET = ModelConfig(vocab_size=64, hidden_size=24, intermediate_size=40, num_layers=6, num_heads=4,
                     num_kv_heads=2, head_dim=6, rms_norm_eps=1e-5)
DRAFT = dict(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _config(**overrides) -> dict:
    """A drafter config.json as the EAGLE-3 authors' and SpecForge's drafters carry it."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 5000.0, "max_position_embeddings": 256,
            "vocab_size": TARGET.vocab_size, "draft_vocab_size": 20, "target_hidden_size": TARGET.hidden_size,
            "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
            **DRAFT, **overrides}


def _weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d, hd, f = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    h, hkv, n = config["num_attention_heads"], config["num_key_value_heads"], config["draft_vocab_size"]

    def w(*shape):
        return rng.normal(0, 0.3, shape).astype(np.float32)

    ids = np.sort(rng.choice(config["vocab_size"], n, replace=False))  # the target ids of the draft columns
    t2d = np.zeros(config["vocab_size"], bool)
    t2d[ids] = True
    return {"fc.weight": w(d, 3 * config["target_hidden_size"]),
            "midlayer.input_layernorm.weight": 1 + w(d), "midlayer.hidden_norm.weight": 1 + w(d),
            "midlayer.self_attn.q_proj.weight": w(h * hd, 2 * d),
            "midlayer.self_attn.k_proj.weight": w(hkv * hd, 2 * d),
            "midlayer.self_attn.v_proj.weight": w(hkv * hd, 2 * d),
            "midlayer.self_attn.o_proj.weight": w(d, h * hd),
            "midlayer.post_attention_layernorm.weight": 1 + w(d),
            "midlayer.mlp.gate_proj.weight": w(f, d), "midlayer.mlp.up_proj.weight": w(f, d),
            "midlayer.mlp.down_proj.weight": w(d, f), "norm.weight": 1 + w(d), "lm_head.weight": w(n, d),
            "d2t": (ids - np.arange(n)).astype(np.int64), "t2d": t2d}


def _write(path, config: dict, weights: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


def _reference_layer(w: dict, prefix: str, config: dict, x: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """A drafter's decoder layer as vLLM's forward runs it (numpy, float64), every position attending causally:
    attention over x [T, D_in] (its input already normed as the drafter norms it) added to `residual` [T, D], then
    the MLP over the normed sum added to it -> [T, D]."""
    hd, h, hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    q, k, v = (x @ w[f"{prefix}self_attn.{n}_proj.weight"].T for n in "qkv")
    T = len(x)
    inv_freq = rope_inverse_frequencies(hd, config["rope_theta"], None)
    q = np.stack([[apply_rope(q[t, i * hd:(i + 1) * hd], t, inv_freq) for i in range(h)] for t in range(T)])
    k = np.stack([[apply_rope(k[t, i * hd:(i + 1) * hd], t, inv_freq) for i in range(hkv)] for t in range(T)])
    v = v.reshape(T, hkv, hd)
    out = np.zeros((T, h, hd))
    for t in range(T):
        for i in range(h):
            g = i // (h // hkv)
            scores = k[: t + 1, g] @ q[t, i] / np.sqrt(hd)
            weights = np.exp(scores - scores.max())
            out[t, i] = (weights / weights.sum()) @ v[: t + 1, g]
    residual = residual + out.reshape(T, h * hd) @ w[f"{prefix}self_attn.o_proj.weight"].T
    y = rms_norm(residual, w[f"{prefix}post_attention_layernorm.weight"], config["rms_norm_eps"])
    y = silu(y @ w[f"{prefix}mlp.gate_proj.weight"].T) * (y @ w[f"{prefix}mlp.up_proj.weight"].T)
    return residual + y @ w[f"{prefix}mlp.down_proj.weight"].T


def _reference_forward(w: dict, config: dict, embeds: np.ndarray, aux: np.ndarray, norm_before_residual: bool):
    """One sequence through the reference EAGLE-3 drafter: embeds [T, D], aux [T, 3 D_t] -> (the fed-back hidden
    state [T, D], logits over the target vocabulary [T, V], -inf outside the draft vocabulary)."""
    eps = config["rms_norm_eps"]
    hidden = aux @ w["fc.weight"].T.astype(np.float64)
    normed = rms_norm(hidden, w["midlayer.hidden_norm.weight"], eps)
    x = np.concatenate([rms_norm(embeds, w["midlayer.input_layernorm.weight"], eps), normed], axis=-1)
    prenorm = _reference_layer(w, "midlayer.", config, x, normed if norm_before_residual else hidden)
    draft_logits = rms_norm(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [T, N]
    logits = np.full((len(x), config["vocab_size"]), -np.inf)
    logits[:, np.arange(len(w["d2t"])) + w["d2t"]] = draft_logits
    return prenorm, logits


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafter_forward_equals_the_reference_transcription(tmp_path, norm_before_residual):
    config = _config(norm_before_residual=norm_before_residual)
    weights = _weights(config, np.random.default_rng(0))
    head, meta = load_reference_eagle3(_write(tmp_path / "d", config, weights), TARGET)
    assert meta["feature_layers"] == [0, 2, 4]  # ids count layer inputs; jaxspec names layer outputs
    rng = np.random.default_rng(1)
    T = 7
    embeds = rng.normal(0, 1, (T, DRAFT["hidden_size"])).astype(np.float32)
    aux = rng.normal(0, 1, (T, 3 * TARGET.hidden_size)).astype(np.float32)
    want_hidden, want_logits = _reference_forward(weights, config, embeds.astype(np.float64),
                                                  aux.astype(np.float64), norm_before_residual)

    readout = head.draft_readout(Readout(embed=jnp.zeros((TARGET.vocab_size, DRAFT["hidden_size"])),
                                         lm_head=jnp.zeros((DRAFT["hidden_size"], TARGET.vocab_size))))
    hidden, cache = head(jnp.asarray(embeds)[None], head.target_features(jnp.asarray(aux))[None],
                         jnp.arange(T)[None], head.new_cache(1, 16))
    np.testing.assert_allclose(np.asarray(hidden[0]), want_hidden, rtol=2e-4, atol=2e-4)
    logits = np.asarray(readout.logits(hidden[0]))  # [T, N] over the draft columns
    got = np.full_like(want_logits, -np.inf)
    got[:, np.asarray(readout.full_vocab(jnp.eye(logits.shape[1])).argmax(-1))] = logits
    np.testing.assert_allclose(got, want_logits, rtol=2e-4, atol=2e-4)
    # The greedy draft token of each position is the reference's, as a target id.
    np.testing.assert_array_equal(np.asarray(readout.token_ids(jnp.argmax(logits, -1))), want_logits.argmax(-1))


def test_written_drafter_reads_back_equal(tmp_path):
    config = _config()
    weights = _weights(config, np.random.default_rng(2))
    head, _ = load_reference_eagle3(_write(tmp_path / "d", config, weights), TARGET)
    target = Readout(embed=jnp.zeros((TARGET.vocab_size, 16)), lm_head=jnp.zeros((16, TARGET.vocab_size)))
    out = save_reference_eagle3(tmp_path / "again", head, target)
    written = json.loads((out / "config.json").read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert written["draft_vocab_size"] == 20 and written["target_hidden_size"] == TARGET.hidden_size
    again, _ = load_reference_eagle3(out, TARGET)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(jaxspec_state(again)), jax.tree.leaves(
        jaxspec_state(head)))


def jaxspec_state(head):
    from flax import nnx

    return nnx.state(head)


def _drafters():
    """kind -> (a config.json of that kind, its weights, its loader)."""
    return {"eagle3": (_config, _weights, load_reference_eagle3),
            "eagle": (_eagle1_config, _eagle1_weights, load_reference_eagle)}


@pytest.mark.parametrize("kind, change, message", [
    ("eagle3", lambda c, w: c.update(architectures=["Eagle3Speculator"]),
     "names no EAGLE-3 drafter class jaxspec runs in its authors' layout"),
    ("eagle3", lambda c, w: c.update(num_hidden_layers=2), "num_hidden_layers"),
    ("eagle3", lambda c, w: c.update(vocab_size=65), "vocab_size"),
    ("eagle3", lambda c, w: c.update(target_hidden_size=32), "target_hidden_size"),
    ("eagle3", lambda c, w: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}), "id 0"),
    ("eagle3", lambda c, w: c.update(attention_bias=True), "attention_bias"),
    ("eagle3", lambda c, w: w.pop("midlayer.hidden_norm.weight"), "missing"),
    ("eagle3", lambda c, w: w.update(d2t=w["d2t"] + 100), "d2t"),
    ("eagle", lambda c, w: c.update(num_hidden_layers=2), "num_hidden_layers"),
    ("eagle", lambda c, w: c.update(vocab_size=65), "vocab_size"),
    ("eagle", lambda c, w: w.pop("layers.0.mlp.up_proj.weight"), "missing"),
    ("eagle", lambda c, w: w.update({"layers.0.self_attn.q_proj.weight": w["layers.0.self_attn.q_proj.weight"][:, :4]}),
     "other shapes"),
])
def test_what_a_drafter_cannot_run_is_refused_by_name(tmp_path, kind, change, message):
    make_config, make_weights, load = _drafters()[kind]
    config = make_config()
    weights = make_weights(config, np.random.default_rng(3))
    change(config, weights)
    with pytest.raises(ValueError, match=message):
        load(_write(tmp_path / "d", config, weights), TARGET)


@pytest.fixture(scope="module")
def early_exit(smollm2, tmp_path_factory):
    """A drafter for the default model written in the layout: its fc passes the output of layer L - 2 through,
    its layer adds little, and its final norm and LM head are the target's, so it predicts what the target's
    next-to-last layer does (the logit lens), which the target often agrees with."""
    cfg = smollm2.config
    d, layers = cfg.hidden_size, cfg.num_layers
    config = {**_config(), "hidden_size": d, "intermediate_size": 64, "num_attention_heads": 3,
              "num_key_value_heads": 1, "head_dim": 64, "vocab_size": cfg.vocab_size,
              "draft_vocab_size": cfg.vocab_size, "target_hidden_size": d, "rope_theta": cfg.rope.theta,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers - 1]}}
    rng = np.random.default_rng(4)
    weights = _weights({**config, "draft_vocab_size": 1, "vocab_size": 1}, rng)
    weights["fc.weight"] = np.concatenate([np.zeros((d, 2 * d)), np.eye(d)], axis=1).astype(np.float32)
    weights["midlayer.self_attn.o_proj.weight"] *= 0.01
    weights["midlayer.mlp.down_proj.weight"] *= 0.01
    weights["norm.weight"] = np.asarray(smollm2.params["norm"]["weight"][...])
    weights["lm_head.weight"] = np.ascontiguousarray(np.asarray(smollm2.params["lm_head"][...]).T)
    weights["d2t"] = np.zeros(cfg.vocab_size, np.int64)
    weights["t2d"] = np.ones(cfg.vocab_size, bool)
    return _write(tmp_path_factory.mktemp("early-exit"), config, weights)


@pytest.fixture(scope="module")
def held_out(smollm2):
    from jaxspec.train.data import humaneval_split

    _, prompts = humaneval_split()
    return [smollm2.tokenizer.encode(p) for p in prompts[:2]]


@pytest.mark.real_model
def test_a_published_layout_drafter_is_lossless_on_the_default_model(smollm2, held_out, early_exit):
    spec = SpecConfig(method="eagle3", head_path=early_exit)
    plain = jaxspec.generate(smollm2, held_out, max_new_tokens=32)
    out = jaxspec.generate(smollm2, held_out, max_new_tokens=32, spec=spec)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.mean_acceptance_length > 1.0, out.stats
    sampling = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.8, top_p=0.9, seed=8)]
    plain = jaxspec.generate(smollm2, held_out, max_new_tokens=24, sampling=sampling)
    out = jaxspec.generate(smollm2, held_out, max_new_tokens=24, sampling=sampling, spec=spec)
    assert out.token_ids == plain.token_ids and out.stats.drafted > 0
    with pytest.raises(ValueError, match="draft_vocab=4096 does not apply"):
        jaxspec.generate(smollm2, held_out, max_new_tokens=4, spec=SpecConfig(method="eagle3", head_path=early_exit,
                                                                             draft_vocab=4096))
    with pytest.raises(ValueError, match="holds a 'eagle3' head"):
        jaxspec.generate(smollm2, held_out, max_new_tokens=4, spec=SpecConfig(method="eagle", head_path=early_exit))


@pytest.mark.real_model
def test_export_command_writes_a_trained_reference_head(smollm2, tmp_path, capsys):
    """`python -m jaxspec.train.export_eagle` writes a reference-architecture head over the shipped ranking's
    first N ids, with the target's LM head columns and the matching map; a fused head is refused by name."""
    from jaxspec.models.heads import load_draft_vocab, new_head, save_head
    from jaxspec.train import export_eagle

    head = new_head("eagle3", smollm2.config, architecture="reference", seed=1)
    path = save_head(tmp_path / "head", head, kind="eagle3")
    out = tmp_path / "exported"
    assert export_eagle.main(["--head", str(path), "--out", str(out), "--draft-vocab", "512"]) == 0
    loaded, meta = load_reference_eagle3(out, smollm2.config)
    ranking = load_draft_vocab(_shipped_ranking(smollm2), smollm2.config.vocab_size)[:512]
    np.testing.assert_array_equal(np.asarray(loaded.ids[...]), ranking)
    lm_head = np.asarray(smollm2.params["lm_head"][...], np.float32)[:, ranking]
    np.testing.assert_allclose(np.asarray(loaded.lm_head[...]), lm_head, rtol=1e-2, atol=1e-6)  # bfloat16 file
    assert meta["feature_layers"] == list(head.feature_layers)
    fused = save_head(tmp_path / "fused", new_head("eagle3", smollm2.config), kind="eagle3")
    assert export_eagle.main(["--head", str(fused), "--out", str(tmp_path / "no")]) == 2
    assert "nor an EAGLE or EAGLE-3 head of the reference architecture" in capsys.readouterr().err


@pytest.mark.real_model
def test_export_command_writes_a_dflash_drafter_in_its_authors_layout(smollm2, tmp_path):
    """The shipped DFlash drafter exported with `python -m jaxspec.train.export_eagle` (bfloat16) loads back from
    the directory and drafts the same greedy text as plain decoding."""
    from jaxspec.models.heads import WEIGHTS_DIR
    from jaxspec.train import export_eagle

    out = tmp_path / "dflash"
    assert export_eagle.main(["--head", str(WEIGHTS_DIR / "smollm2-135m.dflash.safetensors"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [2, 15, 27]
    prompt = ["def running_mean(values):\n    \"\"\"Return the mean of every prefix of values.\"\"\"\n"]
    plain = jaxspec.generate(smollm2, prompt, max_new_tokens=24)
    spec = SpecConfig(method="dflash", head_path=str(out), draft_vocab=4096)
    out = jaxspec.generate(smollm2, prompt, max_new_tokens=24, spec=spec)
    assert out.token_ids == plain.token_ids and out.stats.drafted > 0


def _shipped_ranking(lm):
    from jaxspec.models.heads import WEIGHTS_DIR

    return WEIGHTS_DIR / f"{lm.name}.draft_vocab.json"


# ------------------------------------------------------------------------------------------------ EAGLE-1

def _eagle1_config(**overrides) -> dict:
    """An EAGLE-1 drafter's config.json as the EAGLE authors ship it: the target's Llama config, one layer."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 5000.0, "max_position_embeddings": 256,
            "vocab_size": TARGET.vocab_size, "hidden_size": TARGET.hidden_size, "intermediate_size": 40,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6, **overrides}


def _eagle1_weights(config: dict, rng: np.random.Generator, bias: bool = True) -> dict[str, np.ndarray]:
    d, hd, f = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    h, hkv = config["num_attention_heads"], config["num_key_value_heads"]

    def w(*shape):
        return rng.normal(0, 0.3, shape).astype(np.float32)

    out = {"fc.weight": w(d, 2 * d), "layers.0.self_attn.q_proj.weight": w(h * hd, d),
           "layers.0.self_attn.k_proj.weight": w(hkv * hd, d), "layers.0.self_attn.v_proj.weight": w(hkv * hd, d),
           "layers.0.self_attn.o_proj.weight": w(d, h * hd), "layers.0.post_attention_layernorm.weight": 1 + w(d),
           "layers.0.mlp.gate_proj.weight": w(f, d), "layers.0.mlp.up_proj.weight": w(f, d),
           "layers.0.mlp.down_proj.weight": w(d, f),
           "embed_tokens.weight": w(config["vocab_size"], d)}  # the target's, which the drafter does not use
    if bias:
        out["fc.bias"] = w(d)
    return out


def _eagle1_reference(w: dict, config: dict, embeds: np.ndarray, features: np.ndarray) -> np.ndarray:
    """One sequence through the EAGLE authors' EAGLE-1 drafter: fc over [embedding; feature], a layer without its
    input norm, no final norm -> the predicted features [T, D]."""
    x = np.concatenate([embeds, features], axis=-1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
    return _reference_layer(w, "layers.0.", config, x, x)


@pytest.mark.parametrize("bias", [True, False])
def test_eagle1_drafter_forward_equals_the_reference_transcription(tmp_path, bias):
    config = _eagle1_config()
    weights = _eagle1_weights(config, np.random.default_rng(5), bias)
    path = _write(tmp_path / "d", config, weights)
    assert drafter_kind(path) == "eagle"
    head, meta = load_reference_eagle(path, TARGET)
    assert meta["kind"] == "eagle" and (head.fc_bias is not None) == bias
    rng = np.random.default_rng(6)
    T = 7
    embeds = rng.normal(0, 1, (T, TARGET.hidden_size)).astype(np.float32)
    features = rng.normal(0, 1, (T, TARGET.hidden_size)).astype(np.float32)
    want = _eagle1_reference(weights, config, embeds.astype(np.float64), features.astype(np.float64))
    got, _ = head(jnp.asarray(embeds)[None], head.target_features(jnp.asarray(features))[None], jnp.arange(T)[None],
                  head.new_cache(1, 16))
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=2e-4, atol=2e-4)
    again, _ = load_reference_eagle(save_reference_eagle(tmp_path / "again", head), TARGET)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(jaxspec_state(again)),
                 jax.tree.leaves(jaxspec_state(head)))


def test_a_llama_directory_is_not_a_drafter(tmp_path):
    """A one-layer Llama checkpoint without `fc.weight` is a model, not an EAGLE drafter."""
    config = _eagle1_config()
    weights = {k: v for k, v in _eagle1_weights(config, np.random.default_rng(8)).items() if not k.startswith("fc")}
    assert drafter_kind(_write(tmp_path / "d", config, weights)) is None
    assert drafter_kind(tmp_path / "absent") is None


@pytest.mark.real_model
def test_an_eagle1_drafter_is_lossless_on_the_default_model(smollm2, held_out, tmp_path):
    """An EAGLE-1 drafter for the default model written in its authors' layout, whose fc passes the target's
    feature through and whose layer adds little: it predicts from the target's own last feature, so some of
    EAGLE-2's tree is accepted, and greedy decoding is plain decoding's."""
    cfg = smollm2.config
    d = cfg.hidden_size
    config = _eagle1_config(vocab_size=cfg.vocab_size, hidden_size=d, intermediate_size=64, num_attention_heads=3,
                            num_key_value_heads=1, head_dim=64, rope_theta=cfg.rope.theta)
    weights = _eagle1_weights(config, np.random.default_rng(9), bias=False)
    weights["fc.weight"] = np.concatenate([np.zeros((d, d)), np.eye(d)], axis=1).astype(np.float32)
    weights["layers.0.self_attn.o_proj.weight"] *= 0.001
    weights["layers.0.mlp.down_proj.weight"] *= 0.001
    path = _write(tmp_path / "d", config, weights)
    plain = jaxspec.generate(smollm2, held_out, max_new_tokens=32)
    out = jaxspec.generate(smollm2, held_out, max_new_tokens=32, spec=SpecConfig(method="eagle2", head_path=path))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.mean_acceptance_length > 1.0, out.stats
