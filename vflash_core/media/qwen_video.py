"""Qwen3-VL's video preprocessing in plain torch, equal bit for bit to transformers' `Qwen3VLVideoProcessor`.

transformers' video processors are torchvision "fast" processors: they cannot even be constructed without torchvision,
and PyPI's torchvision does not import beside the CPU-only torch wheels. What Qwen3-VL's processor does to frames that
are already sampled (`do_sample_frames=False`, how the conditioner calls it) is small: one bicubic antialiased resize
per video to a multiple of `patch_size * merge_size` (`smart_resize`), a fused rescale and normalise, and the
patchify into rows of `channels * temporal_patch_size * patch_size**2`. On the CPU torchvision resizes uint8 frames
with torch's own uint8 bicubic kernel, so this calls that same kernel and gets the same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import VflashError

__all__ = ["QwenVideoProcessor"]

_BICUBIC = 3  # PIL's resampling number, as `video_preprocessor_config.json` stores it
# transformers' `Qwen3VLVideoProcessor` class defaults, for keys a config leaves out.
_DEFAULTS = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True,
    "do_normalize": True, "resample": _BICUBIC, "cap_pixels_per_frame": False, "max_video_tokens": 768,
}


@dataclass(frozen=True)
class QwenVideoProcessor:
    """The `processor/` folder's video preprocessor settings and what Qwen3-VL does with them (module docstring)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> QwenVideoProcessor:
        """Read `video_preprocessor_config.json` of an official `processor/` folder."""
        path = Path(folder) / "video_preprocessor_config.json"
        try:
            config = {**_DEFAULTS, **json.loads(path.read_text())}
        except (OSError, json.JSONDecodeError) as exc:
            raise VflashError(f"cannot read Qwen3-VL's video preprocessor config {path}: {exc}") from exc
        if config["resample"] != _BICUBIC:
            raise VflashError(f"{path}: resample {config['resample']} is not supported (Qwen3-VL resizes bicubic, 3)")
        size = config["size"]
        return cls(
            min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
            patch_size=int(config["patch_size"]), temporal_patch_size=int(config["temporal_patch_size"]),
            merge_size=int(config["merge_size"]), image_mean=tuple(config["image_mean"]),
            image_std=tuple(config["image_std"]), rescale_factor=float(config["rescale_factor"]),
            do_resize=bool(config["do_resize"]), do_rescale=bool(config["do_rescale"]),
            do_normalize=bool(config["do_normalize"]),
            # transformers treats an unset cap as off (and warns that this default will change).
            cap_pixels_per_frame=bool(config["cap_pixels_per_frame"]),
            max_video_tokens=int(config["max_video_tokens"]),
        )

    def __call__(self, videos: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """Sampled RGB frame stacks, (T, H, W, 3) uint8 each -> `pixel_values_videos` (all videos' patch rows, one
        after another) and `video_grid_thw` (one (t, h, w) patch grid per video), as Qwen3-VL's processor returns."""
        rows, grids = [], []
        for video in videos:
            if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
                raise VflashError(
                    f"a reference video's frames must be (T, H, W, 3) uint8, got {video.shape} {video.dtype}"
                )
            frames = torch.from_numpy(video).permute(0, 3, 1, 2).contiguous()
            if self.do_resize:
                frames = self._resize(frames)
            patches, grid = self._patchify(self._rescale_and_normalize(frames))
            rows.append(patches)
            grids.append(grid)
        return {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids)}

    def _resize(self, frames: torch.Tensor) -> torch.Tensor:
        num_frames, _, height, width = frames.shape
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        size = _smart_resize(num_frames, height, width, self.temporal_patch_size, factor, self.min_pixels, max_pixels)
        if size == (height, width):
            return frames
        # torchvision's CPU path for uint8 bicubic: torch's native uint8 kernel, no float round trip.
        return torch.nn.functional.interpolate(
            frames, size=list(size), mode="bicubic", align_corners=False, antialias=True
        )

    def _rescale_and_normalize(self, frames: torch.Tensor) -> torch.Tensor:
        if self.do_rescale and self.do_normalize:
            # transformers fuses the two by scaling mean and std; the same arithmetic gives the same bits.
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
            return frames.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        if self.do_normalize:
            mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
            return frames.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        if self.do_rescale:
            return frames * self.rescale_factor
        return frames

    def _patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(T, C, H, W) -> (grid_t * grid_h * grid_w, C * temporal * patch**2) rows in Qwen's merge-window order; the
        last frame is repeated to fill the final temporal patch."""
        if pad := -frames.shape[0] % self.temporal_patch_size:
            frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
        num_frames, channels, height, width = frames.shape
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
        patches = frames.view(
            grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch), [grid_t, grid_h, grid_w]


def _smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's target frame size: each side a multiple of `factor`, the clip's pixels within the bounds."""
    if num_frames < temporal_factor:
        raise VflashError(f"a reference video of {num_frames} sampled frames is shorter than Qwen's {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VflashError(f"a reference video's aspect ratio must be below 200, got {width}x{height}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
