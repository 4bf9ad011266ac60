"""`hybridpd proxy` flags: counts must match (exit 2 with a clear message), values are validated."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from hybridpd.proxy.config import RoutingPolicy
from hybridpd.proxy.main import add_arguments, config_from_args, run


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--prefiller-hosts", "a", "b", "--prefiller-ports", "1"], "--prefiller-hosts has 2 entries but --prefiller-ports has 1"),
    (["--decoder-hosts", "a", "--decoder-ports", "1", "2"], "--decoder-hosts has 1 entries but --decoder-ports has 2"),
    (["--prefill-timeout", "0"], "--prefill-timeout must be positive"),
    (["--decoder-ports", "70000"], "decode port out of range"),
    (["--cluster-token-file", "/nonexistent/token"], "cannot read --cluster-token-file"),
    (["--tls-key", "/nonexistent/key.pem"], "--tls-cert and --tls-key go together"),
    (["--load-tokens-per-request", "-1"], "--load-tokens-per-request must be >= 0"),
    (["--queued-tokens-weight", "2"], "--queued-tokens-weight must be in [0, 1]"),
    (["--pd-threshold", "-1", "--routing", "cache_aware"], "--pd-threshold must be >= 0"),
    (["--pd-threshold", "64"], "--pd-threshold needs --routing cache_aware"),
])
def test_bad_flags_exit_2_with_a_clear_message(argv, message, capsys):
    assert run(_parse(argv)) == 2
    assert message in capsys.readouterr().err


def test_count_mismatch_exits_2_as_a_process():
    result = subprocess.run(
        [sys.executable, "-m", "hybridpd.proxy", "--prefiller-hosts", "a", "b", "--prefiller-ports", "8100"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "must match" in result.stderr


def test_flags_build_the_config(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")
    config = config_from_args(_parse([
        "--port", "9001", "--prefiller-hosts", "p1", "p2", "--prefiller-ports", "1", "2",
        "--decoder-host", "d1", "--decoder-port", "3", "--routing", "least_outstanding",
        "--decode-timeout", "7", "--cluster-token-file", str(token_file),
    ]))
    assert [u.address for u in config.prefillers] == ["p1:1", "p2:2"]
    assert [u.address for u in config.decoders] == ["d1:3"]
    assert config.routing is RoutingPolicy.LEAST_OUTSTANDING
    assert config.decode_timeout == 7.0
    assert config.cluster_token == "tok-123"
    assert "tok-123" not in repr(config)


@pytest.mark.parametrize("flags, expected", [([], True), (["--no-first-token-from-prefill"], False)])
def test_first_token_from_prefill_is_on_unless_turned_off(flags, expected):
    config = config_from_args(_parse(["--prefiller-host", "p", "--prefiller-port", "1", "--decoder-host", "d",
                                      "--decoder-port", "2", *flags]))
    assert config.first_token_from_prefill is expected
