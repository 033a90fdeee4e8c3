"""Parity of the Triton kernels in `vflash_kernels` with their PyTorch references (the model's BF16 rounding contract).

CPU tests run the kernels in Triton's interpreter, through `kernel_harness.interp`: a private copy of the package
decorated for it (`tests/kernel_harness.py` says how). One consequence for kernel code: triton's own `@jit` library
functions (`tl.sum`, `tl.max`, `tl.sigmoid`, ...) were decorated for the GPU when triton was imported, and the
interpreted copy cannot call them; the kernels use builtins (`tl.reduce` with their own combine function, `tl.exp`,
...) instead.

What the interpreter covers, and what it cannot:
* bf16 is checked **bit for bit**. The interpreter casts fp32 -> bf16 by truncation, not round-to-nearest-even (and
  flushes bf16 subnormals to zero in both directions), so the launchers pass `EMULATE_CASTS=True` there: `_round_as`,
  `_to_f32` and `_to_storage` convert on bit patterns instead (`test_rne_emulation_matches_torch` checks that against
  torch on 20,000 random fp32 patterns). Everything else (indexing, strides, masks, gathers, op order, the reduction
  order of the fused QK norm) is the code the GPU runs.
* fp32 is checked bit for bit for modulate, gated residual and rope (plain IEEE fp32 ops on both sides).
* Not covered on the CPU, only by the `gpu` tests: the hardware `cvt.rn.bf16.f32` branch of `_round_as`; libdevice
  `__nv_expf` in SwiGLU (the interpreter cannot call libdevice, numpy's `exp` stands in, so fp32 SwiGLU differs from
  torch's CPU `exp` by a few ulp and is checked with a tolerance); the GPU `rsqrt` in the fused QK norm (the
  interpreter computes `1 / sqrt`); compiler effects such as fp contraction (disabled by `enable_fp_fusion=False`).

GPU tests (`-m gpu`) compare against the torch reference on CUDA with atol = rtol = 0 at the full width of the
released model, including addressed spans beyond 2**31 elements (the int64 index variant). The fused QK-norm + rope is
compared with `F.rms_norm` + rope and only *reported*: it decides whether the integrator may use it.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
import triton.language as tl
from kernel_harness import (
    DTYPES,
    FFN,
    H_FULL,
    HEAD_DIM,
    HEADS,
    INTERPRETED_PACKAGE,
    ROTARY,
    S_CPU,
    S_GPU,
    S_SMALL_TILE,
    TILES,
    adaln_table,
    assert_all_written,
    assert_bitwise,
    compiled_kernels,
    configure,
    generator,
    interpreter_rows,
    modulate_reference,
    packed_qkv,
    poisoned,
    randn,
    strided,
    ulp_distance,
)
from kernel_references import gate_blocks, rms_norm_warp_order_reference, shift_scale_blocks

from vflash_core.engine import model as reference  # the torch reference of every kernel op

# -- CPU: host-side logic (no kernels run) -------------------------------------------------------------------------


def test_index_width_rule_on_fake_shapes():
    """The 32/64-bit choice from shapes and strides only (nothing allocated), at the model's real sizes."""
    launch = compiled_kernels()._launch
    span, needs = launch.addressed_span, launch.needs_int64
    H, I, F_ = 5376, 7168, 14336
    assert span((0, 5), (5, 1)) == 0 and span((1,), (7,)) == 0
    assert span((3, 4), (-4, 1)) == 8 + 3
    # AdaLN table column block: (6, H) view with row stride 6H spans far more than its 6H elements, still small
    assert span((6, H), (6 * H, 1)) == 5 * 6 * H + H - 1 and not needs(((6, H), (6 * H, 1)))
    # the exact border: 2**31 - 1 is the largest int32 offset
    assert not needs(((2, 2**30), (2**30, 1)))  # span 2**31 - 1
    assert needs(((2, 2**30 + 1), (2**30 + 1, 1)))  # span 2**31 + 1
    # SwiGLU input (S, 2F): 75,000 rows exceed 2**31 addressed elements, the (S, F) output does not
    assert needs(((75_000, 2 * F_), (2 * F_, 1))) and not needs(((75_000, F_), (F_, 1)))
    assert not needs(((74_000, 2 * F_), (2 * F_, 1)))
    # q as a strided view of the packed (S, 3I) QKV rows: span counts the row stride 3I, not the view's size I
    assert needs(((100_000, 56, 128), (3 * I, 128, 1)))
    assert not needs(((99_000, 56, 128), (3 * I, 128, 1)))
    assert not needs(((100_000, 56, 128), (I, 128, 1)))  # the same q contiguous: 7.2e8 elements
    # a transposed view reaches its far corner through the column stride
    assert needs(((8, 300_000_000), (1, 8)))
    # tensors work too (strides read, nothing synchronised)
    assert needs(torch.empty_strided((2, 3), (2**31, 1), device="meta")) and not needs(torch.empty(4, 4, device="meta"))


