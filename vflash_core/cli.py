"""The `vflash` command line.

Each subcommand lives in the module that owns its work and exposes `register(subparsers)`, which adds the parser
and sets `handler`; heavy imports happen inside the handler, so `vflash --help` is instant. A user mistake (any
`VflashError`) prints one line and exits with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import VflashError

# Modules that register subcommands, in help order.
COMMAND_MODULES = (
    "vflash_core.cli_denoise", "vflash_core.cli_workflow", "vflash_core.cli_generate", "vflash_core.cli_serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vflash", description="Vflash: fast exact MiniMax-H3 inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return int(args.handler(args) or 0)
    except VflashError as exc:
        print(f"vflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
