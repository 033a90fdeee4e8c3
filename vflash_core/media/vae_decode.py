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
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from .._imports import vflash_kernels
from ..engine.attention import resolve_attention
from ..engine.device_owner import HostCopy, copy_to_host
from ..engine.model import AttentionFn, apply_rotary
from ..errors import VflashError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLMiniMaxH3
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoTransformerBlock

__all__ = [
    "CALLS_IN_FLIGHT_PER_DEVICE", "DECODER_EXECUTIONS", "DEFAULT_WINDOWS_PER_CALL", "DecodeGeometry", "DecoderOps",
    "DecoderWeights", "FrameLanding", "FusedDecoderOps", "NativeVideoDecoder", "TileWindow", "decode_tile_windows",
    "resolve_decoder_execution", "split_calls", "split_tiles",
]

#: Receives the decoded frames in order: (index of the first frame, frames (1, 3, f, H, W) on the first device).
FrameSink = Callable[[int, torch.Tensor], None]

#: Tile-windows per ViT call unless the caller says otherwise (a 1344x768 window has 28 tiles).
DEFAULT_WINDOWS_PER_CALL = 8
#: Attention as diffusers' native backend calls it: `F.scaled_dot_product_attention` under the process's kernel pick.
DEFAULT_ATTENTION = "torch-sdpa"
#: ViT calls queued per device before the oldest one's tiles are collected.
CALLS_IN_FLIGHT_PER_DEVICE = 2


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


# -- weights ----------------------------------------------------------------------------------------------------------


def _moved(value: Any, device: torch.device, copy: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=copy)
    if isinstance(value, tuple):
        return tuple(_moved(v, device, copy) for v in value)
    if isinstance(value, (BlockWeights, DecoderWeights)):
        return type(value)(**{f.name: _moved(getattr(value, f.name), device, copy) for f in fields(value)})
    return value


@dataclass(frozen=True)
class BlockWeights:
    """One ViT block's tensors: the norms' weights and the scales in fp32, the projections in the compute dtype.
    Linear weights are (out, in)."""

    norm1: torch.Tensor | None
    to_q: torch.Tensor
    to_q_bias: torch.Tensor | None
    to_k: torch.Tensor
    to_k_bias: torch.Tensor | None
    to_v: torch.Tensor
    to_v_bias: torch.Tensor | None
    to_out: torch.Tensor
    to_out_bias: torch.Tensor | None
    scale1: torch.Tensor
    norm2: torch.Tensor | None
    ff_in: torch.Tensor  # (2 I, D): [value; gate]
    ff_in_bias: torch.Tensor | None
    ff_out: torch.Tensor  # (D, I)
    ff_out_bias: torch.Tensor | None
    scale2: torch.Tensor

    @classmethod
    def from_module(cls, block: MiniMaxH3VideoTransformerBlock) -> BlockWeights:
        attn, ff = block.attn, block.ff.net
        return cls(
            norm1=block.norm1.weight, to_q=attn.to_q.weight, to_q_bias=attn.to_q.bias, to_k=attn.to_k.weight,
            to_k_bias=attn.to_k.bias, to_v=attn.to_v.weight, to_v_bias=attn.to_v.bias, to_out=attn.to_out[0].weight,
            to_out_bias=attn.to_out[0].bias, scale1=block.scale1, norm2=block.norm2.weight, ff_in=ff[0].proj.weight,
            ff_in_bias=ff[0].proj.bias, ff_out=ff[2].weight, ff_out_bias=ff[2].bias, scale2=block.scale2,
        )


