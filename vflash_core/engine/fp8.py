"""Approximate FP8 execution of the four block linears (`attn.qkv`, `attn.out`, `ffn.in`, `ffn.out`): row-wise E4M3.

Never the default: only profiles whose id says `fp8` (`Profile.fp8`) compile FP8 artifacts, and only FP8 artifacts
run these operations. Everything else of the block (norms, modulation, rotary, attention, gated residuals, LoRA
residuals) keeps its BF16 operations.

* Weights are quantized once, when the artifact is compiled (`quantize_block`): each output row of a [out, in] matrix
  gets its own FP32 scale, absmax / 448, and E4M3 codes (`float8_e4m3fn`) of the row divided by it. The codes take
  half the bytes of BF16 on the device and through the block ring. A linear an fp8_scaled file already stores as
  E4M3 codes with one scale is not quantized again: its codes are kept and its scale becomes every row's.
* `RowFP8Matmul("weight-only")` dequantizes the codes to BF16 and runs a plain GEMM: any device (the reference,
  and the CPU profile's matmul). `RowFP8Matmul("w8a8")` also quantizes each activation row the same way and
  runs `torch._scaled_mm` with the two row-wise scale vectors (FP8 tensor cores at twice the BF16 rate), only on
  CUDA devices of the FP8 families (sm89, sm90, sm100, sm120): anywhere else it raises `VflashError`; it never falls
  back to another matmul.
* The activation quantizer is "torch" (`quantize_rows`, the reference) or "triton": the quantization then happens
  inside the kernel that produces the activation (RMSNorm + modulation before `attn.qkv` and `ffn.in`, SwiGLU before
  `ffn.out`; `vflash_kernels.fp8_quantize`), or alone for the attention output. Both give the same bits.
* A LoRA residual is added to the FP8 GEMM's BF16 output from the BF16 activation, as on the exact path.

Nothing here patches torch or any module: the operations are chosen explicitly, by the session for an FP8 artifact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from ..errors import VflashError, check_choice
from ..formats import ARCH_FAMILIES, ARCH_NAMES, device_arch
from . import model as M
from .config import H3Config
from .fused import FusedOps

__all__ = [
    "ACTIVATION_QUANTIZERS", "FP8_LINEARS", "FP8_MODES", "W8A8_CAPABILITIES", "FusedRowFP8Ops", "QuantizedRows",
    "RowFP8Linear", "RowFP8Matmul", "RowFP8Ops", "dequantize_rows", "quantize_block", "quantize_heads",
    "quantize_rows", "w8a8_refusal",
]

FP8_MODES = ("weight-only", "w8a8")
ACTIVATION_QUANTIZERS = ("torch", "triton")
#: The block linears an FP8 artifact stores as codes + row scales (all other block tensors stay BF16).
FP8_LINEARS = ("attn.qkv", "attn.out", "ffn.in", "ffn.out")
#: The largest finite `float8_e4m3fn` value: a row's absmax maps to it.
E4M3_MAX = 448.0
#: CUDA compute capabilities with row-wise scaled FP8 GEMMs in `torch._scaled_mm` (its CUTLASS kernels for sm89, sm90,
#: sm100 and sm120): those of the GPU families with `fp8` (`formats.ARCH_FAMILIES`).
W8A8_CAPABILITIES = tuple(c for family in ARCH_FAMILIES.values() if family.fp8 for c in family.capabilities)
W8A8_ARCHS = tuple(tag for tag, family in ARCH_FAMILIES.items() if family.fp8)


# -- the quantization rule (torch reference) -------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 quantization of (..., K): codes `float8_e4m3fn` of x's shape and FP32 scales (..., 1).

    scale = absmax / 448 (1 for an all-zero row), code = e4m3(clamp(x / scale, -448, 448)) rounded to nearest even,
    all in FP32; `codes * scales` approximates x. The reference of the `vflash_kernels.fp8_quantize` kernels.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor: torch's CUDA division by a Python number multiplies by its rounded reciprocal instead.
    scales = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return (xf / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`codes * scales` in FP32, rounded once to `dtype`."""
    return (codes.to(torch.float32) * scales).to(dtype)