def test_elementwise_tiles_fit_the_released_widths_and_stay_powers_of_two():
    launch = compiled_kernels()._launch
    tile = launch.elementwise_tile
    assert tile(19_796, 5376) == launch.Tile(16, 256, 8)  # H = 21 * 256: no masked lanes
    assert tile(19_796, 14336) == launch.Tile(2, 2048, 8)  # F = 7 * 2048
    assert tile(19_796, 56, 128) == launch.Tile(4, 8, 8)  # 8 heads of 128 channels
    for rows, groups, size in [(37, 24, 1), (37, 40, 1), (1, 1, 1), (37, 2, 16), (5, 3, 128), (100_000, 7168, 1)]:
        t = tile(rows, groups, size)
        for value in (t.block_rows, t.block_groups):
            assert value >= 1 and value & (value - 1) == 0, t
        assert 1 <= t.num_warps <= 8 and t.block_rows <= max(1, 2 ** (rows - 1).bit_length()), t
    with pytest.raises(ValueError):
        tile(4, 4, 3)


def test_cpu_tensors_need_the_interpreter():
    kernels = compiled_kernels()
    if kernels._launch.INTERPRET:
        pytest.skip("TRITON_INTERPRET is set for the whole process")
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.swiglu.swiglu(torch.zeros(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="table"):
        kernels.modulate.modulate(x, torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long), **shift_scale_blocks("msa"))


# -- CPU: the kernels in the interpreter ---------------------------------------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which,hidden", [("msa", 24), ("mlp", 40), ("out", 24)])
def test_modulate_interpreter(interp, monkeypatch, request, which, hidden, dtype, tile):
    configure(interp, monkeypatch, tile)
    rows = interpreter_rows(tile)
    g = generator(request)
    n_blocks = reference.MODULATION_BLOCKS[which].count
    table_rows = 6 if n_blocks == 6 else 2
    # the table is a strided view (rows padded) and normed a (1, S, H) tensor
    table = strided((table_rows, n_blocks * hidden), dtype, g, scale=0.5)
    normed = randn((1, rows, hidden), dtype, g)
    idx = torch.randint(0, table_rows, (rows,), generator=g)
    out_dtype = torch.float32 if which == "out" else None
    out = poisoned(normed.shape, out_dtype or dtype)
    result = interp.modulate.modulate(normed, table, idx, **shift_scale_blocks(which), out=out, out_dtype=out_dtype)
    assert result is out
    assert_all_written(out, "modulate")
    assert_bitwise(out, modulate_reference(normed, table, idx, which, out_dtype), f"modulate {which}")


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["new", "inplace", "out"])
def test_gated_residual_interpreter(interp, monkeypatch, request, mode, dtype, tile):
    configure(interp, monkeypatch, tile)
    rows = interpreter_rows(tile)
    g = generator(request)
    hidden = 40
    table = strided((6, 6 * hidden), dtype, g, scale=0.5)
    x = randn((1, rows, hidden), dtype, g)
    y = strided((rows, hidden), dtype, g)[None]  # the sublayer output as a strided view
    idx = torch.randint(0, 6, (rows,), generator=g, dtype=torch.int32)
    for which in ("msa", "mlp"):
        expected = reference.gated_residual(x, y, table, idx.long(), which)
        if mode == "inplace":
            x_run = x.clone()
            result = interp.gated_residual.gated_residual(x_run, y, table, idx, **gate_blocks(which), inplace=True)
            assert result is x_run
        elif mode == "out":
            result = interp.gated_residual.gated_residual(x, y, table, idx, **gate_blocks(which), out=poisoned(x.shape, dtype))
        else:
            result = interp.gated_residual.gated_residual(x, y, table, idx, **gate_blocks(which))
        assert_all_written(result, "gated_residual")
        assert_bitwise(result, expected, f"gated residual {which} {mode}")


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("width", [48, 40])
def test_swiglu_interpreter_bf16(interp, monkeypatch, request, width, tile):
    configure(interp, monkeypatch, tile)
    rows = interpreter_rows(tile)
    g = generator(request)
    p = strided((rows, 2 * width), torch.bfloat16, g, scale=3.0)  # packed rows with padding: row stride > 2F
    out = poisoned((rows, width), torch.bfloat16)
    interp.swiglu.swiglu(p, out=out)
    assert_all_written(out, "swiglu")
    assert_bitwise(out, reference.swiglu(p), "swiglu bf16")