@dataclass(frozen=True)
class DecoderWeights:
    """`post_quant_conv` and the ViT decoder of one `AutoencoderKLMiniMaxH3`: the module's own tensors (`from_vae`
    copies nothing) or their copy on another device (`to`)."""

    post_quant_conv: torch.Tensor  # (C, C, 1, 1, 1)
    post_quant_conv_bias: torch.Tensor | None
    proj_in: torch.Tensor  # (D, C)
    proj_in_bias: torch.Tensor | None
    register_tokens: torch.Tensor  # (1, R, D)
    inv_freq: torch.Tensor  # (rotary channels / 6,) fp32
    blocks: tuple[BlockWeights, ...]
    norm_out: torch.Tensor | None  # LayerNorm, fp32
    norm_out_bias: torch.Tensor | None
    proj_out: torch.Tensor  # (3 * pt * p * p, D)
    proj_out_bias: torch.Tensor | None
    heads: int
    norm_eps: float | None  # norm1 / norm2
    qk_norm_eps: float | None
    norm_out_eps: float
    patch_size: int
    patch_size_t: int
    out_channels: int

    @classmethod
    def from_vae(cls, vae: AutoencoderKLMiniMaxH3) -> DecoderWeights:
        """The tensors `vae` holds now (read them again after the module moves: offloading re-points its parameters)."""
        for name, module in vae.named_modules():
            if hasattr(module, "_diffusers_hook") or hasattr(module, "_hf_hook"):
                raise VflashError(
                    "the native video decode reads the VAE's weights directly; "
                    f"{name or 'the VAE'} has a forward hook (layerwise casting or offload)"
                )
        dec = vae.decoder
        block = dec.transformer_blocks[0]
        return cls(
            post_quant_conv=vae.post_quant_conv.weight, post_quant_conv_bias=vae.post_quant_conv.bias,
            proj_in=dec.proj_in.weight, proj_in_bias=dec.proj_in.bias, register_tokens=dec.register_tokens,
            inv_freq=dec.rope.inv_freq, blocks=tuple(BlockWeights.from_module(b) for b in dec.transformer_blocks),
            norm_out=dec.norm_out.weight, norm_out_bias=dec.norm_out.bias, proj_out=dec.proj_out.weight,
            proj_out_bias=dec.proj_out.bias, heads=int(block.attn.heads), norm_eps=block.norm1.eps,
            qk_norm_eps=block.attn.norm_q.eps, norm_out_eps=float(dec.norm_out.eps), patch_size=int(dec.patch_size),
            patch_size_t=int(dec.patch_size_t), out_channels=int(dec.out_channels),
        )

    def to(self, device: str | torch.device, copy: bool = False) -> DecoderWeights:
        """A copy on `device`: the same tensors where they are there already, unless `copy` (a replica for another
        decoding device, which may be this one's device: two CPU "devices" in the tests)."""
        return _moved(self, torch.device(device), copy)

    @property
    def device(self) -> torch.device:
        return self.proj_in.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The projections' dtype, which the normalised activations are cast to."""
        return self.blocks[0].to_q.dtype

    @property
    def output_dtype(self) -> torch.dtype:
        """The pixels' dtype (`proj_out`'s)."""
        return self.proj_out.dtype


# -- the ViT decoder over stacked tile-windows ------------------------------------------------------------------------


