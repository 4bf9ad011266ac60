"""`hybridpd serve [MODEL_DIR] ...`: run one kv_both node until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from hybridpd.engine.model.presets import default_model_dir
from hybridpd.server.args import BadArgumentsError, add_arguments, configs_from_args
from hybridpd.server.node import Node

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        configs = configs_from_args(args, default_model_dir)
    except BadArgumentsError as exc:
        print(f"hybridpd serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(Node(configs).run())
    except (ValueError, FileNotFoundError) as exc:  # a checkpoint or cache configuration that cannot work
        print(f"hybridpd serve: error: {exc}", file=sys.stderr)
        return 2
