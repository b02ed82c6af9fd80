"""From a stream of token ids to a stream of text: incremental detokenization and stop strings.

Token boundaries do not fall on character boundaries (a byte-level BPE token may hold half of a UTF-8
character) and a stop string may span tokens, so text is released only when it is final: never a trailing
replacement character, never a tail that could still become a stop string. Tokens are taken one at a time
so the count of tokens consumed up to a stop string is exact (OpenAI `usage`).
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._sent = 0  # characters of the decoded text already released
        self._text = ""
        self.stopped = False  # a stop string was found; later tokens are ignored
        self.num_tokens = 0  # tokens consumed, up to and including the one completing a stop string

    def add(self, token_ids: Sequence[int], count_only: Sequence[int] = ()) -> str:
        """Consume tokens; return the text that became final. `count_only` tokens (an engine stop token that is
        not part of the text) are counted but not decoded."""
        for t in token_ids:
            if self.stopped:
                break
            self._ids.append(int(t))
            self.num_tokens += 1
            self._text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
            if self._stop:
                self._check_stop()
        if not self.stopped:
            self.num_tokens += len(count_only)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, at the end of the request."""
        return self._release(final=True)

    def _check_stop(self) -> None:
        longest = max(len(s) for s in self._stop)
        start = max(0, self._sent - longest)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if not final and not self.stopped:
            if self._text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
                end -= 1
            # Hold back a tail that is the beginning of a stop string.
            end -= max((n for s in self._stop for n in range(1, min(len(s) - 1, end - self._sent) + 1)
                        if self._text[end - n: end] == s[:n]), default=0)
        end = max(end, self._sent)
        out = self._text[self._sent: end]
        self._sent = end
        return out

    @property
    def text(self) -> str:
        return self._text
