"""Geometry and the packed row layout of one H3 request.

One request is one packed sequence ``[text | conditioning video rows | target audio | target video]`` (t2va, i2va,
l2va, fl2va). Positions are (t, h, w) rotary coordinates built in float64 with numpy's `linspace` arithmetic, exactly
as the reference builds them; the transformer casts them to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import RequestError
from ..memory_plan import PLANNED_TEXT_ROWS
from ..profiles import Profile
from .config import AUDIO_TAG, VIDEO_TAG, H3Config

__all__ = [
    "AUDIO_CHANNELS", "FPS", "MAX_ASPECT_RATIO", "MAX_DURATION_SECONDS", "MIN_ASPECT_RATIO", "MIN_DURATION_SECONDS",
    "VAE_FRAMES_PER_CHUNK", "VAE_LATENTS_PER_CHUNK", "VAE_SPATIAL_RATIO", "Geometry", "PackedLayout", "ReferenceBlock",
    "align_num_frames", "align_num_frames_down", "audio_latent_count", "audio_rows_to_latents", "check_canvas",
    "frames_for_duration", "keyframe_layout", "largest_clip_frames", "largest_request_rows", "patchify",
    "ref2va_layout",
    "request_rows", "resolve_canvas_size", "unpatchify", "video_latent_frames", "video_num_frames",
]

FPS = 24
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2
MIN_DURATION_SECONDS = 5.0
MAX_DURATION_SECONDS = 15.0
VAE_SPATIAL_RATIO = 16
VAE_FRAMES_PER_CHUNK = 17
VAE_LATENTS_PER_CHUNK = 5
MIN_ASPECT_RATIO, MAX_ASPECT_RATIO = 1 / 4, 4.0

# Rotary time: latent frame k spans 5/3 * (1, 4, 4, 4, 4)[k % 5] units (one unit = 1/40 s = one audio latent);
# spatial axes are normalised by the square root of the latent area and scaled by 32.
_FRAME_RESCALE = 5.0 / 3.0
_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
_SPATIAL_SCALE = 32


def align_num_frames(num_frames: int) -> int:
    """Snap a frame count up to the next `17 n + 5` the video VAE encodes."""
    if num_frames < 1:
        raise RequestError(f"num_frames must be positive, got {num_frames}")
    return num_frames + (VAE_LATENTS_PER_CHUNK - num_frames) % VAE_FRAMES_PER_CHUNK


def video_latent_frames(num_frames: int) -> int:
    """Latent frames of an aligned frame count: 17 n + 5 -> 5 n + 2."""
    if num_frames % VAE_FRAMES_PER_CHUNK != VAE_LATENTS_PER_CHUNK:
        raise RequestError(f"num_frames must be {VAE_FRAMES_PER_CHUNK} n + {VAE_LATENTS_PER_CHUNK}, got {num_frames}")
    return (num_frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK * VAE_LATENTS_PER_CHUNK + 2


def video_num_frames(latent_frames: int) -> int:
    """The frames the video VAE decodes from `latent_frames` latent frames, `video_latent_frames`' inverse:
    5 n + 2 -> 17 n + 5."""
    return (latent_frames - 2) // VAE_LATENTS_PER_CHUNK * VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


def align_num_frames_down(num_frames: int) -> int:
    """A frame count snapped down to a `17 n + 5` of at least one chunk (n >= 1; 22 for fewer frames): a clip the
    video VAE encodes without padding."""
    chunks = max(1, (num_frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK)
    return chunks * VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


def audio_latent_count(num_frames: int) -> int:
    """Audio latents per stereo channel covering `num_frames` at 24 fps (40 latents per second)."""
    return round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND)


def frames_for_duration(seconds: float) -> int:
    """The aligned frame count of a requested duration, validated against the 5-15 s range of the model."""
    aligned = align_num_frames(max(1, round(seconds * FPS)))
    if not MIN_DURATION_SECONDS <= aligned / FPS <= MAX_DURATION_SECONDS:
        raise RequestError(
            f"duration {seconds:g} s aligns to {aligned} frames ({aligned / FPS:.3f} s); H3 generates "
            f"{MIN_DURATION_SECONDS:g}-{MAX_DURATION_SECONDS:g} s (124-345 frames of the form 17 n + 5 at {FPS} fps)"
        )
    return aligned


def resolve_canvas_size(
    aspect_width: float, aspect_height: float, multiple: int = 32, short_edge: int = 768, max_pixels: int = 768 * 1344
) -> tuple[int, int]:
    """(height, width) of the canvas for an aspect ratio: short edge first, area capped, both axes rounded."""
    if aspect_width <= 0 or aspect_height <= 0:
        raise RequestError(f"aspect ratio must be positive, got {aspect_width}:{aspect_height}")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT_RATIO <= ratio <= MAX_ASPECT_RATIO:
        raise RequestError(f"aspect ratio {ratio:g} is outside H3's 1:4 .. 4:1")
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def check_canvas(height: int, width: int, multiple: int = 32) -> None:
    if height <= 0 or width <= 0 or height % multiple or width % multiple:
        raise RequestError(f"width and height must be positive multiples of {multiple}, got {width}x{height}")
    ratio = width / height
    if not MIN_ASPECT_RATIO <= ratio <= MAX_ASPECT_RATIO:
        raise RequestError(f"canvas {width}x{height} has aspect ratio {ratio:g}, outside H3's 1:4 .. 4:1")


def patchify(latents: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, F, H, W) latents -> (B * rows, C * pt * ph * pw) rows, frame-major then row-major; feature c*4+dy*2+dx."""
    pt, ph, pw = patch_size
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify(
    rows: torch.Tensor, channels: int, frames: int, height: int, width: int, patch_size: tuple[int, int, int]
) -> torch.Tensor:
    """Inverse of `patchify` for one batch item: rows -> (1, C, F, H, W)."""
    pt, ph, pw = patch_size
    x = rows.reshape(-1, frames // pt, height // ph, width // pw, channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(-1, channels, frames, height, width).contiguous()


def audio_rows_to_latents(rows: torch.Tensor, num_audio_latents: int) -> torch.Tensor:
    """Channel-major (2A, C) rows -> (2, C, A), one batch item per stereo channel."""
    return rows.reshape(AUDIO_CHANNELS, num_audio_latents, rows.shape[-1]).permute(0, 2, 1).contiguous()


def spatial_grid(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """One rotary spatial axis: `dim // patch` fp64 coordinates, numpy `linspace(endpoint=False)` arithmetic."""
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return torch.from_numpy(np.linspace(left, left + ratio, dim // patch, endpoint=False) * _SPATIAL_SCALE)


def _frame_spans(num_latent_frames: int) -> list[float]:
    """Rotary time each latent frame spans: 5/3 * (1, 4, 4, 4, 4)[k % 5]."""
    return [_FRAME_RESCALE * _FRAMES_PER_LATENT[k % len(_FRAMES_PER_LATENT)] for k in range(num_latent_frames)]


def temporal_grid(num_latent_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of every latent frame from `origin`, spans 5/3 * (1, 4, 4, 4, 4) summed sequentially (fp64)."""
    spans = torch.tensor(_frame_spans(num_latent_frames), dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def frame_grid(latent_height: int, latent_width: int, patch_h: int, patch_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) coordinates of one latent frame's rows (rows_per_frame, 2), and the width axis they came from."""
    sqrt_area = np.sqrt(latent_height * latent_width)
    hs = spatial_grid(latent_height, patch_h, sqrt_area)
    ws = spatial_grid(latent_width, patch_w, sqrt_area)
    grids = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], dim=-1), ws


def _last_keyframe_time(num_text: int, num_latent_frames: int) -> float:
    # numpy's pairwise sum of the spans, as the reference computes this anchor (differs from a sequential sum in the
    # last ulp from 16 latent frames on).
    return float(num_text) + float(np.array(_frame_spans(num_latent_frames), dtype=np.float64).sum()) - _FRAME_RESCALE


@dataclass(frozen=True)
class Geometry:
    """Canvas and clip length of one request, with the latent sizes they imply."""

    height: int
    width: int
    num_frames: int  # aligned to 17 n + 5

    @property
    def num_latent_frames(self) -> int:
        return video_latent_frames(self.num_frames)

    @property
    def latent_height(self) -> int:
        return self.height // VAE_SPATIAL_RATIO

    @property
    def latent_width(self) -> int:
        return self.width // VAE_SPATIAL_RATIO

    @property
    def num_audio_latents(self) -> int:
        return audio_latent_count(self.num_frames)

    def rows_per_frame(self, patch_size: tuple[int, int, int]) -> int:
        return (self.latent_height // patch_size[1]) * (self.latent_width // patch_size[2])

    @classmethod
    def of_latents(cls, video: torch.Tensor, audio: torch.Tensor) -> Geometry:
        """The geometry a (video (1, C, T, h, w), audio (2, C_a, A)) latent pair encodes; RequestError when the
        shapes are not an H3 request's or do not agree."""
        if video.ndim != 5 or video.shape[0] != 1:
            raise RequestError(f"an H3 video latent is (1, C, T, H/16, W/16), got {list(video.shape)}")
        if audio.ndim != 3 or audio.shape[0] != AUDIO_CHANNELS:
            raise RequestError(
                f"an H3 audio latent is ({AUDIO_CHANNELS}, C, A) in Vflash layout, got {list(audio.shape)}"
            )
        latent_frames = int(video.shape[2])
        if latent_frames < 2 or (latent_frames - 2) % VAE_LATENTS_PER_CHUNK:
            raise RequestError(f"an H3 video latent has 5 n + 2 latent frames, got {latent_frames}")
        num_frames = video_num_frames(latent_frames)
        geometry = cls(int(video.shape[3]) * VAE_SPATIAL_RATIO, int(video.shape[4]) * VAE_SPATIAL_RATIO, num_frames)
        if int(audio.shape[2]) != geometry.num_audio_latents:
            raise RequestError(
                f"the audio latent has {int(audio.shape[2])} frames; {num_frames} video frames at {FPS} fps need "
                f"{geometry.num_audio_latents}"
            )
        return geometry


def request_rows(config: H3Config, geometry: Geometry, text_rows: int) -> int:
    """Packed rows of a t2va request: text, both audio channels' latents, every latent frame's patches."""
    return (
        text_rows + 2 * audio_latent_count(geometry.num_frames)
        + geometry.num_latent_frames * geometry.rows_per_frame(config.patch_size)
    )


def largest_clip_frames(profile: Profile) -> int:
    """The longest clip a profile accepts, in frames of the form 17 n + 5."""
    return align_num_frames_down(int(profile.max_seconds * FPS + 1e-6))


def largest_request_rows(profile: Profile, config: H3Config, canvas: tuple[int, int] | None = None) -> int:
    """Packed rows of the profile's longest clip on a (height, width) canvas, by default the released model's 16:9 one
    (`resolve_canvas_size`'s defaults are its rules), with the memory plan's planned text rows."""
    height, width = resolve_canvas_size(16, 9) if canvas is None else canvas
    return request_rows(config, Geometry(height, width, largest_clip_frames(profile)), PLANNED_TEXT_ROWS)


@dataclass(frozen=True)
class PackedLayout:
    """Structural description of one packed sequence of S rows (shared by every evaluation of a request)."""

    position_ids: torch.Tensor  # (S, 3) float64 (t, h, w)
    token_tags: torch.Tensor  # (S,) int64: 0 video, 1 text, 2 audio
    video_indices: torch.Tensor  # (Nv,) int64, conditioning rows first
    audio_indices: torch.Tensor  # (Na,) int64, reference rows first
    text_indices: torch.Tensor  # (L,) int64
    num_condition_video_rows: int
    num_condition_audio_rows: int

    @property
    def sequence_length(self) -> int:
        return int(self.position_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "position_ids": self.position_ids,
            "token_tags": self.token_tags,
            "video_indices": self.video_indices,
            "audio_indices": self.audio_indices,
            "text_indices": self.text_indices,
        }


def keyframe_layout(
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    patch_size: tuple[int, int, int],
    keyframe_anchors: tuple[str, ...] = (),
) -> PackedLayout:
    """`[text | keyframe conditioning | target audio | target video]` for t2va (no anchors) and i2va/l2va/fl2va.

    `keyframe_anchors` has one entry per conditioning frame in packed order, `"first"` or `"last"`.
    """
    _, ph, pw = patch_size
    rows_per_frame = geometry.rows_per_frame(patch_size)
    num_text = int(text_token_tags.shape[0])
    num_cond = len(keyframe_anchors) * rows_per_frame
    num_audio_latents = geometry.num_audio_latents
    num_audio_rows = AUDIO_CHANNELS * num_audio_latents
    num_frames = geometry.num_latent_frames
    cond_start = num_text
    audio_start = cond_start + num_cond
    video_start = audio_start + num_audio_rows
    seq = video_start + num_frames * rows_per_frame

    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:num_text, 0] = torch.arange(num_text, dtype=torch.float64)
    grid, width_axis = frame_grid(geometry.latent_height, geometry.latent_width, ph, pw)
    for k, anchor in enumerate(keyframe_anchors):
        if anchor == "first":
            time = float(num_text)
        elif anchor == "last":
            time = _last_keyframe_time(num_text, num_frames)
        else:
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
        rows = slice(cond_start + k * rows_per_frame, cond_start + (k + 1) * rows_per_frame)
        pos[rows, 0] = time
        pos[rows, 1:] = grid
    _audio_positions(pos, audio_start, num_audio_latents, float(num_text), width_axis)
    _video_positions(pos, video_start, num_frames, float(num_text), grid)
    video_indices = torch.cat([torch.arange(cond_start, audio_start), torch.arange(video_start, seq)])
    return _tagged(pos, text_token_tags, video_indices, torch.arange(audio_start, video_start), num_cond, 0)


def _tagged(
    pos: torch.Tensor, text_token_tags: torch.Tensor, video_indices: torch.Tensor, audio_indices: torch.Tensor,
    num_cond_video: int, num_cond_audio: int
) -> PackedLayout:
    """The layout of positions `pos` with every row tagged: the text rows first, then the audio and video rows."""
    text_indices = torch.arange(int(text_token_tags.shape[0]))
    tags = torch.empty(pos.shape[0], dtype=torch.long)
    tags[text_indices] = text_token_tags.to(torch.long)
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return PackedLayout(pos, tags, video_indices, audio_indices, text_indices, num_cond_video, num_cond_audio)


REFERENCE_KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class ReferenceBlock:
    """Geometry of one ref2va reference block, in request order.

    Visual references carry their latent video shape (an image is one latent frame); `audio_latents` counts the
    latents per stereo channel of a standalone audio reference or of a video's soundtrack (0: no soundtrack).
    """

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    def video_rows(self, patch_size: tuple[int, int, int]) -> int:
        return self.latent_frames * (self.latent_height // patch_size[1]) * (self.latent_width // patch_size[2])


def _audio_positions(pos: torch.Tensor, start: int, num_latents: int, time: float, width_axis: torch.Tensor) -> None:
    """Channel-major audio rows from `start`: time `time + k`, no height, pinned to the width axis's two extremes."""
    stop = start + AUDIO_CHANNELS * num_latents
    pos[start:stop, 0] = (time + torch.arange(num_latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    pos[start:stop, 2] = torch.cat(
        [
            torch.full((num_latents,), float(width_axis[0]), dtype=torch.float64),
            torch.full((num_latents,), float(width_axis[-1]), dtype=torch.float64)
        ]
    )


def _video_positions(pos: torch.Tensor, start: int, num_frames: int, time: float, grid: torch.Tensor) -> None:
    """`num_frames` latent frames of `grid` rows from `start`, on the temporal grid from `time`."""
    stop = start + num_frames * grid.shape[0]
    pos[start:stop, 0] = temporal_grid(num_frames, time).repeat_interleave(grid.shape[0])
    pos[start:stop, 1:] = grid.repeat(num_frames, 1)


def ref2va_layout(
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    patch_size: tuple[int, int, int],
    references: tuple[ReferenceBlock, ...],
) -> PackedLayout:
    """`[text | reference blocks in request order | target audio | target video]` of a ref2va request.

    A shared rotary clock starts at the text length and advances per reference: an image takes one unit at its own
    grid; an audio clip takes its latent count, on the target's width extremes; a video puts its soundtrack (if any)
    right before its frames, both from the same origin with the video's own grid, and advances by the longer of the
    two spans (the frame span summed sequentially in fp64, unlike the pairwise sum of the last keyframe anchor).
    The target audio and video then both start at the final clock.
    """
    _, ph, pw = patch_size
    num_text = int(text_token_tags.shape[0])
    num_ref_video = sum(r.video_rows(patch_size) for r in references)
    num_ref_audio = sum(AUDIO_CHANNELS * r.audio_latents for r in references)
    num_audio_rows = AUDIO_CHANNELS * geometry.num_audio_latents
    target_grid, target_width = frame_grid(geometry.latent_height, geometry.latent_width, ph, pw)
    seq = num_text + num_ref_video + num_ref_audio + num_audio_rows + geometry.num_latent_frames * target_grid.shape[0]

    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:num_text, 0] = torch.arange(num_text, dtype=torch.float64)
    video_indices: list[torch.Tensor] = []
    audio_indices: list[torch.Tensor] = []
    cursor, clock = num_text, float(num_text)

    def add_audio(num_latents: int, width_axis: torch.Tensor) -> None:
        nonlocal cursor
        _audio_positions(pos, cursor, num_latents, clock, width_axis)
        audio_indices.append(torch.arange(cursor, cursor + AUDIO_CHANNELS * num_latents))
        cursor += AUDIO_CHANNELS * num_latents

    for ref in references:
        if ref.kind not in REFERENCE_KINDS:
            raise ValueError(f"reference kind must be one of {REFERENCE_KINDS}, got {ref.kind!r}")
        if ref.kind == "audio":
            add_audio(ref.audio_latents, target_width)
            clock += float(ref.audio_latents)
            continue
        grid, width_axis = frame_grid(ref.latent_height, ref.latent_width, ph, pw)
        rows = ref.video_rows(patch_size)
        if ref.kind == "image":
            pos[cursor : cursor + rows, 0] = clock
            pos[cursor : cursor + rows, 1:] = grid.repeat(ref.latent_frames, 1)
            advance = 1.0  # an image takes one integer slot, not a latent frame's 5/3 units
        else:
            if ref.audio_latents:
                add_audio(ref.audio_latents, width_axis)
            _video_positions(pos, cursor, ref.latent_frames, clock, grid)
            span = 0.0
            for frame_span in _frame_spans(ref.latent_frames):  # sequentially (Python 3.12's sum() compensates)
                span += frame_span
            advance = max(float(ref.audio_latents), span)
        video_indices.append(torch.arange(cursor, cursor + rows))
        cursor += rows
        clock += advance

    audio_start, video_start = cursor, cursor + num_audio_rows
    _audio_positions(pos, audio_start, geometry.num_audio_latents, clock, target_width)
    _video_positions(pos, video_start, geometry.num_latent_frames, clock, target_grid)
    video_idx = torch.cat([*video_indices, torch.arange(video_start, seq)])
    audio_idx = torch.cat([*audio_indices, torch.arange(audio_start, video_start)])
    return _tagged(pos, text_token_tags, video_idx, audio_idx, num_ref_video, num_ref_audio)
