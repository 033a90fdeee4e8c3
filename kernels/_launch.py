"""Host-side helpers shared by every op launcher: interpreter detection, index width, tile settings, validation.

Nothing here touches the device (no synchronisation, no allocation): launchers call these on shapes and strides only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

#: True when the kernels run in Triton's CPU interpreter: `triton.jit` reads TRITON_INTERPRET
#: (`knobs.runtime.interpret`, triton >= 3.6) when it decorates a function, so this is fixed when the package is
#: imported. Launchers then pass
#: `EMULATE_CASTS=True` (the interpreter casts fp32 -> bf16 by truncation instead of round-to-nearest-even, and flushes
#: bf16 subnormals in both directions, so the kernels convert on bit patterns instead) and `USE_LIBDEVICE=False` (the
#: interpreter cannot call libdevice; numpy's `exp` stands in for `__nv_expf`).
INTERPRET: bool = bool(triton.knobs.runtime.interpret)

INT32_MAX = 2**31 - 1


# -- index width ----------------------------------------------------------------------------------------------------


def addressed_span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Largest element offset a kernel can form inside a tensor: sum((size - 1) * |stride|), 0 for an empty one.

    This, not `numel()`, bounds the offset arithmetic: a strided view (a column block of the AdaLN table with row
    stride 6H, q inside the packed QKV rows) addresses far more than its logical size.
    """
    if len(shape) != len(strides):
        raise ValueError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in length")
    if any(int(n) == 0 for n in shape):
        return 0
    return sum((int(n) - 1) * abs(int(s)) for n, s in zip(shape, strides))


def needs_int64(*views: torch.Tensor | tuple[Sequence[int], Sequence[int]]) -> bool:
    """The index-width rule: True (use the kernel's `INDEX_64=True` variant) when any addressed span exceeds 2**31 - 1.

    Each view is a tensor (its shape and strides are read, nothing is allocated or synchronised) or a
    `(shape, strides)` pair, so the rule can be checked on fake shapes. Kernels compiled with `INDEX_64=True` widen
    program ids and row/column indices to int64 *before* multiplying by strides; otherwise all offsets stay int32.
    Masked-off lanes past the end of a tensor may form wrapped offsets in int32, which is harmless: they are never
    dereferenced.
    """
    spans = (addressed_span(v.shape, v.stride()) if isinstance(v, torch.Tensor) else addressed_span(*v) for v in views)
    return any(span > INT32_MAX for span in spans)


# -- launch settings -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """One program's tile: `block_rows` rows x `block_groups` column groups of `group_size` elements each."""

    block_rows: int
    block_groups: int
    num_warps: int


#: Elements per program that the heuristic aims for (8 KiB of bf16 per operand): enough 16-byte vectors per thread to
#: keep loads in flight, small enough for thousands of programs at S ~ 20k. Sweep on an H200 (triton 3.6, torch 2.11,
#: 2026-11; benchmarks/kernels.py --sweep-tiles, N = 19,796 / 38,222): modulate, norm_out and the gated residual are
#: within 1 % of each other from 1024 to 8192; SwiGLU is 13 % slower at 8192 and rope 2 % slower at 1024, so 4096.
#: (The fused QK-norm + rope uses its own, `rope.QK_NORM_TILE_ELEMENTS`.)
TARGET_TILE_ELEMENTS = 4096


