"""Why a local cluster did not come up, with what a user needs to see (the child's name and log tail)."""

from __future__ import annotations

from pathlib import Path

from hybridpd.errors import HybridPDError


class ClusterError(HybridPDError):
    """Base of the launcher's errors."""


class ChildExitedError(ClusterError):
    """A child process exited while the cluster was starting or running."""

    def __init__(self, name: str, returncode: int, log_path: Path, log_tail: str) -> None:
        super().__init__(
            f"{name} exited with code {returncode}; last lines of {log_path}:\n{log_tail}"
        )
        self.name = name
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail


class StartupTimeoutError(ClusterError):
    """A child stayed alive but never became healthy before the deadline."""

    def __init__(self, name: str, url: str, seconds: float, log_path: Path, log_tail: str) -> None:
        super().__init__(
            f"{name} was not healthy at {url} after {seconds:.0f}s; last lines of {log_path}:\n{log_tail}"
        )
        self.name = name
        self.log_path = log_path


class StartupInterruptedError(ClusterError):
    """A stop was requested (SIGINT/SIGTERM) before the cluster finished starting."""
