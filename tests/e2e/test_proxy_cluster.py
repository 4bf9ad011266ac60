"""The proxy in front of real nodes (2 prefill + 1 decode on the tiny checkpoint, via LocalCluster, every
process given the same cluster token): greedy outputs equal a colocated node's, streamed or not,
completions and chat; a proxy without the token (or with a wrong one) gets the node's 401 passed through;
then nodes are killed one by one and the proxy retries, or answers 502 naming the node, without hanging."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from hybridpd.bench.prometheus import KV_BYTES_READ_METRIC, counter_sum
from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports, free_port
from hybridpd.launcher.spec import ClusterInfo, ClusterSpec
from hybridpd.proxy.app import build_app
from hybridpd.proxy.config import ProxyConfig, Role, Upstream
from tests.e2e.nodes import make_tiny_checkpoint

REQUEST_TIMEOUT = 120.0
CLUSTER_TOKEN = "e2e-cluster-token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[LocalCluster, ClusterInfo]]:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(CLUSTER_TOKEN + "\n")
    proxy_port, base_port = free_cluster_ports(3)
    spec = ClusterSpec(
        num_prefill=2, num_decode=1, model_dir=model, port=proxy_port, base_port=base_port,
        run_dir=tmp_path_factory.mktemp("run"), startup_timeout=240.0, stop_grace=10.0,
        serve_args=("--kv-cache-memory", "64MiB", "--cluster-token-file", str(token_file),
                    "--enable-auto-tool-choice", "--tool-call-parser", "granite4"),
        proxy_args=("--prefill-timeout", "60", "--decode-timeout", "60", "--connect-timeout", "2",
                    "--cluster-token-file", str(token_file)),
    )
    local = LocalCluster(spec)
    try:
        yield local, local.start()
    finally:
        local.stop()


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _text(path: str, raw: bytes, stream: bool) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    pieces = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        assert "error" not in event, event
        for choice in event.get("choices", []):
            pieces.append((choice["delta"].get("content") or "") if "delta" in choice else choice["text"])
    return "".join(pieces)


COMPLETION = {"prompt": "The hybrid model reads this prompt of some length, " * 4, "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Say something about prefill and decode."}],
        "max_completion_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("path, body, stream", [
    ("/v1/completions", COMPLETION, False),
    ("/v1/completions", COMPLETION, True),
    ("/v1/chat/completions", CHAT, False),
    ("/v1/chat/completions", CHAT, True),
])
def test_greedy_output_through_the_proxy_equals_a_colocated_node(cluster, path, body, stream):
    _, info = cluster
    body = {**body, "stream": stream}
    status, raw = _post(info.proxy_url + path, body)
    assert status == 200, raw
    local_status, local_raw = _post(info.decode[0].url + path, body)  # no kv_transfer_params: colocated
    assert local_status == 200, local_raw
    assert _text(path, raw, stream) == _text(path, local_raw, stream)
    assert _text(path, raw, stream) != ""


EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}


def _chunks(raw: bytes) -> list[dict[str, Any]]:
    events = [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**COMPLETION, "logprobs": 2, "return_token_ids": True}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}),
    ("/v1/completions", {**COMPLETION, "stop": ["~~~~~"]}),   # text held back for a stop string's possible start
    ("/v1/completions", {**COMPLETION, "stop": ["~~~~~"], "max_tokens": 1}),  # ... and released at the end
    ("/v1/chat/completions", {**CHAT, "stop": ["~~~~~"], "max_completion_tokens": 1}),
    ("/v1/completions", {**COMPLETION, "stream_options": EVERY_CHUNK}),      # the usage so far in every chunk
    ("/v1/chat/completions", {**CHAT, "stream_options": EVERY_CHUNK}),
])
def test_a_stream_through_the_proxy_is_shaped_as_a_colocated_one(cluster, path, body):
    """Its head comes from the prefill node's stream and the rest from the decode node's: chunk for chunk the
    same as one node's stream (role chunk, texts, token ids, logprobs and their offsets, finish, usage), under one
    id and `created`."""
    _, info = cluster
    body = {"stream_options": {"include_usage": True}, **body, "stream": True}
    status, raw = _post(info.proxy_url + path, body)
    assert status == 200, raw
    local_status, local_raw = _post(info.decode[0].url + path, body)
    assert local_status == 200, local_raw
    ours, local = _chunks(raw), _chunks(local_raw)
    assert len({(c["id"], c["created"]) for c in ours}) == 1

    def shape(chunks: list[dict[str, Any]]) -> list[Any]:
        out = [json.loads(json.dumps({**c, "id": None, "created": None}),
                          parse_float=lambda text: round(float(text), 3)) for c in chunks]
        for chunk in out:  # where the prompt hit depends on the calls before (the decode node keeps what it pulls)
            chunk.get("usage", {}).pop("prompt_tokens_details", None)
        return out

    assert shape(ours) == shape(local)


def _texts_by_index(path: str, raw: bytes, stream: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    choices = json.loads(raw)["choices"] if not stream else [choice for c in _chunks(raw) for choice in c["choices"]]
    for choice in choices:
        if "message" in choice:
            piece = choice["message"]["content"]
        else:
            piece = (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
        texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_seeded_samples_through_the_proxy_equal_a_colocated_nodes(cluster, path, body, stream):
    """`n` 3 sampled with a seed: split by the proxy into three P/D requests (seed + i), drawn by the node as three
    requests of its own (seed + i): the same three texts at the same indices."""
    _, info = cluster
    body = {**body, "n": 3, "seed": 11, "temperature": 1.0, "stream": stream}
    status, raw = _post(info.proxy_url + path, body)
    assert status == 200, raw
    local_status, local_raw = _post(info.decode[0].url + path, body)
    assert local_status == 200, local_raw
    ours, local = _texts_by_index(path, raw, stream), _texts_by_index(path, local_raw, stream)
    assert sorted(ours) == [0, 1, 2] and ours == local
    assert len(set(ours.values())) > 1   # three draws, not one repeated
    if not stream:
        usage, local_usage = json.loads(raw)["usage"], json.loads(local_raw)["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            local_usage["prompt_tokens"], local_usage["completion_tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_kept_in_the_output_through_the_proxy(cluster, stream):
    """`include_stop_str_in_output`: the output ends with the stop string, where the plain output has it, through P/D
    as on one node (the prefill node's first token and the decode node's rest)."""
    _, info = cluster
    status, raw = _post(info.decode[0].url + "/v1/completions", COMPLETION)
    plain = _text("/v1/completions", raw, False)
    stop = plain[2:4]
    assert status == 200 and stop.strip(), plain
    body = {**COMPLETION, "stop": [stop], "include_stop_str_in_output": True, "stream": stream}
    status, raw = _post(info.proxy_url + "/v1/completions", body)
    local_status, local_raw = _post(info.decode[0].url + "/v1/completions", body)
    assert status == local_status == 200, raw
    text = _text("/v1/completions", raw, stream)
    assert text == _text("/v1/completions", local_raw, stream) == plain[:plain.index(stop) + len(stop)]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "ignore_eos": False, "max_completion_tokens": 80,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                              "structured_outputs": {"disable_any_whitespace": True}}),
    ("/v1/completions", {**COMPLETION, "ignore_eos": False, "max_tokens": 20,
                         "structured_outputs": {"choice": ["prefill", "decode", "both"]}}),
    ("/v1/completions", {**COMPLETION, "ignore_eos": False, "max_tokens": 20, "temperature": 1.0, "seed": 5, "n": 2,
                         "structured_outputs": {"regex": "(ab|cd)[0-9]{2}"}}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_through_the_proxy_equal_a_colocated_nodes(cluster, path, body, stream):
    """The prefill node draws the first token under the constraint, the decode node's matcher takes it and goes on:
    the same outputs as one node's, and every one matches the constraint."""
    _, info = cluster
    body = {**body, "stream": stream}
    read_before = _kv_bytes_read(info)
    status, raw = _post(info.proxy_url + path, body)
    assert _kv_bytes_read(info) > read_before   # split: the decode node pulled the prompt's KV
    local_status, local_raw = _post(info.decode[0].url + path, body)
    assert status == local_status == 200, raw
    ours, local = _texts_by_index(path, raw, stream), _texts_by_index(path, local_raw, stream)
    assert ours == local and len(ours) == body.get("n", 1)
    for text in ours.values():
        if "response_format" in body:
            value = json.loads(text)
            assert set(value) == {"name", "n", "ok"} and 0 <= value["n"] <= 99 and len(value["name"]) <= 6
        elif "choice" in body["structured_outputs"]:
            assert text in ("prefill", "decode", "both")
        else:
            assert re.fullmatch("(ab|cd)[0-9]{2}", text), text


ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}
TOOLS_CHAT = {**CHAT, "ignore_eos": False, "max_completion_tokens": 300, "tools": [ADD, NOW]}


