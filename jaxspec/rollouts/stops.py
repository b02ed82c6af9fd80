"""Stop strings in a rollout: which running samples have written one, checked between chunks so they leave the batch.

Execution-based RL rewards cut a completion at a marker (the end of a function: "\\ndef ", "\\nclass ", ...), and
the tokens after it are wasted work. A stop string can span tokens and end mid-token, so it is found in the decoded
text, on the host, after each chunk; a sample that has written one is marked done and leaves the batch at the next
compaction. Where it is cut is decided afterwards from its tokens alone (`jaxspec.generation.cut_at_stop_string`,
as `generate(stop=...)` cuts), so the result does not depend on the chunk it was found in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..text import TextStream


class StopStrings:
    """Per running sample an incremental detokenizer that watches for its prompt's stop strings."""

    def __init__(self, tokenizer, per_prompt: Sequence[Sequence[str]], num_samples: int, prompt_lens: np.ndarray):
        self.tokenizer = tokenizer
        self.per_prompt = [tuple(s) for s in per_prompt]  # P entries, () where a prompt has none
        self.num_samples = num_samples
        self.prompt_lens = prompt_lens  # i32[P]
        self._streams: dict[int, TextStream] = {}  # sample -> its text so far, fed up to `_fed[sample]` tokens
        self._fed: dict[int, int] = {}

    def reached(self, rows: np.ndarray, running: np.ndarray, history: np.ndarray,
                history_len: np.ndarray) -> np.ndarray:
        """bool[b]: which batch rows hold a running sample whose text now contains a stop string. rows[i]: the
        sample row i holds (-1: padding); running bool[b]; history i32[b, W] and history_len i32[b] as the loop
        left them (prompt, then the sample's tokens)."""
        found = np.zeros(rows.shape, bool)
        for i in np.nonzero(running & (rows >= 0))[0]:
            sample = int(rows[i])
            stops = self.per_prompt[sample // self.num_samples]
            if not stops:
                continue
            stream = self._streams.setdefault(sample, TextStream(self.tokenizer, stops))
            start = int(self.prompt_lens[sample // self.num_samples]) + self._fed.get(sample, 0)
            end = int(history_len[i])
            stream.add(history[i, start:end].tolist())
            self._fed[sample] = end - int(self.prompt_lens[sample // self.num_samples])
            found[i] = stream.stopped
        return found

    def forget(self, samples) -> None:
        """Drop the streams of finished samples (their text is read back whole)."""
        for s in samples:
            self._streams.pop(int(s), None)
            self._fed.pop(int(s), None)
