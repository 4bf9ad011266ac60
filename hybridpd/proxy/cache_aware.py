"""`--routing cache_aware`: which node of a role serves a prompt, from the hits its KV events predict and its load.

The rule (`CostRule`), one for both roles, in tokens of work:

    cost(node) = (prompt tokens - predicted hit on node)          # what this request makes it compute (or pull)
               - storage_hit_weight * (storage hit - memory hit)  # what it reads from its storage tier instead
               + queued_tokens_weight * queued_tokens(node)       # the same, over its calls in flight that have
                                                                  # not produced their first token yet
               + load_tokens_per_request * outstanding(node)      # every call in flight also costs its decode

and the cheapest node wins (ties: round-robin order). The predicted hit is `NodeIndex.prefill_hit` (the hybrid hit
over every group) for a prefill node and `NodeIndex.decode_hit` (full-attention groups: a decode node skips Mamba
alignment for remotely prefilled prompts) for a decode node; 0 for a node the proxy has no index of. So a node
holding a hot prefix keeps winning only until the work queued on it exceeds what its hit saves: one hot prefix
does not pile every request on one node. With no index at all (nothing known) every miss is the whole prompt and
the rule is least outstanding work.

Why queued work weighs half (`--queued-tokens-weight`, 0.5): a node works through its queue while the request
waits, and continuous batching puts the request into the node's next step beside what is still waiting, so on
average it waits for about half of the work ahead of it, while its own miss tokens are computed in full. At weight
1 a node holding the prefix but busy with one miss loses to an idle node that must compute the whole prompt again,
and the copy it makes there evicts other prefixes: on `benchmarks/routing.py` (2 prefill + 2 decode nodes) the
prefill nodes' hit rate was 0.55-0.62 at weight 1 and 0.69 at 0.5 (0.706 is every repeat hitting), and the mean
TTFT against round robin's 0.77-0.88 and 0.73-0.75 (0.58-0.78, ~0.65 on average, since the first token comes from
the prefill call).

The storage hit is the same rule over the hashes the node's storage tier announced (KV events of medium "DISK")
and its memory together; reading a block back costs more than finding it in memory and less than computing it
(`--storage-hit-weight`, 0.5: benchmarks/offload_io.py reads the small preset's blocks at ~80 MB/s here, where
computing them runs at a few thousand tokens a second).

Disaggregate or not (`--pd-threshold`, llm-d's prefix-based decision): the decode node is chosen first, by the same
rule; when the prompt tokens it would compute itself (the prompt less its hybrid hit over every group, memory and
storage: it would prefill the request as a colocated node does) are fewer than the threshold, it serves the request
whole. A prompt the decode node has almost all of skips the prefill node's queue, the pull and a second HTTP call;
the decode node computes a short suffix beside its decodes, which is what the threshold bounds.

The prompt is tokenized once per request: token-id prompts as they are; text and chat through a node's
`POST /tokenize`, which renders and tokenizes exactly as the node will (same chat template, same special tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridpd.completion_prompts import one_prompt
from hybridpd.errors import HybridPDError
from hybridpd.proxy.config import CostRule, Role, Upstream
from hybridpd.proxy.kv_index import NodeIndex, PromptHashes
from hybridpd.proxy.routing import Router
from hybridpd.message_bodies import MESSAGES_PATH, count_tokens_body
from hybridpd.response_bodies import RESPONSES_PATH, chat_body


@dataclass(frozen=True, kw_only=True)
class Choice:
    """A routed call: the node, the hit predicted there, and the work it adds (prompt tokens it computes)."""

    upstream: Upstream
    predicted_hit: int | None     # None: nothing known of this node's cache
    work_tokens: int


def predicted_hit(index: NodeIndex | None, prompt: PromptHashes, role: Role, with_storage: bool = False) -> int | None:
    if index is None:
        return None
    if role is Role.PREFILL:
        return index.prefill_hit(prompt, with_storage)
    return index.decode_hit(prompt, with_storage)


def choose(router: Router, role: Role, prompt: PromptHashes, index_of: Callable[[Upstream], NodeIndex | None],
           rule: CostRule, exclude: tuple[Upstream, ...] = ()) -> Choice:
    """The cheapest node of the role by `rule`: every node's cost in one pass over lists (at 64 nodes a call per node
    was most of a decision)."""
    upstreams = router.upstreams
    indexes = [index_of(u) for u in upstreams]
    hits = NodeIndex.hits_of(indexes, prompt, prefill=role is Role.PREFILL)
    num_tokens = prompt.num_tokens
    work = [num_tokens - hit if hit is not None else num_tokens for hit in hits]
    if rule.storage_hit_weight:   # what a storage tier holds beyond memory is read, not computed
        for i, index in enumerate(indexes):
            if index is not None and index.has_storage:
                stored = predicted_hit(index, prompt, role, with_storage=True)
                work[i] -= rule.storage_hit_weight * max(0, stored - hits[i])
    outstanding, queued = router.loads()
    queued_weight, load_weight = rule.queued_tokens_weight, rule.load_tokens_per_request
    costs = [w + queued_weight * q + load_weight * n for w, q, n in zip(work, queued, outstanding)]
    upstream = router.pick(exclude=exclude, costs=costs)
    hit = hits[upstreams.index(upstream)]
    return Choice(upstream=upstream, predicted_hit=hit, work_tokens=num_tokens - (hit or 0))


def choose_decode_alone(router: Router, prompt: PromptHashes, index_of: Callable[[Upstream], NodeIndex | None],
                        rule: CostRule) -> Choice | None:
    """The decode node that serves the request whole (no prefill call), or None: disaggregate. None too when the
    threshold is off or nothing is known of the chosen node's cache."""
    if not rule.pd_threshold:
        return None
    upstream = choose(router, Role.DECODE, prompt, index_of, rule).upstream
    index = index_of(upstream)
    if index is None:
        return None
    hit = index.prefill_hit(prompt, index.has_storage)
    miss = prompt.num_tokens - hit
    return Choice(upstream=upstream, predicted_hit=hit, work_tokens=miss) if miss < rule.pd_threshold else None


