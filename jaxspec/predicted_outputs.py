"""Predicted outputs (speculative edits) for `generate`: the glue between a request's `prediction=` and the
prediction proposer (`jaxspec.proposers.prediction`).

A row's prediction is a text (or token ids) its output is expected to mostly repeat: the file being edited.
The row's proposer is wrapped so that it drafts up to `SpecConfig.prediction_tokens` tokens from the
prediction after a cursor, and falls back to the method's own drafts (n-gram, suffix automaton) where the
prediction has nothing to offer. Output is unchanged by the prediction: drafts are only proposals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from .decode import NoProposer
from .proposers.base import Proposer, drafts_chains
from .proposers.prediction import PredictionProposer, PredictionState, pad_predictions, with_prediction
from .shapes import next_pow2
from .spec_config import SpecConfig

MIN_PREDICTION_WIDTH = 64  # prediction buffers are a power of two wide, at least this: few compiled shapes
RESYNC_NGRAM, RESYNC_MIN_MATCH = 8, 4  # after an edit, re-synchronise on the newest 8..4 output tokens


@dataclasses.dataclass(frozen=True)
class Predictions:
    """Every row's prediction as token ids (None: the row has none), validated."""

    ids: tuple[tuple[int, ...] | None, ...]

    @property
    def width(self) -> int:
        """The prediction buffer width L: a power of two holding the longest prediction."""
        return next_pow2(max((len(p) for p in self.ids if p), default=1), MIN_PREDICTION_WIDTH)

    def padded(self) -> tuple[np.ndarray, np.ndarray]:
        """(i32[B, L] the predictions, i32[B] their lengths)."""
        return pad_predictions([None if p is None else list(p) for p in self.ids], self.width)


def normalise(lm, prediction, batch: int, vocab: int) -> Predictions | None:
    """`generate`'s `prediction=`: None, one text or id list for every row, or one per row (each a string, a
    list of token ids, or None). ValueError naming the bad entry."""
    if prediction is None:
        return None
    rows = [prediction] * batch if isinstance(prediction, str) or _is_ids(prediction) else prediction
    if not isinstance(rows, Sequence) or len(rows) != batch:
        raise ValueError(f"prediction={_short(prediction)} must be a string, a list of token ids, or one of those "
                         f"(or None) per prompt: {batch} entries")
    ids = []
    for i, row in enumerate(rows):
        if row is None:
            ids.append(None)
        elif isinstance(row, str):
            if lm.tokenizer is None:
                raise ValueError(f"prediction[{i}] is text but the model has no tokenizer; pass token ids")
            ids.append(tuple(lm.tokenizer.encode(row, add_special_tokens=False)) or None)
        elif _is_ids(row):
            bad = [t for t in row if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prediction[{i}] holds token id {bad[0]} outside [0, {vocab})")
            ids.append(tuple(int(t) for t in row) or None)
        else:
            raise ValueError(f"prediction[{i}]={_short(row)} must be a string, a list of token ids or None")
    return Predictions(tuple(ids))


def _is_ids(x) -> bool:
    return (isinstance(x, (list, tuple, np.ndarray)) and len(x) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x))


def _short(x, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wrap(proposer: Proposer, spec: SpecConfig, predictions: Predictions) -> PredictionProposer:
    """The row proposer drafting from predictions first, `proposer` (a deterministic chain) otherwise."""
    inner = None if isinstance(proposer, NoProposer) else proposer
    if inner is not None and (inner.needs_features or not drafts_chains(inner)):
        raise ValueError(f"prediction= drafts beside a chain proposer (methods none, ngram, sam, or a custom chain); "
                         f"method={spec.method!r} drafts from the target's features or a tree")
    k = max(spec.prediction_tokens, spec.num_speculative_tokens)
    # Re-synchronising on a 4-token match, not 2: in an unrelated prediction short n-grams of code ("    return")
    # match by chance, and each false match costs a wide verify (with 2-grams it runs no faster than no prediction).
    return PredictionProposer(k, predictions.width, ngram=RESYNC_NGRAM, min_match=RESYNC_MIN_MATCH, inner=inner)


def install(state, predictions: Predictions):
    """The decode state after prefill with each row's prediction in the proposer state."""
    tokens, lengths = predictions.padded()
    return state.replace(pstate=with_prediction(state.pstate, tokens, lengths, state.history, state.history_len,
                                                state.prompt_len, trust_start=False))


def counts(pstate: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(accepted, rejected) prediction tokens per row (host arrays), or None when the state has none."""
    if not isinstance(pstate, PredictionState):
        return None
    return np.asarray(pstate.accepted), np.asarray(pstate.rejected)
