"""Incremental detokenization with stop strings.

Text is decoded from all output ids each time (tiny outputs; exact for any tokenizer), and only the part that is
final is released: a trailing U+FFFD (an incomplete UTF-8 sequence) and, when stop strings are set, the last
`len(longest stop) - 1` characters are held back until the next token decides them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpd.engine.tokenizer import Tokenizer


@dataclass
class Detokenizer:
    tokenizer: Tokenizer
    stop: tuple[str, ...]
    emitted: int = 0          # characters of the output text already released
    text: str = field(default="")

    def step(self, output_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Returns (new text to release, the stop string that matched or None)."""
        self.text = self.tokenizer.decode(output_ids)
        match = self._first_stop()
        if match is not None:
            at, stop = match
            self.text = self.text[:at]
            return self._release(len(self.text)), stop
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            if self.stop:
                end -= max(len(s) for s in self.stop) - 1
        return self._release(max(end, self.emitted)), None

    def _first_stop(self) -> tuple[int, str] | None:
        """The stop string that occurs first in the text not yet released (one token may add several: the earliest
        ends the output, whatever its place in the list). No match can start before `emitted`: the held-back
        tail is as long as the longest stop string minus one."""
        matches = []
        for stop in self.stop:
            at = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1:
                matches.append((at, stop))
        return min(matches, key=lambda m: m[0], default=None)

    def _release(self, end: int) -> str:
        new = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return new
