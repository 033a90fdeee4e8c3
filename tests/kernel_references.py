"""What the kernel parity tests share beyond the model's torch reference: the AdaLN table layout as the engine passes
it to the kernels (`vflash_core.engine.fused`), and torch emulations of the RMSNorm reduction order of torch's
vectorized CUDA kernel, which the fused norms reproduce (`vflash_kernels.rms_norm_modulate`'s module docstring).

The emulations are what the CPU tests compare the interpreted kernels with bit for bit (CPU `F.rms_norm` sums in
another order); on the GPU the kernels are compared with `F.rms_norm` itself, and the emulations diagnose a mismatch.
`torch.rsqrt` on the CPU is `1 / sqrt`, as the Triton interpreter computes it; on the GPU the kernels use the hardware
approximation, as `F.rms_norm` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vflash_core.engine.model import MODULATION_BLOCKS

#: torch's block for the vectorized row kernel: 32-lane warps, 4 of them (`num_threads() / 32`), 4-element vectors.
LANES = 32
TORCH_WARPS = 4
VEC = 4


def shift_scale_blocks(which: str) -> dict[str, int]:
    """The `shift_block`, `scale_block`, `table_blocks` arguments of the modulating kernels for `which`'s table."""
    blocks = MODULATION_BLOCKS[which]
    return {"shift_block": blocks.shift, "scale_block": blocks.scale, "table_blocks": blocks.count}


def gate_blocks(which: str) -> dict[str, int]:
    """The `gate_block`, `table_blocks` arguments of `gated_residual` for `which`'s table (a main block's sublayer)."""
    blocks = MODULATION_BLOCKS[which]
    assert blocks.gate is not None, which
    return {"gate_block": blocks.gate, "table_blocks": blocks.count}


def halving_tree(s: torch.Tensor) -> torch.Tensor:
    """(..., W) -> (...), W a power of two: element i += element i + W/2, halving W (a shuffle-down or shared-memory
    tree)."""
    width = s.shape[-1]
    while width > 1:
        width //= 2
        s = s[..., :width] + s[..., width : 2 * width]
    return s[..., 0]


def rms_norm_block_order_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, warps: int = TORCH_WARPS
) -> torch.Tensor:
    """torch emulation of `rms_norm_modulate`'s RMSNorm, reduction order included: (..., H) -> (..., H) in x's dtype.

    `warps` is the block height of torch's kernel (4; other powers of two model other launch configurations, for
    diagnosis). Exact for bf16/fp16 inputs, whose squares are exact in fp32 (so the kernel's fma equals a multiply and
    an add).
    """
    hidden = x.shape[-1]
    threads = LANES * warps
    xf = x.float()
    squares = F.pad(xf * xf, (0, -hidden % (threads * VEC))).unflatten(-1, (-1, threads, VEC))  # (..., K, T, 4)
    acc = torch.zeros(squares.shape[:-3] + (threads,), dtype=torch.float32, device=x.device)
    for k in range(squares.shape[-3]):
        for j in range(VEC):
            acc = acc + squares[..., k, :, j]
    sum_sq = halving_tree(halving_tree(acc.unflatten(-1, (warps, LANES))))  # lanes, then warps
    rstd = torch.rsqrt(sum_sq / hidden + eps)
    return (weight.float() * (rstd[..., None] * xf)).to(x.dtype)


def rms_norm_warp_order_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch emulation of `rope.qk_norm_rope`'s RMSNorm, reduction order included: (..., D) -> (..., D) in x's dtype,
    D <= 128.

    torch's block order (`rms_norm_block_order_reference`) with a single warp: rows of at most 128 channels fill only
    warp 0, whose lanes then are the whole reduction.
    """
    return rms_norm_block_order_reference(x, weight, eps, warps=1)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 `a * b + c` rounded once (as a hardware fma): the fp64 product is exact, the fp64 sum is rounded to odd
    (exact with its two-sum error), and 53 >= 24 + 2 bits make the final rounding to fp32 correct."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    t = s - p
    error = (p - (s - t)) + (c64 - t)  # two-sum: s + error == p + c exactly
    bits = s.view(torch.int64)
    # inexact and s even: step to the odd neighbour on error's side (toward zero when the signs differ)
    toward_zero = (error != 0) & ((error > 0) != (s > 0))
    odd = torch.where(toward_zero, bits - 1, bits) | 1
    return torch.where((error != 0) & (bits & 1 == 0), odd.view(torch.float64), s).float()


def rms_norm_cast_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch emulation of `vae_decoder.rms_norm_cast` (and of `head_rms_norm_rope`'s norm, a single warp, D <= 128),
    its reduction order and fma included: (..., D) -> (..., D) in `out_dtype`. eps None is fp32's machine epsilon, as
    `F.rms_norm` has it. The decoder's stream is fp32, whose squares are not exact in fp32: the fma matters.
    """
    hidden = x.shape[-1]
    warps = TORCH_WARPS if hidden > LANES * VEC else 1
    threads = LANES * warps
    xf = x.float()
    padded = F.pad(xf, (0, -hidden % (threads * VEC))).unflatten(-1, (-1, threads, VEC))
    acc = torch.zeros(padded.shape[:-3] + (threads,), dtype=torch.float32, device=x.device)
    for k in range(padded.shape[-3]):
        for j in range(VEC):
            v = padded[..., k, :, j]
            acc = fma_f32(v, v, acc)
    sum_sq = halving_tree(halving_tree(acc.unflatten(-1, (warps, LANES))))
    rstd = torch.rsqrt(sum_sq / hidden + (torch.finfo(torch.float32).eps if eps is None else float(eps)))
    y = rstd[..., None] * xf
    return (y if weight is None else weight.float() * y).to(out_dtype)
