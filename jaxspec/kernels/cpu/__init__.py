"""A float32 matmul for few columns on the CPU: `y [m, n] = w [m, k] @ x [k, n]`, as an XLA FFI custom call.

The model's projections (`linear`, the model's one boundary to this package) hand it weights w [out, in] and
their few activation rows transposed, x [in, N], N = rows x new tokens. On XLA:CPU a product over 2-16 columns
costs several times one over a single column although it reads the same weights (docs/cpu-performance.md);
small_matmul.cc reads every weight once for any N, so a verify forward over a few tokens costs about what a
one-token forward costs.

- `available()` / `unavailable_reason()`: whether the library built by `python -m jaxspec.kernels.cpu.build`
  (run by `make install`) is present, loads, and was built from these sources; `isa()`: the code path it picks
  on this CPU. Nothing is loaded until one of these, `matmul` or `project` is called.
- `matmul(w, x)`: the custom call itself (CPU only, float32, no differentiation rule).
- `linear(x, w, impl)`: what the model calls, x [..., in] by w [out, in]; the kernel through `project` where it
  applies, XLA's dot elsewhere.
- `project(w, x, impl)`: the feature-major product. `impl="auto"` uses the kernel on CPU when it is available and N
  is in `AUTO_COLUMNS` for its code path (where it measured faster), else XLA's `w @ x`; `"xla"` and `"ffi"`
  force a path (`"ffi"`: the kernel for every float32 product). Under `jax.grad`/`jax.jvp` the kernel still
  computes the forward value and XLA the derivatives.
- `uses_kernel(impl, w, x)`: whether `project` would take the kernel for these operands.
- `default_impl()`: the `impl` a model gets when none is given: `$JAXSPEC_MATMUL` (auto, xla or ffi), else auto.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import warnings
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AUTO_COLUMNS", "MatmulImpl", "available", "default_impl", "isa", "linear", "matmul", "project",
           "unavailable_reason", "uses_kernel"]

MatmulImpl = Literal["auto", "xla", "ffi"]
IMPLS: tuple[MatmulImpl, ...] = ("auto", "xla", "ffi")
ENV = "JAXSPEC_MATMUL"

_DIR = Path(__file__).parent
LIBRARY = _DIR / "_small_matmul.so"
# The first is the translation unit; it includes the others.
SOURCES = (_DIR / "small_matmul.cc", _DIR / "portable_tiles.inc", _DIR / "broadcast_tiles.inc")
_TARGET = "jaxspec_small_matmul"
_ISAS = {"auto": 0, "avx512": 1, "avx2": 2, "generic": 3}
_FORMS = {"auto": 0, "dot": 1, "broadcast": 2}

# The column counts N for which `auto` takes the kernel, per code path (docs/cpu-performance.md has the
# measurements). One column stays on XLA: its matrix-vector path streams the weights faster than the kernel on
# one core, so the plain decode step is XLA's. With AVX-512 the kernel beats XLA's GEMM clearly at 2-32 columns
# and by less as columns grow, until the two are level around 512: a prefill over hundreds of tokens stays on
# XLA. With AVX2 only, the default model's forward is faster on the kernel at batch 1 for every T in 2-33 and
# at batch 8 for T = 1-2 (8 and 16 columns); at 24-72 columns the two are about level. The baseline path is a
# fallback only.
AUTO_COLUMNS = {"avx512": range(2, 257), "avx2": range(2, 34)}


def source_hash() -> str:
    """A digest of the kernel's sources and of the jaxlib whose FFI headers it compiles against: the build bakes it
    into the library, the loader compares (a jaxlib upgrade needs a rebuild too)."""
    digest = hashlib.sha256(importlib.metadata.version("jaxlib").encode())
    for path in SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not). Registers the FFI target once, on first success."""
    if not LIBRARY.exists():
        return None, (f"{LIBRARY} is not built: run `python -m jaxspec.kernels.cpu.build` (make install does) "
                      f"with a C++ compiler")
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        lib.JaxspecSmallMatmulSourceHash.restype = ctypes.c_char_p
        lib.JaxspecSmallMatmulBestIsa.restype = ctypes.c_int64
        built_from = lib.JaxspecSmallMatmulSourceHash().decode()
    except (OSError, AttributeError) as e:
        return None, f"{LIBRARY} does not load: {e}"
    if built_from != source_hash():
        why = (f"{LIBRARY} was built from other sources or for another jaxlib: rebuild with "
               f"`python -m jaxspec.kernels.cpu.build`")
        # Not silent, unlike a library never built: sources updated without `make install` are worth a word.
        warnings.warn(f"jaxspec: the CPU matmul kernel is not used: {why}", stacklevel=3)
        return None, why
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxspecSmallMatmul), platform="cpu")
    return lib, ""


def reload() -> None:
    """Look for the library again at the next use: after building it in a running process, or after
    `LIBRARY` changed. What was loaded stays registered with XLA."""
    _load.cache_clear()


def available() -> bool:
    """Whether the kernel library is built, loads and matches these sources (loads it on first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False, or None when it is True."""
    lib, why = _load()
    return None if lib is not None else why