class DecoderOps:
    """The decoder's norms, attention, SwiGLU and scaled residuals as torch ops, in the reference's order and
    roundings; the rest of a block is GEMMs (`block`). Tensors are (W, S, ...) for W stacked tile-windows of S
    tokens."""

    def __init__(self, attend: AttentionFn):
        self.attend_fn = attend

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, dtype: torch.dtype) -> torch.Tensor:
        """RMSNorm of the (W, S, D) stream in fp32, rounded to `dtype`."""
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(dtype)

    def head_norm_rope(self, x: torch.Tensor, eps: float | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(W, S, heads, Dh) q or k: unweighted RMSNorm per head in fp32, rounded back, then rotary (rotate-half) over
        the leading `cos.shape[-1]` channels; cos/sin (1, S, 1, R) in x's dtype."""
        return apply_rotary(self.norm(x, None, eps, x.dtype), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(W, S, heads, Dh) each -> (W, S, heads * Dh): each tile-window attends over its own S tokens."""
        return self.attend_fn(q, k, v).flatten(2, 3)

    def swiglu(self, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """(S, 2 I) `ff_in` output [value | gate] -> value * silu(gate) written into `out` (S, I) of p's dtype."""
        value, gate = p.chunk(2, dim=-1)
        return torch.mul(value, F.silu(gate), out=out)

    def scaled_residual(self, h: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(W, S, D) stream plus the (W, S, D) sublayer output times the fp32 (D,) scale: the product rounds in fp32,
        then the sum (fp32). The result may be written into `h` (the fused ops do, when h is fp32)."""
        return h + y * scale


#: Whether `FusedDecoderOps` normalises the stream with `vflash_kernels.vae_decoder.rms_norm_cast` (torch's CUDA
#: reduction order for fp32 rows) instead of `F.rms_norm`. Equal bit for bit on an H200 (torch 2.11, bf16 and fp32 at
#: the released width: `pytest -m gpu tests/test_vae_decode_fused.py`); re-check after a torch upgrade or on another
#: GPU, and turn this off where that test finds a difference. The fused ops are the default on CUDA
#: (`decoder_execution="auto"`): 1.54x the reference ops' decode at 1344x768 on an H200 (`benchmarks/vae.py`).
FUSED_DECODER_NORM = True
#: Likewise for the per-head q/k norm fused with rotary (`head_rms_norm_rope`) instead of `F.rms_norm` + rotary.
FUSED_DECODER_QK_NORM = True


def _decoder_kernels() -> SimpleNamespace:
    """`vflash_kernels.vae_decoder` and `vflash_kernels.swiglu` (imported on first use: the core runs without
    triton)."""
    package = vflash_kernels().__name__
    return SimpleNamespace(
        vae_decoder=importlib.import_module(f"{package}.vae_decoder"),
        swiglu=importlib.import_module(f"{package}.swiglu"),
    )


class FusedDecoderOps(DecoderOps):
    """`DecoderOps` with the norms, the q/k norm + rotary, SwiGLU and the scaled residuals in Triton kernels, each
    reproducing the roundings of the torch ops it replaces (`kernels/vae_decoder.py`, `kernels/swiglu.py`); the
    scaled residuals update an fp32 stream in place. CUDA only, or Triton's interpreter on the CPU."""

    def __init__(self, attend: AttentionFn, device: torch.device):
        super().__init__(attend)
        kernels = _decoder_kernels()
        if device.type != "cuda" and not kernels.vae_decoder._launch.INTERPRET:
            raise VflashError(
                f"decoder_execution='fused' runs Triton kernels on CUDA, not on {device}; use 'reference' there "
                "(or set TRITON_INTERPRET=1 before importing vflash_kernels to run them in Triton's interpreter)"
            )
        self._kernels = kernels.vae_decoder
        self._swiglu = kernels.swiglu.swiglu
        # (cos, sin, count) of the last call and its repeated tables; holding the tables keeps the identity test sound
        self._angles: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, dtype: torch.dtype) -> torch.Tensor:
        if not FUSED_DECODER_NORM:
            return super().norm(x, weight, eps, dtype)
        return self._kernels.rms_norm_cast(x, weight, eps, dtype)

    def head_norm_rope(self, x: torch.Tensor, eps: float | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not FUSED_DECODER_QK_NORM:
            return super().head_norm_rope(x, eps, cos, sin)
        cos_rows, sin_rows = self._window_angles(cos, sin, x.shape[0])
        return self._kernels.head_rms_norm_rope(x, eps, cos_rows, sin_rows)

    def _window_angles(self, cos: torch.Tensor, sin: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (1, S, 1, R) tables repeated for `count` stacked tile-windows: (count S, R), made once per call shape
        (every block of a call reads the same ones)."""
        last = self._angles
        if last is None or last[0] is not cos or last[1] is not sin or last[2] != count:
            last = self._angles = cos, sin, count, cos[0, :, 0].repeat(count, 1), sin[0, :, 0].repeat(count, 1)
        return last[3], last[4]

    def swiglu(self, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._swiglu(p, out=out)

    def scaled_residual(self, h: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        inplace = h.dtype == torch.promote_types(h.dtype, torch.promote_types(y.dtype, scale.dtype))
        return self._kernels.scaled_residual(h, y, scale, inplace=inplace)


#: How the decoder's elementwise and norm work runs: "fused" (Triton kernels, `FusedDecoderOps`) on CUDA and
#: "reference" (torch ops, `DecoderOps`) elsewhere for "auto", or either one by name. Both give the same bits.
DECODER_EXECUTIONS = ("auto", "reference", "fused")


def resolve_decoder_execution(execution: str, device: torch.device) -> str:
    """`execution` for a decoder on `device`: "auto" is "fused" on CUDA (where Triton runs), else "reference"."""
    if execution not in DECODER_EXECUTIONS:
        raise VflashError(f"unknown decoder_execution {execution!r}; choose one of {', '.join(DECODER_EXECUTIONS)}")
    if execution == "auto":
        return "fused" if device.type == "cuda" else "reference"
    return execution


def rotary(
    w: DecoderWeights, frames: int, height: int, width: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (1, S, 1, R) in `dtype` for a (frames, height, width) tile-window: each axis' coordinates normalised to
    [-1, 1) at voxel centres, times 2 pi inv_freq, [t | h | w] angles duplicated; register and zero tokens at 0.

    Computed once per shape on the device, exactly as the reference computes them per tile (batch 1, fp32)."""
    device = w.device
    grids = [
        2.0 * (torch.arange(0.5, size, dtype=torch.float32, device=device) / size) - 1.0
        for size in (frames, height, width)
    ]
    positions = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2).unsqueeze(0)
    positions = torch.cat([positions, positions.new_zeros((1, w.register_tokens.shape[1] + 1, 3))], dim=1)
    angles = 2.0 * math.pi * positions[:, :, :, None] * w.inv_freq[None, None, None, :]
    angles = angles.flatten(2, 3).tile(2).unsqueeze(2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def block(
    b: BlockWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], w: DecoderWeights, ops: DecoderOps
) -> torch.Tensor:
    """(W, S, D) stream -> the next one, fp32 (the first block's input is in `proj_in`'s dtype): attention, then the
    SwiGLU feed-forward (`ff_in` gives [value | gate]; value * silu(gate) in the compute dtype), each on the normalised
    stream and added as `h + y * scale` with the fp32 scale (the product rounds in fp32, then the sum).

    Each sublayer's intermediates are gone before the next one's are made (`attention`, `feed_forward_input`), so a
    call's working memory is the stream plus the larger sublayer's tensors, not both sublayers' together."""
    h = ops.scaled_residual(h, F.linear(attention(b, h, rope, w, ops), b.to_out, b.to_out_bias), b.scale1)
    return ops.scaled_residual(h, F.linear(feed_forward_input(b, h, w, ops), b.ff_out, b.ff_out_bias), b.scale2)


def attention(
    b: BlockWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], w: DecoderWeights, ops: DecoderOps
) -> torch.Tensor:
    """The attention sublayer's (W, S, D) output before `to_out`, in the compute dtype. q and k are normalised and
    rotated as each is projected, so at most one of them exists unnormalised."""
    x = ops.norm(h, b.norm1, w.norm_eps, w.compute_dtype)
    q = ops.head_norm_rope(F.linear(x, b.to_q, b.to_q_bias).unflatten(2, (w.heads, -1)), w.qk_norm_eps, *rope)
    k = ops.head_norm_rope(F.linear(x, b.to_k, b.to_k_bias).unflatten(2, (w.heads, -1)), w.qk_norm_eps, *rope)
    v = F.linear(x, b.to_v, b.to_v_bias).unflatten(2, (w.heads, -1))
    del x
    return ops.attend(q, k, v)


def feed_forward_input(b: BlockWeights, h: torch.Tensor, w: DecoderWeights, ops: DecoderOps) -> torch.Tensor:
    """`ff_out`'s (W, S, I) input: value * silu(gate) of `ff_in` over the normalised stream, in the compute dtype.

    `ff_in`'s output (2 I wide, 8 D in the released VAE: a call's largest tensor, twice the SwiGLU's) is made one
    tile-window at a time,
    at the reference's own GEMM shape, and each window's SwiGLU is written into its rows of the result."""
    out = torch.empty((*h.shape[:-1], b.ff_in.shape[0] // 2), dtype=w.compute_dtype, device=h.device)
    for window in range(h.shape[0]):
        p = F.linear(ops.norm(h[window], b.norm2, w.norm_eps, w.compute_dtype), b.ff_in, b.ff_in_bias)
        ops.swiglu(p, out[window])
        del p  # before the next window's projection is made
    return out


def decode_tile_windows(
    w: DecoderWeights, latents: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ops: DecoderOps,
    between_blocks: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The ViT decoder over W stacked tile-windows: (W, C, T, th, tw) `post_quant_conv` outputs -> (W, 3, pt T, p th,
    p tw) pixels in `proj_out`'s dtype. `rope` is `rotary(w, T, th, tw, compute dtype)`. `between_blocks()` runs on the
    host before each block (a cancel check; it may raise). Without it, a pure function of fixed shapes (a CUDA graph
    can capture it per W)."""
    count, channels, frames, height, width = latents.shape
    # (W, S, D) tokens, S = T th tw + R + 1: `proj_in` per voxel (rows t, y, x), the R register tokens, one zero token.
    h = F.linear(latents.permute(0, 2, 3, 4, 1).reshape(count, -1, channels), w.proj_in, w.proj_in_bias)
    h = torch.cat([h, w.register_tokens.expand(count, -1, -1).to(h.dtype), torch.zeros_like(h[:, :1, :])], dim=1)
    for b in w.blocks:
        if between_blocks is not None:
            between_blocks()
        h = block(b, h, rope, w, ops)
    # LayerNorm in fp32, `proj_out`, the register and zero tokens dropped, each token's (3, pt, p, p) block in place.
    h = F.layer_norm(h, (h.shape[-1],), w.norm_out, w.norm_out_bias, w.norm_out_eps).to(w.output_dtype)
    h = F.linear(h, w.proj_out, w.proj_out_bias)[:, : frames * height * width, :]
    p, pt = w.patch_size, w.patch_size_t
    h = h.view(count, frames, height, width, w.out_channels, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7).contiguous()
    return h.reshape(count, w.out_channels, frames * pt, height * p, width * p)


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


# -- the driver -------------------------------------------------------------------------------------------------------


def split_calls(calls: list[list[TileWindow]], parts: int) -> list[list[list[TileWindow]]]:
    """`calls` in `parts` contiguous runs as even as possible, the later runs the longer: the first device, which also
    stitches and blends every window, gets the shorter share."""
    base, extra = divmod(len(calls), parts)
    sizes = [base + (i >= parts - extra) for i in range(parts)]
    bounds = [sum(sizes[:i]) for i in range(parts + 1)]
    return [calls[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """The device made current for a thread's launches, and a stream of its own for them on CUDA."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stream = torch.cuda.Stream(device)
    # The replica of the weights and the latents were copied in on the device's current stream: this one starts after.
    stream.wait_stream(torch.cuda.current_stream(device))
    stack.enter_context(torch.cuda.stream(stream))
    stack.callback(stream.synchronize)  # nothing of the thread's may still run once its tensors are released
    return stack


class StagedCall(NamedTuple):
    """A call decoded on another device, its pixels on their way to the host."""

    batch: list[TileWindow]
    pixels: HostCopy


class PeerPart:
    """One contiguous part of the calls decoded on a device other than the first, on a host thread of its own; each
    call's tiles are staged in host memory until the first device takes them (`results`), in order."""

    def __init__(
        self, decoder: NativeVideoDecoder, index: int, z: torch.Tensor, plan: DecodePlan, calls: list[list[TileWindow]]
    ):
        self.outbox: queue.SimpleQueue[StagedCall | BaseException | None] = queue.SimpleQueue()
        self.stopping = threading.Event()
        # The part's own copy of the latents, made before the first device's work is queued: reading them on their
        # device from the thread would queue each read behind that work.
        latents = z.to(decoder.weights[index].device, copy=True)
        self.thread = threading.Thread(
            target=self._run, args=(decoder, index, latents, plan, calls), name=f"vae-decode-device-{index}",
            daemon=True
        )
        self.thread.start()

    def _run(
        self, decoder: NativeVideoDecoder, index: int, latents: torch.Tensor, plan: DecodePlan,
        calls: list[list[TileWindow]]
    ) -> None:
        try:
            with torch.no_grad(), _device_context(decoder.weights[index].device):
                for batch, pixels in decoder._calls(index, latents, plan, calls):
                    if self.stopping.is_set():
                        break
                    self.outbox.put(StagedCall(batch, copy_to_host(pixels)))
            self.outbox.put(None)
        except BaseException as error:  # noqa: BLE001 - handed to the first device's thread, which raises it
            self.outbox.put(error)

    def results(self) -> Iterator[tuple[list[TileWindow], torch.Tensor]]:
        """The part's calls in order, (tile-windows, pixels on the host), as they are staged."""
        while (item := self.outbox.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item.batch, item.pixels.wait()

    def stop(self) -> None:
        """Let the thread finish (after its current call) and wait for it."""
        self.stopping.set()
        self.thread.join()


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
        peers = [PeerPart(self, index, z, plan, part) for index, part in enumerate(parts[1:], start=1)]
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
