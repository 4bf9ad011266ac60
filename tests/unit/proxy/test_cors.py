"""CORS on the proxy, as on the node (hybridpd/cors.py, whose answers tests/unit/server/test_cors.py holds against
Starlette's, vLLM's): a preflight answered before the API key is asked for, every answer (streams, the proxy's own
errors, forwarded calls) with the allowed origin."""

from __future__ import annotations

import pytest

from hybridpd.api_keys import ApiKeys
from hybridpd.cors import CorsPolicy

from .fake_node import Behavior

SITE = "https://app.example"


@pytest.mark.parametrize("policy, allowed", [(CorsPolicy(), "*"), (CorsPolicy(origins=(SITE,)), SITE),
                                             (CorsPolicy(origins=("https://other.example",)), None)])
async def test_preflights_and_answers(make_harness, policy, allowed):
    h = await make_harness([Behavior.OK], [Behavior.OK], cors=policy, api_keys=ApiKeys(("k",)))
    preflight = {"Origin": SITE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-api-key"}
    async with h.session.options(h.url + "/v1/completions", headers=preflight) as resp:
        assert resp.status == (200 if allowed else 400)
        assert resp.headers.get("Access-Control-Allow-Origin") == allowed
    keyed = {"Origin": SITE, "Authorization": "Bearer k"}
    for body in ({"prompt": "hi", "max_tokens": 3, "stream": True}, {"prompt": "hi", "max_tokens": 3}):
        async with h.session.post(h.url + "/v1/completions", json=body, headers=keyed) as resp:
            await resp.read()
            assert resp.status == 200 and resp.headers.get("Access-Control-Allow-Origin") == allowed
    async with h.session.post(h.url + "/v1/completions", data=b"{", headers=keyed) as resp:
        assert resp.status == 400 and resp.headers.get("Access-Control-Allow-Origin") == allowed
    async with h.session.get(h.url + "/v1/models", headers={"Origin": SITE}) as resp:   # no key: 401, still CORS
        assert resp.status == 401 and resp.headers.get("Access-Control-Allow-Origin") == allowed
