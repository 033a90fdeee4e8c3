"""The video VAE's ViT decoder over stacked tile-windows (`vae_decode`): its weights on a device (`DecoderWeights`), its
ops as torch ops (`DecoderOps`) or Triton kernels with the same roundings (`FusedDecoderOps`), and one call's forward
(`decode_tile_windows`)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .._imports import vflash_kernels
from ..engine.model import AttentionFn, apply_rotary
from ..errors import VflashError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLMiniMaxH3
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoTransformerBlock

__all__ = [
    "DECODER_EXECUTIONS", "BlockWeights", "DecoderOps", "DecoderWeights", "FusedDecoderOps", "decode_tile_windows",
    "resolve_decoder_execution", "rotary",
]


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


