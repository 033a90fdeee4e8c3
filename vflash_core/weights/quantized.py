"""ComfyUI-quantized transformer files: which layers a file quantizes and how (`quantized_layers`), and their values
dequantized as ComfyUI core defines them: fp8_scaled (`dequantize`) and int8 / int8_convrot (`dequantize_int8`).
See `checkpoint` for how `SourceWeights` reads these files."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ..errors import WeightFileError
from ..tensor_store import TensorStore
from .gguf_file import GGUFStore

__all__ = [
    "DEQUANTIZED", "FP8_FORMATS", "INT8_FORMAT", "SUPPORTED_FILES", "ScaledWeight", "dequantize", "dequantize_int8",
    "hadamard_signs", "quantized_layers",
]

# ComfyUI quantization formats with an exact dequantization: float8 codes times one scale per tensor.
FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


# ComfyUI's int8 format: int8 codes with a per-tensor or per-row scale, optionally ConvRot-rotated.
INT8_FORMAT = "int8_tensorwise"


SUPPORTED_FILES = (
    "bf16 / fp16 / fp32 weights, fp8_scaled and int8 / int8_convrot files (dequantized to BF16 as ComfyUI core "
    "dequantizes them), GGUF files (dequantized as ComfyUI-GGUF does) and pruned files (`adaln_t_table`, with a "
    "-pruned profile)"
)


@dataclass(frozen=True)
class ScaledWeight:
    """A quantized weight of a ComfyUI-quantized file: its value is `code * scale` (float8 codes with a per-tensor
    scale, or int8 codes with a per-tensor or per-row scale), rotated back from a ConvRot basis when `convrot_group`
    is non-zero (int8_convrot)."""

    scale: str  # name of its scale tensor
    code_dtype: torch.dtype
    convrot_group: int = 0  # the Hadamard group size of an int8_convrot layer; 0: not rotated


def dequantize(
    code: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`code * scale` in `dtype` as ComfyUI core computes it (comfy_kitchen's eager backend: the CPU, and GPUs without
    its CUDA kernels): the code and the scale are each cast to `dtype` (the float8 code exactly; the scale rounds),
    then one product rounds. Its Triton kernel instead multiplies by the fp32 scale before one rounding, which differs
    in the last bit of many elements whenever the scale is not a bf16 value."""
    return torch.mul(code.to(dtype), scale.to(dtype), out=out)


def hadamard_signs(group: int) -> torch.Tensor:
    """The ±1 matrix [group, group] of ConvRot's regular Hadamard transform (`group` a power of 4): the Kronecker
    powers of the symmetric 4x4 regular Hadamard matrix with -1 on its anti-diagonal. Divided by sqrt(group) it is
    orthogonal and its own inverse, which is what makes the rotation of a weight undo that of its activations."""
    base = torch.ones(4, 4, dtype=torch.float32) - 2 * torch.eye(4).flip(1)
    signs = torch.ones(1, 1)
    while signs.shape[0] < group:
        signs = torch.kron(signs, base)
    return signs


def _round_to_bf16(exact: torch.Tensor) -> torch.Tensor:
    """float64 values (in fp32's normal range, or zero) rounded once to the nearest BF16, ties to even. torch's
    float64 -> bf16 cast rounds through fp32 (twice), so the 45 low mantissa bits BF16 drops are rounded off the
    float64's bits directly (a carry steps the exponent); what is left casts exactly."""
    bits = exact.view(torch.int64)
    bits = (bits + ((1 << 44) - 1) + ((bits >> 45) & 1)) & ~((1 << 45) - 1)
    return bits.view(torch.float64).float().to(torch.bfloat16)


# Elements of an int8 weight dequantized at once: bounds the float64 temporaries (a few 8-byte copies each).
_INT8_CHUNK = 1 << 22


