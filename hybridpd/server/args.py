"""`hybridpd serve [MODEL_DIR]`: its flags, and the frozen configs they become.

A bad value that argparse can see alone (a malformed size, an unknown choice) exits 2 in argparse itself; one
that a config rejects in `__post_init__` raises `BadArgumentsError`, which `main.py` prints (no traceback) before
exiting with status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridpd.access_log import add_access_log_arguments, excluded_paths
from hybridpd.api_keys import ApiKeys, add_api_key_argument
from hybridpd.cluster_token import add_token_arguments, read_token
from hybridpd.config import (
    DEFAULT_MAMBA_CACHE_BUDGET,
    DEFAULT_PREFILL_TOKENS_WHILE_DECODING,
    CacheConfig,
    EngineConfig,
    KVLoadFailurePolicy,
    KVTransferConfig,
    MambaCacheMode,
    MambaRetentionPolicy,
    SchedulerConfig,
    SchedulingPolicy,
)
from hybridpd.connector.trusted_peers import LOOPBACK_ONLY, TrustedPeers
from hybridpd.cors import add_cors_arguments, policy_from_args
from hybridpd.engine.cpu_set import parse_cpu_list
from hybridpd.engine.dtype_choice import DTYPES, choose_dtype, this_cpus_flags
from hybridpd.engine.model.config_fields import checkpoint_dtype
from hybridpd.errors import HybridPDError
from hybridpd.kv_events.config import KVEventsConfig
from hybridpd.server.chat_templating import ChatTemplating, default_kwargs_argument, template_argument
from hybridpd.server.config import ServerConfig
from hybridpd.server.request_log import RequestLogging
from hybridpd.server.tool_fields import TOOL_CALL_PARSERS, ToolParsing
from hybridpd.server.watchdog import WatchdogBounds
from hybridpd.sse_keep_alive import add_keep_alive_argument, interval_argument
from hybridpd.tls import TLSConfig, add_tls_arguments

log = logging.getLogger(__name__)

KV_PORT_OFFSET = 1000  # --kv-port 0: the side channel listens on the HTTP port + this

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class BadArgumentsError(HybridPDError):
    """Flags that parse but do not make a valid config (the CLI prints the message and exits 2)."""


@dataclass(frozen=True, kw_only=True)
class NodeConfigs:
    engine: EngineConfig
    kv_transfer: KVTransferConfig
    server: ServerConfig
    kv_events: KVEventsConfig = KVEventsConfig()


def parse_size(text: str) -> int:
    """Bytes from "512MiB", "2GiB", "1.5GB", "1e9" (an argparse `type`)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1e9)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", type=Path, default=None,
                        help="a Hugging Face checkpoint directory (Granite-4.0-H, Nemotron-H or Falcon-H1; default: the "
                             "built-in preset)")
    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8100)
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="the model's names in the API: answers and metrics carry the first, requests may give any "
                           "(default: the dir's name, and the dir as given, as vLLM names a model by its --model)")
    http.add_argument("--shutdown-grace", type=float, default=10.0,
                      help="seconds to let running requests finish on SIGTERM before aborting them")
    http.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                      help="send OpenTelemetry traces there (vLLM's flag): http(s)://HOST:4318/v1/traces over "
                           "OTLP/HTTP, grpc://HOST:4317 over OTLP/gRPC; off by default (needs hybridpd[otel])")
    http.add_argument("--health-port", type=int, default=None,
                      help="also answer GET /health in plain HTTP on this port (Kubernetes probes when --tls-ca "
                           "makes the main port require client certificates)")
    http.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                      help="answer GET /tokenizer_info (vLLM's flag; off by default: it shows the tokenizer's config "
                           "and chat template), what lm-evaluation-harness's remote tokenizer reads")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="let chat requests with tools leave the choice to the model (tool_choice \"auto\", the "
                           "default with tools; vLLM's flag): needs --tool-call-parser")
    http.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                      help="how the model writes tool calls, read into the answer's tool_calls (vLLM's flag; "
                           "granite4: <tool_call>{\"name\", \"arguments\"}</tool_call>, Granite 4.0's)")
    http.add_argument("--chat-template", default=None, metavar="PATH|TEMPLATE",
                      help="the chat template to render chat with instead of the checkpoint's: a file's path, or the "
                           "jinja2 template itself in one line (vLLM's flag)")
    http.add_argument("--trust-request-chat-template", action="store_true",
                      help="render a request with the template it sends (`chat_template`, or "
                           "`chat_template_kwargs.chat_template`); without it such requests are refused, as vLLM's")
    http.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                      help="variables every chat template sees unless a request's chat_template_kwargs set them, as "
                           "a JSON object, e.g. '{\"enable_thinking\": false}' (vLLM's flag)")
    http.add_argument("--response-role", default="assistant",
                      help="the role of a chat answer when the generation prompt opens its turn (vLLM's flag)")
    http.add_argument("--enable-force-include-usage", action="store_true",
                      help="every chat and completions stream carries the usage, in every chunk and at its end, "
                           "whatever its stream_options (vLLM's flag)")
    http.add_argument("--return-tokens-as-token-ids", action="store_true",
                      help="every chat and completions answer's logprobs name tokens `token_id:<id>` (vLLM's flag; "
                           "without it a request asks with return_tokens_as_token_ids)")
    add_keep_alive_argument(http, "queued, prefilling, between tokens")
    http.add_argument("--enable-server-load-tracking", action="store_true",
                      help="GET /load answers the generation requests in flight (vLLM's flag; without it, 0)")
    http.add_argument("--enable-request-id-headers", action="store_true",
                      help="every answer carries an X-Request-Id header: the request's own, or a new one (vLLM's flag)")
    add_cors_arguments(http)
    http.add_argument("--enable-log-requests", action="store_true",
                      help="log each generation request as it arrives: its id and sampling params at INFO, its "
                           "prompt and token ids at DEBUG (vLLM's flag)")
    http.add_argument("--enable-log-outputs", action="store_true",
                      help="with --enable-log-requests, also log what each request generated once it ends (vLLM's "
                           "flag)")
    http.add_argument("--max-log-len", type=int, default=None,
                      help="characters of a prompt or output, and token ids, that the request log shows (vLLM's "
                           "flag; default: all)")
    add_access_log_arguments(http)
    http.add_argument("--engine-heartbeat-timeout", type=float, default=10.0,
                      help="seconds without a heartbeat from the engine process before /health answers 503")
    http.add_argument("--engine-stall-timeout", type=float, default=60.0,
                      help="seconds with work queued and no engine step finished before /health answers 503 "
                           "(generous: one long prefill step counts as a stall too)")

    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=16)
    size = cache.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", type=parse_size, default=None,
                      help="bytes for all KV groups together: 512MiB, 2GiB, 1e9")
    size.add_argument("--num-blocks", type=int, default=None, help="blocks per attention group")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    cache.add_argument("--mamba-cache-mode", choices=[m.value for m in MambaCacheMode], default="align")
    cache.add_argument("--mamba-cache-budget", type=float, default=DEFAULT_MAMBA_CACHE_BUDGET, metavar="SHARE",
                       help="share of the KV memory that saved Mamba states may take for the prefix cache (with "
                            "--kv-cache-memory, the groups share it: running states are taken as requests are "
                            "admitted; default 0.1)")
    cache.add_argument("--mamba-cache-retention", choices=[p.value for p in MambaRetentionPolicy],
                       default=MambaRetentionPolicy.SPARSE.value,
                       help="which Mamba states a request saves: a few chosen boundaries, or every interval")
    cache.add_argument("--mamba-cache-interval", type=int, default=None,
                       help="tokens between saved Mamba states (a multiple of --block-size)")
    cache.add_argument("--kv-offload-dir", type=Path, default=None, metavar="PATH",
                       help="KV offloading to storage: full blocks of every group (Mamba: its saved states) are "
                            "written behind to PATH, and prefix hits are read back from it; several nodes may "
                            "share it (off by default)")
    cache.add_argument("--kv-offload-size", type=parse_size, default=64 << 30, metavar="SIZE",
                       help="the most the storage tier keeps under --kv-offload-dir for this model (least recently "
                            "used blocks evicted beyond it; vLLM calls its own --kv-offloading-size; default 64GiB)")
    cache.add_argument("--kv-cache-metrics", action="store_true",
                       help="vLLM's sampled KV cache residency metrics: each block's lifetime, its idle time before "
                            "its memory is reused and the gaps between its reuses (vllm:kv_block_*_seconds)")
    cache.add_argument("--kv-cache-metrics-sample", type=float, default=0.01, metavar="SHARE",
                       help="the share of allocated blocks --kv-cache-metrics follows, in (0, 1] (default 0.01)")

    sched = parser.add_argument_group("scheduler and model")
    sched.add_argument("--max-num-seqs", type=int, default=32)
    sched.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sched.add_argument("--max-prefill-tokens-while-decoding", type=int,
                       default=DEFAULT_PREFILL_TOKENS_WHILE_DECODING,
                       help="prefill tokens a step may carry while some request decodes, so that arriving prompts "
                            "do not stall the decodes for long, and beyond them the rows the step's products "
                            "would pad anyway (0: up to --max-num-batched-tokens)")
    sched.add_argument("--max-model-len", type=int, default=None)
    sched.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy], default="fcfs",
                       help="fcfs: waiting requests in arrival order; sjf: the fewest uncached prompt tokens first "
                            "(a request waiting --sjf-max-wait goes first), a step taking no further prompt once it "
                            "carries --sjf-step-tokens: lower mean TTFT when prompts arrive in bursts")
    sched.add_argument("--sjf-max-wait", type=float, default=SchedulerConfig.sjf_max_wait, metavar="SECONDS",
                       help="under sjf, a request that has waited this long is admitted before shorter ones")
    sched.add_argument("--sjf-step-tokens", type=int, default=SchedulerConfig.sjf_step_tokens, metavar="TOKENS",
                       help="under sjf, a step takes no further waiting prompt once it carries this many prompt "
                            "tokens (the first prompt is not cut by it)")
    sched.add_argument("--dtype", choices=list(DTYPES), default="auto",
                       help="auto: the checkpoint's dtype where the CPU has bfloat16 units (AMX, AVX512-BF16), "
                            "float32 elsewhere")
    sched.add_argument("--threads", type=int, default=1, help="torch threads for this node")
    sched.add_argument("--engine-cpus", default=None,
                       help="CPUs the engine thread runs on, a Linux CPU list (0, 0-3, 0,2); default: unpinned")
    sched.add_argument("--seed", type=int, default=0)
    sched.add_argument("--skip-tokenizer-init", action="store_true",
                       help="load no tokenizer (as vLLM's flag): prompts must be token ids, outputs carry token ids "
                            "and empty text; text prompts, chat and stop strings are refused")

    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--kv-host", default=None,
                    help="address the side channel binds and that decoders are told to reach (default: --host); "
                         "set it to this host's routable address when --host is 0.0.0.0")
    pd.add_argument("--kv-port", type=int, default=0,
                    help=f"gRPC side-channel port (0 = HTTP port + {KV_PORT_OFFSET})")
    pd.add_argument("--kv-lease-seconds", type=float, default=60.0)
    pd.add_argument("--kv-load-failure-policy", choices=[p.value for p in KVLoadFailurePolicy], default="fail")
    pd.add_argument("--kv-load-timeout", type=float, default=30.0)
    pd.add_argument("--no-decode-skip-mamba-align", dest="decode_skip_mamba_align", action="store_false",
                    help="(debug) let Mamba groups limit the decode side's local prefix hit")
    pd.add_argument("--kv-trusted-peers", nargs="+", default=list(LOOPBACK_ONLY), metavar="CIDR|HOST",
                    help="prefill nodes this node may pull KV from (their remote_host): CIDRs, addresses or host "
                         "names, also comma-separated (default: loopback only)")
    add_token_arguments(pd, "shared secret for the side channel and KV requests")

    add_tls_arguments(parser.add_argument_group("TLS (HTTP and the side channel)"))
    add_api_key_argument(parser, "the key the OpenAI and Anthropic routes (/v1/...) ask for, as vLLM's: "
                                 "`Authorization: Bearer KEY` or `x-api-key: KEY`")

    events = parser.add_argument_group("KV cache events (vLLM's format)")
    events.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help='vLLM\'s KVEventsConfig as JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": '
                             '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": '
                             '"kv-events"}\'')


