"""The native video decode's geometry and assembly (`vae_decode`): which tile-windows a decode of latents of a given
shape has (`DecodeGeometry`, `DecodePlan`), and how decoded tiles are blended into each window's clip and clips
cross-faded into the video (`stitch`, `Timeline`), as diffusers 0.42.1's `decode` lays them out."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import VflashError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLMiniMaxH3

__all__ = ["DecodeGeometry", "DecodePlan", "FrameSink", "TileWindow", "Timeline", "blend", "split_tiles", "stitch"]

#: Receives the decoded frames in order: (index of the first frame, frames (1, 3, f, H, W) on the first device).
FrameSink = Callable[[int, torch.Tensor], None]


# -- geometry ---------------------------------------------------------------------------------------------------------


def split_tiles(length: int, tile: int, min_overlap: int, step: int) -> tuple[list[int], int, list[int]]:
    """Tiles of `tile` px over `length` px: (starts, tile size, overlaps between neighbours), all in pixels.

    The fewest tiles whose overlaps can all be at least `min_overlap`; the slack goes to the overlaps round robin in
    `step` px (one latent), so every boundary stays on the latent grid. A side no longer than a tile is one tile.
    """
    if tile >= length:
        return [0], length, []
    count = math.ceil(length / tile)
    while tile * count - min_overlap * (count - 1) - length < 0:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    slack = tile * count - sum(overlaps) - length
    for i in range(slack // step):
        overlaps[i % (count - 1)] += step
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return starts, tile, overlaps


class TileWindow(NamedTuple):
    """One ViT sequence: tile (`row`, `col`) of temporal window `window`."""

    window: int
    row: int
    col: int


@dataclass(frozen=True)
class DecodePlan:
    """Every tile-window of one decode: where it reads its latents and where its pixels go. Latent units unless named
    in pixels."""

    latent_frames: int  # F of the latents, before the repeated ones
    window_starts: tuple[int, ...]
    window_latents: int  # latent frames per window (all windows have this many)
    row_starts: tuple[int, ...]
    col_starts: tuple[int, ...]
    tile_height: int
    tile_width: int
    height_overlaps: tuple[int, ...]  # pixels, between consecutive tile rows
    width_overlaps: tuple[int, ...]  # pixels, between consecutive tile columns
    output_frames: int
    pixel_height: int
    pixel_width: int

    @property
    def tiles_per_window(self) -> int:
        return len(self.row_starts) * len(self.col_starts)

    def tile_windows(self) -> list[TileWindow]:
        """All tile-windows, window by window, each window's tiles row by row (the reference's order)."""
        grid = [(r, c) for r in range(len(self.row_starts)) for c in range(len(self.col_starts))]
        return [TileWindow(w, r, c) for w in range(len(self.window_starts)) for r, c in grid]

    def window_latent_indices(self, window: int) -> torch.Tensor:
        """Frame indices of `window` into the latents; past the end, the last frame (the reference's repeat padding)."""
        start = self.window_starts[window]
        return torch.arange(start, start + self.window_latents).clamp_(max=self.latent_frames - 1)


@dataclass(frozen=True)
class DecodeGeometry:
    """The VAE's decode geometry: compression ratios, temporal windowing and spatial tiling, as the module has them."""

    spatial_ratio: int
    temporal_ratio: int
    window_stride: int  # `tokens_chunk_size`
    window_overlap: int  # `token_overlap`
    token_drop: int
    clip_length: int
    frame_pre_padding: int
    frame_overlap: int
    tiled: bool
    tile_height: int  # pixels
    tile_width: int
    min_overlap_height: int
    min_overlap_width: int

    @classmethod
    def from_vae(cls, vae: AutoencoderKLMiniMaxH3) -> DecodeGeometry:
        """Read from an `AutoencoderKLMiniMaxH3` (its current tiling settings included)."""
        geometry = cls(
            spatial_ratio=int(vae.spatial_compression_ratio), temporal_ratio=int(vae.temporal_compression_ratio),
            window_stride=int(vae.tokens_chunk_size), window_overlap=int(vae.token_overlap),
            token_drop=int(vae.config.token_drop), clip_length=int(vae.config.clip_length),
            frame_pre_padding=int(vae.frame_pre_padding), frame_overlap=int(vae.frame_overlap),
            tiled=bool(vae.use_tiling), tile_height=int(vae.tile_sample_min_height),
            tile_width=int(vae.tile_sample_min_width), min_overlap_height=int(vae.tile_sample_min_overlap_height),
            min_overlap_width=int(vae.tile_sample_min_overlap_width),
        )
        # With fewer dropped tokens than a chunk, every window ends inside the padded latents, so all have one length.
        if not 0 <= geometry.token_drop < geometry.window_stride:
            raise VflashError(
                f"video VAE geometry not supported: token_drop {geometry.token_drop} "
                f"with chunks of {geometry.window_stride}"
            )
        return geometry

    def clip_parts(self, clip_frames: int) -> tuple[range, range | None]:
        """Frame ranges of a window's clip: its own frames, and (when tokens were dropped) those cross-faded into the
        next window's first frames."""
        frames, chunk, pre = range(clip_frames), self.window_stride * self.temporal_ratio, self.frame_pre_padding
        head = frames[0:chunk][pre:]
        return head, (frames[chunk : 2 * chunk][pre:] if self.token_drop > 0 else None)

    def plan(self, latent_frames: int, latent_height: int, latent_width: int) -> DecodePlan:
        """The tile-windows of latents (1, C, `latent_frames`, `latent_height`, `latent_width`)."""
        stride, ratio = self.window_stride, self.spatial_ratio
        num_tokens = latent_frames + self.token_drop
        pad_tokens = (-num_tokens) % stride
        num_windows = (num_tokens + pad_tokens) // stride - int(self.token_drop > 0)
        if num_windows < 1:
            raise VflashError(f"{latent_frames} latent frames are too few for one decode window of the video VAE")
        window_latents = stride + self.window_overlap
        height, width = latent_height * ratio, latent_width * ratio
        if self.tiled:
            rows, tile_h, h_overlaps = split_tiles(height, self.tile_height, self.min_overlap_height, ratio)
            cols, tile_w, w_overlaps = split_tiles(width, self.tile_width, self.min_overlap_width, ratio)
        else:
            rows, tile_h, h_overlaps, cols, tile_w, w_overlaps = [0], height, [], [0], width, []

        head, tail = self.clip_parts(window_latents * self.temporal_ratio)
        frames = num_windows * len(head) + (len(tail) if tail is not None else 0)
        if pad_tokens > 0:
            # A chunk's last latent frame covers only `clip_length % temporal_ratio` pixel frames, the others cover
            # `temporal_ratio`; the repeated latents' frames are cut.
            intra_tail = self.clip_length % self.temporal_ratio
            frames -= sum(
                intra_tail if intra_tail and (latent_frames + k) % stride == 0 else self.temporal_ratio
                for k in range(pad_tokens)
            )
        return DecodePlan(
            latent_frames=latent_frames, window_starts=tuple(i * stride for i in range(num_windows)),
            window_latents=window_latents, row_starts=tuple(r // ratio for r in rows),
            col_starts=tuple(c // ratio for c in cols), tile_height=tile_h // ratio, tile_width=tile_w // ratio,
            height_overlaps=tuple(h_overlaps), width_overlaps=tuple(w_overlaps), output_frames=frames,
            pixel_height=height, pixel_width=width,
        )



# -- assembly: tiles into clips, clips into the video -----------------------------------------------------------------


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """`b` with its first `extent` entries along `dim` faded in from `a`'s last ones: weights 1 - i/n for `a` and i/n
    for `b` (computed in `b`'s dtype), n = min(extent, both sizes)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    positions = torch.arange(extent, device=b.device, dtype=b.dtype)
    shape = [1] * a.ndim
    shape[dim] = extent
    weight_a = (1 - positions / extent).view(shape)
    weight_b = (positions / extent).view(shape)
    blended = a.narrow(dim, a.shape[dim] - extent, extent) * weight_a + b.narrow(dim, 0, extent) * weight_b
    if extent == b.shape[dim]:
        return blended
    return torch.cat([blended, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def stitch(
    tiles: list[list[torch.Tensor]], height_overlaps: Sequence[int], width_overlaps: Sequence[int]
) -> torch.Tensor:
    """Tiles (1, 3, f, th, tw), row by row, into one (1, 3, f, H, W) clip: each tile blended with the tile above and
    then the tile to its left (both as decoded) over their overlaps (pixels), then cut where the next tile begins."""
    rows = []
    for i, row in enumerate(tiles):
        pieces = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = blend(tiles[i - 1][j], tile, height_overlaps[i - 1], dim=-2)
            if j > 0:
                tile = blend(row[j - 1], tile, width_overlaps[j - 1], dim=-1)
            if i < len(tiles) - 1:
                tile = tile[..., : -height_overlaps[i], :]
            if j < len(row) - 1:
                tile = tile[..., :, : -width_overlaps[j]]
            pieces.append(tile)
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)


class Timeline:
    """Cuts each window's clip into its frames, cross-fades consecutive windows, and hands finished frames to the sink
    in order, cut at the plan's length. Holds one clip's cross-fade frames between windows."""

    def __init__(self, geometry: DecodeGeometry, plan: DecodePlan, sink: FrameSink):
        self.geometry, self.plan, self.sink = geometry, plan, sink
        self.carry: torch.Tensor | None = None  # the previous clip's frames to fade into the next one's first
        self.next_frame = 0

    def add(self, clip: torch.Tensor) -> None:
        """A window's (1, 3, f, H, W) clip, windows in order."""
        head, tail = self.geometry.clip_parts(clip.shape[2])
        frames = clip[:, :, head.start : head.stop]
        if self.carry is not None:
            frames = blend(self.carry, frames, self.geometry.frame_overlap, dim=-3)
        if tail is not None:
            self.carry = clip[:, :, tail.start : tail.stop].clone()  # not a view: the clip itself is released
        self._emit(frames)

    def finish(self) -> None:
        if self.carry is not None:
            self._emit(self.carry)
            self.carry = None
        if self.next_frame < self.plan.output_frames:
            raise AssertionError(f"decoded {self.next_frame} of {self.plan.output_frames} frames")

    def _emit(self, frames: torch.Tensor) -> None:
        keep = min(frames.shape[2], self.plan.output_frames - self.next_frame)
        if keep > 0:
            self.sink(self.next_frame, frames[:, :, :keep])
        self.next_frame += frames.shape[2]


