"""GGUF transformer files (city96's ComfyUI-GGUF format for diffusion models) as a tensor store.

A GGUF of a diffusion model keeps the safetensors names (here the original H3 names, optionally behind
`model.diffusion_model.`) and stores each tensor as F32, F16, BF16 or a ggml quantization type: blocks of
`block_size` consecutive elements of a row, each block `type_size` bytes holding its codes and fp16 scale(s). Dims are
listed innermost first (ggml's `ne`), so a torch shape is their reverse.

`GGUFStore` answers what `checkpoint.SourceWeights` asks of a `TensorStore` (names, shapes, row-range reads); its
reads dequantize each block as ComfyUI-GGUF's loader does (`dequantize_gguf`) and cast to the dtype of the destination
tensor, so a GGUF reads as the safetensors file it was converted from, up to its quantization. The header is parsed
with the `gguf` package (an optional dependency: the `gguf` extra); the tensor bytes are read with plain file reads,
so no file stays open.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..errors import WeightFileError
from ..tensor_store import ReadRequest, TensorIndex, TensorInfo

__all__ = ["DEQUANTIZERS", "GGUFStore", "dequantize_gguf", "require_gguf"]

QK_K = 256  # elements of a k-quant super-block
_CHUNK = 1 << 22  # elements dequantized at once: bounds the fp16 / fp32 temporaries of one read


def require_gguf():
    """The `gguf` package, or one line saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise WeightFileError(
            "reading a GGUF file needs the gguf package: pip install 'vflash[gguf]' (or pip install gguf)"
        ) from None
    return gguf


# -- dequantization: one function per ggml type, blocks [n, type_size] uint8 -> values [n, block_size] -----------
#
# ComfyUI-GGUF computes in the dtype of the blocks' fp16 scales unless told otherwise ("default" dequant_dtype):
# every product and sum rounds to fp16, in the order the functions below keep (scale * sub-scale, then * code, then
# - or + the offset); its "float32" dequant_dtype rounds each step to fp32 instead (`arithmetic`). The result is then
# cast to the layer's compute dtype.


def _half(blocks: torch.Tensor, at: int, arithmetic: torch.dtype) -> torch.Tensor:
    """The fp16 stored at byte `at` of every block, [n, 1], in `arithmetic`."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).to(arithmetic)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, b] bytes -> [n, 2, b] nibbles: the low nibbles of the b bytes, then their high nibbles."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=1)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """[n, b] bytes -> [n, 8 // width, b]: field k holds bits [k*width, (k+1)*width) of each byte."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).reshape(1, -1, 1)
    return (packed.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _high_bits_of_32(packed: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] its bits, bit j at column j."""
    return _bits(packed, 1).transpose(1, 2).reshape(packed.shape[0], 32)


def _q8_0(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [d: f16][32 x int8]
    return _half(blocks, 0, arithmetic) * blocks[:, 2:34].contiguous().view(torch.int8)


def _q4_0(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [d: f16][16 bytes: element j in the low nibble of byte j, element 16 + j in its high nibble]; value d * (q - 8)
    q = _nibbles(blocks[:, 2:18]).reshape(-1, 32).to(torch.int8) - 8
    return _half(blocks, 0, arithmetic) * q


def _q4_1(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [d: f16][m: f16][16 bytes of nibbles as Q4_0]; value d * q + m
    q = _nibbles(blocks[:, 4:20]).reshape(-1, 32)
    return _half(blocks, 0, arithmetic) * q + _half(blocks, 2, arithmetic)


def _q5_0(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [d: f16][qh: 32 fifth bits, bit j of a little-endian uint32 for element j][16 bytes of nibbles]; d * (q - 16)
    q = (_nibbles(blocks[:, 6:22]).reshape(-1, 32) | (_high_bits_of_32(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return _half(blocks, 0, arithmetic) * q


def _q5_1(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [d: f16][m: f16][qh][16 bytes of nibbles]; value d * q + m
    q = _nibbles(blocks[:, 8:24]).reshape(-1, 32) | (_high_bits_of_32(blocks[:, 4:8]) << 4)
    return _half(blocks, 0, arithmetic) * q + _half(blocks, 2, arithmetic)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit sub-block scales and mins of a Q4_K / Q5_K super-block from its 12 bytes [n, 12]: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits from the
    nibbles of bytes 8-11 (scale low, min high) and their top 2 bits from the top 2 bits of bytes 0-3 / 4-7."""
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)), dim=1)
    mins = torch.cat((second & 0x3F, (third >> 4) | ((second >> 6) << 4)), dim=1)
    return scales, mins


