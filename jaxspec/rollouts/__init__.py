"""RL rollouts: P prompts x G samples each, sampled on the device, with grouped speculation and a fast tail.

`rollout(lm, prompts, num_samples=G, ...)` returns every sample's tokens, text, finish reason and the
log-probability of each token under the distribution it was sampled from, with the rollout's timeline. Sample
g of prompt p is keyed by (seed, p, g, position) only (`sample_seeds`), so a rollout reproduces token for
token whatever the batch, its compaction or the speculation method: `SpecConfig(method="group_sam")` drafts
from the prompt's other samples (and `references=`, earlier completions) and changes how fast, never what.
That equality needs logits that do not depend on the batch's shape, as XLA:CPU's do; a GPU's default TF32
products round by shape (docs/how-to/rollouts.md).
"""

from .inputs import LOGPROB_MODES, sample_seeds
from .result import ChunkRecord, RolloutResult, RolloutStats
from .run import batch_buckets, rollout

__all__ = ["ChunkRecord", "LOGPROB_MODES", "RolloutResult", "RolloutStats", "batch_buckets", "rollout", "sample_seeds"]
