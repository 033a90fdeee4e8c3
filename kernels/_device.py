"""`@triton.jit` helpers shared by the kernels: the per-op rounding of the model, torch's 32-lane tree sum, the index
arithmetic of a program's tile (integer only), torch's CUDA RMSNorm order with the AdaLN modulation after it, and
libdevice (every helper is inlined into its kernel).

Rounding contract (the model's, which diffusers' H3 transformer defines): every torch elementwise op on bf16 tensors
computes in fp32 and rounds its own output to bf16 (round to nearest, ties to even). The kernels keep each intermediate
in fp32 and call `_round_as` exactly where torch rounds, so an fp32 value that is exactly representable in the storage
dtype flows between the "ops". For fp32 tensors the rounding is the identity (torch's fp32 ops round to fp32
themselves).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The exact `expf`: torch's CUDA silu computes `x / (1 + exp(-x))` in fp32 with the full-precision `expf` (no
# --use_fast_math) and an IEEE division, and libdevice's `__nv_expf` is that same function. Its module moved between
# Triton versions: `triton.language.extra.cuda.libdevice` (triton >= 3.0, including 3.6 and 3.9), the
# backend-dispatching `triton.language.extra.libdevice` (>= 3.2), and `tl.math` in Triton 2.x.
try:
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - depends on the installed triton
    try:
        from triton.language.extra import libdevice as _libdevice
    except ImportError:
        _libdevice = tl.math


@triton.jit
def _round_as(x, DTYPE: tl.constexpr, EMULATE_CASTS: tl.constexpr):
    """fp32 `x` -> the nearest `DTYPE` value (ties to even), returned as fp32.

    On the GPU the conversion is the hardware's `cvt.rn` (round to nearest even). The Triton interpreter truncates
    fp32 -> bf16 instead, so with `EMULATE_CASTS` the same rounding is done on the bit pattern: add 0x7FFF plus the
    lowest kept bit, clear the 16 dropped bits (NaN is passed through; a carry rounds up into the exponent, to inf at
    the top). Both give torch's `float -> bfloat16`.
    """
    if DTYPE == tl.float32:
        y = x
    elif DTYPE == tl.bfloat16:
        if EMULATE_CASTS:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + (((bits >> 16) & 1) + 0x7FFF)
            bits = (bits >> 16) << 16
            y = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # noqa: PLR0124 - NaN stays NaN
        else:
            y = x.to(tl.bfloat16).to(tl.float32)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _to_f32(x, EMULATE_CASTS: tl.constexpr):
    """A loaded bf16 / fp16 / fp32 tile -> fp32 (exact). In the interpreter bf16 is widened on the bit pattern: its
    own bf16 -> fp32 cast flushes subnormals to zero."""
    if EMULATE_CASTS:
        if x.dtype == tl.bfloat16:
            y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float32)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _to_storage(y, DTYPE: tl.constexpr, EMULATE_CASTS: tl.constexpr):
    """An fp32 value already rounded by `_round_as` -> `DTYPE` for the store (exact).

    In the interpreter (`EMULATE_CASTS`) bf16 is taken from the high half of the fp32 bit pattern: its own fp32 -> bf16
    cast flushes subnormals to zero.
    """
    if EMULATE_CASTS:
        if DTYPE == tl.bfloat16:
            out = (y.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = y.to(DTYPE)
    else:
        out = y.to(DTYPE)
    return out


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _pair_sum(s, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, WIDTH: tl.constexpr):
    """(A, B, WIDTH) -> (A, B, WIDTH // 2): lane i + lane (i + WIDTH/2), one fp32 add per output (one shuffle-down
    step).

    `tl.reduce` with our own combine function rather than `tl.sum`: the latter is a `triton.jit` function of triton's
    standard library, decorated when triton is imported, which the test suite's interpreted copy of this package
    cannot call. A reduction over two elements is a single (commutative) add either way.
    """
    return tl.reduce(tl.reshape(s, (BLOCK_A, BLOCK_B, 2, WIDTH // 2)), 2, _add)


@triton.jit
def _lane_tree_sum(s, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, LANES: tl.constexpr):
    """(A, B, LANES) per-lane partial sums -> (A, B): the shuffle-down tree of a 32-lane warp.

    Offsets 16, 8, 4, 2, 1: after each step lane i holds lane i + lane i+offset, lane 0 ends with the sum, i.e. the
    fixed association ((l0 + l16) + (l8 + l24)) + ... for 32 lanes, independent of Triton's register layout. LANES is a
    power of two <= 32; lanes a warp would hold beyond LANES are zero, so their steps add +0.0 exactly and are skipped.
    """
    if LANES >= 32:
        s = _pair_sum(s, BLOCK_A, BLOCK_B, 32)
    if LANES >= 16:
        s = _pair_sum(s, BLOCK_A, BLOCK_B, 16)
    if LANES >= 8:
        s = _pair_sum(s, BLOCK_A, BLOCK_B, 8)
    if LANES >= 4:
        s = _pair_sum(s, BLOCK_A, BLOCK_B, 4)
    if LANES >= 2:
        s = _pair_sum(s, BLOCK_A, BLOCK_B, 2)
    return tl.reshape(s, (BLOCK_A, BLOCK_B))


# -- tile indices -------------------------------------------------------------------------------------------------


@triton.jit
def _tile_indices(BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, INDEX_64: tl.constexpr):
    """This program's indices along grid axes 0 and 1: (BLOCK_A,) and (BLOCK_B,), int64 with INDEX_64 (widened
    before they multiply a stride)."""
    pid_a = tl.program_id(0)
    pid_b = tl.program_id(1)
    if INDEX_64:
        pid_a = pid_a.to(tl.int64)
        pid_b = pid_b.to(tl.int64)
    return pid_a * BLOCK_A + tl.arange(0, BLOCK_A), pid_b * BLOCK_B + tl.arange(0, BLOCK_B)


@triton.jit
def _row_block(n_rows, BLOCK_ROWS: tl.constexpr, INDEX_64: tl.constexpr):
    """The rows of a program that owns whole rows (grid: (row blocks,)) and their mask."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    return rows, rows < n_rows


