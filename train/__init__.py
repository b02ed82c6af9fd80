"""Training of drafter heads (Medusa, EAGLE) on the target's self-distilled data, installed as ``jaxspec.train``.

    python -m jaxspec.train.eagle --help
    python -m jaxspec.train.medusa --help

Modules: `prompts` (HumanEval split, standard-library prompts), `data` (generation and on-disk shards),
`batches` (resumable windows), `losses`, `evaluate`, `loop` (optimizer, step, checkpoints), `cli`, and one
small module per head (`eagle`, `medusa`).
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
from .loop import TrainConfig, TrainResult, evaluate_head, train
from .medusa import MedusaTask
from .prompts import humaneval_split, stdlib_prompts

__all__ = ["Batch", "Batches", "EagleTask", "GenerationSettings", "MedusaTask", "SelfDistillData", "TrainConfig",
           "TrainResult", "WindowSpec", "ensure_dataset", "evaluate_head", "humaneval_split", "stdlib_prompts",
           "train"]
