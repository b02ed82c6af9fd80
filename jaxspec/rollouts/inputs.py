"""`rollout`'s arguments checked (a ValueError naming the bad value) and turned into the arrays the loop takes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..generation import _stop_ids, available_memory, check_stop_strings, normalise_prompts, rows_bytes
from ..limits import check_token_ids, is_token_list
from ..models.loading import LanguageModel
from ..proposers.group_sam import GroupReferences
from ..sampling_params import SamplingParams
from ..shapes import bucket_shapes, next_pow2
from ..spec_config import SpecConfig
from ..validation import is_integer

LOGPROB_MODES = ("sampling", "raw")  # under the distribution sampled from, or the target's raw softmax
MAX_ROWS = 2**31 - 1  # samples of one rollout: rows, seeds and positions are int32 on the device


@dataclasses.dataclass(frozen=True)
class RolloutInputs:
    """A validated rollout: P prompts x G samples, row p * G + g being sample g of prompt p."""

    ids: list[list[int]]  # P prompts' token ids
    num_samples: int  # G
    max_new_tokens: int
    sampling: SamplingParams  # per-row arrays [P * G], each sample's seed from (seed, p, g)
    stop_table: np.ndarray  # i32[P * G, M] stop ids, -1 padded
    spec: SpecConfig
    params: Any  # the policy weights to run (lm.params or an update of them)
    references: GroupReferences | None  # earlier completions per prompt (group_sam's draft material)
    logprobs: bool
    logprobs_mode: str  # "sampling" | "raw"
    stop: tuple[tuple[str, ...], ...] | None  # per prompt, the stop strings (None: none anywhere)

    @property
    def num_prompts(self) -> int:
        return len(self.ids)

    @property
    def num_rows(self) -> int:
        return len(self.ids) * self.num_samples


@functools.partial(jax.jit, static_argnames=("num_prompts", "num_samples"))
def _sample_seeds(key: jax.Array, num_prompts: int, num_samples: int, offset: jax.Array) -> jax.Array:
    p = offset.astype(jnp.uint32) + jnp.arange(num_prompts, dtype=jnp.uint32)
    g = jnp.arange(num_samples, dtype=jnp.uint32)
    bits = jax.vmap(jax.vmap(lambda i, j: jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, i), j), (),
                                                          jnp.uint32), (None, 0)), (0, None))
    return bits(p, g)


def sample_seeds(seed: int, num_prompts: int, num_samples: int, offset: int = 0) -> np.ndarray:
    """u32[P, G]: the seed of sample g of prompt p, `bits(fold_in(fold_in(key(seed), offset + p), g))` (a nonzero
    `offset`: these prompts are prompts offset.. of a larger rollout, as one process's share of it).

    A sample's tokens are keyed by its seed and each token's position only, so they do not depend on the
    batch, its order, compaction or the speculation method: pass these seeds to `jaxspec.generate` (one row
    per sample) and it samples the same tokens.
    """
    return np.asarray(_sample_seeds(jax.random.key(seed), num_prompts=num_prompts, num_samples=num_samples,
                                    offset=jnp.asarray(offset, jnp.uint32)))


def _check_int(name: str, value, low: int) -> int:
    if not is_integer(value) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return int(value)


def _prompt_sampling(sampling, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams (scalars) per prompt: `sampling` for all, or one per prompt."""
    if isinstance(sampling, SamplingParams):
        return [sampling] * num_prompts
    if not isinstance(sampling, (list, tuple)) or len(sampling) != num_prompts:
        raise ValueError(f"sampling={sampling!r} must be a SamplingParams or a list of {num_prompts}, one per prompt")
    for i, s in enumerate(sampling):
        if not isinstance(s, SamplingParams):
            raise ValueError(f"sampling[{i}]={s!r} must be a SamplingParams")
    return list(sampling)


def check_params(lm: LanguageModel, params) -> Any:
    """`params` when it has exactly the structure, shapes and dtypes of `lm.params` (updated policy weights run
    by the compiled programs without recompiling); ValueError naming the first leaf that differs."""
    if params is None:
        return lm.params
    want = jax.tree_util.tree_flatten_with_path(lm.params)[0]
    try:
        got_leaves, got_tree = jax.tree_util.tree_flatten(params)
    except Exception as e:  # noqa: BLE001 - any unflattenable object is a bad argument
        raise ValueError(f"params={type(params).__name__} must be the model's parameter tree: {e}") from e
    if got_tree != jax.tree_util.tree_structure(lm.params):
        raise ValueError(f"params has the tree structure {got_tree}; it must be the structure of lm.params "
                         f"({len(want)} arrays, from nnx.split of the model)")
    for (path, ref), leaf in zip(want, got_leaves):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape != ref.shape or dtype != ref.dtype:
            raise ValueError(f"params{jax.tree_util.keystr(path)} has shape {shape} and dtype {dtype}; "
                             f"lm.params has {ref.shape} and {ref.dtype}")
    return params


def _references(lm: LanguageModel, references, num_prompts: int, spec: SpecConfig) -> GroupReferences | None:
    """The references as padded arrays: per prompt a list of completions (strings or token-id lists)."""
    if references is None:
        return None
    if spec.method != "group_sam":
        raise ValueError(f"references= are draft material for method='group_sam'; spec.method={spec.method!r}")
    if not isinstance(references, (list, tuple)) or len(references) != num_prompts:
        raise ValueError(f"references must be a list of {num_prompts} lists (one per prompt) of completions; "
                         f"got {_describe(references)}")
    rows: list[list[list[int]]] = []
    for p, refs in enumerate(references):
        if isinstance(refs, str) or is_token_list(refs) or not isinstance(refs, (list, tuple)):
            raise ValueError(f"references[{p}] must be a list of completions (strings or token-id lists); got "
                             f"{_describe(refs)}")
        row = []
        for r, ref in enumerate(refs):
            where = f"references[{p}][{r}]"
            if isinstance(ref, str):
                if lm.tokenizer is None:
                    raise ValueError(f"{where} is text, but the model has no tokenizer: pass token ids")
                ref = lm.tokenizer.encode(ref)
            elif not is_token_list(ref):
                raise ValueError(f"{where}={_describe(ref)} must be a string or a list of token ids")
            row.append(check_token_ids(list(ref), lm.config.vocab_size, where))
        rows.append(row)
    num_refs = max(1, max(len(r) for r in rows))
    # Power-of-two widths, so references of other lengths reuse the compiled programs.
    width = next_pow2(max((len(x) for r in rows for x in r), default=1))
    tokens = np.zeros((num_prompts, num_refs, width), np.int32)
    lengths = np.zeros((num_prompts, num_refs), np.int32)
    for p, row in enumerate(rows):
        for r, ref in enumerate(row):
            tokens[p, r, : len(ref)] = ref
            lengths[p, r] = len(ref)
    return GroupReferences(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths))


