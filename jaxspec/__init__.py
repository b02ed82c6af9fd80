"""jaxspec: speculative decoding for JAX/Flax.

The public API: load a model, generate (plainly or speculatively), and the pieces researchers compose
(sampling, rejection sampling, proposers, cache, models).
"""

from .cache import KVCache
from .config import SamplingParams, SpecConfig
from .generation import GenerateResult, GenerateStats, RowStats, generate
from .logprobs import TokenLogprob
from .models.loading import DEFAULT_MODEL, NAMED_MODELS, LanguageModel, load_model
from .proposers import StaticSuffixAutomaton
from .rejection import rejection_sample
from .sampling import process_logits, processed_probs, sample
from .tree import TreeTopology, verify_tree

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
    "StaticSuffixAutomaton",
    "TokenLogprob",
    "TreeTopology",
    "generate",
    "load_model",
    "process_logits",
    "rejection_sample",
    "processed_probs",
    "sample",
    "verify_tree",
]
