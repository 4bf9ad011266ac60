"""The streaming wire: SSE framing, what each chunk means, the request body."""

from __future__ import annotations

import json

import pytest

from hybridpd.bench.client import NO_TOKEN_ERROR, EndpointTarget, StreamRecorder, build_payload
from hybridpd.bench.config import EndpointKind
from hybridpd.bench.datasets import SampleRequest
from hybridpd.bench.sse import SSEDecoder, StreamEvent, parse_event

STREAM = (
    b": ping\n\n"
    b'data: {"choices": [{"text": "a"}]}\n\n'
    b'data: {"choices": [{"text": "\xc3\xa9"}]}\r\n\r\n'
    b"data: first\ndata: second\n\n"
    b"data: [DONE]\n\n"
)
PAYLOADS = ['{"choices": [{"text": "a"}]}', '{"choices": [{"text": "\u00e9"}]}', "first\nsecond", "[DONE]"]


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(STREAM)])
def test_sse_decoder_is_independent_of_how_bytes_are_split(step):
    decoder = SSEDecoder()
    payloads = []
    for i in range(0, len(STREAM), step):
        payloads += decoder.feed(STREAM[i:i + step])
    assert payloads + decoder.close() == PAYLOADS


def test_sse_decoder_flushes_an_unterminated_last_event():
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"x": 1}') == []
    assert decoder.close() == ['{"x": 1}']


COMPLETION, CHAT = EndpointKind.COMPLETIONS, EndpointKind.CHAT


@pytest.mark.parametrize(
    "kind, payload, expected",
    [
        (COMPLETION, {"choices": [{"text": "hi", "finish_reason": None}]}, StreamEvent(carries_token=True, text="hi")),
        (COMPLETION, {"choices": [{"text": "", "finish_reason": None}]}, StreamEvent(carries_token=True)),
        (COMPLETION, {"choices": [{"text": "", "finish_reason": "length"}]}, StreamEvent(finishes=True)),
        (COMPLETION, {"choices": [{"text": "x", "finish_reason": "stop"}]},
         StreamEvent(carries_token=True, finishes=True, text="x")),
        (COMPLETION, {"choices": [{"text": "", "token_ids": [7], "finish_reason": "stop"}]},
         StreamEvent(carries_token=True, finishes=True)),
        (COMPLETION, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                                "prompt_tokens_details": {"cached_tokens": 3}}},
         StreamEvent(prompt_tokens=9, completion_tokens=4, cached_tokens=3)),
        (COMPLETION, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                                "prompt_tokens_details": None}},
         StreamEvent(prompt_tokens=9, completion_tokens=4)),
        (CHAT, {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
         StreamEvent(carries_token=False)),
        (CHAT, {"choices": [{"delta": {"content": "yo"}, "finish_reason": None}]}, StreamEvent(carries_token=True, text="yo")),
        (CHAT, {"error": {"message": "KV transfer failed", "code": 502}}, StreamEvent(error="KV transfer failed")),
    ],
)
def test_parse_event(kind, payload, expected):
    assert parse_event(json.dumps(payload), kind) == expected


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}


@pytest.mark.parametrize(
    "payloads, ttft, itl, output_len, error",
    [
        # Two tokens, the finish reason on the last one's chunk.
        ([_chunk("a"), _chunk("b", "length"), USAGE | {"usage": {"completion_tokens": 2}}], 1.0, (1.0,), 2, ""),
        # A separate empty finishing chunk after the tokens adds no token and no gap.
        ([_chunk("a"), _chunk(""), _chunk("", "stop"), USAGE | {"usage": {"completion_tokens": 2}}], 1.0, (1.0,), 2,
         ""),
        # One token whose text was held back (a byte that ends no UTF-8 character): only its finishing chunk shows it.
        ([_chunk("", "length"), USAGE], 1.0, (), 1, ""),
        # A stream that finishes having produced nothing has no token to time.
        ([_chunk("", "stop"), USAGE | {"usage": {"completion_tokens": 0}}], 0.0, (), 0, NO_TOKEN_ERROR),
        ([_chunk("", "stop")], 0.0, (), 0, NO_TOKEN_ERROR),
    ],
)
def test_stream_recorder_times_tokens(payloads, ttft, itl, output_len, error):
    recorder = StreamRecorder(start=0.0, prompt_len=5)
    for second, payload in enumerate(payloads, start=1):
        recorder.add(parse_event(json.dumps(payload), COMPLETION), float(second))
    recorder.add(parse_event("[DONE]", COMPLETION), float(len(payloads) + 1))
    output = recorder.output()
    assert (output.ttft, output.itl, output.output_len, output.error) == (ttft, itl, output_len, error)
    assert output.success == (not error)


def test_parse_event_done_and_garbage():
    assert parse_event("[DONE]", COMPLETION).done
    with pytest.raises(ValueError, match="bad stream chunk"):
        parse_event("{oops", COMPLETION)


@pytest.mark.parametrize(
    "kind, prompt, ignore_eos, sampling, expected",
    [
        (COMPLETION, (1, 2), True, (), {"prompt": [1, 2], "ignore_eos": True}),
        (COMPLETION, "hi", False, (("temperature", 0.0),), {"prompt": "hi", "temperature": 0.0}),
        (CHAT, "hi", False, (), {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_build_payload(kind, prompt, ignore_eos, sampling, expected):
    target = EndpointTarget(api_url="http://x/v1/completions", kind=kind, model="m", ignore_eos=ignore_eos,
                            sampling=sampling)
    body = build_payload(target, SampleRequest(prompt=prompt, prompt_len=2, expected_output_len=5))
    common = {"model": "m", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    assert body == common | expected


def test_chat_payload_needs_text():
    target = EndpointTarget(api_url="u", kind=CHAT, model="m", ignore_eos=False)
    with pytest.raises(ValueError, match="text prompts"):
        build_payload(target, SampleRequest(prompt=(1,), prompt_len=1, expected_output_len=1))
