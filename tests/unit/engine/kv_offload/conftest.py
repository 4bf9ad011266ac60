"""Fixtures of the storage tier's tests."""

from __future__ import annotations

import mmap
import os

import pytest

SHARED_BYTES = 4096


@pytest.fixture
def shared_buffer():
    """A memfd of `SHARED_BYTES` (a helper process's shared buffer) and this process's map of it."""
    fd = os.memfd_create("test-shared", os.MFD_CLOEXEC)
    os.ftruncate(fd, SHARED_BYTES)
    memory = mmap.mmap(fd, SHARED_BYTES)
    yield fd, memory
    os.close(fd)
