"""`hybridpd replay`: a trace through N simulated nodes (node.py) and the proxy's real routers, on a modelled clock.

Each request arrives at its trace time. Disaggregated (`--prefill P --decode D`): the prefill router picks a node
(round robin, least outstanding, or cache_aware with `proxy/cache_aware.choose` over the indexes the nodes' own KV
events built), the node serves the prompt (its hit over every group; the rest computed), then the decode router picks
a node, which takes its full-attention hit, pulls the rest and decodes. Colocated (`--colocated N`): one router, one
node does both. Clock (time_model.py): a node computes one prompt at a time (a FIFO queue), so TTFT = queueing +
prefill; a call stays in flight for the router until its node is done with it; decode steps are batched (each request
gets `decode_step_s` per token), so ITL is that step plus a pull spread over the outputs. With cache_aware and the
rule's `pd_threshold` a request whose chosen decode node would compute fewer prompt tokens than it is served whole
there, as a colocated node serves it (its prompts in the node's own FIFO).
"""

from __future__ import annotations

import gc
import heapq
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hybridpd.bench import mooncake
from hybridpd.proxy.block_holders import BlockHolders
from hybridpd.proxy.cache_aware import choose, choose_decode_alone
from hybridpd.proxy.config import CostRule, Role, RoutingPolicy, Upstream
from hybridpd.proxy.kv_index import PromptHashes
from hybridpd.proxy.routing import Router
from hybridpd.replay.node import NodeLayout, Served, SimNode
from hybridpd.replay.storage import SimStorage
from hybridpd.replay.time_model import TimeModel

_T = TypeVar("_T")


@dataclass(frozen=True)
class ClusterShape:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("--colocated and --prefill/--decode exclude each other")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("give --prefill and --decode (each >= 1), or --colocated N")


class _Role:
    """The nodes of one role, their router, and the calls it counts as in flight (closed as the clock passes)."""

    def __init__(self, role: Role, count: int, layout: NodeLayout, policy: RoutingPolicy, first_port: int,
                 holders: BlockHolders, storage: SimStorage | None) -> None:
        self.role = role
        self.upstreams = tuple(Upstream(role=role, host="sim", port=first_port + i) for i in range(count))
        self.nodes = {u: SimNode(f"{role.value}-{i}", layout, holders, storage) for i, u in enumerate(self.upstreams)}
        self.router = Router(self.upstreams, policy)
        self._calls: list[tuple[float, int, Any]] = []
        self._order = 0
        self.decisions = 0
        self.deciding_s = 0.0

    def advance(self, now: float) -> None:
        while self._calls and self._calls[0][0] <= now:
            _, _, call = heapq.heappop(self._calls)
            call.__exit__(None, None, None)

    def pick(self, prompt: PromptHashes, rule: CostRule) -> Upstream:
        if self.router.policy is RoutingPolicy.CACHE_AWARE:
            upstream, seconds = timed_decision(
                lambda: choose(self.router, self.role, prompt, lambda u: self.nodes[u].index, rule).upstream)
        else:
            upstream, seconds = timed_decision(self.router.pick)
        self.deciding_s += seconds
        self.decisions += 1
        return upstream

    def alone(self, prompt: PromptHashes, rule: CostRule) -> Upstream | None:
        """The node of this (decode) role that serves the request whole by `--pd-threshold`, or None."""
        if self.router.policy is not RoutingPolicy.CACHE_AWARE or not rule.pd_threshold:
            return None
        choice, seconds = timed_decision(
            lambda: choose_decode_alone(self.router, prompt, lambda u: self.nodes[u].index, rule))
        self.deciding_s += seconds
        self.decisions += 1
        return None if choice is None else choice.upstream

    def in_flight_until(self, upstream: Upstream, work_tokens: int, end: float) -> None:
        call = self.router.in_flight(upstream, work_tokens)
        call.__enter__()
        self._order += 1
        heapq.heappush(self._calls, (end, self._order, call))


