"""The engine's static settings: slots and their compiled batch sizes, cache length, the methods compiled in,
how many requests one prefill admits."""

from __future__ import annotations

import dataclasses

import jax

from ..constraints.limits import ConstraintLimits
from ..methods import METHODS, names
from ..shapes import BUCKET_MIN, widths_for_long_drafts
from ..spec_config import SpecConfig

# Methods whose rows may share one batch with any other such method (`jaxspec.methods.Method.shares_batch`).
SHARED_BATCH_METHODS = tuple(m for m in names(served=True) if METHODS[m].shares_batch)  # none, ngram, sam


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of an `Engine`: slots, cache length, the methods compiled in, chunk size, queue size."""

    max_slots: int = 8  # the most requests decoded at once
    cache_len: int = 2048  # KV slots per row: prompt + output must fit
    spec: SpecConfig = dataclasses.field(default_factory=lambda: SpecConfig(method="sam"))  # default method, K
    methods: tuple[str, ...] = SHARED_BATCH_METHODS  # proposers compiled in; each request picks one
    chunk_steps: int = 8  # decode steps between host visits (streaming granularity)
    max_waiting: int = 256  # requests queued beyond the free slots; more are refused (QueueFull). 0: no queue
    slot_buckets: tuple[int, ...] | None = None  # compiled batch sizes; default 1 and multiples of 8
    attention_impl: str | None = None  # "xla" or "pallas"; None: Pallas on GPU, XLA elsewhere
    max_logprobs: int | None = 20  # most likely tokens a request may ask for per position; None: no logprobs
    # The most waiting requests admitted by one prefill call; 1: one at a time. None: 8 on accelerators, 1 on
    # CPU, where a prefill costs the same per token at any batch size and padding prompts to the longest one's
    # bucket adds tokens, so batching makes the mean time to first token of a burst worse (measure it with
    # scripts/bench_serve.py --engine --prefill-batches 1,8).
    max_prefill_batch: int | None = None
    # Predicted outputs: the longest prediction (in tokens) a request may carry; 0 serves none. With it, every
    # row drafts up to spec.prediction_tokens tokens a step from its prediction (`jaxspec.predicted_outputs`),
    # and the loop compiles the wider verify widths that takes.
    max_prediction_len: int = 0
    # Structured output: rows may decode under a constraint (`Request.constraint`); every row then carries an
    # automaton state and the batch the stacked automata of its rows (`jaxspec.constraints.rows`).
    constraints: bool = True
    # The batch's stacked automata take one fixed shape, so a new constraint never compiles a program: at most
    # this many states and (state, token) edges across the distinct automata of the live rows. A request whose
    # automaton alone needs more is refused; one that fits only once rows finish waits for them. The defaults
    # hold `{"type": "object"}` (1505 states, 3.3M edges over SmolLM2's vocabulary) or a few dozen ordinary
    # schemas (a 10-string-field object: 172 states, 513k edges); they cost ~58 MB of device memory at V = 49152.
    constraint_states: int = 4096
    constraint_edges: int = 1 << 22
    # How large a constraint may be and its compile's time and memory budget (None: ConstraintLimits()).
    constraint_limits: ConstraintLimits | None = None
    # Warm-up (`Engine.start(warmup=True)`) compiles the smallest slot bucket's chunk at verify width 1 only,
    # serves, and compiles the rest on a thread while requests are served: the larger buckets' plain chunks,
    # prefills and writes (the batch grows to each once it is ready), the speculative chunks (every verify width,
    # one target forward each) and the longer prompts' prefills. The engine answers within one plain program's
    # compile time, and batches and speculates as its programs become ready. False compiles all of it first.
    background_compile: bool = True

    def __post_init__(self):
        if self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots!r} must be >= 1")
        if self.chunk_steps < 1:
            raise ValueError(f"chunk_steps={self.chunk_steps!r} must be >= 1")
        if self.max_prefill_batch is None:
            object.__setattr__(self, "max_prefill_batch", 1 if jax.default_backend() == "cpu" else 8)
        if isinstance(self.max_prefill_batch, bool) or not isinstance(self.max_prefill_batch, int) \
                or self.max_prefill_batch < 1:
            raise ValueError(f"max_prefill_batch={self.max_prefill_batch!r} must be None or an integer >= 1")
        for name in ("constraint_states", "constraint_edges"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.constraint_limits is None:
            object.__setattr__(self, "constraint_limits", ConstraintLimits())
        if not isinstance(self.constraint_limits, ConstraintLimits):
            raise ValueError(f"constraint_limits={self.constraint_limits!r} must be a ConstraintLimits or None")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting!r} must be >= 0")
        if self.max_logprobs is not None and not 0 <= self.max_logprobs <= 1024:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be None or in [0, 1024]")
        served = names(served=True)
        if not self.methods or any(m not in served for m in self.methods):
            raise ValueError(f"methods={self.methods!r} must be a non-empty subset of {served}")
        alone = [m for m in self.methods if not METHODS[m].shares_batch]
        if alone and len(set(self.methods) - {"none"}) > 1:
            raise ValueError(f"methods={self.methods!r}: {alone[0]!r} is served alone (with 'none' beside it)")
        if self.spec.method not in self.methods:
            raise ValueError(f"spec.method={self.spec.method!r} must be one of methods={self.methods!r}")
        if isinstance(self.max_prediction_len, bool) or not isinstance(self.max_prediction_len, int) \
                or not 0 <= self.max_prediction_len <= self.cache_len:
            raise ValueError(f"max_prediction_len={self.max_prediction_len!r} must be an integer in [0, cache_len]")
        if self.max_prediction_len and alone:
            raise ValueError(f"max_prediction_len={self.max_prediction_len!r}: predictions draft beside the lookup "
                             f"methods {SHARED_BATCH_METHODS}, not beside {alone[0]!r}; use 0")
        k = self.loop_k
        if self.cache_len < k + 2 + BUCKET_MIN:
            raise ValueError(f"cache_len={self.cache_len!r} is too small for K={k}")
        if self.slot_buckets is None:
            # XLA:CPU runs forwards over 2-7 rows slower than over 8 (docs/cpu-performance.md,
            # scripts/bench_kernel.py verify-cost): batch 1 or a multiple of 8.
            buckets = {1, self.max_slots} | set(range(8, self.max_slots, 8))
            object.__setattr__(self, "slot_buckets", tuple(sorted(buckets)))
        buckets = tuple(sorted(set(self.slot_buckets)))
        if min(buckets) < 1 or max(buckets) != self.max_slots:
            raise ValueError(f"slot_buckets={self.slot_buckets!r} must be >= 1 and end at max_slots={self.max_slots}")
        object.__setattr__(self, "slot_buckets", buckets)

    def on_data_axis(self, size: int) -> "EngineConfig":
        """These settings for a batch split over a mesh's data axis of `size` devices: every slot bucket rounded
        up to a multiple of it, so each device holds as many rows. ValueError when max_slots is not a multiple."""
        if size == 1:
            return self
        if self.max_slots % size:
            raise ValueError(f"max_slots={self.max_slots} must be a multiple of the mesh's data axis size {size}: "
                             "each device holds max_slots / size rows")
        return dataclasses.replace(self, slot_buckets=tuple(sorted({-(-b // size) * size
                                                                    for b in self.slot_buckets})))

    @property
    def num_speculative_tokens(self) -> int:
        """K: the engine's draft budget (the default method's, or 8 when that method is `none`)."""
        return self.spec.num_speculative_tokens or 8

    @property
    def loop_k(self) -> int:
        """The decode loop's draft budget: K, or the prediction budget when predictions are served and it is
        larger (a row's drafts from its prediction may run longer than its method's)."""
        k = self.num_speculative_tokens
        return max(k, self.spec.prediction_tokens) if self.max_prediction_len else k

    @property
    def prefill_batch_sizes(self) -> tuple[int, ...]:
        """The compiled prefill batch sizes: powers of two below m = min(max_prefill_batch, max_slots), and m.
        n requests admitted together are prefilled at the smallest size >= n, padded with dummy rows."""
        most = min(self.max_prefill_batch, self.max_slots)
        return tuple(sorted({1 << i for i in range(most.bit_length()) if 1 << i < most} | {most}))

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens a row may hold: every slot (drafts past the last one are scored, their K/V
        dropped, and never committed: `jaxspec.cache.write_new`)."""
        return self.cache_len

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The target-forward widths compiled in: 1, the default method's widths and K + 1 (plain rows share
        every step, so width 1 is always there; the widest holds a full draft)."""
        k = self.num_speculative_tokens
        widths = self.spec.verify_widths if self.spec.method != "none" else (1, k + 1)
        widths = tuple(sorted({1, *widths, k + 1}))
        if self.max_prediction_len:
            widths = widths_for_long_drafts(widths, self.loop_k)
        return widths
