"""`@triton.jit` helpers shared by the kernels: the per-op rounding of the model, torch's 32-lane tree sum, and the
index arithmetic of a program's tile (integer only; every helper is inlined into its kernel).

Rounding contract (the model's, which diffusers' H3 transformer defines): every torch elementwise op on bf16 tensors
computes in fp32 and rounds its own output to bf16 (round to nearest, ties to even). The kernels keep each intermediate
in fp32 and call `_round_as` exactly where torch rounds, so an fp32 value that is exactly representable in the storage
dtype flows between the "ops". For fp32 tensors the rounding is the identity (torch's fp32 ops round to fp32
themselves).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
