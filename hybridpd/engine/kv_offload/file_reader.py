"""Reading one block file: its header and pages straight into the buffers they go to (one `readv`), checked
(block_file.intact), and its modification time refreshed (the eviction order is least recently written or read).
No index here: the caller says which file, and records what the read found (the store in-process, the tier from its
reader process's answers)."""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

from hybridpd.engine.kv_offload import block_file


class ReadOutcome(enum.Enum):
    READ = "read"          # every page is in its buffer, checked
    MISSING = "missing"    # no such file (removed by another node, by hand), or it could not be read
    BAD = "bad"            # torn, truncated, foreign or corrupted: a miss, and the file should go


def read_into(path: str, model_key: bytes, block_hash: bytes, layouts: Sequence[tuple[bytes, int]],
              into: Sequence[memoryview]) -> ReadOutcome:
    """Read the file at `path`, expected to hold `block_hash`'s pages of the groups of `layouts` ((group key, page
    bytes), in order), each page into its buffer of `into` (one a layout, exactly its page's size). Whatever the
    outcome, the buffers may have been written."""
    if len(into) != len(layouts) or any(buf.nbytes != size for buf, (_, size) in zip(into, layouts)):
        raise ValueError("read_into needs one buffer of each page's size")
    header = bytearray(block_file.header_size(len(layouts)))
    extra = bytearray(1)   # one byte more: a longer file is not this block either
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ReadOutcome.MISSING
    try:
        size = os.readv(fd, [header, *into, extra])
        os.utime(fd)
    except OSError:
        return ReadOutcome.MISSING
    finally:
        os.close(fd)
    if size != len(header) + sum(buf.nbytes for buf in into):
        return ReadOutcome.BAD
    return ReadOutcome.READ if block_file.intact(header, into, model_key, block_hash, layouts) else ReadOutcome.BAD


def prefetch(path: str) -> None:
    """Ask the kernel to start reading the file (POSIX_FADV_WILLNEED), so the disk (or an NFS server) works while the
    reader checks and copies the files before it; errors are the read's to find."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