def dequantize_int8(code: torch.Tensor, scale: torch.Tensor, convrot_group: int, dtype: torch.dtype) -> torch.Tensor:
    """An int8 layer's weight [rows, cols] in `dtype` (bf16 or fp32) from its int8 codes [rows, cols] and fp32 scale
    (one, or one per row: [rows, 1] / [rows]).

    Without ConvRot, core's value: the fp32 product `code * scale` cast to `dtype`. With ConvRot (`convrot_group` g),
    core's definition is `((code * scale) @ H.T)` per group of g columns, H the normalised regular Hadamard matrix
    (`hadamard_signs(g) / sqrt(g)`), cast to `dtype`; core evaluates it in fp32 in a backend-dependent order. Here it
    is evaluated exactly: the integer sums `code @ signs.T` (each partial sum an integer below 128 g < 2^24, exact in
    fp32 whatever order the GEMM sums in), times the scale / sqrt(g) (sqrt(g) a power of two) in float64 (exact: 24 x
    16 bits), then rounded once to `dtype`. Computed in row chunks."""
    rows, cols = code.shape
    per_row = scale.numel() > 1
    scale = scale.float().reshape(-1, 1) if per_row else scale.float().reshape(())
    if not convrot_group:
        return (code.float() * scale).to(dtype)
    signs = hadamard_signs(convrot_group).T
    factor = scale.double() / math.isqrt(convrot_group)
    out = torch.empty(rows, cols, dtype=dtype)
    step = max(1, _INT8_CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        sums = (
            code[start:stop].float().reshape(stop - start, cols // convrot_group, convrot_group) @ signs
        ).reshape(stop - start, cols)
        exact = sums.double() * (factor[start:stop] if per_row else factor)
        out[start:stop] = _round_to_bf16(exact) if dtype == torch.bfloat16 else exact.to(dtype)
    return out


# How a quantized file's weights became what Vflash runs, as a receipt and an artifact record it (`describe`).
DEQUANTIZED = {
    "int8_convrot": (
        "int8_convrot file dequantized to BF16: int8 code x row scale rotated back from the ConvRot basis, the exact "
        "value rounded once (ComfyUI core's fp32 rotation may round the last BF16 bit otherwise); exact for those "
        "weights. ComfyUI core runs them as int8 GEMMs on per-row-quantized activations, so core's own outputs are "
        "approximate relative to these"
    ),
    "int8": (
        "int8 file dequantized to BF16 as ComfyUI core dequantizes it (fp32 code x scale, cast to BF16); exact for "
        "those weights. ComfyUI core runs them as int8 GEMMs on per-row-quantized activations (approximate)"
    ),
    "gguf": (
        "GGUF file dequantized as ComfyUI-GGUF dequantizes each quantization type (fp16 block arithmetic), cast to "
        "the release's dtypes (BF16; FP32 where the release keeps FP32); exact for those weights, which are not the "
        "BF16 release"
    ),
}


def _format_name(conf: dict) -> str:
    fmt = str(conf.get("format"))
    if fmt == INT8_FORMAT and _convrot_group(conf):
        return "int8_convrot"
    return fmt


def _convrot_group(conf: dict) -> int:
    """The ConvRot group size of an int8 layer's ComfyUI config (0 without ConvRot); its keys sit at the top level or
    under `params`, as core reads them."""
    params = conf.get("params")
    if not isinstance(params, dict):
        params = {}
    if not conf.get("convrot", params.get("convrot", False)):
        return 0
    group = conf.get("convrot_groupsize", params.get("convrot_groupsize", 256))
    return group if isinstance(group, int) and not isinstance(group, bool) else -1


def quantized_layers(store: TensorStore | GGUFStore, prefix: str) -> dict[str, ScaledWeight]:
    """Weight name -> `ScaledWeight` for each quantized layer of a ComfyUI-quantized file (empty for a float file).

    ComfyUI marks quantized layers in three ways, read here as core reads them: `__metadata__` key
    `_quantization_metadata` (JSON `{"layers": {layer: {"format": ...}}}`, scales `<layer>.weight_scale`), which takes
    precedence over per-layer `<layer>.comfy_quant` tensors (the same JSON as bytes); or the older scaled-FP8 layout (a
    `scaled_fp8` tensor, and every layer with a `<layer>.scale_weight` is float8_e4m3fn). A format other than
    per-tensor float8 raises, naming it and what is supported.
    """
    def parse(text: str | bytes, what: str) -> dict:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            value = None
        if not isinstance(value, dict):
            raise WeightFileError(f"{store.path}: {what} is not a JSON object")
        return value

    names = set(store.names)
    formats: dict[str, dict] = {}
    flags = [n for n in names if n.endswith(".comfy_quant")]
    for name, tensor in store.read(flags).items():
        formats[name.removesuffix(".comfy_quant")] = parse(bytes(tensor.reshape(-1).tolist()), name)
    legacy: set[str] = set()  # layers of the older layout, whose scale is `<layer>.scale_weight`
    if "_quantization_metadata" in store.metadata:
        layers = parse(store.metadata["_quantization_metadata"], "`_quantization_metadata`").get("layers", {})
        formats.update({layer: conf if isinstance(conf, dict) else {} for layer, conf in layers.items()})
    elif f"{prefix}scaled_fp8" in names:
        legacy = {n.removesuffix(".scale_weight") for n in names if n.endswith(".scale_weight")}
        formats.update({layer: {"format": "float8_e4m3fn"} for layer in legacy})
    refused: dict[str, list[str]] = {}
    for layer, conf in formats.items():
        if _format_name(conf) not in (*FP8_FORMATS, INT8_FORMAT, "int8_convrot"):
            refused.setdefault(_format_name(conf), []).append(layer)
    if refused:
        found = "; ".join(
            f"{fmt} ({len(layers)} layers, e.g. {min(layers)})" for fmt, layers in sorted(refused.items())
        )
        raise WeightFileError(
            f"{store.path}: {found}: a quantization format Vflash does not read; Vflash reads {SUPPORTED_FILES}"
        )
    bad_groups = sorted(
        layer for layer, conf in formats.items()
        if _format_name(conf) == "int8_convrot" and not _is_power_of_4(_convrot_group(conf))
    )
    if bad_groups:
        raise WeightFileError(
            f"{store.path}: int8_convrot layer {bad_groups[0]} has convrot_groupsize "
            f"{_convrot_group(formats[bad_groups[0]])!r}; a ConvRot group is a power of 4"
        )
    # A missing scale is named by the key its marking reads (`weight_scale`; `scale_weight` only in the older layout).
    return {
        f"{layer}.weight": ScaledWeight(
            f"{layer}.{'scale_weight' if layer in legacy else 'weight_scale'}",
            torch.int8 if conf["format"] == INT8_FORMAT else FP8_FORMATS[conf["format"]],
            _convrot_group(conf) if conf["format"] == INT8_FORMAT else 0,
        )
        for layer, conf in sorted(formats.items())
    }


def _is_power_of_4(value: int) -> bool:
    return value >= 4 and value & (value - 1) == 0 and value.bit_length() % 2 == 1
