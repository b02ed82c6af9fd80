"""Per-request sampling settings.

`SamplingParams` holds either Python scalars (one request, validated on construction) or per-row arrays
(a batch inside jitted code). Its fields are pytree leaves, never static: a new temperature or seed never
recompiles anything.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Literal, Sequence, get_args

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class _Field:
    """How one SamplingParams field is checked and stored."""

    integer: bool  # an integer field (top_k, seed); float fields take any finite real
    low: float
    high: float
    low_open: bool  # the low end is excluded (top_p > 0)
    dtype: Any  # the per-row array dtype `stack` and `broadcast` build

    def allowed(self) -> str:
        if not self.integer and self.high == _F32_MAX:
            return "a finite number > 0" if self.low_open else "a finite number >= 0"
        kind = "an integer" if self.integer else "a number"
        low, high = _BOUND_NAMES.get(self.low, repr(self.low)), _BOUND_NAMES.get(self.high, repr(self.high))
        return f"{kind} in {'(' if self.low_open else '['}{low}, {high}]"


_F32_MAX = float(np.finfo(np.float32).max)  # a larger temperature is inf once stored as float32
_BOUND_NAMES = {2**31 - 1: "2**31 - 1", 2**32 - 1: "2**32 - 1", 0.0: "0", 1.0: "1", -2.0: "-2", 2.0: "2"}
_FIELDS = {
    "temperature": _Field(integer=False, low=0.0, high=_F32_MAX, low_open=False, dtype=np.float32),
    "top_k": _Field(integer=True, low=0, high=2**31 - 1, low_open=False, dtype=np.int32),
    "top_p": _Field(integer=False, low=0.0, high=1.0, low_open=True, dtype=np.float32),
    "min_p": _Field(integer=False, low=0.0, high=1.0, low_open=False, dtype=np.float32),
    "seed": _Field(integer=True, low=0, high=2**32 - 1, low_open=False, dtype=np.uint32),
    # OpenAI's ranges for the two additive penalties; the multiplicative one only needs to be positive.
    "presence_penalty": _Field(integer=False, low=-2.0, high=2.0, low_open=False, dtype=np.float32),
    "frequency_penalty": _Field(integer=False, low=-2.0, high=2.0, low_open=False, dtype=np.float32),
    "repetition_penalty": _Field(integer=False, low=0.0, high=_F32_MAX, low_open=True, dtype=np.float32),
}
# Leaves a user may hand in, all checked. Anything else (tracers, the placeholder objects jax puts in leaves
# while it unflattens a pytree inside its transformations) passes construction unchecked; `stack` and
# `broadcast` still reject it.
_USER_TYPES = (numbers.Number, str, bytes, type(None), list, tuple, dict, set, frozenset, np.ndarray, np.generic)


class InvalidSetting(ValueError):
    """A SamplingParams value out of its field's range or of the wrong type; `field` names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def is_integer(x) -> bool:
    """A Python or numpy integer, not a bool (True as a count, id or rank is always a bug)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _fail(name: str, value, why: str = "") -> InvalidSetting:
    return InvalidSetting(name, f"{name}={value!r} must be {_FIELDS[name].allowed()}{why}")


def _is_unchecked(value) -> bool:
    """True for values only jitted code or pytree machinery hands in: tracers and opaque placeholders."""
    if isinstance(value, jax.core.Tracer):
        return True
    if isinstance(value, jax.Array):
        return value.is_deleted()  # a donated buffer: nothing left to read
    return not isinstance(value, _USER_TYPES)


def _host_values(name: str, value) -> np.ndarray:
    """The field's values as a numpy array of numbers, or ValueError naming the field."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name} is a PRNG key {value.dtype}; it must be {_FIELDS[name].allowed()} "
                         "(pass the integer seed, or pass the key as generate's rng= to derive per-row seeds)")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:  # ragged nesting, unconvertible objects
        raise _fail(name, value) from e
    if arr.dtype == object:  # Python ints beyond 64 bits, or junk: check element by element
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                   for v in arr.ravel().tolist()):
            raise _fail(name, value)
    elif arr.dtype.kind not in "iuf":  # bool, complex, strings, datetimes
        raise _fail(name, value)
    return arr  # any shape: vmapped code stacks per-row arrays; `stack` and `broadcast` check their shapes


