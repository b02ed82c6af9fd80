"""The command line both trainers share: options, then data -> train -> evaluate -> export (-> ship).

    python -m jaxspec.train.eagle            # generate (or reuse) the data, train, evaluate, export
    python -m jaxspec.train.medusa --ship    # ... and copy the head to models/weights/ for generation to find

Both default to the same data directory: whichever runs first generates the self-distilled data (train and
held-out) and the other reuses it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

from .loop import HeadTask, TrainConfig

HELD_OUT_DIR, TRAIN_DIR = "heldout", "train"


# ----------------------------------------------------------------------------------------- argument types

def model_file_parser(prog: str, description: str | None, out_help: str) -> argparse.ArgumentParser:
    """The parser of a command that writes one file for a target model: --model and --out (draft_vocab,
    sam_corpus)."""
    from jaxspec.models.loading import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a named model, a .gguf file or a Hugging Face directory (default: %(default)s)")
    parser.add_argument("--out", required=True, help=out_help)
    return parser


def _typed(kind, ok: Callable, rule: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def positive(kind):
    return _typed(kind, lambda v: v > 0, "> 0")


def nonnegative(kind):
    return _typed(kind, lambda v: v >= 0, ">= 0")


def in_range(kind, low, high, *, low_open=False):
    return _typed(kind, lambda v: (low < v if low_open else low <= v) and v <= high,
                  f"in {'(' if low_open else '['}{low}, {high}]")


# ---------------------------------------------------------------------------------------------- parser

def build_parser(kind: str, *, defaults: dict, add_options: Callable, description: str) -> argparse.ArgumentParser:
    from jaxspec.models.loading import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog=f"python -m jaxspec.train.{kind}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and files")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="target model: a named model, a .gguf file or a Hugging Face directory (default: %(default)s)")
    g.add_argument("--out", default=None,
                   help=f"run directory: checkpoints/, train_log.jsonl and the exported head (head.safetensors + "
                        f"head.json); training resumes from its latest checkpoint "
                        f"(default: checkpoints/<model>-{kind})")
    g.add_argument("--data", default=None,
                   help="self-distillation data directory, shared by the trainers: train/ and heldout/ are "
                        "generated on first use and reused while model, prompts and generation settings match "
                        "(default: checkpoints/data/<model>-selfdistill, or <model>-selfdistill-layers for heads "
                        "that read several layers' features (eagle3))")
    g.add_argument("--ship", action="store_true",
                   help=f"also export the head to models/weights/<model>.{kind}.safetensors, where generation "
                        f"finds it by model name")

    g = p.add_argument_group("self-distillation data (changing these needs a new --data directory)")
    g.add_argument("--stdlib-prompts", type=nonnegative(int), default=defaults.get("stdlib_prompts", 24),
                   help="documented functions of the installed standard library added to the 123 training "
                        "prompts of HumanEval as completion prompts (default: %(default)s)")
    g.add_argument("--chat-prompts", type=nonnegative(int), default=defaults.get("chat_prompts", 0),
                   help="chat requests (rendered with the model's chat template) about HumanEval training prompts, "
                        "then standard-library functions, added to the prompts, so the head learns the target's "
                        "chat answers too (default: %(default)s)")
    g.add_argument("--gen-tokens", type=positive(int), default=128,
                   help="tokens the target generates per prompt (fewer where it stops at EOS) (default: %(default)s)")
    g.add_argument("--temperature", type=nonnegative(float), default=0.0,
                   help="sampling temperature of the target's continuations; 0 is greedy; sampled rows use "
                        "fixed per-prompt seeds, so the data is reproducible (default: %(default)s)")

    g.add_argument("--gen-batch", type=positive(int), default=16,
                   help="prompts per generation call, grouped by length; 16 decodes faster than 8 on a "
                        "CPU (default: %(default)s)")

    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=in_range(int, 2, 1 << 20), default=defaults["seq_len"],
                   help="positions per training window (default: %(default)s)")
    g.add_argument("--batch-size", type=positive(int), default=defaults["batch_size"],
                   help="windows per optimizer step (default: %(default)s)")
    steps = g.add_mutually_exclusive_group()
    steps.add_argument("--steps", type=positive(int), default=None,
                       help=f"optimizer steps of the whole run; the learning-rate schedule spans them, so a "
                            f"finished run is extended with --restart, not resumed (default: {defaults['steps']})")
    steps.add_argument("--epochs", type=positive(float), default=None,
                       help="train for this many passes over the training windows instead of --steps")
    g.add_argument("--lr", type=positive(float), default=defaults["lr"],
                   help="peak learning rate of AdamW (b1 0.9, b2 0.95) (default: %(default)s)")
    g.add_argument("--warmup-steps", type=nonnegative(int), default=defaults["warmup_steps"],
                   help="linear warm-up steps from 0 to --lr, then cosine decay to 0; must be below the "
                        "number of steps (default: %(default)s)")
    g.add_argument("--weight-decay", type=nonnegative(float), default=defaults["weight_decay"],
                   help="AdamW weight decay of the weight matrices (not biases or norm scales) (default: %(default)s)")
    g.add_argument("--clip", type=positive(float), default=defaults["clip"],
                   help="clip gradients to this global norm (default: %(default)s)")
    g.add_argument("--init-from", default=None, metavar="HEAD",
                   help="start from this exported head (a head.safetensors of an earlier run, or a shipped one in "
                        "models/weights/) instead of a random initialisation: a finished run continued with a new "
                        "learning-rate schedule over --steps, or a head fine-tuned on other data; it must be a head "
                        "of this kind for this model (default: random initialisation)")
    g.add_argument("--include-prompt", action="store_true",
                   help="also train on positions whose labels are prompt text (default: generated tokens only)")
    g.add_argument("--seed", type=nonnegative(int), default=0,
                   help="seed of the head's initialisation, the window order and the training noise "
                        "(default: %(default)s)")
    g.add_argument("--data-parallel", type=positive(int), default=1, metavar="N",
                   help="split each batch over N devices, gradients added over them (default: %(default)s; on CPU "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=positive(int), default=50,
                   help="save a checkpoint every N steps; the last step is always saved (default: %(default)s)")
    g.add_argument("--keep", type=positive(int), default=2, help="checkpoints kept (default: %(default)s)")
    g.add_argument("--restart", action="store_true",
                   help="delete the checkpoints in --out and train from scratch (default: resume from the latest)")

    g = p.add_argument_group("evaluation (on the held-out HumanEval quarter: HumanEval/0, /4, /8, ...)")
    g.add_argument("--eval-only", action="store_true",
                   help="skip training: evaluate the latest checkpoint in --out (or its exported head) and "
                        "re-export it with the new numbers")
    g.add_argument("--eval-k", type=positive(int), default=4,
                   help="EAGLE: drafting steps scored (step 1 from the target's features, later steps from the "
                        "head's own); Medusa: ranks scored per head (top-1 .. top-k) (default: %(default)s)")
    g.add_argument("--accept-prompts", type=nonnegative(int), default=8,
                   help="held-out prompts decoded speculatively with the exported head to measure the real mean "
                        "acceptance length; 0 skips it (default: %(default)s)")
    g.add_argument("--accept-tokens", type=positive(int), default=64,
                   help="new tokens per prompt in that measurement (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    add_options(p)
    return p


# ---------------------------------------------------------------------------------------------- pipeline

def main(kind: str, argv: list[str] | None, *, make_task: Callable, add_options: Callable, defaults: dict,
         description: str) -> int:
    parser = build_parser(kind, defaults=defaults, add_options=add_options, description=description)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    from jaxspec.models.loading import NAMED_MODELS

    if args.ship and args.model not in NAMED_MODELS:
        parser.error(f"--ship needs a named model ({', '.join(NAMED_MODELS)}): generation finds shipped heads by "
                     f"model name, and --model {args.model!r} is a path")
    try:
        task = make_task(args)
        if task.context >= args.seq_len:
            raise ValueError(f"context={task.context} must be below seq_len={args.seq_len}")
        # --epochs is turned into steps once the data is known; validate the rest with a placeholder.
        config = _config(args, defaults, steps=args.steps or defaults["steps"])
        data_parallel_mesh(args.data_parallel, config.batch_size)  # before minutes of loading and generating
    except ValueError as e:
        parser.error(str(e))
    _enable_compilation_cache()
    return run(kind, args, task, config, command=f"python -m jaxspec.train.{kind} {shlex.join(argv)}".strip(),
               defaults=defaults, parser=parser)


def _config(args, defaults: dict, steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                       warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, clip=args.clip,
                       save_every=args.save_every, keep=args.keep, seed=args.seed,
                       include_prompt=args.include_prompt)


def data_parallel_mesh(n: int, batch_size: int):
    """The mesh of `--data-parallel n`: `make_mesh(data=n, model=1)` (pure data parallelism), or None for n = 1
    (the single-device program). ValueError naming n and the devices there are when there are fewer than n, and
    naming the data axis and the batch size when n does not divide it."""
    if n == 1:
        return None
    import jax

    from jaxspec.sharding import make_mesh

    from .loop import check_data_parallel

    have = len(jax.devices())
    if n > have:
        raise ValueError(f"--data-parallel {n} needs {n} devices; there are {have} ({jax.default_backend()}); "
                         f"on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} in the environment "
                         f"(set before jax starts) makes {n} host devices")
    mesh = make_mesh(data=n, model=1)
    check_data_parallel(mesh, batch_size)
    return mesh


def _enable_compilation_cache():
    # The target's generation and forward programs compile slowly; later runs reuse them from disk.
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def run(kind: str, args, task: HeadTask, config: TrainConfig, *, command: str, defaults: dict, parser) -> int:
    import jaxspec
    from jaxspec.models.heads import Readout

    from .data import GenerationSettings
    from .prompts import humaneval_split

    lm = jaxspec.load_model(args.model)
    model = Path(str(args.model)).stem if Path(str(args.model)).exists() else str(args.model)
    out = Path(args.out or f"checkpoints/{model}-{kind}")
    layers = task.feature_layers(lm.config)
    data_dir = Path(args.data or f"checkpoints/data/{model}-selfdistill{'-layers' if layers else ''}")
    settings = GenerationSettings(gen_tokens=args.gen_tokens, temperature=args.temperature, gen_batch=args.gen_batch,
                                  feature_layers=layers)
    train_prompts, held_out = humaneval_split()
    readout = Readout.of(lm.params)

    held_data = _dataset(lm, held_out, data_dir / HELD_OUT_DIR, {"humaneval-heldout": len(held_out)}, settings,
                         args, parser)
    if args.eval_only:
        head, step, metadata = _load_trained(kind, task, lm, config, out, parser)
        metadata["eval_command"] = command
    else:
        head, step, metadata, config = _train(lm, task, readout, train_prompts, data_dir, settings, config, out,
                                              args, defaults, parser)
        metadata["command"] = command
    _evaluate_and_export(kind, lm, task, head, step, metadata, readout, held_data, held_out, config, out, args)
    return 0


def _dataset(lm, prompts, directory: Path, sources: dict, settings, args, parser):
    from .data import ensure_dataset

    try:
        return ensure_dataset(lm, prompts, directory, sources=sources, settings=settings,
                              progress=not args.no_progress)
    except ValueError as e:  # a directory made with other settings is the user's to resolve, not a crash
        parser.error(str(e))


def _load_trained(kind: str, task: HeadTask, lm, config: TrainConfig, out: Path, parser):
    """--eval-only: (head, step, metadata) from the latest checkpoint in `out`, else from its exported head."""
    from jaxspec.models.heads import load_head

    from .loop import load_checkpointed_head

    previous = out / "head.json"
    metadata = json.loads(previous.read_text()) if previous.exists() else {}  # keep what it says about training
    metadata.pop("acceptance", None)  # measured again, or not at all, for this head
    found = load_checkpointed_head(task, lm.config, config, out)
    if found is not None:
        head, step, meta = found
        metadata["train"] = meta["identity"]["config"]
    elif (out / "head.safetensors").exists():
        head, _ = load_head(out / "head.safetensors", lm.config)
        step = metadata.get("steps")
    else:
        parser.error(f"--eval-only: {str(out)!r} has neither checkpoints nor an exported head.safetensors")
    print(f"evaluating the {kind} head of step {step} from {out}")
    return head, step, metadata


def _train(lm, task: HeadTask, readout, train_prompts, data_dir: Path, settings, config: TrainConfig, out: Path,
           args, defaults: dict, parser):
    """Training data (generated or reused), then training: (head, step, metadata, the final config)."""
    from .batches import Batches, WindowSpec
    from .loop import train
    try:
        prompts, sources = training_prompts(lm, train_prompts, stdlib=args.stdlib_prompts, chat=args.chat_prompts)
    except ValueError as e:  # --chat-prompts for a model without a chat template
        parser.error(str(e))
    data = _dataset(lm, prompts, data_dir / TRAIN_DIR, sources, settings, args, parser)
    spec = WindowSpec(seq_len=config.seq_len, context=task.context, lookahead=task.lookahead,
                      include_prompt=config.include_prompt)
    batches = Batches(data, spec, config.batch_size, seed=config.seed)
    if batches.steps_per_epoch == 0:
        parser.error(f"--batch-size {config.batch_size} exceeds the {batches.num_windows} training windows")
    if args.epochs is not None:
        try:
            config = _config(args, defaults, steps=max(1, round(args.epochs * batches.steps_per_epoch)))
        except ValueError as e:
            parser.error(str(e))
    print(f"training data: {data.summary()}; {batches.num_windows} windows, {batches.steps_per_epoch} steps per "
          f"epoch, {config.steps} steps")
    init, started_from = _initial_head(args.init_from, task, lm, parser) if args.init_from else (None, None)
    try:
        mesh = data_parallel_mesh(args.data_parallel, config.batch_size)  # --epochs kept the checked batch size
        result = train(task, lm.config, readout, batches, config, out, restart=args.restart,
                       progress=not args.no_progress, run_identity={"model": lm.name, "data": data.manifest["key"]},
                       mesh=mesh, init=init)
    except ValueError as e:  # checkpoints of a run with other settings, or an init head that does not fit
        parser.error(str(e))
    metadata = {"train": config.identity(), "data": {"train": data.summary()}}
    if started_from is not None:
        metadata["init_from"] = started_from
    return result.head, result.step, metadata, config


def _initial_head(path: str, task: HeadTask, lm, parser):
    """--init-from: (head, what the exported file says of its training) for a head of the task's kind."""
    from jaxspec.models.heads import load_head

    try:
        head, meta = load_head(path, lm.config)
    except (ValueError, OSError) as e:
        parser.error(f"--init-from {path!r}: {e}")
    if meta.get("kind") != task.kind:
        parser.error(f"--init-from {path!r} is a {meta.get('kind')} head; this command trains {task.kind} heads")
    if tuple(meta.get("feature_layers") or ()) != tuple(task.feature_layers(lm.config)):
        parser.error(f"--init-from {path!r} reads layers {meta.get('feature_layers')}; this {task.kind} head reads "
                     f"{list(task.feature_layers(lm.config))}")
    print(f"starting from {path} ({meta.get('steps')} steps: {meta.get('command', 'command not recorded')})")
    # What the start was trained with, down the chain of runs that started from one another.
    started_from = {"path": str(path), "steps": meta.get("steps"), "command": meta.get("command"),
                    "init_from": meta.get("init_from")}
    return head, {k: v for k, v in started_from.items() if v is not None}


