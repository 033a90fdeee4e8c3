"""Partial rotary embedding on q and k, alone (`rope`) or fused with the per-head QK RMSNorm (`qk_norm_rope`).

Reference: `vflash_core.engine.model.rope` / `qk_norm_rope` (per-head `F.rms_norm` of q and k, then rotary). Rotate-half
over the first R channels of each D-channel head (R = 96 of 128 in the released model), pairs (i, i + R/2); channels
>= R pass through. cos/sin are the (S, R) fp32 tables rounded to bf16 *before* use. Both ops write q and k as contiguous
(1, S, heads, D): the layout FA3 (`[B, N, H, D]`) and SDPA-on-permuted-views take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._device import _lane_tree_sum, _round_as, _tile_indices, _to_f32, _to_storage

__all__ = ["qk_norm_rope", "rope"]

#: torch's vectorized CUDA row kernel (`vectorized_layer_norm_kernel`, used by `F.rms_norm` for contiguous rows whose
#: length is a multiple of 4) gives lane t of a 32-lane warp the 4 consecutive channels 4t..4t+3; `qk_norm_rope`
#: reproduces that order, so it is defined for head dims up to 4 * 32 = 128.
_LANES = 32
_VEC = 4

#: Tile size of the fused QK-norm + rope kernel (elements per program), below the package default of 4096. Sweep on an
#: H200 (triton 3.6, torch 2.11, 2026-11; benchmarks/kernels.py --sweep-tiles), 56 heads x 128, S = 19,796 / 38,222:
#: 1024 -> 0.418 / 0.798 ms, 2048 -> 0.437 / 0.835, 4096 -> 0.500 / 0.957, 8192 -> 0.517 / 0.988.
QK_NORM_TILE_ELEMENTS = 1024


@triton.jit
def _rotate_half(x, partner, cos, sin, d, ROTARY: tl.constexpr, ROUND_DTYPE: tl.constexpr, EMULATE_CASTS: tl.constexpr):
    """out_d = bf( bf(x_d * c_d) + bf(r_d * s_d) ) for d < R (r_d = -x_{d+R/2} below R/2, x_{d-R/2} above),
    x_d for d >= R."""
    rotated = tl.where(d < ROTARY // 2, -partner, partner)
    out = _round_as(
        _round_as(x * cos, ROUND_DTYPE, EMULATE_CASTS) + _round_as(rotated * sin, ROUND_DTYPE, EMULATE_CASTS),
        ROUND_DTYPE,
        EMULATE_CASTS,
    )
    return tl.where(d < ROTARY, out, x)


@triton.jit
def _angles(
    cos_ptr, sin_ptr, rows, row_mask, d, cos_row_stride, cos_col_stride, sin_row_stride, sin_col_stride,
    ROTARY: tl.constexpr, EMULATE_CASTS: tl.constexpr,
):
    """The tile's rows of the (S, R) cos / sin tables in fp32, (rows, 1, channels); 0 past R and past the last row."""
    angle_mask = row_mask[:, None] & (d < ROTARY)[None, :]
    cos = tl.load(cos_ptr + rows[:, None] * cos_row_stride + d[None, :] * cos_col_stride, mask=angle_mask, other=0.0)
    sin = tl.load(sin_ptr + rows[:, None] * sin_row_stride + d[None, :] * sin_col_stride, mask=angle_mask, other=0.0)
    return _to_f32(cos, EMULATE_CASTS)[:, None, :], _to_f32(sin, EMULATE_CASTS)[:, None, :]


