"""The `jaxspec` command: generate text, serve a model, build a draft corpus, train heads.

    jaxspec generate "def fibonacci(n):"                        # the default model, plain decoding
    jaxspec generate --chat "Write a haiku about JAX." --method sam --temperature 0.7 --seed 1
    jaxspec serve --port 8000                                   # an OpenAI-compatible server
    jaxspec corpus --prompts my_prompts.txt --out my.sam_corpus.json   # sam's draft corpus for your domain
    jaxspec train eagle3 --steps 800                            # train a head (the [train] extra)

Installed with the package (`[project.scripts]`); `python -m jaxspec.cli` is the same command. Each subcommand
has its own --help. Every one turns on the persistent compilation cache in ~/.cache/jaxspec-xla
(`jaxspec.enable_compilation_cache`), so a second run skips most of the compiling. Bad input exits with status 2
and a message naming it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

PROG = "jaxspec"
TRAIN_KINDS = ("eagle", "eagle3", "medusa", "dflash")


def _methods() -> tuple[str, ...]:
    """The methods `generate` runs from a name alone (draft_model needs a second model, custom a proposer)."""
    from .methods import names

    return tuple(m for m in names() if m not in ("draft_model", "custom"))


# ---------------------------------------------------------------------------------------------- generate

def generate_parser(prog: str = f"{PROG} generate") -> argparse.ArgumentParser:
    import jaxspec

    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text from a prompt; speculative methods give the same output as plain decoding "
                    "(greedy: the same tokens; sampled: the same distribution), only faster or slower.")
    p.add_argument("prompt", help="the prompt text (or the user's message with --chat)")
    p.add_argument("--model", default=jaxspec.DEFAULT_MODEL,
                   help=f"a named model ({', '.join(jaxspec.NAMED_MODELS)}), a .gguf file or a Hugging Face "
                        "directory (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    p.add_argument("--method", "--spec", dest="method", default="none", choices=_methods(),
                   help="speculative decoding method, with its default settings (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="K, the most drafts per step (default: the method's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1] (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the model's dtype (default: bfloat16 on a GPU or TPU, float32 on a CPU)")
    return p


def generate_main(argv: Sequence[str] | None = None, prog: str = f"{PROG} generate") -> int:
    """`jaxspec generate`: the completion on stdout (prompt included, except with --chat), statistics on stderr."""
    import jaxspec

    parser = generate_parser(prog)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    try:
        # Settings first: a bad value is reported before seconds of loading the model.
        sampling = jaxspec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          min_p=args.min_p, seed=args.seed)
        spec = jaxspec.SpecConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens)
        cache = jaxspec.enable_compilation_cache()
        # Progress on stderr: loading and a first run's compile take seconds each, silently otherwise.
        t0 = time.perf_counter()
        print(f"[loading {args.model}]", file=sys.stderr, flush=True)
        lm = jaxspec.load_model(args.model, dtype=args.dtype)
        print(f"[loaded in {time.perf_counter() - t0:.1f} s; generating: a first run of these shapes compiles first, "
              f"later ones read the compiled programs from {cache}]", file=sys.stderr, flush=True)
        prompt = args.prompt
        if args.chat:
            if lm.tokenizer is None or lm.tokenizer.chat_template is None:
                raise ValueError(f"--chat needs a tokenizer with a chat template; model {lm.name!r} has none")
            messages = [{"role": "system", "content": args.system}] if args.system else []
            prompt = lm.tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
        result = jaxspec.generate(lm, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling, spec=spec)
    except ValueError as e:
        parser.error(str(e))
    s = result.stats
    print(("" if args.chat else prompt) + result.text[0])
    print(f"\n[{s.generated_tokens} tokens, finish: {result.finish_reason[0]}; prefill {s.prompt_tokens} tokens in "
          f"{s.prefill_s:.2f} s; decode {s.decode_tokens_per_s:.1f} tokens/s (a first run includes compiling)]",
          file=sys.stderr)
    if args.method != "none":
        print(f"[{args.method}: {s.steps} steps, {s.accepted}/{s.drafted} drafts accepted, "
              f"{s.mean_acceptance_length:.2f} tokens per step]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- corpus

def corpus_main(argv: Sequence[str] | None = None) -> int:
    """`jaxspec corpus`: sam's draft corpus from the user's prompts and/or documents
    (`jaxspec.train.sam_corpus.user_main`)."""
    try:
        from .train.sam_corpus import user_main
    except ImportError as e:  # jaxspec.train asks for the [train] extra
        return _fail(f"corpus needs the trainers' dependencies: pip install 'jaxspec[train]' ({e})")
    return user_main(argv, prog=f"{PROG} corpus")


# ---------------------------------------------------------------------------------------------- pass-through

def serve_main(argv: Sequence[str]) -> int:
    """`jaxspec serve ...`: `jaxspec.serving.server.main` with the rest of the command line."""
    try:
        from .serving import server
    except ImportError as e:  # fastapi, uvicorn, ...: in the core install, unless removed since
        return _fail(f"serve needs the server's dependencies (fastapi, uvicorn, ...): pip install jaxspec ({e})")
    return _with_prog(f"{PROG} serve", lambda: server.main(list(argv)))


def train_main(argv: Sequence[str]) -> int:
    """`jaxspec train KIND ...`: `python -m jaxspec.train.KIND` with the rest of the command line."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a drafting head for a target model on its own generations\n"
                    "(docs/how-to/training-heads.md): the same as `python -m jaxspec.train.KIND`.\n"
                    "`jaxspec train KIND --help` lists a trainer's options.")
    parser.add_argument("kind", choices=TRAIN_KINDS, help="the head to train")
    args, rest = parser.parse_known_args(list(argv[:1]))  # only the kind is ours; the trainer parses the rest
    try:
        import importlib

        module = importlib.import_module(f"jaxspec.train.{args.kind}")
    except ImportError as e:  # optax, orbax: the [train] extra
        return _fail(f"train needs the trainers' dependencies: pip install 'jaxspec[train]' ({e})")
    return module.main(list(rest) + list(argv[1:]))


