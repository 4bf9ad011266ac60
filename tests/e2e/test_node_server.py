"""`hybridpd serve` as a real process: every endpoint, streaming and not, bad inputs, a client that disconnects
mid-stream; afterwards every block not held by the prefix cache is free (read from /metrics) and the node is
healthy and still answers correctly."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import assert_blocks_free, start_node, stream_completion


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint("tiny", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    """The reference: what transformers' AutoTokenizer makes of the same directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# The node renders chat with this template (vLLM's --chat-template, from a file) and a default variable.
TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m.role }}|{{ tone }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def node(model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    n = start_node(model_dir, tmp_path_factory.mktemp("logs"), [
        "--num-blocks", "256", "--max-model-len", "512", "--chat-template", str(template),
        "--default-chat-template-kwargs", '{"tone": "calm"}'])
    try:
        yield n
    finally:
        n.stop()


def completion(prompt, **kw):
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}


def test_models_health_tokenize(node, hf_tokenizer):
    models = node.get_json("/v1/models")
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 512
    assert node.get_json("/health")["status"] == "ok"
    for text in ("hello", "The quick brown fox, café 日本語!", "<|end_of_text|>"):
        status, tok = node.post_json("/tokenize", {"prompt": text})
        expected = hf_tokenizer(text)["input_ids"]
        assert status == 200 and tok["tokens"] == expected and tok["count"] == len(expected)


def test_completion_and_return_token_ids(node, hf_tokenizer):
    text = "The quick brown fox jumps over the lazy dog and back again, twice"
    ids = hf_tokenizer(text)["input_ids"]
    assert len(ids) >= 16
    status, body = node.post_json("/v1/completions", completion(text, return_token_ids=True))
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["prompt_token_ids"] == ids
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert choice["text"] == hf_tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    # greedy is deterministic, and a token-id prompt gives the same answer as its text
    status, again = node.post_json("/v1/completions", completion(ids, return_token_ids=True))
    assert status == 200 and again["choices"][0]["token_ids"] == choice["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # the first request's blocks hit


def test_streaming_matches_non_streaming(node):
    body = completion("streaming is", stream=True, stream_options={"include_usage": True}, max_tokens=10)
    events = asyncio.run(stream_completion(node.url, body))
    assert events[-1] == {"done": True}
    usage = events[-2]["usage"]
    text = "".join(e["choices"][0]["text"] for e in events[:-2] if e.get("choices"))
    status, plain = node.post_json("/v1/completions", completion("streaming is", max_tokens=10))
    assert status == 200 and plain["choices"][0]["text"] == text
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_chat(node):
    status, body = node.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_chat_renders_with_the_template_flag(node, hf_tokenizer):
    """--chat-template replaces the checkpoint's template (the special tokens as transformers passes them), the
    default variable applies unless the request sets it, and a request's own template is refused untrusted."""
    user = [{"role": "user", "content": "hi"}]
    for kwargs, tone in ((None, "calm"), ({"tone": "loud"}, "loud")):
        body = {"messages": user, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        status, tok = node.post_json("/tokenize", body)
        text = hf_tokenizer.apply_chat_template(user, chat_template=TEMPLATE, tokenize=False, tone=tone)
        assert status == 200 and tok["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        status, answer = node.post_json("/v1/chat/completions", {**body, "max_tokens": 2})
        assert status == 200 and answer["usage"]["prompt_tokens"] == tok["count"]
    status, refused = node.post_json("/v1/chat/completions", {"messages": user, "chat_template": "{{ 1 }}"})
    assert status == 400 and "--trust-request-chat-template" in refused["error"]["message"]


@pytest.mark.parametrize("body, fragment", [
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": [1, 2, 99999]}, "vocabulary"),
    ({"prompt": "x", "max_tokens": 600}, "cannot be greater than max_model_len=512"),
    ({"prompt": [1] * 513, "max_tokens": 1}, "maximum context length is 512"),
    ({"prompt": []}, "prompt"),
])
def test_bad_input_is_a_400_with_an_openai_error(node, body, fragment):
    status, answer = node.post_json("/v1/completions", body)
    assert status == 400, answer
    assert fragment in answer["error"]["message"]
    assert answer["error"]["code"] == 400 and answer["error"]["type"]


def test_malformed_json_is_a_400(node):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(node.url + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "error" in json.loads(err.value.read())


async def _disconnect_mid_stream(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/v1/completions", json=completion(
            "a long answer", stream=True, max_tokens=400, ignore_eos=True))
        assert resp.status == 200
        await resp.content.readline()
        resp.close()  # the client goes away mid-stream


def test_disconnect_mid_stream_frees_blocks_and_node_stays_healthy(node):
    asyncio.run(_disconnect_mid_stream(node.url))
    assert_blocks_free(node)
    assert node.get_json("/health")["status"] == "ok"
    status, body = node.post_json("/v1/completions", completion("still fine"))
    assert status == 200 and body["choices"][0]["text"] is not None


def test_metrics_and_drained_pool(node):
    text = node.metrics()
    for name in ("vllm:num_requests_running", "hybridpd:kv_free_blocks", "hybridpd:group_prefix_cache_hits",
                 "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc"):
        assert name in text
    assert_blocks_free(node)
