"""`hybridpd serve` flags -> NodeConfigs; bad values exit 2 (argparse) or raise BadArgumentsError (configs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from hybridpd.config import KVLoadFailurePolicy, MambaCacheMode, SchedulingPolicy
from hybridpd.server.args import BadArgumentsError, parse_size

from .conftest import serve_configs, serve_parser


def test_defaults():
    c = serve_configs([])
    assert c.engine.model_dir == Path("/models/default-preset")
    assert (c.server.host, c.server.port, c.server.served_model_name) == ("127.0.0.1", 8100, "default-preset")
    assert (c.engine.cache.block_size, c.engine.cache.enable_prefix_caching) == (16, True)
    assert c.engine.cache.mamba_cache_mode is MambaCacheMode.ALIGN
    assert (c.engine.threads, c.engine.dtype, c.server.shutdown_grace) == (1, "float32", 10.0)
    assert (c.kv_transfer.kv_port, c.kv_transfer.lease_seconds, c.kv_transfer.load_timeout_seconds) == (9100, 60.0, 30.0)
    assert c.kv_transfer.load_failure_policy is KVLoadFailurePolicy.FAIL
    assert c.kv_transfer.decode_skip_mamba_align and c.kv_transfer.cluster_token is None
    assert (c.engine.cpus, c.engine.scheduler.max_prefill_tokens_while_decoding) == (None, 192)
    assert not c.engine.skip_tokenizer_init


@pytest.mark.parametrize("text, cpus", [("0", {0}), ("0-1", {0, 1}), ("1,0", {0, 1}), (" 0 ", {0})])
def test_engine_cpus(text, cpus):
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        pytest.skip(f"this machine lets the process use CPUs {sorted(available)}")
    assert serve_configs(["--engine-cpus", text]).engine.cpus == cpus


def test_no_prefill_cap_while_decoding():
    scheduler = serve_configs(["--max-prefill-tokens-while-decoding", "0"]).engine.scheduler
    assert scheduler.max_prefill_tokens_while_decoding is None


@pytest.mark.parametrize("argv, policy, max_wait, step_tokens", [
    ([], SchedulingPolicy.FCFS, 1.0, 256),
    (["--scheduling-policy", "sjf"], SchedulingPolicy.SJF, 1.0, 256),
    (["--scheduling-policy", "sjf", "--sjf-max-wait", "0.25", "--sjf-step-tokens", "64"], SchedulingPolicy.SJF, 0.25,
     64),
])
def test_scheduling_policy(argv, policy, max_wait, step_tokens):
    scheduler = serve_configs(argv).engine.scheduler
    assert (scheduler.scheduling_policy, scheduler.sjf_max_wait, scheduler.sjf_step_tokens) == (policy, max_wait,
                                                                                               step_tokens)


def test_every_flag(tmp_path):
    c = serve_configs([str(tmp_path), "--host", "0.0.0.0", "--port", "8200", "--served-model-name", "m",
                 "--block-size", "32", "--kv-cache-memory", "512MiB", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "256", "--max-model-len", "1024", "--no-enable-prefix-caching",
                 "--mamba-cache-mode", "none", "--mamba-cache-interval", "64", "--dtype", "bfloat16",
                 "--threads", "2", "--seed", "7", "--kv-port", "9999", "--kv-lease-seconds", "5",
                 "--kv-load-failure-policy", "recompute", "--kv-load-timeout", "3", "--no-decode-skip-mamba-align",
                 "--cluster-token", "s3cr3t-value", "--shutdown-grace", "1.5", "--skip-tokenizer-init"])
    e, k, s = c.engine, c.kv_transfer, c.server
    assert e.model_dir == tmp_path and (s.host, s.port, s.served_model_name, s.shutdown_grace) == ("0.0.0.0", 8200, "m", 1.5)
    assert (e.cache.block_size, e.cache.kv_cache_memory, e.cache.enable_prefix_caching) == (32, 512 * 2**20, False)
    assert (e.cache.mamba_cache_mode, e.cache.mamba_cache_interval) == (MambaCacheMode.NONE, 64)
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens, e.scheduler.max_model_len) == (4, 256, 1024)
    assert (e.dtype, e.threads, e.seed, e.skip_tokenizer_init) == ("bfloat16", 2, 7, True)
    assert (k.kv_host, k.kv_port, k.lease_seconds, k.load_timeout_seconds) == ("0.0.0.0", 9999, 5.0, 3.0)
    assert k.load_failure_policy is KVLoadFailurePolicy.RECOMPUTE and not k.decode_skip_mamba_align
    assert k.cluster_token == "s3cr3t-value" == s.cluster_token and "s3cr3t" not in repr(c)


def test_cluster_token_file_and_ephemeral_port(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    c = serve_configs(["--cluster-token-file", str(token_file), "--port", "0", "--num-blocks", "64"])
    assert c.kv_transfer.cluster_token == "from-file" and c.kv_transfer.kv_port == 0
    assert c.engine.cache.num_blocks == 64


@pytest.mark.parametrize(
    "text, size",
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1e9", 10**9), ("1.5GB", 1_500_000_000), ("4096", 4096),
     ("64 kib", 65536)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "-5", "0", "1e999", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-cache-memory", "lots"],
        ["--kv-cache-memory", "1GiB", "--num-blocks", "10"],
        ["--mamba-cache-mode", "sometimes"],
        ["--dtype", "float16"],
        ["--kv-load-failure-policy", "retry"],
        ["--cluster-token", "a", "--cluster-token-file", "f"],
        ["--port", "http"],
        ["--scheduling-policy", "priority"],
    ],
)
def test_argparse_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_parser().parse_args(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--block-size", "0"], "--block-size"),
        (["--num-blocks", "1"], "--num-blocks"),
        (["--mamba-cache-interval", "20"], "--mamba-cache-interval"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--threads", "0"], "--threads"),
        (["--kv-lease-seconds", "0"], "--kv-lease-seconds"),
        (["--kv-load-timeout", "-1"], "--kv-load-timeout"),
        (["--port", "70000"], "--port"),
        (["--kv-port", "70000"], "--kv-port"),
        (["--shutdown-grace", "-1"], "--shutdown-grace"),
        (["--cluster-token-file", "/nonexistent/token"], "--cluster-token-file"),
        (["--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"], "cannot read --tls-cert"),
        (["--kv-events-config", "{"], "--kv-events-config is not JSON"),
        (["--max-prefill-tokens-while-decoding", "-1"], "--max-prefill-tokens-while-decoding"),
        (["--scheduling-policy", "sjf", "--sjf-max-wait", "0"], "--sjf-max-wait"),
        (["--sjf-max-wait", "nan"], "--sjf-max-wait"),
        (["--sjf-step-tokens", "0"], "--sjf-step-tokens"),
        (["--engine-cpus", "a"], "--engine-cpus must be a CPU list"),
        (["--engine-cpus", "3-1"], "--engine-cpus must be a CPU list"),
        (["--engine-cpus", "0,"], "--engine-cpus must be a CPU list"),
        (["--engine-cpus", "4096"], "not available to this process"),
    ],
)
def test_config_rejects_with_typed_error(argv, words):
    with pytest.raises(BadArgumentsError, match=words):
        serve_configs(argv)
