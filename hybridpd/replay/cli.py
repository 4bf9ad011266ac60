"""`hybridpd replay TRACE`: simulate a cluster on a Mooncake trace (simulator.py) and print one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridpd.bench import mooncake
from hybridpd.config import MambaRetentionPolicy
from hybridpd.proxy.config import CostRule, RoutingPolicy
from hybridpd.server.args import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, nargs="?", help="a Mooncake trace (JSON lines); not needed with --calibrate")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--prefill", type=int, default=0, help="prefill nodes (with --decode)")
    parser.add_argument("--decode", type=int, default=0, help="decode nodes (with --prefill)")
    parser.add_argument("--colocated", type=int, default=0, help="colocated nodes instead of prefill and decode")
    parser.add_argument("--routing", choices=[p.value for p in RoutingPolicy], default="round_robin")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=512 << 20, help="per node (512MiB, 2GiB)")
    parser.add_argument("--kv-offload-size", type=parse_size, default=None,
                        help="a storage tier of this size (one directory every node shares, as --kv-offload-dir on "
                             "a shared volume); default: none")
    parser.add_argument("--pd-threshold", type=int, default=0, metavar="TOKENS",
                        help="the proxy's flag (cache_aware): a request whose decode node would compute fewer prompt "
                             "tokens than this is served whole there; 0: always disaggregate")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--mamba-cache-retention", choices=[p.value for p in MambaRetentionPolicy],
                        default=MambaRetentionPolicy.SPARSE.value,
                        help="which Mamba states a request saves, as the nodes' flag: a few chosen boundaries, or "
                             "every interval")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--trace-tokens-per-hash", type=int, default=16)
    parser.add_argument("--trace-time-scale", type=float, default=1.0)
    parser.add_argument("--trace-start", type=float, default=0.0)
    parser.add_argument("--trace-duration", type=float, default=None)
    parser.add_argument("--trace-max-requests", type=int, default=None)
    parser.add_argument("--trace-max-output-len", type=int, default=None)
    parser.add_argument("--trace-history", type=float, default=0.0, metavar="S",
                        help="serve the S seconds of trace before --trace-start first, unmeasured: the caches as a "
                             "cluster that has been serving holds them (default: 0, the slice on empty caches)")
    parser.add_argument("--time-model", type=Path, default=None, metavar="JSON",
                        help="the clock: a JSON object as --calibrate prints (default: fixed figures)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the clock on this machine with the real engine on --model, print it, exit")


def run(args: argparse.Namespace) -> int:
    from hybridpd.engine.model.loader import read_model_config
    from hybridpd.presets.checkpoints import default_model_dir
    from hybridpd.replay.node import NodeLayout, SimulationError
    from hybridpd.replay.simulator import ClusterShape, simulate
    from hybridpd.replay.time_model import TimeModel, calibrate

    model_dir = args.model or default_model_dir()
    if args.calibrate:
        print(json.dumps(calibrate(model_dir).as_json()))
        return 0
    if args.trace is None:
        print("hybridpd replay: give a TRACE (or --calibrate)", file=sys.stderr)
        return 2
    try:
        shape = ClusterShape(prefill=args.prefill, decode=args.decode, colocated=args.colocated)
        rule = CostRule(pd_threshold=args.pd_threshold)
        rule.check_routing(RoutingPolicy(args.routing))
        clock = TimeModel(**json.loads(args.time_model.read_text())) if args.time_model else TimeModel()
        trace = mooncake.TraceSlice(tokens_per_hash=args.trace_tokens_per_hash, time_scale=args.trace_time_scale,
                                    start_s=args.trace_start, duration_s=args.trace_duration,
                                    max_requests=args.trace_max_requests, max_output_len=args.trace_max_output_len)
        every = mooncake.read_trace(args.trace)
        records, history = ([r for r in chosen if mooncake.scaled_length(r, args.trace_tokens_per_hash)
                             < args.max_model_len]
                            for chosen in (mooncake.select(every, trace),
                                           mooncake.history(every, trace, args.trace_history)))
        layout = NodeLayout.of(model_dir, args.kv_cache_memory, args.block_size, args.max_num_seqs,
                               args.max_model_len, MambaRetentionPolicy(args.mamba_cache_retention))
        vocab = read_model_config(model_dir)[0].vocab_size
        result = simulate(records, trace, layout, shape, RoutingPolicy(args.routing), clock, vocab, rule,
                          offload_bytes=args.kv_offload_size, history=history)
    except (ValueError, TypeError, OSError, SimulationError) as exc:
        print(f"hybridpd replay: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result | {"routing": args.routing, "cluster": vars(shape), "history_requests": len(history),
                               "kv_cache_memory": args.kv_cache_memory, "clock": clock.as_json()}))
    return 0
