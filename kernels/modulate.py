"""AdaLN modulation after the RMSNorm: `normed * (1 + scale[row]) + shift[row]`, gathering the table rows in-kernel.

Reference: `vflash_core.engine.model.modulate` (`h * (1.0 + scale) + shift`, rows of `table.chunk(6, -1)` for the
blocks, of the (T, 2H) [shift | scale] `norm_out` table indexed by timestep for the output heads, then `.to(float32)`).
The RMSNorm itself stays in torch (`F.rms_norm`): its CUDA reduction order for H = 5376 cannot be reproduced bit for
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._device import _round_as, _table_row_offsets, _tile_indices, _to_f32, _to_storage

__all__ = ["modulate", "modulation_columns"]


@triton.jit
def _modulate_kernel(
    x_ptr,
    table_ptr,
    index_ptr,
    out_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    x_col_stride,
    table_row_stride,
    table_col_stride,
    index_stride,
    out_row_stride,
    out_col_stride,
    shift_col,
    scale_col,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """out[s, c] = bf( bf( x[s, c] * bf(1 + table[t, scale_col + c]) ) + table[t, shift_col + c] ),  t = index[s].

    bf() rounds to ROUND_DTYPE (nearest even); every product and sum is computed in fp32 between roundings, as
    torch's three bf16 ops `1.0 + scale`, `*`, `+` do. The result is stored in out's dtype (fp32 for `norm_out`: an
    exact widening of the bf16 value, i.e. `.to(float32)`). Grid: (row blocks, column blocks).
    """
    rows, cols = _tile_indices(BLOCK_ROWS, BLOCK_COLS, INDEX_64)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    table_row_offsets = _table_row_offsets(index_ptr, rows, row_mask, index_stride, table_row_stride, INDEX_64)

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    scale = tl.load(
        table_ptr + table_row_offsets + (scale_col + cols)[None, :] * table_col_stride, mask=mask, other=0.0
    )
    shift = tl.load(
        table_ptr + table_row_offsets + (shift_col + cols)[None, :] * table_col_stride, mask=mask, other=0.0
    )

    one_plus_scale = _round_as(1.0 + _to_f32(scale, EMULATE_CASTS), ROUND_DTYPE, EMULATE_CASTS)
    y = _round_as(_to_f32(x, EMULATE_CASTS) * one_plus_scale, ROUND_DTYPE, EMULATE_CASTS)
    y = _round_as(y + _to_f32(shift, EMULATE_CASTS), ROUND_DTYPE, EMULATE_CASTS)
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride,
        _to_storage(y, out_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask
    )


def modulation_columns(
    table: torch.Tensor, shift_block: int, scale_block: int, table_blocks: int, hidden: int, dtype: torch.dtype,
    input_name: str,
) -> tuple[int, int]:
    """(shift column, scale column) of `table`, a row of `table_blocks` H-wide blocks whose shift and scale are blocks
    `shift_block` and `scale_block`, after checking the table against an (S, hidden) input of `dtype` named
    `input_name` in the messages."""
    for name, block in (("shift_block", shift_block), ("scale_block", scale_block)):
        if not 0 <= block < table_blocks:
            raise ValueError(f"{name} must be in [0, {table_blocks}), got {block}")
    if table.dim() != 2 or table.shape[1] != table_blocks * hidden:
        raise ValueError(f"table must be (R, {table_blocks}*{hidden}), got {tuple(table.shape)}")
    if table.dtype != dtype:
        raise TypeError(f"table dtype {table.dtype} differs from {input_name} dtype {dtype}")
    return shift_block * hidden, scale_block * hidden


def modulate(
    normed: torch.Tensor,
    table: torch.Tensor,
    row_index: torch.Tensor,
    *,
    shift_block: int,
    scale_block: int,
    table_blocks: int,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused AdaLN modulation: `normed * (1 + scale[row_index]) + shift[row_index]` with torch's three roundings.

    normed: (S, H) or (1, S, H), bf16 (or fp16/fp32), any strides: the `F.rms_norm` output.
    table: (R, table_blocks * H) same dtype, any strides (a view is read in place): rows of H-wide blocks, the shift
        at block `shift_block` and the scale at `scale_block`. The layout is the caller's (the engine passes the
        model's `MODULATION_BLOCKS`: a main block's (3T, 6H) AdaLN table, or the (T, 2H) `norm_out` table).
    row_index: (S,) int64/int32 table row of each packed row (`adaln_indices`, or `timestep_indices` for `norm_out`),
        values in [0, R) (not checked: that would synchronise).
    out_dtype: dtype of the result (default normed's); float32 for `norm_out` gives the reference's `.to(float32)`.
    out: optional preallocated result of normed's shape and `out_dtype`, any strides.
    Returns a tensor of normed's shape, contiguous unless `out` was given.
    """
    x2 = _launch.as_rows(normed, "normed")
    shift_col, scale_col = modulation_columns(
        table, shift_block, scale_block, table_blocks, x2.shape[1], normed.dtype, "normed"
    )
    _launch.check_index(row_index, x2.shape[0], "row_index")
    out = _launch.output(out, normed.shape, out_dtype or normed.dtype, normed.device)
    _launch.check_device(normed, table, row_index, out)
    out2 = _launch.as_rows(out, "out")
    n_rows, n_cols = x2.shape
    if n_rows and n_cols:
        tile, grid = _launch.tile_and_grid(n_rows, n_cols)
        _modulate_kernel[grid](
            x2, table, row_index, out2,
            n_rows, n_cols,
            x2.stride(0), x2.stride(1),
            table.stride(0), table.stride(1),
            row_index.stride(0),
            out2.stride(0), out2.stride(1),
            shift_col, scale_col,
            ROUND_DTYPE=_launch.round_dtype(normed.dtype),
            BLOCK_ROWS=tile.block_rows,
            BLOCK_COLS=tile.block_groups,
            INDEX_64=_launch.needs_int64(x2, table, row_index, out2),
            **_launch.launch_options(tile),
        )
    return out


