"""The video VAE decoder's norms and scaled residuals (`vflash_core.media.vae_vit`, `DecoderOps` and `block`).

References (each op's, in `vflash_core.media.vae_vit.DecoderOps`): `norm` = `F.rms_norm(x.float(), (D,), w, eps)`
rounded to the compute dtype; `qk_norm_rope` = the same norm per head without a weight, rounded back to q's dtype,
then rotate-half rotary over the leading R channels; `scaled_residual` = `h + y * scale` (fp32 scale, so the product
rounds in fp32, then the sum). The decoder's SwiGLU is `value * F.silu(gate)` on [value | gate], which is
`swiglu.swiglu` as it stands.

The norms sum squares in the order of torch's vectorized CUDA RMSNorm (`rms_norm_modulate`'s module docstring: 4-element
vectors per thread, fma, 32-lane shuffle tree, then 4 warps), which torch uses for `F.rms_norm` of contiguous fp32 rows
whose length is a multiple of 4. The decoder's stream is fp32, so its squares are not exact in fp32 and the fma matters:
the tests' `rms_norm_cast_reference` (tests/kernel_references.py) emulates it exactly (an fp32 fma computed in fp64
rounded to odd, then to fp32), which is what the CPU tests compare with; bit parity with `F.rms_norm` itself is the
GPU test's.
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
    _round_as,
    _row_chunk,
    _tile_indices,
    _to_f32,
    _to_storage,
    _torch_norm_rows,
)
from .rope import angles_views, check_head_dim, launch_qk_norm_rope

__all__ = ["head_rms_norm_rope", "rms_norm_cast", "scaled_residual"]


@triton.jit
def _rms_norm_cast_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    n_rows,
    eps,
    x_row_stride,
    x_col_stride,
    weight_stride,
    out_row_stride,
    out_col_stride,
    HIDDEN: tl.constexpr,
    TORCH_WARPS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """out[s,c] = OUT( w[c] * (rstd[s] * x[s,c]) )  (or OUT( rstd[s] * x[s,c] ) without a weight), x widened to fp32.

    Every product is an fp32 op (`F.rms_norm` of an fp32 tensor), then one rounding to OUT_DTYPE (the `.to(dtype)`).
    rstd[s] = rsqrt( sum_sq[s] / H + eps ) with sum_sq in torch's block order (`_torch_block_rstd`).
    Grid: (row blocks,); each program reads its rows twice, chunk by chunk of 4 * 32 * TORCH_WARPS channels.
    """
    CHUNK: tl.constexpr = 4 * 32 * TORCH_WARPS
    rows, row_mask, x_rows, rstd = _torch_norm_rows(
        x_ptr, n_rows, x_row_stride, x_col_stride, eps, HIDDEN, TORCH_WARPS, BLOCK_ROWS, INDEX_64, EMULATE_CASTS
    )
    out_rows = out_ptr + rows[:, None] * out_row_stride
    for start in range(0, HIDDEN, CHUNK):
        cols, col_mask, mask = _row_chunk(start, HIDDEN, row_mask, CHUNK, INDEX_64)
        x = _to_f32(tl.load(x_rows + cols[None, :] * x_col_stride, mask=mask, other=0.0), EMULATE_CASTS)
        y = rstd * x
        if HAS_WEIGHT:
            weight = _to_f32(tl.load(weight_ptr + cols * weight_stride, mask=col_mask, other=0.0), EMULATE_CASTS)
            y = weight[None, :] * y
        y = _round_as(y, OUT_DTYPE, EMULATE_CASTS)
        tl.store(
            out_rows + cols[None, :] * out_col_stride, _to_storage(y, out_ptr.dtype.element_ty, EMULATE_CASTS),
            mask=mask
        )


@triton.jit
def _scaled_residual_kernel(
    h_ptr,
    y_ptr,
    scale_ptr,
    out_ptr,
    n_rows,
    n_cols,
    h_row_stride,
    h_col_stride,
    y_row_stride,
    y_col_stride,
    scale_stride,
    out_row_stride,
    out_col_stride,
    PRODUCT_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    INDEX_64: tl.constexpr,
    EMULATE_CASTS: tl.constexpr,
):
    """out[s, c] = OUT( h[s, c] + PRODUCT( y[s, c] * scale[c] ) ): torch's two ops, each in its promoted dtype.

    Every element is loaded before the same program stores it, so `out` may be `h` (in-place update).
    Grid: (row blocks, column blocks).
    """
    rows, cols = _tile_indices(BLOCK_ROWS, BLOCK_COLS, INDEX_64)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    h = _to_f32(
        tl.load(h_ptr + rows[:, None] * h_row_stride + cols[None, :] * h_col_stride, mask=mask, other=0.0),
        EMULATE_CASTS
    )
    y = _to_f32(
        tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :] * y_col_stride, mask=mask, other=0.0),
        EMULATE_CASTS
    )
    scale = _to_f32(tl.load(scale_ptr + cols * scale_stride, mask=col_mask, other=0.0), EMULATE_CASTS)
    product = _round_as(y * scale[None, :], PRODUCT_DTYPE, EMULATE_CASTS)
    result = _round_as(h + product, OUT_DTYPE, EMULATE_CASTS)
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride,
        _to_storage(result, out_ptr.dtype.element_ty, EMULATE_CASTS), mask=mask
    )


# -- host side ---------------------------------------------------------------------------------------------------------


def _norm_eps(eps: float | None) -> float:
    """`F.rms_norm`'s eps for an fp32 input: the given one, or fp32's machine epsilon when None."""
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """(..., N) -> an (M, N) view (never a copy)."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} {tuple(x.shape)} with strides {x.stride()} is not viewable as rows") from None


