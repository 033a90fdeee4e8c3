"""Stand-in for `comfy_api.latest` (ComfyUI 0.33.0): `ComfyExtension`, `io`, `ui`, `Input`, `InputImpl`, `Types`."""

from abc import ABC, abstractmethod

from . import _io_public as io
from . import _ui as ui
from ._video import VideoCodec, VideoComponents, VideoContainer, VideoFromComponents


class ComfyExtension(ABC):
    async def on_load(self) -> None:
        """Called when the extension is loaded."""

    @abstractmethod
    async def get_node_list(self) -> list:
        """The node classes this extension provides."""


class InputImpl:
    VideoFromComponents = VideoFromComponents


class Types:
    VideoCodec = VideoCodec
    VideoContainer = VideoContainer
    VideoComponents = VideoComponents


__all__ = ["ComfyExtension", "io", "ui", "InputImpl", "Types"]
