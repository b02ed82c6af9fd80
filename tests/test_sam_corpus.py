"""Draft corpora for sam's static source: the file format, the corpus shipped for the default model, and
`SpecConfig(sam_source="static" | "both")` drafting from it losslessly when `static_sam` is unset, the default
source ("auto") taking a corpus only where one is given, and `jaxspec corpus` building one from a user's files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import pytest

import jaxspec
from jaxspec import SpecConfig, StaticSuffixAutomaton
from jaxspec.builders import build_proposer, sam_source_for, shipped_static_sam
from jaxspec.models.corpus import CORPUS_SUFFIX, load_corpus, save_corpus, shipped_corpus_path
from jaxspec.models.heads import WEIGHTS_DIR
from jaxspec.train import sam_corpus
from jaxspec.train.prompts import humaneval_split

VOCAB = 97  # the tiny model's


def test_a_corpus_file_round_trips(tmp_path):
    path = save_corpus(tmp_path / "c.json", [[1, 2, 3], [4, 5]], separator=0, vocab_size=VOCAB,
                       metadata={"model": "tiny"})
    assert load_corpus(path, VOCAB) == ([[1, 2, 3], [4, 5]], 0)
    data = json.loads(path.read_text())
    assert (data["kind"], data["num_sequences"], data["num_tokens"], data["model"]) == ("sam_corpus", 2, 5, "tiny")


@pytest.mark.parametrize("sequences, separator, message", [
    ([], 0, "at least one sequence"),
    ([[1], []], 0, "none of them empty"),
    ([[1, VOCAB]], 0, f"token id {VOCAB} outside"),
    ([[1, 2]], -1, "token id -1 outside"),
    ([[1, 2.5]], 0, "must be integers"),
])
def test_bad_corpora_are_refused_naming_the_value(tmp_path, sequences, separator, message):
    with pytest.raises(ValueError, match=message):
        save_corpus(tmp_path / "c.json", sequences, separator=separator, vocab_size=VOCAB)
    path = tmp_path / "raw.json"
    path.write_text(json.dumps({"kind": "sam_corpus", "vocab_size": VOCAB, "separator": separator,
                                "sequences": sequences}))
    with pytest.raises(ValueError, match=message):
        load_corpus(path, VOCAB)


def test_a_file_of_another_kind_or_vocabulary_is_refused(tmp_path):
    path = save_corpus(tmp_path / "c.json", [[1, 2]], separator=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="made for vocab_size=97; this model has 98"):
        load_corpus(path, VOCAB + 1)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "draft_vocab", "ids": [1]}))
    with pytest.raises(ValueError, match="is not a draft corpus"):
        load_corpus(other, VOCAB)
    with pytest.raises(ValueError, match="cannot be read"):
        load_corpus(tmp_path / "missing.json", VOCAB)


def test_a_model_without_a_shipped_corpus_names_what_to_pass(tiny_lm):
    with pytest.raises(ValueError, match="no draft corpus is shipped for model 'tiny'.*static_sam="):
        shipped_corpus_path("tiny")
    for source in ("static", "both"):
        with pytest.raises(ValueError, match="no draft corpus is shipped for model 'tiny'"):
            jaxspec.generate(tiny_lm, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="sam", sam_source=source))


def test_sam_drafts_from_the_rows_own_text_by_default_and_from_a_corpus_given_or_named(tiny_lm, monkeypatch):
    """sam_source "auto": both sources where static_sam is given, the row's own text elsewhere, on every platform,
    even for a model with a shipped corpus (an opt-in: "static" or "both"); a source named explicitly is kept."""
    corpus = StaticSuffixAutomaton.build([[5, 6, 7, 8]], separator=1)
    assert SpecConfig(method="sam").sam_source == "auto"
    assert sam_source_for(tiny_lm, SpecConfig(method="sam")) == "dynamic"
    assert sam_source_for(tiny_lm, SpecConfig(method="sam", static_sam=corpus)) == "both"
    assert sam_source_for(tiny_lm, SpecConfig(method="sam", sam_source="static", static_sam=corpus)) == "static"
    proposer, params = build_proposer(tiny_lm, SpecConfig(method="sam"), prompt_width=8, buffer_len=8, cache_len=16)
    assert proposer.source == "dynamic" and params is None and not proposer.uses_corpus
    proposer, params = build_proposer(tiny_lm, SpecConfig(method="sam", static_sam=corpus), prompt_width=8,
                                      buffer_len=8, cache_len=16)
    assert proposer.source == "both" and params is corpus and proposer.uses_corpus
    named = SimpleNamespace(name="smollm2-135m")  # a model with a shipped corpus
    for backend in ("cpu", "gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert sam_source_for(named, SpecConfig(method="sam")) == "dynamic", backend
        assert sam_source_for(named, SpecConfig(method="sam", sam_source="both")) == "both", backend


@pytest.mark.usefixtures("default_model_installed")
def test_the_default_models_corpus_holds_its_completions_of_training_prompts_only(smollm2):
    path = shipped_corpus_path(smollm2.name)
    assert path == WEIGHTS_DIR / f"smollm2-135m{CORPUS_SUFFIX}"
    sequences, separator = load_corpus(path, smollm2.config.vocab_size)
    assert separator in smollm2.tokenizer.eos_token_ids
    train, held_out = humaneval_split()
    text = "".join(smollm2.tokenizer.decode(s) for s in sequences)
    assert all(p in text for p in train[:5])
    assert not any(p in text for p in held_out)  # the benchmarks' prompts are never in it
    assert shipped_static_sam(smollm2) is shipped_static_sam(smollm2)  # built once


@pytest.mark.usefixtures("default_model_installed")
def test_sam_drafts_from_the_shipped_corpus_losslessly(smollm2):
    """Greedy: held-out prompts with the static source alone and with both equal plain decoding, and the corpus
    drafted tokens the target accepted."""
    _, held_out = humaneval_split()
    prompts = held_out[1:3]
    plain = jaxspec.generate(smollm2, prompts, max_new_tokens=40)
    for source in ("static", "both"):
        out = jaxspec.generate(smollm2, prompts, max_new_tokens=40, spec=SpecConfig(method="sam", sam_source=source))
        assert out.token_ids == plain.token_ids, source
        assert out.stats.drafted > 0 and out.stats.accepted > 0, (source, out.stats)


@pytest.mark.usefixtures("default_model_installed")
def test_the_corpus_command_writes_greedy_completions(tmp_path, smollm2):
    out = tmp_path / "c.json"
    assert sam_corpus.main(["--out", str(out), "--limit", "2", "--max-new-tokens", "6", "--batch-size", "4"]) == 0
    sequences, separator = load_corpus(out, smollm2.config.vocab_size)
    prompts = sam_corpus.corpus_prompts(smollm2, limit=2)
    assert len(prompts) == len(sequences) == 4  # two of each source, code then chat
    plain = jaxspec.generate(smollm2, prompts, max_new_tokens=6)
    assert sequences == [smollm2.tokenizer.encode(p) + t for p, t in zip(prompts, plain.token_ids)]
    recorded = json.loads(out.read_text())["sources"]
    assert [(s["name"], s["texts"]) for s in recorded] == [("humaneval-train", 2), ("humaneval-train-chat", 2)]
    assert all(s["humaneval_task_ids"] == ["HumanEval/1", "HumanEval/2"] for s in recorded)
    with pytest.raises(SystemExit):
        sam_corpus.main(["--out", str(out), "--max-new-tokens", "0"])


@pytest.mark.usefixtures("default_model_installed")
def test_jaxspec_corpus_builds_a_corpus_from_a_users_prompts_and_documents(tmp_path, smollm2):
    """`jaxspec corpus`: prompts (one a line, or .jsonl) completed greedily, documents as they are; the file says
    what it was built from, and sam drafts from it losslessly."""
    (tmp_path / "prompts.txt").write_text("def add_one(x):\n\ndef shout(text):\n")
    (tmp_path / "doc.md").write_text("Call add_one(x) to add one.\nCall shout(text) to upper-case.\n")
    out = tmp_path / "mine.sam_corpus.json"
    assert sam_corpus.user_main(["--prompts", str(tmp_path / "prompts.txt"), "--texts", str(tmp_path / "doc.md"),
                                 "--out", str(out), "--max-new-tokens", "6", "--batch-size", "4"]) == 0
    sequences, separator = load_corpus(out, smollm2.config.vocab_size)
    prompts = ["def add_one(x):", "def shout(text):"]
    plain = jaxspec.generate(smollm2, prompts, max_new_tokens=6)
    assert sequences[:2] == [smollm2.tokenizer.encode(p) + t for p, t in zip(prompts, plain.token_ids)]
    assert sequences[2] == smollm2.tokenizer.encode((tmp_path / "doc.md").read_text())
    meta = json.loads(out.read_text())
    assert [(s["name"], s["texts"], s["completed"]) for s in meta["sources"]] == [("prompts", 2, True),
                                                                                  ("texts", 1, False)]
    assert meta["command"].startswith("jaxspec corpus --prompts")
    spec = SpecConfig(method="sam", static_sam=StaticSuffixAutomaton.build(sequences, separator))
    again = jaxspec.generate(smollm2, prompts, max_new_tokens=6, spec=spec)
    assert again.token_ids == plain.token_ids and again.stats.accepted > 0
    with pytest.raises(SystemExit):  # nothing to build from
        sam_corpus.user_main(["--out", str(out)])
