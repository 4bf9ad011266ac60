"""`hybridpd serve | proxy | up | bench | make-checkpoint`: each command lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("hybridpd.server.main", "serve a model on one kv_both node (OpenAI-compatible HTTP)"),
    "proxy": ("hybridpd.proxy.main", "route each request to a prefill node, then a decode node"),
    "up": ("hybridpd.up", "start a local cluster: N prefill + M decode nodes and a proxy"),
    "bench": ("hybridpd.bench.main", "benchmark a server like `vllm bench serve`"),
    "make-checkpoint": ("hybridpd.engine.model.presets", "write a tiny random checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridpd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(command)
        command.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args.module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
