"""Node failures through the proxy: 4xx passthrough, retries, 502/504, timeouts, client disconnects."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from openai.types.responses import ResponseErrorEvent

from hybridpd.proxy.config import Role
from hybridpd.proxy.responses import EventCount

from .fake_node import REJECT_BODY, Behavior

DEADLINE = 10.0  # seconds a test waits for an event before it fails (never a timing assertion)
BODY = {"prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("prefill, decode", [
    ([Behavior.REJECT], [Behavior.OK]),
    ([Behavior.OK], [Behavior.REJECT]),
    ([Behavior.REJECT, Behavior.OK], [Behavior.OK]),  # a 4xx is the client's fault: no retry
])
async def test_node_4xx_passes_through_unchanged(make_harness, prefill, decode):
    h = await make_harness(prefill, decode)
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 400
        assert await resp.read() == REJECT_BODY
    assert sum(len(node.received) for node in h.prefill) == 1


@pytest.mark.parametrize("first", [None, Behavior.FAIL])  # None: nobody listens on that port
async def test_prefill_failure_retries_on_the_other_node(make_harness, first):
    h = await make_harness([first, Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200
    assert len(h.prefill[1].received) == 1
    assert h.decode[0].received[0].body["kv_transfer_params"]["remote_port"] == h.prefill_ports[1] + 1000
    metrics = h.proxy.metrics.render().decode()
    assert f'upstream="127.0.0.1:{h.prefill_ports[0]}"' in metrics


@pytest.mark.parametrize("prefill, decode, status, error_type, failed_role, failed_index", [
    ([None], [Behavior.OK], 502, "bad_gateway", "prefill", 0),
    ([Behavior.FAIL], [Behavior.OK], 502, "bad_gateway", "prefill", 0),
    ([Behavior.FAIL, Behavior.FAIL], [Behavior.OK], 502, "bad_gateway", "prefill", 1),
    ([Behavior.OK], [None], 502, "bad_gateway", "decode", 0),
    ([Behavior.OK], [Behavior.FAIL], 502, "bad_gateway", "decode", 0),
    ([Behavior.HANG], [Behavior.OK], 504, "gateway_timeout", "prefill", 0),
    ([Behavior.OK], [Behavior.HANG], 504, "gateway_timeout", "decode", 0),
])
async def test_node_failure_is_a_gateway_error_naming_the_node(
    make_harness, prefill, decode, status, error_type, failed_role, failed_index
):
    """With the colocated fallback off (`--no-fallback-colocated`) a prefill failure is the client's error too."""
    h = await make_harness(prefill, decode, prefill_timeout=0.5, decode_timeout=0.5, decode_request_timeout=0.5,
                           connect_timeout=1.0,
                           fallback_colocated=False)
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    ports = h.prefill_ports if failed_role == "prefill" else h.decode_ports
    assert error["type"] == error_type
    assert error["code"] == status
    assert f"{failed_role} node 127.0.0.1:{ports[failed_index]}" in error["message"]
    if failed_role == "decode":
        assert len(h.prefill[0].received) == 1


@pytest.mark.parametrize("prefill", [
    [None],                              # nobody listens
    [Behavior.FAIL, Behavior.FAIL],      # both fail: the retry too
    [Behavior.HANG],                     # no answer within the prefill timeout
])
async def test_when_no_prefill_node_can_take_it_the_decode_node_prefills(make_harness, prefill):
    """The colocated fallback (on by default): a prefill-pool outage costs latency, not errors."""
    h = await make_harness(prefill, [Behavior.OK], prefill_timeout=0.5, connect_timeout=1.0)
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200, await resp.text()
    (call,) = h.decode[0].received
    assert "kv_transfer_params" not in call.body and call.body["prompt"] == BODY["prompt"]
    assert "hybridpd_proxy_fallback_colocated_total 1.0" in h.proxy.metrics.render().decode()


