"""`comfy_api.latest` for the headless host: `ComfyExtension`, `io`, and the VIDEO type the Vflash nodes build
(`InputImpl.VideoFromComponents` of `Types.VideoComponents`), which saves through Vflash's own MP4 writer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from . import comfy_io as io


class ComfyExtension:
    async def on_load(self) -> None:
        """Called once before the node list is read."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        raise NotImplementedError


@dataclass
class VideoComponents:
    images: Any  # IMAGE (F, H, W, 3) in [0, 1]
    frame_rate: Fraction
    audio: dict | None = None  # AUDIO {"waveform": (B, C, T), "sample_rate": int}


class VideoFromComponents:
    def __init__(self, components: VideoComponents, bit_depth: int = 8):
        self.components, self.bit_depth = components, bit_depth

    def get_components(self) -> VideoComponents:
        return self.components

    def get_dimensions(self) -> tuple[int, int]:
        return int(self.components.images.shape[2]), int(self.components.images.shape[1])

    def save_to(self, path: str | Path, metadata: dict[str, Any] | None = None) -> None:
        """MP4 (h264 + AAC) written atomically, never over an existing file; whole frame rates with a soundtrack
        only (what `vflash_core.media.mp4.write_mp4` writes; SaveVideo refuses the rest first). Each `metadata`
        entry becomes a container tag holding its value as JSON, as core writes the prompt and the workflow."""
        from vflash_core.media.mp4 import write_mp4

        c = self.components
        assert c.audio is not None, "SaveVideo refuses a VIDEO without a soundtrack before it saves"
        tags = {key: json.dumps(value) for key, value in (metadata or {}).items()}
        write_mp4(path, c.images, c.audio["waveform"][0], int(c.audio["sample_rate"]), int(c.frame_rate), metadata=tags)


class InputImpl:
    VideoFromComponents = VideoFromComponents


class Types:
    VideoComponents = VideoComponents
