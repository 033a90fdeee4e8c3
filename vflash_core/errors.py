"""Error types that cross the engine's boundaries.

Every error a user can cause (a bad file, a mismatched profile, a bad request) is a `VflashError`: the CLI prints its
message on one line and exits with its `exit_status` without a traceback (2 for a bad request, option or file; 1 for
a valid request that could not be completed); the HTTP service answers it with a 4xx JSON body. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeGuard

__all__ = [
    "BundleError", "CallbackGuard", "IdentityMismatchError", "Number", "RequestError", "RunFailedError",
    "SessionClosedError", "VflashError", "WeightFileError", "check_callback", "check_choice", "describe_value",
    "is_int", "is_real", "listing", "problem_lines", "run_command",
]


class VflashError(Exception):
    """A user-facing failure with a message that names the offending values."""

    #: The `vflash` command's exit status: 2 for usage and validation errors (the request, an option, an input file).
    exit_status = 2


def check_choice(name: str, value: object, allowed: Collection[str]) -> None:
    """Refuse `value` unless it is one of `allowed`, naming the choices: "<name> must be one of a, b, got 'c'"."""
    if value not in allowed:
        raise VflashError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def check_callback(value: object, what: str) -> None:
    """None or a callable, checked before anything loads or runs (a callback is first called once work started)."""
    if value is not None and not callable(value):
        raise VflashError(f"{what} must be a callable or None, got {describe_value(value)}")


def is_int(value: object) -> TypeGuard[int]:
    """An int, never a bool: Python counts True as 1, a user never means a flag as a count, an index or a size."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float]:
    """An int or a float, never a bool (not checked finite: `Number` and `formats.is_number` are)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class CallbackGuard:
    """Wraps a caller's callbacks for one run so the run can tell what they raised (a cancel, an interrupt, a
    caller's bug: the caller's, re-raised unchanged) from a failure of its own: `raised` holds the latest."""

    def __init__(self) -> None:
        self.raised: BaseException | None = None

    def __call__(self, callback: Callable[..., None] | None) -> Callable[..., None] | None:
        """`callback` (None stays None), remembering what it raises."""
        if callback is None:
            return None

        def call(*args: object) -> None:
            try:
                callback(*args)
            except BaseException as exc:
                self.raised = exc
                raise

        return call


_SHOWN = 40


def describe_value(value: object) -> str:
    """A value's type and (shortened) repr, for messages about a field of the wrong type."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= _SHOWN else text[: _SHOWN - 3] + '...'}"


def _bound(value: float) -> str:
    if isinstance(value, int) or value.is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:g}"


@dataclass(frozen=True)
class Number:
    """What one numeric option accepts, and the one parser of numbers for every front end: the right type (an int
    for `int`, any real for `float`; never a bool, a string or None), finite, from `low` to `high` (`low` itself
    refused when `above`). Bounds keep what a number becomes (bytes, a frame count, a timeout) from overflowing.

    `check` takes a value given in Python or JSON, `parse` the text of a command line, `option` is `parse` as an
    argparse `type` (its `VflashError` reaches the command's one-line error tail, see `run_command`)."""

    kind: type[int | float] = float
    low: float | None = None
    high: float | None = None
    above: bool = False
    unit: str = ""  # what the number counts ("GiB", "seconds"), said in messages

    def describe(self) -> str:
        """What is accepted, e.g. "an integer from 1 to 256", "a number of GiB above 0 and at most 1,048,576"."""
        noun = ("an integer number" if self.unit else "an integer") if self.kind is int else "a number"
        noun += f" of {self.unit}" if self.unit else ""
        low = None if self.low is None else f"{'above' if self.above else 'at least'} {_bound(self.low)}"
        if self.low is not None and self.high is not None and not self.above:
            return f"{noun} from {_bound(self.low)} to {_bound(self.high)}"
        limits = " and ".join(
            text for text in (low, None if self.high is None else f"at most {_bound(self.high)}") if text
        )
        if not limits:
            return noun
        return f"{noun} {limits}" if limits.startswith("above") else f"{noun}{', ' if self.unit else ' of '}{limits}"

    def check(self, name: str, value: object, error: type[VflashError] | None = None) -> int | float:
        """`value` as an int or a float, or `error` (default `VflashError`) "<name> must be <describe()>, got ..."."""
        error = error or VflashError
        wanted = numbers.Integral if self.kind is int else numbers.Real
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise error(f"{name} must be {self.describe()}, got {describe_value(value)}")
        try:
            # typeshed's `numbers.Integral`/`Real` do not declare the `__int__`/`__float__` they have
            number = int(value) if self.kind is int else float(value)  # type: ignore[call-overload]
        except OverflowError:  # an int beyond the float range
            number = math.inf
        if (
            isinstance(number, float) and not math.isfinite(number)
            or (self.low is not None and (number <= self.low if self.above else number < self.low))
            or (self.high is not None and number > self.high)
        ):
            shown = repr(value) if len(repr(value)) <= _SHOWN else repr(value)[: _SHOWN - 3] + "..."
            raise error(f"{name} must be {self.describe()}, got {shown}")
        return number

    def parse(self, name: str, text: str) -> int | float:
        """A number from command-line text ("8", "1e3", " 2 "); text that is no number of this kind is refused."""
        try:
            value = self.kind(text.strip())
        except ValueError:  # not a number; an int() also refuses "1.5" and more digits than Python converts
            shown = text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
            raise VflashError(f"{name} must be {self.describe()}, got {shown!r}") from None
        return self.check(name, value)

    def option(self, name: str) -> Callable[[str], int | float]:
        """`parse` as an argparse `type=`, naming the flag (`name`) in its refusal."""
        return lambda text: self.parse(name, text)


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


def problem_lines(message: str) -> list[str]:
    """The lines a command line prints for a message: itself, or for one that lists problems under a head ("head:",
    then one problem a line), one line per problem, each after the head: "head: first", "head: second"."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return [f"{lines[0]} {line}" for line in lines[1:]] if len(lines) > 1 else lines


def listing(head: str, problems: list[str]) -> str:
    """A message of one or more problems: "head: problem", or the head and one indented problem a line (which
    `problem_lines` prints one problem a line)."""
    return f"{head}: {problems[0]}" if len(problems) == 1 else f"{head}:\n  " + "\n  ".join(problems)


def run_command(run: Callable[[], int | None], error_prefix: str, interrupted: str) -> int:
    """A command line's exit status: a `VflashError` printed on one line after `error_prefix`, Ctrl-C as 130."""
    try:
        return int(run() or 0)
    except VflashError as exc:
        for line in problem_lines(str(exc)):
            print(f"{error_prefix}{line}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
