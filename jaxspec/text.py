"""From a stream of token ids to a stream of text: incremental detokenization and stop strings.

Token boundaries do not fall on character boundaries (a byte-level BPE token may hold half of a UTF-8
character) and a stop string may span tokens, so text is released only when it is final: never a half
character, never a tail that could still become a stop string. Tokens are taken one at a time so the count of
tokens consumed up to a stop string is exact (OpenAI `usage`).

The tail held back is found in time linear in the text: each stop string keeps a Knuth-Morris-Pratt state, the
length of its longest prefix that ends the text, updated per new character. (Comparing every prefix length
against the tail on every token is quadratic in the stop string's length, per token.)

Detokenization is incremental: each token's bytes go through one incremental UTF-8 decoder, so a token costs
the same at the end of a long output as at its start (re-decoding the whole output per token is quadratic).
The result equals `tokenizer.decode(ids, skip_special_tokens=True)`: the byte-level decoder drops special
tokens, joins the other tokens' bytes and decodes them at once, replacing invalid sequences.
"""

from __future__ import annotations

import codecs
from typing import Sequence


class Detokenizer:
    """Text of a growing token sequence, one token at a time, for a byte-level tokenizer
    (`jaxspec.models.tokenizer.Tokenizer`)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        # Special tokens (<|im_end|>) are skipped outright: the bytes on either side of one still join.
        self._special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        """The text that token `token` completes (empty while a character is still missing bytes)."""
        if token in self._special:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token))

    def finish(self) -> str:
        """Bytes still pending at the end, decoded with replacement."""
        return self._utf8.decode(b"", final=True)


class _PrefixTracker:
    """The longest prefix of `pattern` that ends the text fed so far (Knuth-Morris-Pratt), and the shorter ones."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        # fail[n]: the length of the longest proper prefix of pattern[:n] that is also its suffix
        fail = [0] * (len(pattern) + 1)
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = fail[k]
            if pattern[i] == pattern[k]:
                k += 1
            fail[i + 1] = k
        self._fail = fail
        self.state = 0  # the longest prefix of the pattern that ends the text (the whole pattern once it occurs)

    def feed(self, text: str) -> None:
        pattern, fail, k = self.pattern, self._fail, self.state
        for ch in text:
            if k == len(pattern):
                k = fail[k]
            while k and ch != pattern[k]:
                k = fail[k]
            if ch == pattern[k]:
                k += 1
        self.state = k

    def longest_tail(self, most: int) -> int:
        """The longest n <= `most` (and shorter than the pattern) such that the text ends with pattern[:n]."""
        n = self.state
        while n and (n > most or n == len(self.pattern)):
            n = self._fail[n]
        return n


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._detok = Detokenizer(tokenizer)
        self._stop = [s for s in stop if s]
        self._tails = [_PrefixTracker(s) for s in self._stop]
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._sent = 0  # characters of the decoded text already released
        self._text = ""
        self._finished = False
        self.stopped = False  # a stop string was found; later tokens are ignored
        self.num_tokens = 0  # tokens consumed, up to and including the one completing a stop string

    def add(self, token_ids: Sequence[int], count_only: Sequence[int] = ()) -> str:
        """Consume tokens; return the text that became final. `count_only` tokens (an engine stop token that is
        not part of the text) are counted but not decoded."""
        for t in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            piece = self._detok.add(int(t))
            if piece:
                self._append(piece)
        if not self.stopped:
            self.num_tokens += len(count_only)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, at the end of the request."""
        if not self._finished and not self.stopped:
            self._finished = True
            piece = self._detok.finish()
            if piece:
                self._append(piece)
        return self._release(final=True)

    def _append(self, piece: str) -> None:
        self._text += piece
        if self._stop:
            self._check_stop(len(self._text) - len(piece))
            if not self.stopped:
                for tail in self._tails:
                    tail.feed(piece)

    def _check_stop(self, new_from: int) -> None:
        # A stop string ending in the new text starts at most len(stop) - 1 characters before it.
        start = max(0, new_from - self._longest_stop + 1)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if not final and not self.stopped:
            # Hold back a tail that is the beginning of a stop string.
            end -= max((t.longest_tail(end - self._sent) for t in self._tails), default=0)
        end = max(end, self._sent)
        out = self._text[self._sent: end]
        self._sent = end
        return out

    @property
    def text(self) -> str:
        return self._text