def isa() -> str | None:
    """The code path the kernel runs on this CPU: "avx512", "avx2" or "generic"; None when unavailable."""
    lib = _load()[0]
    if lib is None:
        return None
    best = int(lib.JaxspecSmallMatmulBestIsa())
    return next(name for name, code in _ISAS.items() if code == best)


def default_impl() -> MatmulImpl:
    """$JAXSPEC_MATMUL (auto, xla or ffi), else "auto"; ValueError for anything else."""
    impl = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"{ENV}={impl!r} must be one of {IMPLS}")
    return impl


def _check_operands(w, x) -> None:
    if w.ndim != 2 or x.ndim != 2 or w.shape[1] != x.shape[0]:
        raise ValueError(f"matmul needs w [m, k] and x [k, n]; got w {tuple(w.shape)}, x {tuple(x.shape)}")
    if w.dtype != jnp.float32 or x.dtype != jnp.float32:
        raise ValueError(f"matmul needs float32 operands; got w {w.dtype}, x {x.dtype}")


def matmul(w: jax.Array, x: jax.Array, *, isa: str = "auto", form: str = "auto", threads: int = 0) -> jax.Array:
    """f32[m, n] = w f32[m, k] @ x f32[k, n] by the kernel (CPU only; no differentiation rule: see `project`).

    `isa` forces a code path ("avx512", "avx2", "generic"; the call fails at run time when the CPU lacks it),
    `form` the loop form of the AVX-512 and AVX2 paths ("dot" or "broadcast"; auto picks by n), `threads` the
    threads used (0: the caller and XLA's intra-op pool; 1: the calling thread only). ValueError for bad shapes
    or dtypes; RuntimeError when the library is unavailable.
    """
    _check_operands(w, x)
    if isa not in _ISAS or form not in _FORMS or threads < 0:
        raise ValueError(f"isa={isa!r} must be one of {tuple(_ISAS)}, form={form!r} one of {tuple(_FORMS)}, "
                         f"threads={threads!r} >= 0")
    if not available():
        raise RuntimeError(f"the CPU matmul kernel is unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(w, x, isa=np.int64(_ISAS[isa]), form=np.int64(_FORMS[form]), threads=np.int64(threads))


@jax.custom_jvp
def _kernel_product(w: jax.Array, x: jax.Array) -> jax.Array:
    return matmul(w, x)


@functools.partial(_kernel_product.defjvp, symbolic_zeros=True)
def _kernel_product_jvp(primals, tangents):
    # The value comes from the kernel; the derivative is linear in the tangents and runs on XLA, so JAX can
    # transpose it for reverse mode (the EAGLE head trains through these projections).
    w, x = primals
    dw, dx = tangents
    y = _kernel_product(w, x)
    dy = jnp.zeros_like(y)
    if not isinstance(dw, jax.custom_derivatives.SymbolicZero):
        dy = dy + dw @ x
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
        dy = dy + w @ dx
    return y, dy


def uses_kernel(impl: MatmulImpl, w, x) -> bool:
    """Whether `project(w, x, impl)` runs the kernel on the CPU (static: from shapes, dtypes and `impl`).

    RuntimeError when `impl` is "ffi" and the library is unavailable; float32 is the kernel's only dtype, so
    other dtypes take XLA's product under every `impl`.
    """
    if impl == "xla":
        return False
    if impl not in IMPLS:
        raise ValueError(f"matmul impl={impl!r} must be one of {IMPLS}")
    fits = w.ndim == 2 and x.ndim == 2 and w.dtype == jnp.float32 and x.dtype == jnp.float32
    if impl == "ffi":
        if not fits:
            return False  # other dtypes have no kernel: XLA, as for "auto"
        if not available():
            raise RuntimeError(f"matmul impl='ffi' but the CPU matmul kernel is unavailable: {unavailable_reason()}")
        return True
    return fits and available() and x.shape[1] in AUTO_COLUMNS.get(isa(), ())


def linear(x: jax.Array, w: jax.Array, impl: MatmulImpl = "auto") -> jax.Array:
    """x [..., in] times w [out, in] -> [..., out], the product every model projection calls: XLA's dot, or, on the
    CPU where `impl` says so (`uses_kernel`), the kernel's w @ x^T over the rows transposed (the few rows of a
    decode or verify step, so the transposes are small)."""
    rows = x.reshape(-1, x.shape[-1])  # [N, in]
    if uses_kernel(impl, w, rows.T):
        out = project(w, rows.T, impl).T
    else:
        out = jnp.einsum("ni,oi->no", rows, w)
    return out.reshape(*x.shape[:-1], w.shape[0])


def project(w: jax.Array, x: jax.Array, impl: MatmulImpl = "auto") -> jax.Array:
    """w [out, in] @ x [in, N] -> [out, N]: the kernel when running on the CPU and `impl` says so, else XLA.

    Decided at trace time from the static shapes and dtypes. On other platforms (a GPU) the product is always
    XLA's; under differentiation the kernel still gives the value and XLA the derivatives.
    """
    if not uses_kernel(impl, w, x):
        return w @ x
    return jax.lax.platform_dependent(w, x, cpu=_kernel_product, default=jnp.matmul)
