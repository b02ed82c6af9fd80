"""The speculation methods: one registry that config, generation, the engine, the server and scripts read.

Each `Method` says what kind of proposer it is, the settings it gets when the caller leaves them unset, what it
needs of the target model (`jaxspec.target`), and whether the serving engine runs it and with what it can share a
batch. How its proposer is built for a model and a batch's shapes is `jaxspec.builders`, which reads this table;
this module imports nothing of jaxspec, so the config and the model contract read it freely. Adding a method
means an entry here and its builder there.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Literal, Mapping

MethodKind = Literal["plain", "lookup", "model", "head", "custom"]


@dataclasses.dataclass(frozen=True)
class Method:
    """One speculation method: what it is, its defaults, what it needs of the target and where it runs."""

    name: str
    kind: MethodKind  # plain (no drafts), lookup (n-gram, suffix automaton), model (a draft LM), head, custom
    summary: str  # one line for help texts and docs
    defaults: Mapping[str, Any]  # SpecConfig settings the method takes when the caller leaves them unset
    head: str | None = None  # the kind of trained head file it runs (kind "head")
    served: bool = False  # the serving engine can compile it in
    # What the target model must offer beyond the core contract (jaxspec.target checks it): "tree" (the forward
    # takes tree_mask), "layers" (self-drafting from its first layers), "features" (hidden states and the
    # readout for heads), "eagle_head" (the config fields an EAGLE head's Llama layer is sized from),
    # "layer_features" (chosen decoder layers' outputs: `return_layers`, for EAGLE-3).
    needs: tuple[str, ...] = ()

    @property
    def shares_batch(self) -> bool:
        """Rows of this method can share one engine batch with rows of any other such method: deterministic
        chain proposers verified by one rule. A head reads the target's features and may draft a tree or a
        sampled chain, so it is served alone (beside `none`)."""
        return self.served and self.kind in ("plain", "lookup")


def _defaults(**settings) -> Mapping[str, Any]:
    return types.MappingProxyType(settings)


# Defaults. The `sam` default is adaptive, tuned for batch 1 on CPU from the measured verify cost c(T)
# (cpu-performance.md): scoring T new tokens costs c(T) plain steps, so a draft pays only when its expected accepted run
# beats c(T) - 1, and the matched suffix length predicts the run. Nothing is drafted below `min_match` tokens, at most
# `draft_per_match` x the match length above it, and each step runs the narrowest verify width holding the batch's
# longest draft (at one row; above one, the width the measured costs favour, `SpecConfig.cost_aware`). On XLA's own
# forward, where 2-5 new tokens cost several plain steps and 9 little more than one, only long matches pay (min_match
# 4, one draft per matched token, widths 9 and 17). With the CPU matmul kernel (docs/cpu-performance.md) c(T) rises
# slowly from about one plain step, so short matches pay: replaying the target's greedy text on tuning prompts
# (docs/concepts/proposers.md) prices rules, and a draft from a single matched token, two drafts per matched token,
# comes first, modelled and end to end on held-out code and chat prompts, at one row and at eight (widths by cost);
# docs/benchmarks.md has the figures. Its widths are 1, 5, 9 and 17: at one row on eight held-out prompts a draft
# of one or two tokens verified at width 5 decodes as fast as at width 3, and each width is one more target forward
# to compile before the first token.
# Trained heads: K counts drafted tokens (eagle, a chain) or tree nodes (medusa, eagle2); 7 and 15 make verify widths 8
# and 16, which XLA:CPU runs cheaply at batch 1 (its general matmul path is efficient again from about 8 rows). They
# draft over the 4096 most frequent tokens (`draft_vocab`, FR-Spec): over the full 49152-wide LM head an EAGLE drafting
# pass costs more than a plain step, over 4096 about a quarter of one, while greedy held-out acceptance keeps 98-100%
# (eagle2 2.53 -> 2.48, eagle 1.92 -> 1.91, medusa 1.90), which turns the heads from slower than plain decoding to
# faster. 2048 drafts are only slightly cheaper but lose twice the acceptance and cover 85-89% of English and chat text
# against 93-95%.
# EAGLE-2/3 draft their 15 nodes best first, and where costs are measured (by default) a step scores only the best
# nodes its c(w) repays, at widths 3, 5 or 9 beside 16 (`SpecConfig.cost_aware`, shapes.TREE_COST_CHOICE_WIDTHS).
# Their trees are 3 levels deep: each level is one more head forward in the drafting pass and widens the head's
# update, and levels 4-6 add little that gets accepted. At one row on held-out prompts, depth 2 loses more
# acceptance than it saves, and depth 3 commits nearly as many tokens a step as depth 6 (eagle3, greedy code: 2.41
# against 2.51) and runs faster, on code and chat, greedy and sampled (docs/benchmarks.md).
_ALL = (
    Method("none", "plain", "plain decoding: no drafts", served=True,
           defaults=_defaults(num_speculative_tokens=0, min_match=1, draft_per_match=math.inf, verify_widths=(1,))),
    Method("ngram", "lookup", "prompt lookup: continue the newest n-gram's earlier occurrence", served=True,
           defaults=_defaults(num_speculative_tokens=8, min_match=2, draft_per_match=math.inf)),
    Method("sam", "lookup", "suffix automaton over the row's text (and a static corpus): adaptive draft length",
           served=True, defaults=_defaults(num_speculative_tokens=16, min_match=1, draft_per_match=2.0,
                                           verify_widths=(1, 5, 9, 17))),
    # Rollouts (jaxspec.rollout): a row drafts from every sample of its prompt. Verify widths 3 and 5 let the
    # rollout's draft policy speculate a little at batch sizes where width 9 does not pay yet.
    Method("group_sam", "lookup", "longest suffix match over every sample of the row's prompt group (rollouts)",
           defaults=_defaults(num_speculative_tokens=8, min_match=2, draft_per_match=math.inf,
                              verify_widths=(1, 3, 5, 9))),
    Method("draft_model", "model", "an independent small model of the same vocabulary drafts a chain",
           defaults=_defaults(num_speculative_tokens=3, min_match=1, draft_per_match=math.inf)),
    Method("self_draft", "model", "the target's first layers with its final norm and LM head draft a chain",
           needs=("layers",), defaults=_defaults(num_speculative_tokens=3, min_match=1, draft_per_match=math.inf)),
    Method("medusa", "head", "Medusa heads draft a static tree from the target's last hidden state",
           head="medusa", served=True, needs=("tree", "features"),
           defaults=_defaults(num_speculative_tokens=15, min_match=1, draft_per_match=math.inf,
                              verify_widths=(1, 16), draft_vocab=4096)),
    Method("eagle", "head", "an EAGLE head drafts a chain (or a static tree) from the target's features",
           head="eagle", served=True, needs=("tree", "features", "eagle_head"),
           defaults=_defaults(num_speculative_tokens=7, min_match=1, draft_per_match=math.inf, verify_widths=(1, 8),
                              draft_vocab=4096)),
    Method("eagle2", "head", "an EAGLE head drafts a dynamic tree (EAGLE-2), expanded by draft confidence",
           head="eagle", served=True, needs=("tree", "features", "eagle_head"),
           defaults=_defaults(num_speculative_tokens=15, min_match=1, draft_per_match=math.inf,
                              verify_widths=(1, 16), tree_depth=3, tree_top_k=4, draft_vocab=4096)),
    # EAGLE-3: a head fusing three of the target's layers, trained on its own drafting steps and on chat as well
    # as code, drafting EAGLE-2's dynamic tree with the same budget and draft vocabulary.
    Method("eagle3", "head", "an EAGLE-3 head (low, middle and high target layers fused) drafts a dynamic tree",
           head="eagle3", served=True, needs=("tree", "features", "eagle_head", "layer_features"),
           defaults=_defaults(num_speculative_tokens=15, min_match=1, draft_per_match=math.inf,
                              verify_widths=(1, 16), tree_depth=3, tree_top_k=4, draft_vocab=4096)),
    # DFlash: a block drafter reading the same three target layers, drafting the whole chain in one forward; K is
    # its block less the anchor (the authors' drafters draft blocks of 16), over the same draft vocabulary.
    Method("dflash", "head", "a DFlash block drafter predicts a whole chain in one forward from the target's layers",
           head="dflash", served=True, needs=("tree", "features", "eagle_head", "layer_features"),
           defaults=_defaults(num_speculative_tokens=15, min_match=1, draft_per_match=math.inf,
                              verify_widths=(1, 16), draft_vocab=4096)),
    Method("custom", "custom", "your own Proposer (SpecConfig.proposer, .proposer_params)",
           defaults=_defaults(min_match=1, draft_per_match=math.inf)),
)
METHODS: Mapping[str, Method] = types.MappingProxyType({m.name: m for m in _ALL})


def names(*, kind: MethodKind | None = None, served: bool | None = None) -> tuple[str, ...]:
    """Method names in registry order, optionally only those of one kind or those the engine does (not) serve."""
    return tuple(m.name for m in _ALL if (kind is None or m.kind == kind) and (served is None or m.served == served))


def get(name: str) -> Method:
    """The method called `name`; ValueError naming it otherwise."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"method={name!r} must be one of {names()}")
    return METHODS[name]


def forced_token_budget(spec) -> int:
    """How many tokens a constrained row of `spec`'s method may draft a step where its constraint forces them:
    `spec.forced_tokens` for the methods that draft deterministic chains or nothing (none, ngram, sam;
    predictions on top of them), 0 for the others (heads, draft models, custom), whose rows are still masked but
    draft no forced tokens (`jaxspec.constraints.rows.wrap`)."""
    return spec.forced_tokens if get(spec.method).kind in ("plain", "lookup") else 0
