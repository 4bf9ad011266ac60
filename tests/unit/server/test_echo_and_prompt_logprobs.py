"""`echo` and `prompt_logprobs` on the HTTP surface, in vLLM's shapes: the echoed prompt's text and token logprobs
before the output (what lm-evaluation-harness's loglikelihood requests read: `echo`, `logprobs: 1`, `max_tokens:
1`), `max_tokens: 0` with echo for the prompt alone, vLLM's `prompt_logprobs` lists on the completion choice and on
the chat answer, the same text streamed and whole, and the refusals vLLM makes."""

from __future__ import annotations

import pytest

from .conftest import parse_sse

PROMPT = "Hi you"


async def completion(client, **body):
    resp = await client.post("/v1/completions", json={"prompt": PROMPT} | body)
    assert resp.status == 200, await resp.text()
    return (await resp.json())["choices"][0]


async def test_echo_puts_the_prompt_before_the_output(client):
    choice = await completion(client, echo=True, max_tokens=3)
    assert choice["text"] == PROMPT + "abc" and choice["logprobs"] is None


async def test_echo_of_a_token_prompt_is_its_decoded_text(client):
    choice = await completion(client, prompt=[list(PROMPT.encode())], echo=True, max_tokens=1)
    assert choice["text"] == PROMPT + "a"


async def test_echo_with_logprobs_scores_every_prompt_token_as_lm_eval_reads_it(client):
    choice = await completion(client, echo=True, logprobs=1, max_tokens=1, temperature=0)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [*PROMPT, "a"]
    assert logprobs["text_offset"] == list(range(len(PROMPT) + 1))
    assert logprobs["token_logprobs"] == [None, *(-i / 10 for i in range(1, len(PROMPT))), -0.5]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"x": -0.05, PROMPT[1]: -0.1}   # the top one, and the prompt's own token
    assert logprobs["top_logprobs"][-1] == {"a": -0.5}
    # lm-evaluation-harness: the continuation's logprob is the sum over token_logprobs[ctxlen:-1]
    ctxlen = 3
    assert sum(logprobs["token_logprobs"][ctxlen:-1]) == pytest.approx(-sum(range(ctxlen, len(PROMPT))) / 10)
    assert len(choice["prompt_logprobs"]) == len(PROMPT) and choice["prompt_logprobs"][0] is None


async def test_echo_with_max_tokens_zero_is_the_prompt_alone(client, engine):
    choice = await completion(client, echo=True, logprobs=0, max_tokens=0)
    assert choice["text"] == PROMPT
    assert choice["logprobs"]["tokens"] == list(PROMPT)
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["token_logprobs"]) == len(PROMPT)
    assert engine.requests[-1].sampling.max_tokens == 1


async def test_prompt_logprobs_in_vllms_shape(client):
    choice = await completion(client, prompt_logprobs=2, max_tokens=2)
    assert choice["text"] == "ab" and choice["logprobs"] is None
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert prompt_logprobs[1] == {
        str(ord(PROMPT[1])): {"logprob": -0.1, "rank": 1, "decoded_token": PROMPT[1]},
        str(ord("x")): {"logprob": -0.05, "rank": 1, "decoded_token": "x"},
        str(ord("y")): {"logprob": -1.05, "rank": 2, "decoded_token": "y"},
    }


async def test_chat_prompt_logprobs_are_top_level(client):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "prompt_logprobs": 0}
    resp = await client.post("/v1/chat/completions", json=body)
    out = await resp.json()
    rendered = "<user>x\n<assistant>"
    assert len(out["prompt_logprobs"]) == len(rendered) and out["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in out["choices"][0]


async def test_no_prompt_logprobs_unless_asked(client):
    choice = await completion(client, max_tokens=1, logprobs=1)
    assert "prompt_logprobs" not in choice and choice["logprobs"]["tokens"] == ["a"]


async def test_an_echoed_stream_says_what_the_whole_answer_says(client):
    whole = await completion(client, echo=True, logprobs=1, max_tokens=3)
    resp = await client.post("/v1/completions",
                             json={"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True})
    chunks = [event["choices"][0] for event in parse_sse(await resp.text())[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key], key


@pytest.mark.parametrize("body, param, message", [
    ({"max_tokens": 0}, "max_tokens", "must be >= 1"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "the whole vocabulary"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "between 0 and 20"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs", "must be an integer"),
    ({"echo": "yes"}, "echo", "must be a boolean"),
    ({"echo": True, "max_tokens": -1}, "max_tokens", "must be >= 0"),
])
async def test_refusals(client, engine, body, param, message):
    resp = await client.post("/v1/completions", json={"prompt": PROMPT} | body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and message in error["message"], error
    assert engine.requests == []


async def test_prompt_logprobs_zero_with_a_stream_is_accepted(client):
    resp = await client.post("/v1/completions",
                             json={"prompt": PROMPT, "prompt_logprobs": 0, "stream": True, "max_tokens": 2})
    events = parse_sse(await resp.text())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ab"