@triton.jit
def _head_rstd(
    x, eps, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """(rows, heads, 1) `rsqrt(sum_sq / D + eps)` of fp32 x (rows, heads, BLOCK_D), the sum of squares in the lane
    order of torch's kernel (`_qk_norm_rope_kernel`'s docstring)."""
    # lane t holds channels 4t + j, j = 0..3 (x[t, a, b] = 4t+2a+b)
    quads = tl.reshape(x, (BLOCK_ROWS, BLOCK_HEADS, BLOCK_D // 4, 2, 2))
    even, odd = tl.split(quads)  # channels 4t + 2a and 4t + 2a + 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    lane_sum = tl.fma(x3, x3, tl.fma(x2, x2, tl.fma(x1, x1, x0 * x0)))
    sum_sq = _lane_tree_sum(lane_sum, BLOCK_ROWS, BLOCK_HEADS, BLOCK_D // 4)
    return tl.math.rsqrt(tl.math.div_rn(sum_sq, HEAD_DIM * 1.0) + eps)[:, :, None]


@triton.jit
def _norm_weight(q_weight_ptr, k_weight_ptr, channels, mask, is_k, q_weight_stride, k_weight_stride,
                 EMULATE_CASTS: tl.constexpr):
    """The part's norm weight (k's for the k part, else q's) at `channels`, fp32, (1, 1, channels); 0 where masked."""
    weight = tl.where(
        is_k,
        tl.load(k_weight_ptr + channels * k_weight_stride, mask=mask, other=0.0),
        tl.load(q_weight_ptr + channels * q_weight_stride, mask=mask, other=0.0),
    )
    return _to_f32(weight, EMULATE_CASTS)[None, None, :]


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    n_heads,
    x_row_stride,
    x_head_stride,
    x_col_stride,
    cos_row_stride,
    cos_col_stride,
    sin_row_stride,
    sin_col_stride,
    out_row_stride,
    out_head_stride,
    out_col_stride,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """Rotary on one (S, heads, D) tensor (any strides) into out (S, heads, D).

    For d < R/2:      out[s,h,d] = bf( bf(x[s,h,d] * c[s,d]) + bf(-x[s,h,d+R/2] * s[s,d]) )
    For R/2 <= d < R: out[s,h,d] = bf( bf(x[s,h,d] * c[s,d]) + bf( x[s,h,d-R/2] * s[s,d]) )
    For d >= R:       out[s,h,d] = x[s,h,d]
    c, s: (S, R) already rounded to x's dtype. Grid: (row blocks, head blocks); a tile holds whole heads.
    """
    rows, heads = _tile_indices(BLOCK_ROWS, BLOCK_HEADS, INDEX_64)
    d = tl.arange(0, BLOCK_D)
    partner = tl.where(d < ROTARY // 2, d + ROTARY // 2, d - ROTARY // 2)
    row_mask = rows < n_rows
    mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None] & (d < HEAD_DIM)[None, None, :]
    rot_mask = mask & (d < ROTARY)[None, None, :]

    base = x_ptr + rows[:, None, None] * x_row_stride + heads[None, :, None] * x_head_stride
    x = _to_f32(tl.load(base + d[None, None, :] * x_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
    x_partner = _to_f32(tl.load(base + partner[None, None, :] * x_col_stride, mask=rot_mask, other=0.0), EMULATE_CASTS)
    cos, sin = _angles(
        cos_ptr, sin_ptr, rows, row_mask, d, cos_row_stride, cos_col_stride, sin_row_stride, sin_col_stride, ROTARY,
        EMULATE_CASTS,
    )
    out = _rotate_half(x, x_partner, cos, sin, d[None, None, :], ROTARY, ROUND_DTYPE, EMULATE_CASTS)
    out_ptrs = (
        out_ptr + rows[:, None, None] * out_row_stride + heads[None, :, None] * out_head_stride
        + d[None, None, :] * out_col_stride
    )
    tl.store(out_ptrs, _to_storage(out, out_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, out_ptr,
    n_rows, n_heads, eps,
    qkv_row_stride, qkv_col_stride, q_weight_stride, k_weight_stride,
    cos_row_stride, cos_col_stride, sin_row_stride, sin_col_stride,
    out_part_stride, out_row_stride, out_head_stride,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """Per-head RMSNorm then rotary, reading q / k (/ v) straight from the (S, 3*heads*D) QKV GEMM output.

    part p = program_id(2): 0 = q (columns [0, I)), 1 = k ([I, 2I)), 2 = v ([2I, 3I), copied unchanged).
    n[s,h,d]   = bf( w[d] * (rstd[s,h] * x[s,h,d]) )             fp32 products, one rounding (as `F.rms_norm`)
    rstd[s,h]  = rsqrt( sum_sq[s,h] / D + eps )                  IEEE division, hardware rsqrt (as torch's rsqrtf)
    sum_sq     = lane t (of 32) sums x[4t]^2, x[4t+1]^2, x[4t+2]^2, x[4t+3]^2 sequentially (fma), then the 32 lane sums
                 are added by the shuffle-down tree (offsets 16, 8, 4, 2, 1): torch's vectorized CUDA row kernel's
                 order for D <= 128 (lanes past D/4 hold 0, which adds exactly).
    out        = rotary of n exactly as `_rope_kernel` (partner channels normalised the same way).
    Grid: (row blocks, head blocks, parts).
    """
    rows, heads = _tile_indices(BLOCK_ROWS, BLOCK_HEADS, INDEX_64)
    part = tl.program_id(2)
    if INDEX_64:
        part = part.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    partner = tl.where(d < ROTARY // 2, d + ROTARY // 2, d - ROTARY // 2)
    row_mask = rows < n_rows
    row_head_mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None]
    mask = row_head_mask & (d < HEAD_DIM)[None, None, :]
    rot_mask = mask & (d < ROTARY)[None, None, :]

    # column of channel 0 of each head of this part inside the packed row
    head_cols = part * (n_heads * HEAD_DIM) + heads * HEAD_DIM
    base = qkv_ptr + rows[:, None, None] * qkv_row_stride + head_cols[None, :, None] * qkv_col_stride

    x = _to_f32(tl.load(base + d[None, None, :] * qkv_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
    x_partner = _to_f32(
        tl.load(base + partner[None, None, :] * qkv_col_stride, mask=rot_mask, other=0.0), EMULATE_CASTS
    )

    rstd = _head_rstd(x, eps, HEAD_DIM, BLOCK_ROWS, BLOCK_HEADS, BLOCK_D)
    is_k = part == 1
    weight = _norm_weight(q_weight_ptr, k_weight_ptr, d, d < HEAD_DIM, is_k, q_weight_stride, k_weight_stride,
                          EMULATE_CASTS)
    weight_partner = _norm_weight(q_weight_ptr, k_weight_ptr, partner, d < ROTARY, is_k, q_weight_stride,
                                  k_weight_stride, EMULATE_CASTS)
    normed = _round_as(weight * (rstd * x), ROUND_DTYPE, EMULATE_CASTS)
    normed_partner = _round_as(weight_partner * (rstd * x_partner), ROUND_DTYPE, EMULATE_CASTS)

    cos, sin = _angles(
        cos_ptr, sin_ptr, rows, row_mask, d, cos_row_stride, cos_col_stride, sin_row_stride, sin_col_stride, ROTARY,
        EMULATE_CASTS,
    )
    out = _rotate_half(normed, normed_partner, cos, sin, d[None, None, :], ROTARY, ROUND_DTYPE, EMULATE_CASTS)
    out = tl.where(part == 2, x, out)  # v: a plain copy
    out_ptrs = (
        out_ptr + part * out_part_stride + rows[:, None, None] * out_row_stride
        + heads[None, :, None] * out_head_stride + d[None, None, :]
    )
    tl.store(out_ptrs, _to_storage(out, out_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask)


# -- host side ---------------------------------------------------------------------------------------------------------


def angles_views(
    cos: torch.Tensor, sin: torch.Tensor, n_rows: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as (S, R) or the model's (1, S, 1, R) -> (S, R) views (never a copy), R even and in (0, D]."""
    views = []
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == 1:
            t = t[0, :, 0, :]
        if t.dim() != 2 or t.shape[0] != n_rows:
            raise ValueError(f"{name} must be ({n_rows}, R) or (1, {n_rows}, 1, R), got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(
                f"{name} must already be rounded to {dtype} (the reference rounds cos/sin first), got {t.dtype}"
            )
        views.append(t)
    cos2, sin2 = views
    if cos2.shape != sin2.shape:
        raise ValueError(f"cos {tuple(cos2.shape)} and sin {tuple(sin2.shape)} differ")
    rotary = cos2.shape[1]
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(f"rotary width R = {rotary} must be even and in (0, D = {head_dim}]")
    return cos2, sin2


def _head_tile_constants(
    head_dim: int, cos: torch.Tensor, block_d: int, tile: _launch.Tile, x: torch.Tensor, *others: torch.Tensor
) -> dict[str, object]:
    """The compile-time arguments both kernels take: the head and rotary widths (R from the (S, R) `cos`), the rounding
    of `x`'s dtype, the tile, whether `x`, `cos` or `others` need int64 indexing, and the launch options."""
    return {
        "HEAD_DIM": head_dim,
        "ROTARY": cos.shape[1],
        "ROUND_DTYPE": _launch.round_dtype(x.dtype),
        "BLOCK_ROWS": tile.block_rows,
        "BLOCK_HEADS": tile.block_groups,
        "BLOCK_D": block_d,
        "INDEX_64": _launch.needs_int64(x, cos, *others),
        **_launch.launch_options(tile),
    }


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launcher: x (S, heads, D) any strides, cos/sin (S, R) any strides, out (S, heads, D) any strides."""
    n_rows, n_heads, head_dim = x.shape
    if x.numel() == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    tile, grid = _launch.tile_and_grid(n_rows, n_heads, block_d)
    _rope_kernel[grid](
        x, cos, sin, out,
        n_rows, n_heads,
        x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        **_head_tile_constants(head_dim, cos, block_d, tile, x, sin, out),
    )
    return out


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on already-normalised q and k (the `F.rms_norm` outputs), torch's three roundings per channel.

    q, k: (1, S, heads, D) or (S, heads, D), bf16 (or fp16/fp32), any strides (views into a larger buffer are read
        in place). cos, sin: (S, R) or (1, S, 1, R) in q's dtype (already rounded), any strides; R even, R <= D.
    out: optional (2, S, heads, D) buffer of q's dtype, any strides; q goes to out[0], k to out[1].
    Returns (q_out, k_out), each (1, S, heads, D) and contiguous when `out` is not given (views `out[0:1]`,
    `out[1:2]` of one (2, S, heads, D) allocation).
    """
    q3, k3 = _launch.as_rows(q, "q", ("S", "heads", "D")), _launch.as_rows(k, "k", ("S", "heads", "D"))
    if q3.shape != k3.shape or q.dtype != k.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must agree")
    n_rows, n_heads, head_dim = q3.shape
    cos2, sin2 = angles_views(cos, sin, n_rows, head_dim, q.dtype)
    _launch.round_dtype(q.dtype)
    out = _launch.output(out, (2, n_rows, n_heads, head_dim), q.dtype, q.device)
    _launch.check_device(q, k, cos, sin, out)
    rope_forward(q3, cos2, sin2, out[0])
    rope_forward(k3, cos2, sin2, out[1])
    return out[0:1], out[1:2]


def qk_norm_rope(
    qkv: torch.Tensor,
    norm_q_weight: torch.Tensor,
    norm_k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    head_dim: int,
    copy_v: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused per-head QK RMSNorm + rotary, reading the fused QKV GEMM output in place.

    qkv: (S, 3I) or (1, S, 3I) bf16 (or fp16/fp32), [q | k | v] with I = heads * head_dim, any strides.
    norm_q_weight, norm_k_weight: (D,) in qkv's dtype (`attn.norm_q.weight`, `attn.norm_k.weight`), any stride.
    eps: the QK-norm epsilon (used in fp32, as torch does). head_dim: D, a multiple of 4 and at most 128.
    cos, sin: (S, R) or (1, S, 1, R) in qkv's dtype (already rounded); R even, R <= D.
    copy_v: also write v as a contiguous (1, S, heads, D) copy; by default v is returned as the strided view
        `qkv[..., 2I:].unflatten(-1, (heads, D))` (what the reference passes to attention; SDPA and FA3 take it).
    out: optional (2 + copy_v, S, heads, D) buffer of qkv's dtype whose channel stride is 1.
    Returns (q, k, v): q and k (and a copied v) are contiguous (1, S, heads, D) views `out[0:1]`, `out[1:2]`
    (`out[2:3]`) of one allocation.

    Numerics: the RMSNorm is `F.rms_norm`'s formula (`bf(x * rsqrt(mean(x^2) + eps) * w)`, weight in fp32 before the
    single rounding) with the sum of squares in the order of torch's vectorized CUDA kernel (see the kernel
    docstring). Measured bit for bit equal to `F.rms_norm` + `rope` on an H200 (torch 2.11, triton 3.6; 0 differing
    elements at S = 19,796, 38,222 and 100,000, full width). It relies on torch's kernel choice, so re-check with
    `pytest -m gpu tests/test_kernels.py -k rope -s` after a torch upgrade or on another GPU, and use
    `F.rms_norm` + `rope` where it differs.
    """
    qkv2 = _launch.as_rows(qkv, "qkv")
    n_rows, width = qkv2.shape
    check_head_dim(head_dim)
    if width % (3 * head_dim):
        raise ValueError(f"qkv width {width} is not 3 * heads * {head_dim}")
    n_heads = width // (3 * head_dim)
    for name, w in (("norm_q_weight", norm_q_weight), ("norm_k_weight", norm_k_weight)):
        if w.shape != (head_dim,) or w.dtype != qkv.dtype:
            raise ValueError(f"{name} must be ({head_dim},) {qkv.dtype}, got {tuple(w.shape)} {w.dtype}")
    cos2, sin2 = angles_views(cos, sin, n_rows, head_dim, qkv.dtype)
    _launch.round_dtype(qkv.dtype)  # a dtype the kernel cannot round in is refused, even for no rows
    shape = (3 if copy_v else 2, n_rows, n_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    elif tuple(out.shape) != shape or out.dtype != qkv.dtype or (out.numel() and out.stride(3) != 1):
        raise ValueError(f"out must be {shape} {qkv.dtype} with channel stride 1, got {tuple(out.shape)} {out.dtype}")
    _launch.check_device(qkv, norm_q_weight, norm_k_weight, cos, sin, out)
    launch_qk_norm_rope(qkv2, norm_q_weight, norm_k_weight, cos2, sin2, out, n_heads, head_dim, float(eps))
    inner = n_heads * head_dim
    v = out[2:3] if copy_v else qkv2[None, :, 2 * inner :].unflatten(-1, (n_heads, head_dim))
    return out[0:1], out[1:2], v


def check_head_dim(head_dim: int) -> None:
    """The head widths the kernel handles: a multiple of its vector width, one warp's lanes at most."""
    if head_dim % _VEC or not 0 < head_dim <= _VEC * _LANES:
        raise ValueError(f"head_dim must be a multiple of {_VEC} in [4, {_VEC * _LANES}], got {head_dim}")


def launch_qk_norm_rope(
    rows: torch.Tensor, norm_q_weight: torch.Tensor, norm_k_weight: torch.Tensor, cos2: torch.Tensor,
    sin2: torch.Tensor, out: torch.Tensor, n_heads: int, head_dim: int, eps: float,
) -> None:
    """The kernel over (S, parts * heads * D) `rows` ([q | k | v] parts, any strides) into the (parts, S, heads, D)
    `out`, for its first `out.shape[0]` parts: q (and k, and a copied v); cos2 / sin2 (S, R) as `angles_views`
    gives them. Checks are the callers'."""
    if not rows.numel():
        return
    block_d = triton.next_power_of_2(head_dim)
    tile, grid = _launch.tile_and_grid(
        rows.shape[0], n_heads, block_d, parts=out.shape[0], target_elements=QK_NORM_TILE_ELEMENTS
    )
    _qk_norm_rope_kernel[grid](
        rows, norm_q_weight, norm_k_weight, cos2, sin2, out,
        rows.shape[0], n_heads, eps,
        rows.stride(0), rows.stride(1),
        norm_q_weight.stride(0), norm_k_weight.stride(0),
        cos2.stride(0), cos2.stride(1),
        sin2.stride(0), sin2.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        **_head_tile_constants(head_dim, cos2, block_d, tile, rows, sin2, out),
    )