def quantize_block(
    tensors: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
    stored: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """A packed block's tensors with the four linears as E4M3 codes (`<linear>.weight`) and FP32 row scales
    (`<linear>.weight_scale`, [out, 1]), computed on `device`, returned on the CPU; other tensors unchanged.

    stored: linear -> (codes, row scales) already in this form (an fp8_scaled file's, `SourceWeights.read_codes`):
        taken as they are, never re-quantized; `tensors` then need not hold that linear's weight."""
    out = dict(tensors)
    for linear in FP8_LINEARS:
        if stored is not None and linear in stored:
            codes, scales = stored[linear]
        else:
            codes, scales = quantize_rows(tensors[f"{linear}.weight"].to(device))
        out[f"{linear}.weight"], out[f"{linear}.weight_scale"] = codes.cpu(), scales.cpu()
    return out


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, heads, D) -> E4M3 codes of x's shape and FP32 descale factors (B, heads), one per head.

    The factor is the power of two at or above absmax / 448 over the head's rows and channels (1 for an all-zero
    head), so dividing by it is exact in x's own dtype and no code overflows: the FP8 attention's operands cost one
    pass in BF16, no FP32 copy of q, k or v.
    """
    amax = x.abs().amax(dim=(1, 3)).float()
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(min=-126.0)
    descale = torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))
    return (x / descale[:, None, :, None].to(x.dtype)).to(torch.float8_e4m3fn), descale


@dataclass(frozen=True)
class QuantizedRows:
    """An activation in per-row FP8: codes `float8_e4m3fn` (..., K), scales FP32 (..., 1), and the BF16 rows they were
    made from where a LoRA branch reads them (else None)."""

    codes: torch.Tensor
    scales: torch.Tensor
    value: torch.Tensor | None


# -- the matmul --------------------------------------------------------------------------------------------------------


def w8a8_refusal(device: torch.device) -> str | None:
    """Why w8a8 cannot run on `device` (None when it can): it needs a CUDA device of a `W8A8_CAPABILITIES` arch."""
    need = f"FP8 w8a8 execution needs FP8 tensor cores, a CUDA device of {', '.join(W8A8_ARCHS)}"
    if device.type != "cuda":
        return f"{need}; {device} is not a CUDA device"
    if torch.cuda.get_device_capability(device) not in W8A8_CAPABILITIES:
        return f"{need}; {device} is {ARCH_NAMES.get(device_arch(device), device_arch(device))}"
    return None


class RowFP8Matmul:
    """How the block linears of an FP8 artifact run: `mode` "weight-only" or "w8a8", chosen explicitly.

    activation_quantizer: "torch" (`quantize_rows`) or "triton" (`vflash_kernels.fp8_quantize`, CUDA tensors); the
        same bits either way. w8a8 only.
    fast_accum: `torch._scaled_mm`'s `use_fast_accum` (Hopper's faster FP8 accumulation, less precise); w8a8 only.

    `linear` raises `VflashError` for w8a8 on a device without FP8 tensor cores (`w8a8_refusal`), on the first call
    per device.
    """

    def __init__(self, mode: str, activation_quantizer: str = "torch", fast_accum: bool = False):
        check_choice("FP8 mode", mode, FP8_MODES)
        check_choice("activation_quantizer", activation_quantizer, ACTIVATION_QUANTIZERS)
        if not isinstance(fast_accum, bool):
            raise VflashError(f"fast_accum must be true or false, got {fast_accum!r}")
        if mode == "weight-only" and (activation_quantizer != "torch" or fast_accum):
            raise VflashError(
                "weight-only FP8 keeps activations in BF16: activation_quantizer and fast_accum apply to w8a8 only"
            )
        self.mode = mode
        self.activation_quantizer = activation_quantizer
        self.fast_accum = fast_accum
        self.kernels: ModuleType | None = None  # vflash_kernels.fp8_quantize, imported on first use
        self._devices: set[torch.device] = set()

    def __repr__(self) -> str:
        return (
            f"RowFP8Matmul({self.mode!r}, activation_quantizer={self.activation_quantizer!r}, "
            f"fast_accum={self.fast_accum})"
        )

    def check_device(self, device: torch.device | str) -> None:
        """Raise `VflashError` if this matmul cannot run on `device`."""
        device = torch.device(device)
        if device in self._devices:
            return
        if self.mode == "w8a8":
            refusal = w8a8_refusal(device)
            if refusal is not None:
                raise VflashError(refusal)
        self._devices.add(device)

    def quantize_kernels(self) -> ModuleType:
        """The Triton quantizers (`vflash_kernels.fp8_quantize`), imported on first use."""
        if self.kernels is None:
            from .._imports import vflash_kernels

            vflash_kernels()
            from vflash_kernels import fp8_quantize

            self.kernels = fp8_quantize
        return self.kernels

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """x's rows quantized by this matmul's activation quantizer (x kept as their BF16 value)."""
        if self.activation_quantizer == "triton":
            codes, scales, _ = self.quantize_kernels().quantize_rows(x)
        else:
            codes, scales = quantize_rows(x)
        return QuantizedRows(codes, scales, x)

    def linear(
        self, x: torch.Tensor | QuantizedRows, codes: torch.Tensor, scales: torch.Tensor,
        loras: tuple[M.LoraResidual, ...] = ()
    ) -> torch.Tensor:
        """x (..., in) BF16 (or already quantized rows, w8a8) times the [out, in] E4M3 `codes` with FP32 row `scales`
        [out, 1] -> (..., out) BF16, plus the LoRA residuals computed from x's BF16 rows."""
        if (
            codes.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32
            or codes.dim() != 2 or scales.shape != (codes.shape[0], 1)
        ):
            raise VflashError(
                "FP8 weights must be [out, in] float8_e4m3fn codes with [out, 1] float32 scales, "
                f"got {codes.dtype} {tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}"
            )
        value = x.value if isinstance(x, QuantizedRows) else x
        self.check_device(codes.device)
        if value is None and (loras or self.mode == "weight-only"):
            raise VflashError(
                "weight-only FP8 and LoRA residuals read the BF16 input of the linear; "
                "quantized rows without it were given"
            )
        if self.mode == "weight-only":
            assert value is not None  # refused above
            y = F.linear(value, dequantize_rows(codes, scales, torch.bfloat16))
        else:
            rows = x if isinstance(x, QuantizedRows) else self.quantize(x)
            lead = rows.codes.shape[:-1]
            y = torch._scaled_mm(
                rows.codes.reshape(-1, codes.shape[1]), codes.t(), scale_a=rows.scales.reshape(-1, 1),
                scale_b=scales.view(1, -1),
                out_dtype=torch.bfloat16, use_fast_accum=self.fast_accum,
            ).view(*lead, codes.shape[0])
        return y if value is None else M.add_lora_residuals(y, value, loras)  # (no LoRA without a value: refused above)