async def test_a_prefill_4xx_is_not_a_reason_to_fall_back(make_harness):
    h = await make_harness([Behavior.REJECT], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 400 and await resp.read() == REJECT_BODY
    assert h.decode[0].received == []
    assert "hybridpd_proxy_fallback_colocated_total 0.0" in h.proxy.metrics.render().decode()


async def test_decode_failure_after_stream_started_is_an_error_event(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.HANG_MID_STREAM], decode_timeout=0.5)
    async with h.session.post(h.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [line for line in raw.split("\n\n") if line]
    assert '"text": "x"' in events[0]  # the head, from the prefill node's stream
    assert events[1].startswith('data: {"id":"cmpl-1"')
    assert '"type": "gateway_timeout"' in events[2] and f"decode node 127.0.0.1:{h.decode_ports[0]}" in events[2]
    assert events[3] == "data: [DONE]"


async def test_a_responses_stream_that_fails_midway_ends_with_a_typed_error_event(make_harness):
    """A Responses stream's failure is its own `error` event, numbered after the events relayed, without [DONE]."""
    h = await make_harness([Behavior.OK], [Behavior.HANG_MID_STREAM], decode_timeout=0.5)
    async with h.session.post(h.url + "/v1/responses", json={"input": "hi", "stream": True}) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [event for event in raw.split("\n\n") if event]
    assert len(events) == 2 and events[0].startswith("data: ")   # the one event the node sent before it hung
    kind, data = events[1].split("\n")
    error = json.loads(data.removeprefix("data: "))
    assert kind == "event: error" and error["type"] == "error" and error["sequence_number"] == 1
    assert error["code"] == "gateway_timeout" and f"decode node 127.0.0.1:{h.decode_ports[0]}" in error["message"]
    ResponseErrorEvent.model_validate(error)   # as the `openai` client reads it


async def test_a_messages_stream_that_fails_midway_ends_with_anthropics_error_event(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.HANG_MID_STREAM], decode_timeout=0.5)
    async with h.session.post(h.url + "/v1/messages", json={"messages": [], "stream": True}) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [event for event in raw.split("\n\n") if event]
    assert len(events) == 2
    kind, data = events[1].split("\n")
    error = json.loads(data.removeprefix("data: "))
    assert kind == "event: error" and error["type"] == "error" and error["error"]["type"] == "api_error"
    assert f"decode node 127.0.0.1:{h.decode_ports[0]}" in error["error"]["message"]


async def test_the_proxys_own_errors_on_the_messages_path_are_anthropics_shape(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/messages", data=b"{", headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("chunks, events", [
    ([b"data: a\n\n", b"data: b\n\n"], 2),
    ([b"event: x\ndata: a\n", b"\nevent: y\ndata: b\n\n"], 2),   # an event's end split between chunks
    ([b"data: a\n", b"\n", b"\n"], 1),
    ([b"data: a", b"\n\ndata: b\n"], 1),
    ([b"", b"data: a\n\n"], 1),
])
def test_the_relayed_events_are_counted_across_chunks(chunks, events):
    count = EventCount()
    for chunk in chunks:
        count.feed(chunk)
    assert count.events == events


@pytest.mark.parametrize("data, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
])
async def test_bad_json_is_a_400_in_openai_shape(make_harness, data, message):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", data=data,
                              headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and message in error["message"]
    assert h.prefill[0].received == []


@pytest.mark.parametrize("prefill, decode, stream, hanging_role", [
    (Behavior.HANG, Behavior.OK, False, "prefill"),
    (Behavior.OK, Behavior.HANG, False, "decode"),
    (Behavior.OK, Behavior.HANG_MID_STREAM, True, "decode"),
])
async def test_client_disconnect_cancels_the_upstream_call(make_harness, prefill, decode, stream, hanging_role):
    h = await make_harness([prefill], [decode])
    hanging = h.prefill[0] if hanging_role == "prefill" else h.decode[0]
    first_chunk = asyncio.Event()

    async def client() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(h.url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
                await resp.content.readany()
                first_chunk.set()
                await asyncio.Event().wait()

    task = asyncio.create_task(client())
    try:
        await asyncio.wait_for(hanging.arrived.wait(), DEADLINE)
        if stream:
            await asyncio.wait_for(first_chunk.wait(), DEADLINE)
    finally:
        task.cancel()  # the client goes away: its session closes the connection
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.wait_for(hanging.cancelled.wait(), DEADLINE)
    router = h.proxy.routers[Role(hanging_role)]
    upstream = router.upstreams[0]
    for _ in range(100):  # the proxy's handler unwinds right after the node saw the cancellation
        if router.outstanding(upstream) == 0:
            break
        await asyncio.sleep(0.01)
    assert router.outstanding(upstream) == 0
