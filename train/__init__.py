"""Training of drafter heads (Medusa, EAGLE) on the target's self-distilled data, installed as ``jaxspec.train``.

    python -m jaxspec.train.eagle --help
    python -m jaxspec.train.medusa --help
    python -m jaxspec.train.eagle3 --help

Modules: `prompts` (HumanEval split, standard-library prompts), `data` (generation and on-disk shards),
`batches` (resumable windows), `losses`, `evaluate`, `loop` (optimizer, step, checkpoints), `cli`, and one
small module per head (`eagle`, `eagle3`, `medusa`).
"""

try:  # the [train] extra; the core install (`import jaxspec`, generation) needs none of these
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import tqdm  # noqa: F401
except ImportError as e:
    raise ImportError(f"jaxspec.train needs the training extra: pip install 'jaxspec[train]' ({e})") from e

from .batches import Batch, Batches, WindowSpec
from .data import GenerationSettings, SelfDistillData, ensure_dataset
from .eagle import EagleTask
from .eagle3 import Eagle3Task
from .loop import TrainConfig, TrainResult, evaluate_head, train
from .medusa import MedusaTask
from .prompts import chat_prompts, humaneval_split, stdlib_prompts

__all__ = ["Batch", "Batches", "Eagle3Task", "EagleTask", "GenerationSettings", "MedusaTask", "SelfDistillData",
           "TrainConfig", "TrainResult", "WindowSpec", "chat_prompts", "ensure_dataset", "evaluate_head",
           "humaneval_split", "stdlib_prompts", "train"]