def _value_in_range(field: _Field, v) -> bool:
    """One Python number: exact comparisons, whatever its size."""
    if v != v or v in (math.inf, -math.inf) or (field.integer and v != int(v)):
        return False
    return (field.low < v if field.low_open else field.low <= v) and v <= field.high


def _in_range(field: _Field, arr: np.ndarray) -> bool:
    """Whether every value lies in the field's range (and is a whole number for integer fields)."""
    if arr.dtype == object:  # Python ints beyond 64 bits (mixed with others): one by one
        return all(_value_in_range(field, v) for v in arr.ravel().tolist())
    if arr.dtype.kind == "f":
        # Compare in float64: a bound like 2**32 - 1 does not fit float16, and numpy would cast it with a
        # RuntimeWarning (to inf; the answer stays right, since no float16 value reaches such a bound).
        arr = arr.astype(np.float64)
        with np.errstate(invalid="ignore"):
            if not np.all(np.isfinite(arr)) or (field.integer and not np.all(arr == np.floor(arr))):
                return False
    low_ok = arr > field.low if field.low_open else arr >= field.low
    return bool(np.all(low_ok) and np.all(arr <= field.high))


def _checked(name: str, value) -> np.ndarray:
    """The field's values, validated, as a numpy array of its row dtype; ValueError names a bad value."""
    arr = _host_values(name, value)
    field = _FIELDS[name]
    if not _in_range(field, arr):
        raise _fail(name, value)
    stored = np.asarray(arr.tolist() if arr.dtype == object else arr).astype(field.dtype)
    if field.low_open:
        # A value above the open end that rounds onto it in the row dtype (top_p=1e-50 is 0.0 in float32)
        # keeps its meaning as the dtype's smallest normal value (for top_p: the likeliest token alone).
        stored = np.maximum(stored, np.finfo(field.dtype).tiny).astype(field.dtype)
    return stored


@flax.struct.dataclass
class SamplingParams:
    """One request's sampling settings (Python scalars), or per-row arrays [B] for a batch.

    temperature: a finite number >= 0. Below `jaxspec.sampling.GREEDY_BELOW` (1e-5) a row is greedy (the
      argmax), exactly as at 0: dividing logits by a smaller temperature overflows float32.
    top_k: an integer in [0, 2**31 - 1]; 0 disables.  top_p: in (0, 1]; 1 disables.
    min_p: in [0, 1]; 0 disables.  seed: an integer in [0, 2**32 - 1].
    presence_penalty, frequency_penalty: in [-2, 2]; 0 disables. Subtracted from the logit of every token
      the output holds so far: once (presence) and once per occurrence (frequency), as OpenAI defines them.
    repetition_penalty: > 0; 1 disables. Divides the positive logits and multiplies the negative ones of every
      token in the prompt or the output so far (the CTRL rule Hugging Face and vLLM apply).
    Penalties apply before temperature and truncation (`jaxspec.penalties`).

    Construction checks concrete values (scalars, per-row lists, numpy or jax arrays) element by element and
    raises ValueError naming the field; tracers inside jitted code are not checked (they come from checked
    arrays).
    """

    temperature: float = 0.0  # below GREEDY_BELOW (0 included) means greedy (argmax)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    seed: int = 0  # a request's random numbers derive from this seed and the token position only
    presence_penalty: float = 0.0  # in [-2, 2]; 0 disables
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 disables
    repetition_penalty: float = 1.0  # > 0; 1 disables

    def __post_init__(self):
        for name in _FIELDS:
            value = getattr(self, name)
            if not _is_unchecked(value):
                _checked(name, value)

    @property
    def is_greedy(self):
        """Whether the temperature is below `jaxspec.sampling.GREEDY_BELOW` (per row for arrays)."""
        from .sampling import GREEDY_BELOW  # a function-level import: sampling imports this module

        return self.temperature < GREEDY_BELOW

    @classmethod
    def stack(cls, params: Sequence["SamplingParams"]) -> "SamplingParams":
        """Per-row arrays [B] from one SamplingParams per row (each with scalar fields)."""
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise ValueError(f"params={params!r} must be a list of SamplingParams, one per row")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}]={p!r} must be a SamplingParams")
        columns = {}
        for name in _FIELDS:
            values = [_checked(name, getattr(p, name)) for p in params]
            for i, v in enumerate(values):
                if v.ndim != 0:
                    raise ValueError(f"params[{i}].{name}={getattr(params[i], name)!r} must be a scalar to stack")
            columns[name] = jnp.asarray(np.asarray(values, _FIELDS[name].dtype).reshape(len(values)))
        return cls(**columns)

    def broadcast(self, batch: int) -> "SamplingParams":
        """Per-row arrays [B] from scalars or arrays (a scalar applies to every row)."""
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 0:
            raise ValueError(f"batch={batch!r} must be an integer >= 0")
        return SamplingParams(**{name: self._rows(name, batch) for name in _FIELDS})

    def _rows(self, name: str, batch: int) -> jax.Array:
        """One field as an array [B]: checked on the host unless it is a tracer."""
        value = getattr(self, name)
        if isinstance(value, jax.core.Tracer):  # inside jit: already checked where it was concrete
            return jnp.broadcast_to(jnp.asarray(value, _FIELDS[name].dtype), (batch,))
        arr = _checked(name, value)
        if arr.shape not in ((), (batch,)):
            raise ValueError(f"{name} has shape {arr.shape}: it must be a scalar or one value per row, "
                             f"shape ({batch},)")
        return jnp.asarray(np.broadcast_to(arr, (batch,)))


