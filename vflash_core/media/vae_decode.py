"""Native decode of the H3 video VAE (`AutoencoderKLMiniMaxH3.decode`), bit for bit, many tile-windows per call.

What the decode computes (diffusers 0.42.1's `decode`; its windows, tiles, blends and roundings are reproduced here):

* Latents (1, C, F, h, w) are cast to `post_quant_conv`'s dtype and extended at the end by repeating the last frame,
  so that temporal windows of `tokens_chunk_size + token_overlap` latent frames (7 for H3), one every
  `tokens_chunk_size` frames (5), cover them exactly.
* Each window is cut into spatial tiles laid out in pixels: `tile_sample_min_height` x `tile_sample_min_width` (256 px),
  the fewest that cover the frame with overlaps of at least `tile_sample_min_overlap_*` (64 px), the slack spread over
  the overlaps in whole latent steps; a side no longer than a tile is one tile. So every tile-window of a decode has
  the same shape.
* Each tile-window goes through `post_quant_conv` and the ViT decoder: one token per latent voxel, then the register
  tokens and one zero token; pre-norm blocks whose residual stream is fp32 (the norms and `scale1`/`scale2` are kept
  in fp32, the projections run in the compute dtype), q/k RMSNorm in fp32 and rotary over the leading channels of each
  head; LayerNorm, `proj_out` and unpatchify to (3, 4 T, 16 th, 16 tw) pixels.
* Tiles are blended linearly into the window's clip (each tile with its upper, then its left neighbour, both as
  decoded). The clip gives `tokens_chunk_size * temporal_compression_ratio - frame_pre_padding` frames (17),
  cross-faded over `frame_overlap` frames (5) with the frames after the next chunk boundary of the previous clip; the
  last clip's own such frames end the video, less the frames that the repeated latents produced.

What this module changes is only how the work is issued:

* `windows_per_call` tile-windows run as one ViT call: their token rows stacked, so every linear layer is one GEMM over
  all of them, and attention one call with the tile-windows as its batch dimension. Row blocks of a GEMM do not
  interact, so this is the per-tile-window result wherever the GEMM computes a row the same way whatever the row count
  (MKL and oneDNN on the CPU do for these shapes, tested; on an H200, cuBLAS does for bf16 weights, tested, but not for
  fp32 ones, whose results moved by up to 3e-6, so with fp32 weights on a GPU the default is one tile-window per call:
  `windows_per_call=1` issues exactly the reference's shapes). Elementwise work and the norms are per element or per
  row; attention is per batch item and head.
* A call's feed-forward projection (`ff_in`, the widest tensor) is made one tile-window at a time, at the reference's
  own GEMM shape, and each sublayer's intermediates are released before the next sublayer runs, so a call's working
  memory is its fp32 stream plus one sublayer's tensors (`block`).
* `execution="fused"` (the default on CUDA) runs the norms, the q/k norm + rotary, SwiGLU and the scaled residuals in
  Triton kernels (`FusedDecoderOps`), each reproducing the roundings of the torch ops it replaces, the norms summing
  squares in the order of torch's CUDA RMSNorm; "reference" (the default elsewhere) runs them as torch ops
  (`DecoderOps`).
* A window is stitched, cross-faded and handed to the sink as soon as its last tile is decoded, so device memory is
  bounded by the calls in flight, one window's tiles and clip, and the cross-fade frames, whatever the clip length.
* With several devices (each with its own copy of the decoder weights), the calls are split into contiguous parts, one
  per device, run concurrently: the first device's part on the calling thread, every other part on a host thread of
  its own driving its own stream. A call's shape is the one it has on one device, so each device computes the tiles
  one device would. Every tile comes back to the first device, which stitches and blends everything in the
  one-device order: its own part first, then each other part's tiles, which wait in host memory meanwhile (so device
  memory stays bounded on every device, whatever the clip length).

Where each part lives: the tiles' geometry and their assembly into clips and the video in `vae_tiles`, the ViT decoder
and its ops in `vae_vit`, the parts on other devices in `vae_decode_devices`; this module drives them.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..engine.attention import resolve_attention
from ..engine.device_owner import HostCopy, copy_to_host
from ..errors import VflashError
from .vae_decode_devices import PeerPart, split_calls
from .vae_tiles import DecodeGeometry, DecodePlan, FrameSink, TileWindow, Timeline, stitch
from .vae_vit import DecoderOps, DecoderWeights, FusedDecoderOps, decode_tile_windows, resolve_decoder_execution, rotary

if TYPE_CHECKING:
    from diffusers import AutoencoderKLMiniMaxH3

__all__ = ["CALLS_IN_FLIGHT_PER_DEVICE", "DEFAULT_WINDOWS_PER_CALL", "FrameLanding", "NativeVideoDecoder"]

#: Tile-windows per ViT call unless the caller says otherwise (a 1344x768 window has 28 tiles).
DEFAULT_WINDOWS_PER_CALL = 8
#: Attention as diffusers' native backend calls it: `F.scaled_dot_product_attention` under the process's kernel pick.
DEFAULT_ATTENTION = "torch-sdpa"
#: ViT calls queued per device before the oldest one's tiles are collected.
CALLS_IN_FLIGHT_PER_DEVICE = 2


#: Parts a `FrameLanding` keeps in flight in pinned memory before it waits for the oldest one's copy.
LANDING_PARTS_IN_FLIGHT = 1


class FrameLanding:
    """A frame sink that writes each part into `output` at its frames (along `frame_dim`) without holding up the
    device: a part on CUDA bound for host memory is copied into pinned memory behind the work that made it, without
    waiting, and moved into `output` once `LANDING_PARTS_IN_FLIGHT` later parts are queued, or at `finish()`. (A
    blocking copy into pageable memory stalls the decode's launches until the device has drained: 14 % of a 1344x768
    decode's device time went to such copies.) Any other part is copied at once. The bytes are the parts' own."""

    def __init__(self, output: torch.Tensor, frame_dim: int):
        self.output, self.frame_dim = output, frame_dim
        self.in_flight: deque[tuple[int, HostCopy]] = deque()

    def __call__(self, start: int, frames: torch.Tensor) -> None:
        if frames.device.type != "cuda" or self.output.device.type != "cpu":
            self._place(start, frames)
            return
        self.in_flight.append((start, copy_to_host(frames)))
        while len(self.in_flight) > LANDING_PARTS_IN_FLIGHT:
            self._land()

    def finish(self) -> None:
        """Every part in `output`."""
        while self.in_flight:
            self._land()

    def _land(self) -> None:
        start, copy = self.in_flight.popleft()
        self._place(start, copy.wait())

    def _place(self, start: int, frames: torch.Tensor) -> None:
        self.output.narrow(self.frame_dim, start, frames.shape[self.frame_dim]).copy_(frames)


# -- the driver --------------------------------------------------------------------------------------------------------


class NativeVideoDecoder:
    """`AutoencoderKLMiniMaxH3.decode` bit for bit: `windows_per_call` tile-windows per ViT call (default
    `DEFAULT_WINDOWS_PER_CALL`, one for fp32 weights on a GPU), the calls split in contiguous parts over the devices of
    `weights` and run concurrently (the first one stitches and blends), frames handed out window by window.
    `execution`: "auto" (the default: "fused" on CUDA, "reference" elsewhere), "reference" (torch ops, `DecoderOps`)
    or "fused" (Triton kernels, `FusedDecoderOps`, same bits; CUDA only outside Triton's interpreter)."""

    def __init__(
        self, geometry: DecodeGeometry, weights: Sequence[DecoderWeights], attention: str = DEFAULT_ATTENTION,
        windows_per_call: int | None = None, execution: str = "auto",
    ):
        if not weights:
            raise VflashError("the native video decode needs the decoder's weights on at least one device, got none")
        execution = resolve_decoder_execution(execution, weights[0].device)
        if windows_per_call is None:  # stacked calls keep diffusers' bits except for fp32 GEMMs on a GPU (module doc)
            fp32_on_gpu = weights[0].proj_in.dtype == torch.float32 and weights[0].proj_in.is_cuda
            windows_per_call = 1 if fp32_on_gpu else DEFAULT_WINDOWS_PER_CALL
        if windows_per_call < 1:
            raise VflashError(f"windows_per_call must be at least 1, got {windows_per_call}")
        self.geometry = geometry
        self.weights = list(weights)
        resolved = [resolve_attention(attention, w.device) for w in self.weights]
        self.attention_backend = resolved[0][0]
        self.execution = execution
        self.ops = [
            FusedDecoderOps(fn, w.device) if execution == "fused" else DecoderOps(fn)
            for w, (_, fn) in zip(self.weights, resolved)
        ]
        self.windows_per_call = windows_per_call

    @classmethod
    def from_vae(
        cls, vae: AutoencoderKLMiniMaxH3, devices: Sequence[str | torch.device] = (),
        attention: str = DEFAULT_ATTENTION, windows_per_call: int | None = None, execution: str = "auto",
    ) -> NativeVideoDecoder:
        """Decode with `vae`'s own tensors on its device, or on each of `devices` (the first one stitches): the
        module's tensors where it is, a replica of them on every other device."""
        own = DecoderWeights.from_vae(vae)
        weights = [own.to(devices[0]), *(own.to(device, copy=True) for device in devices[1:])] if devices else [own]
        return cls(DecodeGeometry.from_vae(vae), weights, attention, windows_per_call, execution)

    def plan(self, latent_shape: Sequence[int]) -> DecodePlan:
        """The plan for latents of shape (1, C, F, h, w)."""
        if len(latent_shape) != 5 or latent_shape[0] != 1:
            raise VflashError(f"the native video decode takes latents (1, C, F, h, w), got {list(latent_shape)}")
        return self.geometry.plan(*latent_shape[2:])

    @torch.no_grad()
    def decode(
        self, z: torch.Tensor, sink: FrameSink | None = None, output_device: str | torch.device = "cpu",
        between_blocks: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """(1, C, F, h, w) denormalised latents, on any device -> (1, 3, F', 16 h, 16 w) pixels in ImageNet space, in
        `proj_out`'s dtype, on `output_device`; or None, the frames having gone to `sink` window by window.

        `between_blocks()` (a cancel check; it may raise, which stops every device after its current call) runs on the
        calling thread only: before each block of the first device's calls, and before each call's tiles are
        collected, so also while the other devices' parts are awaited."""
        plan = self.plan(z.shape)
        output, landing = None, None
        if sink is None:
            shape = (1, 3, plan.output_frames, plan.pixel_height, plan.pixel_width)
            output = torch.empty(shape, dtype=self.weights[0].output_dtype, device=output_device)
            sink = landing = FrameLanding(output, frame_dim=2)

        timeline = Timeline(self.geometry, plan, sink)
        # The tile-windows of each ViT call, in order, `windows_per_call` at a time (the last call may have fewer).
        items, per_call = plan.tile_windows(), self.windows_per_call
        parts = split_calls(
            [items[first : first + per_call] for first in range(0, len(items), per_call)], len(self.weights)
        )
        grid: dict[TileWindow, torch.Tensor] = {}
        peers = [
            PeerPart(self.weights[index].device, index, z, functools.partial(self._calls, index, plan=plan, calls=part))
            for index, part in enumerate(parts[1:], start=1)
        ]
        try:
            # The one-device order: the first device's own part, then each peer's part as it is staged.
            in_order = itertools.chain(
                self._calls(0, z, plan, parts[0], between_blocks), *(peer.results() for peer in peers)
            )
            for batch, pixels in in_order:
                if between_blocks is not None:
                    between_blocks()
                self._collect(batch, pixels, plan, grid, timeline)
        finally:
            for peer in peers:
                peer.stop()
        timeline.finish()
        if landing is not None:
            landing.finish()
        return output

    def _calls(
        self, index: int, z: torch.Tensor, plan: DecodePlan, calls: list[list[TileWindow]],
        between_blocks: Callable[[], None] | None = None,
    ) -> Iterator[tuple[list[TileWindow], torch.Tensor]]:
        """`calls` on device `index`, in order, each as (tile-windows, pixels there); up to `CALLS_IN_FLIGHT_PER_DEVICE`
        further calls are launched before a call's pixels are handed on."""
        w = self.weights[index]
        rope = rotary(w, plan.window_latents, plan.tile_height, plan.tile_width, w.compute_dtype)
        in_flight: deque[tuple[list[TileWindow], torch.Tensor]] = deque()
        for batch in calls:
            in_flight.append((batch, self._decode_call(index, z, plan, batch, rope, between_blocks)))
            if len(in_flight) > CALLS_IN_FLIGHT_PER_DEVICE:
                yield in_flight.popleft()
        yield from in_flight

    def _decode_call(
        self, index: int, z: torch.Tensor, plan: DecodePlan, batch: list[TileWindow],
        rope: tuple[torch.Tensor, torch.Tensor],
        between_blocks: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One ViT call on device `index`: (len(batch), 3, pt T, p th, p tw) pixels there."""
        w = self.weights[index]
        windows: dict[int, torch.Tensor] = {}
        tiles = []
        for item in batch:
            if item.window not in windows:
                window = z[:, :, plan.window_latent_indices(item.window).to(z.device)]
                windows[item.window] = window.to(w.device).to(w.post_quant_conv.dtype)
            y, x = plan.row_starts[item.row], plan.col_starts[item.col]
            tile = windows[item.window][..., y : y + plan.tile_height, x : x + plan.tile_width]
            # `post_quant_conv` tile by tile, at the reference's shape (a 1x1x1 convolution, negligible beside the ViT).
            tiles.append(F.conv3d(tile, w.post_quant_conv, w.post_quant_conv_bias))
        return decode_tile_windows(w, torch.cat(tiles), rope, self.ops[index], between_blocks)

    def _collect(
        self, batch: list[TileWindow], pixels: torch.Tensor, plan: DecodePlan, grid: dict[TileWindow, torch.Tensor],
        timeline: Timeline
    ) -> None:
        """File a call's tiles on the first device; stitch and hand on each window whose last tile this was."""
        pixels = pixels.to(self.weights[0].device)
        for i, item in enumerate(batch):
            grid[item] = pixels[i : i + 1]
            if len(grid) == plan.tiles_per_window:
                rows = [
                    [grid.pop(TileWindow(item.window, r, c)) for c in range(len(plan.col_starts))]
                    for r in range(len(plan.row_starts))
                ]
                timeline.add(stitch(rows, plan.height_overlaps, plan.width_overlaps))
