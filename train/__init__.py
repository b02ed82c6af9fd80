"""Training of drafter heads (Medusa, EAGLE, DFlash) on the target's self-distilled data, installed as
``jaxspec.train``.

    python -m jaxspec.train.eagle --help
    python -m jaxspec.train.medusa --help
    python -m jaxspec.train.eagle3 --help
    python -m jaxspec.train.dflash --help

Modules: `prompts` (HumanEval split, standard-library prompts), `data` (generation and on-disk shards),
`batches` (resumable windows), `losses`, `evaluate`, `loop` (optimizer, step, checkpoints), `cli`, and one
small module per head (`eagle`, `eagle3`, `medusa`, `dflash`). Beside the heads, what other drafters learn from the
target: `draft_vocab` (the heads' frequency-ranked draft vocabulary) and `sam_corpus` (sam's static draft corpus).
"""

try:  # the [train] extra; the core install (`import jaxspec`, generation) needs none of these
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import tqdm  # noqa: F401
except ImportError as e:
    raise ImportError(f"jaxspec.train needs the training extra: pip install 'jaxspec[train]' ({e})") from e

from .batches import Batch, Batches, WindowSpec
from .data import GenerationSettings, SelfDistillData, ensure_dataset
from .loop import TrainConfig, TrainResult, evaluate_head, train
from .prompts import chat_prompts, humaneval_split, stdlib_prompts

# The task classes live in the modules `python -m jaxspec.train.<kind>` runs. Importing them here, eagerly, would
# load each such module once as part of the package and again as __main__ (runpy warns about it); they load on
# first use instead.
_TASKS = {"EagleTask": ".eagle", "Eagle3Task": ".eagle3", "MedusaTask": ".medusa", "DFlashTask": ".dflash"}


def __getattr__(name: str):
    if name in _TASKS:
        import importlib

        return getattr(importlib.import_module(_TASKS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["Batch", "Batches", "DFlashTask", "Eagle3Task", "EagleTask", "GenerationSettings", "MedusaTask",
           "SelfDistillData", "TrainConfig", "TrainResult", "WindowSpec", "chat_prompts", "ensure_dataset",
           "evaluate_head", "humaneval_split", "stdlib_prompts", "train"]
