"""docs/flags.md names every flag of every command, so the page a newcomer reads cannot drift from `--help`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybridpd.bench.cli_args import add_benchmark_arguments as bench_arguments
from hybridpd.proxy.main import add_arguments as proxy_arguments
from hybridpd.replay.cli import add_arguments as replay_arguments
from hybridpd.server.args import add_arguments as serve_arguments
from hybridpd.up import add_arguments as up_arguments

FLAGS_PAGE = (Path(__file__).resolve().parents[2] / "docs" / "flags.md").read_text()


def flags_of(add) -> list[str]:
    parser = argparse.ArgumentParser()
    add(parser)
    return sorted({option for action in parser._actions for option in action.option_strings
                   if option.startswith("--") and option != "--help"})


@pytest.mark.parametrize("command, add", [("serve", serve_arguments), ("proxy", proxy_arguments),
                                          ("up", up_arguments), ("bench", bench_arguments),
                                          ("replay", replay_arguments)])
def test_every_flag_is_named_in_docs_flags(command, add):
    missing = [flag for flag in flags_of(add) if flag not in FLAGS_PAGE
               and flag.replace("--no-", "--") not in FLAGS_PAGE]
    assert not missing, f"hybridpd {command}: {missing} are not in docs/flags.md"
