"""Parity of the fused RMSNorm + AdaLN modulation `rms_norm_modulate` (`vflash_kernels.rms_norm_modulate`).

CPU tests run the kernel in Triton's interpreter, inside kernel_harness.py's private interpreted copy of the package (its
docstring says why and how; the `interp` fixture makes it once per module). The kernel is compared bit for bit with
`rms_norm_modulate_order_reference`, the torch emulation of torch's CUDA reduction order, on 37 rows at H = 1280 (3
chunks of 512 channels, the last half full, as the released 5376's 11 are) and at H = 512 (one chunk, every thread of
the torch block one vector), 1000 (a partial chunk) and 24 (fewer vectors than lanes), with strided inputs, both tile
settings, int32 / int64 row indices and the INDEX_64 variant. How often that order differs from the CPU `F.rms_norm`
(another order) is printed only. What the interpreter cannot show: the GPU's `rsqrt` (it computes `1 / sqrt`, as the
CPU reference does) and whether torch's CUDA kernel really uses that order.

GPU tests (`-m gpu`) answer the latter: full width, S = 19,796 and 38,222, bf16, x ~ 3 N(0, 1), weight ~ 1 +
0.25 N(0, 1), a (3T, 6H) table view as the model builds it; the kernel must equal `F.rms_norm` + `modulate` bit for bit
for "msa" and "mlp". On a mismatch the test prints the count of differing elements, and which launch configuration of
torch's kernel (warps per block) the order reference has to assume to reproduce `F.rms_norm`.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_harness import (
    H_FULL,
    H_INTERPRETED,
    INTERPRETED_PACKAGE,
    S_CPU,
    S_GPU,
    S_SMALL_TILE,
    TILES,
    adaln_table,
    assert_all_written,
    assert_bitwise,
    configure,
    generator,
    interpreter_rows,
    modulate_reference,
    poisoned,
    randn,
    strided,
    ulp_distance,
)
from kernel_references import rms_norm_block_order_reference, rms_norm_warp_order_reference, shift_scale_blocks


def rms_norm_modulate_order_reference(x, weight, eps, table, row_index, which="msa", out_dtype=None):
    """What the kernel computes, in torch ops: the emulated reduction order of its norm, then the model's modulation."""
    return modulate_reference(rms_norm_block_order_reference(x, weight, eps), table, row_index, which, out_dtype)


def rms_norm_modulate_reference(x, weight, eps, table, row_index, which="msa", out_dtype=None):
    """The torch ops the kernel replaces: `F.rms_norm`, then the model's modulation."""
    return modulate_reference(F.rms_norm(x, (x.shape[-1],), weight, eps), table, row_index, which, out_dtype)


_MODULE = "rms_norm_modulate"
EPS = 1e-5


@pytest.fixture(scope="module")
def op(interp):
    """This op's module inside `interp`'s private package, decorated for the interpreter as `interp` decorates the
    others (TRITON_INTERPRET=1 only while it is imported); `interp`'s teardown removes it with the package."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        module = importlib.import_module(f"{INTERPRETED_PACKAGE}.{_MODULE}")
    assert module._launch is interp._launch and module._launch.INTERPRET
    return module


@pytest.fixture
def gpu_op(gpu):
    """This op's compiled module (the `gpu` fixture makes `vflash_kernels` importable and frees CUDA memory after)."""
    return importlib.import_module(f"vflash_kernels.{_MODULE}")


def _inputs(S, H, dtype, g, layout="model"):
    """x as the model's (1, S, H) residual or an (S, H) view into padded rows; weight ~ 1 + 0.25 N(0, 1)."""
    x = randn((1, S, H), dtype, g, 3.0) if layout == "model" else strided((S, H), dtype, g, scale=3.0)
    weight = randn((H,), dtype, g, 0.25) + 1
    return x, weight


def _report(what, got, reference):
    ulps = ulp_distance(got, reference)
    print(f"{what}: {int((ulps > 0).sum())}/{ulps.numel()} elements differ, max {int(ulps.max())} ulp")
    return ulps


# -- CPU: references (no kernels run) --------------------------------------------------------------------------


