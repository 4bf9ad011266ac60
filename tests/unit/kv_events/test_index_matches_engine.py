"""The proxy's view of a node's cache against the node's own coordinator, on random histories.

A KVCacheManager records events; they go through the wire (vLLM's msgpack format, encoded and decoded) into a
NodeIndex. After every operation the index holds exactly the hashes each pool can serve, and for every new prompt
the index's predictions equal what the coordinator then finds: `prefill_hit` its hybrid hit, `decode_hit` its hit
for a remotely prefilled request (skip_mamba_align: full-attention groups only).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpd.config import MambaRetentionPolicy
from hybridpd.kv_events.wire import GroupInfo, decode_batch, encode_batch
from hybridpd.proxy.kv_index import NodeIndex, PromptHashes

from ..engine.kv_cache.builders import Req, manager, prefill
from ..engine.kv_cache.test_hit_property import layouts


def _sync(m, index, groups) -> None:
    events = m.take_events()
    if events:
        index.apply(decode_batch(encode_batch(events, groups)).events)
    for g in range(len(m.groups)):
        assert index.hashes(g) == m.cached_hashes(g), f"group {g} ({groups[g].kind}) differs"


def _predictions_hold(m, index, prompt, salt) -> None:
    hashes = PromptHashes(prompt, salt)
    for skip, predicted in ((False, index.prefill_hit(hashes)), (True, index.decode_hit(hashes))):
        req = Req("probe", list(prompt), cache_salt=salt, skip_mamba_align=skip)
        found = m.get_computed_blocks(req).num_tokens
        m.free("probe")  # forget its hash chains: the next probe has another prompt
        assert predicted == found, f"skip_mamba_align={skip}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layout=layouts(), data=st.data())
def test_the_index_follows_the_cache_and_predicts_its_hits(layout, data):
    specs, blocks = layout
    m = manager(*specs, blocks=blocks, events=True,
                retention=data.draw(st.sampled_from(list(MambaRetentionPolicy))))
    groups = [GroupInfo.of(i, g) for i, g in enumerate(m.groups)]
    index = NodeIndex(groups)
    bases = [data.draw(st.lists(st.integers(0, 9), min_size=8, max_size=70)) for _ in range(2)]
    held: list[str] = []
    for op_no in range(data.draw(st.integers(3, 16))):
        op = data.draw(st.sampled_from(["run", "run", "run", "hold", "free", "reset"]))
        if op in ("run", "hold"):
            base = data.draw(st.sampled_from(bases))
            prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(
                st.lists(st.integers(0, 9), min_size=1, max_size=12))
            salt = data.draw(st.sampled_from([None, None, b"s"]))
            _predictions_hold(m, index, prompt, salt)
            req = Req(f"r{op_no}", prompt, cache_salt=salt)
            try:
                prefill(m, req, chunk=data.draw(st.sampled_from([None, 3, 8])))
            except RuntimeError:  # out of blocks: nothing of it stays
                m.free(req.request_id)
            else:
                if op == "hold":
                    held.append(req.request_id)
                else:
                    m.free(req.request_id)
        elif op == "free" and held:
            m.free(held.pop(data.draw(st.integers(0, len(held) - 1))))
        elif op == "reset":
            m.reset_prefix_cache()
        _sync(m, index, groups)
    for rid in held:
        m.free(rid)
    m.reset_prefix_cache()
    _sync(m, index, groups)
    assert index.num_hashes == 0


def test_a_reset_with_nothing_held_is_one_all_blocks_cleared():
    from hybridpd.engine.kv_cache.events import AllBlocksCleared, BlockRemoved

    from ..engine.kv_cache.builders import fa, mamba
    m = manager(fa(4), mamba(8), events=True)
    prefill(m, Req("a", list(range(20))))
    m.free("a")
    m.take_events()
    m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]
    prefill(m, Req("b", list(range(20))))   # held: its attention blocks keep their hashes through a reset
    m.take_events()
    m.reset_prefix_cache()
    removed = m.take_events()                # only its saved Mamba states (free once saved) are forgotten
    assert removed and all(isinstance(e, BlockRemoved) and e.group_idx == 1 for e in removed)
    assert m.cached_hashes(0) and not m.cached_hashes(1)
    m.free("b")
    m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]
    prefill(m, Req("c", list(range(20))))
    prefill(m, Req("d", list(range(40, 60))))
    m.free("d")
    m.take_events()
    m.reset_prefix_cache()
    removed = m.take_events()
    assert removed and all(isinstance(e, BlockRemoved) for e in removed)
