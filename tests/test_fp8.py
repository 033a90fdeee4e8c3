"""The approximate FP8 execution (`vflash_core.engine.fp8`) and its Triton activation quantizers (`vflash_kernels.fp8_quantize`).

CPU, kernels: in Triton's interpreter (kernel_harness.py's private interpreted copy of the package, see its docstring),
each quantizer's codes (compared as bytes) and scales equal its torch reference bit for bit: `fp8.quantize_rows` of
the input, of `model.swiglu`, and of the RMSNorm (in torch's CUDA reduction order, `rms_norm_block_order_reference`)
+ modulation; also strided inputs, both tile settings, the INDEX_64 variants, zero rows and codes in E4M3's subnormal
range. The interpreter has no float8 type, so the fp32 -> E4M3 rounding is emulated on bit patterns there
(`_fp8._e4m3_bits`), checked against torch's cast on ~400,000 values; the GPU runs the same bit rounding (Triton's
own fp32 -> E4M3 cast rounds twice on some targets), checked against torch's CUDA cast by the GPU tests.

CPU, execution: weight-only is a BF16 GEMM over the dequantized weights, w8a8 the product of the activation's and the
weight's E4M3 codes times their row scales rounded once to BF16 (with either quantizer), each plus its LoRA residual,
against an oracle that writes those definitions out in float64 and shares no code with the executions: within one
BF16 rounding everywhere (a GEMM's FP32 accumulation may round a near tie the other way), exact in all but 1 % of
the elements (run on the CPU with the device rule patched: the class itself refuses any device without FP8 tensor
cores (sm89, sm90, sm100, sm120), which is tested too, as are the explicit choices and that nothing in torch is
patched).

GPU (`-m gpu`): the quantizers against the torch reference on CUDA at the released width (S = 19,796 and 38,222) and
beyond 2**31 addressed elements, and w8a8 through `torch._scaled_mm` with the Triton quantizer equal to the torch one:

    pytest -m gpu tests/test_fp8.py -s
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernel_harness import (
    FFN,
    H_FULL,
    H_INTERPRETED,
    INTERPRETED_PACKAGE,
    S_CPU,
    S_GPU,
    S_SMALL_TILE,
    TILES,
    adaln_table,
    assert_bitwise,
    configure,
    generator,
    interpreter_rows,
    randn,
    strided,
)
from kernel_references import rms_norm_block_order_reference, shift_scale_blocks
from triton.runtime.interpreter import InterpretedFunction

from vflash_core.engine import fp8
from vflash_core.engine import model as reference
from vflash_core.errors import VflashError

EPS = 1e-5


@pytest.fixture(scope="module")
def op(interp):
    """`fp8_quantize` inside `interp`'s private package, decorated for the interpreter (as test_rms_norm_modulate.py
    imports its op)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        module = importlib.import_module(f"{INTERPRETED_PACKAGE}.fp8_quantize")
    assert module._launch is interp._launch and module._launch.INTERPRET
    return module


def assert_same_quantization(got, expected_rows: torch.Tensor, what: str) -> None:
    """(codes, scales, value) of a kernel against `fp8.quantize_rows(expected_rows)`: codes as bytes, bitwise."""
    codes, scales, _ = got
    expected_codes, expected_scales = fp8.quantize_rows(expected_rows)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == expected_rows.shape, f"{what}: codes {codes.dtype} {tuple(codes.shape)}"
    assert scales.shape == (*expected_rows.shape[:-1], 1), f"{what}: scales {tuple(scales.shape)}"
    assert_bitwise(codes.view(torch.uint8), expected_codes.view(torch.uint8), f"{what} codes")
    assert_bitwise(scales, expected_scales, f"{what} scales")


def with_special_rows(x: torch.Tensor) -> torch.Tensor:
    """Row 0 all zeros (scale 1, codes 0); row 1 one large value among tiny ones (codes in E4M3's subnormal range)."""
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    rows[0] = 0
    rows[1] = rows[1] * 1e-3
    rows[1, 0] = 50.0
    return x


# -- CPU: the E4M3 rounding --------------------------------------------------------------------------------------


# The `_fp8` module under test, bound by each test below (the interpreted copy, imported by the `op` fixture, or the
# GPU package's); the probe finds it among its globals when it runs.
_fp8_under_test = None


