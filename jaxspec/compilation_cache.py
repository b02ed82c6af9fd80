"""One call that keeps XLA's compiled programs on disk, so a later process skips compiling them.

The real model's decode loops take tens of seconds to compile on a CPU; with the cache on, a second `jaxspec
generate` (or server start, or demo) loads them from disk instead. Nothing turns it on by itself: importing
jaxspec leaves JAX's settings alone, and an application that manages its own cache keeps doing so.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DIR = Path("~/.cache/jaxspec-xla")
# Programs that compile faster than this are not written: they cost more to store and read than to rebuild.
MIN_COMPILE_SECONDS = 1.0


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache in the folder `path` (default `~/.cache/jaxspec-xla`, the one
    jaxspec's commands, server and trainers use), created if missing. Returns the folder.

    Programs compiled from then on in this process are written there and read back by any later process that
    calls this with the same folder. ValueError where `path` exists and is not a folder."""
    import jax

    folder = (DEFAULT_DIR if path is None else Path(path)).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"path={str(folder)!r} must be a folder for the compilation cache; it is a file")
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder
