#!/usr/bin/env python
"""Benchmark the OpenAI-compatible server (scripts/serve.py) under load, with speculation off, fixed and adaptive.

An async load generator (httpx) keeps c requests in flight (c = 1, 4, 16, 64 by default): c client tasks
each send a streaming /v1/completions request (a HumanEval prompt, `max_tokens` 128, greedy), read its
server-sent events to the end, and send the next, until the level's requests are done (max(2 c, 8) of them
by default). For every (mode, concurrency) it reports:

* throughput: completion tokens of all successful requests / wall time of the level, and requests/s;
* time to first token (TTFT): from sending the request to the first event that carries text, p50 and p99;
* per-token latency (TPOT): per request (t_last_text - t_first_text) / (completion_tokens - 1), p50 and p99
  over requests. The server streams a chunk per `--chunk-steps` decode steps, so a chunk can carry several
  tokens; the gaps between chunks are recorded too (raw, in the JSON);
* mean acceptance length: tokens committed per active row-step over the level, from the server's Prometheus
  counters scraped before and after it: `jaxspec.state.mean_acceptance_length(d committed, d row_steps)`
  (1.0 without speculation).

Modes are server policies: `off` (never speculate), `fixed` (always speculate, SAM drafts) and `adaptive`
(speculate while the load is light and where it was measured faster). One server process is started per
mode (`--policy MODE --method sam`) on a free port; the script waits for GET /health (startup compiles for
minutes on a small CPU), warms it up with a few untimed requests (so prefill compiles for the prompt lengths
happen outside the measurement), runs the sweep and stops it (SIGINT, then SIGKILL after a timeout).

Why side by side in one run: the machines this runs on are shared and noisy, and absolute tokens/s move by
tens of percent between runs. The question the benchmark answers is relative (is adaptive ever slower than
off under load? does it keep fixed's gain at concurrency 1?), so all modes run in the same invocation, on
the same prompts in the same order, with the same server settings, and the report gives the ratios
adaptive/off and fixed/off per concurrency. With --interleave all servers are started first and the modes
take turns at each concurrency level, so slow drift of the machine hits every mode alike. At temperature 0
the outputs are identical in every mode (speculative decoding is lossless), so every mode does the same work.

    python scripts/bench_serve.py                                  # off, fixed, adaptive at c = 1, 4, 16, 64
    python scripts/bench_serve.py --concurrency 1,4 --max-tokens 32 --modes off,adaptive     # quicker
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --label mine                   # a running server
    python scripts/bench_serve.py --engine [ARGS]    # the engine alone, in process (benchkit/serve/engine.py)
    python scripts/bench_serve.py --vllm none,ngram --prompts held-out --concurrency 1,8,32   # beside vLLM

With --vllm, vLLM's own OpenAI server (its CPU build, in the venv `make peer-venv` makes; benchkit/peer.py) is
started first on the same weights, converted once to a Hugging Face directory, with as many rows at once as
--max-slots; the report then gives every server's throughput as a multiple of the first vLLM server's at each
concurrency, how many completions are its text, and the targets: throughput at least vLLM's and p99 time to
first token at most vLLM's. Servers run one at a time, so each has the machine to itself.

Outputs in --out-dir (default bench_out/): bench_serve.json (settings and every raw number), bench_serve.md
(the tables, also printed), bench_serve.png (throughput, per-token latency and TTFT against concurrency;
needs matplotlib) and serve_MODE.log (each started server's output). The pieces (results, client, servers,
sweep, report) are in scripts/benchkit/serve/.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
from pathlib import Path

from benchkit import machine, page, peer, workloads
from benchkit.serve.report import markdown_report, peer_checks, ratio_rows, target_checks, write_outputs
from benchkit.serve.servers import free_port, launch, start_server
from benchkit.serve.sweep import benchmark, requests_for_level, warmup_prompt_indices
from jaxspec.methods import names
from jaxspec.models.loading import named_model_path
from jaxspec.models.tokenizer import Tokenizer

MODES = ("off", "fixed", "adaptive")
VLLM_KINDS = ("none", "ngram")


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers")
    return values


def _vllm_list(text: str) -> list[str]:
    kinds = [m.strip() for m in text.split(",") if m.strip()]
    if any(k not in VLLM_KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"vLLM servers are {', '.join(VLLM_KINDS)}; got {text!r}")
    return kinds


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="store_true",
                   help="benchmark the engine alone, in process, instead: the other arguments go to it "
                        "(bench_serve.py --engine --help)")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64],
                   help="comma-separated concurrency levels: requests kept in flight (default: 1,4,16,64)")
    g.add_argument("--requests-per-client", type=int, default=2,
                   help="requests per level = max(this x concurrency, --min-requests) (default: %(default)s)")
    g.add_argument("--min-requests", type=int, default=8,
                   help="the fewest requests in a level (default: %(default)s)")
    g.add_argument("--num-requests", type=int, default=None,
                   help="a fixed number of requests in every level, instead of the two options above")
    g.add_argument("--warmup-requests", type=int, default=8,
                   help="untimed requests before the sweep, prompts spread over the length range the sweep "
                        "uses (so prefill compiles happen outside the measurement); 0 skips (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy, the same output in every mode (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None,
                   help="with --temperature > 0: request i sends seed SEED + i (default: no seed)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: every request generates exactly --max-tokens tokens")
    g.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds to wait for the next bytes of a response (default: %(default)s)")

    g = p.add_argument_group("servers started here (one per mode)")
    g.add_argument("--modes", type=_mode_list, default=list(MODES),
                   help="comma-separated speculation policies to compare, each its own server "
                        "(--policy MODE) (default: off,fixed,adaptive)")
    g.add_argument("--interleave", action="store_true",
                   help="start every mode's server first and let the modes take turns at each concurrency "
                        "level (drift of a noisy machine then hits all modes alike; needs the memory of all "
                        "servers at once, and servers that use no CPU while idle)")
    g.add_argument("--model", default="smollm2-135m", help="--model of the server (default: %(default)s)")
    g.add_argument("--method", default="sam", choices=names(served=True),
                   help="--method of the server: the draft method of fixed and adaptive (default: %(default)s)")
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="--num-speculative-tokens of the server (default: the server's)")
    g.add_argument("--max-slots", type=int, default=8, help="--max-slots of the server (default: %(default)s)")
    g.add_argument("--cache-len", type=int, default=1024,
                   help="--cache-len of the server; must hold the longest prompt + --max-tokens + K + 1 "
                        "(default: %(default)s)")
    g.add_argument("--chunk-steps", type=int, default=None, help="--chunk-steps of the server (default: the server's)")
    g.add_argument("--spec-max-active", type=int, default=None,
                   help="--spec-max-active of the server (adaptive policy) (default: the server's)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="--max-waiting of the server; must exceed the top concurrency - --max-slots or "
                        "requests get HTTP 429 (default: the server's)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help="more arguments for every server, split on spaces; repeatable (e.g. --server-arg "
                        "'--slot-buckets 1,8')")
    g.add_argument("--serve-script", type=Path, default=Path(__file__).resolve().parent / "serve.py",
                   help="the server script (default: scripts/serve.py)")
    g.add_argument("--host", default="127.0.0.1", help="address the servers listen on (default: %(default)s)")
    g.add_argument("--startup-timeout", type=float, default=3600.0,
                   help="seconds to wait for GET /health to answer 200; startup compiles for minutes "
                        "(default: %(default)s)")
    g.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds between SIGINT and SIGKILL when stopping a server (default: %(default)s)")

    g = p.add_argument_group("vLLM beside it (its venv: `make peer-venv`)")
    g.add_argument("--vllm", type=_vllm_list, default=[],
                   help="comma-separated vLLM servers to start too, on the same weights (converted once) and "
                        "prompts: none (plain), ngram (its n-gram speculation); the report compares every server "
                        "with the first (default: none started)")
    g.add_argument("--vllm-ngram", type=int, default=5, help="draft tokens of vLLM's ngram (default: %(default)s)")
    g.add_argument("--vllm-python", default=str(peer.PYTHON),
                   help="the Python of vLLM's venv (default: %(default)s)")
    g.add_argument("--hf-dir", default=str(peer.HF_DIR),
                   help="the default model as a Hugging Face directory, converted there once (default: %(default)s)")
    g.add_argument("--prompts", choices=("humaneval", "held-out"), default="humaneval",
                   help="humaneval: the HumanEval prompts as code; held-out: the prompts of scripts/bench_peer.py, "
                        "held out of everything jaxspec ships (default: %(default)s)")

    g = p.add_argument_group("a server already running")
    g.add_argument("--url", default=None,
                   help="benchmark the server at this base URL (e.g. http://127.0.0.1:8000) instead of starting "
                        "servers: one mode, named by --label")
    g.add_argument("--label", default="server",
                   help="the mode name of --url in the report; off, fixed or adaptive make it count in the "
                        "ratios (default: %(default)s)")
    g.add_argument("--model-name", default=None,
                   help="the `model` field of requests (default: the first id of GET /v1/models)")

    g = p.add_argument_group("report")
    g.add_argument("--out-dir", default="bench_out",
                   help="where bench_serve.json, .md, .png and server logs go (default: %(default)s)")
    g.add_argument("--no-plot", dest="plot", action="store_false", help="do not write bench_serve.png")
    page.add_option(g, "serve")
    g.add_argument("--high-concurrency", type=int, default=16,
                   help="levels at or above this count as high load for the adaptive >= off check "
                        "(default: %(default)s)")
    g.add_argument("--tolerance", type=float, default=0.03,
                   help="how far adaptive may fall below off (high load) or fixed (concurrency 1) "
                        "(default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("requests_per_client", "min_requests", "max_tokens", "max_slots", "cache_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be at least 1")
    return args


def vllm_label(kind: str, args: argparse.Namespace) -> str:
    return "vLLM" if kind == "none" else f"vLLM ngram k={args.vllm_ngram}"


def vllm_starter(kind: str, model_dir: Path, args: argparse.Namespace):
    """Starts vLLM's OpenAI server of the converted weights, as many rows at once as jaxspec's --max-slots."""

    def start():
        port = free_port(args.host)
        cmd = peer.serve_command(args.vllm_python, model_dir, args.host, port, args.vllm_ngram if kind == "ngram"
                                 else 0, args.max_slots)
        return launch(vllm_label(kind, args), cmd, f"http://{args.host}:{port}",
                      Path(args.out_dir) / f"serve_vllm-{kind}.log", env=peer.serve_environment(args.vllm_python))

    return start


def starters(args: argparse.Namespace) -> list | None:
    """vLLM's servers first (the report's reference), then jaxspec's modes; None without vLLM (the modes alone)."""
    if not args.vllm:
        return None
    model_dir = peer.hf_directory(args.vllm_python, Path(args.hf_dir), named_model_path(args.model))
    return ([vllm_starter(kind, model_dir, args) for kind in args.vllm]
            + [functools.partial(start_server, mode, args) for mode in args.modes])


