"""Head relayouts around the sequence-head (Ulysses) all-to-alls: `pack_heads` before the exchange, `merge_heads` after.

Reference: `vflash_core.engine.parallel.pack_heads_reference` / `merge_heads_reference`, called by
`SequenceHeadAttention`. Each of P ranks holds S_r rows of all heads = P * Hp heads of D channels; rank j attends heads
[j*Hp, (j+1)*Hp).

* pack:  x (S_r, heads, D) -> destination-major (P, S_r, Hp, D),  out[j, s, h, d] = x[s, j*Hp + h, d]
  (block j is the contiguous part of the send buffer that goes to rank j).
* merge: source-major received (P, S_r, Hp, D) -> (S_r, heads, D),  out[s, i*Hp + h, d] = received[i, s, h, d]
  (block i came back from rank i: the attention output of its heads on this rank's rows).

Both are one strided copy over the index space (P, S_r, Hp, D): the (S_r, heads, D) side is read (pack) or written
(merge) through its view `t.unflatten(1, (P, Hp)).permute(1, 0, 2, 3)`, so a single kernel serves both. Every element
is loaded once and stored once without conversion, so the result equals the reference for every bit pattern (NaN
payloads, signed zeros and subnormals included), with no intermediate tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

__all__ = ["merge_heads", "pack_heads"]


@triton.jit
def _relayout_kernel(
    src_ptr,
    dst_ptr,
    n_rows,
    n_heads,
    src_part_stride,
    src_row_stride,
    src_head_stride,
    src_col_stride,
    dst_part_stride,
    dst_row_stride,
    dst_head_stride,
    dst_col_stride,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """dst[p, s, h, d] = src[p, s, h, d] over (P, S_r, Hp, D), each side addressed through its own four strides.

    pack:  src = x viewed as (P, S_r, Hp, D) (part stride Hp * x's head stride), dst = out.
    merge: src = received, dst = out viewed as (P, S_r, Hp, D).
    Grid: (row blocks, head blocks, P). A tile is BLOCK_ROWS rows x BLOCK_HEADS whole heads of one part, so with unit
    channel strides both the load and the store are runs of D (of BLOCK_HEADS * D for contiguous heads) elements.
    """
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    part = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    if INDEX_64:
        pid_r = pid_r.to(tl.int64)
        pid_h = pid_h.to(tl.int64)
        part = part.to(tl.int64)
        d = d.to(tl.int64)  # the channel stride can be the large one (a transposed view)
    rows = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    heads = pid_h * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    mask = (rows < n_rows)[:, None, None] & (heads < n_heads)[None, :, None] & (d < HEAD_DIM)[None, None, :]

    src = (
        src_ptr + part * src_part_stride + rows[:, None, None] * src_row_stride
        + heads[None, :, None] * src_head_stride
    )
    dst = (
        dst_ptr + part * dst_part_stride + rows[:, None, None] * dst_row_stride
        + heads[None, :, None] * dst_head_stride
    )
    values = tl.load(src + d[None, None, :] * src_col_stride, mask=mask)
    tl.store(dst + d[None, None, :] * dst_col_stride, values, mask=mask)


def relayout_forward(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Launcher: src and dst (P, S_r, Hp, D) of one shape and dtype, any strides, not overlapping; dst = src."""
    parts, n_rows, n_heads, head_dim = src.shape
    if src.numel() == 0:
        return dst
    block_d = triton.next_power_of_2(head_dim)
    tile, grid = _launch.tile_and_grid(n_rows, n_heads, block_d, parts=parts)
    _relayout_kernel[grid](
        src, dst,
        n_rows, n_heads,
        src.stride(0), src.stride(1), src.stride(2), src.stride(3),
        dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3),
        HEAD_DIM=head_dim,
        BLOCK_ROWS=tile.block_rows,
        BLOCK_HEADS=tile.block_groups,
        BLOCK_D=block_d,
        INDEX_64=_launch.needs_int64(src, dst),
        num_warps=tile.num_warps,
        **_launch.COMPILE_OPTIONS,
    )
    return dst


def _check_pair(src: torch.Tensor, dst: torch.Tensor, src_name: str, dst_name: str) -> None:
    if src.dtype != dst.dtype:
        raise TypeError(f"{dst_name} dtype {dst.dtype} differs from {src_name} dtype {src.dtype}")
    _launch.round_dtype(src.dtype)  # bf16 / fp16 / fp32 only, with the package's error message
    _launch.check_device(src, dst)


def pack_heads(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Split this rank's heads by destination rank: out[j, s, h, d] = x[s, j*Hp + h, d], Hp = heads / P.

    x: (S_r, heads, D), bf16/fp16/fp32, any strides, read in place (q / k are contiguous, v is usually a view into the
        fused QKV GEMM output with row stride 3 * heads * D).
    out: (P, S_r, Hp, D) of x's dtype, any strides (contiguous when it is the all-to-all's send buffer), not
        overlapping x. P is read from out.shape[0] and must divide heads.
    Returns out (the signature of `vflash_core.engine.parallel.pack_heads_reference`).
    """
    if x.dim() != 3 or out.dim() != 4:
        raise ValueError(
            f"x must be (S_r, heads, D) and out (P, S_r, heads/P, D), got {tuple(x.shape)} and {tuple(out.shape)}"
        )
    parts = out.shape[0]
    n_rows, heads, head_dim = x.shape
    if parts < 1 or heads % parts:
        raise ValueError(f"out's leading dimension P = {parts} must be >= 1 and divide x's {heads} heads")
    shape = (parts, n_rows, heads // parts, head_dim)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must be {shape} for x {tuple(x.shape)}, got {tuple(out.shape)}")
    _check_pair(x, out, "x", "out")
    relayout_forward(x.unflatten(1, (parts, heads // parts)).permute(1, 0, 2, 3), out)
    return out


def merge_heads(received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Put the heads returned by each source rank back in global order: out[s, i*Hp + h, d] = received[i, s, h, d].

    received: (P, S_r, Hp, D), bf16/fp16/fp32, any strides (contiguous: the all-to-all's receive buffer), P >= 1.
    out: (S_r, P * Hp, D) of received's dtype, any strides (a view is written in place), not overlapping received.
    Returns out (the signature of `vflash_core.engine.parallel.merge_heads_reference`).
    """
    if received.dim() != 4 or out.dim() != 3:
        raise ValueError(
            "received must be (P, S_r, Hp, D) and out (S_r, P*Hp, D), "
            f"got {tuple(received.shape)} and {tuple(out.shape)}"
        )
    parts, n_rows, heads_per_part, head_dim = received.shape
    if parts < 1:
        raise ValueError(f"received must hold at least one part, got {tuple(received.shape)}")
    shape = (n_rows, parts * heads_per_part, head_dim)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must be {shape} for received {tuple(received.shape)}, got {tuple(out.shape)}")
    _check_pair(received, out, "received", "out")
    relayout_forward(received, out.unflatten(1, (parts, heads_per_part)).permute(1, 0, 2, 3))
    return out


