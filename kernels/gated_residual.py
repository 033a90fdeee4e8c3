"""Gated residual update: `x + gate[row] * y`, gathering the gate rows of the AdaLN table in-kernel.

Reference: `vflash_core.engine.model.gated_residual` (`x + gate * y` after each sublayer of `main_block`): the product
rounds, then the sum; no tanh, no clamp on the gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._device import _round_as, _table_row_offsets, _tile_indices, _to_f32, _to_storage

__all__ = ["gated_residual"]

@triton.jit
def _gated_residual_kernel(
    x_ptr,
    y_ptr,
    table_ptr,
    index_ptr,
    out_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    x_col_stride,
    y_row_stride,
    y_col_stride,
    table_row_stride,
    table_col_stride,
    index_stride,
    out_row_stride,
    out_col_stride,
    gate_col,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """out[s, c] = bf( x[s, c] + bf( table[t, gate_col + c] * y[s, c] ) ),  t = index[s].

    Two torch bf16 ops (`gate * y`, then `x + ...`), each rounded to ROUND_DTYPE (nearest even) from fp32. Every
    element is loaded before it is stored by the same program, so `out` may be `x` (in-place update).
    Grid: (row blocks, column blocks).
    """
    rows, cols = _tile_indices(BLOCK_ROWS, BLOCK_COLS, INDEX_64)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    table_row_offsets = _table_row_offsets(index_ptr, rows, row_mask, index_stride, table_row_stride, INDEX_64)

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    y = tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :] * y_col_stride, mask=mask, other=0.0)
    gate = tl.load(table_ptr + table_row_offsets + (gate_col + cols)[None, :] * table_col_stride, mask=mask, other=0.0)
    gated = _round_as(_to_f32(gate, EMULATE_CASTS) * _to_f32(y, EMULATE_CASTS), ROUND_DTYPE, EMULATE_CASTS)
    result = _round_as(_to_f32(x, EMULATE_CASTS) + gated, ROUND_DTYPE, EMULATE_CASTS)
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride,
        _to_storage(result, out_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask
    )


def gated_residual(
    x: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    row_index: torch.Tensor,
    *,
    gate_block: int,
    table_blocks: int,
    out: torch.Tensor | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Fused `x + gate[row_index] * y` with torch's two roundings.

    x: (S, H) or (1, S, H) residual stream, bf16 (or fp16/fp32), any strides.
    y: sublayer output of x's shape and dtype (attention or FFN output projection), any strides.
    table: (R, table_blocks * H) AdaLN table, any strides: rows of H-wide blocks, the gate at block `gate_block`. The
        layout is the caller's (the engine passes the model's `MODULATION_BLOCKS`: a main block's (3T, 6H) table).
    row_index: (S,) int64/int32 table row per packed row (`adaln_indices`), values in [0, R) (not checked).
    inplace: write the result into `x` and return `x` (safe: each element is read before it is written by the same
        program). Otherwise the result goes to `out` (x's shape and dtype, any strides) or a new contiguous tensor.
    """
    if not 0 <= gate_block < table_blocks:
        raise ValueError(f"gate_block must be in [0, {table_blocks}), got {gate_block}")
    x2, y2 = _launch.as_rows(x, "x"), _launch.as_rows(y, "y")
    if y.shape != x.shape or y.dtype != x.dtype or table.dtype != x.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype} and table {table.dtype} must agree"
        )
    n_rows, hidden = x2.shape
    if table.dim() != 2 or table.shape[1] != table_blocks * hidden:
        raise ValueError(f"table must be (R, {table_blocks}*{hidden}), got {tuple(table.shape)}")
    _launch.check_index(row_index, n_rows, "row_index")
    if inplace:
        if out is not None:
            raise ValueError("pass either out= or inplace=True, not both")
        out = x
    else:
        out = _launch.output(out, x.shape, x.dtype, x.device)
    if out is not x and out.data_ptr() == x.data_ptr() and out.stride() != x.stride():
        raise ValueError("out aliases x with different strides; use inplace=True or a separate tensor")
    _launch.check_device(x, y, table, row_index, out)
    out2 = _launch.as_rows(out, "out")
    if n_rows and hidden:
        tile, grid = _launch.tile_and_grid(n_rows, hidden)
        _gated_residual_kernel[grid](
            x2, y2, table, row_index, out2,
            n_rows, hidden,
            x2.stride(0), x2.stride(1),
            y2.stride(0), y2.stride(1),
            table.stride(0), table.stride(1),
            row_index.stride(0),
            out2.stride(0), out2.stride(1),
            gate_block * hidden,
            ROUND_DTYPE=_launch.round_dtype(x.dtype),
            BLOCK_ROWS=tile.block_rows,
            BLOCK_COLS=tile.block_groups,
            INDEX_64=_launch.needs_int64(x2, y2, table, row_index, out2),
            **_launch.launch_options(tile),
        )
    return out


