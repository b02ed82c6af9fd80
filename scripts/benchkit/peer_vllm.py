"""The vLLM peer, run inside vLLM's own virtual environment: a standalone script, never imported by jaxspec.

vLLM's CPU build pins its own torch, so it lives in a venv of its own (`make peer-venv` makes `.venv-vllm`)
and scripts/bench_peer.py talks to this script as a subprocess. It imports nothing from jaxspec or benchkit
(benchkit's package imports jax), only vLLM, transformers and the standard library.

    .venv-vllm/bin/python -P scripts/benchkit/peer_vllm.py convert MODEL.gguf OUT_DIR
    .venv-vllm/bin/python -P scripts/benchkit/peer_vllm.py worker --model OUT_DIR [--ngram K]

(`-P`: this folder first on sys.path would let benchkit/profile.py hide the standard library's `profile`.)

`convert` writes the GGUF checkpoint as a Hugging Face float32 directory (config.json, model.safetensors, the
tokenizer), dequantised by transformers, which is what vLLM's CPU build loads.

`worker` starts one offline `vllm.LLM` (with `--ngram K`, vLLM's prompt-lookup speculative decoding, K draft
tokens, matching suffixes of up to 4 tokens), prints one JSON line `{"ready": seconds to start}`, then answers requests,
one JSON object a line on stdin, with one JSON line on stdout each:

    {"prompts": [[ids...], ...], "max_tokens": 128}  ->  {"outputs": [[ids...], ...], "seconds": s}

All of a request's prompts are submitted together (`LLM.generate` schedules them as one batch of rows), greedy,
each ending at its end-of-sequence token or after max_tokens; `seconds` is the wall time of that call, prefill
included. Everything else vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def convert(gguf_path: str, out_dir: str) -> None:
    """The GGUF checkpoint as a Hugging Face float32 directory at out_dir."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # transformers dequantises the weights on load; what is left of GGUF is the quantizer's bookkeeping, which
    # would make save_pretrained refuse a model that is no longer quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def worker(model: str, ngram: int, max_rows: int, max_model_len: int) -> None:
    # The replies keep stdout to themselves: vLLM and its engine processes print there too, so they get stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    from vllm import LLM, SamplingParams, TokensPrompt

    speculative = None
    if ngram:
        speculative = {"method": "ngram", "num_speculative_tokens": ngram, "prompt_lookup_max": 4}
    start = time.perf_counter()
    # On a CPU, gpu_memory_utilization is the share of the machine's memory vLLM claims at start (0.92 by default,
    # more than is free beside jaxspec); a KV cache of 1 GiB holds every row these benchmarks run many times over.
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_rows, seed=0,
              speculative_config=speculative, gpu_memory_utilization=0.2, kv_cache_memory_bytes=1 << 30)
    reply({"ready": time.perf_counter() - start})
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outputs = [list(r.outputs[0].token_ids) for r in results]
        reply({"outputs": outputs, "seconds": seconds})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="a GGUF checkpoint as a Hugging Face float32 directory")
    c.add_argument("gguf")
    c.add_argument("out")
    w = sub.add_parser("worker", help="an offline vllm.LLM answering JSON lines on stdin")
    w.add_argument("--model", required=True, help="a Hugging Face directory (`convert` writes one)")
    w.add_argument("--ngram", type=int, default=0, help="vLLM's n-gram speculation with K draft tokens (0: off)")
    w.add_argument("--max-rows", type=int, default=8, help="rows vLLM schedules at once (max_num_seqs)")
    w.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.command == "convert":
        convert(args.gguf, args.out)
    else:
        worker(args.model, args.ngram, args.max_rows, args.max_model_len)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which re-import this file
    sys.exit(main())
