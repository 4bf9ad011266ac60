"""Typed errors, raised where they are understood; `hybridpd.server.errors` maps them to HTTP once."""

from __future__ import annotations


class HybridPDError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidRequestError(HybridPDError):
    """The client's own bad input (HTTP 400). `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def renamed(exc: InvalidRequestError, param: str | None) -> InvalidRequestError:
    """`exc` about the field `param` instead of its own (a body converted to another's shape, an error about the
    converted field): its message names `param` where it named the other."""
    message = str(exc)
    if exc.param and param != exc.param:
        message = message.replace(exc.param, param or "", 1)
    return InvalidRequestError(message, param)


class UnauthorizedError(HybridPDError):
    """A missing or wrong cluster token (HTTP 401)."""


class ForbiddenError(HybridPDError):
    """A request this node refuses by policy (HTTP 403): e.g. a pull from a peer it does not trust."""


class NotFoundError(HybridPDError):
    """An unknown model, route or request (HTTP 404)."""


class ServerOverloadedError(HybridPDError):
    """The node is shutting down or cannot admit the request (HTTP 503)."""


class KVTransferError(HybridPDError):
    """Loading remote KV failed: the peer that failed and why (HTTP 502 from the node)."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"KV transfer from {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason

    def __reduce__(self):  # rebuilt from its own fields (it crosses to the node's HTTP front pickled)
        return (type(self), (self.peer, self.reason))


class CheckpointError(HybridPDError, ValueError):
    """A checkpoint directory that is missing, unreadable, or does not describe a model we can run."""


class EngineDeadError(HybridPDError):
    """The engine loop died; the node cannot serve (HTTP 500)."""
