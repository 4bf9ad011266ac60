"""The proxy's routing path at scale: `cache_aware` decisions per second over the Mooncake conversation trace's hour.

`--nodes` colocated simulated nodes (hybridpd/replay/node.py: our real KV cache manager per node, on the meta device,
publishing the KV events that build the proxy's real indexes, all sharing one `BlockHolders`) take the trace in
arrival order, each request routed by the proxy's own `choose` and then served by the node it chose, so the indexes
fill as a cluster's would. Then, on the state the hour left, the last `--timed` requests' prompts are routed again
without serving them (the state does not move), `--rounds` times: that is the routing path alone, one process, the
collector paused as in a proxy whose heap holds only its indexes. Each decision hashes its prompt (as the proxy
does for every request) and asks every node.

Last line: JSON with `decisions_per_s` (the median round; goal >= 5,000 at 64 nodes), each round's, the same during
the hour (`decisions_per_s_while_filling`, the simulator's figure), the number of block hashes the holders map and
the indexes' bytes per block hash.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from hybridpd.bench import mooncake
from hybridpd.engine.model.loader import read_model_config
from hybridpd.presets.checkpoints import default_model_dir
from hybridpd.proxy.block_holders import BlockHolders
from hybridpd.proxy.cache_aware import choose
from hybridpd.proxy.config import CostRule, Role, RoutingPolicy, Upstream
from hybridpd.proxy.kv_index import PromptHashes
from hybridpd.proxy.routing import Router
from hybridpd.replay.node import NodeLayout, SimNode
from hybridpd.replay.simulator import timed_decision

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=256, help="MiB per node")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-requests", type=int, default=None, help="default: the whole hour")
    parser.add_argument("--timed", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")

    model = default_model_dir()
    vocab = read_model_config(model)[0].vocab_size
    trace = mooncake.TraceSlice(tokens_per_hash=16, max_requests=args.max_requests, max_output_len=4)
    records = [r for r in mooncake.select(mooncake.read_trace(args.trace), trace)
               if mooncake.scaled_length(r, 16) < args.max_model_len]
    layout = NodeLayout.of(model, args.kv_cache_memory << 20, 16, 32, args.max_model_len)
    holders = BlockHolders()
    upstreams = tuple(Upstream(role=Role.DECODE, host="sim", port=1 + i) for i in range(args.nodes))
    nodes = {u: SimNode(f"node-{i}", layout, holders) for i, u in enumerate(upstreams)}
    router = Router(upstreams, RoutingPolicy.CACHE_AWARE)
    rule = CostRule()

    def index_of(upstream: Upstream):
        return nodes[upstream].index

    rng = np.random.Generator(np.random.PCG64(0))
    prompts = [list(mooncake.prompt_tokens(r, 16, vocab, rng)) for r in records]
    print(f"routing_scale: {len(records)} requests through {args.nodes} nodes ...", file=sys.stderr, flush=True)
    def decision(prompt: list[int]) -> tuple[Upstream, float]:   # the proxy's: hash the prompt, ask every node
        return timed_decision(lambda: choose(router, Role.DECODE, PromptHashes(prompt, None), index_of, rule).upstream)

    filling = 0.0
    for i, prompt in enumerate(prompts):
        upstream, elapsed = decision(prompt)
        filling += elapsed
        nodes[upstream].colocated(f"r{i}", prompt, [1])
    timed = prompts[-args.timed:]
    rounds = []
    for _ in range(args.rounds):
        spent = sum(decision(prompt)[1] for prompt in timed)
        rounds.append(len(timed) / spent)
    hashes = sum(node.index.num_hashes for node in nodes.values())
    print(json.dumps({
        "decisions_per_s": statistics.median(rounds), "decisions_per_s_per_round": rounds,
        "decisions_per_s_while_filling": len(prompts) / filling, "goal": ">= 5000 at 64 nodes",
        "nodes": args.nodes, "requests": len(prompts), "timed_requests": len(timed),
        "index_hashes": hashes, "holder_hashes": holders.num_hashes,
        "kv_cache_memory_mib": args.kv_cache_memory,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
