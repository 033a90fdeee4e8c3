"""The choices of a `NativeEngineSession`'s placement options, without torch: the command line's parsers and the node
pack's menus offer them without importing the engine."""

from __future__ import annotations

__all__ = ["STRATEGIES", "WEIGHT_RESIDENCIES"]

WEIGHT_RESIDENCIES = ("auto", "resident", "block-ring", "disk-ring")  # where the core's blocks live on a GPU
STRATEGIES = ("sequence-head", "tensor")  # how one request is split over several GPUs
