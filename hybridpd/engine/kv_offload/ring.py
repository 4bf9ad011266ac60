"""Byte ranges of a fixed buffer handed out and given back in the same order (first in, first out), each range
contiguous: the write-behind's staging memory, which the engine's step copies pages into and the writer process
reads them from."""

from __future__ import annotations

from collections import deque


class ByteRing:
    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"a ring needs a positive size, got {size}")
        self.size = size
        self._taken: deque[tuple[int, int]] = deque()   # (offset, length), oldest first

    def room(self) -> int:
        """The longest range `take` would hand out now."""
        if not self._taken:
            return self.size
        head, end = self._taken[0][0], self._taken[-1][0] + self._taken[-1][1]
        if end > head:   # taken: [head, end); free: [end, size) and [0, head)
            return max(self.size - end, head)
        return head - end   # wrapped: taken [head, size) and [0, end); free: [end, head)

    def take(self, length: int) -> int | None:
        """The offset of `length` contiguous bytes, or None if no such range is free."""
        if length <= 0:
            raise ValueError(f"a range needs a positive length, got {length}")
        if not self._taken:
            if length > self.size:
                return None
            offset = 0
        else:
            head, end = self._taken[0][0], self._taken[-1][0] + self._taken[-1][1]
            if end > head and self.size - end >= length:
                offset = end
            elif end > head and head >= length:
                offset = 0   # wrap: the bytes from `end` to the buffer's end stay unused until the ring empties past them
            elif end <= head and head - end >= length:
                offset = end
            else:
                return None
        self._taken.append((offset, length))
        return offset

    def give_back(self) -> None:
        """The oldest range is free again."""
        self._taken.popleft()

    @property
    def taken(self) -> int:
        """The ranges out now."""
        return len(self._taken)