def training_prompts(lm, train_prompts: list[str], *, stdlib: int, chat: int) -> tuple[list[str], dict[str, int]]:
    """(prompts, sources) of the training data: HumanEval's training split, `stdlib` standard-library functions
    and `chat` chat requests (`prompts.chat_prompts`); the chat source is named only when there is one, so
    data made before it still matches."""
    from .prompts import chat_prompts, stdlib_prompts

    extra = stdlib_prompts(stdlib)
    sources = {"humaneval-train": len(train_prompts), "stdlib": len(extra)}
    asks: list[str] = []
    if chat:
        if lm.tokenizer is None or lm.tokenizer.chat_template is None:
            raise ValueError(f"--chat-prompts {chat} needs a tokenizer with a chat template; {lm.name!r} has none")
        asks = chat_prompts(lambda m: lm.tokenizer.apply_chat_template(m, add_generation_prompt=True), chat)
        sources["chat"] = len(asks)
    return train_prompts + extra + asks, sources


def _evaluate_and_export(kind: str, lm, task: HeadTask, head, step, metadata: dict, readout, held_data, held_out,
                         config: TrainConfig, out: Path, args):
    import jax

    from jaxspec.models.heads import WEIGHTS_DIR, save_head

    from .batches import Batches, WindowSpec
    from .evaluate import acceptance
    from .loop import evaluate_head

    held_batches = Batches(held_data, WindowSpec(seq_len=config.seq_len, context=task.context,
                                                 lookahead=task.lookahead), config.batch_size)
    evaluation = evaluate_head(task, head, readout, held_batches)
    print(f"held-out evaluation: {json.dumps(evaluation)}")
    metadata.setdefault("data", {})["heldout"] = held_data.summary()
    metadata.update({"model": lm.name, "steps": step, "head": task.settings(), "eval": evaluation,
                     "created": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__})
    if kind == "medusa":
        metadata["rank_probs"] = evaluation["rank_probs"]  # generation builds its static tree from this
    path = save_head(out / "head", head, kind=kind, metadata=metadata)
    print(f"exported {path}")
    if args.accept_prompts:
        # Measured with the exported file, as generation will load it; the metadata is then written again.
        metadata["acceptance"] = acceptance(lm, task.method, path, held_out[: args.accept_prompts],
                                            max_new_tokens=args.accept_tokens)
        print(f"acceptance: {json.dumps(metadata['acceptance'])}")
        save_head(path, head, kind=kind, metadata=metadata)
    if args.ship:
        print(f"shipped {save_head(WEIGHTS_DIR / f'{lm.name}.{kind}', head, kind=kind, metadata=metadata)}")