SamSource = Literal["auto", "dynamic", "static", "both"]
SamIndex = Literal["auto", "match", "automaton"]
SAM_INDEXES = get_args(SamIndex)


def _short_repr(value, limit: int = 160) -> str:
    """repr(value), cut to `limit` characters (a proposer may hold whole arrays)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_custom_proposer(proposer) -> None:
    """ValueError unless `proposer` can serve method "custom": it has init, propose and update, declares
    needs_features and max_depth, and is hashable.

    The proposer is a static argument of the jitted loop (part of the compiled program's identity), so it must
    hash; arrays belong in `proposer_params`. Its output shapes are checked later, when `jaxspec.prepare` (or
    `generate`) traces `propose` on the real inputs.
    """
    if proposer is None:
        raise ValueError("method='custom' needs proposer=... (an object with init, propose and update; see "
                         "jaxspec.proposers.base.Proposer)")
    missing = [name for name in ("init", "propose", "update") if not callable(getattr(proposer, name, None))]
    if missing:
        raise ValueError(f"proposer={_short_repr(proposer)} has no {', '.join(missing)}: a Proposer needs init, "
                         "propose and update (jaxspec.proposers.base.Proposer)")
    try:
        hash(proposer)
    except Exception as e:  # TypeError for unhashable types and fields; anything a custom __hash__ raises
        raise ValueError(f"proposer={_short_repr(proposer)} is not hashable ({type(e).__name__}: {e}): it is a "
                         "static argument of the jitted loop, so it must be a frozen dataclass "
                         "(@dataclasses.dataclass(frozen=True)) or otherwise hashable; pass arrays as "
                         "proposer_params") from e
    undeclared = [name for name in ("needs_features", "max_depth") if not hasattr(proposer, name)]
    if undeclared:
        raise ValueError(f"proposer={_short_repr(proposer)} does not declare {', '.join(undeclared)}: a Proposer "
                         "says whether it reads the target's hidden states (needs_features: bool) and the most "
                         "drafts one step can accept (max_depth: int, K for a chain); a chain proposer can inherit "
                         "jaxspec.proposers.base.ChainProposer")
    k = getattr(proposer, "num_speculative_tokens", None)
    if not isinstance(proposer.needs_features, (bool, np.bool_)):
        raise ValueError(f"proposer.needs_features={proposer.needs_features!r} must be True or False")
    if not is_integer(proposer.max_depth) or (is_integer(k) and not 0 <= proposer.max_depth <= k):
        raise ValueError(f"proposer.max_depth={proposer.max_depth!r} must be an integer in [0, "
                         f"num_speculative_tokens={k!r}]")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How to speculate: static settings, part of the compiled program's identity.

    Unset (None) settings take the method's defaults (`jaxspec.methods.METHODS`); `SpecConfig(method="sam")` is the
    adaptive suffix-automaton setting. Data a method needs (a draft model, a static suffix automaton) rides
    along in fields excluded from hashing and comparison; `generate` passes it to the device as jit arguments.
    """

    method: str = "none"  # a name in jaxspec.methods.METHODS
    num_speculative_tokens: int | None = None  # K: the most drafts per row and step
    # Lookup proposers (ngram, sam): propose nothing below this matched length, and at most
    # ceil(draft_per_match * match length) tokens (SuffixDecoding's alpha); math.inf means no cap.
    min_match: int | None = None
    draft_per_match: float | None = None
    ngram_max: int = 4  # prompt lookup tries n-grams of ngram_max .. min_match tokens
    # Where sam drafts from: "dynamic" (the row's own text), "static" (a corpus: `static_sam`, or the one shipped for
    # the model), "both" (the longer match drafts), or "auto" (the default): "both" where `static_sam` is given,
    # else "dynamic", on every platform (`jaxspec.methods.sam_source_for`). The shipped corpus is the model's own
    # completions of HumanEval's training split: an opt-in ("static" or "both") that pays on prompts like those
    # (held-out HumanEval code and chat about it) and costs a few percent on code far from it (docs/benchmarks.md
    # has the figures); `jaxspec corpus` writes one from a user's own prompts or documents
    # (docs/how-to/sam-corpus.md). Its matching walks suffix links in data-dependent loops, a kernel launch per
    # iteration on a GPU, where it has not been measured.
    sam_source: SamSource = "auto"
    # How the dynamic source finds the longest earlier occurrence of a row's suffix: "automaton" (a suffix
    # automaton extended token by token in data-dependent loops), "match" (a match-length array updated by
    # comparing, a fixed number of array operations per step), or "auto": "match" on accelerators, where each
    # loop iteration is a kernel launch, and on a CPU up to 4096 tokens of text (jaxspec.proposers.sam). Both
    # draft the same tokens. For group_sam: "match" searches the group's texts by comparison, suffixes up to 32
    # tokens long; "auto" takes it unless a rollout's group_capacity bounds an automaton
    # (jaxspec.proposers.group_sam).
    sam_index: SamIndex = "auto"
    # Widths (new tokens per row) the verify forward may take; each step runs the narrowest one that holds
    # the longest draft in the batch, so a step where no row drafts costs one plain decode step (unless the
    # width is chosen by cost, `cost_aware`).
    # Default (1, K + 1); (K + 1,) always verifies at full width. Each width compiles its own forward.
    verify_widths: tuple[int, ...] | None = None
    # Chains: choose each step's verify width from the measured cost of each width and each row's running
    # acceptance (jaxspec.cost), instead of the narrowest width holding the longest draft. Measured once per
    # shape and cached on disk. None (the default) is True for a batch of more than one row and False for one:
    # at 8 rows one drafting row makes the whole batch pay a wide forward (on XLA:CPU c(9) is several plain
    # steps), which the narrowest-width rule pays for with a slowdown below plain decoding and the cost-aware one
    # declines; at one row the matched-length rule is tuned and drafts more. No call waits for the measurement:
    # until a shape's table is measured (compiling and timing its widths' forwards, on a background thread between
    # generations) a prior from the model's bytes and FLOPs per width stands in (`jaxspec.cost.verify_cost`);
    # JAXSPEC_VERIFY_COST=off switches cost awareness off. EAGLE-2 and EAGLE-3 trees (drafted best node first)
    # choose by cost at one row too: scoring only the nodes the cost repays is faster than scoring the whole
    # 15-node tree. So does sam drafting from a corpus, which then beats the narrowest-width rule on code and chat alike
    # (docs/benchmarks.md has the figures).
    cost_aware: bool | None = None
    self_draft_layers: int = 8  # self_draft: the target's first N layers plus its final norm and LM head
    # medusa / eagle / eagle2 / eagle3: the trained head's file (jaxspec.models.heads.save_head); None takes the
    # head shipped for the model (models/weights/<model>.<kind>.safetensors).
    head_path: str | None = None
    # eagle2 / eagle3: levels of the dynamic tree, and frontier nodes expanded per level (each with that many
    # children). Unset, the method's depth (3), or the least that drafts num_speculative_tokens nodes.
    # eagle: unset drafts a chain of K; set, a static tree (EAGLE-1) of K nodes at most tree_depth deep, with
    # up to tree_top_k candidates per node (`TreeTopology.default`).
    # group_sam: tree_top_k > 1 drafts that many continuations from the group, differing in their first token,
    # K // tree_top_k deep each (Seer's multi-path drafting; sam_index "match" or "auto"); tree_depth stays unset.
    tree_depth: int | None = None
    tree_top_k: int | None = None
    # medusa / eagle / eagle2 / eagle3: the head scores only the N most frequent target tokens (FR-Spec), the first N of
    # a frequency ranking (models/weights/<model>.draft_vocab.json, or <head>.draft_vocab.json beside your own
    # head), so a drafting pass skips most of the LM head; drafts map back to target ids and verification stays
    # lossless. An integer in [1, vocab_size] (the vocabulary size means all of it); unset takes the method's
    # default for its shipped head, and a head_path of your own drafts over the full vocabulary unless set.
    draft_vocab: int | None = None
    # Predicted outputs (generate's `prediction=`): the most drafts per step taken from a row's prediction.
    # Long runs are cheap to verify next to what they save, so this is well above the methods' K.
    prediction_tokens: int = 32
    # Constraints (generate's `constraint=`): the most tokens a step drafts where the constraint leaves one legal
    # token (JSON punctuation and keys), beside methods none, ngram and sam; 0 drafts none.
    forced_tokens: int = 16
    draft_model: Any = dataclasses.field(default=None, compare=False, repr=False)  # a LanguageModel
    # The corpus of sam_source "static" and "both": a StaticSuffixAutomaton; unset, the draft corpus shipped for the
    # model (jaxspec.models.corpus; a ValueError where none is shipped).
    static_sam: Any = dataclasses.field(default=None, compare=False, repr=False)
    # method "custom": any object following the jaxspec.proposers.base.Proposer protocol (frozen, hashable; its
    # num_speculative_tokens must equal K) and the pytree its functions take as params.
    proposer: Any = dataclasses.field(default=None, compare=False, repr=False)
    proposer_params: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        from .methods import get  # the registry builds proposers, whose modules import this one

        defaults = dict(get(self.method).defaults)
        if self.method == "custom":
            check_custom_proposer(self.proposer)
        if self.method == "custom":
            defaults["num_speculative_tokens"] = getattr(self.proposer, "num_speculative_tokens", None)
        if self.num_speculative_tokens is not None:
            defaults.pop("verify_widths", None)  # the method's widths belong to its own K
        if self.method in ("eagle2", "eagle3") and self.tree_depth is None:
            defaults["tree_depth"] = _tree_depth_for(self.num_speculative_tokens, self.tree_top_k, defaults)
        if self.head_path is not None:
            defaults.pop("draft_vocab", None)  # the method's draft vocabulary was measured with its shipped heads
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.verify_widths is None and isinstance(self.num_speculative_tokens, numbers.Integral):
            object.__setattr__(self, "verify_widths", tuple(sorted({1, self.num_speculative_tokens + 1})))
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer >= 0")
        if self.method == "none" and k != 0:
            raise ValueError(f"num_speculative_tokens={k!r} with method='none': plain decoding drafts nothing")
        if self.method != "none" and k == 0:
            raise ValueError(f"num_speculative_tokens=0 leaves method={self.method!r} nothing to propose")
        if self.min_match < 1:
            raise ValueError(f"min_match={self.min_match!r} must be >= 1")
        pk = self.prediction_tokens
        if isinstance(pk, bool) or not isinstance(pk, numbers.Integral) or not 1 <= pk <= 256:
            raise ValueError(f"prediction_tokens={pk!r} must be an integer in [1, 256]")
        fk = self.forced_tokens
        if isinstance(fk, bool) or not isinstance(fk, numbers.Integral) or not 0 <= fk <= 256:
            raise ValueError(f"forced_tokens={fk!r} must be an integer in [0, 256]")
        if not self.draft_per_match > 0:
            raise ValueError(f"draft_per_match={self.draft_per_match!r} must be > 0 (math.inf: no cap)")
        if self.ngram_max < self.min_match:
            raise ValueError(f"ngram_max={self.ngram_max!r} must be >= min_match={self.min_match!r}")
        if self.sam_source not in ("auto", "dynamic", "static", "both"):
            raise ValueError(f"sam_source={self.sam_source!r} must be 'auto', 'dynamic', 'static' or 'both'")
        if self.sam_index not in SAM_INDEXES:
            raise ValueError(f"sam_index={self.sam_index!r} must be one of {SAM_INDEXES}")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("method='draft_model' needs draft_model (a LanguageModel)")
        if self.method == "custom" and getattr(self.proposer, "num_speculative_tokens", None) != k:
            raise ValueError(f"method='custom' needs proposer (a Proposer) with num_speculative_tokens={k}; "
                             f"got {self.proposer!r}")
        dynamic_tree = self.method in ("eagle2", "eagle3")
        if dynamic_tree or (self.method == "eagle" and (self.tree_depth, self.tree_top_k) != (None, None)):
            for name in ("tree_depth", "tree_top_k"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                    raise ValueError(f"{name}={value!r} must be an integer >= 1")
            drafted = (dynamic_tree_nodes(self.tree_depth, self.tree_top_k) if dynamic_tree
                       else sum(self.tree_top_k ** d for d in range(1, self.tree_depth + 1)))
            if k > drafted:
                raise ValueError(f"num_speculative_tokens={k} exceeds the {drafted} nodes a tree of tree_depth="
                                 f"{self.tree_depth}, tree_top_k={self.tree_top_k} drafts")
        if self.method == "group_sam" and (self.tree_depth, self.tree_top_k) != (None, None):
            paths = self.tree_top_k
            if self.tree_depth is not None or not is_integer(paths) or paths < 1 or k % paths:
                raise ValueError(f"group_sam takes tree_top_k (paths) alone, an integer >= 1 dividing "
                                 f"num_speculative_tokens={k}; got tree_depth={self.tree_depth!r}, "
                                 f"tree_top_k={paths!r}")
            if paths > 1 and self.sam_index == "automaton":
                raise ValueError(f"tree_top_k={paths} drafts from group_sam's texts index; sam_index='automaton'")
        if self.draft_vocab is not None:
            if not is_integer(self.draft_vocab) or self.draft_vocab < 1:
                raise ValueError(f"draft_vocab={self.draft_vocab!r} must be None or an integer in [1, vocab_size]")
            if get(self.method).kind != "head":
                raise ValueError(f"draft_vocab={self.draft_vocab!r} applies to the trained heads (medusa, eagle, "
                                 f"eagle2, eagle3), not method={self.method!r}")
        if self.head_path is not None and not isinstance(self.head_path, (str, os.PathLike)):
            raise ValueError(f"head_path={self.head_path!r} must be a path")
        if self.cost_aware is not None and not isinstance(self.cost_aware, (bool, np.bool_)):
            raise ValueError(f"cost_aware={self.cost_aware!r} must be True, False or None (True above one row)")
        if self.self_draft_layers < 1:
            raise ValueError(f"self_draft_layers={self.self_draft_layers!r} must be >= 1")
        widths = tuple(self.verify_widths)
        if not widths or min(widths) < 1 or max(widths) != k + 1:
            raise ValueError(f"verify_widths={widths!r} must be >= 1 and end at num_speculative_tokens + 1 = {k + 1}")
        object.__setattr__(self, "verify_widths", tuple(sorted(set(widths))))

    def cost_aware_at(self, batch: int, ranked_tree: bool = False, corpus: bool = False) -> bool:
        """Whether a batch of `batch` rows chooses each step's verify width by measured cost (`cost_aware`;
        None means above one row, and at every batch size for a tree drafted best node first and for drafts
        from a static corpus, whose long matches are weaker evidence than the row's own text)."""
        return (batch > 1 or ranked_tree or corpus) if self.cost_aware is None else bool(self.cost_aware)

    @classmethod
    def adaptive_sam(cls, **overrides) -> "SpecConfig":
        """The adaptive suffix-automaton default, `SpecConfig(method="sam")`, with any setting overridden."""
        return cls(method="sam", **overrides)


def dynamic_tree_nodes(depth: int, top_k: int) -> int:
    """The nodes an EAGLE-2 dynamic tree drafts before its best K are kept: the root's top_k children, then
    top_k children for each of the top_k frontier nodes at every further level."""
    return top_k + (depth - 1) * top_k ** 2


def _tree_depth_for(num_nodes, top_k, defaults) -> int | None:
    """The default depth of an EAGLE-2/3 dynamic tree: the method's, deepened where a budget of `num_nodes`
    needs more levels to draft that many (`dynamic_tree_nodes`). Values that are not positive integers are
    left to the checks that name them."""
    depth = defaults.get("tree_depth")
    num_nodes = defaults.get("num_speculative_tokens") if num_nodes is None else num_nodes
    top_k = defaults.get("tree_top_k") if top_k is None else top_k
    if not all(is_integer(v) and v >= 1 for v in (depth, num_nodes, top_k)):
        return depth
    while dynamic_tree_nodes(depth, top_k) < num_nodes:
        depth += 1
    return depth
