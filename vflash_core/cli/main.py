"""The `vflash` command line.

Each subcommand lives in the module that owns its work and exposes `register(subparsers)`, which adds the parser
and sets `handler`; heavy imports happen inside the handler, so `vflash --help` is instant. Installed packages add
subcommands through the `vflash.commands` entry points, so this package names none of them. A user error (any
`VflashError`) prints one line, without a traceback, and exits with its `exit_status` (2 for a bad request, option or
file, 1 for a valid request that could not be completed); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

from ..errors import run_command

__all__ = ["build_parser", "main"]

# Modules that register subcommands, in help order.
COMMAND_MODULES = (
    "vflash_core.cli.denoise", "vflash_core.cli.generate", "vflash_core.cli.compare", "vflash_core.cli.serve"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vflash", description="Vflash: fast exact MiniMax-H3 inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for entry in importlib.metadata.entry_points(group="vflash.commands"):
        entry.load().register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()

    def run() -> int | None:
        args = parser.parse_args(argv)  # inside: a refused number (`errors.Number.option`) is a one-line error too
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
        return args.handler(args)

    return run_command(run, "vflash: error: ", "vflash: interrupted")


if __name__ == "__main__":
    sys.exit(main())