def timed_decision(decide: Callable[[], _T]) -> tuple[_T, float]:
    """A routing decision and the seconds it took. The collector waits meanwhile: its passes here walk the simulated
    nodes' block objects, which a proxy's heap does not hold (its indexes are sets of bytes, which the collector does
    not track)."""
    collecting = gc.isenabled()
    gc.disable()
    start = time.perf_counter()
    try:
        return decide(), time.perf_counter() - start
    finally:
        if collecting:
            gc.enable()


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _index_bytes_per_block(roles: Sequence[_Role]) -> float | None:
    """What the proxy's indexes hold per block hash, measured: the same sets rebuilt under tracemalloc."""
    hashes = [h for role in roles for node in role.nodes.values()
              for g in range(len(node.index.groups)) for h in node.index.hashes(g)]
    if not hashes:
        return None
    tracemalloc.start()
    copy = {bytes(bytearray(h)) for h in hashes}
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size / len(copy)


class _Cores:
    """The CPU cores a cluster's nodes share (`TimeModel.cores`; 0: one per node, never waited for). A prefill runs
    on the core where it can start first and holds it until it is done; so does each request's decoding, for its
    decode steps counted one by one, and at its arrival the CPU it costs outside the engines (`request_cpu_s`). Work
    fills the first gap long enough on a core, so work placed for later leaves the core free before it."""

    def __init__(self, count: int) -> None:
        self._busy: list[list[tuple[float, float]]] = [[] for _ in range(count)]   # per core: (start, end), sorted

    def forget_before(self, now: float) -> None:
        """Nothing placed from here on is ready before `now` (requests come in arrival order)."""
        for intervals in self._busy:
            while intervals and intervals[0][1] <= now:
                intervals.pop(0)

    def run(self, ready: float, seconds: float) -> float:
        """Work of `seconds`, ready at `ready`: when it ends."""
        if not self._busy or seconds <= 0:
            return ready + seconds
        best, best_start, best_at = 0, float("inf"), 0
        for core, intervals in enumerate(self._busy):
            start, at = ready, len(intervals)
            for k, (begin, end) in enumerate(intervals):
                if start + seconds <= begin:
                    at = k
                    break
                start = max(start, end)
            if start < best_start:
                best, best_start, best_at = core, start, at
        self._busy[best].insert(best_at, (best_start, best_start + seconds))
        return best_start + seconds


def _count(hits: dict[str, int], served: Served) -> None:
    hits["memory"] += served.memory_tokens
    hits["storage"] += served.storage_tokens


def _storage_seen(storage: SimStorage | None, nodes: Sequence[SimNode]) -> None:
    """Every node announces what the shared directory came to hold or lost (its scan's DISK KV events)."""
    changes = storage.take_changes() if storage is not None else []
    if changes:
        for node in nodes:
            node.see_storage(changes)


