"""Fixed-shape training windows over self-distillation sequences, in an order fixed by (seed, epoch).

A window is `seq_len` consecutive positions of one sequence plus `lookahead` positions after them (where the
labels of its last positions live). Its first `context` positions only feed the head's attention (EAGLE reads
its own earlier positions); the rest form the window's *loss region*, and consecutive windows of a sequence
tile its loss region without overlap. By default the loss region starts at the last prompt position, whose
feature produced the first generated token: that is where a drafter starts working at inference.

Batch `step` is a pure function of (data, settings, seed, step): epoch = step // steps_per_epoch, and each
epoch is one permutation of all windows drawn from `default_rng([seed, epoch])`. Resuming at step s therefore
sees exactly the batches an uninterrupted run would have seen from s on.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import flax.struct
import numpy as np

from .data import SelfDistillData


@flax.struct.dataclass
class Batch:
    """One training batch of windows, on the host."""

    tokens: np.ndarray  # i32[B, W]  W = seq_len + lookahead; -1 past a sequence's end
    features: np.ndarray  # f16[B, W, D]  the target's features (zero past the end)
    label_ok: np.ndarray  # bool[B, W]  the token may serve as a label (generated, or any with include_prompt)
    inputs: np.ndarray  # bool[B, T]  the position is in the window's loss region
    positions: np.ndarray  # i32[B, T]  positions in the sequence (rotary positions of the head)
    # f16[B, W, L*D]  the target's chosen decoder layers' outputs side by side (data made with feature_layers,
    # read by EAGLE-3 heads); None when the data has none
    layer_features: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """How sequences are cut into training windows."""

    seq_len: int  # T: positions a head reads per window
    context: int = 0  # leading positions that only feed attention
    lookahead: int = 1  # positions past the window that labels read (EAGLE 1, Medusa M + 1)
    include_prompt: bool = False  # loss also on prompt positions (labels that are prompt text)

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len!r} must be >= 2")
        if not 0 <= self.context < self.seq_len:
            raise ValueError(f"context={self.context!r} must be in [0, seq_len={self.seq_len})")
        if self.lookahead < 1:
            raise ValueError(f"lookahead={self.lookahead!r} must be >= 1")


def window_table(lengths: np.ndarray, prompt_lengths: np.ndarray, spec: WindowSpec) -> np.ndarray:
    """i64[N, 3]: (sequence, first position, first loss position relative to the window) of every window."""
    rows = []
    for seq, (length, prompt) in enumerate(zip(lengths.tolist(), prompt_lengths.tolist())):
        region = 0 if spec.include_prompt else max(prompt - 1, 0)  # first input position of the loss region
        start = max(0, region - spec.context)
        # An input position j needs the token at j + 1 at least, so the last useful input is length - 2.
        while region <= length - 2:
            rows.append((seq, start, region - start))
            region = start + spec.seq_len  # the next window's region begins where this one's ends
            start = region - spec.context
    return np.asarray(rows, np.int64).reshape(-1, 3)


class Batches:
    """The windows of `data`, as fixed-shape batches of `batch_size` in a deterministic, resumable order."""

    def __init__(self, data: SelfDistillData, spec: WindowSpec, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        self.data, self.spec, self.batch_size, self.seed = data, spec, batch_size, seed
        self.windows = window_table(data.lengths, data.prompt_lengths, spec)
        self._epoch_order: tuple[int, np.ndarray] | None = None

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (the windows left over change from epoch to epoch)."""
        return len(self.windows) // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """i64[N]: the window permutation of `epoch`."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.windows)))
        return self._epoch_order[1]

    def batch(self, step: int) -> Batch:
        """Training batch number `step` (0-based) of the whole run."""
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size={self.batch_size} exceeds the {self.num_windows} windows of the data")
        epoch, i = divmod(step, self.steps_per_epoch)
        return self.assemble(self.order(epoch)[i * self.batch_size: (i + 1) * self.batch_size])

    def from_step(self, step: int) -> Iterator[Batch]:
        """Batches `step`, `step + 1`, ... without end (resuming a run at its checkpointed step)."""
        while True:
            yield self.batch(step)
            step += 1

    def in_order(self) -> Iterator[Batch]:
        """Every window once, in data order (evaluation); the last batch is filled with empty windows."""
        for b in range(0, len(self.windows), self.batch_size):
            yield self.assemble(np.arange(b, min(b + self.batch_size, len(self.windows))))

    def assemble(self, window_ids: np.ndarray) -> Batch:
        """The Batch of the given windows i32[n], n <= batch_size; missing rows are empty windows."""
        spec, B = self.spec, self.batch_size
        T, W, D = spec.seq_len, spec.seq_len + spec.lookahead, self.data.hidden_size
        tokens = np.full((B, W), -1, np.int32)
        features = np.zeros((B, W, D), np.float16)
        label_ok = np.zeros((B, W), bool)
        inputs = np.zeros((B, T), bool)
        positions = np.zeros((B, T), np.int32)
        layers = len(self.data.feature_layers)
        layer_features = np.zeros((B, W, layers * D), np.float16) if layers else None
        for r, w in enumerate(window_ids):
            seq, start, loss_from = (int(x) for x in self.windows[w])
            seq_tokens, seq_features, generated = self.data.sequence(seq)
            n = min(W, len(seq_tokens) - start)
            tokens[r, :n] = seq_tokens[start: start + n]
            features[r, :n] = seq_features[start: start + n]
            if layer_features is not None:
                layer_features[r, :n] = self.data.layer_features(seq)[start: start + n]
            label_ok[r, :n] = True if spec.include_prompt else generated[start: start + n]
            inputs[r, loss_from:] = True
            positions[r] = start + np.arange(T)
        return Batch(tokens=tokens, features=features, label_ok=label_ok, inputs=inputs, positions=positions,
                     layer_features=layer_features)