def elementwise_tile(n_rows: int, n_groups: int, group_size: int = 1, target_elements: int | None = None) -> Tile:
    """THE launch-settings heuristic of every op in this package (documented here, nowhere else).

    The problem is `n_rows` rows of `n_groups` column groups; a group of `group_size` elements (a power of two) is
    never split across programs (1 for plain columns; the padded head width for the per-head rotary kernels).
    `target_elements` (a power of two; default `TARGET_TILE_ELEMENTS`) is the tile size aimed for; an op passes its
    own only with the measurement that justifies it beside the constant.

    * `block_groups`: a power of two with `block_groups * group_size` in [256, 2048] elements (or the whole row,
      rounded up to a power of two, when that is smaller), choosing the one that leaves the fewest masked lanes in the
      last column block, the larger on ties. H = 5376 = 21 * 256 gives 256 (no waste), F = 14336 = 7 * 2048 gives
      2048, 56 heads of 128 give 8 heads (1024 elements, no waste).
    * `block_rows`: `target_elements // (block_groups * group_size)`, at least 1, at most the row count rounded up
      to a power of two.
    * `num_warps`: one warp per 512 tile elements, clamped to [1, 8] (4096 elements -> 8 warps, 16 per thread).
    """
    if group_size < 1 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two, got {group_size}")
    target = TARGET_TILE_ELEMENTS if target_elements is None else int(target_elements)
    n_rows, n_groups = max(int(n_rows), 1), max(int(n_groups), 1)
    whole = triton.next_power_of_2(n_groups)
    candidates = [
        g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if 256 <= g * group_size <= 2048 and g <= whole
    ]
    if not candidates:  # rows narrower than 256 elements (or a single group wider than 2048): one block per row
        candidates = [min(whole, max(1, 2048 // group_size))]
    waste = lambda g: -n_groups % g  # masked groups in the last column block
    block_groups = min(candidates, key=lambda g: (waste(g), -g))
    tile_cols = block_groups * group_size
    block_rows = max(1, min(target // tile_cols, triton.next_power_of_2(n_rows)))
    num_warps = max(1, min(8, (block_rows * tile_cols) // 512))
    return Tile(block_rows, block_groups, num_warps)


def tile_and_grid(
    n_rows: int, n_groups: int, group_size: int = 1, *, parts: int | None = None, target_elements: int | None = None
) -> tuple[Tile, tuple[int, ...]]:
    """`elementwise_tile` and its grid: (row blocks, column-group blocks), with a third axis of `parts` if given."""
    tile = elementwise_tile(n_rows, n_groups, group_size, target_elements)
    grid = (triton.cdiv(n_rows, tile.block_rows), triton.cdiv(n_groups, tile.block_groups))
    return tile, grid if parts is None else (*grid, parts)


# -- validation at the API boundary ---------------------------------------------------------------------------------


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device CUDA unless the kernels run in the interpreter (which takes CPU)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"vflash_kernels ops run on CUDA tensors (got {device}); on the CPU use the torch reference in "
            "`vflash_core.engine.model` each op, or set TRITON_INTERPRET=1 before importing vflash_kernels to run the "
            "kernels in Triton's interpreter"
        )


def as_rows(x: torch.Tensor, name: str, dims: tuple[str, ...] = ("S", "N")) -> torch.Tensor:
    """x of shape `dims` or (1, *dims) -> a view of shape `dims` with the same strides (never a copy)."""
    if x.dim() == len(dims) + 1 and x.shape[0] == 1:
        return x[0]
    if x.dim() != len(dims):
        shape = ", ".join(dims)
        raise ValueError(f"{name} must be ({shape}) or (1, {shape}), got shape {tuple(x.shape)}")
    return x


_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def round_dtype(dtype: torch.dtype):
    """The `tl` dtype whose rounding the kernel applies after each op: the dtype torch would compute the op in."""
    import triton.language as tl

    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; the kernels take bfloat16, float16 or float32 tensors")
    return getattr(tl, _TL_DTYPES[dtype])


def check_index(index: torch.Tensor, n_rows: int, name: str) -> None:
    """A 1-D int32/int64 row index with one entry per row (values are not checked: that would synchronise)."""
    if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1 or index.shape[0] != n_rows:
        raise ValueError(
            f"{name} must be a 1-D int32/int64 tensor of {n_rows} entries, got {tuple(index.shape)} {index.dtype}"
        )


def output(out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The caller's `out` after checking its shape and dtype, or a new contiguous tensor."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"out must be {tuple(shape)} {dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


#: Launch keyword passed to every kernel: no fp contraction, so `a * b + c` in fp32 stays two roundings as in torch
#: (with bf16 storage the intermediate conversions already prevent it; for fp32 tensors this keeps parity).
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def launch_options(tile: Tile) -> dict[str, object]:
    """The keywords every converting kernel's launch ends with: `EMULATE_CASTS` (see `INTERPRET`), the tile's warps and
    `COMPILE_OPTIONS`."""
    return {"EMULATE_CASTS": INTERPRET, "num_warps": tile.num_warps, **COMPILE_OPTIONS}
