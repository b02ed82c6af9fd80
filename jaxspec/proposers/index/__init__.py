"""The index structures lookup proposers draft from: where else has the text a row ends with appeared, and what
followed it there.

Two questions, each with two indexes that answer it identically (the tests check them against each other):

- a row's own text: `suffix_automaton` (a suffix automaton built token by token, amortised O(1) per token) and
  `suffix_match` (the longest match per position, found by comparing tokens: loop-free, the faster one where
  texts are short), both with `build_batch`, `extend_many_batch` and `draft_batch`; `suffix_automaton` also
  holds the static automaton over a corpus;
- a rollout group's texts: `group_automaton` and `group_match`, both with `start`, `catch_up`, `extend_rows`,
  `extend_groups` and `draft_rows`.

Every function is pure and jittable: an index is a pytree of fixed-capacity arrays, updated by returning a new
one.
"""
