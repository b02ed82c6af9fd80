"""Grouped suffix drafting (`SpecConfig(method="group_sam")`): a row drafts from its whole group.

An RL rollout samples G completions of each prompt, and the G samples of one prompt resemble each other far
more than any corpus does: where one sample writes what a sibling wrote before, the sibling's continuation is
a good draft. Each group's index holds the prompt, every sample's committed tokens (each sample extends its
own string as it commits, so siblings are visible while they are being written) and optional reference
completions of the prompt (an earlier rollout's samples). A row drafts what followed an occurrence, anywhere
in its group, of the longest suffix of its own text that has a continuation.

Two indexes (`index`): the group's texts searched by comparison (`group_match.GroupMatch`: one scatter to
append, a fixed number of array operations to draft, suffixes compared up to `max_match` tokens) and a
generalized suffix automaton (`group_automaton.GroupAutomaton`: amortised O(1) per token, in loops whose trip
counts depend on the data, siblings taking turns). "auto" takes the texts, unless `max_tokens` bounds the
automaton. On a GPU each automaton loop iteration is a kernel launch. On XLA:CPU (a draft and a 2-token append
per row a step) the texts cost less than the automaton at 8 rows, about the same at 32, and about twice as much
at 128, where a plain step of the default model costs far more than either.

Layout. Rows p * G .. p * G + G - 1 of the batch `init` sees form group p: the layout `PrefillSpec(group_size=G)`
produces. Each row keeps its (group, string) indices as per-row state, and the groups' automata are
`BatchShared`, so the slot operations of `jaxspec.engine.slots` can compact, move or drop rows (a rollout's
long tail) while every group's automaton stays whole. With G = 1 every row is its own group: per-row suffix
automaton drafting, as `method="sam"` with a dynamic source.

Drafts are deterministic (`Draft.probs` None): verification judges them by the target alone, so output is
lossless and a seeded run commits exactly the tokens of plain decoding. A group whose automaton fills up
(its capacity is `max_tokens`) stops drafting; decoding goes on unchanged.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from .base import BatchShared, ChainProposer, Committed, Context, Draft, lookup_draft_count
from .index import group_automaton as ga_lib
from .index import group_match as gm_lib
from .sam import SAM_INDEXES


@flax.struct.dataclass
class GroupReferences:
    """Earlier completions of each prompt, used only as draft material (the proposer's params)."""

    tokens: jax.Array  # i32[P, R, L]  R completions per prompt, right-padded
    lengths: jax.Array  # i32[P, R]  their lengths (0: no completion in that place)


@flax.struct.dataclass
class GroupSamState:
    group: jax.Array  # i32[B]  the row's group (its prompt)
    string: jax.Array  # i32[B]  the row's own string in its group's automaton (its sample index)
    automata: BatchShared  # GroupMatch or GroupAutomaton of every group, leading axis P (not B)


@dataclasses.dataclass(frozen=True)
class GroupSamProposer(ChainProposer):
    """Drafting from the group's texts or generalized suffix automaton; params: `GroupReferences` or None."""

    num_speculative_tokens: int  # K
    group_size: int  # G: consecutive rows per group at init
    prompt_width: int  # P_w: the prompt bucket (every string starts with its group's prompt)
    buffer_len: int  # the most tokens a sample commits (its output buffer)
    min_match: int = 2  # propose nothing below this matched suffix length
    draft_per_match: float | None = None  # at most ceil(draft_per_match * match_len) drafts
    max_tokens: int | None = None  # tokens one group's automaton holds; None: all it can ever be given
    index: str = "auto"  # "match" | "automaton" | "auto" (see the module docstring)
    max_match: int = gm_lib.MAX_MATCH  # the "match" index compares suffixes up to this length
    # > 1: a tree of this many continuations that differ in their first token, K // paths deep each (Seer's
    # multi-path drafting; the "match" index only). Verification follows whichever the target agrees with.
    paths: int = 1

    def __post_init__(self):
        for name in ("num_speculative_tokens", "group_size", "prompt_width", "buffer_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be None or >= 1")
        if self.index not in SAM_INDEXES:
            raise ValueError(f"index={self.index!r} must be one of {SAM_INDEXES}")
        if self.max_tokens is not None and self.index == "match":
            raise ValueError(f"max_tokens={self.max_tokens} bounds the automaton index; index='match' holds every "
                             "text whole")
        if self.max_match < 1:
            raise ValueError(f"max_match={self.max_match!r} must be >= 1")
        if self.paths < 1 or self.num_speculative_tokens % self.paths:
            raise ValueError(f"paths={self.paths!r} must be >= 1 and divide num_speculative_tokens="
                             f"{self.num_speculative_tokens}")
        if self.paths > 1 and not self.uses_match_index:
            raise ValueError(f"paths={self.paths} drafts from the texts index; index={self.index!r}, max_tokens="
                             f"{self.max_tokens!r} take the automaton")

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept: K for a chain, each path's depth for a tree."""
        return self.num_speculative_tokens // self.paths

    @property
    def uses_match_index(self) -> bool:
        """Whether each group's index is its texts, searched by comparison (else a suffix automaton)."""
        if self.index != "auto":
            return self.index == "match"
        return self.max_tokens is None

    def capacity(self, num_references: int = 0, reference_len: int = 0) -> int:
        """Tokens one group's automaton must hold for everything: the prompt, every sample's output, the
        references (or `max_tokens` when set). The texts index holds them all by construction."""
        if self.max_tokens is not None:
            return self.max_tokens
        return self.prompt_width + self.group_size * self.buffer_len + num_references * reference_len

    def index_bytes(self, num_references: int = 0, reference_len: int = 0) -> int:
        """Device bytes of one group's index (`GroupMatch.create`'s or `GroupAutomaton.create`'s tables)."""
        strings, width = self.group_size + num_references, self.prompt_width + max(self.buffer_len, reference_len)
        if self.uses_match_index:
            return gm_lib.GroupMatch.nbytes(strings, width)
        return ga_lib.GroupAutomaton.nbytes(strings, width, max_tokens=self.capacity(num_references, reference_len))

    def init(self, params: GroupReferences | None, ctx: Context) -> GroupSamState:
        """Each group's index: its prompt once, the references, then each row's first token."""
        batch = ctx.history.shape[0]
        g = self.group_size
        if batch % g:
            raise ValueError(f"a batch of {batch} rows is not whole groups of group_size={g}")
        num_groups = batch // g
        num_refs, ref_len = (0, 0) if params is None else params.tokens.shape[1:]
        if params is not None and params.tokens.shape[0] != num_groups:
            raise ValueError(f"references for {params.tokens.shape[0]} prompts; the batch has {num_groups} groups")
        width = self.prompt_width + max(self.buffer_len, ref_len)
        if self.uses_match_index:
            lib, automata = gm_lib, gm_lib.GroupMatch.create(num_groups, g + num_refs, width)
        else:
            lib, automata = ga_lib, ga_lib.GroupAutomaton.create(num_groups, g + num_refs, width,
                                                                 max_tokens=self.capacity(num_refs, ref_len))
        leaders = slice(None, None, g)  # row p * G, the group's first sample: its prompt is the group's
        # At init each row holds its prompt and the first token prefill sampled.
        automata = lib.start(automata, ctx.history[leaders].astype(jnp.int32),
                             (ctx.history_len[leaders] - 1).astype(jnp.int32))
        for j in range(num_refs):
            automata = lib.extend_groups(automata, jnp.full((num_groups,), g + j, jnp.int32),
                                         params.tokens[:, j].astype(jnp.int32), params.lengths[:, j].astype(jnp.int32))
        rows = jnp.arange(batch, dtype=jnp.int32)
        group, string = rows // g, rows % g
        first = jnp.take_along_axis(ctx.history, (ctx.history_len - 1)[:, None], axis=1).astype(jnp.int32)
        automata = lib.extend_rows(automata, group, string, first, jnp.ones((batch,), jnp.int32))
        return GroupSamState(group=group, string=string, automata=BatchShared(automata))

    def propose(self, params, pstate: GroupSamState, ctx: Context, keys: jax.Array) -> tuple[Draft, GroupSamState]:
        """The continuation of the longest suffix of each row's text seen with one anywhere in its group."""
        k = self.num_speculative_tokens
        index = pstate.automata.value
        if self.paths > 1:
            return self._propose_paths(index, pstate, ctx), pstate
        if isinstance(index, gm_lib.GroupMatch):
            tokens, match_len, available = gm_lib.draft_rows(index, pstate.group, pstate.string, k, self.max_match)
        else:
            tokens, match_len, available = ga_lib.draft_rows(index, pstate.group, pstate.string, k)
        num_draft = lookup_draft_count(match_len, available, ctx.max_draft, k, self.min_match, self.draft_per_match)
        tokens = jnp.where(jnp.arange(k) < num_draft[:, None], tokens, 0).astype(jnp.int32)
        return Draft(tokens=tokens, num_draft=num_draft, probs=None, match_len=match_len.astype(jnp.int32)), pstate

    def _propose_paths(self, index: gm_lib.GroupMatch, pstate: GroupSamState, ctx: Context) -> Draft:
        """A tree of `paths` chains under the root, best match first: token i = c * D + d is path c's d-th
        draft (D = K // paths), under the root when d = 0, else under its predecessor. num_draft counts nodes
        up to the last path that drafts; a shorter path earlier keeps its unreal nodes (verification judges
        them like any other: they cost width, never a wrong token)."""
        depth = self.max_depth
        tokens, match_len, available = gm_lib.draft_paths(index, pstate.group, pstate.string, depth, self.paths,
                                                          self.max_match)  # [B, paths, D], [B, paths] x 2
        batch = tokens.shape[0]
        per_path = lookup_draft_count(match_len.reshape(-1), available.reshape(-1),
                                      jnp.repeat(ctx.max_draft, self.paths), depth, self.min_match,
                                      self.draft_per_match).reshape(batch, self.paths)  # i32[B, paths]
        # Matches shorten path by path, so the paths that draft come first.
        drafting = jnp.sum(per_path > 0, axis=1)  # i32[B]
        last = jnp.take_along_axis(per_path, jnp.maximum(drafting - 1, 0)[:, None], axis=1)[:, 0]
        num_draft = jnp.where(drafting > 0, (drafting - 1) * depth + last, 0)
        d = jnp.arange(self.num_speculative_tokens, dtype=jnp.int32) % depth
        parents = jnp.where(d == 0, 0, jnp.arange(self.num_speculative_tokens, dtype=jnp.int32))  # node i+1 under i
        return Draft(tokens=tokens.reshape(batch, -1).astype(jnp.int32), num_draft=num_draft.astype(jnp.int32),
                     probs=None, match_len=match_len[:, 0].astype(jnp.int32),
                     parents=jnp.broadcast_to(parents, (batch, self.num_speculative_tokens)))

    def update(self, params, pstate: GroupSamState, ctx: Context, committed: Committed) -> GroupSamState:
        """Each row's string extended by committed.tokens[b, :committed.num[b]] (siblings one at a time)."""
        index = pstate.automata.value
        extend = gm_lib.extend_rows if isinstance(index, gm_lib.GroupMatch) else ga_lib.extend_rows
        automata = extend(index, pstate.group, pstate.string, committed.tokens.astype(jnp.int32),
                          committed.num.astype(jnp.int32))
        return pstate.replace(automata=BatchShared(automata))

    def catch_up(self, pstate: GroupSamState, texts: jax.Array, lengths: jax.Array) -> GroupSamState:
        """Every sample's string brought up to its text: texts i32[P * G, H] (sample p * G + g: prompt p's g-th,
        whatever batch row holds it, or none does any more), lengths i32[P * G]. What a string already holds
        is not appended again (`group_automaton.catch_up`, `group_match.catch_up`)."""
        automata = pstate.automata.value
        num_groups = automata.texts.shape[0]
        texts = jnp.asarray(texts, jnp.int32).reshape(num_groups, self.group_size, -1)
        lengths = jnp.asarray(lengths, jnp.int32).reshape(num_groups, self.group_size)
        catch_up = _match_catch_up if isinstance(automata, gm_lib.GroupMatch) else _automaton_catch_up
        return pstate.replace(automata=BatchShared(catch_up(automata, texts, lengths)))


_automaton_catch_up = jax.jit(ga_lib.catch_up, donate_argnums=0)
_match_catch_up = jax.jit(gm_lib.catch_up, donate_argnums=0)
