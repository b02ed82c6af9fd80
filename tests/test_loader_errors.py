"""Bad files at the loaders' boundary: each is a ValueError naming the file and what is wrong, raised before any
allocation sized by the bad file; and rollouts/batches too large for memory refused from their sizes alone."""

from __future__ import annotations

import json
import re
import shutil
import time

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.models.heads import load_head
from jaxspec.models.loading import load_model, named_model_path
from reference_numpy import random_hf_checkpoint

HF = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
          attention_bias=False)


def _raises(call, *parts: str):
    """Call `call`, expecting a ValueError whose message holds every one of `parts` (literally)."""
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


# ------------------------------------------------------------------------------------------------ GGUF

L, D, F, H, KV, HD, V = 2, 16, 24, 4, 2, 4, 40


def _gguf_tensors(rng) -> dict[str, np.ndarray]:
    t = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(L):
        t.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.attn_q.weight": (H * HD, D),
                  f"blk.{i}.attn_k.weight": (KV * HD, D), f"blk.{i}.attn_v.weight": (KV * HD, D),
                  f"blk.{i}.attn_output.weight": (D, H * HD), f"blk.{i}.ffn_norm.weight": (D,),
                  f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                  f"blk.{i}.ffn_down.weight": (D, F)})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


def write_gguf(path, *, tensors=None, block_count=L, skip_field=None, arch="llama"):
    """A tiny llama GGUF (float32 tensors, a byte-level vocabulary of V tokens) that load_model accepts (of another
    `arch`, the same metadata and tensors under that architecture's name)."""
    tensors = _gguf_tensors(np.random.default_rng(0)) if tensors is None else tensors
    w = gguf.GGUFWriter(str(path), arch)
    fields = {"block_count": block_count, "embedding_length": D, "feed_forward_length": F, "head_count": H,
              "head_count_kv": KV, "context_length": 128}
    for name, value in fields.items():
        if name != skip_field:
            getattr(w, f"add_{name}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) if i < 26 else f"t{i}" for i in range(V)])
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_tiny_gguf_loads(tmp_path):
    lm = load_model(write_gguf(tmp_path / "tiny.gguf"))
    assert (lm.config.num_layers, lm.config.hidden_size, lm.config.vocab_size) == (L, D, V)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_is_refused_by_name(tmp_path, arch):
    _raises(lambda: load_model(write_gguf(tmp_path / f"{arch}.gguf", arch=arch)),
            f"architecture '{arch}' is not supported", "Gemma 2 and Gemma 3 load from Hugging Face directories")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_gguf_names_the_file_and_the_tensor(tmp_path, keep):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: int(len(whole) * keep)])
    message = _raises(lambda: load_model(path), str(path), "truncated", f"the file ({path.stat().st_size} bytes)")
    assert re.search(r"tensor '(token_embd|output|blk\.\d+\.\w+)\.weight'", message)


def test_a_gguf_cut_inside_its_header_names_the_file(tmp_path):
    path = tmp_path / "head.gguf"
    path.write_bytes(write_gguf(tmp_path / "whole.gguf").read_bytes()[:200])
    _raises(lambda: load_model(path), str(path), "truncated, corrupt or not a GGUF file")


def test_the_default_model_truncated_names_the_file_and_a_tensor(default_model_installed, tmp_path, monkeypatch):
    source = named_model_path(jaxspec.DEFAULT_MODEL)
    path = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(source.stat().st_size - 4096))

    def dequantize(*args):
        raise AssertionError("a tensor was read before the file's size was checked")

    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    _raises(lambda: load_model(path), str(path), "truncated or corrupt: tensor 'blk.9.attn_v.weight'",
            "past the end of the file (98358336 bytes) (and 1 more tensors after it)")


def test_gguf_nan_and_integer_weights_are_named(tmp_path):
    tensors = _gguf_tensors(np.random.default_rng(0))
    tensors["blk.1.ffn_up.weight"][3, 5] = np.nan
    path = write_gguf(tmp_path / "nan.gguf", tensors=tensors)
    _raises(lambda: load_model(path), str(path), "'blk.1.ffn_up.weight'", "non-finite", "(3, 5)")
    tensors = _gguf_tensors(np.random.default_rng(0))
    tensors["output_norm.weight"] = np.ones((D,), np.int32)
    path = write_gguf(tmp_path / "int.gguf", tensors=tensors)
    _raises(lambda: load_model(path), str(path), "'output_norm.weight'", "I32", "float weights are expected")


