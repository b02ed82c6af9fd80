"""Train the EAGLE head of a target on its own self-distilled features: `python -m jaxspec.train.eagle`.

The head reads (f_i, embedding of x_{i+1}) and predicts f_{i+1}; see `losses.eagle_loss` for the loss and
`evaluate.eagle_counts` for the held-out per-step accuracies. `--help` lists every option.

With the defaults a run for SmolLM2-135M fits in well under an hour on a small CPU: generating the
self-distilled data (once; the Medusa trainer reuses it) takes about as long as training, evaluating a fraction
of either.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads import HEAD_ARCHITECTURES, EagleHead, new_head

from . import cli
from .evaluate import eagle_counts, eagle_summary
from .losses import eagle_loss


@dataclasses.dataclass(frozen=True)
class EagleTask:
    w_cls: float = 0.1  # weight of the token (classification) loss, as in the EAGLE paper
    noise: float = 0.1  # U(-noise, noise) added to the input features during training
    context: int = 16  # window positions before the loss region (attention context)
    unroll: int = 1  # drafting steps trained per position (>1: from the head's own features, see eagle_loss)
    unroll_decay: float = 1.0  # weight of step s's loss: unroll_decay ** (s - 1)
    eval_depth: int = 4  # drafting steps scored at evaluation
    architecture: str = "jaxspec"  # the head's: jaxspec's own, or "reference", the EAGLE authors' (HEAD_ARCHITECTURES)

    kind = "eagle"
    method = "eagle"
    lookahead = 1  # pair j's label is the feature at j + 1

    def __post_init__(self):
        if not self.w_cls >= 0:
            raise ValueError(f"w_cls={self.w_cls!r} must be >= 0")
        if not self.noise >= 0:
            raise ValueError(f"noise={self.noise!r} must be >= 0")
        if self.context < 0:
            raise ValueError(f"context={self.context!r} must be >= 0")
        if self.unroll < 1:
            raise ValueError(f"unroll={self.unroll!r} must be >= 1")
        if not self.unroll_decay > 0:
            raise ValueError(f"unroll_decay={self.unroll_decay!r} must be > 0")
        if self.eval_depth < 1:
            raise ValueError(f"eval_depth={self.eval_depth!r} must be >= 1")
        if self.architecture not in HEAD_ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} must be one of {HEAD_ARCHITECTURES}")

    def feature_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        return ()  # the target's final hidden state only

    def new_head(self, cfg: ModelConfig, seed: int) -> EagleHead:
        return new_head(self.kind, cfg, seed=seed, feature_layers=self.feature_layers(cfg) or None,
                        architecture=self.architecture)

    def loss(self, head, readout, batch, key):
        return eagle_loss(head, readout, batch, key, w_cls=self.w_cls, noise=self.noise, unroll=self.unroll,
                          unroll_decay=self.unroll_decay)

    def eval_counts(self, head, readout, batch):
        return eagle_counts(head, readout, batch, depth=self.eval_depth)

    def eval_summary(self, counts):
        return eagle_summary(counts, self.eval_depth)

    def settings(self) -> dict:
        """What training depends on (a resumed run must match it); evaluation settings may change."""
        return {"w_cls": self.w_cls, "noise": self.noise, "context": self.context, "unroll": self.unroll,
                "unroll_decay": self.unroll_decay, "architecture": self.architecture}


# 200 steps of 4 windows x 144 positions: about 5 passes over the default data, minutes of training for
# SmolLM2-135M on a small CPU. lr 1e-3 beat 3e-3 in a short trial on held-out step-1 accuracy.
DEFAULTS = dict(seq_len=144, batch_size=4, steps=200, lr=1e-3, warmup_steps=20, weight_decay=0.0, clip=0.5)


def add_options(parser: argparse.ArgumentParser, defaults: EagleTask = EagleTask()):
    g = parser.add_argument_group("EAGLE head")
    g.add_argument("--w-cls", type=cli.nonnegative(float), default=defaults.w_cls,
                   help="weight of the token loss (soft-label cross-entropy against the target's next-token "
                        "distribution) added to the SmoothL1 feature loss (default: %(default)s, the EAGLE paper's)")
    g.add_argument("--noise", type=cli.nonnegative(float), default=defaults.noise,
                   help="half-width of the uniform noise U(-noise, noise) added to the input features while "
                        "training, so the head copes with its own imperfect features when drafting; 0 disables "
                        "(default: %(default)s; the features are RMS-normed, elements of order 1)")
    g.add_argument("--context", type=cli.nonnegative(int), default=defaults.context,
                   help="positions at the start of each window that only serve as attention context (they "
                        "precede the window's loss region); must be below --seq-len (default: %(default)s)")
    g.add_argument("--unroll", type=cli.positive(int), default=defaults.unroll,
                   help="drafting steps trained at every position: 1 trains on the target's features only "
                        "(EAGLE-1/2); N > 1 also runs steps 2..N from the head's own predicted features, as "
                        "drafting does (HASS, EAGLE-3's training-time test), at about N times the cost of a "
                        "step (default: %(default)s)")
    g.add_argument("--unroll-decay", type=cli.positive(float), default=defaults.unroll_decay,
                   help="weight of drafting step s's loss is DECAY ** (s - 1) (default: %(default)s)")
    g.add_argument("--architecture", choices=HEAD_ARCHITECTURES, default=defaults.architecture,
                   help="jaxspec: this project's head; reference: the EAGLE authors' drafter, which `python -m "
                        "jaxspec.train.export_eagle` writes in the layout vLLM and SGLang load (default: "
                        "%(default)s)")


def make_task(args: argparse.Namespace, task_class: type[EagleTask] = EagleTask) -> EagleTask:
    """The task of the parsed options (`task_class`: EagleTask, or a variant with the same options)."""
    return task_class(w_cls=args.w_cls, noise=args.noise, context=args.context, unroll=args.unroll,
                      unroll_decay=args.unroll_decay, eval_depth=args.eval_k, architecture=args.architecture)


def main(argv: list[str] | None = None) -> int:
    return cli.main("eagle", argv, make_task=make_task, add_options=add_options, defaults=DEFAULTS,
                    description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
