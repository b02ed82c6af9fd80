"""Suffix automaton proposer: draft what followed the longest earlier occurrence of the row's current suffix.

Sources (SAM-Decoding): "dynamic", an automaton of the row's own text (prompt + output), built after prefill
and extended with every committed token; "static", an automaton of a fixed corpus (`StaticSuffixAutomaton`,
built on the host, passed as `params`), matched incrementally against the row's text; "both": the source with
the longer match drafts (the dynamic one on a tie).

Deterministic: `Draft.probs` is None. `Draft.match_len` is the matched suffix length behind the draft.

The dynamic source has two indexes that draft the same tokens (`index`): the suffix automaton
(`suffix_automaton`), amortised O(1) work per token in loops whose trip counts depend on the data, and the
match-length array (`suffix_match`), O(L * T) work per step (L the most tokens a step commits) in a fixed
number of array operations. "auto" takes the array on accelerators, where each loop iteration is a kernel
launch and a host round trip (the automaton's update costs more than a plain decode step there), and on a CPU
up to `MATCH_MAX_TEXT_LEN` tokens of text, where it is also the faster of the two at 1, 8 and 32 rows (T = 2048,
7 tokens appended a step). Past that its O(L * T) comparisons cost more than the automaton's walks at eight rows
(several times more at T = 16384).

Each index keeps its own copy of the row's text (drafts are read from it), so `propose` and `update` never read
`ctx.history`; `init` reads history[:, :history_len]. Memory per row for max_text_len T: 8 T bytes for the array
(plus a temporary 4 L T per step); about (32 + 16 * S/T + 4) * T bytes for the automaton, with S = the power of
two >= 6T (335 KB for T = 2048). A row whose text outgrows T stops drafting from the dynamic source (with
"both", the static source still drafts).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import flax.struct
import jax
import jax.numpy as jnp

from .base import ChainProposer, Committed, Context, Draft, lookup_draft_count
from .index import suffix_automaton as sam_lib
from .index import suffix_match
from .index.suffix_automaton import StaticMatch, StaticSuffixAutomaton, SuffixAutomaton
from .index.suffix_match import SuffixMatch

# How a row's own text is searched: "match" compares tokens (`suffix_match`), "automaton" walks a suffix
# automaton (`suffix_automaton`), "auto" chooses by platform and text length (`SamProposer._match`).
SamIndex = Literal["auto", "match", "automaton"]
SAM_INDEXES = get_args(SamIndex)
MATCH_MAX_TEXT_LEN = 4096  # index "auto" on a CPU: the match-length array up to this capacity, the automaton past it


@flax.struct.dataclass
class SamState:
    dynamic: SuffixAutomaton | SuffixMatch | None  # per row (leading axis B); None for source "static"
    static: StaticMatch | None  # per row; None for source "dynamic"


@dataclasses.dataclass(frozen=True)
class SamProposer(ChainProposer):
    """Suffix-automaton drafting (`SpecConfig(method="sam")`); params: a StaticSuffixAutomaton or None."""

    num_speculative_tokens: int  # K
    max_text_len: int  # the dynamic automaton's capacity (prompt bucket + output buffer); past it: no drafts
    source: str = "dynamic"  # "dynamic" | "static" | "both"
    min_match: int = 2  # propose nothing below this matched suffix length
    draft_per_match: float | None = None  # at most ceil(draft_per_match * match_len) drafts
    index: str = "auto"  # the dynamic source's index: "match" | "automaton" | "auto" (see the module docstring)

    def __post_init__(self):
        if self.source not in ("dynamic", "static", "both"):
            raise ValueError(f"source={self.source!r} must be 'dynamic', 'static' or 'both'")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be >= 1")
        if self.max_text_len < 1:
            raise ValueError(f"max_text_len={self.max_text_len!r} must be >= 1")
        if self.index not in SAM_INDEXES:
            raise ValueError(f"index={self.index!r} must be one of {SAM_INDEXES}")

    @property
    def uses_match_index(self) -> bool:
        """Whether the dynamic source is the match-length array (else the suffix automaton)."""
        if self.index != "auto":
            return self.index == "match"
        return jax.default_backend() != "cpu" or self.max_text_len <= MATCH_MAX_TEXT_LEN

    @property
    def uses_corpus(self) -> bool:
        """Drafts from a static corpus (`jaxspec.proposers.base.Proposer.uses_corpus`)."""
        return self._static

    @property
    def _dynamic(self) -> bool:
        return self.source in ("dynamic", "both")

    @property
    def _static(self) -> bool:
        return self.source in ("static", "both")

    def _check_params(self, params):
        if self._static and not isinstance(params, StaticSuffixAutomaton):
            raise ValueError(f"source={self.source!r} needs params = a StaticSuffixAutomaton, got {type(params)}")

    def init(self, params, ctx: Context) -> SamState:
        """Feed each row's history (prompt + first generated token) to its automaton / corpus match."""
        self._check_params(params)
        batch = ctx.history.shape[0]
        dynamic = static = None
        if self._dynamic:
            index = suffix_match if self.uses_match_index else sam_lib
            dynamic = index.build_batch(ctx.history, ctx.history_len, self.max_text_len)
        if self._static:
            static = sam_lib.static_feed_batch(params, StaticMatch.create(batch), ctx.history.astype(jnp.int32),
                                               ctx.history_len.astype(jnp.int32))
        return SamState(dynamic=dynamic, static=static)

    def propose(self, params, pstate: SamState, ctx: Context, keys: jax.Array) -> tuple[Draft, SamState]:
        """The tokens after the longest earlier occurrence of each row's suffix, from the chosen source(s)."""
        k = self.num_speculative_tokens
        if self._dynamic:
            tokens, match_len, available = _index_of(pstate.dynamic).draft_batch(pstate.dynamic, k)
        if self._static:
            s_tokens, s_match, s_available = sam_lib.static_draft_batch(params, pstate.static, k)
            if self._dynamic:
                use_static = s_match > match_len
                tokens = jnp.where(use_static[:, None], s_tokens, tokens)
                match_len = jnp.where(use_static, s_match, match_len)
                available = jnp.where(use_static, s_available, available)
            else:
                tokens, match_len, available = s_tokens, s_match, s_available
        num_draft = lookup_draft_count(match_len, available, ctx.max_draft, k, self.min_match, self.draft_per_match)
        tokens = jnp.where(jnp.arange(k) < num_draft[:, None], tokens, 0).astype(jnp.int32)
        return Draft(tokens=tokens, num_draft=num_draft, probs=None, match_len=match_len.astype(jnp.int32)), pstate

    def update(self, params, pstate: SamState, ctx: Context, committed: Committed) -> SamState:
        """Extend with committed.tokens[b, :committed.num[b]] (ctx already holds them)."""
        tokens, num = committed.tokens.astype(jnp.int32), committed.num.astype(jnp.int32)
        dynamic, static = pstate.dynamic, pstate.static
        if self._dynamic:
            dynamic = _index_of(dynamic).extend_many_batch(dynamic, tokens, num)
        if self._static:
            static = sam_lib.static_feed_batch(params, static, tokens, num)
        return SamState(dynamic=dynamic, static=static)


def _index_of(dynamic: SuffixAutomaton | SuffixMatch):
    """The module of the row index `dynamic` (`jaxspec.proposers.index`): both answer the same verbs."""
    return suffix_match if isinstance(dynamic, SuffixMatch) else sam_lib