_MAX_TOKEN_ID = 2 ** 63 - 1   # what the nodes' block hashes encode; a larger id is the node's 400, not our prediction


def token_ids_in_body(path: str, body: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (or one list of them); None when it must be tokenized, or when an id
    is out of any vocabulary's range (the node refuses the request; nothing is predicted)."""
    if path != "/v1/completions":
        return None
    prompt = one_prompt(body.get("prompt"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t <= _MAX_TOKEN_ID for t in prompt):
        return prompt
    return None


# The fields a `/tokenize` call carries over from the request (each when of its type): what changes the prompt's tokens.
_COMPLETION_TOKENIZE = {"model": str, "add_special_tokens": bool}
_CHAT_TOKENIZE = {**_COMPLETION_TOKENIZE, "add_generation_prompt": bool, "continue_final_message": bool,
                  "chat_template": str, "chat_template_kwargs": dict, "tools": list}


def tokenize_body(path: str, body: dict[str, Any], *, merge_inline_system: bool = False) -> dict[str, Any] | None:
    """The `/tokenize` body that yields this request's prompt tokens; None when there is nothing to tokenize (or
    the node will refuse the body). A Responses or Messages body is tokenized as the chat body it asks for (a
    Messages body's system messages joined into the first with `merge_inline_system`, as a node whose template
    wants the system prompt first converts it)."""
    if path in (RESPONSES_PATH, MESSAGES_PATH):
        try:
            body = (chat_body(body) if path == RESPONSES_PATH
                    else count_tokens_body(body, merge_inline_system=merge_inline_system))
        except HybridPDError:
            return None
        path = "/v1/chat/completions"
    chat = path == "/v1/chat/completions"
    kinds = _CHAT_TOKENIZE if chat else _COMPLETION_TOKENIZE
    carried = {key: body[key] for key, kind in kinds.items() if isinstance(body.get(key), kind)}
    if chat:
        return {**carried, "messages": body["messages"]} if isinstance(body.get("messages"), list) else None
    prompt = one_prompt(body.get("prompt"))
    return {**carried, "prompt": prompt} if isinstance(prompt, str) and prompt else None


def truncated(body: dict[str, Any], tokens: list[int]) -> list[int]:
    """The prompt as the node will serve it: its last `truncate_prompt_tokens` (when a positive integer)."""
    keep = body.get("truncate_prompt_tokens")
    if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0:
        return tokens[-keep:]
    return tokens


def cache_salt(body: dict[str, Any]) -> bytes | None:
    salt = body.get("cache_salt")
    return salt.encode("utf-8") if isinstance(salt, str) else None
