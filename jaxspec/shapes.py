"""Shape bucketing: the few static shapes that batches and requests are padded to.

Every distinct shape is a separate compiled program, so prompt widths, output buffers, cache lengths and
batch sizes are rounded up to a handful of buckets: similar requests reuse one program and a new request
never recompiles. `jaxspec.generate` and the serving engine both bucket through this module.
"""

from __future__ import annotations

from typing import Sequence

BUCKET_MIN = 16  # the smallest prompt width and output buffer compiled
CACHE_ALIGN = 128  # cache lengths are multiples of this many slots


def next_pow2(n: int, minimum: int = BUCKET_MIN) -> int:
    """The smallest power of two >= max(n, 1), and at least `minimum`."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def round_up(n: int, align: int) -> int:
    """n rounded up to a multiple of `align`."""
    return -(-n // align) * align


def prompt_bucket(prompt_len: int, cap: int) -> int:
    """The padded width of a prompt of `prompt_len` tokens prefilled alone, at most `cap` (the cache length)."""
    return min(next_pow2(prompt_len), cap)


def bucket_shapes(prompt_lens: Sequence[int], max_new_tokens: int) -> tuple[int, int, int]:
    """(prompt width P, output buffer N, cache slots S) that a batch compiles for.

    A power of two for the prompt and output buffers, the cache aligned to 128 slots, so similar requests
    reuse one program. The cache holds the longest prompt and the output budget and nothing more: whatever the
    method, speculative and plain programs share a bucket. Verification may score drafts past a row's last
    slot; `jaxspec.cache.write_new` drops their K/V, and a row's budget ends before they could be committed.

    The cache is sized from max_new_tokens itself, not from its power-of-two buffer: a row never holds more, and
    a step's attention reads every slot at several rows, so the rounding cost time. 96 new tokens after a
    125-token prompt with K = 8 took 384 slots sized from the buffer (128) and 256 from the budget (when the cache
    still kept K + 1 slots for a draft), and the loop's plain steps at 32 rows ran 12% slower for it.
    """
    width = next_pow2(max(prompt_lens))
    buffer_len = next_pow2(max_new_tokens)
    return width, buffer_len, round_up(max(width, max(prompt_lens) + max_new_tokens), CACHE_ALIGN)


def packed_width(prompt_lens: Sequence[int], width: int) -> int | None:
    """The positions N a prefill of these prompts (padded to `width`) runs its token-wise work over when packed
    end to end (`jaxspec.models.packing`): a power of two holding them all, or None where that saves nothing
    (one row, or rows so alike that N would be rows x width). N is at most half of rows x width, and its few
    values (width, 2 width, ... below rows x width) bound the prefill programs a batch shape compiles."""
    packed = next_pow2(sum(prompt_lens))
    return packed if packed < len(prompt_lens) * width else None


# Verify widths offered beside a method's own when drafts may run long (predicted outputs, forced tokens): a
# step verifies at the narrowest width holding its longest draft, so a short run does not pay for the widest.
LONG_DRAFT_WIDTHS = (9, 17, 33, 65)


# Verify widths offered beside those when forced text is drafted (`generate(constraint=...)`): a forced run (a
# JSON key with its quotes and colon) is 2-4 tokens, and with the CPU matmul kernel a forward over 3 or 5 new
# tokens costs well below one over 9, on the AVX2 and the AVX-512 path alike (docs/cpu-performance.md).
FORCED_TEXT_WIDTHS = (3, 5)


# Verify widths offered beside a chain method's own where each step's width is chosen by measured cost (by
# default, batches of several rows): at 8 rows on XLA:CPU a forward over 2 new tokens per row costs about one plain
# step and one over 3 or 5 well below one over 9, so a step where a few rows draft can still score their first
# drafts cheaply. The table decides which of them a step runs.
COST_CHOICE_WIDTHS = (2, 3, 5)
# ... and beside a tree method's (whose nodes come best first, so a narrower width scores the best smaller tree):
# at one row c(3), c(5) and c(9) each cost clearly less than c(17) (docs/cpu-performance.md).
TREE_COST_CHOICE_WIDTHS = (3, 5, 9)


def _with_widths(widths: Sequence[int], extra: Sequence[int], k: int) -> tuple[int, ...]:
    """`widths` plus the `extra` ones up to K + 1, sorted, each once."""
    return tuple(sorted(set(widths) | {w for w in extra if w <= k + 1}))


def widths_for_forced_text(widths: Sequence[int], k: int) -> tuple[int, ...]:
    """`widths` plus FORCED_TEXT_WIDTHS up to K + 1."""
    return _with_widths(widths, FORCED_TEXT_WIDTHS, k)


def widths_for_long_drafts(widths: Sequence[int], k: int) -> tuple[int, ...]:
    """`widths` plus LONG_DRAFT_WIDTHS up to K + 1, and K + 1."""
    return _with_widths(widths, (*LONG_DRAFT_WIDTHS, k + 1), k)


def widths_for_cost_choice(widths: Sequence[int], k: int, tree: bool = False) -> tuple[int, ...]:
    """`widths` plus COST_CHOICE_WIDTHS (TREE_COST_CHOICE_WIDTHS for a tree) up to K + 1."""
    return _with_widths(widths, TREE_COST_CHOICE_WIDTHS if tree else COST_CHOICE_WIDTHS, k)