def simulate(records: Sequence[mooncake.TraceRecord], trace: mooncake.TraceSlice, layout: NodeLayout,
             shape: ClusterShape, policy: RoutingPolicy, clock: TimeModel, vocab_size: int,
             rule: CostRule = CostRule(), seed: int = 0, offload_bytes: int | None = None,
             history: Sequence[mooncake.TraceRecord] = ()) -> dict[str, Any]:
    """`offload_bytes`: the storage tier's capacity (`--kv-offload-size`), one directory every node shares.
    `history`: requests served first, at their own trace times before the slice's, filling the caches; every
    figure but the storage tier's totals is the slice's alone."""
    rng = np.random.Generator(np.random.PCG64(seed))
    served_records = [*history, *records]
    offsets = mooncake.arrival_offsets(served_records, trace)
    offsets = [o - offsets[0] for o in offsets] if history else offsets   # the clock starts at 0 (nodes idle)
    holders = BlockHolders()   # the simulated proxy's, shared by its indexes of every node
    storage = (SimStorage([g.spec.page_size_bytes for g in layout.groups], offload_bytes)
               if offload_bytes is not None else None)
    if shape.colocated:
        roles = [_Role(Role.DECODE, shape.colocated, layout, policy, 1, holders, storage)]
    else:
        roles = [_Role(Role.PREFILL, shape.prefill, layout, policy, 1, holders, storage),
                 _Role(Role.DECODE, shape.decode, layout, policy, 1001, holders, storage)]
    nodes = [node for role in roles for node in role.nodes.values()]
    cores = _Cores(clock.cores)
    engine_cpu_s = 0.0   # the engines' work the clock charged (prefills, reads, decode steps)
    prompt_total = output_total = 0
    prefill = {"memory": 0, "storage": 0}
    decode = {"memory": 0, "storage": 0}
    ttfts, itls, finishes = [], [], []
    served_alone = 0   # requests a decode node served whole (`--pd-threshold`)
    for i, (record, arrival) in enumerate(zip(served_records, offsets)):
        measured = i >= len(history)
        prompt = list(mooncake.prompt_tokens(record, trace.tokens_per_hash, vocab_size, rng))
        n_out = max(1, min(record.output_length, trace.max_output_len or record.output_length))
        outputs = [int(t) for t in rng.integers(0, vocab_size, size=n_out)]
        hashes = PromptHashes(prompt, None)
        rid = f"r{i}"
        for role in roles:
            role.advance(arrival)
        cores.forget_before(arrival)
        cores.run(arrival, clock.request_cpu_s)
        alone = None if shape.colocated else roles[1].alone(hashes, rule)
        first = roles[1] if alone is not None else roles[0]
        upstream = alone or first.pick(hashes, rule)
        node = first.nodes[upstream]
        whole = shape.colocated or alone is not None
        served = node.colocated(rid, prompt, outputs) if whole else node.prefill(rid, prompt)
        if measured:
            _count(decode if whole else prefill, served)
            served_alone += alone is not None
        _storage_seen(storage, nodes)
        computed = len(prompt) - served.cached_tokens
        prefill_s = clock.prefill_s(computed) + clock.storage_s(served.read_bytes)
        prefilled = cores.run(max(arrival + clock.request_s, node.busy_until), prefill_s)
        node.busy_until = prefilled
        first.in_flight_until(upstream, computed, prefilled)
        fetch_s = 0.0
        if not whole:
            decode_role = roles[1]
            decode_role.advance(prefilled)
            d_upstream = decode_role.pick(hashes, rule)
            pulled = decode_role.nodes[d_upstream].decode(rid, prompt, outputs, served.cached_tokens)
            if measured:
                _count(decode, pulled)
            _storage_seen(storage, nodes)
            fetch_s = clock.pull_s(pulled.pulled_bytes) + clock.storage_s(pulled.read_bytes)
        done = prefilled + fetch_s + clock.decode_step_s * (n_out - 1)
        cores.run(prefilled + fetch_s, clock.decode_step_s * (n_out - 1))   # the decode node's CPU, shared
        engine_cpu_s += (prefill_s + clock.decode_step_s * (n_out - 1)) if measured else 0.0
        if not whole:
            decode_role.in_flight_until(d_upstream, 0, done)
        if not measured:
            continue
        ttfts.append(prefilled - arrival)
        if n_out > 1:
            itls.append(clock.decode_step_s + fetch_s / (n_out - 1))
        finishes.append(done)
        prompt_total += len(prompt)
        output_total += n_out
    hits, total = mooncake.ideal_hit_tokens(records, trace.tokens_per_hash, history)
    deciding = sum(r.deciding_s for r in roles)
    decisions = sum(r.decisions for r in roles)
    span = max(finishes) - offsets[len(history)] if finishes else 0.0
    return {
        "requests": len(records), "prompt_tokens": prompt_total, "output_tokens": output_total,
        "ideal_hit_rate": hits / total if total else None,
        "prefill_hit_rate": None if shape.colocated else sum(prefill.values()) / prompt_total,
        "decode_alone_requests": None if shape.colocated else served_alone,
        "decode_hit_rate": sum(decode.values()) / prompt_total,
        "prefill_storage_hit_rate": None if shape.colocated or storage is None else prefill["storage"] / prompt_total,
        "decode_storage_hit_rate": None if storage is None else decode["storage"] / prompt_total,
        "storage": None if storage is None else {
            "capacity_bytes": storage.capacity, "used_bytes": storage.used, "blocks_written": storage.blocks_written,
            "blocks_read": storage.blocks_read, "blocks_evicted": storage.blocks_evicted},
        "mean_ttft_s": statistics.mean(ttfts), "p90_ttft_s": _percentile(ttfts, 0.9),
        "mean_itl_s": statistics.mean(itls) if itls else None,
        "engine_cpu_s": engine_cpu_s,
        "output_throughput": output_total / span if span > 0 else None,
        "routing_decisions_per_s": decisions / deciding if deciding > 0 else None,
        "index_bytes_per_block": _index_bytes_per_block(roles),
        "blocks_per_node": list(layout.num_blocks),
    }
