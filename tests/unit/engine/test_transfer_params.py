"""`parse_kv_transfer_params`: vLLM's wire shapes in, typed values out; every malformed variant names its field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hybridpd.engine.request import TokenLogprob
from hybridpd.engine.transfer_params import RemoteDecodeParams, RemotePrefillParams, parse_kv_transfer_params
from hybridpd.errors import InvalidRequestError

# What the proxy sends a prefill node (vLLM's toy proxy sends exactly this, nulls included).
PREFILL_SHAPE: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}

# What a prefill node answers and the proxy forwards to a decode node.
DECODE_SHAPE: dict[str, Any] = {
    "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "engine-a",
    "remote_request_id": "req-1", "remote_block_ids": [[1, 2, 3], [], [7]], "remote_host": "10.0.0.5",
    "remote_port": 7001, "remote_num_tokens": 40, "remote_lease_expiry": 1_700_000_000.5, "first_token_id": 42,
}
LOGPROB = {"token_id": 42, "logprob": -0.25, "top": [[42, -0.25], [7, -1.5]]}

EXPECTED_PREFILL = RemotePrefillParams(
    remote_engine_id="engine-a", remote_request_id="req-1", remote_block_ids=((1, 2, 3), (), (7,)),
    remote_host="10.0.0.5", remote_port=7001, remote_num_tokens=40, remote_lease_expiry=1_700_000_000.5,
    first_token_id=42,
)


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


def without(base: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != name}


@pytest.mark.parametrize("raw, expected", [
    (None, None),
    (PREFILL_SHAPE, RemoteDecodeParams()),
    ({"do_remote_decode": True}, RemoteDecodeParams()),
    (DECODE_SHAPE, EXPECTED_PREFILL),
    (with_(DECODE_SHAPE, do_remote_decode=None), EXPECTED_PREFILL),
    (without(DECODE_SHAPE, "do_remote_decode"), EXPECTED_PREFILL),
    (with_(DECODE_SHAPE, remote_lease_expiry=None),
     RemotePrefillParams(remote_engine_id="engine-a", remote_request_id="req-1",
                         remote_block_ids=((1, 2, 3), (), (7,)), remote_host="10.0.0.5", remote_port=7001,
                         remote_num_tokens=40, first_token_id=42)),
    (with_(DECODE_SHAPE, first_token_id=0, first_token_logprob=None),
     RemotePrefillParams(remote_engine_id="engine-a", remote_request_id="req-1", remote_block_ids=((1, 2, 3), (), (7,)),
                         remote_host="10.0.0.5", remote_port=7001, remote_num_tokens=40,
                         remote_lease_expiry=1_700_000_000.5, first_token_id=0)),
    (with_(DECODE_SHAPE, first_token_logprob=LOGPROB),
     RemotePrefillParams(remote_engine_id="engine-a", remote_request_id="req-1", remote_block_ids=((1, 2, 3), (), (7,)),
                         remote_host="10.0.0.5", remote_port=7001, remote_num_tokens=40,
                         remote_lease_expiry=1_700_000_000.5, first_token_id=42,
                         first_token_logprob=TokenLogprob(token_id=42, logprob=-0.25, top=((42, -0.25), (7, -1.5))))),
    (with_(DECODE_SHAPE, remote_block_ids=[[0, 2**31 - 1]], remote_port=65535),
     RemotePrefillParams(remote_engine_id="engine-a", remote_request_id="req-1", remote_block_ids=((0, 2**31 - 1),),
                         remote_host="10.0.0.5", remote_port=65535, remote_num_tokens=40,
                         remote_lease_expiry=1_700_000_000.5, first_token_id=42)),
    (with_(DECODE_SHAPE, remote_cached_tokens=32),
     RemotePrefillParams(remote_engine_id="engine-a", remote_request_id="req-1", remote_block_ids=((1, 2, 3), (), (7,)),
                         remote_host="10.0.0.5", remote_port=7001, remote_num_tokens=40, remote_cached_tokens=32,
                         remote_lease_expiry=1_700_000_000.5, first_token_id=42)),
    ({}, None),                                                   # both flags absent: colocated
    ({"do_remote_decode": False, "do_remote_prefill": False}, None),
])
def test_well_formed(raw, expected):
    assert parse_kv_transfer_params(raw) == expected


@pytest.mark.parametrize("raw, field", [
    ([], "kv_transfer_params"),
    ("do_remote_decode", "kv_transfer_params"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params"),
    ({"do_remote_decode": 1}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": "true"}, "kv_transfer_params.do_remote_decode"),
    (with_(DECODE_SHAPE, do_remote_prefill=1), "kv_transfer_params.do_remote_prefill"),
    (without(DECODE_SHAPE, "remote_engine_id"), "kv_transfer_params.remote_engine_id"),
    (with_(DECODE_SHAPE, remote_engine_id=5), "kv_transfer_params.remote_engine_id"),
    (with_(DECODE_SHAPE, remote_engine_id=""), "kv_transfer_params.remote_engine_id"),
    (without(DECODE_SHAPE, "remote_request_id"), "kv_transfer_params.remote_request_id"),
    (with_(DECODE_SHAPE, remote_request_id=["req-1"]), "kv_transfer_params.remote_request_id"),
    (with_(DECODE_SHAPE, remote_request_id=""), "kv_transfer_params.remote_request_id"),
    (without(DECODE_SHAPE, "remote_host"), "kv_transfer_params.remote_host"),
    (with_(DECODE_SHAPE, remote_host=None), "kv_transfer_params.remote_host"),
    (with_(DECODE_SHAPE, remote_host=""), "kv_transfer_params.remote_host"),
    (without(DECODE_SHAPE, "remote_port"), "kv_transfer_params.remote_port"),
    (with_(DECODE_SHAPE, remote_port="7001"), "kv_transfer_params.remote_port"),
    (with_(DECODE_SHAPE, remote_port=7001.0), "kv_transfer_params.remote_port"),
    (with_(DECODE_SHAPE, remote_port=True), "kv_transfer_params.remote_port"),
    (with_(DECODE_SHAPE, remote_port=0), "kv_transfer_params.remote_port"),
    (with_(DECODE_SHAPE, remote_port=-1), "kv_transfer_params.remote_port"),
    (with_(DECODE_SHAPE, remote_port=65536), "kv_transfer_params.remote_port"),
    (without(DECODE_SHAPE, "remote_num_tokens"), "kv_transfer_params.remote_num_tokens"),
    (with_(DECODE_SHAPE, remote_num_tokens=-1), "kv_transfer_params.remote_num_tokens"),
    (with_(DECODE_SHAPE, remote_num_tokens=0), "kv_transfer_params.remote_num_tokens"),
    (with_(DECODE_SHAPE, remote_cached_tokens=-1), "kv_transfer_params.remote_cached_tokens"),
    (with_(DECODE_SHAPE, remote_cached_tokens=41), "kv_transfer_params.remote_cached_tokens"),   # > remote_num_tokens
    (with_(DECODE_SHAPE, remote_cached_tokens="all"), "kv_transfer_params.remote_cached_tokens"),
    (without(DECODE_SHAPE, "first_token_id"), "kv_transfer_params.first_token_id"),
    (with_(DECODE_SHAPE, first_token_id=-1), "kv_transfer_params.first_token_id"),
    (with_(DECODE_SHAPE, first_token_id="42"), "kv_transfer_params.first_token_id"),
    (with_(DECODE_SHAPE, first_token_id=True), "kv_transfer_params.first_token_id"),
    (with_(DECODE_SHAPE, first_token_logprob=[42, -0.25]), "kv_transfer_params.first_token_logprob"),
    (with_(DECODE_SHAPE, first_token_logprob=with_(LOGPROB, token_id=7)), "kv_transfer_params.first_token_logprob"),
    (with_(DECODE_SHAPE, first_token_logprob=with_(LOGPROB, logprob="low")), "kv_transfer_params.first_token_logprob"),
    (with_(DECODE_SHAPE, first_token_logprob=with_(LOGPROB, logprob=math.nan)),
     "kv_transfer_params.first_token_logprob"),
    (with_(DECODE_SHAPE, first_token_logprob=with_(LOGPROB, top=[[42]])), "kv_transfer_params.first_token_logprob"),
    (with_(DECODE_SHAPE, first_token_logprob=with_(LOGPROB, top=[["42", -1.0]])),
     "kv_transfer_params.first_token_logprob"),
    (with_(DECODE_SHAPE, remote_num_tokens=False), "kv_transfer_params.remote_num_tokens"),
    (with_(DECODE_SHAPE, remote_num_tokens=3.5), "kv_transfer_params.remote_num_tokens"),
    (without(DECODE_SHAPE, "remote_block_ids"), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[1, 2, 3]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids={"0": [1]}), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids="[[1]]"), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[1], (2,)]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[1, -1]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[2**31]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[10**30]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[True]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[1.0]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[[None]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_block_ids=[["1"]]), "kv_transfer_params.remote_block_ids"),
    (with_(DECODE_SHAPE, remote_lease_expiry="soon"), "kv_transfer_params.remote_lease_expiry"),
    (with_(DECODE_SHAPE, remote_lease_expiry=True), "kv_transfer_params.remote_lease_expiry"),
    (with_(DECODE_SHAPE, remote_lease_expiry=math.nan), "kv_transfer_params.remote_lease_expiry"),
    (with_(DECODE_SHAPE, remote_lease_expiry=math.inf), "kv_transfer_params.remote_lease_expiry"),
])
def test_malformed_names_the_field(raw, field):
    with pytest.raises(InvalidRequestError) as caught:
        parse_kv_transfer_params(raw)
    assert caught.value.param == field
    assert field in str(caught.value)


@pytest.mark.parametrize("params", [
    EXPECTED_PREFILL,
    RemotePrefillParams(remote_engine_id="e", remote_request_id="r", remote_block_ids=(), remote_host="::1",
                        remote_port=1, remote_num_tokens=1, first_token_id=0),
    RemotePrefillParams(remote_engine_id="e", remote_request_id="r", remote_block_ids=((5,), (6, 7)),
                        remote_host="h", remote_port=65535, remote_num_tokens=17, remote_lease_expiry=12.0,
                        first_token_id=3, first_token_logprob=TokenLogprob(token_id=3, logprob=-2.0, top=((9, -0.5),))),
])
def test_to_json_round_trip(params):
    wire = params.to_json()
    assert wire["do_remote_prefill"] is True and wire["do_remote_decode"] is False
    assert all(isinstance(group, list) for group in wire["remote_block_ids"])
    assert parse_kv_transfer_params(wire) == params


def test_parsing_does_not_edit_the_body():
    raw = with_(DECODE_SHAPE)
    before = repr(raw)
    parse_kv_transfer_params(raw)
    assert repr(raw) == before


def test_peer_is_host_and_side_channel_port():
    assert EXPECTED_PREFILL.peer == "10.0.0.5:7001"
