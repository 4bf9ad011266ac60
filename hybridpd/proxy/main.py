"""`hybridpd proxy`: vLLM's toy proxy flags, plus routing, timeouts and the cluster token."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aiohttp import web

from hybridpd.access_log import add_access_log_arguments, excluded_paths, runner_kwargs
from hybridpd.api_keys import ApiKeys, add_api_key_argument
from hybridpd.cluster_token import add_token_arguments, read_token
from hybridpd.cors import add_cors_arguments, policy_from_args
from hybridpd.gc_heap import freeze_startup_heap_on_start
from hybridpd.proxy.app import build_app
from hybridpd.proxy.config import CostRule, DnsSource, ProxyConfig, Role, RoutingPolicy, Upstream
from hybridpd.proxy.outliers import OutlierPolicy
from hybridpd.sse_keep_alive import add_keep_alive_argument, interval_argument
from hybridpd.tls import TLSConfig, add_tls_arguments

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=None,
                        help="static prefill nodes (default 127.0.0.1 unless --prefiller-dns)")
    parser.add_argument("--prefiller-ports", "--prefiller-port", type=int, nargs="+", default=None,
                        help="their ports (default 8100)")
    parser.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=None,
                        help="static decode nodes (default 127.0.0.1 unless --decoder-dns)")
    parser.add_argument("--decoder-ports", "--decoder-port", type=int, nargs="+", default=None,
                        help="their ports (default 8200)")
    parser.add_argument("--prefiller-dns", default=None, metavar="NAME:PORT",
                        help="prefill nodes from DNS: every A/AAAA record of NAME, re-resolved every --dns-interval "
                             "(a Kubernetes headless Service)")
    parser.add_argument("--decoder-dns", default=None, metavar="NAME:PORT", help="decode nodes from DNS, likewise")
    parser.add_argument("--nodes-file", type=Path, default=None, metavar="PATH",
                        help='both roles\' nodes from a JSON file {"prefill": ["host:port", ...], "decode": [...]}, '
                             're-read when it changes')
    parser.add_argument("--dns-interval", type=float, default=5.0,
                        help="seconds between DNS resolutions (and checks of --nodes-file)")
    parser.add_argument("--fallback-colocated", action=argparse.BooleanOptionalAction, default=True,
                        help="when no prefill node can take a request, let a decode node prefill it itself")
    parser.add_argument("--first-token-from-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="stream a streaming client's first token from the prefill call, before the decode call "
                             "opens (the decode node continues the stream); off: the decode node streams it, as "
                             "behind vLLM's toy proxy")
    parser.add_argument("--dns-server", default=None, metavar="HOST:PORT",
                        help="ask this DNS server instead of the system's resolver")
    parser.add_argument(
        "--routing", choices=[policy.value for policy in RoutingPolicy], default=RoutingPolicy.ROUND_ROBIN.value,
        help="how a node of each role is picked per request",
    )
    parser.add_argument("--load-tokens-per-request", type=int, default=32, metavar="TOKENS",
                        help="cache_aware: the cost of one call in flight on a node, in prompt tokens (see "
                             "proxy/cache_aware.py: cost = miss + W x queued miss tokens + this x calls in flight)")
    parser.add_argument("--queued-tokens-weight", type=float, default=0.5, metavar="W",
                        help="cache_aware: how much the miss tokens queued on a node weigh against the request's "
                             "own, in [0, 1] (0.5: a request waits for about half the work ahead of it)")
    parser.add_argument("--storage-hit-weight", type=float, default=0.5, metavar="W",
                        help="cache_aware: how much a prompt token a node would read from its storage tier "
                             "(--kv-offload-dir) saves against one held in memory, in [0, 1]")
    parser.add_argument("--pd-threshold", type=int, default=0, metavar="TOKENS",
                        help="cache_aware: send a request to a prefill node only when the decode node chosen for it "
                             "would compute at least TOKENS of its prompt (its hit in memory and storage known from "
                             "its KV events); a shorter miss is served whole there, with no prefill call and no pull "
                             "(llm-d's prefix-based P/D decision, its nonCachedTokens). 0 (default): always "
                             "disaggregate")
    parser.add_argument("--prefill-timeout", type=float, default=120.0, help="seconds for a whole prefill call")
    parser.add_argument("--prefill-first-byte-timeout", type=float, default=5.0,
                        help="seconds for a prefill node's first byte (its HTTP front's 100 Continue); a node "
                             "silent that long is retried once on another prefill node")
    parser.add_argument("--decode-timeout", type=float, default=120.0,
                        help="streamed decode calls: seconds between two chunks before the call fails")
    parser.add_argument("--decode-request-timeout", type=float, default=1800.0,
                        help="non-streamed decode calls: seconds for the whole generation")
    parser.add_argument("--decode-first-byte-timeout", type=float, default=5.0,
                        help="seconds for a decode node's first byte (its 100 Continue); a node silent that long "
                             "never read the call, which goes to another decode node")
    add_keep_alive_argument(parser, "the prefill call, the pull, slow tokens")
    add_cors_arguments(parser)
    add_access_log_arguments(parser)
    parser.add_argument("--probe-interval", type=float, default=1.0,
                        help="seconds between active probes (GET /health) of every node")
    parser.add_argument("--eject-after", type=int, default=3, metavar="N",
                        help="consecutive failed calls (or probes) that eject a node from rotation")
    parser.add_argument("--ejection-time", type=float, default=2.0,
                        help="seconds of a first ejection; each further one doubles it, up to --max-ejection-time")
    parser.add_argument("--max-ejection-time", type=float, default=30.0, help="the longest ejection, in seconds")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a node")
    parser.add_argument("--health-timeout", type=float, default=2.0, help="seconds for one node's GET /health")
    add_token_arguments(parser, "sent to nodes as the X-HybridPD-Cluster-Token header on calls that carry "
                                "kv_transfer_params")
    add_tls_arguments(parser)
    add_api_key_argument(parser, "the key clients must present on /v1/... routes (`Authorization: Bearer KEY` or "
                                 "`x-api-key: KEY`); the first one is also presented to the nodes")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="send OpenTelemetry traces there (vLLM's flag): http(s)://HOST:4318/v1/traces or "
                             "grpc://HOST:4317; the proxy's spans and the traceparent it passes on to the nodes")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _upstreams(role: Role, hosts: list[str], ports: list[int]) -> tuple[Upstream, ...]:
    flag = "prefiller" if role is Role.PREFILL else "decoder"
    if len(hosts) != len(ports):
        raise ValueError(
            f"--{flag}-hosts has {len(hosts)} entries but --{flag}-ports has {len(ports)}; they must match "
            f"one to one (give a host for every port)"
        )
    return tuple(Upstream(role=role, host=host, port=port) for host, port in zip(hosts, ports))


def _role_nodes(role: Role, hosts: list[str] | None, ports: list[int] | None, dns: str | None,
                default_port: int) -> tuple[tuple[Upstream, ...], DnsSource | None]:
    flag = "prefiller" if role is Role.PREFILL else "decoder"
    if dns is not None:
        if hosts is not None or ports is not None:
            raise ValueError(f"--{flag}-dns and --{flag}-hosts/--{flag}-ports are exclusive: choose one")
        return (), DnsSource.parse(role, dns)
    return _upstreams(role, hosts or ["127.0.0.1"], ports or [default_port]), None


def _dns_server(text: str | None) -> tuple[str, int] | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--dns-server is HOST:PORT, got {text!r}")
    return host, int(port)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Raises ValueError with a message meant for the user."""
    if args.nodes_file is not None:
        given = [flag for flag, value in (("--prefiller-hosts", args.prefiller_hosts), ("--prefiller-ports",
                 args.prefiller_ports), ("--decoder-hosts", args.decoder_hosts), ("--decoder-ports", args.decoder_ports),
                 ("--prefiller-dns", args.prefiller_dns), ("--decoder-dns", args.decoder_dns)) if value is not None]
        if given:
            raise ValueError(f"--nodes-file gives every node: drop {', '.join(given)}")
        prefillers, prefill_dns, decoders, decode_dns = (), None, (), None
    else:
        prefillers, prefill_dns = _role_nodes(Role.PREFILL, args.prefiller_hosts, args.prefiller_ports,
                                              args.prefiller_dns, 8100)
        decoders, decode_dns = _role_nodes(Role.DECODE, args.decoder_hosts, args.decoder_ports, args.decoder_dns,
                                           8200)
    return ProxyConfig(
        host=args.host,
        port=args.port,
        prefillers=prefillers,
        decoders=decoders,
        prefill_dns=prefill_dns,
        decode_dns=decode_dns,
        dns_interval=args.dns_interval,
        dns_server=_dns_server(args.dns_server),
        fallback_colocated=args.fallback_colocated,
        first_token_from_prefill=args.first_token_from_prefill,
        nodes_file=args.nodes_file,
        routing=RoutingPolicy(args.routing),
        cost_rule=CostRule(load_tokens_per_request=args.load_tokens_per_request,
                           queued_tokens_weight=args.queued_tokens_weight,
                           storage_hit_weight=args.storage_hit_weight, pd_threshold=args.pd_threshold),
        prefill_timeout=args.prefill_timeout,
        prefill_first_byte_timeout=args.prefill_first_byte_timeout,
        decode_timeout=args.decode_timeout,
        decode_request_timeout=args.decode_request_timeout,
        decode_first_byte_timeout=args.decode_first_byte_timeout,
        sse_keep_alive=interval_argument(args.sse_keep_alive_interval),
        cors=policy_from_args(args),
        probe_interval=args.probe_interval,
        outliers=OutlierPolicy(threshold=args.eject_after, base_ejection_s=args.ejection_time,
                               max_ejection_s=args.max_ejection_time),
        connect_timeout=args.connect_timeout,
        health_timeout=args.health_timeout,
        cluster_token=read_token(args),
        api_keys=ApiKeys.from_args(args, os.environ),
        tls=TLSConfig.from_args(args),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"hybridpd proxy: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info(
        "proxy on %s:%d, prefill %s, decode %s, routing %s", config.host, config.port,
        config.nodes_file or config.prefill_dns or [u.address for u in config.prefillers],
        config.nodes_file or config.decode_dns or [u.address for u in config.decoders], config.routing.value,
    )
    app = build_app(config)
    app.on_startup.append(freeze_startup_heap_on_start)   # the app, its sessions, the modules: long-lived
    web.run_app(
        app, host=config.host, port=config.port, handler_cancellation=True,
        print=lambda message: logger.info("%s", message.strip()),
        **runner_kwargs(not args.disable_uvicorn_access_log, excluded_paths(args.disable_access_log_for_endpoints)),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridpd proxy", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