@triton.jit
def _row_chunk(start, n_cols, row_mask, BLOCK_COLS: tl.constexpr, INDEX_64: tl.constexpr):
    """Columns [start, start + BLOCK_COLS) of a row loop: the columns, their mask, and the (rows, columns) mask."""
    cols = start + tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols = cols.to(tl.int64)
    col_mask = cols < n_cols
    return cols, col_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _table_row_offsets(index_ptr, rows, row_mask, index_stride, table_row_stride, INDEX_64: tl.constexpr):
    """(R,) packed rows -> (R, 1) element offsets of their AdaLN table rows, `index[row] * table_row_stride`."""
    table_rows = tl.load(index_ptr + rows * index_stride, mask=row_mask, other=0)
    if INDEX_64:
        table_rows = table_rows.to(tl.int64)
    else:
        table_rows = table_rows.to(tl.int32)
    return (table_rows * table_row_stride)[:, None]


# -- torch's CUDA RMSNorm order (`rms_norm_modulate`'s module docstring) ----------------------------------------

#: torch's block for the vectorized row kernel: 32-lane warps, `num_threads() / 32` = 4 of them, 4-element vectors.
_LANES = 32
_TORCH_WARPS = 4
_VEC = 4
#: Channels one block of torch reads per step (128 threads x 4): the column tile of every loop iteration of the
#: torch-order norms, so that
#: each tile column group is one torch thread's vector.
_CHUNK = _LANES * _TORCH_WARPS * _VEC


