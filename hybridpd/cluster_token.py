"""The cluster token's two flags (`--cluster-token`, `--cluster-token-file`), shared by `serve` and `proxy`.

The token is a shared secret: never logged, compared in constant time where it is checked.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_token_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help_text: str) -> None:
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--cluster-token", default=None, help=help_text)
    token.add_argument("--cluster-token-file", type=Path, default=None, help="read the cluster token from a file")


def read_token(args: argparse.Namespace) -> str | None:
    """The token the flags name; raises ValueError (a message for the user) when the file cannot be read."""
    if args.cluster_token_file is None:
        return args.cluster_token
    try:
        return args.cluster_token_file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --cluster-token-file {args.cluster_token_file}: {exc.strerror}") from exc
