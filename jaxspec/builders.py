"""How each method's proposer is built for a model and a batch's shapes: the builders behind the registry
(`jaxspec.methods`), and what they load (the shipped corpus, trained heads, their draft vocabulary).
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any, Callable

from flax import nnx

from .decode import NoProposer
from .graphdefs import hashed
from .methods import METHODS, get
from .models.corpus import load_corpus, shipped_corpus_path
from .models.eagle_files import drafter_kind, load_reference_drafter
from .models.heads import Readout, draft_vocab_path, load_draft_vocab, load_head, named_head_path
from .models.llama import Llama
from .models.loading import LanguageModel
from .proposers.base import Proposer
from .proposers.dflash import DFlashProposer
from .proposers.draft_model import DraftModelProposer, self_draft_model
from .proposers.eagle import EagleProposer
from .proposers.group_sam import GroupSamProposer
from .proposers.index.suffix_automaton import StaticSuffixAutomaton
from .proposers.medusa import MedusaProposer
from .proposers.ngram import NgramProposer
from .proposers.sam import SamProposer
from .target import check_target
from .tree import TreeTopology


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The static shapes a proposer is built for: prompt width P, output buffer N, cache slots S, and the rows
    per group G (samples of one prompt, consecutive in the batch; 1 outside rollouts)."""

    prompt_width: int
    buffer_len: int
    cache_len: int
    group_size: int = 1


def _build_none(lm, spec, shapes):
    return NoProposer(), None


def _build_custom(lm, spec, shapes):
    return spec.proposer, spec.proposer_params


def _build_ngram(lm, spec, shapes):
    return NgramProposer(spec.num_speculative_tokens, ngram_max=spec.ngram_max, min_match=spec.min_match,
                         draft_per_match=spec.draft_per_match), None


def _check_static_sam(lm: LanguageModel, static_sam) -> None:
    """A static automaton must hold only token ids the target can embed."""
    if not isinstance(static_sam, StaticSuffixAutomaton):
        raise ValueError(f"static_sam={static_sam!r} must be a jaxspec.StaticSuffixAutomaton")
    vocab = lm.config.vocab_size
    low, high = static_sam.min_token_id(), static_sam.max_token_id()
    if low < 0 or high >= vocab:
        raise ValueError(f"static_sam holds token id {low if low < 0 else high} outside [0, {vocab}): its corpus "
                         f"must come from the vocabulary of {lm.name!r}")


def sam_source_for(lm: LanguageModel, spec) -> str:
    """The source sam drafts from for `lm`: `spec.sam_source`, with "auto" resolved to "both" where the user
    passed a corpus (`static_sam`) and to "dynamic" (the row's own text) everywhere else, on every platform.

    The corpus shipped for a model is an explicit opt-in (`sam_source="static"` or `"both"` without
    `static_sam`). It holds the model's completions of HumanEval's training split, so what it adds depends on how
    close a user's prompts are to those: on held-out HumanEval prompts sam runs faster with it than without, on
    code far from it a few percent slower at one row (docs/benchmarks.md has the figures).
    `jaxspec corpus` builds a corpus from the user's own prompts or documents (docs/how-to/sam-corpus.md)."""
    if spec.sam_source != "auto":
        return spec.sam_source
    return "both" if spec.static_sam is not None else "dynamic"


def _build_sam(lm, spec, shapes):
    source, static_sam = sam_source_for(lm, spec), spec.static_sam
    if source != "dynamic":
        static_sam = shipped_static_sam(lm) if static_sam is None else static_sam
        _check_static_sam(lm, static_sam)
    return SamProposer(spec.num_speculative_tokens, max_text_len=shapes.prompt_width + shapes.buffer_len,
                       source=source, index=spec.sam_index, min_match=spec.min_match,
                       draft_per_match=spec.draft_per_match), static_sam


_CORPORA: dict = {}  # (path, modification time, vocab size) -> StaticSuffixAutomaton


def shipped_static_sam(lm: LanguageModel) -> StaticSuffixAutomaton:
    """The suffix automaton of the draft corpus shipped for `lm` (`jaxspec.models.corpus`), built once per file:
    what `SpecConfig(sam_source="static" | "both")` drafts from when `static_sam` is unset. ValueError where no
    corpus is shipped for the model."""
    path = shipped_corpus_path(lm.name)
    key = (str(path), path.stat().st_mtime_ns, lm.config.vocab_size)
    if key not in _CORPORA:
        sequences, separator = load_corpus(path, lm.config.vocab_size)
        _CORPORA[key] = StaticSuffixAutomaton.build(sequences, separator)
    return _CORPORA[key]


