"""Train an EAGLE-3 head of a target on its own self-distilled text: `python -m jaxspec.train.eagle3`.

What differs from `jaxspec.train.eagle` (EAGLE-1/2), after the EAGLE-3 paper:
- the head reads the fusion of three of the target's layers (low, middle, high: `eagle3_layers`), so the data
  records those layers' outputs too (a data directory of its own, `<model>-selfdistill-layers`);
- it is trained only to predict tokens (w_reg 0: its output need not match any target feature), from its own
  outputs for drafting steps 2..N as well ("training-time test", `--unroll`, default 3);
- the prompts include chat requests (`--chat-prompts`, rendered with the model's chat template) beside code,
  so chat prompts are not out of its distribution.

`--help` lists every option. With the defaults, for SmolLM2-135M on a small CPU, generating the data (once)
takes the better part of an hour and each step seconds (docs/how-to/training-heads.md gives the shipped head's
commands and times).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads import eagle3_layers

from . import cli
from .eagle import EagleTask
from .eagle import add_options as add_eagle_options
from .eagle import make_task as make_eagle_task
from .losses import eagle_loss


@dataclasses.dataclass(frozen=True)
class Eagle3Task(EagleTask):
    w_cls: float = 1.0  # the token loss is the only loss
    noise: float = 0.0  # the training-time test shows the head its own features; no noise is needed
    unroll: int = 3  # drafting steps trained per position
    w_reg: float = 0.0  # no feature regression

    kind = "eagle3"
    method = "eagle3"

    def feature_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        return eagle3_layers(cfg.num_layers)

    def loss(self, head, readout, batch, key):
        return eagle_loss(head, readout, batch, key, w_cls=self.w_cls, w_reg=self.w_reg, noise=self.noise,
                          unroll=self.unroll, unroll_decay=self.unroll_decay)

    def settings(self) -> dict:
        return {**super().settings(), "w_reg": self.w_reg}


# 4 windows x 144 positions per step as for EAGLE; each unrolled step costs about one more head pass.
DEFAULTS = dict(seq_len=144, batch_size=4, steps=600, lr=1e-3, warmup_steps=30, weight_decay=0.0, clip=0.5,
                stdlib_prompts=300, chat_prompts=240)


def add_options(parser: argparse.ArgumentParser):
    add_eagle_options(parser, defaults=Eagle3Task())


def make_task(args: argparse.Namespace) -> Eagle3Task:
    return make_eagle_task(args, Eagle3Task)


def main(argv: list[str] | None = None) -> int:
    return cli.main("eagle3", argv, make_task=make_task, add_options=add_options, defaults=DEFAULTS,
                    description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
