"""The servers under test: started here one per mode (scripts/serve.py, or a peer, on a free port), or one given
by URL."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]  # scripts/benchkit/serve/ -> the repository: the servers' cwd


@dataclasses.dataclass
class Target:
    """A server under test: started here (proc set) or given by --url."""

    label: str
    base_url: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    command: list[str] | None = None
    model: str | None = None  # the served model name, from /v1/models
    started_at: float | None = None  # time.perf_counter() at launch
    startup_s: float | None = None  # from launch (or from the first poll, for --url) to a healthy /health
    failed: str | None = None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(mode: str, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, str(Path(args.serve_script).resolve()), "--model", args.model, "--host", args.host,
           "--port", str(port),
           "--policy", mode, "--method", args.method, "--max-slots", str(args.max_slots),
           "--cache-len", str(args.cache_len),
           "--no-background-compile"]  # speculation compiled before /health: no compile beside the timed load
    optional = {"--chunk-steps": args.chunk_steps, "--num-speculative-tokens": args.num_speculative_tokens,
                "--spec-max-active": args.spec_max_active, "--max-waiting": args.max_waiting}
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    for extra in args.server_arg:
        cmd += extra.split()
    return cmd


def start_server(mode: str, args: argparse.Namespace) -> Target:
    """scripts/serve.py with the speculation policy `mode`, on a free port."""
    port = free_port(args.host)
    return launch(mode, server_command(mode, port, args), f"http://{args.host}:{port}",
                  Path(args.out_dir) / f"serve_{mode}.log")


def launch(label: str, cmd: list[str], base_url: str, log_path: Path, env: dict | None = None) -> Target:
    """Start a server process (any OpenAI-compatible one) with its output in log_path."""
    log = open(log_path, "w")
    print(f"[{label}] starting: {' '.join(cmd)}  (log: {log_path})", flush=True)
    # Its own session: a Ctrl-C here does not reach it, stop_server() shuts it down in order.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()
    return Target(label=label, base_url=base_url, proc=proc, log_path=log_path, command=cmd,
                  started_at=time.perf_counter())


def _log_tail(target: Target, lines: int = 20) -> str:
    if target.log_path is None or not target.log_path.exists():
        return ""
    return "\n".join(target.log_path.read_text(errors="replace").splitlines()[-lines:])


async def wait_ready(client: httpx.AsyncClient, target: Target, timeout_s: float) -> bool:
    """Poll GET /health until 200; give up when the server exits or after timeout_s."""
    t0 = time.perf_counter()
    next_note = 60.0
    while True:
        if target.proc is not None and target.proc.poll() is not None:
            target.failed = f"server exited with code {target.proc.returncode} before it was ready"
            break
        try:
            resp = await client.get(target.base_url + "/health", timeout=10.0)
            if resp.status_code == 200:
                target.startup_s = time.perf_counter() - (target.started_at or t0)
                return True
        except httpx.HTTPError:
            pass
        elapsed = time.perf_counter() - t0
        if elapsed > timeout_s:
            target.failed = f"not healthy after {timeout_s:.0f} s"
            break
        if elapsed > next_note:
            print(f"[{target.label}] still starting ({elapsed:.0f} s)", flush=True)
            next_note += 60.0
        await asyncio.sleep(1.0)
    print(f"[{target.label}] FAILED: {target.failed}\n{_log_tail(target)}", flush=True)
    return False


def stop_server(target: Target, timeout_s: float) -> None:
    """SIGINT (the server finishes in-flight requests and exits), then SIGKILL if it is still there."""
    proc = target.proc
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[{target.label}] did not exit {timeout_s:.0f} s after SIGINT: killing it", flush=True)
        proc.kill()
        proc.wait()


async def served_model(client: httpx.AsyncClient, target: Target, override: str | None) -> str:
    if override:
        return override
    resp = await client.get(target.base_url + "/v1/models", timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