def test_gguf_missing_field_and_absurd_layer_count_are_named(tmp_path):
    path = write_gguf(tmp_path / "nofield.gguf", skip_field="feed_forward_length")
    _raises(lambda: load_model(path), str(path), "'llama.feed_forward_length' is missing", "an integer")
    path = write_gguf(tmp_path / "layers.gguf", block_count=10**9)
    started = time.perf_counter()
    _raises(lambda: load_model(path), str(path), "num_layers=1000000000", f"tensors are of {L} layers")
    assert time.perf_counter() - started < 1


def test_gguf_missing_tensor_is_named(tmp_path):
    tensors = _gguf_tensors(np.random.default_rng(0))
    del tensors["blk.1.attn_v.weight"]
    path = write_gguf(tmp_path / "missing.gguf", tensors=tensors)
    _raises(lambda: load_model(path), str(path), "missing tensors ['model.layers.1.self_attn.v_proj.weight']")


# ------------------------------------------------------------------------------------ Hugging Face directory


@pytest.fixture
def hf_dir(tmp_path):
    random_hf_checkpoint(tmp_path, HF, seed=0)
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, edit):
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"))


def test_a_valid_hf_dir_loads(hf_dir):
    assert load_model(hf_dir).config.hidden_size == HF["hidden_size"]


def test_hf_config_json_errors_name_the_file_and_field(hf_dir):
    config = str(hf_dir / "config.json")
    (hf_dir / "config.json").write_text('{"hidden_size": 32,\n  "vocab_size": }')
    _raises(lambda: load_model(hf_dir), config, "not valid JSON", "line 2 column 17")
    random_hf_checkpoint(hf_dir, HF, seed=0)
    _edit_config(hf_dir, hidden_size=None)
    _raises(lambda: load_model(hf_dir), config, "'hidden_size' is missing", "an integer")
    _edit_config(hf_dir, hidden_size="32" * 100)
    message = _raises(lambda: load_model(hf_dir), config, "'hidden_size' must be an integer; got '3232")
    assert len(message) < 300  # the value cut short
    _edit_config(hf_dir, hidden_size=32, rope_theta=[1])
    _raises(lambda: load_model(hf_dir), config, "'rope_theta' must be a finite number")


def test_an_absurd_hidden_size_fails_before_allocating(hf_dir):
    _edit_config(hf_dir, hidden_size=10**9, head_dim=8)
    started = time.perf_counter()
    _raises(lambda: load_model(hf_dir), str(hf_dir / "model.safetensors"), "hidden_size=1000000000",
            "model.embed_tokens.weight is [61, 32], the config needs [61, 1000000000] (vocab_size, hidden_size)")
    assert time.perf_counter() - started < 1