def _q2_k(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [16 bytes: sub-block scale (low nibble) and min (high nibble)][64 bytes of 2-bit codes][d: f16][dmin: f16];
    # element 128 h + 32 s + l is bits 2s..2s+1 of code byte 32 h + l, in sub-block (128 h + 32 s + l) // 16
    n = blocks.shape[0]
    sub = blocks[:, 0:16]
    scale = (_half(blocks, 80, arithmetic) * (sub & 0x0F)).reshape(n, 16, 1)
    offset = (_half(blocks, 82, arithmetic) * (sub >> 4)).reshape(n, 16, 1)
    q = _bits(blocks[:, 16:80].reshape(n * 2, 32), 2).reshape(n, 16, 16)
    return (scale * q - offset).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [hmask: 32 bytes, the third bit of element 32 b + l in bit b of byte l, set meaning "no -4"][64 bytes of 2-bit
    # codes laid out as Q2_K's][12 bytes: 16 signed 6-bit sub-block scales, their low 4 bits in the nibbles of bytes
    # 0-7 (sub-block k in byte k % 8, high nibble for k >= 8), their top 2 bits in bytes 8-11 (bits 2 (k // 4) of
    # byte 8 + k % 4), biased by 32][d: f16]; value d * scale * (q - 4 * (1 - hbit))
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    low = _nibbles(packed[:, 0:8]).reshape(n, 16)
    high = _bits(packed[:, 8:12], 2).reshape(n, 16)
    sub = (low | (high << 4)).to(torch.int8) - 32
    scale = (_half(blocks, 108, arithmetic) * sub).reshape(n, 16, 1)
    q = _bits(blocks[:, 32:96].reshape(n * 2, 32), 2).reshape(n, 16, 16).to(torch.int8)
    missing = ((_bits(blocks[:, 0:32], 1).reshape(n, 16, 16) & 1) ^ 1).to(torch.int8)
    return (scale * (q - (missing << 2))).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [d: f16][dmin: f16][12 bytes of 6-bit scales and mins][128 bytes: element 64 c + 32 h + l is nibble h of byte
    # 32 c + l, in sub-block 2 c + h]; value d * scale * q - dmin * min
    n = blocks.shape[0]
    sc, mn = _k_scales_and_mins(blocks[:, 4:16])
    scale = (_half(blocks, 0, arithmetic) * sc).reshape(n, 8, 1)
    offset = (_half(blocks, 2, arithmetic) * mn).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:144].reshape(n * 4, 32)).reshape(n, 8, 32)
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # as Q4_K, with [qh: 32 bytes] before the nibbles: the fifth bit of element 32 s + l is bit s of byte l
    n = blocks.shape[0]
    sc, mn = _k_scales_and_mins(blocks[:, 4:16])
    scale = (_half(blocks, 0, arithmetic) * sc).reshape(n, 8, 1)
    offset = (_half(blocks, 2, arithmetic) * mn).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 48:176].reshape(n * 4, 32)).reshape(n, 8, 32) | (_bits(blocks[:, 16:48], 1) << 4)
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    # [128 bytes: low 4 bits, element 128 h + 64 k + l in nibble k of byte 64 h + l][64 bytes: top 2 bits, element
    # 128 h + 32 s + l in bits 2s..2s+1 of byte 32 h + l][16 int8 sub-block scales][d: f16]; value d * scale * (q - 32)
    n = blocks.shape[0]
    scale = (_half(blocks, 208, arithmetic) * blocks[:, 192:208].contiguous().view(torch.int8)).reshape(n, 16, 1)
    low = _nibbles(blocks[:, 0:128].reshape(n * 2, 64)).reshape(n, 2, 128)
    high = _bits(blocks[:, 128:192].reshape(n * 2, 32), 2).reshape(n, 2, 128)
    q = (low | (high << 4)).to(torch.int8).reshape(n, 16, 16) - 32
    return (scale * q).reshape(n, QK_K)


