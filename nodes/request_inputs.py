"""A Vflash encode node's request widgets as the pipeline's values: the canvas and the frame count its width, height,
length and seconds give, the connected slots of its Autogrow reference inputs, and the whole of what an all-in-one
node (Generate, Compare) renders."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vflash_core.engine.layout import FPS, Geometry, align_num_frames, frames_for_duration
from vflash_core.errors import RequestError

if TYPE_CHECKING:
    import torch

    from .engines import TransformerSpec

__all__ = ["ENCODE_DEFAULTS", "RenderInputs", "RequestWidgets", "connected_slots", "request_geometry"]

#: The canvas and length widgets of VflashEncode / VflashGenerate and their defaults, in `request_geometry`'s order.
ENCODE_DEFAULTS = {"width": 1344, "height": 768, "length": 124, "seconds": 0.0}


@dataclass(frozen=True)
class RequestWidgets:
    """The request widgets VflashGenerate and VflashCompare share: the prompt, the canvas and length (as
    `request_geometry` reads them) and the optional keyframes, IMAGE batches (1, H, W, 3)."""

    prompt: str
    width: int
    height: int
    length: int
    seconds: float
    first_frame: torch.Tensor | None = None
    last_frame: torch.Tensor | None = None


@dataclass(frozen=True)
class RenderInputs:
    """What VflashGenerate and VflashCompare render, travelling whole from the node to its action: the transformer,
    the text encoder and VAEs (Vflash's specs or core's, as `actions.encode` takes them), the request widgets and the
    seed."""

    model: TransformerSpec
    te: Any
    vae: Any
    request: RequestWidgets
    seed: int
    audio_vae: Any = None


def request_geometry(width: int, height: int, length: int, seconds: float) -> Geometry:
    """Canvas and snapped frame count of the widget values (seconds > 0 overrides length); the canvas is checked
    against the model's canvas rules with the rest of the request (`validation.plan_inputs`)."""
    if seconds and not math.isfinite(float(seconds) * FPS):  # before the frame count becomes an integer
        raise RequestError(f"seconds must be a finite number of seconds, got {seconds}")
    if seconds and seconds > 0:
        frames = frames_for_duration(float(seconds))
    else:
        if length < 1:
            raise RequestError(f"length must be at least 1 frame, got {length}")
        frames = align_num_frames(int(length))
    return Geometry(int(height), int(width), frames)


def connected_slots(group: Mapping[str, Any] | None) -> dict[int, Any]:
    """Autogrow values (`ref_image_0`, `ref_image_1`, ...) by slot index, in index order, unconnected slots skipped."""
    items = sorted((int(name.rsplit("_", 1)[-1]), value) for name, value in (group or {}).items() if value is not None)
    return dict(items)
