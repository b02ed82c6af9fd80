"""jaxspec: speculative decoding for JAX/Flax.

The public API: load a model, generate, and the pieces researchers compose (sampling, cache, models).
"""

from .cache import KVCache
from .config import SamplingParams, SpecConfig
from .generation import GenerateResult, GenerateStats, RowStats, generate
from .models.loading import DEFAULT_MODEL, NAMED_MODELS, LanguageModel, load_model
from .sampling import process_logits, processed_probs, sample

__all__ = [
    "DEFAULT_MODEL",
    "GenerateResult",
    "GenerateStats",
    "KVCache",
    "LanguageModel",
    "NAMED_MODELS",
    "RowStats",
    "SamplingParams",
    "SpecConfig",
    "generate",
    "load_model",
    "process_logits",
    "processed_probs",
    "sample",
]