def _e4m3_probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """fp32 -> `_e4m3_bits(scale 1)` -> uint8, with `_fp8_under_test` the interpreted or the GPU package's `_fp8`."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.reshape(tl.load(x_ptr + offsets, mask=mask, other=0.0), (1, BLOCK))
    bits = _fp8_under_test._e4m3_bits(x, tl.full((1, 1), 1.0, tl.float32))
    tl.store(out_ptr + offsets, tl.reshape(bits, (BLOCK,)), mask=mask)


def _e4m3_rounding_cases() -> torch.Tensor:
    """Random fp32 bit patterns, normal and subnormal E4M3 magnitudes, exact ties, signed zeros, the clamp's edges."""
    g = torch.Generator().manual_seed(11)
    patterns = torch.randint(-(2**31), 2**31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ties = torch.tensor([1 + 2**-4, 1 + 3 * 2**-4, 2**-9 * 1.5, 2**-9 * 2.5, 2**-10, 3 * 2**-11, 2**-6 * (1 - 2**-4)])
    above_ties = torch.nextafter(ties, torch.full_like(ties, 1e9))
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 447.9, 2**-6, -(2**-6), 2**-9, 464.0, 1e30, -1e30])
    return torch.cat([patterns[patterns.isfinite()], torch.randn(50_000, generator=g) * 100, torch.randn(50_000, generator=g) * 1e-2, ties, -ties, above_ties, -above_ties, special])


