"""Streaming: generated ids into text one id at a time (`IncrementalDetokenizer`), and stop
strings found in that text across token boundaries (`StopMatcher`). Both work on any tokenizer
of the package's interface (`TokenizerLike`) through its public methods."""
from __future__ import annotations

from collections.abc import Sequence

from .protocol import TokenizerLike


class IncrementalDetokenizer:
    """Turns generated ids into text one id at a time.

    Decoding one token alone is wrong in general (a character can be split over several byte
    tokens; sentencepiece drops the space in front of the first token), so each step decodes a
    short window of recent ids and emits what the new id added to it. Text that may still change
    is held back: a trailing U+FFFD (possibly a character still missing bytes), and with a
    byte-fallback decoder the text of a trailing run of <0xXX> tokens, which the decoder turns
    into U+FFFDs as a whole if a later byte makes the run invalid UTF-8.
    """

    def __init__(self, tokenizer: TokenizerLike, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_ids
        self.ids: list[int] = []
        self._start = 0        # the window is ids[_start:]
        self._emitted = 0      # characters of decode(window) already returned
        self._clean_end = 0    # len(ids) when everything decoded so far had been returned

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self.ids[start:stop], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Add one generated id; returns the text it completes (often "")."""
        self.ids.append(token_id)
        stable = self._stable_end()
        text = self._decode(self._start, stable)
        ready = text.rstrip("\ufffd")
        delta = ready[self._emitted:]
        self._emitted = max(self._emitted, len(ready))
        if stable == len(self.ids) and len(ready) == len(text):  # nothing held back
            self._slide_window(self._clean_end)
            self._clean_end = len(self.ids)
        return delta

    def _stable_end(self) -> int:
        """Where the trailing run of byte tokens begins (len(ids) if there is none). Ids that
        decode to nothing (skipped specials, ids outside the vocabulary) vanish before the
        decoder runs, so a run continues across them."""
        if not self._byte_ids:
            return len(self.ids)
        end, has_bytes = len(self.ids), False
        while end > self._start:
            token = self.ids[end - 1]
            if token in self._byte_ids:
                has_bytes = True
            elif not self._vanishes(token):
                break
            end -= 1
        return end if has_bytes else len(self.ids)

    def _vanishes(self, token: int) -> bool:
        tok = self._tokenizer
        return (self._skip and tok.is_special(token)) or not 0 <= token < tok.vocab_size or not tok.id_to_token(token)

    def _slide_window(self, start: int) -> None:
        # Restart the window at an earlier clean boundary (a character boundary), keeping it
        # short. The window must begin with text already returned: if it began with ids that
        # decode to nothing (skipped specials), a start-of-text rule (sentencepiece's dropped
        # leading space) would hit the next token, which is not at the start of the real text.
        if start <= self._start:
            return
        text = self._decode(start)
        if text and not text.startswith("\ufffd"):
            self._start, self._emitted = start, len(text)

    def flush(self) -> str:
        """Whatever is still held back; an incomplete character comes out as U+FFFD."""
        text = self._decode(self._start)
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta


class StopMatcher:
    """Finds stop strings in streamed text, also when one is split over several pieces.

    `feed` returns the text that can be shown now. The end of the text that could be the
    beginning of a stop string is held back until it is clear; on a match, the text before the
    stop string is returned and the rest (the stop string and anything after it) is dropped.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._held + text
        found = [(buffer.find(s), s) for s in self._stops]
        hits = [(at, s) for at, s in found if at >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            self.stopped, self.matched, self._held = True, stop, ""
            return buffer[:at], True
        keep = self._longest_partial(buffer)
        cut = len(buffer) - keep
        self._held = buffer[cut:]
        return buffer[:cut], False

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is the beginning of a stop string.
        Only places where a stop string's first character occurs are tried, each with one
        C-level comparison, so a step costs about one scan of the held text per stop string."""
        longest = 0
        for stop in self._stops:
            at = buffer.find(stop[0], max(len(buffer) - len(stop) + 1, 0))
            while 0 <= at < len(buffer) - longest:
                if stop.startswith(buffer[at:]):
                    longest = len(buffer) - at
                    break
                at = buffer.find(stop[0], at + 1)
        return longest

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
