"""Proposers: pure functions that draft tokens for the target to verify (see base.Proposer)."""

from .base import ChainProposer, Committed, Context, Draft, Proposer
from .dflash import DFlashProposer, DFlashState
from .draft_model import DraftModelProposer, self_draft_model
from .eagle import EagleProposer, EagleState
from .index.suffix_automaton import StaticSuffixAutomaton, SuffixAutomaton
from .index.suffix_match import SuffixMatch
from .medusa import MedusaProposer
from .ngram import NgramProposer
from .prediction import PredictionProposer, PredictionState, with_prediction
from .sam import SamProposer

__all__ = [
    "ChainProposer",
    "Committed",
    "Context",
    "DFlashProposer",
    "DFlashState",
    "Draft",
    "DraftModelProposer",
    "EagleProposer",
    "EagleState",
    "MedusaProposer",
    "NgramProposer",
    "PredictionProposer",
    "PredictionState",
    "Proposer",
    "SamProposer",
    "StaticSuffixAutomaton",
    "SuffixAutomaton",
    "SuffixMatch",
    "self_draft_model",
    "with_prediction",
]
