"""`@triton.jit` helpers of the FP8 activation quantizers: per-row absmax scale and fp32 -> E4M3 codes.

The rule (the torch reference is `vflash_core.engine.fp8.quantize_rows`): for a row r of fp32 values,

    amax[r]  = max |y[r, c]|                                   exact
    scale[r] = amax[r] / 448   (IEEE division), 1 for a zero row (its codes are then 0)
    code     = e4m3( clamp( y / scale[r], -448, 448 ) )        IEEE division, round to nearest even

448 is the largest finite E4M3 (`float8_e4m3fn`) value. Codes are stored as their uint8 bit patterns, so the kernels
write the same bytes in the interpreter (which has no float8 type) and on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_absmax(y, amax):
    """Running per-row absmax: (R, C) fp32 tile and (R, 1) running maxima -> (R, 1). Max is exact in any order, so
    the tiling does not matter. `tl.reduce` with a combine function of ours (see `_device._pair_sum` for why)."""
    return tl.maximum(amax, tl.reduce(tl.abs(y), 1, _maximum)[:, None])


@triton.jit
def _row_scale(amax):
    """(R, 1) absmax -> fp32 row scales: amax / 448 (IEEE division), 1.0 for an all-zero row."""
    return tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _store_row_scales(amax, scales_ptr, rows, row_mask, scales_stride):
    """`_row_scale(amax)`, stored at scales[rows] and returned for the codes pass."""
    scale = _row_scale(amax)
    tl.store(scales_ptr + rows[:, None] * scales_stride, scale, mask=row_mask[:, None])
    return scale


@triton.jit
def _e4m3_bits(y, scale):
    """fp32 `y` (R, C) and its rows' scales (R, 1) -> uint8 bit patterns of `e4m3(clamp(y / scale, -448, 448))`.

    The rounding is done on the fp32 bit pattern, as torch's `c10::Float8_e4m3fn` does it, in the interpreter (which
    has no float8 type) and on the GPU alike: Triton's fp32 -> `float8e4nv` cast is not one round to nearest even on
    every NVIDIA target (below compute capability 9.0, SM89 included, Triton's NVIDIA backend first truncates to fp16,
    so a value just above a tie lands on it and then rounds to even), and a few integer ops cost nothing in a kernel
    bound by memory. Below 2^-6 (E4M3's smallest normal) the value is rounded
    into the subnormal range by adding 2^14 in fp32 (the sum's low bits are the subnormal code); otherwise the
    exponent is rebiased (127 -> 7) and the 20 dropped mantissa bits rounded to nearest even. Inputs are clamped to
    +-448, so no code overflows.
    """
    q = tl.math.div_rn(y, scale)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    bits = q.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits ^ sign
    # 16384.0 = 2^14, whose bit pattern is 141 << 23
    small = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    odd = (magnitude >> 20) & 1
    normal = (magnitude - (120 << 23) + 0x7FFFF + odd) >> 20
    code = tl.where(magnitude < (121 << 23), small, normal)
    return ((code & 0x7F) | (sign >> 24)).to(tl.uint8)
