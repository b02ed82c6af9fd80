"""jaxspec: speculative decoding for JAX/Flax.

The public API: load a model, generate (plainly or speculatively), and the pieces researchers compose
(sampling, rejection sampling, proposers, cache, models). The loop `generate` runs is public too: `prepare`
builds its inputs from plain prompts, `prefill`, `decode` (or `decode_chunk`, or `spec_step` in a loop of your
own) run it, and `Prepared.new_tokens` reads the result (docs/how-to/own-loop.md). `rollout` samples groups
of completions per prompt for RL (`jaxspec.rollouts`).
"""

from .cache import KVCache
from .compilation_cache import enable_compilation_cache
from .constraints import Choice, JsonSchema, Regex
from .decode import PrefillSpec, StepSpec, decode, decode_chunk, prefill, spec_step
from .generation import GenerateResult, GenerateStats, Prepared, RowStats, generate, prepare
from .logprobs import TokenLogprob
from .models.loading import DEFAULT_MODEL, NAMED_MODELS, LanguageModel, load_model
from .policy import DraftPolicy
from .processors import ProcessorRequest
from .proposers import StaticSuffixAutomaton
from .rejection import rejection_sample
from .rollouts import RolloutResult, RolloutStats, rollout, sample_seeds
from .sampling import process_logits, processed_probs, sample
from .sampling_params import SamplingParams
from .score import ScoreResult, score, score_arrays
from .spec_config import SpecConfig
from .state import DecodeState, RowLimits, RowParams
from .target import TargetModel, check_target
from .tree import DraftTree, TreeTopology, verify_tree

__all__ = [
    "Choice",
    "DEFAULT_MODEL",
    "DecodeState",
    "DraftPolicy",
    "DraftTree",
    "GenerateResult",
    "GenerateStats",
    "JsonSchema",
    "KVCache",
    "LanguageModel",
    "NAMED_MODELS",
    "PrefillSpec",
    "Prepared",
    "ProcessorRequest",
    "Regex",
    "RolloutResult",
    "RolloutStats",
    "RowLimits",
    "RowParams",
    "RowStats",
    "SamplingParams",
    "ScoreResult",
    "SpecConfig",
    "StaticSuffixAutomaton",
    "StepSpec",
    "TargetModel",
    "TokenLogprob",
    "TreeTopology",
    "check_target",
    "decode",
    "decode_chunk",
    "enable_compilation_cache",
    "generate",
    "load_model",
    "prefill",
    "prepare",
    "process_logits",
    "rejection_sample",
    "rollout",
    "sample_seeds",
    "processed_probs",
    "sample",
    "score",
    "score_arrays",
    "spec_step",
    "verify_tree",
]
