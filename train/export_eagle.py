"""Write an EAGLE, EAGLE-3 or DFlash drafter trained here in the layout vLLM and SGLang load:
`python -m jaxspec.train.export_eagle`.

The head must be of the EAGLE authors' architecture (`python -m jaxspec.train.eagle3 --architecture reference`, or
`jaxspec.train.eagle`): jaxspec's own heads have no counterpart there. An EAGLE-3 drafter shares the target's LM
head while it trains; the export writes a copy of it, over the `--draft-vocab` N most frequent target tokens (the
ranking beside the head or shipped for the model, as `SpecConfig(draft_vocab=N)` uses) or the whole vocabulary,
with the matching draft-to-target map. An EAGLE-1 drafter is scored by the target's LM head wherever it runs, and
so is a DFlash drafter (`python -m jaxspec.train.dflash`), whose layout has no draft vocabulary: one trained over
N ids is scored over the whole vocabulary by the servers that load it. The directory loads back with
`SpecConfig(method="eagle3", "eagle" or "dflash", head_path=DIR)`.

    python -m jaxspec.train.export_eagle --model smollm2-135m --head runs/eagle3/head.safetensors \\
        --out exported/smollm2-eagle3 --draft-vocab 4096
"""

from __future__ import annotations

import sys
from typing import Sequence

from . import cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.model_file_parser("python -m jaxspec.train.export_eagle", __doc__,
                                   "the directory to write (config.json and model.safetensors)")
    parser.add_argument("--head", required=True, help="the head file a reference-architecture run saved")
    parser.add_argument("--draft-vocab", type=cli.positive(int), default=None,
                        help="an EAGLE-3 drafter's draft vocabulary size N (default: the target's whole vocabulary)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="bfloat16",
                        help="the weights' dtype in the file (default: %(default)s, what the servers load)")
    args = parser.parse_args(argv)

    from jaxspec.models.dflash import DFlashDrafter
    from jaxspec.models.eagle_files import save_reference_dflash, save_reference_eagle, save_reference_eagle3
    from jaxspec.models.heads import (
        Readout,
        ReferenceEagle3Head,
        ReferenceEagleHead,
        draft_vocab_path,
        load_draft_vocab,
        load_head,
    )
    from jaxspec.models.loading import load_model

    try:
        lm = load_model(args.model)
        head, _ = load_head(args.head, lm.config)
        if isinstance(head, (ReferenceEagleHead, DFlashDrafter)):
            if args.draft_vocab is not None:
                raise ValueError("--draft-vocab applies to EAGLE-3 drafters; EAGLE and DFlash ones are scored by "
                                 "the target's LM head")
            out = (save_reference_eagle(args.out, head, dtype=args.dtype) if isinstance(head, ReferenceEagleHead)
                   else save_reference_dflash(args.out, head, lm.config, dtype=args.dtype))
            print(f"wrote {out}")
            return 0
        if not isinstance(head, ReferenceEagle3Head):
            raise ValueError(f"--head {args.head!r} is not a DFlash drafter, nor an EAGLE or EAGLE-3 head of the "
                             f"reference architecture (train one with `python -m jaxspec.train.eagle3 "
                             f"--architecture reference`)")
        readout = Readout.of(lm.params)
        if args.draft_vocab is not None and args.draft_vocab != lm.config.vocab_size:
            if args.draft_vocab > lm.config.vocab_size:
                raise ValueError(f"--draft-vocab {args.draft_vocab} exceeds the target's {lm.config.vocab_size} "
                                 f"tokens")
            ranking = load_draft_vocab(draft_vocab_path(args.head, lm.name), lm.config.vocab_size)
            readout = readout.restrict(ranking[: args.draft_vocab])
        out = save_reference_eagle3(args.out, head, readout, dtype=args.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
