"""Build the CPU matmul kernel (small_matmul.cc) into a shared library inside this package.

    python -m jaxspec.kernels.cpu.build            # what `make install` runs
    CXX=g++-13 python -m jaxspec.kernels.cpu.build

The library is compiled for the baseline ISA of the machine's compiler; the AVX-512 and AVX2 code paths are
compiled alongside and picked at run time, so the build needs no -march flag. Without a C++ compiler this
prints why and exits 0: the model then uses XLA's matmul (`jaxspec.kernels.cpu.available()` is False). A
compiler that fails on the source exits 1, so a broken build does not pass unnoticed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxspec.kernels.cpu import LIBRARY, SOURCES, source_hash

FLAGS = ("-O3", "-std=gnu++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden",
         # The portable path relies on the compiler fusing a*b+c into FMA where the target has it.
         "-ffp-contract=fast")


def find_compiler() -> str | None:
    """$CXX, else g++, c++ or clang++ from PATH; None when there is none."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    return next((path for name in ("g++", "c++", "clang++") if (path := shutil.which(name))), None)


def build(cxx: str) -> Path:
    """Compile the library with `cxx` (subprocess.CalledProcessError with the compiler's output on failure)."""
    import jax

    command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f'-DJAXSPEC_SOURCE_HASH="{source_hash()}"',
               str(SOURCES[0])]
    # Written beside the library and renamed over it: a process that has the old one loaded keeps its copy.
    fd, tmp = tempfile.mkstemp(dir=LIBRARY.parent, prefix=LIBRARY.stem, suffix=".tmp")
    os.close(fd)
    try:
        subprocess.run([*command, "-o", tmp], check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)  # mkstemp made it private
        os.replace(tmp, LIBRARY)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return LIBRARY


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cxx", default=None, help="the C++ compiler (default: $CXX, else g++, c++, clang++)")
    args = parser.parse_args(argv)
    cxx = args.cxx or find_compiler()
    if cxx is None:
        print("jaxspec: no C++ compiler found (set CXX): the CPU matmul kernel is not built, the model uses XLA's "
              "matmul", file=sys.stderr)
        return 0
    try:
        path = build(cxx)
    except subprocess.CalledProcessError as e:
        print(f"jaxspec: building the CPU matmul kernel failed:\n$ {' '.join(e.cmd)}\n{e.stderr}", file=sys.stderr)
        return 1
    except FileNotFoundError:
        print(f"jaxspec: the C++ compiler {cxx!r} does not exist: the CPU matmul kernel is not built",
              file=sys.stderr)
        return 0
    print(f"jaxspec: built {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
