"""Reading the files models and heads are made of, each problem reported as a `FileError` naming the file.

The loaders (`jaxspec.models.loading`, `jaxspec.models.heads`) read JSON sidecars and safetensors weights through
these helpers, so a missing file, bad JSON, a missing or mistyped field, a truncated file, a non-float tensor or a
non-finite value is a ValueError saying which file and what is wrong, never a KeyError, a TypeError from deep in
a library, or an allocation sized by a corrupt header. Safetensors headers are read and checked against the file
size before any tensor is; tensors are then read one at a time from a memory map.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np


class FileError(ValueError):
    """A file jaxspec reads is missing, malformed, or does not fit the model; the message names the file."""


REQUIRED = object()  # `field`'s default when the field must be present


def describe(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (a corrupt field may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in `path`; FileError naming `what` and the file when it is missing, unreadable or not JSON
    (with the position of the first error)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileError(f"{what} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FileError(f"{what} {str(path)!r} cannot be read: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FileError(f"{what} {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                        f"(char {e.pos})") from None


# kind -> (test, what the message says is expected)
_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
               "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def field(data: dict, name: str, kind: str, source: str, default: Any = REQUIRED) -> Any:
    """data[name] when it is of `kind` ("int", "number", "str", "bool", "list", "dict"); `default` when it is
    absent or null and a default is given; FileError naming `source`, the field, the expected type and the value
    (cut short) otherwise."""
    test, expected = _KINDS[kind]
    value = data.get(name)
    if value is None:
        if default is not REQUIRED:
            return default
        raise FileError(f"{source}: field {name!r} is missing; it must be {expected}")
    if not test(value):
        raise FileError(f"{source}: field {name!r} must be {expected}; got {describe(value)}")
    return value


def json_object(value: Any, source: str) -> dict:
    """`value` when it is a JSON object; FileError naming `source` otherwise."""
    if not isinstance(value, dict):
        raise FileError(f"{source} must hold a JSON object; it holds {type(value).__name__} {describe(value)}")
    return value


# ------------------------------------------------------------------------------------------- safetensors

# Safetensors dtype -> numpy dtype. Weights must be one of the float ones; the rest are named in errors only.
FLOAT_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                "BF16": np.dtype(ml_dtypes.bfloat16)}
# Integer and boolean tensors: index maps beside the weights (an EAGLE-3 drafter's draft-to-target ids).
INTEGER_DTYPES = {"I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
                  "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
                  "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
_OTHER_DTYPES = {**{name: dtype.itemsize for name, dtype in INTEGER_DTYPES.items()}, "F8_E4M3": 1, "F8_E5M2": 1}


class SafetensorsFile:
    """A safetensors file's header, checked against the file's size, and its tensors read one at a time.

    `shapes` and `dtypes` come from the header alone (nothing is allocated); `read(name)` maps the tensor's bytes
    and checks that it is float and finite. FileError naming the file for a truncated file, a corrupt header, a
    non-float dtype or a non-finite value.
    """

    def __init__(self, path: str | Path, what: str = "safetensors file"):
        self.path = Path(path)
        self.source = f"{what} {str(self.path)!r}"
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise FileError(f"{self.source} is truncated: {size} bytes, too few for a safetensors header")
                (header_len,) = struct.unpack("<Q", prefix)
                if 8 + header_len > size:
                    raise FileError(f"{self.source} is truncated or not a safetensors file: its header claims "
                                    f"{header_len} bytes but the file has {size}")
                raw = f.read(header_len)
        except FileNotFoundError:
            raise FileError(f"{self.source} does not exist") from None
        except OSError as e:
            raise FileError(f"{self.source} cannot be read: {e}") from e
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FileError(f"{self.source} has a corrupt header (not JSON: {e})") from None
        header = json_object(header, f"{self.source}'s header")
        self.metadata = header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_size = size - self._data_start
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._offsets: dict[str, int] = {}
        for name, info in header.items():
            where = f"{self.source}: tensor {name!r}"
            if not isinstance(info, dict):
                raise FileError(f"{where} has a corrupt header entry {describe(info)}")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if dtype not in FLOAT_DTYPES and dtype not in _OTHER_DTYPES:
                raise FileError(f"{where} has an unknown dtype {describe(dtype)}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise FileError(f"{where} has a corrupt shape {describe(shape)}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
                raise FileError(f"{where} has corrupt data_offsets {describe(offsets)}")
            begin, end = offsets
            itemsize = FLOAT_DTYPES[dtype].itemsize if dtype in FLOAT_DTYPES else _OTHER_DTYPES[dtype]
            if not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
                raise FileError(f"{where} ({dtype}{shape}) has data_offsets {offsets}, which do not span its "
                                f"{math.prod(shape) * itemsize} bytes")
            if end > data_size:
                raise FileError(f"{self.source} is truncated: tensor {name!r} ({dtype}{shape}) ends at byte {end} of "
                                f"the data, which holds {data_size} bytes")
            self.shapes[name], self.dtypes[name], self._offsets[name] = tuple(shape), dtype, begin

    def check_float(self) -> None:
        """FileError naming every tensor whose dtype is not a float one (weights are floats)."""
        bad = {name: dtype for name, dtype in self.dtypes.items() if dtype not in FLOAT_DTYPES}
        if bad:
            raise FileError(f"{self.source} holds tensors of non-float dtypes, where float weights are expected: "
                            f"{describe(bad, 200)}")

    def _read_raw(self, name: str, dtype: np.dtype) -> np.ndarray:
        """Tensor `name`'s bytes as an array of `dtype`, read into memory of its own. A read rather than a memory
        map: mapped pages stay resident (and counted) while the map lives, so a load through a map holds the
        whole file beside the model it fills; a read holds one tensor."""
        shape = self.shapes[name]
        arr = np.empty(shape, dtype)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + self._offsets[name])
            got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
        if got != arr.nbytes:  # the file shrank after its header was checked
            raise FileError(f"{self.source} is truncated: tensor {name!r} has {got} of its {arr.nbytes} bytes")
        return arr

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` (float16, float32 or float64; bfloat16 widened to float32), read from the file;
        FileError when it is not float or holds a NaN or an infinity."""
        dtype = self.dtypes[name]
        if dtype not in FLOAT_DTYPES:
            raise FileError(f"{self.source}: tensor {name!r} has dtype {dtype}; float weights are expected")
        arr = self._read_raw(name, FLOAT_DTYPES[dtype])
        arr = arr.astype(np.float32) if dtype == "BF16" else arr
        check_finite(arr, f"{self.source}: tensor {name!r}")
        return arr

    def read_integers(self, name: str) -> np.ndarray:
        """The integer or boolean tensor `name`, as int64; FileError when it has another dtype."""
        dtype = self.dtypes[name]
        if dtype not in INTEGER_DTYPES:
            raise FileError(f"{self.source}: tensor {name!r} has dtype {dtype}; integers are expected")
        return self._read_raw(name, INTEGER_DTYPES[dtype]).astype(np.int64)


def check_finite(arr: np.ndarray, where: str) -> None:
    """FileError naming `where` and the first bad index when float array `arr` holds a NaN or an infinity.

    One pass of np.isfinite on the host as each tensor is read: over the default model's 135M parameters that is
    1-2% of the whole load_model, so every load checks."""
    if not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))
        first = tuple(int(i) for i in bad[0])
        raise FileError(f"{where} holds {len(bad)} non-finite values (NaN or infinity), the first at index "
                        f"{first}: {arr[first]}")
