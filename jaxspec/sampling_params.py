"""Per-request sampling settings, `SamplingParams`, checked where they are made.

`SamplingParams` holds either Python scalars (one request, validated on construction) or per-row arrays
(a batch inside jitted code). Its fields are pytree leaves, never static: a new temperature or seed never
recompiles anything.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this floor are greedy, exactly as temperature 0, everywhere a row's temperature decides
# between the argmax and a draw (`process_logits`, `sample`, `is_greedy`, chain and tree verification, and the
# proposers, which sample through this module). Why a floor: logits / T overflows float32 to inf for tiny T
# (already at T < ~1e-37 for logits of size ~10), and inf logits draw token 0 or make NaN probabilities. Why
# 1e-5, the epsilon vLLM treats as greedy: above it, logits of magnitude up to ~1e30 stay finite after the
# division, and below it sampling is already a point mass in practice: a logit gap of 1e-3 becomes e^-100.
GREEDY_BELOW = 1e-5


@dataclasses.dataclass(frozen=True)
class _Field:
    """How one SamplingParams field is checked and stored."""

    integer: bool  # an integer field (top_k, seed); float fields take any finite real
    low: float
    high: float
    low_open: bool  # the low end is excluded (top_p > 0)
    dtype: Any  # the per-row array dtype `stack` and `broadcast` build

    def allowed(self) -> str:
        if not self.integer and self.high == _F32_MAX:
            return "a finite number > 0" if self.low_open else "a finite number >= 0"
        kind = "an integer" if self.integer else "a number"
        low, high = _BOUND_NAMES.get(self.low, repr(self.low)), _BOUND_NAMES.get(self.high, repr(self.high))
        return f"{kind} in {'(' if self.low_open else '['}{low}, {high}]"


_F32_MAX = float(np.finfo(np.float32).max)  # a larger temperature is inf once stored as float32
_BOUND_NAMES = {2**31 - 1: "2**31 - 1", 2**32 - 1: "2**32 - 1", 0.0: "0", 1.0: "1", -2.0: "-2", 2.0: "2"}
_FIELDS = {
    "temperature": _Field(integer=False, low=0.0, high=_F32_MAX, low_open=False, dtype=np.float32),
    "top_k": _Field(integer=True, low=0, high=2**31 - 1, low_open=False, dtype=np.int32),
    "top_p": _Field(integer=False, low=0.0, high=1.0, low_open=True, dtype=np.float32),
    "min_p": _Field(integer=False, low=0.0, high=1.0, low_open=False, dtype=np.float32),
    "seed": _Field(integer=True, low=0, high=2**32 - 1, low_open=False, dtype=np.uint32),
    # OpenAI's ranges for the two additive penalties; the multiplicative one only needs to be positive.
    "presence_penalty": _Field(integer=False, low=-2.0, high=2.0, low_open=False, dtype=np.float32),
    "frequency_penalty": _Field(integer=False, low=-2.0, high=2.0, low_open=False, dtype=np.float32),
    "repetition_penalty": _Field(integer=False, low=0.0, high=_F32_MAX, low_open=True, dtype=np.float32),
}
# Leaves a user may hand in, all checked. Anything else (tracers, the placeholder objects jax puts in leaves
# while it unflattens a pytree inside its transformations) passes construction unchecked; `stack` and
# `broadcast` still reject it.
_USER_TYPES = (numbers.Number, str, bytes, type(None), list, tuple, dict, set, frozenset, np.ndarray, np.generic)


class InvalidSetting(ValueError):
    """A SamplingParams value out of its field's range or of the wrong type; `field` names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _fail(name: str, value, why: str = "") -> InvalidSetting:
    return InvalidSetting(name, f"{name}={value!r} must be {_FIELDS[name].allowed()}{why}")


def _is_unchecked(value) -> bool:
    """True for values only jitted code or pytree machinery hands in: tracers and opaque placeholders."""
    if isinstance(value, jax.core.Tracer):
        return True
    if isinstance(value, jax.Array):
        return value.is_deleted()  # a donated buffer: nothing left to read
    return not isinstance(value, _USER_TYPES)


def _host_values(name: str, value) -> np.ndarray:
    """The field's values as a numpy array of numbers, or ValueError naming the field."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name} is a PRNG key {value.dtype}; it must be {_FIELDS[name].allowed()} "
                         "(pass the integer seed, or pass the key as generate's rng= to derive per-row seeds)")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:  # ragged nesting, unconvertible objects
        raise _fail(name, value) from e
    if arr.dtype == object:  # Python ints beyond 64 bits, or junk: check element by element
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                   for v in arr.ravel().tolist()):
            raise _fail(name, value)
    elif arr.dtype.kind not in "iuf":  # bool, complex, strings, datetimes
        raise _fail(name, value)
    return arr  # any shape: vmapped code stacks per-row arrays; `stack` and `broadcast` check their shapes


def _value_in_range(field: _Field, v) -> bool:
    """One Python number: exact comparisons, whatever its size."""
    if v != v or v in (math.inf, -math.inf) or (field.integer and v != int(v)):
        return False
    return (field.low < v if field.low_open else field.low <= v) and v <= field.high


def _in_range(field: _Field, arr: np.ndarray) -> bool:
    """Whether every value lies in the field's range (and is a whole number for integer fields)."""
    if arr.dtype == object:  # Python ints beyond 64 bits (mixed with others): one by one
        return all(_value_in_range(field, v) for v in arr.ravel().tolist())
    if arr.dtype.kind == "f":
        # Compare in float64: a bound like 2**32 - 1 does not fit float16, and numpy would cast it with a
        # RuntimeWarning (to inf; the answer stays right, since no float16 value reaches such a bound).
        arr = arr.astype(np.float64)
        with np.errstate(invalid="ignore"):
            if not np.all(np.isfinite(arr)) or (field.integer and not np.all(arr == np.floor(arr))):
                return False
    low_ok = arr > field.low if field.low_open else arr >= field.low
    return bool(np.all(low_ok) and np.all(arr <= field.high))


