"""Per-row FP8 (E4M3) activation quantizers, alone and fused into the kernels that produce the block's activations.

An approximate path's operands (the exact path never calls these): the input of each block linear is quantized per
row to E4M3 codes with one FP32 scale per row (`_fp8`'s rule; torch reference `vflash_core.engine.fp8.quantize_rows`):

| op                           | reference (torch)                                                             |
|------------------------------|-------------------------------------------------------------------------------|
| `quantize_rows(x)`           | `quantize_rows(x)`                                                            |
| `swiglu_quantize(p)`         | `quantize_rows(model.swiglu(p))`                                              |
| `rms_norm_modulate_quantize` | `quantize_rows(model.rms_norm_modulate(...))`, the norm in torch's CUDA order |

The fused ops read their inputs twice instead of writing the BF16 activation and reading it back: a row's scale
needs the absmax of the whole row before the first code can be written, so a first pass computes the activation and
its absmax (writing the BF16 value too with `keep_value`, for a LoRA branch that reads it), and a second pass
computes the same values again (the same ops, so the same bits) and writes the codes. Each program owns whole rows.
`rms_norm_modulate_quantize` is `rms_norm_modulate`'s own kernel with its quantizing passes switched on, so its values
are that op's by construction.

Every op returns `(codes, scales, value)`: codes `float8_e4m3fn` of the activation's shape, scales FP32 of its shape
with a last dimension of 1, value the BF16 activation or None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._device import _libdevice, _round_as, _row_block, _row_chunk, _to_f32, _to_storage
from ._fp8 import _e4m3_bits, _row_absmax, _store_row_scales
from .rms_norm_modulate import check_norm_modulate_inputs, launch_rms_norm_modulate

__all__ = ["quantize_rows", "rms_norm_modulate_quantize", "swiglu_quantize"]

Quantized = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def _outputs(x: torch.Tensor, shape: tuple[int, ...], keep_value: bool, value_dtype: torch.dtype) -> Quantized:
    codes = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=x.device)
    value = torch.empty(shape, dtype=value_dtype, device=x.device) if keep_value else None
    return codes, scales, value


# -- quantize_rows --------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    x_col_stride,
    codes_row_stride,
    codes_col_stride,
    scales_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """codes[s, :], scales[s] = the row rule of `_fp8` over x[s, :]. Grid: (row blocks,); each program walks its rows
    in column chunks twice (absmax, then codes)."""
    rows, row_mask = _row_block(n_rows, BLOCK_ROWS, INDEX_64)
    x_rows = x_ptr + rows[:, None] * x_row_stride
    amax = tl.full((BLOCK_ROWS, 1), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols, _, mask = _row_chunk(start, n_cols, row_mask, BLOCK_COLS, INDEX_64)
        amax = _row_absmax(
            _to_f32(tl.load(x_rows + cols[None, :] * x_col_stride, mask=mask, other=0.0), EMULATE_CASTS), amax
        )
    scale = _store_row_scales(amax, scales_ptr, rows, row_mask, scales_stride)
    codes_rows = codes_ptr + rows[:, None] * codes_row_stride
    for start in range(0, n_cols, BLOCK_COLS):
        cols, _, mask = _row_chunk(start, n_cols, row_mask, BLOCK_COLS, INDEX_64)
        x = _to_f32(tl.load(x_rows + cols[None, :] * x_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
        tl.store(codes_rows + cols[None, :] * codes_col_stride, _e4m3_bits(x, scale), mask=mask)


def quantize_rows(x: torch.Tensor) -> Quantized:
    """Per-row E4M3 codes and FP32 scales of x: (S, K) or (1, S, K), bf16 / fp16 / fp32, any strides.

    Returns (codes, scales, None): codes contiguous `float8_e4m3fn` of x's shape, scales (S, 1) / (1, S, 1) fp32.
    """
    x2 = _launch.as_rows(x, "x")
    _launch.round_dtype(x.dtype)
    codes, scales, _ = _outputs(x, tuple(x.shape), False, x.dtype)
    _launch.check_device(x, codes, scales)
    n_rows, n_cols = x2.shape
    if n_rows and n_cols:
        codes2, scales2 = _launch.as_rows(codes, "codes").view(torch.uint8), _launch.as_rows(scales, "scales")
        tile = _launch.elementwise_tile(n_rows, n_cols)
        _quantize_rows_kernel[(triton.cdiv(n_rows, tile.block_rows),)](
            x2, codes2, scales2,
            n_rows, n_cols,
            x2.stride(0), x2.stride(1),
            codes2.stride(0), codes2.stride(1),
            scales2.stride(0),
            BLOCK_ROWS=tile.block_rows,
            BLOCK_COLS=tile.block_groups,
            INDEX_64=_launch.needs_int64(x2, codes2),
            **_launch.launch_options(tile),
        )
    return codes, scales, None


# -- SwiGLU + quantize ----------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_values(
    p_rows, cols, mask, n_cols, p_col_stride, ROUND_DTYPE: tl.constexpr, EMULATE_CASTS: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr
):
    """One chunk of `swiglu`'s output with its kernel's roundings (see `swiglu._swiglu_kernel`), as fp32."""
    value = _to_f32(tl.load(p_rows + cols[None, :] * p_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
    gate = _to_f32(tl.load(p_rows + (n_cols + cols)[None, :] * p_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
    if USE_LIBDEVICE:
        decay = _libdevice.exp(-gate)
    else:
        decay = tl.exp(-gate)
    silu = _round_as(tl.math.div_rn(gate, 1.0 + decay), ROUND_DTYPE, EMULATE_CASTS)
    return _round_as(value * silu, ROUND_DTYPE, EMULATE_CASTS)


@triton.jit
def _swiglu_quantize_kernel(
    p_ptr,
    value_ptr,
    codes_ptr,
    scales_ptr,
    n_rows,
    n_cols,
    p_row_stride,
    p_col_stride,
    value_row_stride,
    value_col_stride,
    codes_row_stride,
    codes_col_stride,
    scales_stride,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    WRITE_VALUE: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """y = swiglu(p) per row (written to value with WRITE_VALUE), then its codes and scale. Grid: (row blocks,)."""
    rows, row_mask = _row_block(n_rows, BLOCK_ROWS, INDEX_64)
    p_rows = p_ptr + rows[:, None] * p_row_stride
    amax = tl.full((BLOCK_ROWS, 1), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols, _, mask = _row_chunk(start, n_cols, row_mask, BLOCK_COLS, INDEX_64)
        y = _swiglu_values(p_rows, cols, mask, n_cols, p_col_stride, ROUND_DTYPE, EMULATE_CASTS, USE_LIBDEVICE)
        if WRITE_VALUE:
            out = value_ptr + rows[:, None] * value_row_stride + cols[None, :] * value_col_stride
            tl.store(out, _to_storage(y, value_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask)
        amax = _row_absmax(y, amax)
    scale = _store_row_scales(amax, scales_ptr, rows, row_mask, scales_stride)
    codes_rows = codes_ptr + rows[:, None] * codes_row_stride
    for start in range(0, n_cols, BLOCK_COLS):
        cols, _, mask = _row_chunk(start, n_cols, row_mask, BLOCK_COLS, INDEX_64)
        y = _swiglu_values(p_rows, cols, mask, n_cols, p_col_stride, ROUND_DTYPE, EMULATE_CASTS, USE_LIBDEVICE)
        tl.store(codes_rows + cols[None, :] * codes_col_stride, _e4m3_bits(y, scale), mask=mask)


def swiglu_quantize(p: torch.Tensor, *, keep_value: bool = False) -> Quantized:
    """`swiglu(p)` quantized per row, without writing the BF16 product unless `keep_value`.

    p: (S, 2F) or (1, S, 2F) [value | gate], bf16 (or fp16 / fp32), any strides. Returns (codes, scales, value) of
    the (.., S, F) product: value is the product itself (`vflash_kernels.swiglu.swiglu`'s bits) or None.
    """
    p2 = _launch.as_rows(p, "p")
    if p2.shape[1] % 2:
        raise ValueError(f"p must have an even last dimension [value | gate], got {tuple(p.shape)}")
    round_dtype = _launch.round_dtype(p.dtype)
    codes, scales, value = _outputs(p, (*p.shape[:-1], p.shape[-1] // 2), keep_value, p.dtype)
    _launch.check_device(p, codes, scales)
    n_rows, n_cols = p2.shape[0], p2.shape[1] // 2
    if n_rows and n_cols:
        codes2, scales2 = _launch.as_rows(codes, "codes").view(torch.uint8), _launch.as_rows(scales, "scales")
        value2 = _launch.as_rows(value, "value") if value is not None else p2  # p2: never written (WRITE_VALUE=False)
        tile = _launch.elementwise_tile(n_rows, n_cols)
        _swiglu_quantize_kernel[(triton.cdiv(n_rows, tile.block_rows),)](
            p2, value2, codes2, scales2,
            n_rows, n_cols,
            p2.stride(0), p2.stride(1),
            value2.stride(0), value2.stride(1),
            codes2.stride(0), codes2.stride(1),
            scales2.stride(0),
            ROUND_DTYPE=round_dtype,
            BLOCK_ROWS=tile.block_rows,
            BLOCK_COLS=tile.block_groups,
            WRITE_VALUE=value is not None,
            INDEX_64=_launch.needs_int64(p2, value2, codes2),
            USE_LIBDEVICE=not _launch.INTERPRET,
            **_launch.launch_options(tile),
        )
    return codes, scales, value


# -- RMSNorm + modulate + quantize ----------------------------------------------------------------------------------


def rms_norm_modulate_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, table: torch.Tensor, row_index: torch.Tensor, *,
    shift_block: int, scale_block: int, table_blocks: int, keep_value: bool = False
) -> Quantized:
    """`rms_norm_modulate(x, weight, eps, table, row_index, ...)` quantized per row, without writing the BF16
    activation unless `keep_value`.

    Arguments as `vflash_kernels.rms_norm_modulate.rms_norm_modulate` (the engine quantizes the main blocks' sublayer
    inputs), with the same refusals (inputs for which `F.rms_norm` would take its other CUDA path). Returns
    (codes, scales, value): value is `rms_norm_modulate`'s result itself, or None.
    """
    x2, shift_col, scale_col = check_norm_modulate_inputs(
        x, weight, table, row_index, shift_block, scale_block, table_blocks
    )
    _launch.round_dtype(x.dtype)  # a dtype the kernel cannot round in is refused, even for no rows
    codes, scales, value = _outputs(x, tuple(x.shape), keep_value, x.dtype)
    _launch.check_device(x, weight, table, row_index, codes, scales)
    codes2, scales2 = _launch.as_rows(codes, "codes").view(torch.uint8), _launch.as_rows(scales, "scales")
    value2 = None if value is None else _launch.as_rows(value, "value")
    launch_rms_norm_modulate(x2, weight, eps, table, row_index, (shift_col, scale_col), value2, (codes2, scales2))
    return codes, scales, value