def test_hf_tensors_missing_extra_and_misshapen_are_named(hf_dir):
    weights = str(hf_dir / "model.safetensors")
    _edit_weights(hf_dir, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    _raises(lambda: load_model(hf_dir), weights, "missing tensors ['model.layers.1.mlp.down_proj.weight']")
    random_hf_checkpoint(hf_dir, HF, seed=0)
    _edit_weights(hf_dir, lambda w: w.update({"model.extra.weight": np.zeros((2,), np.float32)}))
    _raises(lambda: load_model(hf_dir), weights, "unexpected tensors ['model.extra.weight']")
    random_hf_checkpoint(hf_dir, HF, seed=0)
    _edit_weights(hf_dir, lambda w: w.update({"model.norm.weight": np.ones((31,), np.float32)}))
    _raises(lambda: load_model(hf_dir), weights, "model.norm.weight is [31], the config needs [32] (hidden_size)")


def test_hf_integer_and_nan_weights_are_named(hf_dir):
    weights = str(hf_dir / "model.safetensors")
    _edit_weights(hf_dir, lambda w: w.update({"model.norm.weight": np.ones((32,), np.int32)}))
    _raises(lambda: load_model(hf_dir), weights, "non-float dtypes", "'model.norm.weight': 'I32'")
    random_hf_checkpoint(hf_dir, HF, seed=0)

    def poison(w):
        w["model.layers.0.self_attn.o_proj.weight"][1, 2] = np.inf

    _edit_weights(hf_dir, poison)
    _raises(lambda: load_model(hf_dir), weights, "'model.layers.0.self_attn.o_proj.weight'", "non-finite", "(1, 2)")


def test_hf_truncated_weights_and_missing_shard_are_named(hf_dir, tmp_path_factory):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    _raises(lambda: load_model(hf_dir), str(path), "is truncated: tensor ")
    path.write_bytes(b"\x01")
    _raises(lambda: load_model(hf_dir), str(path), "truncated")
    sharded = tmp_path_factory.mktemp("sharded")
    random_hf_checkpoint(sharded, HF, seed=0, shards=2)
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    _raises(lambda: load_model(sharded), str(shard), "is missing")
    (sharded / "model.safetensors.index.json").write_text("[1, 2")
    _raises(lambda: load_model(sharded), str(sharded / "model.safetensors.index.json"), "not valid JSON")


def test_bfloat16_safetensors_are_read(hf_dir):
    """Hugging Face checkpoints are mostly bfloat16, which numpy cannot name: read as float32."""
    import ml_dtypes

    want = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in want.items()}, str(hf_dir / "model.safetensors"))
    lm = load_model(hf_dir)
    norm = np.asarray(lm.params["norm"]["weight"][...])
    np.testing.assert_array_equal(norm, want["model.norm.weight"].astype(ml_dtypes.bfloat16).astype(np.float32))


# ------------------------------------------------------------------------------------------------ heads


@pytest.fixture
def head_copy(head_files, tmp_path):
    """A copy of a head's two files in tmp_path: (weights path, metadata path) for `kind`."""
    def copy(kind):
        weights = tmp_path / f"{kind}.safetensors"
        shutil.copy(head_files[kind], weights)
        shutil.copy(head_files[kind].with_suffix(".json"), weights.with_suffix(".json"))
        return weights, weights.with_suffix(".json")
    return copy