def model_names(served: list[str] | None, model_dir: Path, given: Path | None) -> tuple[str, ...]:
    """The model's names in the API, the one answers carry first: `--served-model-name`'s, or the checkpoint
    directory's name and, where it differs, the directory as given (vLLM's name for a model served without the flag:
    a client written for `vllm serve DIR` sends `"model": "DIR"`)."""
    if served:
        return tuple(dict.fromkeys(served))
    return tuple(dict.fromkeys([model_dir.resolve().name, *([str(given)] if given is not None else [])]))


def configs_from_args(args: argparse.Namespace, default_model_dir: Callable[[], Path]) -> NodeConfigs:
    """The node's configs; `default_model_dir()` is called only when no MODEL_DIR was given.

    `--kv-port 0` resolves to the HTTP port + 1000 here, unless the HTTP port is itself 0 (ephemeral), in which
    case it stays 0 for whoever binds the side channel.
    """
    model_dir = args.model_dir if args.model_dir is not None else default_model_dir()
    kv_port = args.kv_port or (args.port + KV_PORT_OFFSET if args.port else 0)
    try:
        kv_events = KVEventsConfig.parse(args.kv_events_config)
        tls = TLSConfig.from_args(args)
        dtype, why = choose_dtype(args.dtype, checkpoint_dtype(model_dir), this_cpus_flags())
        log.info("computing in %s (%s)", dtype, why)
        engine = EngineConfig(
            model_dir=model_dir,
            dtype=dtype,
            threads=args.threads,
            cpus=parse_cpu_list(args.engine_cpus) if args.engine_cpus is not None else None,
            seed=args.seed,
            skip_tokenizer_init=args.skip_tokenizer_init,
            cache=CacheConfig(
                block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory,
                num_blocks=args.num_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
                mamba_cache_mode=MambaCacheMode(args.mamba_cache_mode),
                mamba_cache_interval=args.mamba_cache_interval,
                enable_kv_cache_events=kv_events.publishes,
                mamba_cache_budget=args.mamba_cache_budget,
                mamba_retention=MambaRetentionPolicy(args.mamba_cache_retention),
                kv_offload_dir=args.kv_offload_dir,
                kv_offload_size=args.kv_offload_size,
                kv_offload_read_timeout=args.kv_load_timeout,
                kv_cache_metrics_sample=args.kv_cache_metrics_sample if args.kv_cache_metrics else None,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding or None,
                max_model_len=args.max_model_len,
                scheduling_policy=SchedulingPolicy(args.scheduling_policy),
                sjf_max_wait=args.sjf_max_wait,
                sjf_step_tokens=args.sjf_step_tokens,
            ),
        )
        cluster_token = read_token(args)
        names = model_names(args.served_model_name, model_dir, args.model_dir)
        server = ServerConfig(
            host=args.host,
            port=args.port,
            served_model_name=names[0],
            model_aliases=names[1:],
            shutdown_grace=args.shutdown_grace,
            health_port=args.health_port,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            watchdog=WatchdogBounds(silent_after=args.engine_heartbeat_timeout,
                                    stall_after=args.engine_stall_timeout),
            cluster_token=cluster_token,
            trusted_peers=TrustedPeers.parse(args.kv_trusted_peers),
            tls=tls,
            tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            tool_parsing=ToolParsing(args.enable_auto_tool_choice, args.tool_call_parser),
            api_keys=ApiKeys.from_args(args, os.environ),
            chat_template=template_argument(args.chat_template),
            templating=ChatTemplating(args.trust_request_chat_template,
                                      default_kwargs_argument(args.default_chat_template_kwargs), args.response_role),
            force_include_usage=args.enable_force_include_usage,
            tokens_as_ids=args.return_tokens_as_token_ids,
            sse_keep_alive=interval_argument(args.sse_keep_alive_interval),
            load_tracking=args.enable_server_load_tracking,
            request_id_headers=args.enable_request_id_headers,
            cors=policy_from_args(args),
            request_logging=RequestLogging(args.enable_log_requests, args.enable_log_outputs, args.max_log_len),
            access_log=not args.disable_uvicorn_access_log,
            access_log_excluded=excluded_paths(args.disable_access_log_for_endpoints),
        )
        if not 0 <= kv_port < 65536:
            raise ValueError(f"--kv-port must be in [0, 65535], got {kv_port}")
        kv_transfer = KVTransferConfig(
            kv_host=args.kv_host or args.host,
            kv_port=kv_port,
            lease_seconds=args.kv_lease_seconds,
            load_failure_policy=KVLoadFailurePolicy(args.kv_load_failure_policy),
            decode_skip_mamba_align=args.decode_skip_mamba_align,
            load_timeout_seconds=args.kv_load_timeout,
            cluster_token=cluster_token,
            tls=tls,
        )
    except ValueError as exc:
        raise BadArgumentsError(str(exc)) from exc
    return NodeConfigs(engine=engine, kv_transfer=kv_transfer, server=server, kv_events=kv_events)
