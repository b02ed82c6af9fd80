"""Per-request sampling settings.

`SamplingParams` holds either Python scalars (one request, validated on construction) or per-row arrays
(a batch inside jitted code). Its fields are pytree leaves, never static: a new temperature or seed never
recompiles anything.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np


def _is_concrete(x) -> bool:
    return isinstance(x, (numbers.Number, np.ndarray, np.generic))


@flax.struct.dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    seed: int = 0  # a request's random numbers derive from this seed and the token position only

    def __post_init__(self):
        # Only concrete values are checked: inside jit the fields are tracers of already-checked arrays.
        checks = {
            "temperature": lambda v: np.all(v >= 0) and np.all(np.isfinite(v)),
            "top_k": lambda v: np.all(v >= 0) and np.all(np.asarray(v) == np.floor(v)),
            "top_p": lambda v: np.all((v > 0) & (v <= 1)),
            "min_p": lambda v: np.all((v >= 0) & (v <= 1)),
            "seed": lambda v: np.all(np.asarray(v) == np.floor(v)),
        }
        allowed = {"temperature": ">= 0 and finite", "top_k": "an integer >= 0", "top_p": "in (0, 1]",
                   "min_p": "in [0, 1]", "seed": "an integer"}
        for name, ok in checks.items():
            value = getattr(self, name)
            if _is_concrete(value) and not ok(np.asarray(value, np.float64)):
                raise ValueError(f"{name}={value!r} must be {allowed[name]}")

    @property
    def is_greedy(self):
        return self.temperature == 0

    @classmethod
    def stack(cls, params: Sequence["SamplingParams"]) -> "SamplingParams":
        """Per-row arrays [B] from one SamplingParams per row."""
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
            seed=jnp.asarray([p.seed for p in params], jnp.uint32),
        )

    def broadcast(self, batch: int) -> "SamplingParams":
        """Per-row arrays [B] from scalars or arrays (a scalar applies to every row)."""
        def rows(x, dt):
            return jnp.broadcast_to(jnp.asarray(x, dt), (batch,))

        return SamplingParams(temperature=rows(self.temperature, jnp.float32), top_k=rows(self.top_k, jnp.int32),
                              top_p=rows(self.top_p, jnp.float32), min_p=rows(self.min_p, jnp.float32),
                              seed=rows(self.seed, jnp.uint32))
