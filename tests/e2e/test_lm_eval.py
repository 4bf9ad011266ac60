"""lm-evaluation-harness against a 1P+1D cluster through the proxy, unchanged: its `local-completions` model (the
OpenAI completions client `lm_eval --model local-completions` runs) asks loglikelihood requests (`echo`, `logprobs:
1`, `max_tokens: 1`, the prompt as token ids; one prompt a request, or a list of them with `batch_size`) and
generate_until requests. The loglikelihoods equal transformers'
own on the same checkpoint (a full forward, log-softmax summed over the continuation's tokens), `is_greedy` equals
the reference's argmax test, the generations equal transformers' greedy ones cut at the stop string, and the
prompt scored after another request cached its prefix is scored all the same. Every block returns to its pool."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from tests.e2e.faults import ProxyProcess, start_proxy
from tests.e2e.nodes import NodeProcess, make_tiny_checkpoint
from tests.e2e.pd_calls import assert_drained, start_nodes, stop_all
from tests.oracle.reference import load_reference, reference_logits

NODE_ARGS = ("--kv-cache-memory", "64MiB", "--served-model-name", "tiny", "--enable-tokenizer-info-endpoint")
PAIRS = [  # (context, continuation): the context ends without a space, the continuation starts with one
    ("The hybrid model reads the prompt once and then", " it writes the next tokens"),
    ("Prefill and decode run on different nodes, so", " the decode node"),
    ("The hybrid model reads the prompt once and then", " decodes"),   # its context is cached by then
    ("A", " b"),
]


@dataclass
class Cluster:
    prefill: NodeProcess
    decode: NodeProcess
    proxy: ProxyProcess
    model_dir: Path
    reference: torch.nn.Module

    def lm(self, batch_size: int = 1, tokenizer_backend: str = "huggingface") -> LocalCompletionsAPI:
        """lm-eval's client; its tokenizer the checkpoint's own (transformers) or, `remote`, the cluster's endpoints."""
        tokenizer = str(self.model_dir) if tokenizer_backend == "huggingface" else None
        return LocalCompletionsAPI(base_url=f"{self.proxy.url}/v1/completions", model="tiny",
                                   tokenizer=tokenizer, tokenizer_backend=tokenizer_backend,
                                   tokenized_requests=True, max_length=512, num_concurrent=1, max_retries=1,
                                   batch_size=batch_size)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    logs = tmp_path_factory.mktemp("logs")
    nodes = start_nodes(model_dir, logs, {"prefill": NODE_ARGS, "decode": NODE_ARGS})
    proxy = None
    try:
        proxy = start_proxy(nodes["prefill"], nodes["decode"], logs)
        torch.set_num_threads(1)
        yield Cluster(nodes["prefill"], nodes["decode"], proxy, model_dir, load_reference(model_dir))
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(nodes.values())


def reference_loglikelihood(reference, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    logits = reference_logits(reference, context + continuation)
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    rows = logprobs[len(context) - 1 : -1]
    wanted = torch.tensor(continuation)
    total = float(rows.gather(1, wanted.unsqueeze(1)).sum())
    return total, bool((rows.argmax(dim=-1) == wanted).all())


def greedy_ids(reference, ids: list[int], n: int) -> list[int]:
    out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("batch_size", [1, 3])   # 3: its prompts go in lists of three, one request each
def test_loglikelihood_through_pd_equals_transformers(cluster, batch_size):
    client = cluster.lm(batch_size)
    context = PAIRS[0][0]
    greedy = client.tokenizer.decode(greedy_ids(cluster.reference, client.tok_encode(context), 3))
    pairs = [*PAIRS, (context, greedy)]   # the model's own greedy continuation: is_greedy must be true
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    results = client.loglikelihood(requests, disable_tqdm=True)
    for pair, (loglikelihood, is_greedy) in zip(pairs, results, strict=True):
        expected, expected_greedy = reference_loglikelihood(cluster.reference, *client._encode_pair(*pair))
        assert loglikelihood == pytest.approx(expected, abs=1e-3), pair
        assert is_greedy == expected_greedy, pair
    assert results[-1][1], "the greedy continuation must test as greedy"
    assert_drained(cluster.prefill, cluster.decode)


def test_generate_until_through_pd_equals_transformers(cluster):
    client = cluster.lm()
    context = "Prefill and decode run on different nodes, so"
    request = Instance(request_type="generate_until", doc={}, idx=0,
                       arguments=(context, {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}))
    (text,) = client.generate_until([request], disable_tqdm=True)
    ids = client.tok_encode(context)
    expected = client.tokenizer.decode(greedy_ids(cluster.reference, ids, 8)).split("\n\n")[0]
    assert text == expected
    assert_drained(cluster.prefill, cluster.decode)


def test_the_remote_tokenizer_through_the_proxy_equals_transformers(cluster):
    """`tokenizer_backend=remote`: lm-eval tokenizes through the cluster's `/tokenizer_info`, `/tokenize` and
    `/detokenize` (the proxy passes them to a node) instead of loading the tokenizer itself; every id, text, special
    token and loglikelihood equals what it gets with transformers' tokenizer."""
    local, remote = cluster.lm(), cluster.lm(tokenizer_backend="remote")
    for text in ("The hybrid model reads the prompt", " café 日本語 🙂", "<|end_of_text|> x"):
        ids = local.tok_encode(text)
        assert remote.tok_encode(text) == ids
        assert remote.tokenizer.decode(ids) == local.tokenizer.decode(ids)
    assert (remote.eot_token_id, remote.eos_string) == (local.eot_token_id, local.eos_string)
    assert remote.prefix_token_id == local.prefix_token_id
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)]
    assert remote.loglikelihood(requests, disable_tqdm=True) == local.loglikelihood(requests, disable_tqdm=True)
    assert_drained(cluster.prefill, cluster.decode)