def rms_norm_cast(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """`F.rms_norm(x.float(), (D,), weight, eps).to(out_dtype)` in one pass, without the fp32 normalised tensor.

    x: (..., D) bf16 / fp16 / fp32 whose leading dims flatten to rows without a copy; D a multiple of 4. weight: (D,)
    fp32 or None. eps: None means fp32's machine epsilon, as torch has it. Returns a contiguous (..., D) `out_dtype`.
    The sum of squares runs in torch's vectorized CUDA order (module docstring).
    """
    x2 = _rows(x, "x")
    n_rows, hidden = x2.shape
    if hidden % _VEC:
        raise ValueError(f"norm width {hidden} is not a multiple of {_VEC}: F.rms_norm would not use its vector kernel")
    if weight is not None and (weight.shape != (hidden,) or weight.dtype != torch.float32):
        raise ValueError(f"weight must be ({hidden},) float32, got {tuple(weight.shape)} {weight.dtype}")
    _launch.round_dtype(x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch.check_device(x, out, *(() if weight is None else (weight,)))
    out2 = out.view(-1, hidden)
    if n_rows:
        tile = _launch.elementwise_tile(n_rows, 1, _CHUNK)
        _rms_norm_cast_kernel[(triton.cdiv(n_rows, tile.block_rows),)](
            x2, x2 if weight is None else weight, out2,
            n_rows, _norm_eps(eps),
            x2.stride(0), x2.stride(1),
            0 if weight is None else weight.stride(0),
            out2.stride(0), out2.stride(1),
            HIDDEN=hidden,
            TORCH_WARPS=_TORCH_WARPS,
            HAS_WEIGHT=weight is not None,
            OUT_DTYPE=_launch.round_dtype(out_dtype),
            BLOCK_ROWS=tile.block_rows,
            INDEX_64=_launch.needs_int64(x2, out2),
            **_launch.launch_options(tile),
        )
    return out


#: (Dh,) weights of ones per (Dh, dtype, device), for the q/k norm's kernel (made once, not per call).
_UNIT_WEIGHTS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _unit_weight(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (head_dim, dtype, device)
    if key not in _UNIT_WEIGHTS:
        _UNIT_WEIGHTS[key] = torch.ones(head_dim, dtype=dtype, device=device)
    return _UNIT_WEIGHTS[key]


def head_rms_norm_rope(x: torch.Tensor, eps: float | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm without a weight in fp32, rounded back to x's dtype, then rotate-half rotary over the leading R
    channels: `apply_rotary(F.rms_norm(x.float(), (Dh,), None, eps).to(x.dtype), cos, sin)`.

    x: (W, S, heads, Dh) bf16 / fp16 / fp32 whose (W, S) rows flatten without a copy (a linear layer's output),
    Dh a multiple of 4 and at most 128. cos, sin: (W S, R) in x's dtype, window w's rows at [w S, (w + 1) S) (the
    tile-windows' shared (S, R) table repeated W times); R even, R <= Dh. Returns a contiguous (W, S, heads, Dh).

    `rope.qk_norm_rope`'s kernel over the one tensor: its norm times a weight of ones is this norm (1.0 * v = v), and
    for Dh <= 128 its lane order is torch's vectorized CUDA order.
    """
    count, seq, heads, head_dim = x.shape
    check_head_dim(head_dim)
    rows = _rows(x.flatten(2, 3), "x")  # (W S, heads Dh)
    cos2, sin2 = angles_views(cos, sin, rows.shape[0], head_dim, x.dtype)
    _launch.round_dtype(x.dtype)  # a dtype the kernel cannot round in is refused, even for no rows
    out = torch.empty((1, rows.shape[0], heads, head_dim), dtype=x.dtype, device=x.device)  # one part: q alone
    unit = _unit_weight(head_dim, x.dtype, x.device)
    _launch.check_device(x, cos, sin, out)
    launch_qk_norm_rope(rows, unit, unit, cos2, sin2, out, heads, head_dim, _norm_eps(eps))
    return out.view(count, seq, heads, head_dim)


def scaled_residual(
    h: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, *, inplace: bool = False
) -> torch.Tensor:
    """`h + y * scale` with torch's type promotion and two roundings, in one pass.

    h: (..., D) residual stream (fp32, or bf16 for the decoder's first block); y: (..., D) a projection's output in
    the compute dtype; scale: (D,) (fp32 in the decoder). h and y flatten to rows without a copy. inplace: write into h
    and return it (h must then have the result's dtype). Returns the result, contiguous unless in place.
    """
    product_dtype = torch.promote_types(y.dtype, scale.dtype)
    out_dtype = torch.promote_types(h.dtype, product_dtype)
    if h.shape != y.shape or scale.shape != (h.shape[-1],):
        raise ValueError(f"h {tuple(h.shape)}, y {tuple(y.shape)} and scale {tuple(scale.shape)} do not agree")
    if inplace and h.dtype != out_dtype:
        raise ValueError(f"an in-place update needs h in the result's dtype {out_dtype}, got {h.dtype}")
    out = h if inplace else torch.empty(h.shape, dtype=out_dtype, device=h.device)
    _launch.check_device(h, y, scale, out)
    h2, y2, out2 = _rows(h, "h"), _rows(y, "y"), _rows(out, "out")
    n_rows, n_cols = h2.shape
    if n_rows and n_cols:
        tile, grid = _launch.tile_and_grid(n_rows, n_cols)
        _scaled_residual_kernel[grid](
            h2, y2, scale, out2,
            n_rows, n_cols,
            h2.stride(0), h2.stride(1),
            y2.stride(0), y2.stride(1),
            scale.stride(0),
            out2.stride(0), out2.stride(1),
            PRODUCT_DTYPE=_launch.round_dtype(product_dtype),
            OUT_DTYPE=_launch.round_dtype(out_dtype),
            BLOCK_ROWS=tile.block_rows,
            BLOCK_COLS=tile.block_groups,
            INDEX_64=_launch.needs_int64(h2, y2, out2),
            **_launch.launch_options(tile),
        )
    return out
