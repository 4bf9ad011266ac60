"""Bodies of several choices, as OpenAI's API and vLLM take them: several prompts in one completions body (`prompt`
a list of strings or of token-id lists) and `n` > 1 samples of each. Each choice is its own engine request (prompt
p's sample i at index p * n + i, its seed the body's + i); one answer with the choices in order, or one stream
interleaving them by index; the usage counts each prompt once. Echo and logprobs per choice (lm-evaluation-harness
sends its loglikelihood batches so); a failure of one ends the others."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from .conftest import parse_sse
from .fake_engine import fake_token

USER = [{"role": "user", "content": "hi"}]


async def post(client, **body):
    resp = await client.post("/v1/completions", json=body)
    return resp.status, await resp.json()


async def test_a_choice_per_prompt_in_order_with_the_usage_summed(client, engine):
    status, out = await post(client, prompt=["Hi", "you there"], max_tokens=3)
    assert status == 200
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "abc"), (1, "abc")]
    assert [r.prompt_token_ids for r in engine.requests] == [tuple(b"Hi"), tuple(b"you there")]
    assert len({r.request_id for r in engine.requests}) == 2
    assert out["usage"] == {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert out["id"] == engine.requests[0].request_id and out["object"] == "text_completion"


async def test_token_prompts_with_echo_and_logprobs_as_lm_eval_batches_them(client):
    prompts = [[72, 105], [1, 2, 3, 4]]
    status, out = await post(client, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert status == 200
    for prompt, choice in zip(prompts, out["choices"]):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["tokens"][-1] == chr(fake_token(0))
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)


async def test_return_token_ids_per_choice(client):
    status, out = await post(client, prompt=[[5, 6], [7]], max_tokens=2, return_token_ids=True)
    assert status == 200
    assert [c["prompt_token_ids"] for c in out["choices"]] == [[5, 6], [7]]
    assert [c["token_ids"] for c in out["choices"]] == [[fake_token(0), fake_token(1)]] * 2
    assert "prompt_token_ids" not in out


async def test_a_bad_prompt_refuses_the_whole_body_before_any_request(client, engine):
    status, out = await post(client, prompt=["fine", [engine.vocab_size]], max_tokens=2)
    assert status == 400 and out["error"]["param"] == "prompt"
    assert engine.requests == []


async def test_one_failure_fails_the_body_and_ends_the_others(client, engine):
    engine.fail_at_output = 0
    single_status, single = await post(client, prompt="a", max_tokens=4)
    engine.fail_at_output, engine.fail_request, engine.endless = None, 2, True   # the batch's second prompt fails
    status, out = await post(client, prompt=["a", "bb", "ccc"], max_tokens=4)
    assert status == single_status != 200 and out["error"] == single["error"] | {"message": out["error"]["message"]}
    others = [engine.requests[1].request_id, engine.requests[3].request_id]
    await engine.aborted_event.wait()
    assert sorted(engine.aborted) == sorted(others)   # the endless ones were closed: aborted, nothing left running


async def test_n_samples_of_one_prompt_each_with_its_seed(client, engine):
    status, out = await post(client, prompt="Hi", max_tokens=2, n=3, seed=7, temperature=1.0)
    assert status == 200
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [r.sampling.seed for r in engine.requests] == [7, 8, 9]
    assert [r.prompt_token_ids for r in engine.requests] == [tuple(b"Hi")] * 3
    assert len({r.request_id for r in engine.requests}) == 3 and out["id"] == engine.requests[0].request_id
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}   # the prompt counted once


async def test_n_without_a_seed_leaves_every_sample_unseeded(client, engine):
    status, _ = await post(client, prompt="Hi", max_tokens=1, n=2)
    assert status == 200 and [r.sampling.seed for r in engine.requests] == [None, None]


async def test_a_seed_at_the_int64_edge_wraps_within_int64(client, engine):
    status, _ = await post(client, prompt="Hi", max_tokens=1, n=2, seed=2**63 - 1)
    assert status == 200 and [r.sampling.seed for r in engine.requests] == [2**63 - 1, -(2**63)]


async def test_n_samples_of_several_prompts_are_indexed_prompt_by_prompt(client, engine):
    status, out = await post(client, prompt=["a", "bcd"], max_tokens=1, n=2, seed=0, return_token_ids=True)
    assert status == 200
    assert [(c["index"], c["prompt_token_ids"]) for c in out["choices"]] == [
        (0, [97]), (1, [97]), (2, [98, 99, 100]), (3, [98, 99, 100])]
    assert [r.sampling.seed for r in engine.requests] == [0, 1, 0, 1]
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["completion_tokens"] == 4


async def test_chat_n_samples(client, engine):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "n": 2})
    out = await resp.json()
    assert resp.status == 200 and out["object"] == "chat.completion"
    assert [(c["index"], c["message"]) for c in out["choices"]] == [
        (i, {"role": "assistant", "content": "ab"}) for i in range(2)]
    assert out["usage"]["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)
    assert out["usage"]["completion_tokens"] == 4


async def test_echo_on_every_sample(client):
    status, out = await post(client, prompt="Hi", max_tokens=1, n=2, echo=True)
    assert status == 200 and [c["text"] for c in out["choices"]] == ["Hi" + chr(fake_token(0))] * 2


def _by_index(chunks):
    per_index = defaultdict(list)
    for chunk in chunks:
        for choice in chunk["choices"]:
            per_index[choice["index"]].append(choice)
    return per_index


@pytest.mark.parametrize("body", [
    {"prompt": "Hi", "n": 3},
    {"prompt": ["Hi", "you", "there"]},
])
async def test_a_stream_of_several_choices_interleaves_them_by_index(client, engine, body):
    resp = await client.post("/v1/completions", json=body | {
        "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks, usage = events[:-2], events[-2]
    assert {c["id"] for c in events[:-1]} == {engine.requests[0].request_id}
    per_index = _by_index(chunks)
    assert sorted(per_index) == [0, 1, 2]
    for choices in per_index.values():
        assert "".join(c["text"] for c in choices) == "abcd"
        assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    order = [c["choices"][0]["index"] for c in chunks]
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)   # the last choice began before the first ended
    prompt_tokens = 2 if "n" in body else 2 + 3 + 5
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == prompt_tokens
    assert usage["usage"]["completion_tokens"] == 12


async def test_a_chat_stream_of_n_samples_has_a_role_chunk_per_index(client):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "n": 2, "stream": True})
    events = parse_sse(await resp.text())
    per_index = _by_index(events[:-1])
    for index in (0, 1):
        assert [c["delta"] for c in per_index[index]] == [
            {"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]


async def test_a_failure_before_any_output_is_the_http_error(client, engine):
    engine.fail_at_output = 0
    resp = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "stream": True})
    assert resp.status != 200 and (await resp.json())["error"]["type"]


async def _aborted(engine, count):
    async def every():
        while len(engine.aborted) < count:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(every(), 30)   # a guard against a hang, not a measure
    return sorted(engine.aborted)


async def test_a_choice_failing_mid_stream_ends_the_stream_and_the_others(client, engine):
    engine.fail_request, engine.endless = 1, True   # the second choice fails; the others would never end
    resp = await client.post("/v1/completions", json={"prompt": "x", "n": 3, "stream": True})
    assert resp.status == 200
    events = parse_sse(await resp.text())
    assert events[0]["choices"][0]["index"] == 0   # the stream had begun
    assert "error" in events[-2] and events[-1] == "[DONE]"
    others = [engine.requests[0].request_id, engine.requests[2].request_id]
    assert await _aborted(engine, 2) == sorted(others)


async def test_a_client_leaving_mid_stream_aborts_every_choice(client, engine):
    engine.stall_after_first = asyncio.Event()
    resp = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 8, "stream": True})
    assert resp.status == 200
    await resp.content.readline()
    resp.close()
    assert await _aborted(engine, 2) == sorted(r.request_id for r in engine.requests)
