"""The types and ranges of a request's numbers (`validation.VideoRequest`'s fields, the command line's request flags),
without torch or PIL: `vflash generate`'s parser is built from them before anything heavy imports."""

from __future__ import annotations

from ..errors import Number

__all__ = ["PIXELS", "SECONDS", "SEED"]

#: A request's numbers: a float such as 448.7 is refused as a width, never truncated; the ranges are checked against
#: the model and the profile by `validation.plan_request`, but the seed's is the generator's.
SEED = Number(int, 0, 2**63 - 1)
PIXELS = Number(int, unit="pixels")
SECONDS = Number(float, unit="seconds")