def _bf16(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _f16(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16)


def _f32(blocks: torch.Tensor, arithmetic: torch.dtype) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


#: ggml type name -> (elements per block, bytes per block, dequantization).
DEQUANTIZERS: dict[str, tuple[int, int, Callable[[torch.Tensor, torch.dtype], torch.Tensor]]] = {
    "F32": (1, 4, _f32), "F16": (1, 2, _f16), "BF16": (1, 2, _bf16),
    "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q2_K": (QK_K, 84, _q2_k), "Q3_K": (QK_K, 110, _q3_k), "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}
FLOAT_TYPES = ("F32", "F16", "BF16")  # stored as values: ComfyUI-GGUF only casts them


def dequantize_gguf(
    raw: torch.Tensor, qtype: str, shape: tuple[int, ...], dtype: torch.dtype, arithmetic: torch.dtype = torch.float16
) -> torch.Tensor:
    """A tensor of `shape` in `dtype` from its GGUF bytes `raw` (uint8, whole blocks) of ggml type `qtype`, computed
    as ComfyUI-GGUF computes it: each block dequantized in `arithmetic` (float16, its default; float32, its
    "float32" dequant_dtype), then cast to `dtype` (F32 / F16 / BF16 tensors are cast only)."""
    _, type_size, dequantize = DEQUANTIZERS[qtype]
    blocks = raw.reshape(-1, type_size)
    return dequantize(blocks, arithmetic).reshape(shape).to(dtype)


class _Tensor:
    """Where one GGUF tensor's bytes are and how to read them."""

    def __init__(self, qtype: str, shape: tuple[int, ...], offset: int, nbytes: int):
        self.qtype, self.shape, self.offset, self.nbytes = qtype, shape, offset, nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along dim 0 of a matrix (whole blocks)."""
        return self.nbytes // self.shape[0] if self.shape[0] else 0


class GGUFStore(TensorIndex):
    """The tensors of one `.gguf` file by name (its dims reversed into torch order), read as `TensorStore` reads.

    `info(name).dtype` is the stored dtype of an F32 / F16 / BF16 tensor and float16 for a quantized one (the dtype
    ComfyUI-GGUF dequantizes in); a read dequantizes into whatever dtype its destination has. `quant_types()` counts
    the tensors of each ggml type. String key-values of the header are `metadata`. Holds no open file.
    """

    def __init__(self, path: str | Path):
        gguf = require_gguf()
        super().__init__(path, ())
        try:
            reader = gguf.GGUFReader(str(self.path))
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise WeightFileError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self._tensors: dict[str, _Tensor] = {}
        unsupported: dict[str, list[str]] = {}
        for tensor in reader.tensors:
            qtype = tensor.tensor_type.name
            if qtype not in DEQUANTIZERS:
                unsupported.setdefault(qtype, []).append(tensor.name)
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            block_size = DEQUANTIZERS[qtype][0]
            if shape and shape[-1] % block_size:
                raise WeightFileError(f"{self.path}: tensor {tensor.name!r} {list(shape)} is not whole {qtype} blocks")
            self._tensors[tensor.name] = _Tensor(qtype, shape, int(tensor.data_offset), int(tensor.n_bytes))
        if unsupported:
            found = "; ".join(f"{t} ({len(n)} tensors, e.g. {min(n)})" for t, n in sorted(unsupported.items()))
            raise WeightFileError(
                f"{self.path}: GGUF quantization type(s) Vflash does not read: {found}; "
                f"it reads {', '.join(DEQUANTIZERS)}"
            )
        marker = "comfy.gguf.orig_shape."
        reshaped = sorted(name.removeprefix(marker) for name in reader.fields if name.startswith(marker))
        if reshaped:  # only ComfyUI-GGUF's SDXL / SD1 conversions reshape tensors; an H3 file never does
            raise WeightFileError(
                f"{self.path}: tensor {reshaped[0]!r} is stored reshaped (comfy.gguf.orig_shape), "
                "which H3 files never are"
            )
        self._metadata = {}
        for name, field in reader.fields.items():
            if len(field.types) == 1 and field.types[0] == gguf.GGUFValueType.STRING:
                self._metadata[name] = bytes(field.parts[field.data[-1]]).decode("utf-8", errors="replace")
        self._file_of = {name: self for name in self._tensors}  # type: ignore[misc]
        self.files = [self]  # type: ignore[list-item]
        del reader  # its memory map closes with it

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def info(self, name: str) -> TensorInfo:
        if name not in self._tensors:
            raise WeightFileError(f"{self.path}: missing tensor {name!r}")
        t = self._tensors[name]
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(t.qtype, torch.float16)
        return TensorInfo(dtype, t.shape, t.offset, t.offset + t.nbytes)

    def quant_type(self, name: str) -> str:
        return self._tensors[name].qtype

    def quant_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            counts[t.qtype] = counts.get(t.qtype, 0) + 1
        return dict(sorted(counts.items()))

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(self.info(name).shape, dtype=self.info(name).dtype) for name in names}
        self.read_into([ReadRequest(name, tensor) for name, tensor in out.items()])
        return out

    def read_into(self, requests: Iterable[ReadRequest]) -> None:
        """Rows [row_start, row_stop) of each tensor, dequantized (a row is whole blocks) and cast to `out.dtype`,
        `_CHUNK` elements at a time at most (a matrix's rows; a vector whole)."""
        requests = list(requests)
        for request in requests:
            if request.name not in self._tensors:
                raise WeightFileError(f"{self.path}: missing tensor {request.name!r}")
        with open(self.path, "rb") as handle:
            for request in requests:
                t = self._tensors[request.name]
                rows = t.shape[0] if t.shape else 1
                start, stop = request.row_start, rows if request.row_stop is None else request.row_stop
                shape = (stop - start, *t.shape[1:]) if t.shape else ()
                if request.out.shape != shape:
                    raise WeightFileError(
                        f"{self.path}: {request.name} rows {start}:{stop} are {list(shape)}, "
                        f"not {list(request.out.shape)}"
                    )
                if len(t.shape) < 2:  # a vector's "rows" are not whole blocks: read it whole
                    raw = self._bytes(handle, t.offset, t.nbytes, request.name)
                    request.out.copy_(dequantize_gguf(raw, t.qtype, shape, request.out.dtype))
                    continue
                step = max(1, _CHUNK // max(1, math.prod(t.shape[1:])))
                for first in range(start, stop, step):
                    last = min(stop, first + step)
                    offset, size = t.offset + first * t.row_bytes, (last - first) * t.row_bytes
                    raw = self._bytes(handle, offset, size, request.name)
                    piece = (last - first, *t.shape[1:])
                    request.out[first - start : last - start] = dequantize_gguf(raw, t.qtype, piece, request.out.dtype)

    def _bytes(self, handle, offset: int, size: int, name: str) -> torch.Tensor:
        raw = torch.empty(size, dtype=torch.uint8)
        handle.seek(offset)
        # numpy's stubs declare the buffer protocol (`__buffer__`) for Python >= 3.12 only
        if handle.readinto(memoryview(raw.numpy())) != size:  # type: ignore[arg-type]
            raise WeightFileError(f"{self.path}: file ends inside tensor {name!r}")
        return raw
