"""Random histories against a brute-force reference: hits, hit blocks, and what the blocks hold; with fixed pools
and with pools that share one budget (a block that moved to another group and back must never serve a stale hit).

The reference tries every hit length from the longest down and checks each deciding group plainly; a shadow
map records which token prefix each block was last written with, so a hit on a block with the wrong contents
(a hash that outlived its block) fails too.
"""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpd.config import MambaRetentionPolicy
from hybridpd.engine.kv_cache.block_pool import NULL_BLOCK_ID
from hybridpd.engine.kv_cache.hashing import hash_block
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from .builders import Req, all_free, fa, mamba, manager, sw


@st.composite
def layouts(draw):
    base = draw(st.integers(1, 16))
    sizes = [d for d in range(1, base + 1) if base % d == 0]
    kinds = draw(st.lists(st.sampled_from(["fa", "fa8", "sw1", "sw2", "mamba"]), min_size=1, max_size=5))
    windows = (draw(st.integers(1, 64)), draw(st.integers(1, 64)))
    attention = {k: draw(st.sampled_from(sizes)) for k in ("fa", "fa8", "sw1", "sw2")}
    used = [attention[k] for k in kinds if k != "mamba"]
    interval = (math.lcm(*used) if used else base) * draw(st.integers(1, 3))
    build = {
        "fa": lambda: fa(attention["fa"]), "fa8": lambda: fa(attention["fa8"], heads=8),
        "sw1": lambda: sw(windows[0], attention["sw1"]), "sw2": lambda: sw(windows[1], attention["sw2"]),
        "mamba": lambda: mamba(interval),
    }
    specs = tuple(build[k]() for k in kinds)
    # room for 30-250 tokens per attention group: enough to hit, few enough to evict
    blocks = tuple(
        draw(st.integers(3, 16)) if k == "mamba" else math.ceil(draw(st.integers(30, 250)) / s.block_size) + 2
        for k, s in zip(kinds, specs)
    )
    return specs, blocks


def plain_chain(tokens, block_size, salt):
    chain, parent = [], None
    for k in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[k * block_size:(k + 1) * block_size], salt if k == 0 else None)
        chain.append(parent)
    return chain


