"""`hybridpd serve [MODEL_DIR] ...`: run one kv_both node until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from hybridpd.presets.checkpoints import default_model_dir
from hybridpd.server.args import BadArgumentsError, add_arguments, configs_from_args
from hybridpd.server.config import LOOPBACK
from hybridpd.server.node import EngineStartError, Node

__all__ = ["add_arguments", "run"]

UCX_DEVICES_VAR = "UCX_NET_DEVICES"
LOOPBACK_DEVICE = "lo"


def confine_transport(host: str) -> None:
    """A node told to listen on loopback keeps the transport there too: UCX otherwise opens a TCP listener on
    every network device. Set before the transport starts; an explicit UCX_NET_DEVICES is left as it is."""
    if host in LOOPBACK:
        os.environ.setdefault(UCX_DEVICES_VAR, LOOPBACK_DEVICE)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        configs = configs_from_args(args, default_model_dir)
        confine_transport(configs.kv_transfer.kv_host)  # before the engine process starts: it inherits it
        return asyncio.run(Node(configs).run())
    except (BadArgumentsError, ValueError, FileNotFoundError) as exc:  # flags, checkpoint or cache that cannot work
        print(f"hybridpd serve: error: {exc}", file=sys.stderr)
        return 2
    except EngineStartError as exc:
        print(f"hybridpd serve: error: the engine process could not start: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the HTTP port taken, the address not ours
        print(f"hybridpd serve: error: {exc}", file=sys.stderr)
        return 1
