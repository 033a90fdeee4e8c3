"""Video references without torchvision: `QwenVideoProcessor` is Qwen3-VL's video preprocessing in plain torch, and
a ref2va request with a video reference runs end to end on the CPU suite's torch (which has no torchvision)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mp4_probe import probe_mp4
from transformers.utils import is_torchvision_available

from vflash_core.media.mp4 import write_mp4
from vflash_core.media.qwen_video import QwenVideoProcessor
from vflash_core.pipeline.h3_pipeline import H3Pipeline, VideoRequest

OFFICIAL = {  # Qwen3-VL-32B's `processor/video_preprocessor_config.json` (the keys it sets)
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
}


def _processor(tmp_path, config: dict) -> QwenVideoProcessor:
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(config))
    return QwenVideoProcessor.from_pretrained(tmp_path)


def _frames(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_patch_rows_are_normalised_pixels_in_merge_window_order(tmp_path):
    """A 3-frame 64x96 clip (no resize: both sides are multiples of 32): the last frame fills the second temporal
    patch, and each row holds one 16x16 patch of two frames, channel-major, rows ordered by 2x2 merge window."""
    processor = _processor(tmp_path, OFFICIAL)
    video = _frames(0, (3, 64, 96, 3))
    out = processor([video])
    assert out["video_grid_thw"].tolist() == [[2, 4, 6]]
    rows = out["pixel_values_videos"]
    assert rows.shape == (2 * 4 * 6, 3 * 2 * 16 * 16) and rows.dtype == torch.float32
    padded = np.concatenate([video, video[-1:]]).astype(np.float32)
    row = 0
    for t in range(2):
        for window_y in range(2):
            for window_x in range(3):
                for y in range(2):
                    for x in range(2):
                        top, left = (window_y * 2 + y) * 16, (window_x * 2 + x) * 16
                        block = padded[2 * t:2 * t + 2, top:top + 16, left:left + 16]  # (2, 16, 16, 3)
                        want = (block.transpose(3, 0, 1, 2).reshape(-1) - 127.5) / 127.5
                        np.testing.assert_allclose(rows[row].numpy(), want, rtol=0, atol=1e-6)
                        row += 1


def test_frames_are_resized_to_the_patch_grid_within_the_pixel_bounds(tmp_path):
    processor = _processor(tmp_path, OFFICIAL)
    # 50x70 rounds to 64x64 per frame; 4 frames of 64x64 are above the 4096 shortest_edge bound, so no upscale.
    out = processor([_frames(1, (4, 50, 70, 3)), _frames(2, (2, 64, 64, 3))])
    assert out["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    assert out["pixel_values_videos"].shape == (2 * 16 + 16, 3 * 2 * 256)
    small = _processor(tmp_path, {**OFFICIAL, "size": {"longest_edge": 2 * 32 * 32, "shortest_edge": 32 * 32}})
    assert small([_frames(3, (2, 128, 128, 3))])["video_grid_thw"].tolist() == [[1, 2, 2]]


@pytest.mark.skipif(not is_torchvision_available(), reason="needs torchvision")
@pytest.mark.parametrize("cap", [False, True])
def test_equals_transformers_qwen3vl_video_processor(tmp_path, cap):
    """Where torchvision imports (a GPU machine, or ComfyUI's venv), the same bytes as transformers' own processor."""
    from transformers import AutoVideoProcessor

    size = {"longest_edge": 16 * 32 * 32 * 4, "shortest_edge": 4096}
    config = {**OFFICIAL, "size": size, "cap_pixels_per_frame": cap}
    mine = _processor(tmp_path, config)
    theirs = AutoVideoProcessor.from_pretrained(tmp_path)
    videos = [_frames(4, (5, 90, 160, 3)), _frames(5, (4, 200, 120, 3)), _frames(6, (2, 40, 40, 3))]
    want = theirs(videos=videos, do_sample_frames=False, return_tensors="pt")
    got = mine(videos)
    assert torch.equal(got["video_grid_thw"], want["video_grid_thw"])
    assert torch.equal(got["pixel_values_videos"], want["pixel_values_videos"])


def test_ref2va_with_a_video_reference_generates_on_the_cpu(h3_prepared_ref, tmp_path):
    """A clip with its own soundtrack and a picture: the request runs to an MP4 (it used to stop at "video references
    need torchvision")."""
    from PIL import Image

    clip = write_mp4(tmp_path / "clip.mp4", torch.rand(30, 64, 96, 3, generator=torch.Generator().manual_seed(0)),
                     torch.zeros(2, 40000), 32000)
    Image.new("RGB", (96, 64), (200, 40, 40)).save(tmp_path / "picture.png")
    request = VideoRequest(
        "<Picture 1> waves at <Video 1> with <Audio 1>", references=(str(clip), str(tmp_path / "picture.png")),
        duration_seconds=5.0, seed=3, width=96, height=64,
    )
    with H3Pipeline.from_prepared(h3_prepared_ref) as pipeline:
        pipeline.validate(request)
        pipeline.generate(request, tmp_path / "out.mp4")
    info = probe_mp4(tmp_path / "out.mp4")
    assert (info["width"], info["height"]) == (96, 64)