def reference_hit(m, specs, req):
    """Try every L from num_prompt_tokens - 1 down; return the first every deciding group serves."""
    tokens = req.all_token_ids
    deciding = [g for g, s in enumerate(specs) if isinstance(s, FullAttentionSpec) or not req.skip_mamba_align]
    chains = [plain_chain(tokens, s.block_size, req.cache_salt) for s in specs]

    def held(g, k):                     # the block holding the prefix of k blocks of group g, or None
        return m.cached_block(g, chains[g][k - 1])

    def blocks_for(g, length):
        s, b = specs[g], specs[g].block_size
        if length % b:
            return None
        if isinstance(s, MambaSpec):
            found = (held(g, length // b),)
        else:
            first = max(0, length - s.sliding_window + 1) // b if isinstance(s, SlidingWindowSpec) else 0
            found = (NULL_BLOCK_ID,) * first + tuple(held(g, i + 1) for i in range(first, length // b))
        return None if None in found else found

    if deciding:
        for length in range(req.num_prompt_tokens - 1, 0, -1):
            found = {g: blocks_for(g, length) for g in deciding}
            if all(v is not None for v in found.values()):
                return length, tuple(found.get(g, ()) for g in range(len(specs)))
    return 0, tuple(() for _ in specs)


class Shadow:
    """Which token prefix each block of each group was last written with."""

    def __init__(self, specs):
        self.specs = specs
        self.content = [dict() for _ in specs]

    def write_step(self, step, tokens, start, end):
        for g, s in enumerate(self.specs):
            table = step.block_tables[g]
            if isinstance(s, MambaSpec):
                ops = step.mamba[g]
                for n, slot in ops.saves:
                    self.content[g][slot] = tuple(tokens[:n])
                continue
            b = s.block_size
            written = {i for i, _ in step.load[g]} | set(range(start // b, math.ceil(end / b)))
            for i in written:
                if table[i] != NULL_BLOCK_ID:
                    self.content[g][table[i]] = tuple(tokens[:min((i + 1) * b, end)])

    def check_request(self, m, req):
        for g, s in enumerate(self.specs):
            if isinstance(s, MambaSpec):
                continue
            b, table = s.block_size, m.block_table(req.request_id)[g]
            assert len(table) == math.ceil(req.num_computed / b)
            first = max(0, req.num_computed - s.sliding_window + 1) // b if isinstance(s, SlidingWindowSpec) else 0
            assert all(x == NULL_BLOCK_ID for x in table[:first])
            for i in range(first, len(table)):
                if (i + 1) * b <= req.num_computed:
                    assert self.content[g][table[i]] == tuple(req.all_token_ids[:(i + 1) * b])

    def check_hit(self, specs, hit, tokens):
        for g, s in enumerate(specs):
            for i, blk in enumerate(hit.blocks[g]):
                if blk == NULL_BLOCK_ID:
                    continue
                n = hit.num_tokens if isinstance(s, MambaSpec) else (i + 1) * s.block_size
                assert self.content[g][blk] == tuple(tokens[:n])


def snapshot(m, running):
    return ({r: m.block_table(r) for r in running}, [m.num_free_blocks(g) for g in range(len(m.groups))])


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layout=layouts(), data=st.data())
def test_random_histories_match_the_reference(layout, data):
    specs, blocks = layout
    m = manager(*specs, blocks=blocks, retention=data.draw(st.sampled_from(list(MambaRetentionPolicy))),
                shared_cap=data.draw(st.sampled_from([None, None, 0, 2, 100])),
                shared_share=data.draw(st.sampled_from([1.0, 0.5, 0.25])))
    shadow = Shadow(specs)
    bases = [data.draw(st.lists(st.integers(0, 9), min_size=8, max_size=70)) for _ in range(2)]
    running: dict[str, Req] = {}
    for op_no in range(data.draw(st.integers(4, 24))):
        op = data.draw(st.sampled_from(["admit", "admit", "step", "step", "free"]))
        if op == "admit":
            base = data.draw(st.sampled_from(bases))
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
            prompt = base[:cut] + data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=12))
            req = Req(f"r{op_no}", prompt, skip_mamba_align=data.draw(st.booleans()),
                      cache_salt=data.draw(st.sampled_from([None, None, b"x"])))
            hit = m.get_computed_blocks(req)
            assert (hit.num_tokens, hit.blocks) == reference_hit(m, specs, req)
            shadow.check_hit(specs, hit, req.all_token_ids)
            before = snapshot(m, running)
            n_prompt = req.num_prompt_tokens
            if req.skip_mamba_align:
                external, new = n_prompt - 1 - hit.num_tokens, 1
            else:
                external, new = 0, data.draw(st.integers(1, n_prompt - hit.num_tokens))
            step = m.allocate_slots(req, new, hit, num_external_tokens=external)
            if step is None:
                assert snapshot(m, running) == before
                m.free(req.request_id)
            else:
                start = hit.num_tokens + external
                shadow.write_step(step, req.all_token_ids, start, start + new)
                req.num_computed = start + new
                m.commit(req, req.num_computed)
                running[req.request_id] = req
        elif op == "step" and running:
            req = running[data.draw(st.sampled_from(sorted(running)))]
            if req.num_computed == len(req.all_token_ids):
                req.all_token_ids.append(data.draw(st.integers(0, 9)))
            new = data.draw(st.integers(1, len(req.all_token_ids) - req.num_computed))
            before = snapshot(m, running)
            step = m.allocate_slots(req, new)
            if step is None:
                assert snapshot(m, running) == before
                m.free(req.request_id)      # preempted
                del running[req.request_id]
            else:
                shadow.write_step(step, req.all_token_ids, req.num_computed, req.num_computed + new)
                req.num_computed += new
                m.commit(req, req.num_computed)
        elif op == "free" and running:
            m.free(running.pop(data.draw(st.sampled_from(sorted(running)))).request_id)
        m.check_invariants()
        for req in running.values():
            shadow.check_request(m, req)
    for rid in list(running):
        m.free(rid)
    m.free("never-seen")
    m.check_invariants()
    assert all_free(m)
