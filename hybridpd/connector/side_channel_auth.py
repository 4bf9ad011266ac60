"""The cluster token on the side channel: `authorization: Bearer <token>` metadata, compared in constant time.

The token itself is never logged nor put in an error message.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

AUTH_KEY = "authorization"
_BEARER = "Bearer "


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (none when the cluster has no token)."""
    return () if token is None else ((AUTH_KEY, _BEARER + token),)


def is_authorized(metadata: Sequence[tuple[str, str | bytes]] | None, token: str | None) -> bool:
    """True when no token is configured, or when the call carries exactly `Bearer <token>`."""
    if token is None:
        return True
    for key, value in metadata or ():
        if key.lower() == AUTH_KEY and isinstance(value, str) and value.startswith(_BEARER):
            return hmac.compare_digest(value[len(_BEARER):].encode(), token.encode())
    return False
