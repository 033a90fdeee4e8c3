"""Official MiniMax-H3 transformer weights, read into one internal naming.

Two on-disk layouts exist:

* **diffusers** — the `transformer/` or `transformer_ref/` folder of MiniMaxAI/MiniMax-H3: `config.json` plus one or
  more `diffusion_pytorch_model*.safetensors`, separate `to_q/to_k/to_v`, SwiGLU input stored `[value; gate]`.
* **original** — the reference implementation's names (`blocks.{i}.attn.qkv_proj`, `mlp.fc1`, `final_layer.*`), as a
  single file or shards. `mlp.fc1` is stored `[gate; value]`; the fused QKV is `stacked` (`[q; k; v]`, published
  single files) or per-head `interleaved` (raw MiniMaxAI shards), which shapes cannot tell apart.

Comfy-Org's repacked single files (original layout, stacked QKV) come in further forms:

* **fp8_scaled** — ComfyUI's scaled-FP8 files: the block linears stored as float8 codes with one scale per tensor.
  They are read as BF16 `code * scale`, computed as ComfyUI core dequantizes them (`dequantize`), so what Vflash
  runs is exact for those weights. For an FP8 profile the main blocks' E4M3 linears are instead kept as stored
  (`read_codes`: the file's codes, its per-tensor scale repeated per row), never dequantized and re-quantized.
* **int8_convrot** — ComfyUI's `int8_tensorwise` layers with `convrot`: int8 codes with one fp32 scale per output
  row, stored in a basis rotated by a block-diagonal normalised Hadamard matrix (groups of `convrot_groupsize`
  input columns). Read as BF16 by `dequantize_int8`: the value core's dequantization defines, `(code * scale)`
  rotated back, rounded once (core's own fp32 rotation may round the last BF16 bit differently, its summation order
  depending on the backend). Core itself never runs these weights dequantized: its int8 GEMMs quantize the
  activations per row too, so Vflash's result is exact for the dequantized weights and approximate relative to
  core. `int8_tensorwise` without convrot (`code * scale`, core's fp32 product rounded to BF16) is bitwise core's.
* **GGUF** (`.gguf`, through `gguf_file.GGUFStore`, needs the `gguf` package) — the same original names, each
  tensor dequantized as ComfyUI-GGUF dequantizes its quant type into the dtype the release stores it in.
* **pruned** (`*_pruned_*`) — an `adaln_t_table` [grid, k] fp32 replaces the time embedder, and every `adaln_proj`
  is a reduced-rank fp32 [rows, k] projection applied without SiLU. They compile only for `-pruned` profiles
  (approximate: see `model.curve_time_embedding`); a pruned GGUF too.
* other ComfyUI quantized formats (nvfp4, mxfp8, convrot_w4a4, ...) are refused.

Internal names (what the compiler and the runtime use)::

    blocks.{i}.norm1.weight            [H]
    blocks.{i}.attn.qkv.weight         [3*inner, H]   stacked q; k; v
    blocks.{i}.attn.norm_q.weight      [head_dim]
    blocks.{i}.attn.norm_k.weight      [head_dim]
    blocks.{i}.attn.out.weight         [H, inner]
    blocks.{i}.norm2.weight            [H]
    blocks.{i}.ffn.in.weight           [2*ffn, H]     value; gate
    blocks.{i}.ffn.out.weight          [H, ffn]
    blocks.{i}.adaln.weight / .bias    [18*H, temb], [18*H]   (source only; compiled into tables)
    refiner.{j}.*                      as a block, without adaln
    refiner.final_norm.weight, proj_in.*, audio_proj_in.*, context_embedder.*, time_embedder.linear_{1,2}.*,
    norm_out.norm.weight, norm_out.linear.*, proj_out.*, audio_proj_out.*

Everything is read with `TensorStore` row-range reads straight into the final tensors, so fusing Q/K/V, swapping the
SwiGLU halves and de-interleaving heads cost no intermediate copies.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import torch

from ..engine.artifact import FLOAT_DTYPES
from ..engine.config import FP32_PARTS, H3Config, aux_shapes, block_shapes
from ..errors import IdentityMismatchError, WeightFileError
from ..profiles import PROFILES, Profile
from ..tensor_store import ReadRequest, TensorStore
from .gguf_file import GGUFStore
from .quantized import (
    DEQUANTIZED,
    FP8_FORMATS,
    SUPPORTED_FILES,
    ScaledWeight,
    dequantize,
    dequantize_int8,
    quantized_layers,
)

__all__ = ["AUX_NAMES", "BLOCK_NAMES", "SourceWeights", "internal_shapes", "release_dtype", "source_name"]

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


# Prefixes some single-file exports put in front of the original names.
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# Internal aux module -> (diffusers name, original name); each has a `.weight` and a `.bias`.
AUX_NAMES = {
    "proj_in": ("proj_in", "video_patch_proj"),
    "audio_proj_in": ("audio_proj_in", "audio_patch_proj"),
    "context_embedder": ("context_embedder", "condition_proj"),
    "time_embedder.linear_1": ("time_embedder.linear_1", "time_embedder.proj_in"),
    "time_embedder.linear_2": ("time_embedder.linear_2", "time_embedder.proj_out"),
    "norm_out.linear": ("norm_out.linear", "final_layer.adaln_proj.linear"),
    "proj_out": ("proj_out", "final_layer.video_out"),
    "audio_proj_out": ("audio_proj_out", "final_layer.audio_out"),
}
# The other tensors outside the blocks: internal name -> (diffusers name, original name).
_AUX_TENSORS = {
    "norm_out.norm.weight": ("norm_out.norm.weight", "final_layer.norm.weight"),
    "refiner.final_norm.weight": ("token_refiner.final_norm.weight", "token_refiner.final_norm.weight"),
    "adaln_t_table": ("adaln_t_table", "adaln_t_table"),  # pruned files only
}
# Internal block list -> (diffusers, original) prefix of its blocks.
BLOCK_PREFIXES = {
    "blocks": ("transformer_blocks", "blocks"),
    "refiner": ("token_refiner.refiner_blocks", "token_refiner.blocks"),
}
# Internal block tensor -> (diffusers name, original name), below the block's prefix. Diffusers stores Q, K and V apart
# (`{}` stands for q, k or v); the original `mlp.fc1` is stored [gate; value] and its fused QKV may be interleaved per
# head (`SourceWeights._build_sources` reads those rows in internal order).
BLOCK_NAMES = {
    "norm1.weight": ("norm1.weight", "norm1.weight"),
    "attn.qkv.weight": ("attn.to_{}.weight", "attn.qkv_proj.weight"),
    "attn.norm_q.weight": ("attn.norm_q.weight", "attn.q_norm.weight"),
    "attn.norm_k.weight": ("attn.norm_k.weight", "attn.k_norm.weight"),
    "attn.out.weight": ("attn.to_out.0.weight", "attn.out_proj.weight"),
    "norm2.weight": ("norm2.weight", "norm2.weight"),
    "ffn.in.weight": ("ff.net.0.proj.weight", "mlp.fc1.weight"),
    "ffn.out.weight": ("ff.net.2.weight", "mlp.fc2.weight"),
    "adaln.weight": ("adaln_proj.linear.weight", "adaln_proj.linear.weight"),
    "adaln.bias": ("adaln_proj.linear.bias", "adaln_proj.linear.bias"),
}


def source_name(internal: str, original: bool) -> str:
    """The name internal tensor `internal` has in the original layout (without an export prefix) or in diffusers'
    (for diffusers' QKV a template: `{}` is q, k or v)."""
    column = 1 if original else 0
    kind, _, rest = internal.partition(".")
    index, _, local = rest.partition(".")
    if kind in BLOCK_PREFIXES and index.isdigit():
        return f"{BLOCK_PREFIXES[kind][column]}.{index}.{BLOCK_NAMES[local][column]}"
    module, _, suffix = internal.rpartition(".")
    if module in AUX_NAMES:
        return f"{AUX_NAMES[module][column]}.{suffix}"
    return _AUX_TENSORS[internal][column]


def internal_shapes(config: H3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint in internal names, in file order: blocks, refiner blocks, auxiliary tensors."""
    shapes = {}
    for i in range(config.num_layers):
        shapes.update(block_shapes(config, f"blocks.{i}", with_adaln=True))
    for j in range(config.num_refiner_layers):
        shapes.update(block_shapes(config, f"refiner.{j}", with_adaln=False))
    shapes.update(aux_shapes(config))
    return shapes


# How to fill one internal tensor: (source name, src_row_start, src_row_stop, dst_row_start) row ranges, stop -1 for
# the whole source tensor.
_Pieces = list[tuple[str, int, int, int]]


# Elements checked at once by `check_finite`: bounds the temporary mask (1 byte each) whatever the tensor's size.
_FINITE_CHUNK = 1 << 24


def check_finite(tensor: torch.Tensor, name: str, path: Path) -> None:
    """Refuse a floating-point tensor holding NaN or an infinity, naming it and its file: one such weight or scale
    poisons every output it touches (an fp8_scaled file with a NaN scale compiled, then failed in the MP4 encoder)."""
    if not tensor.is_floating_point():
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        chunk = flat[start : start + _FINITE_CHUNK]
        if chunk.dtype in FP8_FORMATS.values():  # float8 has no isfinite; widening is exact
            chunk = chunk.float()
        if not bool(torch.isfinite(chunk).all()):
            bad = start + int((~torch.isfinite(chunk)).nonzero()[0])
            raise WeightFileError(
                f"{path}: tensor {name!r} holds a non-finite value ({flat[bad].item()} at element {bad}); "
                "the file is corrupt"
            )


def release_dtype(internal: str, pruned: bool) -> torch.dtype:
    """The dtype of an internal tensor in the release: fp32 for the patch projections, the time embedder and the
    output heads (a pruned file's time table and reduced-rank AdaLN projections too), bf16 for everything else."""
    fp32 = internal.startswith(FP32_PARTS) or internal == "adaln_t_table" or (
        pruned and (".adaln." in internal or internal.startswith("norm_out.linear."))
    )
    return torch.float32 if fp32 else torch.bfloat16


class _TimeWidths(TypedDict, total=False):
    """The time embedder's widths read from an unpruned file (a pruned file has none: `H3Config`'s defaults stay)."""

    freq_dim: int
    time_embed_hidden_dim: int
    time_embed_dim: int


class SourceWeights:
    """An H3 transformer checkpoint (official, a Comfy-Org fp8_scaled / int8_convrot / pruned file, or a GGUF),
    readable in internal naming. Holds no open file.

    Args:
        path: a diffusers `transformer/` folder, a single `.safetensors` or `.gguf` file, an index json, or a folder
            of original-layout shards.
        qkv_layout: for the original layout only, `"stacked"` (default; published single files) or `"interleaved"`
            (raw MiniMaxAI shards).
        config: the transformer config; read from `config.json` (diffusers folder), the file's `__metadata__`
            `config` entry, or inferred from tensor shapes, in that order, when not given. For a pruned file it is
            the base model's (`time_embed_dim` is the full width; the file's rank is `curve[1]`).

    `format` is "fp8_scaled", "int8_convrot", "int8", "gguf" or the main blocks' stored dtype ("bf16", "fp16",
    "fp32"); `curve` is (grid, rank) of a pruned file's `adaln_t_table`, else None; `gguf` whether it is a GGUF.
    """

    def __init__(self, path: str | Path, qkv_layout: str | None = None, config: H3Config | None = None):
        self.path = Path(path)
        self.gguf = self.path.suffix.lower() == ".gguf"
        self.store: TensorStore | GGUFStore = GGUFStore(self.path) if self.gguf else TensorStore(self.path)
        names = set(self.store.names)
        if "transformer_blocks.0.attn.to_q.weight" in names:
            self.layout = "diffusers"
            if qkv_layout not in (None, "stacked"):
                raise WeightFileError(f"{self.path}: qkv_layout={qkv_layout!r} applies to the original layout only")
            self.qkv_layout = "separate"
            self._prefix = ""
        else:
            self._prefix = next((p for p in _ORIGINAL_PREFIXES if f"{p}blocks.0.attn.qkv_proj.weight" in names), "")
            if f"{self._prefix}blocks.0.attn.qkv_proj.weight" not in names:
                raise WeightFileError(
                    f"{self.path}: not an H3 transformer checkpoint (no `transformer_blocks.0.attn.to_q.weight` or "
                    "`blocks.0.attn.qkv_proj.weight`)"
                )
            self.layout = "original"
            qkv_layout = qkv_layout or "stacked"
            if qkv_layout not in ("stacked", "interleaved"):
                raise WeightFileError(f"qkv_layout must be 'stacked' or 'interleaved', got {qkv_layout!r}")
            self.qkv_layout = qkv_layout
        table = f"{self._prefix}adaln_t_table"
        self.curve: tuple[int, int] | None = None
        if table in names:
            shape = self.store.info(table).shape
            # a GGUF's table reads as fp32 whatever float type stores it
            if len(shape) != 2 or shape[0] < 2 or (self.store.info(table).dtype != torch.float32 and not self.gguf):
                raise WeightFileError(
                    f"{self.path}: `adaln_t_table` must be a [grid >= 2, rank] fp32 table, "
                    f"found {list(shape)} {self.store.info(table).dtype}"
                )
            self.curve = (shape[0], shape[1])
        self._quantized = quantized_layers(self.store, self._prefix)
        self.config = config or self._find_config()
        self._shapes = self._build_shapes()
        self._aux = {*aux_shapes(self.config), "adaln_t_table"} & set(self._shapes)
        self._sources = self._build_sources()
        self._validate()
        self._scales = self.store.read(sorted({q.scale for q in self._quantized.values()}))
        for name, scale in self._scales.items():  # read once, here: a NaN scale is refused by prepare already
            check_finite(scale, name, self.path)
        int8 = [q for q in self._quantized.values() if q.code_dtype == torch.int8]
        if self.gguf:
            self.format = "gguf"
        elif int8:
            self.format = "int8_convrot" if any(q.convrot_group for q in int8) else "int8"
        else:
            self.format = "fp8_scaled" if self._quantized else _DTYPE_NAMES[self.dtype_of("blocks.0.attn.qkv.weight")]

    @property
    def pruned(self) -> bool:
        return self.curve is not None

    def describe(self) -> dict[str, object]:
        """What a receipt and a compiled artifact record of the weights' form: `format`, `quantized_layers` (the
        ComfyUI-quantized layers, or a GGUF's quantized tensors), `pruned`; for a quantized file also `quant_types`
        (tensor count per quantization type) and `dequantized` (one line: how its weights became BF16, and how
        exact that is)."""
        record: dict[str, object] = {
            "format": self.format, "quantized_layers": self._quantized_count(),
            "pruned": None if self.curve is None else {"grid": self.curve[0], "rank": self.curve[1]},
        }
        types = self._quant_types()
        if types and self.format != "fp8_scaled":  # an fp8_scaled file's record is as it was
            record["quant_types"] = types
            record["dequantized"] = DEQUANTIZED[self.format]
        return record

    def _quant_types(self) -> dict[str, int]:
        if isinstance(self.store, GGUFStore):
            return self.store.quant_types()
        types: dict[str, int] = {}
        for q in self._quantized.values():
            kind = "int8_convrot" if q.convrot_group else str(q.code_dtype).removeprefix("torch.")
            types[kind] = types.get(kind, 0) + 1
        return dict(sorted(types.items()))

    def _quantized_count(self) -> int:
        if isinstance(self.store, GGUFStore):
            return sum(n for t, n in self.store.quant_types().items() if t not in ("F32", "F16", "BF16"))
        return len(self._quantized)

    def check_profile(self, profile: Profile) -> None:
        """A pruned file compiles only for a -pruned profile, and a -pruned profile only from a pruned file."""
        if self.pruned and not profile.pruned:
            assert self.curve is not None  # what `pruned` tests
            grid, rank = self.curve
            choices = (
                ", ".join(p for p, v in PROFILES.items() if v.pruned and v.arch == profile.arch) or "a -pruned profile"
            )
            raise IdentityMismatchError(
                f"{self.path} is a pruned file (an `adaln_t_table` [{grid}, {rank}] replaces the time embedder): it "
                f"compiles only for a -pruned profile (approximate AdaLN), not {profile.id}; for {profile.arch}: "
                f"{choices}"
            )
        if profile.fp8 and (self.gguf or any(q.code_dtype == torch.int8 for q in self._quantized.values())):
            raise IdentityMismatchError(
                f"{self.path} is a {self.format} file: FP8 profile {profile.id} would quantize its dequantized "
                "weights a second time; choose a BF16 profile"
            )
        if profile.fp8 and self._quantized:
            other = sorted(
                n for n, q in self._quantized.items()
                if q.code_dtype != torch.float8_e4m3fn and n in self._block_linear_sources()
            )
            if other:
                raise IdentityMismatchError(
                    f"{self.path} stores block linears as "
                    f"{str(self._quantized[other[0]].code_dtype).removeprefix('torch.')} (e.g. {other[0]}): "
                    f"FP8 profile {profile.id} keeps a file's float8_e4m3fn codes and never re-quantizes them; "
                    "choose a BF16 profile"
                )
        if profile.pruned and not self.pruned:
            raise IdentityMismatchError(
                f"profile {profile.id} is for pruned files (with an `adaln_t_table`); {self.path} holds the full AdaLN "
                "weights: choose the profile without -pruned"
            )

    def _block_linear_sources(self) -> set[str]:
        """The file names of the main blocks' four FP8 linears (`fp8.FP8_LINEARS`)."""
        linears = ("attn.qkv.weight", "attn.out.weight", "ffn.in.weight", "ffn.out.weight")
        return {
            name
            for i in range(self.config.num_layers)
            for linear in linears
            for name, *_ in self._sources[f"blocks.{i}.{linear}"]
        }

    # -- config -------------------------------------------------------------------------------------------------

    def _find_config(self) -> H3Config:
        folder = self.path if self.path.is_dir() else self.path.parent
        if self.layout == "diffusers" and (folder / "config.json").is_file():
            return H3Config.from_file(folder / "config.json")
        if "config" in self.store.metadata:
            return H3Config.from_dict(json.loads(self.store.metadata["config"]))
        return self._infer_config()

    def _infer_config(self) -> H3Config:
        def shape(name: str) -> tuple[int, ...]:
            return self.store.info(self._raw(name)).shape

        head_dim = shape("blocks.0.attn.q_norm.weight")[0]
        inner = shape("blocks.0.attn.qkv_proj.weight")[0] // 3
        video_patch = shape("video_patch_proj.weight")
        def count(pattern: str) -> int:
            found = [int(m.group(1)) for n in self.store.names if (m := re.match(pattern, n))]
            return 1 + max(found, default=-1)

        prefix = re.escape(self._prefix)
        num_layers = count(rf"{prefix}blocks\.(\d+)\.")
        num_refiner = count(rf"{prefix}token_refiner\.blocks\.(\d+)\.")
        time: _TimeWidths = {}
        if not self.pruned:  # a pruned file has no time embedder: the base model's widths stay the defaults
            time = {
                "freq_dim": shape("time_embedder.proj_in.weight")[1],
                "time_embed_hidden_dim": shape("time_embedder.proj_in.weight")[0],
                "time_embed_dim": shape("time_embedder.proj_out.weight")[0],
            }
        return H3Config(
            num_attention_heads=inner // head_dim,
            attention_head_dim=head_dim,
            hidden_size=video_patch[0],
            num_layers=num_layers,
            num_refiner_layers=num_refiner,
            ffn_dim=shape("blocks.0.mlp.fc2.weight")[1],
            in_channels=video_patch[1] // 4,
            audio_in_channels=shape("audio_patch_proj.weight")[1],
            text_dim=shape("condition_proj.weight")[1],
            **time,
            # Comfy-Org files keep the `rope.inv_freq` buffer; otherwise the release's: 3/4 of each head (96 of 128).
            rope_freq_dim=shape("rope.inv_freq")[0] if self._raw("rope.inv_freq") in self.store else head_dim // 8,
        )

    def _raw(self, name: str) -> str:
        return f"{self._prefix}{name}"

    # -- name mapping -------------------------------------------------------------------------------------------

    def _build_sources(self) -> dict[str, _Pieces]:
        c = self.config
        inner, d, f = c.inner_dim, c.attention_head_dim, c.ffn_dim
        original = self.layout == "original"
        sources: dict[str, _Pieces] = {}
        for internal in self._shapes:
            name = self._raw(source_name(internal, original))
            if internal.endswith(".attn.qkv.weight") and not original:
                sources[internal] = [(name.format(p), 0, inner, k * inner) for k, p in enumerate("qkv")]
            elif internal.endswith(".attn.qkv.weight") and self.qkv_layout == "interleaved":
                # per head [q k v] -> [q_all; k_all; v_all]
                rows = [(h * 3 + k, k * inner + h * d) for h in range(c.num_attention_heads) for k in range(3)]
                sources[internal] = [(name, src * d, (src + 1) * d, dst) for src, dst in rows]
            elif internal.endswith(".ffn.in.weight") and original:  # stored [gate; value]; internal [value; gate]
                sources[internal] = [(name, f, 2 * f, 0), (name, 0, f, f)]
            else:
                sources[internal] = [(name, 0, -1, 0)]
        return sources

    # -- validation and reads -----------------------------------------------------------------------------------

    def _build_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = internal_shapes(self.config)
        if self.curve is not None:  # reduced-rank AdaLN projections read the table's curve; no time embedder
            grid, rank = self.curve
            h = self.config.hidden_size
            for i in range(self.config.num_layers):
                shapes[f"blocks.{i}.adaln.weight"] = (18 * h, rank)
            shapes["norm_out.linear.weight"] = (2 * h, rank)
            shapes = {name: shape for name, shape in shapes.items() if not name.startswith("time_embedder.")}
            shapes["adaln_t_table"] = (grid, rank)
        return shapes

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every internal tensor of this checkpoint with its shape."""
        return dict(self._shapes)

    def _validate(self) -> None:
        """Every source tensor present with the shape the config implies and a float dtype (float8 for the layers a
        scaled-FP8 file quantizes, each with a one-element float scale); one error lists all."""
        expect: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]] = {}
        for internal, shape in self._shapes.items():
            for name, start, stop, _ in self._sources[internal]:
                if name not in expect:
                    # a piece of a fused internal tensor comes from diffusers' to_q / to_k / to_v (inner_dim rows each)
                    # or from the original fused qkv_proj / fc1 (the internal row count)
                    rows = self.config.inner_dim if stop != -1 and self.layout == "diffusers" else shape[0]
                    expect[name] = ((rows, *shape[1:]), FLOAT_DTYPES)
        unmarked = sorted(
            n for n in expect
            if n in self.store and n not in self._quantized and self.store.info(n).dtype not in FLOAT_DTYPES
        )
        if unmarked:
            dtypes = sorted({str(self.store.info(n).dtype).removeprefix("torch.") for n in unmarked})
            raise WeightFileError(
                f"{self.path}: {len(unmarked)} weight(s) stored as {'/'.join(dtypes)} without ComfyUI quantization "
                f"metadata (e.g. {unmarked[0]}); Vflash reads {SUPPORTED_FILES}"
            )
        for name, scaled in self._quantized.items():
            if name in expect:
                expect[name] = (expect[name][0], (scaled.code_dtype,))
                stored = self.store.info(scaled.scale).shape if scaled.scale in self.store else ()
                # one element (0-d or not); an int8 layer's may be one per row instead, [rows, 1] or [rows]
                per_row = scaled.code_dtype == torch.int8 and stored in ((expect[name][0][0], 1), (expect[name][0][0],))
                expect[scaled.scale] = (stored if math.prod(stored) == 1 or per_row else (), FLOAT_DTYPES)
                cols = expect[name][0][-1]
                if scaled.convrot_group and cols % scaled.convrot_group:
                    raise WeightFileError(
                        f"{self.path}: int8_convrot weight {name} has {cols} columns, not a multiple of its "
                        f"convrot_groupsize {scaled.convrot_group}"
                    )
        self.store.require(expect)
        adaln = (".adaln.weight", ".adaln.bias") if self.pruned else ()  # a pruned file's are fp32 by design
        block_dtypes = {self.dtype_of(n) for n in self._shapes if n.startswith("blocks.") and not n.endswith(adaln)}
        if len(block_dtypes) > 1:
            raise WeightFileError(f"{self.path}: main-block tensors mix dtypes {sorted(map(str, block_dtypes))}")

    def stores_e4m3(self, internal: str) -> bool:
        """Whether an internal weight is stored as float8_e4m3fn codes with per-tensor scales, every piece of it (the
        block linears of an fp8_scaled file): an FP8 profile then keeps those codes (`read_codes`)."""
        return all(
            name in self._quantized and self._quantized[name].code_dtype == torch.float8_e4m3fn
            for name, *_ in self._sources[internal]
        )

    def read_codes(self, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Internal E4M3 weights (`stores_e4m3`) as the file stores them, never dequantized: (codes [rows, in]
        float8_e4m3fn, the file's bytes in internal row order; row scales [rows, 1] float32, each row the per-tensor
        scale of the file tensor it comes from). `codes * scales` is the weight's value, as for `read`."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        requests = []
        for internal in names:
            if not self.stores_e4m3(internal):
                raise WeightFileError(
                    f"{self.path}: {internal} is not stored as float8_e4m3fn codes with a per-tensor scale"
                )
            codes = torch.empty(self._shapes[internal], dtype=torch.float8_e4m3fn)
            scales = torch.empty(codes.shape[0], 1, dtype=torch.float32)
            for name, start, stop, dst in self._sources[internal]:
                rows = codes.shape[0] if stop == -1 else stop - start
                # exact widening
                scales[dst : dst + rows] = self._scales[self._quantized[name].scale].float().reshape(())
                requests.append(
                    ReadRequest(name, codes) if stop == -1 else ReadRequest(name, codes[dst : dst + rows], start, stop)
                )
            out[internal] = (codes, scales)
        self.store.read_into(requests)
        for internal, (codes, _) in out.items():
            check_finite(codes, " / ".join(dict.fromkeys(name for name, *_ in self._sources[internal])), self.path)
        return out

    def dtype_of(self, internal: str) -> torch.dtype:
        """The dtype `read` returns: the stored one, or bf16 for a ComfyUI-quantized weight (ComfyUI core dequantizes
        every quantized layer to its compute dtype, bf16 on a device with bf16). A GGUF's tensors read in the dtype the
        release (and a Comfy-Org file) stores them in (`release_dtype`): ComfyUI-GGUF casts each to its layer's
        compute dtype, whatever the GGUF type (its converter keeps small and 1-D tensors F32)."""
        if self.gguf:
            return release_dtype(internal, self.pruned)
        name = self._sources[internal][0][0]
        return torch.bfloat16 if name in self._quantized else self.store.info(name).dtype

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read internal tensors (names from `shapes()`) into fresh CPU tensors; float8 weights are dequantized."""
        out: dict[str, torch.Tensor] = {}
        requests = []
        # (code, layer, its rows, destination)
        scaled: list[tuple[torch.Tensor, ScaledWeight, slice, torch.Tensor]] = []
        for internal in names:
            tensor = torch.empty(self._shapes[internal], dtype=self.dtype_of(internal))
            out[internal] = tensor
            for name, start, stop, dst in self._sources[internal]:
                target = tensor if stop == -1 else tensor[dst : dst + stop - start]
                if name in self._quantized:
                    code = torch.empty(target.shape, dtype=self._quantized[name].code_dtype)
                    scaled.append((code, self._quantized[name], slice(start, None if stop == -1 else stop), target))
                    target = code
                requests.append(ReadRequest(name, target) if stop == -1 else ReadRequest(name, target, start, stop))
        self.store.read_into(requests)
        for code, layer, rows, target in scaled:
            scale = self._scales[layer.scale]
            if layer.code_dtype == torch.int8:  # a per-row scale follows the rows read
                target.copy_(dequantize_int8(
                    code, scale.reshape(-1)[rows] if scale.numel() > 1 else scale, layer.convrot_group, target.dtype
                ))
            else:
                dequantize(code, scale, target.dtype, out=target)
        for internal, tensor in out.items():  # as the tensors are read: no second pass over the file
            check_finite(tensor, " / ".join(dict.fromkeys(name for name, *_ in self._sources[internal])), self.path)
        return out

    def read_aux(self, include: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
        """Tensors outside the main and refiner blocks (with a pruned file's `adaln_t_table`) that `include` accepts."""
        return self.read([n for n in self._shapes if n in self._aux and include(n)])

    @property
    def files(self) -> list[Path]:
        return [shard.path for shard in self.store.files]
