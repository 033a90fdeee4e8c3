"""The `vflash` command line.

Each subcommand lives in the module that owns its work, which lists its commands' names and one-line help in `COMMANDS`
and exposes `register(subparsers)`, which adds their full parsers and sets `handler`. A command module imports nothing
heavy at its top: its options' definitions are imported inside `register`, and only the module of the command on the
command line registers, so `vflash --help` (the names and help the others list) and an unknown command never import
torch; a command's options take their names and ranges from modules that import no torch either (`pipeline.options`,
`engine.session_options`, ...), so neither does its --help nor a refused option. Installed packages add subcommands
through the `vflash.commands` entry points, so this package names none of them. A user error (any `VflashError`) prints
one line (one a problem, for a message that lists several), without a traceback, and exits with its `exit_status` (2 for
a bad request, option or file, 1 for a valid request that could not be completed); anything else is a bug and keeps its
traceback.
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
    "vflash_core.cli.denoise", "vflash_core.cli.generate", "vflash_core.cli.compare", "vflash_core.cli.serve",
    "vflash_core.cli.fleet",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's full parser, or, given `command` (the word a command line names),
    that command's module's, with the other commands listed by name and help only."""
    parser = argparse.ArgumentParser(prog="vflash", description="Vflash: fast exact MiniMax-H3 inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [importlib.import_module(name) for name in COMMAND_MODULES]
    modules += [entry.load() for entry in importlib.metadata.entry_points(group="vflash.commands")]
    for module in modules:
        if command is None or command in module.COMMANDS:
            module.register(sub)
        else:
            for name, text in module.COMMANDS.items():
                sub.add_parser(name, help=text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The command is the first word that is not an option: the top-level options (-v, -h) take no value.
    parser = build_parser(next((arg for arg in argv if not arg.startswith("-")), ""))

    def run() -> int | None:
        args = parser.parse_args(argv)  # inside: a refused number (`errors.Number.option`) is a one-line error too
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
        return args.handler(args)

    return run_command(run, "vflash: error: ", "vflash: interrupted")


if __name__ == "__main__":
    sys.exit(main())
