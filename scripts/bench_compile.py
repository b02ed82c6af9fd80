"""Compile time: what a user waits for before the first token, per method and batch size, and for the server.

Each measurement runs in a fresh process. "cold" starts with an empty persistent compilation cache and verify-cost
table (a new machine, a new version); "warm" is the next process with the cache the cold one wrote (a second
`jaxspec generate`, a server restart). For each method and row count the report gives the first call's wall time
(prefill and decode programs compiled, verify-cost prior or table read) and its ratio to plain decoding's first
call in the same state, the second call's (compiled: what a step costs), how many programs compiled, the seconds
JAX spent tracing, lowering and compiling them, and the size of the largest (instructions of its HLO before
optimisation; "-" where every program came from the cache). `--server` adds `python scripts/serve.py`'s start:
seconds until /health answers, and until a first completion returns.

    python scripts/bench_compile.py                                   # none,ngram,sam,eagle3 at 1 and 8 rows
    python scripts/bench_compile.py --methods none,sam --rows 1 --server
    python scripts/bench_compile.py --methods group_sam --rows 8      # a rollout: 8 rows = 2 prompts x 4 samples
    python scripts/bench_compile.py --methods none,sam --layer-loops unroll,scan   # both layer loops side by side

`--layer-loops` runs each measurement with the decoder layers unrolled and/or as a `lax.scan`
(`jaxspec.models.llama.set_layer_loop`); by default the platform's own choice. "vs plain" compares within a loop.

Prompts: the held-out HumanEval prompts (benchkit.workloads), greedy, `--new-tokens` each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchkit import cli, machine, page, tables
from benchkit.serve.servers import free_port
from jaxspec.models.llama import LAYER_LOOP_ENV

SCRIPTS = Path(__file__).resolve().parent
_RESULT = "bench_compile result: "
# JAX's compile log (jax_log_compiles): one line per program and stage.
_STAGES = {"trace": re.compile(r"Finished tracing \+? ?\S*? ?(\S+) for jit in ([\d.e-]+) sec"),
           "lower": re.compile(r"Finished jaxpr to MLIR module conversion jit\((.+?)\) in ([\d.e-]+) sec"),
           "compile": re.compile(r"Finished XLA compilation of jit\((.+?)\) in ([\d.e-]+) sec")}
_SMALL_PROGRAM_S = 0.2  # programs compiled faster than this (array setup, small helpers) are not counted


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", type=cli.names, default="none,ngram,sam,eagle3",
                   help="methods, comma-separated; group_sam runs a rollout (default: %(default)s)")
    p.add_argument("--rows", type=cli.ints, default="1,8", help="batch sizes (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row (default: %(default)s)")
    p.add_argument("--caches", type=cli.names, default="cold,warm", help="cold, warm or both (default: %(default)s)")
    p.add_argument("--layer-loops", type=cli.names, default="",
                   help="unroll, scan or both, one measurement each (default: the platform's layer loop)")
    p.add_argument("--server", action="store_true", help="also time `python scripts/serve.py` to /health")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--child", nargs=2, metavar=("METHOD", "ROWS"), help=argparse.SUPPRESS)
    page.add_option(p, "compile")
    args = p.parse_args(argv)
    if args.new_tokens < 1 or any(r < 1 for r in args.rows):
        p.error("--new-tokens and --rows must be >= 1")
    if not set(args.caches) <= {"cold", "warm"} or not args.caches:
        p.error(f"--caches={','.join(args.caches)} must name cold, warm or both")
    if set(args.layer_loops) - {"unroll", "scan"}:
        p.error(f"--layer-loops={','.join(args.layer_loops)} must name unroll, scan or both")
    return args


# ------------------------------------------------------------------------------------------------ one process

def child(method: str, rows: int, new_tokens: int) -> dict:
    """In this process: load the model, call generate (or rollout) twice; what compiled, from JAX's log."""
    import logging

    import jax

    records: list[tuple[str, str, float]] = []  # (stage, program, seconds)

    class Collect(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            for stage, pattern in _STAGES.items():
                m = pattern.search(text)
                if m:
                    records.append((stage, m.group(1), float(m.group(2))))

    logging.getLogger("jax").addHandler(Collect())
    logging.getLogger("jax").setLevel(logging.WARNING)
    jax.config.update("jax_log_compiles", True)
    import jaxspec
    from benchkit import workloads

    jaxspec.cost.BACKGROUND = True  # the library's default (benchkit turns it off for timed benchmarks)

    t0 = time.perf_counter()
    lm = jaxspec.load_model()
    load_s = time.perf_counter() - t0
    layer_loop = lm.module.layer_loop
    greedy = jaxspec.SamplingParams(temperature=0.0)
    if method == "group_sam":
        prompts = workloads.held_out_prompts(lm.tokenizer, max(1, rows // 4))
        samples = rows // len(prompts)

        def call():
            jaxspec.rollout(lm, prompts, num_samples=samples, max_new_tokens=new_tokens,
                            spec=jaxspec.SpecConfig(method="group_sam"), sampling=greedy, logprobs=False)
    else:
        prompts = workloads.held_out_prompts(lm.tokenizer, rows)
        spec = None if method == "none" else jaxspec.SpecConfig(method=method)

        def call():
            jaxspec.generate(lm, prompts, max_new_tokens=new_tokens, spec=spec, sampling=greedy)

    t0 = time.perf_counter()
    call()
    first_s = time.perf_counter() - t0
    first = list(records)
    t0 = time.perf_counter()
    call()
    second_s = time.perf_counter() - t0
    compiled = [(p, s) for stage, p, s in first if stage == "compile" and s >= _SMALL_PROGRAM_S]
    return {"method": method, "rows": rows, "layer_loop": layer_loop, "load_s": load_s, "first_s": first_s,
            "second_s": second_s,
            "programs": sorted({p for p, _ in compiled}), "num_programs": len(compiled),
            **{f"{stage}_s": sum(s for st, _, s in first if st == stage) for stage in _STAGES},
            "recompiled_on_second_call": len([r for r in records[len(first):] if r[0] == "compile"])}


def _hlo_sizes(dump: Path) -> dict[str, int]:
    """Instructions of each program's HLO before optimisation, from an XLA dump folder (the largest per name)."""
    sizes: dict[str, int] = {}
    for f in dump.glob("*.before_optimizations.txt"):
        name = f.name.split(".")[1] if f.name.count(".") >= 2 else f.name
        count = sum(1 for line in f.read_text(errors="replace").splitlines() if " = " in line)
        sizes[name] = max(sizes.get(name, 0), count)
    return sizes


def run_child(method: str, rows: int, new_tokens: int, cache_dir: Path, cost_dir: Path,
              layer_loop: str | None = None) -> dict:
    """`child` in a fresh process over the compilation cache in `cache_dir` and the cost table in `cost_dir`, its
    layers run as `layer_loop` (None: the platform's default)."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, JAXSPEC_COMPILATION_CACHE=str(cache_dir), JAXSPEC_VERIFY_COST=str(cost_dir),
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip())
        if layer_loop:
            env[LAYER_LOOP_ENV] = layer_loop
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", method, str(rows),
                               "--new-tokens", str(new_tokens)], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
        if proc.returncode or not lines:
            raise RuntimeError(f"{method} at {rows} rows failed:\n{proc.stderr[-3000:]}")
        result = json.loads(lines[-1][len(_RESULT):])
        sizes = _hlo_sizes(Path(dump))
    result["largest_hlo"] = max((n for name, n in sizes.items() if name.removeprefix("jit_") in
                                 {p.removeprefix("jit_") for p in result["programs"]}), default=0)
    return result


# ------------------------------------------------------------------------------------------------ the server

def _get(url: str, body: dict | None = None, timeout: float = 5.0) -> int:
    """The HTTP status of a GET (or, with `body`, a JSON POST) to `url`; 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def server_start(home: Path, port: int, timeout: float) -> dict:
    """Start `python scripts/serve.py` with `home` as HOME (its compilation cache under it): seconds until
    /health answers 200, and until a first completion (16 tokens) returns."""
    env = dict(os.environ, HOME=str(home))
    env.pop("JAXSPEC_COMPILATION_CACHE", None)
    env.pop("JAXSPEC_VERIFY_COST", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "serve.py"), "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while _get(f"http://127.0.0.1:{port}/health") != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"serve.py did not answer /health within {timeout:.0f} s")
            time.sleep(0.5)
        health_s = time.perf_counter() - t0
        status = _get(f"http://127.0.0.1:{port}/v1/completions", {"model": "smollm2-135m", "prompt": "def add(a, b):",
                                                                  "max_tokens": 16, "temperature": 0}, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"the first completion failed with HTTP status {status or 'none'}")
        return {"health_s": health_s, "first_completion_s": time.perf_counter() - t0}
    finally:
        proc.terminate()
        proc.wait(60)


# ------------------------------------------------------------------------------------------------ the report

def report(results: list[dict], servers: list[dict]) -> str:
    plain = {(r["cache"], r["rows"], r["layer_loop"]): r["first_s"] for r in results if r["method"] == "none"}
    rows = []
    for r in results:
        base = plain.get((r["cache"], r["rows"], r["layer_loop"]))
        rows.append((r["method"], r["rows"], r["layer_loop"], r["cache"], f"{r['first_s']:.1f}",
                     f"{r['first_s'] / base:.2f}x" if base else "-", f"{r['second_s']:.2f}", r["num_programs"],
                     f"{r['trace_s']:.1f} / {r['lower_s']:.1f} / {r['compile_s']:.1f}", r["largest_hlo"] or "-",
                     f"{r['load_s']:.1f}"))
    text = [tables.markdown(("method", "rows", "layers", "caches", "first call s", "vs plain", "second call s",
                             "programs", "trace / lower / compile s", "largest HLO (instructions)", "load s"), rows)]
    if servers:
        text.append("\n`python scripts/serve.py` (default settings):\n")
        text.append(tables.markdown(("caches", "/health s", "first completion s"),
                                    [(s["cache"], f"{s['health_s']:.1f}", f"{s['first_completion_s']:.1f}")
                                     for s in servers]))
    return "\n".join(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        import jaxspec

        jaxspec.enable_compilation_cache(os.environ["JAXSPEC_COMPILATION_CACHE"])
        print(_RESULT + json.dumps(child(args.child[0], int(args.child[1]), args.new_tokens)), flush=True)
        return 0
    info = machine.info()
    results, servers = [], []
    with tempfile.TemporaryDirectory() as work:
        for method in args.methods:
            for rows in args.rows:
                if method == "group_sam" and rows < 2:
                    continue  # a rollout drafts from a group of samples
                for loop in args.layer_loops or [None]:
                    name = f"{method}-{rows}-{loop}"
                    cache_dir, cost_dir = Path(work) / f"xla-{name}", Path(work) / f"cost-{name}"
                    for state in ("cold", "warm"):  # warm reads what cold wrote
                        r = run_child(method, rows, args.new_tokens, cache_dir, cost_dir, loop)
                        if state in args.caches:
                            results.append(dict(r, cache=state))
                            print(json.dumps(results[-1]), flush=True)
                        if "warm" not in args.caches:
                            break
        if args.server:
            home = Path(work) / "server-home"
            for state in ("cold", "warm"):
                s = server_start(home, free_port("127.0.0.1"), args.server_timeout)
                if state in args.caches:
                    servers.append(dict(s, cache=state))
                    print(json.dumps(servers[-1]), flush=True)
    text = f"{machine.line(info)}\n\n" + report(results, servers)
    print(text)
    if args.write_page:
        page.write(args.write_page, text, info, {"generate": results, "server": servers})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