def _edit_meta(meta_path, **changes):
    meta = json.loads(meta_path.read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    meta_path.write_text(json.dumps(meta))


def test_head_sidecar_errors_name_the_file_and_field(head_copy, tiny_lm):
    cfg = tiny_lm.config
    weights, meta = head_copy("medusa")
    load_head(weights, cfg)  # the copy loads
    text = meta.read_text()
    meta.write_text(text[:40])
    _raises(lambda: load_head(weights, cfg), str(meta), "not valid JSON", "line")
    meta.write_text(text)
    _edit_meta(meta, kind=None)
    _raises(lambda: load_head(weights, cfg), str(meta), "field 'kind' is missing", "a string")
    _edit_meta(meta, kind=5)
    _raises(lambda: load_head(weights, cfg), str(meta), "field 'kind' must be a string; got 5")
    _edit_meta(meta, kind="hydra")
    _raises(lambda: load_head(weights, cfg), str(meta), "field 'kind'='hydra'")
    _edit_meta(meta, kind="medusa", num_heads="3")
    _raises(lambda: load_head(weights, cfg), str(meta), "field 'num_heads' must be an integer; got '3'")
    meta.unlink()
    _raises(lambda: load_head(weights, cfg), str(meta), "does not exist")
    weights.unlink()
    _raises(lambda: load_head(weights, cfg), str(weights), "does not exist")


def test_an_absurd_head_count_fails_before_allocating(head_copy, tiny_lm):
    weights, meta = head_copy("medusa")
    _edit_meta(meta, num_heads=10**9)
    started = time.perf_counter()
    _raises(lambda: load_head(weights, tiny_lm.config), str(weights), "num_heads=1000000000",
            "'w': ((3, 48, 48), (1000000000, 48, 48))")
    assert time.perf_counter() - started < 1


def test_eagle3_feature_layers_are_checked(head_copy, tiny_lm):
    weights, meta = head_copy("eagle3")
    _edit_meta(meta, feature_layers=[0, 7])
    _raises(lambda: load_head(weights, tiny_lm.config), str(meta), "'feature_layers'", "2-layer model", "[0, 7]")
    _edit_meta(meta, feature_layers=[0] * 10**5)
    _raises(lambda: load_head(weights, tiny_lm.config), str(meta), "'feature_layers'", "distinct")


def test_head_weights_missing_extra_integer_nan_and_truncated(head_copy, tiny_lm):
    cfg = tiny_lm.config
    weights, _ = head_copy("eagle")
    good = load_file(str(weights))

    def save(**changes):
        values = dict(good)
        for key, value in changes.items():
            if value is None:
                values.pop(key)
            else:
                values[key] = value
        save_file(values, str(weights))

    save(fc_bias=None)
    _raises(lambda: load_head(weights, cfg), str(weights), "missing ['fc_bias']")
    save(extra=np.zeros((2,), np.float16))
    _raises(lambda: load_head(weights, cfg), str(weights), "unexpected ['extra']")
    save(fc_bias=np.zeros((47,), np.float16))
    _raises(lambda: load_head(weights, cfg), str(weights), "'fc_bias': ((47,), (48,))")
    save(fc_bias=np.zeros((48,), np.int16))
    _raises(lambda: load_head(weights, cfg), str(weights), "'fc_bias': 'I16'")
    nan = good["fc"].copy()
    nan[4, 1] = np.nan
    save(fc=nan)
    _raises(lambda: load_head(weights, cfg), str(weights), "tensor 'fc'", "non-finite", "(4, 1)")
    save()
    weights.write_bytes(weights.read_bytes()[:-10])
    _raises(lambda: load_head(weights, cfg), str(weights), "truncated")


def test_init_from_a_corrupt_head_names_the_file(head_copy, tiny_lm, capsys):
    from jaxspec.train import eagle3
    from jaxspec.train.cli import _initial_head, build_parser
    from jaxspec.train.eagle3 import Eagle3Task

    parser = build_parser("eagle3", defaults=eagle3.DEFAULTS, add_options=eagle3.add_options, description="")
    weights, meta = head_copy("eagle3")
    meta.write_text("{")
    with pytest.raises(SystemExit):
        _initial_head(str(weights), Eagle3Task(context=4, unroll=2), tiny_lm, parser)
    assert str(meta) in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- memory checks


def test_a_huge_rollout_is_refused_before_anything_is_built(tiny_lm, monkeypatch):
    from jaxspec.rollouts import inputs

    def built(*args, **kwargs):
        raise AssertionError("per-sample arrays were built before the memory check")

    monkeypatch.setattr(inputs, "sample_seeds", built)
    started = time.perf_counter()
    _raises(lambda: jaxspec.rollout(tiny_lm, [[1, 2, 3]], num_samples=10**9, max_new_tokens=8,
                                    sampling=jaxspec.SamplingParams()),
            "num_samples=1000000000", "max_new_tokens=8", "needs about ", " bytes (", "are available")
    assert time.perf_counter() - started < 0.5
    _raises(lambda: jaxspec.rollout(tiny_lm, [[1, 2, 3]] * 4, num_samples=2**30, max_new_tokens=8,
                                    sampling=jaxspec.SamplingParams()), "num_samples=1073741824", "int32")


def test_generate_refuses_a_batch_beyond_memory(tiny_lm, monkeypatch):
    from jaxspec import generation

    monkeypatch.setattr(generation, "available_memory", lambda: 1 << 12)
    _raises(lambda: jaxspec.generate(tiny_lm, [[1, 2, 3]] * 8, max_new_tokens=16), "8 prompts",
            "max_new_tokens=16", "need about ", "but 4096 bytes")


# ----------------------------------------------------------------------------------- draft corpora, rankings


def test_a_corrupt_corpus_names_the_file_and_the_json_error(tmp_path):
    from jaxspec.models.corpus import load_corpus, save_corpus

    path = save_corpus(tmp_path / "c.sam_corpus.json", [[1, 2, 3]], separator=0, vocab_size=10)
    load_corpus(path, 10)
    path.write_text(path.read_text()[:-10])
    _raises(lambda: load_corpus(path, 10), str(path), "cannot be read", "line")
    _raises(lambda: load_corpus(tmp_path / "absent.json", 10), str(tmp_path / "absent.json"), "cannot be read")
