"""Timing: warm-up calls first (the first call compiles), then repeats; runs side by side, and their ratios.

The machines these benchmarks run on are shared and noisy. Runs that are compared take turns within one
process (`interleave`), so a burst of load or slow drift hits all of them alike, and results are reported as
ratios to a baseline measured in the same rounds.

A jax function returns before its device work ends: what is timed must block on its result
(`jax.block_until_ready`) itself.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Iterator, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def clocked(fn: Callable[[], T], clock: Callable[[], float] = time.perf_counter) -> tuple[float, T]:
    """Call `fn` once: (seconds it took, what it returned)."""
    start = clock()
    result = fn()
    return clock() - start, result


def timer(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """`fn` as a call that returns the seconds it took (its own result dropped)."""
    return lambda: clocked(fn, clock)[0]


def repeat(fn: Callable[[], T], repeats: int, warmup: int = 1) -> list[T]:
    """What `fn` returns on each of `repeats` calls, after `warmup` calls whose results are dropped."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]


def rounds(names: Sequence[K], repeats: int, alternate: bool = False) -> Iterator[tuple[int, K]]:
    """(round, name) in side-by-side order: `repeats` rounds, each visiting every name once. With `alternate`
    every other round runs in reverse, so no name always runs first (or right after another) in a round."""
    for r in range(repeats):
        for name in (names[::-1] if alternate and r % 2 else names):
            yield r, name


def interleave(runs: Mapping[K, Callable[[], T]], repeats: int, warmup: int = 1,
               alternate: bool = False) -> dict[K, list[T]]:
    """Every run called `warmup` times (all compile before any is timed), then `repeats` rounds of each run in
    turn (see `rounds`). Returns what each run returned in each round."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples: dict[K, list[T]] = {name: [] for name in runs}
    for _, name in rounds(list(runs), repeats, alternate):
        samples[name].append(runs[name]())
    return samples


def ratios(samples: Mapping[K, Sequence[float]], base: K,
           stat: Callable[[Sequence[float]], float] = statistics.median) -> dict[K, float]:
    """`stat` (the median; `min` for the best) of each run's samples over that of `base`'s samples."""
    reference = stat(samples[base])
    return {name: stat(values) / reference for name, values in samples.items()}
