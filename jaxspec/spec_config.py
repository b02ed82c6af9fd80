"""How to speculate: `SpecConfig`, the static settings of a speculative run, checked where they are made.

A SpecConfig is part of the compiled program's identity (it is hashable and compared by value). Each method's
defaults come from the registry (`jaxspec.methods`); this module reads the registry, never the reverse.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any, Literal

import numpy as np

from .methods import get
from .proposers.base import Proposer
from .proposers.sam import SAM_INDEXES, SamIndex
from .tree import dynamic_tree_nodes
from .validation import is_integer, short_repr

SamSource = Literal["auto", "dynamic", "static", "both"]


def check_custom_proposer(proposer) -> None:
    """ValueError unless `proposer` can serve method "custom": it is a `jaxspec.proposers.base.Proposer` (which
    makes it define init, propose, update and max_depth), its declarations have the right types, and it is
    hashable.

    The proposer is a static argument of the jitted loop (part of the compiled program's identity), so it must
    hash; arrays belong in `proposer_params`. Its output shapes are checked later, when `jaxspec.prepare` (or
    `generate`) traces `propose` on the real inputs.
    """
    if proposer is None:
        raise ValueError("method='custom' needs proposer=... (a jaxspec.proposers.base.Proposer)")
    if not isinstance(proposer, Proposer):
        raise ValueError(f"proposer={short_repr(proposer)} is not a jaxspec.proposers.base.Proposer: inherit it "
                         "(a chain proposer: jaxspec.proposers.base.ChainProposer), which declares what the loop "
                         "reads and checks that init, propose, update and max_depth are defined")
    try:
        hash(proposer)
    except Exception as e:  # TypeError for unhashable types and fields; anything a custom __hash__ raises
        raise ValueError(f"proposer={short_repr(proposer)} is not hashable ({type(e).__name__}: {e}): it is a "
                         "static argument of the jitted loop, so it must be a frozen dataclass "
                         "(@dataclasses.dataclass(frozen=True)) or otherwise hashable; pass arrays as "
                         "proposer_params") from e
    try:
        k = proposer.num_speculative_tokens
    except AttributeError:
        raise ValueError(f"proposer={short_repr(proposer)} has no num_speculative_tokens: a Proposer declares K, "
                         "the most tokens (or tree nodes) it drafts a step") from None
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
    # else "dynamic", on every platform (`jaxspec.builders.sam_source_for`). The shipped corpus is the model's own
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
    # medusa / eagle / eagle2 / eagle3 / dflash: the trained head's file (jaxspec.models.heads.save_head); None
    # takes the head shipped for the model (models/weights/<model>.<kind>.safetensors).
    head_path: str | None = None
    # eagle2 / eagle3: levels of the dynamic tree, and frontier nodes expanded per level (each with that many
    # children). Unset, the method's depth (3), or the least that drafts num_speculative_tokens nodes.
    # eagle: unset drafts a chain of K; set, a static tree (EAGLE-1) of K nodes at most tree_depth deep, with
    # up to tree_top_k candidates per node (`TreeTopology.default`).
    # dflash: both set, a tree: the block's chain with the tree_top_k - 1 next best candidates at each of its first
    # tree_depth positions (K counts every node).
    # group_sam: tree_top_k > 1 drafts that many continuations from the group, differing in their first token,
    # K // tree_top_k deep each (Seer's multi-path drafting; sam_index "match" or "auto"); tree_depth stays unset.
    tree_depth: int | None = None
    tree_top_k: int | None = None
    # medusa / eagle / eagle2 / eagle3 / dflash: the head scores only the N most frequent target tokens (FR-Spec),
    # the first N of a frequency ranking (models/weights/<model>.draft_vocab.json, or <head>.draft_vocab.json beside
    # your own head), so a drafting pass skips most of the LM head; drafts map back to target ids and verification
    # stays lossless. An integer in [1, vocab_size] (the vocabulary size means all of it); unset takes the method's
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
    # method "custom": a jaxspec.proposers.base.Proposer (frozen, hashable; its num_speculative_tokens must equal K)
    # and the pytree its functions take as params.
    proposer: Any = dataclasses.field(default=None, compare=False, repr=False)
    proposer_params: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        defaults = dict(get(self.method).defaults)
        if self.method == "custom":
            check_custom_proposer(self.proposer)
        if self.method == "custom":
            defaults["num_speculative_tokens"] = self.proposer.num_speculative_tokens
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
        if self.method == "custom" and self.proposer.num_speculative_tokens != k:
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
        if self.method == "dflash" and (self.tree_depth, self.tree_top_k) != (None, None):
            m, depth = self.tree_top_k, self.tree_depth
            if not is_integer(m) or m < 2 or not is_integer(depth) or depth < 1 or k - depth * (m - 1) < depth:
                raise ValueError(f"dflash drafts a tree with tree_top_k >= 2 candidates at each of its first "
                                 f"tree_depth >= 1 positions, leaving a chain of num_speculative_tokens - tree_depth "
                                 f"* (tree_top_k - 1) >= tree_depth drafts; got tree_depth={depth!r}, "
                                 f"tree_top_k={m!r}, num_speculative_tokens={k}")
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
                                 f"eagle2, eagle3, dflash), not method={self.method!r}")
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
