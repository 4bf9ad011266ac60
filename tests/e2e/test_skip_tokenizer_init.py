"""`hybridpd serve --skip-tokenizer-init` as a real process, on a checkpoint with no tokenizer files (vLLM's flag:
token ids in, token ids out). It computes what a node with the tokenizer computes, refuses what needs the tokenizer
with a 400 in OpenAI's shape, and every block not held by the prefix cache is free afterwards."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import assert_blocks_free, start_node, stream_completion

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 120, 33, 2, 77, 15, 91, 18]
NODE_ARGS = ["--num-blocks", "128", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    with_tokenizer = write_checkpoint("tiny", tmp_path_factory.mktemp("model"))
    bare = tmp_path_factory.mktemp("bare") / "tiny"
    shutil.copytree(with_tokenizer, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    return with_tokenizer, bare


@pytest.fixture(scope="module")
def reference_ids(dirs, tmp_path_factory):
    """The greedy answer of a node that has the tokenizer."""
    node = start_node(dirs[0], tmp_path_factory.mktemp("ref-logs"), NODE_ARGS, name="reference")
    try:
        status, body = node.post_json("/v1/completions", completion(return_token_ids=True))
        assert status == 200, body
        return body["choices"][0]["token_ids"]
    finally:
        node.stop()


@pytest.fixture(scope="module")
def node(dirs, tmp_path_factory):
    n = start_node(dirs[1], tmp_path_factory.mktemp("logs"), [*NODE_ARGS, "--skip-tokenizer-init"])
    try:
        yield n
    finally:
        n.stop()


def completion(**kw):
    return {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def test_token_ids_in_and_out(node, reference_ids):
    status, body = node.post_json("/v1/completions", completion(return_token_ids=True))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == reference_ids
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] == len(PROMPT)
    assert_blocks_free(node)


def test_stream_sends_a_chunk_per_token(node, reference_ids):
    events = asyncio.run(stream_completion(node.url, completion(stream=True, return_token_ids=True)))
    tokens = [e["choices"][0] for e in events if e.get("choices") and e["choices"][0].get("token_ids")]
    assert all(c["text"] == "" for c in tokens)
    assert [t for c in tokens for t in c["token_ids"]] == reference_ids
    assert len(tokens) == len(reference_ids)  # one chunk per token, none held back for text
    assert_blocks_free(node)


def test_logprobs_name_tokens_by_id(node, reference_ids):
    status, body = node.post_json("/v1/completions", completion(logprobs=2))
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in reference_ids]
    assert all(len(top) >= 1 and all(k.startswith("token_id:") for k in top) for top in logprobs["top_logprobs"])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop": ["\n"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "messages"),
    ("/tokenize", {"prompt": "hello"}, "prompt"),
])
def test_what_needs_the_tokenizer_is_refused(node, path, body, param):
    status, out = node.post_json(path, body)
    assert status == 400, out
    assert out["error"]["param"] == param and "--skip-tokenizer-init" in out["error"]["message"]
    assert node.get_json("/health")["status"] == "ok"
    assert_blocks_free(node)