def test_e4m3_emulation_matches_torch(op, monkeypatch):
    """In the interpreter, `_e4m3_bits` is torch's fp32 -> float8_e4m3fn after the clamp to +-448."""
    monkeypatch.setitem(globals(), "_fp8_under_test", sys.modules[INTERPRETED_PACKAGE + "._fp8"])
    values = _e4m3_rounding_cases()
    out = torch.empty(values.shape, dtype=torch.uint8)
    InterpretedFunction(_e4m3_probe)[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
    expected = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert_bitwise(out.view(torch.int8), expected.view(torch.int8), "E4M3 rounding")


@pytest.mark.gpu
def test_e4m3_rounding_gpu(gpu, monkeypatch):
    """Compiled for the GPU, `_e4m3_bits` is torch's CUDA fp32 -> float8_e4m3fn (values just above a tie included,
    where a cast through fp16 would round twice)."""
    monkeypatch.setitem(globals(), "_fp8_under_test", importlib.import_module("vflash_kernels._fp8"))
    values = _e4m3_rounding_cases().cuda()
    out = torch.empty(values.shape, dtype=torch.uint8, device="cuda")
    triton.jit(_e4m3_probe)[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
    expected = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert_bitwise(out, expected, "E4M3 rounding on the GPU")


# -- CPU: the kernels in the interpreter ---------------------------------------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("width,layout", [(520, "model"), (40, "strided"), (24, "model")])
def test_quantize_rows_interpreter(op, monkeypatch, request, width, layout, dtype, tile):
    """Rows of 520 take the heuristic's 256-column tiles (two whole, then one of 8 columns; the 1000 used before fit
    one masked 1024-wide tile) and 33 of the small setting's 16 columns, the last half masked."""
    configure(op, monkeypatch, tile)
    g, rows = generator(request), interpreter_rows(tile)
    x = randn((1, rows, width), dtype, g, 3.0) if layout == "model" else strided((rows, width), dtype, g, scale=3.0)
    x = with_special_rows(x)
    assert_same_quantization(op.quantize_rows(x), x, f"quantize_rows {dtype} {width}")


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("keep_value", [False, True])
@pytest.mark.parametrize("width", [48, 40])
def test_swiglu_quantize_interpreter(op, monkeypatch, request, width, keep_value, tile):
    configure(op, monkeypatch, tile)
    g = generator(request)
    p = with_special_rows(strided((interpreter_rows(tile), 2 * width), torch.bfloat16, g, scale=3.0))  # packed rows with padding
    got = op.swiglu_quantize(p, keep_value=keep_value)
    expected = reference.swiglu(p)
    assert_same_quantization(got, expected, f"swiglu_quantize F={width}")
    if keep_value:
        assert_bitwise(got[2], expected, "swiglu value")
    else:
        assert got[2] is None


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("which", ["msa", "mlp"])
@pytest.mark.parametrize("hidden,layout", [(H_INTERPRETED, "model"), (1000, "strided"), (24, "model")])
def test_rms_norm_modulate_quantize_interpreter(op, monkeypatch, request, hidden, layout, which, tile):
    """Against `fp8.quantize_rows` of the norm in the kernel's order (as test_rms_norm_modulate.py) + `modulate`."""
    configure(op, monkeypatch, tile)
    g = generator(request)
    rows = interpreter_rows(tile)
    x = randn((1, rows, hidden), torch.bfloat16, g, 3.0) if layout == "model" else strided((rows, hidden), torch.bfloat16, g, scale=3.0)
    x = with_special_rows(x)
    weight = randn((hidden,), torch.bfloat16, g, 0.25) + 1
    table = strided((6, 6 * hidden), torch.bfloat16, g, scale=0.5)
    idx = torch.randint(0, 6, (rows,), generator=g, dtype=torch.int32 if layout == "strided" else torch.int64)
    expected = reference.modulate(rms_norm_block_order_reference(x, weight, EPS), table, idx.long(), which)
    got = op.rms_norm_modulate_quantize(x, weight, EPS, table, idx, **shift_scale_blocks(which), keep_value=layout == "model")
    assert_same_quantization(got, expected, f"rms_norm_modulate_quantize H={hidden} {which}")
    if layout == "model":
        assert_bitwise(got[2], expected, "rms_norm_modulate value")


def test_int64_variants_interpreter(op, monkeypatch, request):
    """The INDEX_64 variant of each quantizer (forced on small shapes) gives the int32 variant's bits."""
    configure(op, monkeypatch, "small", index_64=True)
    g = generator(request)
    x = strided((S_SMALL_TILE, 40), torch.bfloat16, g, scale=3.0)
    assert_same_quantization(op.quantize_rows(x), x, "quantize_rows int64")
    p = strided((S_SMALL_TILE, 96), torch.bfloat16, g, scale=3.0)
    assert_same_quantization(op.swiglu_quantize(p), reference.swiglu(p), "swiglu_quantize int64")
    weight, table = randn((1000,), torch.bfloat16, g, 0.25) + 1, strided((6, 6000), torch.bfloat16, g, scale=0.5)
    xs = randn((1, S_SMALL_TILE, 1000), torch.bfloat16, g, 3.0)
    idx = torch.randint(0, 6, (S_SMALL_TILE,), generator=g)
    expected = reference.modulate(rms_norm_block_order_reference(xs, weight, EPS), table, idx, "msa")
    assert_same_quantization(op.rms_norm_modulate_quantize(xs, weight, EPS, table, idx, **shift_scale_blocks("msa")), expected, "rms_norm_modulate_quantize int64")


def test_quantizer_refusals(op):
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even"):
        op.swiglu_quantize(torch.zeros(3, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="scale_block"):
        op.rms_norm_modulate_quantize(x, torch.ones(8, dtype=torch.bfloat16), EPS, torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long), shift_block=0, scale_block=2, table_blocks=2)
    with pytest.raises(ValueError, match="multiple of 4"):
        op.rms_norm_modulate_quantize(torch.zeros(3, 6, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16), EPS, torch.zeros(6, 36, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long), **shift_scale_blocks("msa"))
    with pytest.raises(TypeError, match="unsupported dtype"):
        op.quantize_rows(torch.zeros(3, 8, dtype=torch.float64))


# -- CPU: the execution --------------------------------------------------------------------------------------------


def _linear_case(request, rows=S_CPU, in_features=64, out_features=48, lora=True):
    """x (1, rows, in) bf16, a BF16 weight compiled to codes + row scales, and a LoRA residual on a row range."""
    g = generator(request)
    x = randn((1, rows, in_features), torch.bfloat16, g, 2.0)
    weight = randn((out_features, in_features), torch.bfloat16, g, 0.1)
    codes, scales = fp8.quantize_rows(weight)
    loras = (reference.LoraResidual(randn((4, in_features), torch.bfloat16, g, 0.1), randn((16, 4), torch.bfloat16, g, 0.1), 0.5, 8),) if lora else ()
    return x, weight, codes, scales, loras


@pytest.fixture
def cpu_is_sm90(monkeypatch):
    """Let w8a8 run on the CPU (torch's CPU `_scaled_mm` takes row-wise scales), to compare it here bit for bit."""
    monkeypatch.setattr(fp8, "w8a8_refusal", lambda device: None)


# The oracle of the two executions: their definitions written out in float64, rounding where the definitions round
# (an E4M3 code read from its bits, a value rounded to BF16's 8 or E4M3's 4 significant bits to nearest even), sharing
# no code with `fp8` or `model`. A GEMM's own FP32 accumulation may round a near tie the other way than the exact sum.


def _round_to_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 v rounded to `bits` significant bits, ties to even (no exponent limits: BF16's range is not reached)."""
    mantissa, exponent = torch.frexp(v)
    return torch.ldexp(torch.round(mantissa * 2.0**bits), exponent - bits)


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return _round_to_bits(v, 8)


def _e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes -> float64 from the bits: (-1)^s * 1.m * 2^(e-7), subnormals 0.m * 2^-6."""
    bits = codes.view(torch.uint8).to(torch.int64)
    exponent, mantissa = (bits >> 3) & 15, (bits & 7).double() / 8
    magnitude = torch.where(exponent > 0, torch.ldexp(1 + mantissa, exponent - 7), torch.ldexp(mantissa, torch.full_like(exponent, -6)))
    return torch.where(bits >= 128, -magnitude, magnitude)


def _quantized_rows_oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row rule in float64: scale = absmax / 448 in FP32 (1 for a zero row), x / scale in FP32, clamped to
    +-448, rounded to E4M3 (4 significant bits; multiples of 2^-9 below 2^-6). Returns (code values, scales)."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    scales = torch.where(amax > 0, (amax / 448).float().double(), torch.ones_like(amax))
    v = (x / scales).float().double().clamp(-448, 448)
    return torch.where(v.abs() < 2.0**-6, torch.round(v * 2.0**9) / 2.0**9, _round_to_bits(v, 4)), scales


def _lora_oracle(y: torch.Tensor, x: torch.Tensor, loras) -> torch.Tensor:
    """Each residual scale * B(A(x)) in BF16 steps (each product summed exactly, then rounded), added to its rows."""
    for lora in loras:
        delta = _bf16(_bf16(_bf16(x.double() @ lora.down.double().T) @ lora.up.double().T) * lora.scale)
        rows = slice(lora.row_start, lora.row_start + lora.up.shape[0])
        y[..., rows] = _bf16(y[..., rows] + delta)
    return y


def assert_one_rounding_from(got: torch.Tensor, oracle: torch.Tensor, what: str) -> None:
    """BF16 `got` is the float64 `oracle` (already rounded to BF16) or one BF16 step beside it, and no more than 1 %
    of the elements are beside it (a truncating or otherwise biased rounding would put about half there)."""
    assert got.dtype == torch.bfloat16 and got.shape == oracle.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    step = torch.ldexp(torch.ones_like(oracle), torch.frexp(oracle)[1] - 8)  # BF16's spacing at the oracle's magnitude
    off = (got.double() - oracle).abs()
    assert bool((off <= step).all()), f"{what}: {(off / step).max().item():.1f} BF16 steps from the oracle"
    assert int((off > 0).sum()) <= got.numel() // 100, f"{what}: {int((off > 0).sum())}/{got.numel()} elements one step off"


def test_the_oracles_e4m3_reading_is_torchs():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes.float().isfinite()  # 0x7f and 0xff are NaN
    assert int(finite.sum()) == 254 and torch.equal(_e4m3_value(codes)[finite], codes.double()[finite])


def test_weight_only_is_a_gemm_over_dequantized_weights(request):
    """y = x @ bf16(code * scale in FP32).T in BF16, plus the LoRA residual, against the float64 oracle."""
    x, weight, codes, scales, loras = _linear_case(request)
    got = fp8.RowFP8Matmul("weight-only").linear(x, codes, scales, loras)
    dequantized = _bf16((_e4m3_value(codes) * scales.double()).float().double())
    assert_one_rounding_from(got, _lora_oracle(_bf16(x.double() @ dequantized.T), x, loras), "weight-only")
    assert (dequantized - weight.double()).abs().max() <= weight.double().abs().amax(1, keepdim=True).max() / 16  # 3 mantissa bits


@pytest.mark.parametrize("quantizer", fp8.ACTIVATION_QUANTIZERS)
def test_w8a8_equals_scaled_mm_of_quantized_rows(request, op, cpu_is_sm90, quantizer):
    """w8a8 = the activation's and the weight's E4M3 codes multiplied, times both row scales, rounded once to BF16
    (+ LoRA), against the float64 oracle (whose activation codes are the per-row rule written out), with either
    activation quantizer (the Triton one in the interpreter); and close to the exact BF16 linear."""
    x, weight, codes, scales, loras = _linear_case(request)
    execution = fp8.RowFP8Matmul("w8a8", activation_quantizer=quantizer)
    if quantizer == "triton":
        execution.kernels = op
    got = execution.linear(x, codes, scales, loras)
    x_values, x_scales = _quantized_rows_oracle(x)
    products = (x_values @ _e4m3_value(codes).T) * x_scales * scales.double().T
    assert_one_rounding_from(got, _lora_oracle(_bf16(products), x, loras), f"w8a8 {quantizer}")
    exact = reference.linear(x, weight, loras=loras)
    relative = ((got.float() - exact.float()).norm() / exact.float().norm()).item()
    assert relative < 0.08, relative  # E4M3: 3 mantissa bits on both operands


def test_w8a8_takes_quantized_rows_with_or_without_values(request, op, cpu_is_sm90):
    x, _, codes, scales, loras = _linear_case(request)
    execution = fp8.RowFP8Matmul("w8a8")
    expected = execution.linear(x, codes, scales, loras)
    x_codes, x_scales, _ = op.quantize_rows(x)
    assert_bitwise(execution.linear(fp8.QuantizedRows(x_codes, x_scales, x), codes, scales, loras), expected, "quantized rows")
    assert_bitwise(execution.linear(fp8.QuantizedRows(x_codes, x_scales, None), codes, scales), execution.linear(x, codes, scales), "without LoRA")
    with pytest.raises(VflashError, match="LoRA residuals read the BF16 input"):
        execution.linear(fp8.QuantizedRows(x_codes, x_scales, None), codes, scales, loras)


def test_w8a8_is_refused_off_sm90(request):
    """An explicit choice: w8a8 on the CPU raises (it does not fall back to weight-only or to BF16)."""
    x, _, codes, scales, _ = _linear_case(request, lora=False)
    execution = fp8.RowFP8Matmul("w8a8", activation_quantizer="triton")
    with pytest.raises(VflashError, match="needs FP8 tensor cores, a CUDA device of sm89, sm90, sm100, sm120; cpu is not a CUDA device"):
        execution.check_device("cpu")
    with pytest.raises(VflashError, match="needs FP8 tensor cores"):
        execution.linear(x, codes, scales)
    assert execution.kernels is None  # nothing ran: the refusal comes first
    fp8.RowFP8Matmul("weight-only").check_device("cpu")


def test_w8a8_refusal_names_the_architecture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert fp8.w8a8_refusal(torch.device("cuda:0")) == (
        "FP8 w8a8 execution needs FP8 tensor cores, a CUDA device of sm89, sm90, sm100, sm120; cuda:0 is sm86 GPUs (RTX 30xx / A-series)")
    for capability in fp8.W8A8_CAPABILITIES:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8.w8a8_refusal(torch.device("cuda:0")) is None


def test_explicit_choices_are_checked():
    with pytest.raises(VflashError, match="FP8 mode must be one of weight-only, w8a8"):
        fp8.RowFP8Matmul("auto")
    with pytest.raises(VflashError, match="activation_quantizer"):
        fp8.RowFP8Matmul("w8a8", activation_quantizer="cuda")
    with pytest.raises(VflashError, match="w8a8 only"):
        fp8.RowFP8Matmul("weight-only", activation_quantizer="triton")
    with pytest.raises(VflashError, match="w8a8 only"):
        fp8.RowFP8Matmul("weight-only", fast_accum=True)
    with pytest.raises(VflashError, match="fast_accum"):
        fp8.RowFP8Matmul("w8a8", fast_accum=1)
    execution = fp8.RowFP8Matmul("weight-only")
    with pytest.raises(VflashError, match="float8_e4m3fn codes"):
        execution.linear(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(4, 1))


def test_nothing_in_torch_is_patched(request, cpu_is_sm90):
    """Running both modes leaves torch's functions and modules as they were (no global patching)."""
    before = (F.linear, torch._scaled_mm, torch.nn.Linear.forward, torch.Tensor.__matmul__, torch.matmul)
    x, _, codes, scales, loras = _linear_case(request)
    for mode in fp8.FP8_MODES:
        fp8.RowFP8Matmul(mode).linear(x, codes, scales, loras)
    assert (F.linear, torch._scaled_mm, torch.nn.Linear.forward, torch.Tensor.__matmul__, torch.matmul) == before


def test_row_fp8_linear_module(request):
    """Buffers start on meta (no memory); the trusted loader assigns them, with shapes and dtypes checked."""
    x, _, codes, scales, loras = _linear_case(request)
    execution = fp8.RowFP8Matmul("weight-only")
    module = fp8.RowFP8Linear(64, 48, execution)
    assert module.codes.is_meta and module.scales.is_meta and module.codes.dtype == torch.float8_e4m3fn
    with pytest.raises(VflashError, match="no weights yet"):
        module(x)
    with pytest.raises(VflashError, match=r"codes must be torch.float8_e4m3fn \[48, 64\]"):
        module.load(codes.t().contiguous(), scales)
    with pytest.raises(VflashError, match="scales must be torch.float32"):
        module.load(codes, scales.double())
    module.load(codes, scales)
    assert_bitwise(module(x, loras), execution.linear(x, codes, scales, loras), "module")
    other = fp8.RowFP8Linear(64, 48, execution)
    other.load_state_dict({"codes": codes, "scales": scales}, assign=True)
    assert_bitwise(other(x), execution.linear(x, codes, scales), "load_state_dict")
    assert "RowFP8Matmul('weight-only'" in repr(module)


def test_quantize_block_keeps_everything_else(request):
    g = generator(request)
    block = {f"{name}.weight": randn((16, 8), torch.bfloat16, g) for name in fp8.FP8_LINEARS}
    block["norm1.weight"] = randn((8,), torch.bfloat16, g)
    out = fp8.quantize_block(block)
    assert out["norm1.weight"] is block["norm1.weight"]
    for name in fp8.FP8_LINEARS:
        codes, scales = fp8.quantize_rows(block[f"{name}.weight"])
        assert_bitwise(out[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8), name)
        assert_bitwise(out[f"{name}.weight_scale"], scales, name)


def test_quantize_heads_is_exact_division_by_powers_of_two(request):
    g = generator(request)
    x = randn((1, S_CPU, 3, 16), torch.bfloat16, g, 5.0)
    x[:, :, 1] = 0
    codes, descale = fp8.quantize_heads(x)
    assert descale.shape == (1, 3) and descale[0, 1] == 1.0
    assert torch.equal(torch.exp2(torch.log2(descale).round()), descale)
    amax = x.float().abs().amax(dim=(1, 3))
    assert bool((amax / descale <= 448).all()) and bool((amax / descale > 224).all() | (amax == 0).any())
    restored = codes.float() * descale[:, None, :, None]
    assert (restored - x.float()).abs().max() <= amax.max() / 16


def test_fp8_block_ops_refuse_bf16_weights(tiny_config):
    ops = fp8.RowFP8Ops(tiny_config, reference.sdpa_attention, fp8.RowFP8Matmul("weight-only"))
    with pytest.raises(VflashError, match="FP8 artifact's weights"):
        ops.linear(torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))


# -- GPU -------------------------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_op(gpu):
    return importlib.import_module("vflash_kernels.fp8_quantize")


@pytest.mark.gpu
@pytest.mark.parametrize("S", S_GPU)
def test_quantizers_gpu(gpu, gpu_op, request, S):
    """Full width, bit for bit against `fp8.quantize_rows` of the torch ops on CUDA (the norm: `F.rms_norm`, which the
    fused kernel's order reproduces on the H200, see test_rms_norm_modulate.py)."""
    g = generator(request, "cuda")
    out = randn((1, S, 56 * 128), torch.bfloat16, g, 2.0, "cuda")  # the attention output feeding attn.out
    assert_same_quantization(gpu_op.quantize_rows(out), out, f"quantize_rows S={S}")
    del out
    p = randn((1, S, 2 * FFN), torch.bfloat16, g, 3.0, "cuda")
    got = gpu_op.swiglu_quantize(p, keep_value=True)
    expected = reference.swiglu(p)
    assert_same_quantization(got, expected, f"swiglu_quantize S={S}")
    assert_bitwise(got[2], expected, "swiglu value")
    del p, got, expected
    x = randn((1, S, H_FULL), torch.bfloat16, g, 3.0, "cuda")
    weight = randn((H_FULL,), torch.bfloat16, g, 0.25, "cuda") + 1
    table = adaln_table(2, torch.bfloat16, g)
    idx = torch.randint(0, 6, (S,), generator=g, device="cuda")
    for which in ("msa", "mlp"):
        expected = reference.modulate(F.rms_norm(x, (H_FULL,), weight, EPS), table, idx, which)
        got = gpu_op.rms_norm_modulate_quantize(x, weight, EPS, table, idx, **shift_scale_blocks(which), keep_value=True)
        assert_same_quantization(got, expected, f"rms_norm_modulate_quantize {which} S={S}")
        assert_bitwise(got[2], expected, f"rms_norm_modulate value {which}")


@pytest.mark.gpu
def test_quantizers_gpu_beyond_int32(gpu, gpu_op, request):
    """SwiGLU input (75,000, 28,672): 2.15e9 addressed elements, the INDEX_64 variant; and a forced INDEX_64 run."""
    g = generator(request, "cuda")
    p = randn((75_000, 2 * FFN), torch.bfloat16, g, 3.0, "cuda")
    assert gpu._launch.needs_int64(p)
    got = gpu_op.swiglu_quantize(p)
    expected = reference.swiglu(p)
    del p
    assert_same_quantization(got, expected, "swiglu_quantize S=75,000")


@pytest.mark.gpu
def test_forced_int64_quantizers_gpu(gpu, gpu_op, monkeypatch, request):
    monkeypatch.setattr(gpu._launch, "needs_int64", lambda *views: True)
    g = generator(request, "cuda")
    x = randn((4099, H_FULL), torch.bfloat16, g, 3.0, "cuda")
    assert_same_quantization(gpu_op.quantize_rows(x), x, "quantize_rows INDEX_64")
    p = randn((4099, 2 * FFN), torch.bfloat16, g, 3.0, "cuda")
    assert_same_quantization(gpu_op.swiglu_quantize(p), reference.swiglu(p), "swiglu_quantize INDEX_64")


@pytest.mark.gpu
def test_w8a8_gpu(gpu, request):
    """On a GPU with FP8 tensor cores (sm89, sm90, sm100, sm120): the Triton quantizer's w8a8 equals the torch quantizer's bit for bit at a full-width FFN
    output projection; the error against the BF16 GEMM is printed. Elsewhere: refused."""
    g = generator(request, "cuda")
    x = randn((1, 4096, FFN), torch.bfloat16, g, 1.0, "cuda")
    weight = randn((H_FULL, FFN), torch.bfloat16, g, 0.02, "cuda")
    codes, scales = fp8.quantize_rows(weight)
    triton_execution = fp8.RowFP8Matmul("w8a8", activation_quantizer="triton")
    refusal = fp8.w8a8_refusal(torch.device("cuda:0"))
    if refusal is not None:
        with pytest.raises(VflashError, match="needs FP8 tensor cores"):
            triton_execution.linear(x, codes, scales)
        return
    got = triton_execution.linear(x, codes, scales)
    assert_bitwise(got, fp8.RowFP8Matmul("w8a8").linear(x, codes, scales), "triton vs torch quantizer")
    exact = reference.linear(x, weight)
    print(f"w8a8 vs BF16 GEMM (4096 x {FFN} -> {H_FULL}): relative L2 {((got.float() - exact.float()).norm() / exact.float().norm()).item():.4f}")


# -- FP8 attention (fa3-fp8) ---------------------------------------------------------------------------------------


def test_fp8_attention_is_refused_outside_fp8_profiles():
    from vflash_core.engine.attention import resolve_attention

    with pytest.raises(VflashError, match="approximate .FP8 attention.: it runs only with an FP8 profile"):
        resolve_attention("fa3-fp8", torch.device("cpu"))
    with pytest.raises(VflashError, match="needs a CUDA device"):
        resolve_attention("fa3-fp8", torch.device("cpu"), approximate_allowed=True)
    assert resolve_attention("auto", torch.device("cpu"), approximate_allowed=True)[0] == "torch-sdpa"


def _fake_fa3(monkeypatch, build_flags: dict, with_descale: bool = True) -> list[dict]:
    """Stand-ins for fa3-fwd's modules (its CUDA kernels cannot load here); records each call's arguments."""
    import types

    calls: list[dict] = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None):
        calls.append({"q": q, "k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale})
        return torch.zeros(q.shape, dtype=torch.bfloat16)

    def plain(q, k, v, softmax_scale=None, causal=False):
        return q

    monkeypatch.setitem(sys.modules, "fa3_fwd_config", types.SimpleNamespace(CONFIG={"build_flags": build_flags}))
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", types.SimpleNamespace(flash_attn_func=flash_attn_func if with_descale else plain))
    return calls


def test_fp8_attention_probe_refuses_builds_without_fp8(monkeypatch):
    from vflash_core.engine import attention

    _fake_fa3(monkeypatch, {"FLASHATTENTION_DISABLE_FP8": True})
    with pytest.raises(VflashError, match="built without FP8 kernels"):
        attention._fa3_fp8()
    _fake_fa3(monkeypatch, {"FLASHATTENTION_DISABLE_FP8": False}, with_descale=False)
    with pytest.raises(VflashError, match="takes no q/k/v descale factors"):
        attention._fa3_fp8()
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)  # not installed
    with pytest.raises(VflashError, match="needs the fa3-fwd package"):
        attention._fa3_fp8()


def test_fp8_attention_hands_e4m3_heads_and_descales(monkeypatch, request):
    from vflash_core.engine import attention

    calls = _fake_fa3(monkeypatch, {"FLASHATTENTION_DISABLE_FP8": False})
    g = generator(request)
    q, k, v = (randn((1, S_CPU, 3, 16), torch.bfloat16, g, 3.0) for _ in range(3))
    attention._fa3_fp8()(q, k, v)
    (call,) = calls
    for name, x in (("q", q), ("k", k), ("v", v)):
        codes, descale = fp8.quantize_heads(x)
        assert call[name].dtype == torch.float8_e4m3fn and call[f"{name}_descale"].shape == (1, 3)
        assert_bitwise(call[name].view(torch.uint8), codes.view(torch.uint8), name)
        assert_bitwise(call[f"{name}_descale"], descale, f"{name} descale")


@pytest.mark.gpu
def test_fp8_attention_gpu(gpu, request):
    """fa3-fp8 on (1, 19,796, 56, 128), or its refusal's reason. Its error against exact FA3 is printed; what it adds
    beyond the E4M3 rounding of q, k and v (exact FA3 on the dequantized operands) is only the kernel's E4M3 rounding
    of the softmax weights, each within 2^-4 relative and independent, so the outputs agree to a few percent."""
    from vflash_core.engine.attention import resolve_attention

    device = torch.device("cuda:0")
    try:
        _, approximate = resolve_attention("fa3-fp8", device, approximate_allowed=True)
        _, exact = resolve_attention("fa3", device)
    except VflashError as exc:
        pytest.skip(f"fa3-fp8 refused here: {exc}")
    g = generator(request, "cuda")
    q, k, v = (randn((1, 19_796, 56, 128), torch.bfloat16, g, 2.0, "cuda") for _ in range(3))
    got = approximate(q, k, v)

    def relative(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    expected = exact(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    print(f"fa3-fp8 vs fa3: relative L2 {relative(got, expected):.4f}, max abs {(got.float() - expected.float()).abs().max().item():.4f}")
    dequantized = []
    for x in (q, k, v):
        codes, descale = fp8.quantize_heads(x)
        dequantized.append((codes.float() * descale[:, None, :, None]).to(torch.bfloat16))
    beyond_operands = relative(got, exact(*dequantized))
    print(f"fa3-fp8 vs fa3 on the E4M3-rounded q, k, v: relative L2 {beyond_operands:.4f}")
    assert beyond_operands < 0.05