def _tool_answer(raw: bytes, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
    """The content, the calls (name, arguments) and the finish reason, put together from a stream as a client does."""
    if not stream:
        choice = json.loads(raw)["choices"][0]
        calls = choice["message"].get("tool_calls", [])
        return (choice["message"]["content"] or "", [(c["function"]["name"], c["function"]["arguments"])
                                                     for c in calls], choice["finish_reason"])
    content, calls, reason = "", {}, None
    for choice in (choice for chunk in _chunks(raw) for choice in chunk["choices"]):
        content += choice["delta"].get("content") or ""
        for piece in choice["delta"].get("tool_calls", []):
            name, arguments = calls.get(piece["index"], (None, ""))
            calls[piece["index"]] = (piece["function"].get("name", name), arguments + piece["function"]["arguments"])
        reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("body", [
    {**TOOLS_CHAT, "tool_choice": {"type": "function", "function": {"name": "add"}}},
    {**TOOLS_CHAT, "tool_choice": "required", "parallel_tool_calls": False},
    # auto: the model's own `<tool_call>` format, read by the granite4 parser (a regex makes the random model write one)
    {**TOOLS_CHAT, "structured_outputs": {
        "regex": r'Sure\.<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'}},
])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_through_the_proxy_equal_a_colocated_nodes(cluster, body, stream):
    """Tools in the template, the call constrained on the prefill node's first token and the decode node's rest, or
    read from the text the decode node wrote: the same calls as one node's, each of the named tool's schema."""
    _, info = cluster
    body = {**body, "stream": stream}
    read_before = _kv_bytes_read(info)
    status, raw = _post(info.proxy_url + "/v1/chat/completions", body)
    assert _kv_bytes_read(info) > read_before
    local_status, local_raw = _post(info.decode[0].url + "/v1/chat/completions", body)
    assert status == local_status == 200, raw
    content, calls, reason = _tool_answer(raw, stream)
    assert (content, calls, reason) == _tool_answer(local_raw, stream)
    assert len(calls) == 1
    name, arguments = calls[0][0], json.loads(calls[0][1])
    if name == "add":
        assert set(arguments) == {"a", "b"} and all(0 <= v <= 99 for v in arguments.values())
    else:   # "required" may call either tool
        assert (name, body["tool_choice"]) == ("now", "required") and isinstance(arguments, dict)
    if "structured_outputs" in body:
        assert (content, reason) == ("Sure.", "tool_calls")
    else:
        assert content == "" and reason == ("stop" if isinstance(body["tool_choice"], dict) else "tool_calls")


def _responses_output(base_url: str, body: dict[str, Any], stream: bool) -> tuple[str, list[Any], Any]:
    """The status, the output items without their ids and the usage of a Responses API answer, as the `openai`
    client reads it (a stream: its completed response, checked against the items and text its events sent)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
    model = client.models.list().data[0].id
    if stream:
        events = list(client.responses.create(model=model, stream=True, **body))
        response = events[-1].response
        assert events[-1].type == "response.completed"
        assert [e.item for e in events if e.type == "response.output_item.done"] == response.output
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "".join(i.content[0].text for i in response.output if i.type == "message" and i.content)
    else:
        response = client.responses.create(model=model, **body)
    items = [(i.type, i.content[0].text if i.content else "") if i.type == "message" else (i.type, i.name, i.arguments)
             for i in response.output]
    return response.status, items, response.usage.output_tokens


RESPONSE = {"input": "Say something about prefill and decode.", "instructions": "Be brief.", "max_output_tokens": 8,
            "temperature": 0, "extra_body": {"ignore_eos": True}}
RESPONSE_TOOLS = {**RESPONSE, "max_output_tokens": 300, "extra_body": {},
                  "tools": [{"type": "function", **tool["function"]} for tool in (ADD, NOW)]}


@pytest.mark.parametrize("body", [
    RESPONSE,
    {**RESPONSE_TOOLS, "tool_choice": {"type": "function", "name": "add"}},
    {**RESPONSE_TOOLS, "extra_body": {"structured_outputs": {
        "regex": r'Sure\.<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'}}},
])
@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_through_the_proxy_equals_a_colocated_nodes(cluster, body, stream):
    """The `openai` client's `responses.create` through P/D (the prefill node's one output token, the KV pulled, the
    decode node's rest) reads what it reads from one node."""
    _, info = cluster
    read_before = _kv_bytes_read(info)
    answer = _responses_output(info.proxy_url, body, stream)
    assert _kv_bytes_read(info) > read_before
    assert answer == _responses_output(info.decode[0].url, body, stream)
    status, items, output_tokens = answer
    if "tools" not in body:
        assert (status, output_tokens, [kind for kind, _ in items]) == ("incomplete", 8, ["message"])
    else:
        assert status == "completed" and items[-1][:2] == ("function_call", "add")
        assert set(json.loads(items[-1][2])) == {"a", "b"}
        assert items[:-1] == ([("message", "Sure.")] if "structured_outputs" in body["extra_body"] else [])


def _message(base_url: str, body: dict[str, Any], stream: bool) -> tuple[Any, ...]:
    """What the `anthropic` client reads of a Messages answer: its content blocks without ids, the stop reason and
    the output tokens (a stream: the message the client builds from the events, checked against its text deltas)."""
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
    model = client.models.list().data[0].id
    if stream:
        with client.messages.stream(model=model, **body) as events:
            text = "".join(events.text_stream)
            message = events.get_final_message()
        assert text == "".join(block.text for block in message.content if block.type == "text")
    else:
        message = client.messages.create(model=model, **body)
    blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]
    return blocks, message.stop_reason, message.usage.output_tokens


