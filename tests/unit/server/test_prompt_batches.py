"""Several prompts in one completions body (`prompt` a list of strings or of token-id lists), as OpenAI's API and
vLLM take them: each prompt its own engine request, one answer with a choice per prompt in order, the usage summed;
echo and logprobs per prompt (lm-evaluation-harness sends its loglikelihood batches so); a failure of one ends
the others."""

from __future__ import annotations

from .fake_engine import fake_token


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
