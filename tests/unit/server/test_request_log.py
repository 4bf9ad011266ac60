"""vLLM's request log (server/request_log.py): each request's arrival (params at INFO; prompt and ids at DEBUG) with
`--enable-log-requests`, what it generated with `--enable-log-outputs`, cut by `--max-log-len`; nothing by
default."""

from __future__ import annotations

import logging
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.server.args import BadArgumentsError
from hybridpd.server.request_log import LOGGER, RequestLogging

from .conftest import make_app, serve_configs
from .fake_engine import FakeEngine


async def lines(caplog, logging_policy: RequestLogging, level: int, body: dict) -> list[str]:
    client = TestClient(TestServer(make_app(FakeEngine(), request_logging=logging_policy)))
    await client.start_server()
    caplog.set_level(level, logger=LOGGER.name)
    try:
        resp = await client.post("/v1/completions", json=body)
        await resp.read()
    finally:
        await client.close()
    return [r.getMessage() for r in caplog.records if r.name == LOGGER.name]


BODY = {"prompt": "hello", "max_tokens": 3}


@pytest.mark.parametrize("policy, level, stream, expected", [
    (RequestLogging(), logging.DEBUG, False, []),
    (RequestLogging(requests=True), logging.INFO, False, ["Received request {id}: params: SamplingParams("]),
    (RequestLogging(requests=True), logging.DEBUG, False,
     ["Request {id} details: prompt: 'hello', prompt_token_ids: [104, 101, 108, 108, 111], prompt_embeds shape: "
      "None.", "Received request {id}: params: SamplingParams("]),
    (RequestLogging(requests=True, max_len=2), logging.DEBUG, False,
     ["Request {id} details: prompt: 'he', prompt_token_ids: [104, 101], prompt_embeds shape: None.",
      "Received request {id}: params: SamplingParams("]),
    (RequestLogging(requests=True, outputs=True), logging.INFO, False,
     ["Received request {id}: params: SamplingParams(",
      "Generated response {id}: output: 'abc', finish_reason: length"]),
    (RequestLogging(requests=True, outputs=True, max_len=1), logging.DEBUG, True,
     ["Request {id} details: prompt: 'h'", "Received request {id}: params: SamplingParams(",
      "Generated response {id} (streaming complete) details: output_token_ids: [97]",
      "Generated response {id} (streaming complete): output: 'a', finish_reason: length"]),
])
async def test_request_log(caplog, policy, level, stream, expected):
    got = await lines(caplog, policy, level, {**BODY, "stream": stream})
    assert len(got) == len(expected)
    request_id = re.search(r"(cmpl-\w+)", got[0]).group(1) if got else None
    for line, start in zip(got, expected):
        assert line.startswith(start.format(id=request_id)), (line, start)


def test_the_flags():
    def server(argv):
        return serve_configs(argv).server

    assert server([]).request_logging == RequestLogging()
    assert server(["--enable-log-requests", "--enable-log-outputs", "--max-log-len", "8"]).request_logging == \
        RequestLogging(True, True, 8)
    with pytest.raises(BadArgumentsError, match="requires --enable-log-requests"):
        server(["--enable-log-outputs"])
    with pytest.raises(BadArgumentsError, match="--max-log-len"):
        server(["--enable-log-requests", "--max-log-len", "-1"])