class RowFP8Linear(torch.nn.Module):
    """One FP8 linear as a module: `codes` [out, in] E4M3 and `scales` [out, 1] FP32 buffers, created on the meta
    device (no memory) and assigned by a trusted loader (`load`, or `load_state_dict(..., assign=True)`)."""

    def __init__(self, in_features: int, out_features: int, matmul: RowFP8Matmul):
        super().__init__()
        self.in_features, self.out_features, self.matmul = in_features, out_features, matmul
        self.register_buffer("codes", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device="meta"))
        self.register_buffer("scales", torch.empty(out_features, 1, dtype=torch.float32, device="meta"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.matmul!r}"

    def load(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Take the compiled codes and scales (one device, this module's shapes and dtypes)."""
        expected = ((self.out_features, self.in_features), torch.float8_e4m3fn), ((self.out_features, 1), torch.float32)
        for name, tensor, (shape, dtype) in zip(("codes", "scales"), (codes, scales), expected):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise VflashError(
                    f"RowFP8Linear {name} must be {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
                )
        if codes.device != scales.device:
            raise VflashError(
                f"RowFP8Linear codes on {codes.device} and scales on {scales.device}: they must share a device"
            )
        self.codes, self.scales = codes, scales

    def forward(self, x: torch.Tensor | QuantizedRows, loras: tuple[M.LoraResidual, ...] = ()) -> torch.Tensor:
        if self.codes.is_meta:
            raise VflashError("RowFP8Linear has no weights yet: its loader has not assigned codes and scales")
        return self.matmul.linear(x, self.codes, self.scales, loras)


# -- block operations ----------------------------------------------------------------------------------------------


class _RowFP8Linears:
    """The block linears through a `RowFP8Matmul`; mixed into a `BlockOps` (reference or fused elementwise ops)."""

    fp8: RowFP8Matmul

    def linear(
        self, x: torch.Tensor | QuantizedRows, weight: torch.Tensor | M.RowScaledWeight,
        loras: tuple[M.LoraResidual, ...] = ()
    ) -> torch.Tensor:
        if not isinstance(weight, M.RowScaledWeight):
            raise VflashError(
                f"FP8 block operations take an FP8 artifact's weights (codes + row scales), got a {weight.dtype} matrix"
            )
        return self.fp8.linear(x, weight.codes, weight.scales, loras)


class RowFP8Ops(_RowFP8Linears, M.BlockOps):
    """`model.BlockOps` (the torch reference of every elementwise op) with the block linears in FP8."""

    def __init__(self, config: H3Config, attention: M.AttentionFn, matmul: RowFP8Matmul, reduce=None):
        super().__init__(config, attention, reduce)
        self.fp8 = matmul


class FusedRowFP8Ops(_RowFP8Linears, FusedOps):
    """`fused.FusedOps` with the block linears in FP8. With w8a8 and the "triton" quantizer, the RMSNorm + modulation
    and SwiGLU kernels write their output already quantized (`vflash_kernels.fp8_quantize`), plus its BF16 value only
    when `keep_values` (the artifact's blocks carry LoRA residuals, which read it)."""

    def __init__(
        self, config: H3Config, attention: M.AttentionFn, matmul: RowFP8Matmul, keep_values: bool, reduce=None
    ):
        super().__init__(config, attention, reduce)
        self.fp8 = matmul
        self.keep_values = keep_values
        self._fused_quantizer = matmul.mode == "w8a8" and matmul.activation_quantizer == "triton"

    # Wider than the base's return type on purpose: the quantized rows go only to this class's own `linear`.
    def norm_modulate(  # type: ignore[override]
        self, x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, row_index: torch.Tensor, which: str
    ) -> torch.Tensor | QuantizedRows:
        if not self._fused_quantizer:
            return super().norm_modulate(x, weight, table, row_index, which)
        blocks = M.MODULATION_BLOCKS[which]
        return QuantizedRows(
            *self.fp8.quantize_kernels().rms_norm_modulate_quantize(
                x, weight, self.config.norm_eps, table, row_index, shift_block=blocks.shift,
                scale_block=blocks.scale, table_blocks=blocks.count, keep_value=self.keep_values,
            )
        )

    def swiglu(self, p: torch.Tensor) -> torch.Tensor | QuantizedRows:  # type: ignore[override]
        if not self._fused_quantizer:
            return super().swiglu(p)
        return QuantizedRows(*self.fp8.quantize_kernels().swiglu_quantize(p, keep_value=self.keep_values))
