"""SwiGLU of the feed-forward: `value * silu(gate)` on the fused [value | gate] input projection.

Reference: `vflash_core.engine.model.swiglu` (`value, gate = p.chunk(2, dim=-1)`; `value * F.silu(gate)`). diffusers'
`ff.net.0.proj` is [value; gate]: the first half is the value (the original checkpoint's `mlp.fc1` is [gate; value]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._device import _libdevice, _round_as, _tile_indices, _to_f32, _to_storage

__all__ = ["swiglu"]


@triton.jit
def _swiglu_kernel(
    p_ptr,
    out_ptr,
    n_rows,
    n_cols,
    p_row_stride,
    p_col_stride,
    out_row_stride,
    out_col_stride,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """out[s, c] = bf( v * bf( g / (1 + exp(-g)) ) ),  v = p[s, c], g = p[s, n_cols + c], all in fp32 between roundings.

    silu as torch's CUDA kernel computes it: the full-precision `expf` (libdevice `__nv_expf`, not the approximate
    `tl.exp` = `ex2.approx`) and an IEEE round-to-nearest division (`tl.math.div_rn`, not the approximate `/`).
    In the interpreter (`USE_LIBDEVICE=False`) numpy's fp32 `exp` stands in for `__nv_expf`.
    Grid: (row blocks, column blocks) over the (S, F) output.
    """
    rows, cols = _tile_indices(BLOCK_ROWS, BLOCK_COLS, INDEX_64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]

    row_offsets = rows[:, None] * p_row_stride
    value = _to_f32(tl.load(p_ptr + row_offsets + cols[None, :] * p_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
    gate = _to_f32(
        tl.load(p_ptr + row_offsets + (n_cols + cols)[None, :] * p_col_stride, mask=mask, other=0.0), EMULATE_CASTS
    )

    if USE_LIBDEVICE:
        decay = _libdevice.exp(-gate)
    else:
        decay = tl.exp(-gate)
    silu = _round_as(tl.math.div_rn(gate, 1.0 + decay), ROUND_DTYPE, EMULATE_CASTS)
    result = _round_as(value * silu, ROUND_DTYPE, EMULATE_CASTS)
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride,
        _to_storage(result, out_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask
    )


def swiglu(p: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused SwiGLU with torch's roundings: `value * silu(gate)` where `value, gate = p.chunk(2, -1)`.

    p: (S, 2F) or (1, S, 2F), bf16 (or fp16/fp32), any strides (read in place, never copied).
    out: optional (S, F) / (1, S, F) result of p's dtype, any strides. Returns (.., S, F), contiguous unless `out`.
    """
    p2 = _launch.as_rows(p, "p")
    if p2.shape[1] % 2:
        raise ValueError(f"p must have an even last dimension [value | gate], got {tuple(p.shape)}")
    out = _launch.output(out, (*p.shape[:-1], p.shape[-1] // 2), p.dtype, p.device)
    _launch.check_device(p, out)
    round_dtype = _launch.round_dtype(p.dtype)
    out2 = _launch.as_rows(out, "out")
    n_rows, n_cols = out2.shape
    if n_rows and n_cols:
        tile, grid = _launch.tile_and_grid(n_rows, n_cols)
        _swiglu_kernel[grid](
            p2, out2,
            n_rows, n_cols,
            p2.stride(0), p2.stride(1),
            out2.stride(0), out2.stride(1),
            ROUND_DTYPE=round_dtype,
            BLOCK_ROWS=tile.block_rows,
            BLOCK_COLS=tile.block_groups,
            INDEX_64=_launch.needs_int64(p2, out2),
            USE_LIBDEVICE=not _launch.INTERPRET,
            **_launch.launch_options(tile),
        )
    return out