MESSAGE = {"system": "Be brief.", "max_tokens": 8, "extra_body": {"temperature": 0},
           "messages": [{"role": "user", "content": "Say something about prefill and decode."}]}
MESSAGE_TOOLS = {**MESSAGE, "max_tokens": 300, "tool_choice": {"type": "tool", "name": "add"},
                 "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                            "input_schema": t["function"].get("parameters", {})} for t in (ADD, NOW)]}


@pytest.mark.parametrize("body", [MESSAGE, MESSAGE_TOOLS])
@pytest.mark.parametrize("stream", [False, True])
def test_the_messages_api_through_the_proxy_equals_a_colocated_nodes(cluster, body, stream):
    """The `anthropic` client's `messages.create` and `messages.stream` through P/D (the prefill node's one output
    token, the KV pulled, the decode node's rest) read what they read from one node; count_tokens is answered too."""
    _, info = cluster
    read_before = _kv_bytes_read(info)
    answer = _message(info.proxy_url, body, stream)
    assert _kv_bytes_read(info) > read_before
    assert answer == _message(info.decode[0].url, body, stream)
    blocks, reason, output_tokens = answer
    if "tools" in body:
        assert reason == "tool_use" and len(blocks) == 1 and blocks[0][:2] == ("tool_use", "add")
        assert set(blocks[0][2]) == {"a", "b"}
    else:
        assert [kind for kind, *_ in blocks] == ["text"] and 1 <= output_tokens <= 8
    client = anthropic.Anthropic(base_url=info.proxy_url, api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
    counted = client.messages.count_tokens(model=client.models.list().data[0].id, system=body["system"],
                                           messages=body["messages"])
    assert counted.input_tokens > 0


def _one_token_word(url: str, token_ids: list[int]) -> tuple[str, int] | None:
    """An output token that is a word of ASCII letters on its own: the text that encodes to it alone."""
    for token in token_ids:
        _, raw = _post(url + "/detokenize", {"tokens": [token]})
        word = json.loads(raw)["prompt"].strip()
        if word.isascii() and word.isalpha():
            _, raw = _post(url + "/tokenize", {"prompt": word, "add_special_tokens": False})
            if json.loads(raw)["tokens"] == [token]:
                return word, token
    return None


def test_bad_words_through_the_proxy_equal_a_colocated_nodes(cluster):
    """A one-token word of the plain greedy output, banned: the output no longer holds that token, and P/D (the
    prefill node's first token, the decode node's rest) bans it as one node does."""
    _, info = cluster
    node = info.decode[0].url
    _, raw = _post(node + "/v1/completions", {**COMPLETION, "max_tokens": 16, "return_token_ids": True})
    plain = json.loads(raw)["choices"][0]["token_ids"]
    found = _one_token_word(node, plain)
    assert found is not None, plain
    word, token = found
    body = {**COMPLETION, "max_tokens": 16, "bad_words": [word], "return_token_ids": True}
    status, raw = _post(info.proxy_url + "/v1/completions", body)
    local_status, local_raw = _post(node + "/v1/completions", body)
    assert status == local_status == 200, raw
    banned = json.loads(raw)["choices"][0]["token_ids"]
    assert banned == json.loads(local_raw)["choices"][0]["token_ids"] != plain
    assert token not in banned


def _kv_bytes_read(info: ClusterInfo) -> float:
    with urllib.request.urlopen(info.decode[0].metrics_url, timeout=10) as response:
        return counter_sum(response.read().decode(), KV_BYTES_READ_METRIC) or 0.0


async def _post_through_inprocess_proxy(info: ClusterInfo, token: str | None) -> tuple[int, dict[str, Any]]:
    """One completion through a second proxy (in this process) in front of the same nodes."""
    config = ProxyConfig(
        prefillers=tuple(Upstream(role=Role.PREFILL, host="127.0.0.1", port=n.port) for n in info.prefill),
        decoders=tuple(Upstream(role=Role.DECODE, host="127.0.0.1", port=n.port) for n in info.decode),
        prefill_timeout=60.0, decode_timeout=60.0, cluster_token=token,
    )
    runner = web.AppRunner(build_app(config), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION) as resp:
                return resp.status, await resp.json()
    finally:
        await runner.cleanup()


async def _through_keep_alive_proxy(info: ClusterInfo, path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """A stream through a second proxy (in this process) sending keep-alive comments every millisecond of quiet:
    (the text the `openai` client reads from it, the raw stream read again)."""
    config = ProxyConfig(
        prefillers=tuple(Upstream(role=Role.PREFILL, host="127.0.0.1", port=n.port) for n in info.prefill),
        decoders=tuple(Upstream(role=Role.DECODE, host="127.0.0.1", port=n.port) for n in info.decode),
        prefill_timeout=60.0, decode_timeout=60.0, cluster_token=CLUSTER_TOKEN, sse_keep_alive=0.001,
    )
    runner = web.AppRunner(build_app(config), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=REQUEST_TIMEOUT)
        model = (await client.models.list()).data[0].id
        extra = {k: v for k, v in body.items() if k not in ("messages", "prompt", "max_tokens", "temperature",
                                                             "max_completion_tokens")}
        if path.endswith("chat/completions"):
            stream = await client.chat.completions.create(
                model=model, messages=body["messages"], max_completion_tokens=body["max_completion_tokens"],
                temperature=0, stream=True, extra_body=extra)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            stream = await client.completions.create(model=model, prompt=body["prompt"], max_tokens=body["max_tokens"],
                                                     temperature=0, stream=True, extra_body=extra)
            text = "".join([c.choices[0].text async for c in stream if c.choices])
        await client.close()
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}{path}", json={**body, "stream": True}) as resp:
                return text, await resp.read()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_keep_alive_comments_through_real_nodes_leave_the_stream_the_clients_read(cluster, path, body):
    """A proxy with --sse-keep-alive-interval in front of real nodes: the `openai` client reads from its stream what
    a colocated node answers, and the stream is whole events and comments only (none inside an event)."""
    _, info = cluster
    text, raw = await _through_keep_alive_proxy(info, path, body)
    local_status, local_raw = await asyncio.to_thread(_post, info.decode[0].url + path, {**body, "stream": True})
    assert local_status == 200 and text == _text(path, local_raw, True) != ""
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == "" and all(b == ": keep-alive" or b.startswith("data: ") for b in blocks[:-1])
    assert _text(path, raw, True) == text


@pytest.mark.parametrize("token, status", [
    (None, 401),                   # the node's own 401 passes through the proxy as a 4xx, not a 502
    ("not-the-token", 401),
    (CLUSTER_TOKEN, 200),
])
async def test_the_cluster_token_reaches_the_nodes(cluster, token, status):
    _, info = cluster
    read_before = await asyncio.to_thread(_kv_bytes_read, info)
    answer_status, answer = await _post_through_inprocess_proxy(info, token)
    assert answer_status == status, answer
    read_after = await asyncio.to_thread(_kv_bytes_read, info)
    if status == 401:
        assert answer["error"]["type"] == "authentication_error"
        assert "X-HybridPD-Cluster-Token" in answer["error"]["message"]
        assert read_after == read_before
    else:
        assert answer["choices"][0]["text"] != ""
        assert read_after > read_before  # the decode node pulled KV over the token-checked side channel


def test_killed_nodes_mean_retry_then_colocated_fallback_then_502_naming_the_node(cluster):
    _, info = cluster
    os.kill(info.prefill[0].pid, signal.SIGKILL)
    for _ in range(2):  # round robin would pick the dead node for one of these: the proxy retries
        status, raw = _post(info.proxy_url + "/v1/completions", COMPLETION)
        assert status == 200, raw
    os.kill(info.prefill[1].pid, signal.SIGKILL)
    status, raw = _post(info.proxy_url + "/v1/completions", COMPLETION)  # no prefill node left: the decode node
    assert status == 200, raw                                               # prefills it itself (--fallback-colocated)
    assert json.loads(raw)["choices"][0]["text"] != ""
    with urllib.request.urlopen(info.proxy_url + "/metrics", timeout=REQUEST_TIMEOUT) as answer:
        assert "hybridpd_proxy_fallback_colocated_total 1.0" in answer.read().decode()
    os.kill(info.decode[0].pid, signal.SIGKILL)
    request = urllib.request.Request(info.proxy_url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT)
    assert failure.value.code == 502
    assert f"decode node {info.decode[0].url.removeprefix('http://')}" in failure.value.read().decode()
    assert Path(info.run_dir / "proxy.log").exists()