def _describe(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def validate(lm: LanguageModel, prompts, *, num_samples, max_new_tokens, sampling, spec, params, references,
             logprobs, logprobs_mode, seed, stop_token_ids, ignore_eos, stop=None, prompt_offset=0) -> RolloutInputs:
    """Every argument checked, in the order of the signature, and normalised."""
    if isinstance(prompts, (list, tuple)) and len(prompts) == 0:
        raise ValueError("prompts=[] must hold at least one prompt")
    ids = normalise_prompts(lm, prompts)
    num_samples = _check_int("num_samples", num_samples, 1)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    per_prompt = _prompt_sampling(sampling, len(ids))
    spec = SpecConfig() if spec is None else spec
    if not isinstance(spec, SpecConfig):
        raise ValueError(f"spec={spec!r} must be a jaxspec.SpecConfig")
    if spec.method == "custom":
        raise ValueError("spec.method='custom' is not supported by rollout: its proposer sees no groups")
    params = check_params(lm, params)
    refs = _references(lm, references, len(ids), spec)
    if not isinstance(logprobs, (bool, np.bool_)):
        raise ValueError(f"logprobs={logprobs!r} must be True or False")
    if logprobs_mode not in LOGPROB_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} must be one of {LOGPROB_MODES}")
    if not is_integer(seed) or not 0 <= seed <= 2**32 - 1:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32 - 1]")
    limit = lm.config.max_position_embeddings
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{len(p) + max_new_tokens} positions, more than the context length {limit}")
    prompt_offset = _check_int("prompt_offset", prompt_offset, 0)
    # Before anything is built per row (seeds, sampling arrays, stop table: P * G of each): a rollout that cannot
    # fit is refused from its sizes alone. The loop checks again once the proposer's indexes are sized.
    num_rows = len(ids) * num_samples
    if num_rows > MAX_ROWS:
        raise ValueError(f"num_samples={num_samples} x {len(ids)} prompts is {num_rows} samples; at most {MAX_ROWS} "
                         "fit one rollout (rows are numbered with int32)")
    width, buffer_len, cache_len = bucket_shapes([len(p) for p in ids], max_new_tokens)
    check_memory(lm, num_prompts=len(ids), num_samples=num_samples, max_new_tokens=max_new_tokens,
                 logprobs=bool(logprobs), cache_len=cache_len, history_len=width + buffer_len, index_bytes=0)
    seeds = sample_seeds(int(seed), len(ids), num_samples, prompt_offset).reshape(-1)  # u32[P * G]
    rows = SamplingParams.stack([s for s in per_prompt for _ in range(num_samples)])
    rows = rows.replace(seed=jnp.asarray(seeds))
    stops = _stop_ids(lm, len(ids), stop_token_ids, ignore_eos)  # i32[P, M]
    stop_strings = check_stop_strings(lm, stop, len(ids))
    return RolloutInputs(ids=ids, num_samples=num_samples, max_new_tokens=max_new_tokens, sampling=rows,
                         stop_table=np.repeat(stops, num_samples, axis=0), spec=spec, params=params,
                         references=refs, logprobs=bool(logprobs), logprobs_mode=logprobs_mode, stop=stop_strings)


def check_memory(lm: LanguageModel, *, num_prompts: int, num_samples: int, max_new_tokens: int, logprobs: bool,
                 cache_len: int, history_len: int, index_bytes: int) -> None:
    """ValueError naming num_samples, the number of prompts and max_new_tokens, with the bytes needed and the
    bytes available, when the rollout's rows (KV cache, history, log-probabilities: `rows_bytes`) and group_sam's
    group indexes would not fit twice in memory (compaction copies the batch once); from the sizes alone, nothing
    allocated."""
    rows = rows_bytes(lm, num_rows=num_prompts * num_samples, cache_len=cache_len, history_len=history_len,
                      logprobs=logprobs)
    need, have = 2 * (rows + index_bytes), available_memory()
    need //= 1 if lm.mesh is None else lm.mesh.size  # on a mesh, at best spread evenly over its devices
    if need > have:
        gib = 1 << 30
        raise ValueError(
            f"num_samples={num_samples} x {num_prompts} prompts with max_new_tokens={max_new_tokens} needs about "
            f"{need} bytes ({need / gib:.2f} GiB: rows' KV cache and history {rows / gib:.2f} GiB, group indexes "
            f"{index_bytes / gib:.2f} GiB, twice over for compaction) but {have} bytes ({have / gib:.2f} GiB) are "
            "available: lower num_samples, the number of prompts, max_new_tokens or group_capacity")