def test_swiglu_interpreter_fp32(interp, request):
    """fp32 has no output rounding to hide the `exp` implementation: numpy's (interpreter) vs torch's CPU one."""
    g = generator(request)
    p = randn((1, S_CPU, 96), torch.float32, g, scale=3.0)
    out = poisoned((1, S_CPU, 48), torch.float32)
    interp.swiglu.swiglu(p, out=out)
    assert_all_written(out, "swiglu fp32")
    torch.testing.assert_close(out, reference.swiglu(p), rtol=4e-7, atol=1e-30)


def test_swiglu_interpreter_many_bf16_values(interp, request):
    """Every finite bf16 gate value of moderate magnitude once (the silu rounding is where exp differences could show)."""
    gate = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate[gate.float().abs() < 100]
    value = torch.ones_like(gate)
    p = torch.cat([value[:, None], gate[:, None]], dim=1)  # one row per value: (N, 2)
    assert_bitwise(interp.swiglu.swiglu(p), reference.swiglu(p), "swiglu over bf16 gates")




def _angles(S, R, dtype, g, layout):
    """bf16-rounded cos / sin as (S, R) strided views or in the model's (1, S, 1, R) layout."""
    angles = torch.rand((S, R // 2), generator=g) * 6.3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    if layout == "model":
        return cos.to(dtype)[None, :, None, :], sin.to(dtype)[None, :, None, :]
    wide = torch.cat([cos, sin], -1).to(dtype)  # (S, 2R): cos and sin are column views with row stride 2R
    return wide[:, :R], wide[:, R:]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,D,R,layout", [(2, 16, 12, "model"), (3, 16, 16, "strided"), (2, 24, 8, "strided")])
def test_rope_interpreter(interp, monkeypatch, request, heads, D, R, layout, dtype, tile):
    configure(interp, monkeypatch, tile)
    rows = interpreter_rows(tile)
    g = generator(request)
    _, q, k, _ = packed_qkv(rows, heads, D, dtype, g)  # q and k read through the packed row stride
    cos, sin = _angles(rows, R, dtype, g, layout)
    out = poisoned((2, rows, heads, D), dtype)
    q_out, k_out = interp.rope.rope(q, k, cos, sin, out=out)
    assert_all_written(out, "rope")
    q_ref, k_ref = reference.rope(q, k, cos, sin)
    assert_bitwise(q_out, q_ref, "rope q")
    assert_bitwise(k_out, k_ref, "rope k")
    # default allocation: contiguous (1, S, heads, D)
    q_new, k_new = interp.rope.rope(q.contiguous(), k, cos, sin)
    assert q_new.shape == (1, rows, heads, D) and q_new.is_contiguous() and k_new.is_contiguous()
    assert_bitwise(q_new, q_ref, "rope q (contiguous input)")


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("copy_v", [False, True])
@pytest.mark.parametrize("heads,D,R", [(2, 16, 12), (3, 128, 96), (2, 20, 8)])
def test_qk_norm_rope_interpreter(interp, monkeypatch, request, heads, D, R, copy_v, tile):
    """bf16: bit for bit with the torch emulation of the documented reduction order; F.rms_norm is reported."""
    configure(interp, monkeypatch, tile)
    rows = interpreter_rows(tile)
    g = generator(request)
    dtype = torch.bfloat16
    qkv, q, k, v = packed_qkv(rows, heads, D, dtype, g)
    wq, wk = randn((D,), dtype, g, 0.2) + 1, randn((D,), dtype, g, 0.2) + 1
    cos, sin = _angles(rows, R, dtype, g, "model")
    eps = 1e-5
    out = poisoned((3 if copy_v else 2, rows, heads, D), dtype)
    q_out, k_out, v_out = interp.rope.qk_norm_rope(qkv, wq, wk, eps, cos, sin, head_dim=D, copy_v=copy_v, out=out)
    assert_all_written(out, "qk_norm_rope")
    assert q_out.shape == k_out.shape == v_out.shape == (1, rows, heads, D) and q_out.is_contiguous()
    emulated = reference.rope(
        rms_norm_warp_order_reference(q, wq, eps), rms_norm_warp_order_reference(k, wk, eps), cos, sin
    )
    assert_bitwise(q_out, emulated[0], "fused q vs emulated order")
    assert_bitwise(k_out, emulated[1], "fused k vs emulated order")
    assert_bitwise(v_out, v, "v")
    assert v_out.is_contiguous() == copy_v
    q_ref, k_ref, _ = reference.qk_norm_rope(qkv, wq, wk, eps, cos, sin, head_dim=D)
    for name, got, ref in (("q", q_out, q_ref), ("k", k_out, k_ref)):
        ulps = ulp_distance(got, ref)
        print(f"qk_norm_rope vs CPU F.rms_norm ({name}, D={D}): {int((ulps > 0).sum())}/{ulps.numel()} differ, max {int(ulps.max())} ulp")
        assert int(ulps.max()) <= 2  # rms differences of 1 ulp can move a rotated channel by one more rounding


def test_qk_norm_rope_interpreter_fp32(interp, request):
    g = generator(request)
    qkv, _, _, _ = packed_qkv(S_CPU, 2, 16, torch.float32, g)
    wq, wk = randn((16,), torch.float32, g, 0.2) + 1, randn((16,), torch.float32, g, 0.2) + 1
    cos, sin = _angles(S_CPU, 12, torch.float32, g, "model")
    got = interp.rope.qk_norm_rope(qkv, wq, wk, 1e-5, cos, sin, head_dim=16)
    ref = reference.qk_norm_rope(qkv, wq, wk, 1e-5, cos, sin, head_dim=16)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)


def test_int64_variant_interpreter(interp, monkeypatch, request):
    """The INDEX_64 variant of every kernel (forced on small shapes) gives the same bits as the int32 one."""
    configure(interp, monkeypatch, "small", index_64=True)
    g = generator(request)
    dtype, S, H = torch.bfloat16, S_SMALL_TILE, 40
    table = strided((6, 6 * H), dtype, g, scale=0.5)
    idx = torch.randint(0, 6, (S,), generator=g)
    x, y = randn((1, S, H), dtype, g), randn((1, S, H), dtype, g)
    assert_bitwise(interp.modulate.modulate(x, table, idx, **shift_scale_blocks("mlp")), modulate_reference(x, table, idx, "mlp"), "modulate int64")
    assert_bitwise(interp.gated_residual.gated_residual(x, y, table, idx, **gate_blocks("msa")), reference.gated_residual(x, y, table, idx), "gate int64")
    p = strided((S, 96), dtype, g, scale=3.0)
    assert_bitwise(interp.swiglu.swiglu(p), reference.swiglu(p), "swiglu int64")
    qkv, q, k, _ = packed_qkv(S, 3, 16, dtype, g)
    cos, sin = _angles(S, 12, dtype, g, "strided")
    for got, ref in zip(interp.rope.rope(q, k, cos, sin), reference.rope(q, k, cos, sin)):
        assert_bitwise(got, ref, "rope int64")
    wq, wk = randn((16,), dtype, g, 0.2) + 1, randn((16,), dtype, g, 0.2) + 1
    got = interp.rope.qk_norm_rope(qkv, wq, wk, 1e-5, cos, sin, head_dim=16)
    emulated = reference.rope(
        rms_norm_warp_order_reference(q, wq, 1e-5), rms_norm_warp_order_reference(k, wk, 1e-5), cos, sin
    )
    assert_bitwise(got[0], emulated[0], "qk_norm_rope int64 q")
    assert_bitwise(got[1], emulated[1], "qk_norm_rope int64 k")


# The interpreted package's `_device` module: `test_rne_emulation_matches_torch` binds it (the interpreted copy is
# imported by the `interp` fixture, after this module), and the probe below finds it among its globals when it runs.
_device_interpreted = None


def _round_probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """fp32 -> `_round_as(bf16, EMULATE_CASTS=True)` -> `_to_storage` -> bf16 (run through the interpreter by the test below)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    y = _device_interpreted._round_as(x, tl.bfloat16, True)
    tl.store(out_ptr + offsets, _device_interpreted._to_storage(y, tl.bfloat16, True), mask=mask)


def test_rne_emulation_matches_torch(interp, monkeypatch):
    """`_round_as(EMULATE_CASTS=True)` is torch's fp32 -> bf16: ties to even, carries into the exponent, overflow to
    inf, subnormals, signed zeros, NaN; on 20,000 random bit patterns and the special cases."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setitem(globals(), "_device_interpreted", sys.modules[INTERPRETED_PACKAGE + "._device"])
    special = [1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -(1.0 + 2**-8), 255.99, 3.3895e38, 3.39e38, -3.3895e38,
               float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 2**-133, -0.0, 0.0, 1.00390625, 65535.0]
    bits = torch.randint(-(2**31), 2**31, (20_000,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    values = torch.cat([torch.tensor(special, dtype=torch.float32), bits.to(torch.int32).view(torch.float32)])
    out = poisoned(values.shape, torch.bfloat16)
    InterpretedFunction(_round_probe)[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
    assert_bitwise(out, values.to(torch.bfloat16), "emulated RNE")
    assert (out.view(torch.int16) == values.to(torch.bfloat16).view(torch.int16))[~values.isnan()].all()


# -- GPU: full width, bit for bit against torch on CUDA ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("S", S_GPU)
def test_modulate_gpu(gpu, request, S):
    g = generator(request, "cuda")
    table = adaln_table(2, torch.bfloat16, g)
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    normed = randn((1, S, H_FULL), torch.bfloat16, g, device="cuda")
    for which in ("msa", "mlp"):
        out = poisoned(normed.shape, torch.bfloat16, "cuda")
        gpu.modulate.modulate(normed, table, idx, **shift_scale_blocks(which), out=out)
        assert_bitwise(out, modulate_reference(normed, table, idx, which), f"modulate {which} S={S}")
    # a strided table view (row stride 6H + 64) and the norm_out modulation with its fp32 result
    wide = randn((6, 6 * H_FULL + 64), torch.bfloat16, g, 0.5, "cuda")[:, : 6 * H_FULL]
    assert_bitwise(gpu.modulate.modulate(normed, wide, idx, **shift_scale_blocks("mlp")), modulate_reference(normed, wide, idx, "mlp"), "strided table")
    out_table = randn((2, 2 * H_FULL), torch.bfloat16, g, 0.5, "cuda")
    t_idx = torch.randint(0, 2, (S,), generator=g, device="cuda")
    got = gpu.modulate.modulate(normed, out_table, t_idx, **shift_scale_blocks("out"), out_dtype=torch.float32)
    assert_bitwise(got, modulate_reference(normed, out_table, t_idx, "out", torch.float32), "norm_out")


@pytest.mark.gpu
@pytest.mark.parametrize("S", S_GPU)
def test_gated_residual_gpu(gpu, request, S):
    g = generator(request, "cuda")
    table = adaln_table(2, torch.bfloat16, g)
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    x = randn((1, S, H_FULL), torch.bfloat16, g, 4.0, "cuda")
    y = randn((1, S, H_FULL), torch.bfloat16, g, device="cuda")
    for which in ("msa", "mlp"):
        expected = reference.gated_residual(x, y, table, idx, which)
        out = poisoned(x.shape, torch.bfloat16, "cuda")
        assert_bitwise(gpu.gated_residual.gated_residual(x, y, table, idx, **gate_blocks(which), out=out), expected, f"gate {which} S={S}")
        x_run = x.clone()
        gpu.gated_residual.gated_residual(x_run, y, table, idx, **gate_blocks(which), inplace=True)
        assert_bitwise(x_run, expected, f"gate {which} in place S={S}")


@pytest.mark.gpu
@pytest.mark.parametrize("S", S_GPU)
def test_swiglu_gpu(gpu, request, S):
    g = generator(request, "cuda")
    p = randn((1, S, 2 * FFN), torch.bfloat16, g, 3.0, "cuda")
    out = poisoned((1, S, FFN), torch.bfloat16, "cuda")
    gpu.swiglu.swiglu(p, out=out)
    assert_bitwise(out, reference.swiglu(p), f"swiglu S={S}")


def _gpu_rotary(S, g):
    angles = torch.rand((S, ROTARY // 2), generator=g, device="cuda") * 200.0
    freqs = torch.cat([angles, angles], -1)
    return freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("S", S_GPU)
def test_rope_gpu(gpu, request, S):
    """rope on the `F.rms_norm` outputs (contiguous) and on strided views of the QKV rows; the fused variant equal to both."""
    g = generator(request, "cuda")
    inner = HEADS * HEAD_DIM
    qkv = randn((1, S, 3 * inner), torch.bfloat16, g, 2.0, "cuda")
    wq, wk = randn((HEAD_DIM,), torch.bfloat16, g, 0.2, "cuda") + 1, randn((HEAD_DIM,), torch.bfloat16, g, 0.2, "cuda") + 1
    cos, sin = _gpu_rotary(S, g)
    q_view, k_view, _ = (part.unflatten(-1, (HEADS, HEAD_DIM)) for part in qkv.split(inner, dim=-1))
    q_normed, k_normed = F.rms_norm(q_view, (HEAD_DIM,), wq, 1e-5), F.rms_norm(k_view, (HEAD_DIM,), wk, 1e-5)
    q_ref, k_ref = reference.rope(q_normed, k_normed, cos, sin)
    out = poisoned((2, S, HEADS, HEAD_DIM), torch.bfloat16, "cuda")
    q_out, k_out = gpu.rope.rope(q_normed, k_normed, cos, sin, out=out)
    assert q_out.is_contiguous() and q_out.shape == (1, S, HEADS, HEAD_DIM)
    assert_bitwise(q_out, q_ref, f"rope q S={S}")
    assert_bitwise(k_out, k_ref, f"rope k S={S}")
    q_s, k_s = gpu.rope.rope(q_view, k_view, cos, sin)
    q_sr, k_sr = reference.rope(q_view, k_view, cos, sin)
    assert_bitwise(q_s, q_sr, "rope on strided q")
    assert_bitwise(k_s, k_sr, "rope on strided k")
    _assert_fused_exact(gpu, qkv, wq, wk, cos, sin, q_ref, k_ref)


def _assert_fused_exact(gpu, qkv, wq, wk, cos, sin, q_ref, k_ref):
    """The default path's fused QK norm + rotary (`FUSED_QK_NORM`) at the real head width 128: bit for bit with
    `F.rms_norm` + rope on this GPU, the equality the default path's exactness rests on."""
    q_f, k_f, v_f = gpu.rope.qk_norm_rope(qkv, wq, wk, 1e-5, cos, sin, head_dim=HEAD_DIM, copy_v=True)
    inner = HEADS * HEAD_DIM
    assert_bitwise(v_f, qkv[..., 2 * inner :].unflatten(-1, (HEADS, HEAD_DIM)).contiguous(), "v copy")
    assert_bitwise(q_f, q_ref, f"fused qk_norm_rope q vs F.rms_norm + rope, S={qkv.shape[1]}")
    assert_bitwise(k_f, k_ref, f"fused qk_norm_rope k vs F.rms_norm + rope, S={qkv.shape[1]}")


@pytest.mark.gpu
def test_forced_int64_gpu(gpu, monkeypatch, request):
    """The INDEX_64 variants compiled for the GPU give the int32 variants' bits (forced on the smaller width)."""
    monkeypatch.setattr(gpu._launch, "needs_int64", lambda *views: True)
    g = generator(request, "cuda")
    S = 4099
    table = adaln_table(2, torch.bfloat16, g)
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    x, y = randn((1, S, H_FULL), torch.bfloat16, g, device="cuda"), randn((1, S, H_FULL), torch.bfloat16, g, device="cuda")
    assert_bitwise(gpu.modulate.modulate(x, table, idx, **shift_scale_blocks("msa")), modulate_reference(x, table, idx, "msa"), "modulate")
    assert_bitwise(gpu.gated_residual.gated_residual(x, y, table, idx, **gate_blocks("msa")), reference.gated_residual(x, y, table, idx), "gate")
    p = randn((1, S, 2 * FFN), torch.bfloat16, g, 3.0, "cuda")
    assert_bitwise(gpu.swiglu.swiglu(p), reference.swiglu(p), "swiglu")
    qkv = randn((1, S, 3 * HEADS * HEAD_DIM), torch.bfloat16, g, 2.0, "cuda")
    q, k, _ = (part.unflatten(-1, (HEADS, HEAD_DIM)) for part in qkv.split(HEADS * HEAD_DIM, dim=-1))
    cos, sin = _gpu_rotary(S, g)
    for got, ref in zip(gpu.rope.rope(q, k, cos, sin), reference.rope(q, k, cos, sin)):
        assert_bitwise(got, ref, "rope")


@pytest.mark.gpu
def test_swiglu_gpu_beyond_int32(gpu, request):
    """p = (75,000, 28,672): 2.15e9 addressed elements, the INDEX_64 variant."""
    S = 75_000
    g = generator(request, "cuda")
    p = randn((S, 2 * FFN), torch.bfloat16, g, 3.0, "cuda")
    assert gpu._launch.needs_int64(p)
    got = gpu.swiglu.swiglu(p)
    expected = reference.swiglu(p)
    del p
    assert_bitwise(got, expected, "swiglu S=75,000")


@pytest.mark.gpu
def test_rope_gpu_beyond_int32(gpu, request):
    """q / k as views of (100,000, 21,504) QKV rows (2.15e9 addressed elements): rope and the fused variant bitwise."""
    S = 100_000
    inner = HEADS * HEAD_DIM
    g = generator(request, "cuda")
    qkv = randn((S, 3 * inner), torch.bfloat16, g, 2.0, "cuda")
    q, k, _ = (part.unflatten(-1, (HEADS, HEAD_DIM)) for part in qkv[None].split(inner, dim=-1))
    assert gpu._launch.needs_int64(q) and gpu._launch.needs_int64(qkv)
    cos, sin = _gpu_rotary(S, g)
    q_out, k_out = gpu.rope.rope(q, k, cos, sin)
    q_ref, k_ref = reference.rope(q, k, cos, sin)
    assert_bitwise(q_out, q_ref, "rope q S=100,000")
    assert_bitwise(k_out, k_ref, "rope k S=100,000")
    del q_out, k_out, q_ref, k_ref
    wq, wk = randn((HEAD_DIM,), torch.bfloat16, g, 0.2, "cuda") + 1, randn((HEAD_DIM,), torch.bfloat16, g, 0.2, "cuda") + 1
    q_ref, k_ref, _ = reference.qk_norm_rope(qkv[None], wq, wk, 1e-5, cos, sin, head_dim=HEAD_DIM)
    _assert_fused_exact(gpu, qkv[None], wq, wk, cos, sin, q_ref, k_ref)


@pytest.mark.gpu
def test_modulate_and_gate_gpu_beyond_int32(gpu, request):
    """(400,000, 5,376) residual rows: 2.15e9 elements, the INDEX_64 variants of modulate and the gated residual."""
    S = 400_000
    g = generator(request, "cuda")
    table = adaln_table(2, torch.bfloat16, g)
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    x = randn((S, H_FULL), torch.bfloat16, g, device="cuda")
    assert gpu._launch.needs_int64(x)
    got = gpu.modulate.modulate(x, table, idx, **shift_scale_blocks("mlp"))
    assert_bitwise(got, modulate_reference(x, table, idx, "mlp"), "modulate S=400,000")
    y = got
    expected = reference.gated_residual(x, y, table, idx, "msa")
    gpu.gated_residual.gated_residual(x, y, table, idx, **gate_blocks("msa"), inplace=True)
    assert_bitwise(x, expected, "gate in place S=400,000")


@pytest.mark.gpu
def test_special_values_gpu(gpu, request):
    """Zeros, signed zeros, huge, tiny-normal and subnormal bf16 inputs through every kernel (flush-to-zero check)."""
    g = generator(request, "cuda")
    S = 1024
    specials = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 1e-37, 3e38, -3e38, 1e30, 88.0, -88.0, 100.0, -100.0, 1e-3], device="cuda")

    def sprinkle(t):
        flat = t.view(-1)
        pos = torch.randint(0, flat.numel(), (flat.numel() // 8,), generator=g, device="cuda")
        flat[pos] = specials[torch.randint(0, specials.numel(), pos.shape, generator=g, device="cuda")].to(t.dtype)
        return t

    table = sprinkle(adaln_table(2, torch.bfloat16, g))
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    x, y = sprinkle(randn((1, S, H_FULL), torch.bfloat16, g, device="cuda")), sprinkle(randn((1, S, H_FULL), torch.bfloat16, g, device="cuda"))
    assert_bitwise(gpu.modulate.modulate(x, table, idx, **shift_scale_blocks("msa")), modulate_reference(x, table, idx, "msa"), "modulate")
    assert_bitwise(gpu.gated_residual.gated_residual(x, y, table, idx, **gate_blocks("msa")), reference.gated_residual(x, y, table, idx), "gate")
    p = sprinkle(randn((1, S, 2 * FFN), torch.bfloat16, g, 3.0, "cuda"))
    assert_bitwise(gpu.swiglu.swiglu(p), reference.swiglu(p), "swiglu")
    q, k = sprinkle(randn((1, S, HEADS, HEAD_DIM), torch.bfloat16, g, device="cuda")), sprinkle(randn((1, S, HEADS, HEAD_DIM), torch.bfloat16, g, device="cuda"))
    cos, sin = _gpu_rotary(S, g)
    for got, ref in zip(gpu.rope.rope(q, k, cos, sin), reference.rope(q, k, cos, sin)):
        assert_bitwise(got, ref, "rope")
