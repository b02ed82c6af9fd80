"""Where and when a benchmark ran: the header of every report (docs/benchmarks.md gives it for every block)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else whatever `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    # Package metadata, not `jax.__version__`: reading it imports nothing.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def info(device: bool = True) -> dict:
    """The machine, software versions and date, as a dict for a report's JSON.

    `machine` ("x86_64, 2 cores"), `date`, `jax` and `backend` keep the keys earlier reports used. With
    `device=False` no JAX backend is started: bench_serve's load generator leaves the accelerator to the servers
    it launches (a started GPU backend would reserve most of its memory).
    """
    out = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "cpu": _cpu_model(), "cores": os.cpu_count(),
           "platform": platform.platform(), "python": platform.python_version(),
           "jax": _version("jax"), "jaxlib": _version("jaxlib"), "flax": _version("flax")}
    if device:
        import jax

        devices = jax.devices()
        out["backend"] = jax.default_backend()
        out["device"] = f"{len(devices)} x {devices[0].device_kind}"
        # None is XLA's default: TF32 for float32 products on recent NVIDIA GPUs, full float32 on a CPU.
        out["matmul_precision"] = jax.config.jax_default_matmul_precision
    return out


def line(machine: dict) -> str:
    """One line for a report's header: machine, CPU, versions, device (when recorded), date."""
    device = f", {machine['backend']} ({machine['device']})" if "device" in machine else ""
    if machine.get("matmul_precision"):
        device += f", matmul precision {machine['matmul_precision']}"
    return (f"{machine['machine']} ({machine['cpu']}), jax {machine['jax']}, flax {machine['flax']}{device}, "
            f"{machine['date']}")