def _checked(name: str, value) -> np.ndarray:
    """The field's values, validated, as a numpy array of its row dtype; ValueError names a bad value."""
    arr = _host_values(name, value)
    field = _FIELDS[name]
    if not _in_range(field, arr):
        raise _fail(name, value)
    stored = np.asarray(arr.tolist() if arr.dtype == object else arr).astype(field.dtype)
    if field.low_open:
        # A value above the open end that rounds onto it in the row dtype (top_p=1e-50 is 0.0 in float32)
        # keeps its meaning as the dtype's smallest normal value (for top_p: the likeliest token alone).
        stored = np.maximum(stored, np.finfo(field.dtype).tiny).astype(field.dtype)
    return stored


@flax.struct.dataclass
class SamplingParams:
    """One request's sampling settings (Python scalars), or per-row arrays [B] for a batch.

    temperature: a finite number >= 0. Below `GREEDY_BELOW` (1e-5) a row is greedy (the
      argmax), exactly as at 0: dividing logits by a smaller temperature overflows float32.
    top_k: an integer in [0, 2**31 - 1]; 0 disables.  top_p: in (0, 1]; 1 disables.
    min_p: in [0, 1]; 0 disables.  seed: an integer in [0, 2**32 - 1].
    presence_penalty, frequency_penalty: in [-2, 2]; 0 disables. Subtracted from the logit of every token
      the output holds so far: once (presence) and once per occurrence (frequency), as OpenAI defines them.
    repetition_penalty: > 0; 1 disables. Divides the positive logits and multiplies the negative ones of every
      token in the prompt or the output so far (the CTRL rule Hugging Face and vLLM apply).
    Penalties apply before temperature and truncation (`jaxspec.penalties`).

    Construction checks concrete values (scalars, per-row lists, numpy or jax arrays) element by element and
    raises ValueError naming the field; tracers inside jitted code are not checked (they come from checked
    arrays).
    """

    temperature: float = 0.0  # below GREEDY_BELOW (0 included) means greedy (argmax)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    seed: int = 0  # a request's random numbers derive from this seed and the token position only
    presence_penalty: float = 0.0  # in [-2, 2]; 0 disables
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 disables
    repetition_penalty: float = 1.0  # > 0; 1 disables

    def __post_init__(self):
        for name in _FIELDS:
            value = getattr(self, name)
            if not _is_unchecked(value):
                _checked(name, value)

    @property
    def is_greedy(self):
        """Whether the temperature is below `GREEDY_BELOW` (per row for arrays)."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def stack(cls, params: Sequence["SamplingParams"]) -> "SamplingParams":
        """Per-row arrays [B] from one SamplingParams per row (each with scalar fields)."""
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise ValueError(f"params={params!r} must be a list of SamplingParams, one per row")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}]={p!r} must be a SamplingParams")
        columns = {}
        for name in _FIELDS:
            values = [_checked(name, getattr(p, name)) for p in params]
            for i, v in enumerate(values):
                if v.ndim != 0:
                    raise ValueError(f"params[{i}].{name}={getattr(params[i], name)!r} must be a scalar to stack")
            columns[name] = jnp.asarray(np.asarray(values, _FIELDS[name].dtype).reshape(len(values)))
        return cls(**columns)

    def broadcast(self, batch: int) -> "SamplingParams":
        """Per-row arrays [B] from scalars or arrays (a scalar applies to every row)."""
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 0:
            raise ValueError(f"batch={batch!r} must be an integer >= 0")
        return SamplingParams(**{name: self._rows(name, batch) for name in _FIELDS})

    def _rows(self, name: str, batch: int) -> jax.Array:
        """One field as an array [B]: checked on the host unless it is a tracer."""
        value = getattr(self, name)
        if isinstance(value, jax.core.Tracer):  # inside jit: already checked where it was concrete
            return jnp.broadcast_to(jnp.asarray(value, _FIELDS[name].dtype), (batch,))
        arr = _checked(name, value)
        if arr.shape not in ((), (batch,)):
            raise ValueError(f"{name} has shape {arr.shape}: it must be a scalar or one value per row, "
                             f"shape ({batch},)")
        return jnp.asarray(np.broadcast_to(arr, (batch,)))