def test_order_reference_is_the_qk_norm_order_up_to_128_channels():
    """For rows of <= 128 channels only torch's warp 0 holds data: the block order is `qk_norm_rope`'s warp order."""
    g = torch.Generator().manual_seed(5)
    for D in (128, 96, 20):
        x, w = _inputs(257, D, torch.bfloat16, g)
        assert_bitwise(rms_norm_block_order_reference(x, w, EPS), rms_norm_warp_order_reference(x, w, EPS), f"D={D}")


def test_order_reference_sees_the_block_shape():
    """At full width the assumed block shape matters, so the GPU comparison with `F.rms_norm` can tell them apart."""
    x, w = _inputs(2000, H_FULL, torch.bfloat16, torch.Generator().manual_seed(6))
    ours = rms_norm_block_order_reference(x, w, EPS)
    for warps in (1, 2, 8, 16):
        assert bool((rms_norm_block_order_reference(x, w, EPS, warps=warps) != ours).any()), warps


def test_rejects_inputs_of_the_other_torch_path():
    op = importlib.import_module(f"vflash_kernels.{_MODULE}")
    table, idx = torch.zeros(6, 6 * 8, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 4"):
        op.rms_norm_modulate(torch.zeros(3, 6, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16), EPS, torch.zeros(6, 36, dtype=torch.bfloat16), idx, **shift_scale_blocks("msa"))
    misaligned = torch.zeros(3 * 8 + 1, dtype=torch.bfloat16)[1:].view(3, 8)  # contiguous, 2 bytes off
    with pytest.raises(ValueError, match="aligned"):
        op.rms_norm_modulate(misaligned, w, EPS, table, idx, **shift_scale_blocks("msa"))
    with pytest.raises(ValueError, match="weight"):
        op.rms_norm_modulate(torch.zeros(3, 8, dtype=torch.bfloat16), w.float(), EPS, table, idx, **shift_scale_blocks("msa"))


# -- CPU: the kernel in the interpreter ------------------------------------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("which", ["msa", "mlp"])
@pytest.mark.parametrize("hidden,layout", [(H_INTERPRETED, "model"), (512, "model"), (1000, "strided"), (24, "strided")])
def test_rms_norm_modulate_interpreter(op, monkeypatch, request, hidden, layout, which, tile):
    """bf16: bit for bit with the emulated order; the CPU F.rms_norm (another order) is reported. Strided cases also
    take an int32 row index."""
    configure(op, monkeypatch, tile)
    rows = interpreter_rows(tile)
    g = generator(request)
    dtype = torch.bfloat16
    x, w = _inputs(rows, hidden, dtype, g, layout)
    table = strided((6, 6 * hidden), dtype, g, scale=0.5)
    idx = torch.randint(0, 6, (rows,), generator=g, dtype=torch.int32 if layout == "strided" else torch.int64)
    out = poisoned(x.shape, dtype)
    assert op.rms_norm_modulate(x, w, EPS, table, idx, **shift_scale_blocks(which), out=out) is out
    assert_all_written(out, "rms_norm_modulate")
    assert_bitwise(out, rms_norm_modulate_order_reference(x, w, EPS, table, idx.long(), which), f"H={hidden} {which} vs emulated order")
    _report(f"rms_norm_modulate vs CPU F.rms_norm + modulate (H={hidden}, {which})", out, rms_norm_modulate_reference(x, w, EPS, table, idx.long(), which))
    normed_ulps = _report(f"  the norm alone, emulated order vs CPU F.rms_norm (H={hidden})", rms_norm_block_order_reference(x, w, EPS), F.rms_norm(x, (hidden,), w, EPS))
    assert int(normed_ulps.max()) <= 1  # another summation order moves rstd by a few fp32 ulp: one bf16 rounding at most


def test_rms_norm_modulate_interpreter_norm_out_fp32_result(op, request):
    """The `norm_out` table ((T, 2H), "out") with the fp32 result of `output_heads` (`.to(float32)`)."""
    g = generator(request)
    x, w = _inputs(S_CPU, 1000, torch.bfloat16, g)
    table = randn((2, 2 * 1000), torch.bfloat16, g, 0.5)
    idx = torch.randint(0, 2, (S_CPU,), generator=g)
    got = op.rms_norm_modulate(x, w, EPS, table, idx, **shift_scale_blocks("out"), out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    assert_bitwise(got, rms_norm_modulate_order_reference(x, w, EPS, table, idx, "out", torch.float32), "norm_out")


def test_rms_norm_modulate_interpreter_int64_variant(op, monkeypatch, request):
    configure(op, monkeypatch, "small", index_64=True)
    g = generator(request)
    x, w = _inputs(S_SMALL_TILE, 1000, torch.bfloat16, g, "strided")
    table = strided((6, 6 * 1000), torch.bfloat16, g, scale=0.5)
    idx = torch.randint(0, 6, (S_SMALL_TILE,), generator=g)
    assert_bitwise(op.rms_norm_modulate(x, w, EPS, table, idx, **shift_scale_blocks("mlp")), rms_norm_modulate_order_reference(x, w, EPS, table, idx, "mlp"), "int64")


def test_rms_norm_modulate_interpreter_fp32(op, request):
    """fp32 squares are rounded: the kernel's fma (as nvcc's) and the reference's multiply-then-add differ in the last
    bits of the sum of squares, so this compares with a tolerance."""
    g = generator(request)
    x, w = _inputs(S_CPU, 1000, torch.float32, g)
    table = randn((6, 6 * 1000), torch.float32, g, 0.5)
    idx = torch.randint(0, 6, (S_CPU,), generator=g)
    got = op.rms_norm_modulate(x, w, EPS, table, idx, **shift_scale_blocks("msa"))
    torch.testing.assert_close(got, rms_norm_modulate_reference(x, w, EPS, table, idx, "msa"), rtol=2e-6, atol=2e-6)


# -- GPU: full width against torch on CUDA -------------------------------------------------------------------------


def _gpu_case(S, g):
    x = randn((1, S, H_FULL), torch.bfloat16, g, 3.0, "cuda")
    x[0, 0] = 0  # a zero row: rstd = rsqrt(eps)
    w = randn((H_FULL,), torch.bfloat16, g, 0.25, "cuda") + 1
    table = adaln_table(2, torch.bfloat16, g)
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    return x, w, table, idx


def _diagnose_order(x, w):
    """Which block height the order reference needs to reproduce `F.rms_norm` on this GPU (count of differing bf16).

    The reference runs in torch ops on CUDA; if `torch.rsqrt` there is not the `rsqrtf` of torch's norm kernel, every
    layout shows a few differences and the right one the fewest."""
    expected = F.rms_norm(x, (H_FULL,), w, EPS)
    for warps in (1, 2, 4, 8, 16, 32):
        differ = int((rms_norm_block_order_reference(x, w, EPS, warps=warps) != expected).sum())
        print(f"  order reference with {warps:2d} warps per torch block vs F.rms_norm: {differ}/{expected.numel()} differ")


@pytest.mark.gpu
@pytest.mark.parametrize("S", S_GPU)
def test_rms_norm_modulate_gpu(gpu, gpu_op, monkeypatch, request, S):
    """Bit for bit with `F.rms_norm` + `modulate`; prints the count of differing elements (and a diagnosis) if not."""
    g = generator(request, "cuda")
    x, w, table, idx = _gpu_case(S, g)
    expected = {which: gpu.modulate.modulate(F.rms_norm(x, (H_FULL,), w, EPS), table, idx, **shift_scale_blocks(which)) for which in ("msa", "mlp")}
    failures = []
    for which in ("msa", "mlp"):
        got = gpu_op.rms_norm_modulate(x, w, EPS, table, idx, **shift_scale_blocks(which))
        differ = int((got != expected[which]).sum())
        print(f"rms_norm_modulate {which} S={S}: {differ}/{got.numel()} elements differ from F.rms_norm + modulate")
        if differ:
            failures.append(which)
    if failures:
        _diagnose_order(x, w)
    assert not failures, f"not bit for bit with F.rms_norm + modulate for {failures} (counts above)"
    monkeypatch.setattr(gpu._launch, "needs_int64", lambda *views: True)
    assert_bitwise(gpu_op.rms_norm_modulate(x, w, EPS, table, idx, **shift_scale_blocks("mlp")), expected["mlp"], f"INDEX_64 variant S={S}")
