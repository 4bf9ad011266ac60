"""`POST /kv_leases/release`: end a lease this node holds as a prefill node, for a caller that holds it.

The proxy calls it when the decode side of a request never takes the lease: the decode node refused the call (a 4xx
before admission: bad input, an untrusted peer, a missing token), could not be reached, or no decode node was left.
Without it the prefill node would pin the request's blocks until the lease expires. Body:
`{"remote_request_id": ..., "remote_lease_secret": ...}` (as the node answered them in `kv_transfer_params`); the
cluster token is required when the node has one, and the lease's own secret always: only its holder may end it.
The answer is 202: the release is handed to the engine process, which frees the blocks on its engine thread.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from aiohttp import web

from hybridpd.errors import InvalidRequestError, UnauthorizedError
from hybridpd.server.body import read_json_object
from hybridpd.wire_headers import CLUSTER_TOKEN_HEADER, LEASE_RELEASE_PATH


def lease_routes(release: Callable[[str, str], None], cluster_token: str | None) -> list[web.RouteDef]:
    async def release_lease(request: web.Request) -> web.Response:
        if cluster_token is not None:
            sent = request.headers.get(CLUSTER_TOKEN_HEADER, "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(sent, cluster_token.encode("utf-8")):
                raise UnauthorizedError(f"{LEASE_RELEASE_PATH} needs a valid {CLUSTER_TOKEN_HEADER} header")
        body = await read_json_object(request)
        request_id, secret = body.get("remote_request_id"), body.get("remote_lease_secret")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("remote_request_id must be a non-empty string", "remote_request_id")
        if not isinstance(secret, str) or not secret:
            raise InvalidRequestError("remote_lease_secret must be a non-empty string", "remote_lease_secret")
        release(request_id, secret)
        return web.json_response({"status": "accepted"}, status=202)

    return [web.post(LEASE_RELEASE_PATH, release_lease)]