def prompt_texts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The requests' prompts and what they are, in words."""
    if args.prompts == "held-out":
        tokenizer = Tokenizer.from_gguf(named_model_path(args.model))
        return workloads.held_out_mix_texts(tokenizer, 5, 4), "9 held-out prompts (5 code, 4 chat)"
    prompts = workloads.free_form_texts()
    return prompts, f"{len(prompts)} HumanEval prompts"


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--engine" in argv:  # before parsing: the engine benchmark has options of its own
        from benchkit.serve import engine

        return engine.main([a for a in argv if a != "--engine"])
    args = parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    machine_info = machine.info(device=False)  # the servers started here own the accelerator
    if args.vllm and not Path(args.vllm_python).exists():
        print(f"no vLLM venv at {args.vllm_python}: run `make peer-venv` (or pass --vllm-python)", file=sys.stderr)
        return 2
    prompts, described = prompt_texts(args)
    most = max(requests_for_level(c, args) for c in args.concurrency)
    warmup = warmup_prompt_indices(min(most, len(prompts)), prompts, args.warmup_requests)
    levels_desc = ", ".join(f"c={c}: {requests_for_level(c, args)}" for c in args.concurrency)
    print(f"{described}; requests per level {levels_desc}; max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, ignore_eos {args.ignore_eos}; {len(warmup)} warm-up requests",
          flush=True)

    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        targets, levels = asyncio.run(benchmark(args, prompts, warmup, starters(args)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    ratios = ratio_rows(levels, args.concurrency)
    checks = target_checks(ratios, args.high_concurrency, args.tolerance)
    reference = vllm_label(args.vllm[0], args) if args.vllm else None
    if reference is not None:
        checks += peer_checks(levels, reference, args.modes, [c for c in args.concurrency if c > 1])
    markdown = markdown_report(machine_info, levels, ratios, checks, reference)
    print()
    print(markdown)
    write_outputs(args, machine_info, targets, levels, ratios, checks, warmup, markdown)
    if args.write_page:
        page.write(args.write_page, markdown, machine_info, {"ratios": ratios, "targets": checks})
    failed = [t for t in targets if t.failed]
    errors = sum(lv.errors for lv in levels)
    if failed:
        print("servers that failed: " + "; ".join(f"{t.label}: {t.failed}" for t in failed), file=sys.stderr)
    if errors:
        print(f"{errors} requests failed (see the table and bench_serve.json)", file=sys.stderr)
    return 1 if failed or not levels else 0


if __name__ == "__main__":
    sys.exit(main())
