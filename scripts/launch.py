#!/usr/bin/env python
"""Start a command as a group of jax.distributed processes (`jaxspec.distributed.initialize` reads what this sets).

One host, N processes (a free coordinator port is picked; each child's lines are prefixed with [pK]):

    python scripts/launch.py --num-processes 2 -- python examples/data_parallel_generate.py --check

Several hosts, one process each: run the same line on every host with its own --process-id and process 0's
reachable address as the coordinator:

    python scripts/launch.py --num-processes 4 --process-id 2 --coordinator 10.0.0.1:12355 -- python my_job.py

`--local-devices N` gives each process N forced CPU devices (XLA_FLAGS), for trying meshes on one machine. The
launcher exits with the first failing child's code (and stops the others), or 0 when all succeed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(coordinator: str, num_processes: int, process_id: int, local_devices: int | None) -> dict:
    env = dict(os.environ, JAXSPEC_COORDINATOR=coordinator, JAXSPEC_NUM_PROCESSES=str(num_processes),
               JAXSPEC_PROCESS_ID=str(process_id))
    if local_devices is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={local_devices}"
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _relay(process: subprocess.Popen, prefix: str) -> None:
    """Copy a child's output lines to ours, prefixed."""
    for line in process.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("launch.py: error: put the command after --, e.g. launch.py --num-processes 2 -- python x.py")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-processes", type=int, required=True, help="processes in the group (all hosts)")
    p.add_argument("--process-id", type=int, default=None,
                   help="run only this process (one per host); default: all of them on this host")
    p.add_argument("--coordinator", default=None,
                   help="host:port of process 0's coordinator (default: 127.0.0.1 and a free port)")
    p.add_argument("--local-devices", type=int, default=None, help="forced CPU devices per process")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("no command after --")
    if args.num_processes < 1:
        p.error(f"--num-processes={args.num_processes} must be >= 1")
    if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id={args.process_id} must be in [0, {args.num_processes})")
    if args.process_id is not None and args.coordinator is None:
        p.error("--process-id needs --coordinator (process 0's host:port, reachable from every host)")
    return args, command


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(argv)
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    ids = [args.process_id] if args.process_id is not None else list(range(args.num_processes))
    children, relays = [], []
    for k in ids:
        child = subprocess.Popen(command, env=_environment(coordinator, args.num_processes, k, args.local_devices),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        children.append(child)
        relays.append(threading.Thread(target=_relay, args=(child, f"[p{k}]"), daemon=True))
        relays[-1].start()
    code = 0
    try:
        pending = list(children)
        while pending:
            for child in list(pending):
                try:
                    rc = child.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                pending.remove(child)
                if rc != 0 and code == 0:
                    code = rc
                    for other in pending:  # the group cannot finish without this one
                        other.terminate()
    except KeyboardInterrupt:
        for child in children:
            child.terminate()
        code = 130
    for relay in relays:
        relay.join(timeout=5)
    return code


if __name__ == "__main__":
    sys.exit(main())