@triton.jit
def _torch_block_rstd(
    x_rows, row_mask, x_col_stride, eps, HIDDEN: tl.constexpr, TORCH_WARPS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """(BLOCK_ROWS, 1) `rstd` of whole rows, the sum of squares in torch's block order (the docstring of
    `rms_norm_modulate._rms_norm_modulate_kernel`), reading each row chunk by chunk of 4 * 32 * TORCH_WARPS channels;
    channels past HIDDEN load 0 and add +0.0 exactly."""
    CHUNK: tl.constexpr = 4 * 32 * TORCH_WARPS
    # per-thread sums: column 4t + j of a chunk is torch thread t's channel j (x[r, t, a, b] = channel 4t + 2a + b)
    acc = tl.full((BLOCK_ROWS, CHUNK // 4), 0.0, tl.float32)  # not `tl.zeros`: a triton @jit function (see `_pair_sum`)
    for start in range(0, HIDDEN, CHUNK):
        cols, _, mask = _row_chunk(start, HIDDEN, row_mask, CHUNK, INDEX_64)
        x = _to_f32(tl.load(x_rows + cols[None, :] * x_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
        quads = tl.reshape(x, (BLOCK_ROWS, CHUNK // 4, 2, 2))
        even, odd = tl.split(quads)  # channels 4t + 2a and 4t + 2a + 1
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        acc = tl.fma(x3, x3, tl.fma(x2, x2, tl.fma(x1, x1, tl.fma(x0, x0, acc))))
    warp_sums = _lane_tree_sum(tl.reshape(acc, (BLOCK_ROWS, TORCH_WARPS, 32)), BLOCK_ROWS, TORCH_WARPS, 32)
    sum_sq = _lane_tree_sum(tl.reshape(warp_sums, (BLOCK_ROWS, 1, TORCH_WARPS)), BLOCK_ROWS, 1, TORCH_WARPS)
    return tl.math.rsqrt(tl.math.div_rn(sum_sq, HIDDEN * 1.0) + eps)


@triton.jit
def _torch_norm_rows(
    x_ptr, n_rows, x_row_stride, x_col_stride, eps, HIDDEN: tl.constexpr, TORCH_WARPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, INDEX_64: tl.constexpr, EMULATE_CASTS: tl.constexpr,
):
    """The prologue of a kernel that normalises whole rows in torch's order: this program's rows and their mask
    (`_row_block`), the pointers to their first channel, and their (BLOCK_ROWS, 1) `_torch_block_rstd`."""
    rows, row_mask = _row_block(n_rows, BLOCK_ROWS, INDEX_64)
    x_rows = x_ptr + rows[:, None] * x_row_stride
    rstd = _torch_block_rstd(
        x_rows, row_mask, x_col_stride, eps, HIDDEN, TORCH_WARPS, BLOCK_ROWS, INDEX_64, EMULATE_CASTS
    )
    return rows, row_mask, x_rows, rstd


@triton.jit
def _norm_modulate_chunk(
    x_rows, weight_ptr, table_row_ptrs, rstd, cols, mask, col_mask, x_col_stride, weight_stride, table_col_stride,
    shift_col, scale_col,
    ROUND_DTYPE: tl.constexpr, EMULATE_CASTS: tl.constexpr,
):
    """One chunk of the output as fp32: normalise (`F.rms_norm`'s one rounding), then `modulate`'s three roundings."""
    x = _to_f32(tl.load(x_rows + cols[None, :] * x_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
    weight = _to_f32(tl.load(weight_ptr + cols * weight_stride, mask=col_mask, other=0.0), EMULATE_CASTS)
    normed = _round_as(weight[None, :] * (rstd * x), ROUND_DTYPE, EMULATE_CASTS)
    scale = tl.load(table_row_ptrs + (scale_col + cols)[None, :] * table_col_stride, mask=mask, other=0.0)
    shift = tl.load(table_row_ptrs + (shift_col + cols)[None, :] * table_col_stride, mask=mask, other=0.0)
    one_plus_scale = _round_as(1.0 + _to_f32(scale, EMULATE_CASTS), ROUND_DTYPE, EMULATE_CASTS)
    y = _round_as(normed * one_plus_scale, ROUND_DTYPE, EMULATE_CASTS)
    return _round_as(y + _to_f32(shift, EMULATE_CASTS), ROUND_DTYPE, EMULATE_CASTS)
