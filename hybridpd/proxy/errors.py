"""What can go wrong between the proxy and a node, as typed errors; `responses.py` maps them to HTTP once."""

from __future__ import annotations

import enum

from hybridpd.errors import HybridPDError
from hybridpd.proxy.config import Upstream


class FailureKind(enum.Enum):
    UNREACHABLE = "unreachable"      # no connection (refused, reset, connect timeout)
    TIMEOUT = "timeout"              # connected, but no answer within the timeout
    SERVER_ERROR = "server_error"    # the node answered 5xx
    BAD_ANSWER = "bad_answer"        # the node answered 2xx with something we cannot use


class UpstreamError(HybridPDError):
    """A node failed this call; the message names the node (never the cluster token)."""

    def __init__(self, upstream: Upstream, kind: FailureKind, reason: str, *, nothing_sent: bool = False) -> None:
        super().__init__(f"{upstream.name} failed ({kind.value}): {reason}")
        self.upstream = upstream
        self.kind = kind
        self.reason = reason
        self.nothing_sent = nothing_sent   # the connection was never opened: the node saw nothing of the call


class UpstreamRejectedError(HybridPDError):
    """A node answered 4xx: the client's own bad input. Its answer goes back to the client as it is."""

    def __init__(self, upstream: Upstream, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{upstream.name} rejected the request with HTTP {status}")
        self.upstream = upstream
        self.status = status
        self.body = body
        self.content_type = content_type