def bench_main(argv: Sequence[str]) -> int:
    """`jaxspec bench ...`: `python scripts/bench.py ...`, which lives in the source checkout, not in the installed
    package: from an editable install (`make install`) it runs; from a wheel it says where to get it."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
    if not script.is_file():
        return _fail("bench needs a source checkout of jaxspec: the benchmarks live in its scripts/ folder and are "
                     "not installed; clone the repository and run `make bench` or `python scripts/bench.py`")
    import subprocess

    return subprocess.call([sys.executable, str(script), *argv])


def _with_prog(prog: str, call: Callable[[], int]) -> int:
    """Run `call` with argv[0] = `prog`, so a command whose parser takes its name from argv[0] says `jaxspec serve`
    in its usage and errors."""
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = prog
    try:
        return call()
    finally:
        if saved is not None:
            sys.argv[0] = saved


def _fail(message: str) -> int:
    """Status 1: what is missing is the installation's, not the command line's (argparse's errors exit 2)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("generate", help="generate text from a prompt, plainly or speculatively", add_help=False)
    sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                   add_help=False)
    sub.add_parser("corpus", help="build sam's draft corpus from your prompts or documents", add_help=False)
    sub.add_parser("train", help=f"train a drafting head: {', '.join(TRAIN_KINDS)} (the [train] extra)",
                   add_help=False)
    sub.add_parser("bench", help="the benchmarks (scripts/bench.py; needs a source checkout)", add_help=False)
    return parser


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "generate": generate_main, "corpus": corpus_main, "serve": serve_main, "train": train_main, "bench": bench_main}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # --help, a missing or unknown command: argparse prints and exits (status 2)
        return 2
    command, rest = argv[0], argv[1:]
    if not {"-h", "--help"} & set(rest):  # help needs no cache folder
        from .compilation_cache import enable_compilation_cache

        enable_compilation_cache()
    return COMMANDS[command](rest)

if __name__ == "__main__":
    sys.exit(main())
