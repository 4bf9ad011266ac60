"""CORS on the node as vLLM's server answers it (hybridpd/cors.py): by default every origin, method and header; a
preflight is answered before the API key is asked for; answers (streams too) carry Access-Control-Allow-Origin; the
four flags narrow it. Starlette's CORSMiddleware, which vLLM's server runs, is the reference: every case's status
and CORS headers are what it answers the same request with the same settings."""

from __future__ import annotations


import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.api_keys import ApiKeys
from hybridpd.cors import ALL_METHODS, PREFLIGHT_VARY, CorsPolicy

from .conftest import make_app, serve_configs, serve_parser
from .fake_engine import FakeEngine

SITE = "https://app.example"
PREFLIGHT = {"Origin": SITE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
NARROW = CorsPolicy(origins=(SITE,), methods=("POST",), headers=("Authorization",))

# (policy, request headers, status, the CORS headers of the answer): preflights of /v1/chat/completions
PREFLIGHTS = [
    (CorsPolicy(), PREFLIGHT, 200, {"Access-Control-Allow-Origin": "*",
                                    "Access-Control-Allow-Methods": ", ".join(ALL_METHODS),
                                    "Access-Control-Allow-Headers": "authorization, content-type",
                                    "Access-Control-Max-Age": "600"}),
    (CorsPolicy(credentials=True), PREFLIGHT, 200,
     {"Access-Control-Allow-Origin": SITE, "Access-Control-Allow-Credentials": "true", "Vary": PREFLIGHT_VARY}),
    (NARROW, PREFLIGHT, 200, {"Access-Control-Allow-Origin": SITE, "Access-Control-Allow-Methods": "POST",
                              "Access-Control-Allow-Headers": "Accept, Accept-Language, Authorization, "
                                                              "Content-Language, Content-Type"}),
    (NARROW, {**PREFLIGHT, "Origin": "https://elsewhere.example"}, 400, {}),
    (NARROW, {**PREFLIGHT, "Access-Control-Request-Method": "PUT"}, 400, {}),
    (NARROW, {**PREFLIGHT, "Access-Control-Request-Headers": "x-secret"}, 400, {}),
    (CorsPolicy(), {**PREFLIGHT, "Access-Control-Request-Private-Network": "true"}, 400, {}),
]


async def starlette_answer(policy: CorsPolicy, method: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    """What Starlette's CORSMiddleware (vLLM's) answers: its status and CORS headers, in front of an app that
    answers 200."""
    from starlette.middleware.cors import CORSMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    cors = CORSMiddleware(app, allow_origins=list(policy.origins), allow_credentials=policy.credentials,
                          allow_methods=list(policy.methods), allow_headers=list(policy.headers))
    scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await cors(scope, receive, send)
    return sent[0]["status"], cors_headers((k.decode(), v.decode()) for k, v in sent[0]["headers"])


def cors_headers(pairs) -> dict[str, str]:
    return {k.lower(): v for k, v in pairs if k.lower().startswith("access-control-") or k.lower() == "vary"}


async def served(**config) -> TestClient:
    client = TestClient(TestServer(make_app(FakeEngine(), **config)))
    await client.start_server()
    return client


@pytest.mark.parametrize("policy, headers, status, expected", PREFLIGHTS)
async def test_preflights(policy, headers, status, expected):
    client = await served(cors=policy, api_keys=ApiKeys(("k",)))   # no key: a preflight never needs one
    try:
        resp = await client.options("/v1/chat/completions", headers=headers)
        assert resp.status == status
        assert {k: resp.headers.get(k) for k in expected} == expected
        if status == 400:
            assert (await resp.text()).startswith("Disallowed CORS")
        assert (resp.status, cors_headers(resp.headers.items())) == await starlette_answer(policy, "OPTIONS", headers)
    finally:
        await client.close()


@pytest.mark.parametrize("policy, headers, allow_origin", [
    (CorsPolicy(), {"Origin": SITE}, "*"),
    (CorsPolicy(credentials=True), {"Origin": SITE}, SITE),
    (CorsPolicy(), {}, None),                              # not a cross-origin call
    (NARROW, {"Origin": SITE}, SITE),
    (NARROW, {"Origin": "https://elsewhere.example"}, None),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_answers_carry_the_allowed_origin(policy, headers, allow_origin, stream):
    client = await served(cors=policy)
    try:
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream},
                                 headers=headers)
        await resp.read()
        assert resp.status == 200 and resp.headers.get("Access-Control-Allow-Origin") == allow_origin
        assert cors_headers(resp.headers.items()) == (await starlette_answer(policy, "POST", headers))[1]
        refused = await client.post("/v1/completions", json={"max_tokens": 2}, headers=headers)
        assert refused.status == 400 and refused.headers.get("Access-Control-Allow-Origin") == allow_origin
    finally:
        await client.close()


def test_the_flags():
    def cors(argv):
        return serve_configs(argv).server.cors

    assert cors([]) == CorsPolicy()
    assert cors(["--allowed-origins", f'["{SITE}"]', "--allow-credentials", "--allowed-methods", '["POST"]',
                 "--allowed-headers", '["Authorization"]']) == CorsPolicy((SITE,), True, ("POST",), ("Authorization",))
    for bad in ('"*"', "[1]", "["):
        with pytest.raises(SystemExit):
            serve_parser().parse_args(["--allowed-origins", bad])
