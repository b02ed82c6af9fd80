"""Structured output: constraints compiled to token-level automata held on the device.

A spec (`Regex`, `JsonSchema`, `Choice`) compiles, with outlines-core, to a `TokenAutomaton` over a tokenizer's
vocabulary (`compile_constraint`, cached). The decode loop keeps one i32 state per row and calls pure, jittable
functions on it: `allowed_mask` / `mask_logits` before sampling, `advance` / `states_along` / `advance_many`
along drafts, `forced_token` to draft tokens the constraint leaves no choice about. `stack` merges the automata
of a batch's rows (FREE for rows without a constraint) into one set of arrays. `jaxspec.constraints.rows` is
the loop's side: each row's state, the masks at every verified position, and the forced-token proposer.

outlines-core rather than llguidance or xgrammar: it gives the whole automaton up front, as explicit
state -> token -> next-state maps, which become device arrays that a jitted loop indexes without the host.
llguidance and xgrammar run pushdown automata (context-free grammars) on the host and compute each step's
mask there from the parser's stack, which a device-resident loop cannot do between its steps.

Compiling is bounded (`ConstraintLimits`): the spec's text is checked first (repetition counts, $ref expansion,
enum sizes: `ConstraintTooLarge`, a ValueError naming the limit and the offending part), then outlines-core runs
in a worker process (`compiler`) within a time and memory budget, killed on timeout or when `cancel` is set.

    aut = compile_constraint(JsonSchema(schema), lm.tokenizer, lm.config.vocab_size)
    state = jnp.full((batch,), INITIAL)       # per step, inside the jitted loop:
    logits = mask_logits(aut, state, logits)  # then sample `token`
    state = advance(aut, state, token)
"""

from .automaton import (
    DEAD,
    FREE,
    INITIAL,
    TokenAutomaton,
    advance,
    advance_many,
    allowed_mask,
    forced_token,
    is_final,
    jump_token,
    mask_logits,
    states_along,
)
from .compile import clear_cache, compile_constraint
from .compiler import CompileCancelled, CompilerBusy
from .limits import ConstraintLimits, ConstraintTooLarge
from .spec import COMPACT_WHITESPACE, SPACED_WHITESPACE, Choice, Constraint, JsonSchema, Regex
from .stack import stack

__all__ = [
    "COMPACT_WHITESPACE",
    "SPACED_WHITESPACE",
    "DEAD",
    "FREE",
    "INITIAL",
    "Choice",
    "CompileCancelled",
    "CompilerBusy",
    "Constraint",
    "ConstraintLimits",
    "ConstraintTooLarge",
    "JsonSchema",
    "Regex",
    "TokenAutomaton",
    "advance",
    "advance_many",
    "allowed_mask",
    "clear_cache",
    "compile_constraint",
    "forced_token",
    "is_final",
    "jump_token",
    "mask_logits",
    "stack",
    "states_along",
]
