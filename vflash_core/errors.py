"""Error types that cross the engine's boundaries.

Every error a user can cause (a bad file, a mismatched profile, a bad request) is a `VflashError`: the CLI prints its
message on one line and exits with its `exit_status` without a traceback (2 for a bad request, option or file; 1 for
a valid request that could not be completed); the HTTP service answers it with a 4xx JSON body. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection


class VflashError(Exception):
    """A user-facing failure with a message that names the offending values."""

    #: The `vflash` command's exit status: 2 for usage and validation errors (the request, an option, an input file).
    exit_status = 2


def check_choice(name: str, value: object, allowed: Collection[str]) -> None:
    """Refuse `value` unless it is one of `allowed`, naming the choices: "<name> must be one of a, b, got 'c'"."""
    if value not in allowed:
        raise VflashError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


class RunFailedError(VflashError):
    """A valid request that could not be completed here: cancelled, not enough device memory, a closed pipeline."""

    exit_status = 1


class WeightFileError(VflashError):
    """A safetensors file is missing, truncated, corrupt, or holds tensors of the wrong name, shape or dtype."""


class IdentityMismatchError(VflashError):
    """Two things that must agree do not: receipt vs files, profile vs artifact, bundle vs model layout."""


class BundleError(VflashError):
    """A conditioning bundle is malformed, tampered with, or already consumed."""


class SessionClosedError(RunFailedError):
    """A closed or failed session was called."""


class RequestError(VflashError):
    """A request is invalid (canvas, duration, mode, inputs) and was rejected before any heavy work ran."""


def one_line(message: str) -> str:
    """A message that lists problems on several lines, as one line: "head: first; second"."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return " ".join(lines[:1] + ["; ".join(lines[1:])] if len(lines) > 1 else lines)


def run_command(run: Callable[[], int | None], error_prefix: str, interrupted: str) -> int:
    """A command line's exit status: a `VflashError` printed on one line after `error_prefix`, Ctrl-C as 130."""
    try:
        return int(run() or 0)
    except VflashError as exc:
        print(f"{error_prefix}{one_line(str(exc))}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