def _build_group_sam(lm, spec, shapes):
    return GroupSamProposer(spec.num_speculative_tokens, group_size=shapes.group_size,
                            prompt_width=shapes.prompt_width, buffer_len=shapes.buffer_len, min_match=spec.min_match,
                            draft_per_match=spec.draft_per_match, index=spec.sam_index,
                            paths=spec.tree_top_k or 1), None


def _build_draft_model(lm, spec, shapes):
    draft = spec.draft_model if spec.method == "draft_model" else self_draft_model(lm, spec.self_draft_layers)
    if draft.config.vocab_size != lm.config.vocab_size:
        raise ValueError(f"draft_model {draft.name!r} has vocab_size={draft.config.vocab_size}; the target "
                         f"{lm.name!r} has {lm.config.vocab_size}: they must share one vocabulary")
    if draft.tokenizer is not None and lm.tokenizer is not None:
        i = lm.tokenizer.first_difference(draft.tokenizer)
        if i is not None:
            raise ValueError(f"draft_model {draft.name!r} has another tokenizer than the target {lm.name!r}: token "
                             f"{i} is {_entry(draft.tokenizer, i)} there and {_entry(lm.tokenizer, i)} in the "
                             f"target; they must share one vocabulary")
    return DraftModelProposer(spec.num_speculative_tokens, draft.graphdef, cache_len=shapes.cache_len,
                              prompt_width=shapes.prompt_width), draft.params


def _entry(tokenizer, i: int) -> str:
    token = tokenizer.backend.id_to_token(i)
    return "absent" if token is None else repr(token)


_HEADS: dict = {}  # (path, modification time, target config) -> (graphdef, params, metadata)


def _head_file(lm: LanguageModel, spec) -> Path:
    """The head file `spec` runs: its `head_path` (.safetensors appended when missing; an EAGLE or EAGLE-3
    drafter's directory in its authors' layout as it is), or the one shipped for `lm`."""
    path = Path(spec.head_path) if spec.head_path is not None else named_head_path(lm.name, get(spec.method).head)
    if drafter_kind(path) is not None:
        return path
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    if not path.exists():
        raise ValueError(f"head_path={str(spec.head_path)!r}: no head file at {str(path)!r}")
    return path


def trained_head(lm: LanguageModel, spec) -> tuple[Any, Any, dict]:
    """(graphdef, params, metadata) of the head `spec` runs: its `head_path`, or the one shipped for `lm`."""
    kind = get(spec.method).head
    path = _head_file(lm, spec)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    key = (str(path.resolve()), tuple(f.stat().st_mtime_ns for f in files), lm.config)
    if key not in _HEADS:
        head, meta = load_reference_drafter(path, lm.config) if path.is_dir() else load_head(path, lm.config)
        graphdef, params = nnx.split(head)
        _HEADS[key] = (hashed(graphdef), params, meta)  # the proposer holding it is a static jit argument
    meta = _HEADS[key][2]
    if meta.get("kind") != kind:
        raise ValueError(f"head_path={str(path)!r} holds a {meta.get('kind')!r} head; method="
                         f"{spec.method!r} needs a {kind!r} head")
    return _HEADS[key]


def medusa_topology(meta: dict, budget: int) -> TreeTopology:
    """The static tree for a Medusa head: best-first over its measured rank accuracies (`rank_probs`, stored
    by training), or the default prior when the file has none."""
    if meta.get("rank_probs"):
        return TreeTopology.best_first(meta["rank_probs"], budget)
    return TreeTopology.default(depth=int(meta["num_heads"]), top_k=4, budget=budget)


# id of the target's lm_head array -> (a weak reference to it, {(ranking file, its mtime, N): Readout columns}):
# slicing N columns out of a [D, V] LM head copies N * D floats, so each is made once per target array and
# forgotten with it.
_DRAFT_COLUMNS: dict[int, tuple[weakref.ref, dict]] = {}


