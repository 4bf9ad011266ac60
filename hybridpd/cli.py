"""`hybridpd serve | proxy | up | bench | make-checkpoint | replay`: each command lives in its own module, imported only
when that command runs (so one command's dependencies never break another)."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("hybridpd.server.main", "serve a model on one kv_both node (OpenAI-compatible HTTP)"),
    "proxy": ("hybridpd.proxy.main", "route each request to a prefill node, then a decode node"),
    "up": ("hybridpd.up", "start a local cluster: N prefill + M decode nodes and a proxy"),
    "bench": ("hybridpd.bench.main", "benchmark a server like `vllm bench serve`"),
    "make-checkpoint": ("hybridpd.presets.checkpoints", "write a tiny random checkpoint"),
    "replay": ("hybridpd.replay.cli", "simulate a cluster on a Mooncake trace (real KV cache and routers)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s module is imported, to add that command's flags."""
    parser = argparse.ArgumentParser(prog="hybridpd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(module=module)
        if name == command:
            importlib.import_module(module).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return int(importlib.import_module(args.module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
