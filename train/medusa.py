"""Train Medusa heads of a target on its own self-distilled text: `python -m jaxspec.train.medusa`.

Head m maps the target's final hidden state at t to the logits of the token at t + 2 + m; see
`losses.medusa_loss` and `evaluate.medusa_counts`. The held-out rank table (`rank_probs`) goes into the
exported file's metadata, where generation builds its static candidate tree from it. `--help` lists every
option.

With the defaults a run for SmolLM2-135M fits in well under an hour on a small CPU: generating the
self-distilled data (once; the EAGLE trainer reuses it) takes about as long as training, evaluating a fraction
of either.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads import MedusaHeads

from . import cli
from .evaluate import medusa_counts, medusa_summary
from .losses import medusa_loss


@dataclasses.dataclass(frozen=True)
class MedusaTask:
    num_heads: int = 4  # M: tokens t + 2 .. t + M + 1
    decay: float = 0.8  # head m's loss weight is decay**m (the Medusa paper's 0.8)
    top_k: int = 4  # ranks scored per head at evaluation (rank_probs columns)

    kind = "medusa"
    method = "medusa"
    context = 0  # the heads read one position each: no attention context to provide

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads={self.num_heads!r} must be >= 1")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay={self.decay!r} must be in (0, 1]")
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k!r} must be >= 1")

    @property
    def lookahead(self) -> int:
        return self.num_heads + 1  # head M - 1 at the window's last position reads the token M + 1 later

    def feature_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        return ()  # the target's final hidden state only

    def new_head(self, cfg: ModelConfig, seed: int) -> MedusaHeads:
        return MedusaHeads(cfg, self.num_heads)  # zero-initialised: no randomness

    def loss(self, head, readout, batch, key):
        return medusa_loss(head, readout, batch, key, decay=self.decay)

    def eval_counts(self, head, readout, batch):
        return medusa_counts(head, readout, batch, top_k=self.top_k)

    def eval_summary(self, counts):
        return medusa_summary(counts)

    def settings(self) -> dict:
        """What training depends on (a resumed run must match it); evaluation settings may change."""
        return {"num_heads": self.num_heads, "decay": self.decay}


# 130 steps of 4 windows x 128 positions (4 heads: 2048 rows through the 49152-wide LM head, forward and
# backward): about 3.5 passes over the default data, as many minutes of training for SmolLM2-135M on a small CPU
# as the EAGLE trainer's default. lr 3e-3 beat 1e-3 in a short trial on held-out top-1 accuracy of every head.
DEFAULTS = dict(seq_len=128, batch_size=4, steps=130, lr=3e-3, warmup_steps=10, weight_decay=0.0, clip=1.0)


def add_options(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("Medusa heads")
    g.add_argument("--num-heads", type=cli.positive(int), default=MedusaTask.num_heads,
                   help="heads M; head m predicts the token m + 2 positions after the one the target's "
                        "feature belongs to (default: %(default)s)")
    g.add_argument("--decay", type=cli.in_range(float, 0.0, 1.0, low_open=True), default=MedusaTask.decay,
                   help="head m's loss is weighted decay**m, in (0, 1] (default: %(default)s, the Medusa paper's)")


def make_task(args: argparse.Namespace) -> MedusaTask:
    return MedusaTask(num_heads=args.num_heads, decay=args.decay, top_k=args.eval_k)


def main(argv: list[str] | None = None) -> int:
    return cli.main("medusa", argv, make_task=make_task, add_options=add_options, defaults=DEFAULTS,
                    description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
