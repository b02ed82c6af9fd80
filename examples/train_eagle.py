#!/usr/bin/env python
"""Train an EAGLE head from Python, save it, and decode with it: `jaxspec.train` without the command line.

    python examples/train_eagle.py                       # 8 prompts, 40 steps: a few minutes on 2 cores
    python examples/train_eagle.py --prompts 4 --gen-tokens 32 --steps 10 --out /tmp/eagle-example

The pieces `python -m jaxspec.train.eagle` wires together (train/cli.py), called one by one:

1. `ensure_dataset`: the target continues HumanEval training prompts greedily and records its hidden state
   at every token (self-distillation); the directory is reused when model, prompts and settings match;
2. `WindowSpec` + `Batches`: fixed-shape training windows in a resumable order;
3. `train(EagleTask(...), ...)`: AdamW on the head, orbax checkpoints under `--out`/run;
4. `evaluate_head`: the head's per-step accuracy on held-out prompts (HumanEval/0, /4, /8, ...);
5. `save_head`, then `jaxspec.generate(..., spec=SpecConfig(method="eagle", head_path=...))` on held-out
   prompts, greedily, beside plain decoding: the texts must be identical (exit status 1 if not), whatever the
   head learned. The head shipped with the package (trained 1500 steps on 523 prompts) is run too, to show
   what longer training buys.

A head trained this briefly drafts poorly; the point is the path from data to a head file that generation
loads. `python -m jaxspec.train.eagle --help` has settings that train a useful one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jaxspec
from jaxspec.models.heads import Readout, save_head
from jaxspec.train import (
    Batches,
    EagleTask,
    GenerationSettings,
    TrainConfig,
    WindowSpec,
    ensure_dataset,
    evaluate_head,
    humaneval_split,
    train,
)


def train_and_generate(lm: jaxspec.LanguageModel, train_prompts: list, held_out: list, out: Path, *,
                       gen_tokens: int, steps: int, batch_size: int, seq_len: int, lr: float,
                       max_new_tokens: int, compare_shipped: bool = False, progress: bool = True) -> dict:
    """Data -> training -> evaluation -> head file -> speculative generation. Prompts are strings or token ids.

    Returns what the run measured: losses, held-out accuracy, the head's path and acceptance, and whether the
    speculative tokens equal the plain ones.
    """
    # gen_batch: every generate call runs this many rows (a short batch is padded with copies), so the
    # held-out data reuses the programs the training data compiled.
    settings = GenerationSettings(gen_tokens=gen_tokens, gen_batch=min(8, len(train_prompts)))
    # ensure_dataset reuses a directory made with the same prompts and settings and refuses one made otherwise:
    # one directory per setting, so a rerun reuses its data and a changed flag gets new data.
    data_dir = out / "data" / f"{len(train_prompts)}-prompts-{len(held_out)}-held-out-{gen_tokens}-tokens"
    data = ensure_dataset(lm, train_prompts, data_dir / "train", sources={"train": len(train_prompts)},
                          settings=settings, progress=progress)
    held_data = ensure_dataset(lm, held_out, data_dir / "heldout", sources={"heldout": len(held_out)},
                               settings=settings, progress=progress)
    print(f"data: {data.summary()['sequences']} sequences, {data.summary()['generated']} generated tokens "
          f"(held out: {held_data.summary()['sequences']} sequences)")

    # context: window positions that only feed the head's attention (its KV over earlier tokens); the loss
    # region follows. include_prompt also trains on prompt text: more labels from few prompts.
    task = EagleTask(context=min(16, seq_len // 4))
    config = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                         warmup_steps=max(1, steps // 10), save_every=steps, include_prompt=True)
    windows = WindowSpec(seq_len=config.seq_len, context=task.context, lookahead=task.lookahead,
                         include_prompt=config.include_prompt)
    batches = Batches(data, windows, config.batch_size, seed=config.seed)
    if batches.steps_per_epoch == 0:
        raise ValueError(f"batch_size={batch_size} exceeds the {batches.num_windows} training windows; "
                         "use more prompts or a smaller batch")
    readout = Readout.of(lm.params)  # the target's embedding and LM head, shared by the head (not copied)
    # run_identity: a checkpoint is resumed only by a run of the same model, data and settings. restart=True
    # trains from scratch each time (without it, a finished run would resume at its last step and do nothing).
    result = train(task, lm.config, readout, batches, config, out / "run", restart=True, progress=progress,
                   run_identity={"model": lm.name, "data": data.manifest["key"]})
    losses = [h["loss"] for h in result.history]
    print(f"trained {result.step} steps on {batches.num_windows} windows: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    evaluation = evaluate_head(task, result.head, readout,
                               Batches(held_data, dataclasses.replace(windows, include_prompt=False), batch_size))
    print(f"held-out step accuracy (drafting steps 1..{task.eval_depth}): {evaluation['step_accuracy']}")

    # The file generation loads: head.safetensors (float16) + head.json (what it is and how it was trained).
    path = save_head(out / "head", result.head, kind="eagle",
                     metadata={"model": lm.name, "steps": result.step, "train": config.identity(), "eval": evaluation})
    print(f"saved {path}")

    greedy = jaxspec.SamplingParams(temperature=0.0)
    plain = jaxspec.generate(lm, held_out, max_new_tokens=max_new_tokens, sampling=greedy)
    heads = {"trained here": str(path)} | ({"shipped": None} if compare_shipped else {})
    runs = {}
    for label, head_path in heads.items():
        out_spec = jaxspec.generate(lm, held_out, max_new_tokens=max_new_tokens, sampling=greedy,
                                    spec=jaxspec.SpecConfig(method="eagle", head_path=head_path))
        s = out_spec.stats
        runs[label] = {"identical": out_spec.token_ids == plain.token_ids, "drafted": s.drafted,
                       "accepted": s.accepted, "steps": s.steps, "mean_acceptance_length": s.mean_acceptance_length}
        print(f"eagle, head {label}: {s.steps} steps (plain {plain.stats.steps}), {s.drafted} drafted, "
              f"{s.accepted} accepted, mean acceptance length {s.mean_acceptance_length:.2f}; "
              f"identical to plain: {runs[label]['identical']}")
    return {"losses": losses, "eval": evaluation, "head_path": str(path), "runs": runs,
            "identical": all(r["identical"] for r in runs.values())}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--out", default="checkpoints/example-eagle",
                        help="data, checkpoints and the head file (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="HumanEval training prompts (default: %(default)s)")
    parser.add_argument("--held-out", type=int, default=2,
                        help="held-out HumanEval prompts for evaluation and decoding (default: %(default)s)")
    parser.add_argument("--gen-tokens", type=int, default=64,
                        help="tokens the target generates per prompt for the data (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="positions per window (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--no-shipped", action="store_true", help="skip decoding with the shipped head")
    args = parser.parse_args(argv)

    lm = jaxspec.load_model(args.model)
    train_prompts, held_out = humaneval_split()  # held out: HumanEval/0, /4, /8, ...
    result = train_and_generate(lm, train_prompts[: args.prompts], held_out[: args.held_out], Path(args.out),
                                gen_tokens=args.gen_tokens, steps=args.steps, batch_size=args.batch_size,
                                seq_len=args.seq_len, lr=args.lr, max_new_tokens=args.max_new_tokens,
                                compare_shipped=not args.no_shipped and args.model == jaxspec.DEFAULT_MODEL,
                                progress=False)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["identical"] else 1)

