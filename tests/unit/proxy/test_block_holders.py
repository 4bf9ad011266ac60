"""The shared holders (proxy/block_holders.py): indexes that read their runs from one walk answer exactly as indexes
that run every group's rule themselves (the brute-force reference), for every node, through random event streams;
so does the bulk answer a routing decision reads (`NodeIndex.hits_of`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.engine.kv_cache.hashing import RequestBlockHashes
from hybridpd.kv_events import wire
from hybridpd.kv_events.wire import GroupInfo
from hybridpd.proxy.block_holders import BlockHolders
from hybridpd.proxy.kv_index import NodeIndex, PromptHashes

B = 2
GROUPS = (GroupInfo(group_idx=0, kind="mamba", block_size=2 * B, sliding_window=None),
          GroupInfo(group_idx=1, kind="full_attention", block_size=B, sliding_window=None),
          GroupInfo(group_idx=2, kind="sliding_window", block_size=B, sliding_window=3),
          GroupInfo(group_idx=3, kind="full_attention", block_size=B, sliding_window=None))
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5],
           [7, 7, 7, 7, 7, 7], [1, 2])


def _hashes(prompt: list[int], group: int) -> list[bytes]:
    return RequestBlockHashes(None).chain(GROUPS[group].block_size, prompt)


# an event: (node, kind, group, prompt, first block, last block, medium)
_EVENT = st.tuples(st.integers(0, 2), st.sampled_from(["store", "remove", "reset"]), st.integers(0, 3),
                   st.integers(0, len(PROMPTS) - 1), st.integers(0, 6), st.integers(0, 6),
                   st.sampled_from(["GPU", "DISK"]))


def _event(kind: str, group: int, prompt: int, first: int, last: int, medium: str) -> wire.KVCacheEvent:
    if kind == "reset":
        return wire.AllBlocksCleared()
    hashes = _hashes(PROMPTS[prompt], group)[first:last + 1]
    if kind == "store":
        return wire.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                block_size=GROUPS[group].block_size, lora_id=None, medium=medium, lora_name=None,
                                group_idx=group)
    return wire.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def _answers(index: NodeIndex, prompt: PromptHashes) -> tuple[int, ...]:
    return tuple(hit(prompt, with_storage=storage) for hit in (index.decode_hit, index.prefill_hit)
                 for storage in (False, True))


@settings(max_examples=300, deadline=None)
@given(events=st.lists(_EVENT, max_size=40), restart=st.integers(-1, 2))
def test_shared_runs_answer_as_each_index_alone(events, restart):
    holders = BlockHolders()
    shared = [NodeIndex(GROUPS, holders) for _ in range(3)]
    alone = [NodeIndex(GROUPS) for _ in range(3)]
    for k, (node, kind, group, prompt, first, last, medium) in enumerate(events):
        event = _event(kind, group, prompt, first, last, medium)
        shared[node].apply([event])
        alone[node].apply([event])
        if k == len(events) // 2 and restart >= 0:   # a feed starts over: its index is dropped, a new one joins
            shared[restart].close()
            shared[restart] = NodeIndex(GROUPS, holders)
            alone[restart] = NodeIndex(GROUPS)
    for tokens in PROMPTS:
        prompt, reference = PromptHashes(tokens, None), PromptHashes(tokens, None)
        for with_holders, without in zip(shared, alone):
            assert _answers(with_holders, prompt) == _answers(without, reference)
        mixed = [shared[0], None, alone[1], shared[2]]   # the bulk answer: the same, node for node
        for prefill, hit in ((False, NodeIndex.decode_hit), (True, NodeIndex.prefill_hit)):
            assert NodeIndex.hits_of(mixed, prompt, prefill=prefill) == [
                None if index is None else hit(index, reference) for index in mixed]
    for index in shared:
        index.clear()
    for index in shared:
        index.close()
    assert holders.num_hashes == 0   # every bit taken out again: nothing left behind


@pytest.mark.parametrize("masks, chain, expected", [
    ({b"a": 0b111, b"b": 0b011, b"c": 0b001}, [b"a", b"b", b"c"], {2: 1, 1: 2, 0: 3}),
    ({b"a": 0b10, b"b": 0b01}, [b"a", b"b"], {1: 1}),          # bit 0 lacks the first block: it holds none
    ({}, [b"a"], {}),
    ({b"a": 0b1}, [], {}),
])
def test_held_blocks_walks_the_chain_once_for_every_node(masks, chain, expected):
    holders = BlockHolders()
    for _ in range(3):
        holders.join()
    for block_hash, mask in masks.items():
        for bit in range(3):
            holders.set(bit, block_hash, memory=bool(mask >> bit & 1), reachable=bool(mask >> bit & 1))
    assert holders.held_blocks(chain, with_storage=False) == expected


def test_a_bit_is_reused_only_after_its_index_left():
    holders = BlockHolders()
    first, second = holders.join(), holders.join()
    holders.set(first, b"x", memory=True, reachable=True)
    holders.leave(first, [b"x"])
    assert holders.num_hashes == 0
    assert holders.join() == first and holders.join() not in (first, second)
