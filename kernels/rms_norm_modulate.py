"""RMSNorm fused with the AdaLN modulation, in one pass:
`modulate(F.rms_norm(x, (H,), w, eps), table, row_index, ...)`.

Reference: `vflash_core.engine.model.rms_norm_modulate` (`F.rms_norm`, then `modulate`), used by `main_block` before
each sublayer and by `output_heads`. The (S, H) normalised tensor is never written: the kernel saves one write and one
read of it per norm against `F.rms_norm` followed by `modulate`.

Bit parity with `F.rms_norm` needs its CUDA reduction order. Recent torch (2.11 included) sends `F.rms_norm`
with a weight of the input's dtype to `_fused_rms_norm` (aten/src/ATen/native/layer_norm.cpp, `rms_norm_symint`),
whose CUDA kernel is the LayerNorm kernel instantiated with `rms_norm=true`
(aten/src/ATen/native/cuda/layer_norm_kernel.cu, `RmsNormKernelImpl` -> `LayerNormKernelImplInternal<T, T_ACC, true>`).
For bf16 / fp16 / fp32 rows whose length is a multiple of 4 and whose x, weight and output pointers are 8-byte
(4-element) aligned it launches `vectorized_layer_norm_kernel` (otherwise a two-kernel Welford path with another
order, which `rms_norm_modulate` refuses):

* one block per row of `dim3(32, num_threads() / 32)` threads: `num_threads()` is `4 * C10_WARP_SIZE` on CUDA
  (ATen/native/cuda/thread_constants.h), so 4 warps, 128 threads; thread t = lane + 32 * warp.
* `compute_stats<T, rms_norm=true>`: thread t reads the 4-element vectors t, t + 128, t + 256, ... of the row (channels
  512k + 4t + j) and accumulates `sigma2 = sigma2 + v * v` in fp32 for j = 0..3 of each vector in turn
  (`cuWelfordOnlineSum`'s rms branch: a plain sum of squares, not a Welford mean; nvcc contracts it to an fma, which
  for bf16 / fp16 squares, exact in fp32, is the same value).
* warp: `WARP_SHFL_DOWN` with offsets 16, 8, 4, 2, 1, `cuWelfordCombine`'s rms branch adding the two sums;
  block: through shared memory, warps [offset, 2 offset) hand their sum to warp w - offset for offset = 2, 1, i.e.
  (w0 + w2) + (w1 + w3).
* `sigma2 / float(N)` (IEEE division), `rstd = c10::cuda::compat::rsqrt(ms + eps)` = `rsqrtf` = PTX
  `rsqrt.approx.f32`, and `y = bf(float(w) * (rstd * float(x)))`.

`tl.math.rsqrt` lowers to libdevice `__nv_rsqrtf`, the same `rsqrt.approx.f32` (its ftz variant under Triton's
default `nvvm-reflect-ftz`, which differs only for subnormal arguments; `ms + eps >= eps` is normal for any eps above
1.2e-38). For rows of at most 128 channels this order is `rope.qk_norm_rope`'s (only warp 0 holds data).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._device import (
    _CHUNK,
    _TORCH_WARPS,
    _VEC,
    _norm_modulate_chunk,
    _row_chunk,
    _table_row_offsets,
    _to_storage,
    _torch_norm_rows,
)
from ._fp8 import _e4m3_bits, _row_absmax, _store_row_scales
from .modulate import modulation_columns

__all__ = ["rms_norm_modulate"]


@triton.jit
def _rms_norm_modulate_kernel(
    x_ptr,
    weight_ptr,
    table_ptr,
    index_ptr,
    out_ptr,
    codes_ptr,
    scales_ptr,
    n_rows,
    eps,
    x_row_stride,
    x_col_stride,
    weight_stride,
    table_row_stride,
    table_col_stride,
    index_stride,
    out_row_stride,
    out_col_stride,
    codes_row_stride,
    codes_col_stride,
    scales_stride,
    shift_col,
    scale_col,
    HIDDEN: tl.constexpr,
    TORCH_WARPS: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    QUANTIZE: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """RMSNorm of whole rows in torch's CUDA order, then the AdaLN modulation of `modulate`, stored to out with
    WRITE_OUT; with QUANTIZE also the rows' E4M3 codes and scales (`_fp8`'s rule, `fp8_quantize`'s fused quantizer).

    n[s,c]    = bf( w[c] * (rstd[s] * x[s,c]) )                 fp32 products, one rounding (as `F.rms_norm`)
    rstd[s]   = rsqrt( sum_sq[s] / H + eps )                    IEEE division, hardware rsqrt (as torch's rsqrtf)
    sum_sq[s] = thread t (of T = 32 * TORCH_WARPS) sums x[s, 4T*k + 4t + j]^2 for k = 0, 1, ... and j = 0..3 in that
                order (fma); the 32 lane sums of each warp are added by the shuffle-down tree (offsets 16, 8, 4, 2, 1),
                then the warp sums by the same tree over warps (offsets TORCH_WARPS/2, ..., 1).
    out[s,c]  = bf( bf( n[s,c] * bf(1 + table[r, scale_col + c]) ) + table[r, shift_col + c] ),  r = index[s]
    Grid: (row blocks,). Each program reads its rows chunk by chunk of 4T channels, as torch's kernel re-reads its
    row: the sum of squares, then the modulated values (and their absmax), then, with QUANTIZE, the same values again,
    quantized (a row's scale needs its whole absmax first). Channels past H load 0 and add +0.0 exactly.
    """
    CHUNK: tl.constexpr = 4 * 32 * TORCH_WARPS
    rows, row_mask, x_rows, rstd = _torch_norm_rows(
        x_ptr, n_rows, x_row_stride, x_col_stride, eps, HIDDEN, TORCH_WARPS, BLOCK_ROWS, INDEX_64, EMULATE_CASTS
    )
    table_row_ptrs = table_ptr + _table_row_offsets(index_ptr, rows, row_mask, index_stride, table_row_stride, INDEX_64)
    out_rows = out_ptr + rows[:, None] * out_row_stride
    amax = tl.full((BLOCK_ROWS, 1), 0.0, tl.float32)
    for start in range(0, HIDDEN, CHUNK):
        cols, col_mask, mask = _row_chunk(start, HIDDEN, row_mask, CHUNK, INDEX_64)
        y = _norm_modulate_chunk(
            x_rows, weight_ptr, table_row_ptrs, rstd, cols, mask, col_mask, x_col_stride, weight_stride,
            table_col_stride, shift_col, scale_col, ROUND_DTYPE, EMULATE_CASTS
        )
        if WRITE_OUT:
            tl.store(
                out_rows + cols[None, :] * out_col_stride, _to_storage(y, out_ptr.dtype.element_ty, EMULATE_CASTS),
                mask=mask
            )
        if QUANTIZE:
            amax = _row_absmax(y, amax)
    if QUANTIZE:
        scale = _store_row_scales(amax, scales_ptr, rows, row_mask, scales_stride)
        codes_rows = codes_ptr + rows[:, None] * codes_row_stride
        for start in range(0, HIDDEN, CHUNK):
            cols, col_mask, mask = _row_chunk(start, HIDDEN, row_mask, CHUNK, INDEX_64)
            y = _norm_modulate_chunk(
                x_rows, weight_ptr, table_row_ptrs, rstd, cols, mask, col_mask, x_col_stride, weight_stride,
                table_col_stride, shift_col, scale_col, ROUND_DTYPE, EMULATE_CASTS
            )
            tl.store(codes_rows + cols[None, :] * codes_col_stride, _e4m3_bits(y, scale), mask=mask)


def check_norm_modulate_inputs(
    x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, shift_block: int,
    scale_block: int, table_blocks: int
) -> tuple[torch.Tensor, int, int]:
    """x as (S, H) rows and the (shift, scale) table columns, after the checks of `rms_norm_modulate`.

    Refuses inputs for which `F.rms_norm` takes its non-vectorized CUDA path (another reduction order): torch makes x
    and the weight contiguous first (a copy is freshly allocated, so aligned), then needs H % 4 == 0 and 4-element
    alignment of the data pointers. Reading `data_ptr()` does not synchronise.
    """
    x2 = _launch.as_rows(x, "x")
    n_rows, hidden = x2.shape
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be ({hidden},) {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    shift_col, scale_col = modulation_columns(table, shift_block, scale_block, table_blocks, hidden, x.dtype, "x")
    if hidden % _VEC:
        raise ValueError(
            f"hidden size {hidden} is not a multiple of {_VEC}: F.rms_norm would not use its vectorized kernel"
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.is_contiguous() and t.data_ptr() % (_VEC * t.element_size()):
            raise ValueError(
                f"{name} is contiguous but not {_VEC}-element aligned: F.rms_norm would not use its vectorized kernel"
            )
    _launch.check_index(row_index, n_rows, "row_index")
    return x2, shift_col, scale_col


def rms_norm_modulate(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    table: torch.Tensor,
    row_index: torch.Tensor,
    *,
    shift_block: int,
    scale_block: int,
    table_blocks: int,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`modulate(F.rms_norm(x, (H,), weight, eps), table, row_index, ...)` in one kernel, without the normed tensor.

    x: (S, H) or (1, S, H), bf16 (or fp16/fp32), any strides; H a multiple of 4.
    weight: (H,) in x's dtype (`norm1.weight`, `norm2.weight`), any stride. eps: used in fp32, as torch does.
    table, row_index, shift_block, scale_block, table_blocks, out_dtype, out: as `modulate` (a main block's
        (3T, 6H) table, or the (T, 2H) `norm_out` table with out_dtype float32; row_index values in [0, R), not
        checked).
    Returns a tensor of x's shape, contiguous unless `out` was given.

    Numerics: the RMSNorm in the order of torch's vectorized CUDA kernel (module docstring), then `modulate`'s
    roundings. Raises ValueError where `F.rms_norm` would take its other CUDA path (H % 4 != 0, or a contiguous x or
    weight not aligned to 4 elements). Bit parity with `F.rms_norm` + `modulate` rests on torch's kernel choice:
    check it with `pytest -m gpu tests/test_rms_norm_modulate.py -s` after a torch upgrade or on another GPU.
    """
    x2, shift_col, scale_col = check_norm_modulate_inputs(
        x, weight, table, row_index, shift_block, scale_block, table_blocks
    )
    out = _launch.output(out, x.shape, out_dtype or x.dtype, x.device)
    _launch.check_device(x, weight, table, row_index, out)
    launch_rms_norm_modulate(x2, weight, eps, table, row_index, (shift_col, scale_col), _launch.as_rows(out, "out"))
    return out


def launch_rms_norm_modulate(
    x2: torch.Tensor, weight: torch.Tensor, eps: float, table: torch.Tensor, row_index: torch.Tensor,
    columns: tuple[int, int], out2: torch.Tensor | None, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`_rms_norm_modulate_kernel` over the (S, H) rows x2 (after `check_norm_modulate_inputs`, whose table columns
    `columns` are): the modulated rows into the (S, H) out2 (None: not written), and with `quantized` (the (S, H)
    uint8 codes and (S, 1) fp32 scales) their E4M3 codes and row scales. Checks nothing itself."""
    n_rows, hidden = x2.shape
    if not n_rows:
        return
    # an argument the kernel never reads (WRITE_OUT / QUANTIZE off) still needs a tensor: x2's rows stand in
    out_view = x2 if out2 is None else out2
    codes2, scales2 = (x2, x2) if quantized is None else quantized
    # a row is n_groups = 1 group of one torch block's chunk: the loops walk the rest of the row
    tile = _launch.elementwise_tile(n_rows, 1, _CHUNK)
    _rms_norm_modulate_kernel[(triton.cdiv(n_rows, tile.block_rows),)](
        x2, weight, table, row_index, out_view, codes2, scales2,
        n_rows, float(eps),
        x2.stride(0), x2.stride(1),
        weight.stride(0),
        table.stride(0), table.stride(1),
        row_index.stride(0),
        out_view.stride(0), out_view.stride(1),
        codes2.stride(0), codes2.stride(1),
        scales2.stride(0),
        *columns,
        HIDDEN=hidden,
        TORCH_WARPS=_TORCH_WARPS,
        ROUND_DTYPE=_launch.round_dtype(x2.dtype),
        BLOCK_ROWS=tile.block_rows,
        WRITE_OUT=out2 is not None,
        QUANTIZE=quantized is not None,
        INDEX_64=_launch.needs_int64(x2, weight, table, row_index, out_view, codes2),
        **_launch.launch_options(tile),
    )
