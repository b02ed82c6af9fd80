"""Train a DFlash block drafter of a target on its own self-distilled text: `python -m jaxspec.train.dflash`.

The drafter (`jaxspec.models.dflash.DFlashDrafter`) reads the same three target layers an EAGLE-3 head fuses, so it
trains on the same data directory (`<model>-selfdistill-layers`: HumanEval's training split, standard-library
functions and chat requests, answered by the target; the held-out quarter of HumanEval is never asked). Each step
draws `--anchors` random positions of every window's loss region and trains the block anchored at each: the anchor's
token and block_size - 1 masks, seeing the window's context before the anchor, each position against the target's
distribution of the token there (`losses.dflash_loss`).

Drafting scores the shipped draft vocabulary (`--draft-vocab`, the 4096 most frequent target tokens by default), so
training scores the same N columns: that is what the drafter's drafts are chosen from, and it makes a step several
times cheaper than scoring the whole 49,152-token vocabulary at every block position. The exported head records N,
and generation drafts over it.

`--help` lists every option; docs/how-to/training-heads.md gives the shipped drafter's command and times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.dflash import DFLASH_BLOCK, DFlashDrafter
from jaxspec.models.heads import DRAFT_VOCAB_SUFFIX, WEIGHTS_DIR, eagle3_layers, load_draft_vocab, new_head

from . import cli
from .evaluate import dflash_counts, eagle_summary
from .losses import dflash_loss


@dataclasses.dataclass(frozen=True)
class DFlashTask:
    num_layers: int = 3  # drafter decoder layers
    block_size: int = DFLASH_BLOCK  # the anchor and block_size - 1 masks: K = block_size - 1 drafts per step
    anchors: int = 16  # blocks trained per window
    gamma: float = 7.0  # block position i's loss weight is exp(-(i - 1) / gamma) (the DFlash paper's, for 16)
    context: int = 16  # window positions before the loss region (context of its first anchors)
    eval_stride: int = 4  # held-out blocks are anchored at every eval_stride-th window position
    draft_ids: tuple[int, ...] = ()  # the draft vocabulary trained and drafted over; () the whole vocabulary

    kind = "dflash"
    method = "dflash"

    def __post_init__(self):
        for name in ("num_layers", "anchors", "eval_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size!r} must be >= 2")
        if not self.gamma > 0:
            raise ValueError(f"gamma={self.gamma!r} must be > 0")
        if self.context < 0:
            raise ValueError(f"context={self.context!r} must be >= 0")

    @property
    def lookahead(self) -> int:
        return self.block_size  # the last anchor's last label lies block_size - 1 positions past the window

    def feature_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        return eagle3_layers(cfg.num_layers)

    def new_head(self, cfg: ModelConfig, seed: int) -> DFlashDrafter:
        return new_head("dflash", cfg, seed=seed, feature_layers=self.feature_layers(cfg),
                        num_layers=self.num_layers, block_size=self.block_size)

    def _drafting(self, readout):
        return readout.restrict(jnp.asarray(self.draft_ids, jnp.int32)) if self.draft_ids else readout

    def loss(self, head, readout, batch, key):
        return dflash_loss(head, self._drafting(readout), batch, key, anchors=self.anchors, gamma=self.gamma)

    def eval_counts(self, head, readout, batch):
        return dflash_counts(head, readout, self._drafting(readout), batch, stride=self.eval_stride)

    def eval_summary(self, counts):
        return eagle_summary(counts, self.block_size - 1)

    def settings(self) -> dict:
        """What training depends on (a resumed run must match it); evaluation settings may change."""
        return {"num_layers": self.num_layers, "block_size": self.block_size, "anchors": self.anchors,
                "gamma": self.gamma, "context": self.context, "draft_vocab": len(self.draft_ids) or None}


# 4 windows x 144 positions x 16 blocks per step (0.6 s on 2 cores): 3000 steps are 8 passes over the windows, each
# pass anchoring new blocks; lr as for the EAGLE-3 head.
DEFAULTS = dict(seq_len=144, batch_size=4, steps=3000, lr=1e-3, warmup_steps=60, weight_decay=0.0, clip=0.5,
                stdlib_prompts=300, chat_prompts=240)


def add_options(parser: argparse.ArgumentParser):
    d = DFlashTask()
    g = parser.add_argument_group("DFlash drafter")
    g.add_argument("--num-layers", type=cli.positive(int), default=d.num_layers,
                   help="drafter decoder layers (default: %(default)s)")
    g.add_argument("--block-size", type=cli.in_range(int, 2, 64), default=d.block_size,
                   help="block the drafter predicts: the newest token and BLOCK_SIZE - 1 masks, so up to "
                        "BLOCK_SIZE - 1 drafts a step (default: %(default)s)")
    g.add_argument("--anchors", type=cli.positive(int), default=d.anchors,
                   help="blocks trained per window, at random positions of its loss region (default: %(default)s)")
    g.add_argument("--gamma", type=cli.positive(float), default=d.gamma,
                   help="block position i's loss weight is exp(-(i - 1) / GAMMA) (default: %(default)s)")
    g.add_argument("--context", type=cli.nonnegative(int), default=d.context,
                   help="positions at the start of each window that only serve as context (default: %(default)s)")
    g.add_argument("--draft-vocab", type=cli.nonnegative(int), default=4096,
                   help="train and draft over the N most frequent target tokens of the model's shipped ranking "
                        "(models/weights/<model>.draft_vocab.json); 0 scores the whole vocabulary "
                        "(default: %(default)s)")


def draft_ids(model: str, n: int) -> tuple[int, ...]:
    """The first `n` ids of the draft-vocabulary ranking shipped for the named `model` (() for n = 0); ValueError
    naming the file when there is none or it ranks fewer."""
    if n == 0:
        return ()
    path = WEIGHTS_DIR / f"{model}{DRAFT_VOCAB_SUFFIX}"
    if not path.exists():
        raise ValueError(f"--draft-vocab {n} needs a token ranking at {str(path)!r}; write one with `python -m "
                         f"jaxspec.train.draft_vocab --model {model}`, or pass --draft-vocab 0")
    ids = load_draft_vocab(path, json.loads(path.read_text())["vocab_size"])
    if n > len(ids):
        raise ValueError(f"--draft-vocab {n} exceeds the {len(ids)} ids ranked in {str(path)!r}")
    return tuple(int(i) for i in ids[:n])


def make_task(args: argparse.Namespace) -> DFlashTask:
    return DFlashTask(num_layers=args.num_layers, block_size=args.block_size, anchors=args.anchors, gamma=args.gamma,
                      context=args.context, draft_ids=draft_ids(str(args.model), args.draft_vocab))


def main(argv: list[str] | None = None) -> int:
    return cli.main("dflash", argv, make_task=make_task, add_options=add_options, defaults=DEFAULTS,
                    description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