def draft_readout(lm: LanguageModel, spec) -> Readout:
    """The readout the head of `spec` drafts through: the target's own, or over `spec.draft_vocab` = N < V tokens
    its LM head's columns [D, N] of the first N ids of the head's ranking (`draft_vocab_path`) and those ids."""
    readout = Readout.of(lm.params)
    n, vocab = spec.draft_vocab, lm.config.vocab_size
    if n is None or n == vocab:
        return readout
    if n > vocab:
        raise ValueError(f"draft_vocab={n} must be in [1, {vocab}]: the vocabulary of {lm.name!r}")
    path = draft_vocab_path(_head_file(lm, spec), lm.name)
    lm_head = readout.lm_head
    ref, by_ranking = _DRAFT_COLUMNS.get(id(lm_head), (None, None))
    if ref is None or ref() is not lm_head:
        by_ranking = {}
        _DRAFT_COLUMNS[id(lm_head)] = (weakref.ref(lm_head), by_ranking)
        weakref.finalize(lm_head, _DRAFT_COLUMNS.pop, id(lm_head), None)
    key = (str(path.resolve()), path.stat().st_mtime_ns, n)
    if key not in by_ranking:
        ranking = load_draft_vocab(path, vocab)
        if n > len(ranking):
            raise ValueError(f"draft_vocab={n} exceeds the {len(ranking)} ids ranked in {str(path)!r}")
        restricted = readout.restrict(ranking[:n])
        by_ranking[key] = (restricted.lm_head, restricted.ids)
    columns, ids = by_ranking[key]
    return readout.replace(lm_head=columns, ids=ids)


def _build_head(lm, spec, shapes):
    # jaxspec's own Llama meets every method's contract (its tests trace it); another target's forward is traced.
    check_target(lm, spec.method, trace=type(lm.module) is not Llama)
    graphdef, head_params, meta = trained_head(lm, spec)
    trained_over = (meta.get("head") or {}).get("draft_vocab")
    if spec.method == "dflash" and spec.draft_vocab is None and trained_over:
        # A DFlash drafter trained over a draft vocabulary scores only those columns well: it drafts over them.
        spec = dataclasses.replace(spec, draft_vocab=trained_over)
    target_readout = draft_readout(lm, spec)
    readout = nnx.merge(graphdef, head_params).draft_readout(target_readout)
    if spec.draft_vocab is not None and readout.lm_head is not target_readout.lm_head:
        raise ValueError(f"draft_vocab={spec.draft_vocab} does not apply to head_path={spec.head_path!r}: that "
                         f"drafter scores its own draft vocabulary of {readout.lm_head.shape[1]} tokens")
    params = {"head": head_params, "readout": readout}
    k = spec.num_speculative_tokens
    if spec.method == "medusa":
        return MedusaProposer(k, graphdef, medusa_topology(meta, k)), params
    if spec.method == "dflash":
        drafter = nnx.merge(graphdef, head_params)
        return DFlashProposer(k, graphdef, cache_len=shapes.cache_len, block_size=drafter.block_size,
                              feature_layers=drafter.feature_layers, tree_top_k=spec.tree_top_k or 1,
                              tree_depth=spec.tree_depth or 0), params
    if spec.method in ("eagle2", "eagle3"):
        return EagleProposer(k, graphdef, cache_len=shapes.cache_len, mode="tree", depth=spec.tree_depth,
                             top_k=spec.tree_top_k, feature_layers=tuple(meta.get("feature_layers") or ())), params
    if spec.tree_depth is not None:
        return EagleProposer(k, graphdef, cache_len=shapes.cache_len, mode="static",
                             topology=TreeTopology.default(spec.tree_depth, spec.tree_top_k, k)), params
    return EagleProposer(k, graphdef, cache_len=shapes.cache_len), params


Builder = Callable[[LanguageModel, Any, Shapes], tuple[Proposer, Any]]  # (lm, SpecConfig, Shapes) -> (P, params)
_BUILDERS: dict[str, Builder] = {
    "none": _build_none, "ngram": _build_ngram, "sam": _build_sam, "group_sam": _build_group_sam,
    "draft_model": _build_draft_model, "self_draft": _build_draft_model, "medusa": _build_head, "eagle": _build_head,
    "eagle2": _build_head, "eagle3": _build_head, "dflash": _build_head, "custom": _build_custom,
}
if set(_BUILDERS) != set(METHODS):  # a method added to the registry needs its builder here
    raise ImportError(f"methods without a builder: {sorted(set(METHODS) - set(_BUILDERS))}; builders without a "
                      f"method: {sorted(set(_BUILDERS) - set(METHODS))}")


def build_proposer(lm: LanguageModel, spec, *, prompt_width: int, buffer_len: int, cache_len: int,
                   group_size: int = 1) -> tuple[Proposer, Any]:
    """The proposer (static settings) and its params (a pytree passed to the device) for `spec` (a SpecConfig)
    over batches of the given shapes (`group_size` consecutive rows per prompt group)."""
    get(spec.method)  # ValueError naming an unknown method
    return _BUILDERS[spec.method](lm, spec, Shapes(prompt_width, buffer_len, cache_len, group_size))
