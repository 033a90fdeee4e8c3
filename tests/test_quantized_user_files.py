"""The users' quantized transformer files as Vflash sources: ComfyUI's int8_convrot safetensors and city96's GGUF.

Each is checked against a reference computed independently of the code under test: int8_convrot against ComfyUI
core's formula written here in numpy (float64, rounded once to BF16, bitwise; and core's fp32 evaluation, within one
BF16 step on a stated share of elements), GGUF against the `gguf` package's own numpy dequantization (bitwise in fp32
arithmetic for every type; in ComfyUI-GGUF's default fp16 arithmetic bitwise for the one-product types, within a
stated bound for the others). Then each file compiles and generates the latents of the BF16 file holding exactly its
dequantized weights, bit for bit.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformer_files
from conftest import TINY, assert_bitwise, compile_tiny
from safetensors.torch import load_file
from transformer_files import GGUF_HALF_OFFSETS, random_gguf_blocks

from vflash_core import Geometry, NativeEngineSession, build_keyframe_bundle
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.errors import IdentityMismatchError, WeightFileError
from vflash_core.weights import synthetic
from vflash_core.weights.checkpoint import SourceWeights
from vflash_core.weights.compiler import prepare
from vflash_core.weights.gguf_file import DEQUANTIZERS, dequantize_gguf
from vflash_core.weights.quantized import dequantize_int8

gguf = pytest.importorskip("gguf")

EXACT_CPU = "t2va-base4-exact-cpu"


@pytest.fixture(scope="module")
def base_weights():
    return synthetic.random_internal_weights(TINY, seed=31)


def _generate(paths: dict, config=TINY, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(6, config.text_dim, generator=g).to(torch.bfloat16)
    bundle = build_keyframe_bundle(embeds, torch.ones(6, dtype=torch.long), Geometry(64, 96, 124), config, torch.Generator().manual_seed(seed), seed=seed)
    with NativeEngineSession(EXACT_CPU, CompiledPaths(**paths)) as session:
        return session.generate(bundle)


def _same_latents_as_its_dequantized_bf16_file(tmp_path, path) -> CompiledArtifact:
    """Compile `path` and the original-layout BF16 file of its dequantized weights; both generate the same latents."""
    source = SourceWeights(path)
    dequantized = transformer_files.write_original_transformer(tmp_path / "dequantized.safetensors", source.config, source.read(list(source.shapes())))
    (tmp_path / "q").mkdir()
    (tmp_path / "bf16").mkdir()
    ours, reference = compile_tiny(tmp_path / "q", path, EXACT_CPU), compile_tiny(tmp_path / "bf16", dequantized, EXACT_CPU)
    a, b = _generate(ours, source.config), _generate(reference, source.config)
    assert_bitwise(a.video_latents, b.video_latents, "video latents")
    assert_bitwise(a.audio_latents, b.audio_latents, "audio latents")
    assert a.metadata["base_weights"]["format"] == source.format
    return CompiledArtifact(**ours)


# -- int8_convrot ----------------------------------------------------------------------------------------------------


def _regular_hadamard_float64(group: int) -> np.ndarray:
    """ConvRot's normalised regular Hadamard matrix, built in numpy: Kronecker powers of the 4x4 matrix with -1 on its
    anti-diagonal, divided by sqrt(group)."""
    h4 = np.array([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=np.float64)
    h = h4
    while h.shape[0] < group:
        h = np.kron(h, h4)
    return h / np.sqrt(group)


def _nearest_bf16(values: np.ndarray) -> torch.Tensor:
    """float64 values rounded once to the nearest BF16 (ties to even), by their binary exponent: 8 significant bits."""
    mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    rounded = np.ldexp(np.round(mantissa * 256.0) / 256.0, exponent)  # np.round: half to even, exact in float64
    return torch.from_numpy(rounded).float().to(torch.bfloat16)  # exactly representable: both casts are exact


def _core_dequantized_float64(codes: torch.Tensor, scale: torch.Tensor, group: int) -> np.ndarray:
    """Core's int8_convrot weight, `(code * scale) @ H.T` per group of columns, evaluated exactly in float64."""
    q, s = codes.numpy().astype(np.float64), scale.numpy().astype(np.float64).reshape(-1, 1)
    rows, cols = q.shape
    return ((q * s).reshape(rows, cols // group, group) @ _regular_hadamard_float64(group).T).reshape(rows, cols)


def _core_dequantized_fp32(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Core's eager evaluation: fp32 product, fp32 rotation (numpy's summation order here), one cast to BF16."""
    q = codes.numpy().astype(np.float32) * scale.numpy().astype(np.float32).reshape(-1, 1)
    rows, cols = q.shape
    rotated = q.reshape(rows, cols // group, group) @ _regular_hadamard_float64(group).astype(np.float32).T
    return torch.from_numpy(rotated.reshape(rows, cols)).to(torch.bfloat16)


@pytest.mark.parametrize("group", [4, 16, 64, 256])
def test_int8_convrot_dequantization_is_cores_formula_rounded_once(group):
    """Bitwise the float64 value of core's formula rounded once. Core's own fp32 evaluation differs from it on under
    1 % of the elements: by at most one BF16 step, or where the exact value cancels to about zero by at most fp32's
    summation error over the group, group x 128 x scale x 2^-24 (its fp32 sums round before the cast)."""
    weight = torch.randn(96, 4 * group, generator=torch.Generator().manual_seed(group)) * 0.05
    codes, scale = synthetic.quantize_int8_convrot(weight, group)
    assert codes.dtype == torch.int8 and scale.shape == (96, 1) and scale.dtype == torch.float32
    ours = dequantize_int8(codes, scale, group, torch.bfloat16)
    assert_bitwise(ours, _nearest_bf16(_core_dequantized_float64(codes, scale, group)), f"group {group}")
    core = _core_dequantized_fp32(codes, scale, group)
    larger = torch.maximum(ours.float().abs(), core.float().abs())
    summation = group * 128 * scale * 2.0 ** -24
    assert ((ours.float() - core.float()).abs() <= torch.finfo(torch.bfloat16).eps * larger + summation).all()
    assert float((ours != core).float().mean()) < 0.01
    # the rotation undone: per row, the weight's distance to the original is at most that of the rotated codes (the
    # rotation is orthogonal: at most half a step each) plus the BF16 rounding
    distance = (ours.float() - weight).norm(dim=1, keepdim=True)
    assert (distance <= scale * 0.5 * weight.shape[1] ** 0.5 + 2 ** -8 * weight.norm(dim=1, keepdim=True)).all()


def test_int8_without_convrot_is_cores_fp32_product_cast():
    codes = torch.randint(-128, 128, (16, 24), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    for scale in (torch.rand(16, 1) * 0.01, torch.tensor(0.0123)):
        expected = torch.from_numpy(codes.numpy().astype(np.float32) * scale.numpy().astype(np.float32)).to(torch.bfloat16)
        assert_bitwise(dequantize_int8(codes, scale, 0, torch.bfloat16), expected, f"scale {list(scale.shape)}")


@pytest.mark.parametrize("marking", ["comfy_quant", "metadata"])
def test_int8_convrot_file_reads_as_core_dequantizes(tmp_path, base_weights, marking):
    """Each int8_convrot layer (every block and refiner linear, the AdaLN projections and condition_proj: their columns
    are multiples of the group) reads as core's value rounded once; every other tensor as stored."""
    path = synthetic.write_comfy_transformer(tmp_path / "h3_int8_convrot.safetensors", TINY, base_weights, int8_convrot=4, int8_marking=marking)
    raw = load_file(path)
    source = SourceWeights(path)
    layers = [k.removesuffix(".weight_scale") for k in raw if k.endswith(".weight_scale")]
    assert source.format == "int8_convrot" and len(layers) == TINY.num_layers * 5 + TINY.num_refiner_layers * 4 + 1
    assert source.describe()["quant_types"] == {"int8_convrot": len(layers)} and "rounded once" in source.describe()["dequantized"]
    ours = synthetic.to_original_names(source.read(list(source.shapes())), TINY)
    for layer in layers:
        expected = _nearest_bf16(_core_dequantized_float64(raw[f"{layer}.weight"], raw[f"{layer}.weight_scale"], 4))
        assert_bitwise(ours[f"{layer}.weight"], expected, layer)
    for name, tensor in raw.items():
        if name in ours and name.removesuffix(".weight") not in layers:
            assert_bitwise(ours[name], tensor, name)


def test_int8_convrot_file_is_exact_for_its_weights(tmp_path, base_weights):
    """Compiled, it generates the BF16 file of its dequantized weights bit for bit; the artifact records the format,
    the quant types and how the weights were dequantized."""
    path = synthetic.write_comfy_transformer(tmp_path / "h3_int8_convrot.safetensors", TINY, base_weights, int8_convrot=4)
    artifact = _same_latents_as_its_dequantized_bf16_file(tmp_path, path)
    base = artifact.base_weights
    assert base["format"] == "int8_convrot" and base["quant_types"] == {"int8_convrot": base["quantized_layers"]}
    assert "approximate relative to these" in base["dequantized"]


def test_fp8_profiles_refuse_int8_and_gguf_files(tmp_path, base_weights):
    int8 = synthetic.write_comfy_transformer(tmp_path / "h3_int8_convrot.safetensors", TINY, base_weights, int8_convrot=4)
    q8 = transformer_files.write_gguf_transformer(tmp_path / "h3-Q8_0.gguf", TINY, base_weights, _gguf_types("Q8_0"))
    for path, fmt in ((int8, "int8_convrot"), (q8, "gguf")):
        with pytest.raises(IdentityMismatchError, match=rf"is a {fmt} file: FP8 profile t2va-base4-fp8-cpu would quantize its dequantized weights a second time; choose a BF16 profile$"):
            prepare("t2va-base4-fp8-cpu", path, tmp_path / "receipt.json")
    assert not (tmp_path / "receipt.json").exists()


# -- GGUF ------------------------------------------------------------------------------------------------------------

# One rounding between the exact value and ComfyUI-GGUF's fp16 result: a code times the fp16 block scale.
_ONE_PRODUCT = ("Q8_0", "Q4_0", "Q5_0")


@pytest.mark.parametrize("qtype", sorted(GGUF_HALF_OFFSETS))
def test_gguf_dequantization_matches_the_gguf_package(qtype):
    """In fp32 arithmetic (ComfyUI-GGUF's "float32" dequant_dtype) every type is bitwise the gguf package's numpy
    dequantization, which computes in fp32 in the same order; in fp16 arithmetic (its default), bitwise the fp16
    rounding of it for the one-product types, and for the others within 2^-8 of the block's largest |value| (each
    of two or three fp16 roundings is within 2^-11 of its operands, an offset's up to a few times the values) plus
    half a BF16 step after the cast."""
    cols = 512
    raw = random_gguf_blocks(qtype, 6, cols, seed=len(qtype) * 7 + ord(qtype[1]))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    assert reference.shape == (6, cols)
    as_bytes = torch.from_numpy(raw.copy())
    assert_bitwise(dequantize_gguf(as_bytes, qtype, (6, cols), torch.float32, torch.float32), reference, f"{qtype} fp32")
    ours = dequantize_gguf(as_bytes, qtype, (6, cols), torch.bfloat16)
    if qtype in _ONE_PRODUCT:
        assert_bitwise(ours, reference.half().to(torch.bfloat16), f"{qtype} fp16")
    else:
        block = DEQUANTIZERS[qtype][0]
        block_max = reference.abs().reshape(6, -1, block).amax(dim=2, keepdim=True).expand(6, cols // block, block).reshape(6, cols)
        bound = 2.0 ** -8 * block_max + 2.0 ** -9 * reference.abs()
        assert ((ours.float() - reference).abs() <= bound).all(), float(((ours.float() - reference).abs() / bound).max())


def test_gguf_float_types_are_cast_only():
    values = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    for qtype, stored in (("F32", values), ("F16", values.half()), ("BF16", values.bfloat16())):
        as_bytes = stored.contiguous().view(torch.uint8).reshape(4, -1)
        assert_bitwise(dequantize_gguf(as_bytes, qtype, (4, 64), torch.bfloat16), stored.to(torch.bfloat16), qtype)
        assert_bitwise(dequantize_gguf(as_bytes, qtype, (4, 64), torch.float32), stored.float(), qtype)


def _gguf_types(main: str, fallback: str | None = None):
    """A quantizer's choice: 1-D tensors F32, matrices whose rows are whole `main` blocks `main`, else whole
    `fallback` blocks `fallback`, else F32 for the release's fp32 tensors (and a pruned file's) and BF16 for the rest."""
    def choose(name: str, shape: tuple[int, ...]) -> str:
        if len(shape) < 2:
            return "F32"
        for qtype in (main, fallback):
            if qtype and shape[1] % DEQUANTIZERS[qtype][0] == 0:
                return qtype
        return "F32" if name.startswith(_FP32_NAMES) or "adaln" in name else "BF16"
    return choose


_FP32_NAMES = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.", "final_layer.audio_out.")


# A tiny family whose widths hold whole blocks of every type: rows of 32 (hidden) and of 256 (ffn.out).
GGUF_CONFIG = replace(TINY, hidden_size=32, ffn_dim=256)


def _reference_read(path, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor as the gguf package dequantizes it (fp32), cast to `dtype`."""
    (tensor,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == name]
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(reversed(tensor.shape.tolist()))).to(dtype)


@pytest.mark.parametrize("main", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_file_reads_as_comfyui_gguf_dequantizes(tmp_path, main):
    """Original names mapped (stacked QKV, fc1's halves swapped), each tensor in the release's dtype: fp32 for the
    patch projections, time embedder and heads, bf16 otherwise; F32 / BF16 tensors bitwise their cast, quantized ones
    as `test_gguf_dequantization_matches_the_gguf_package` states. A k-quant main type (rows of 256) leaves the rows of
    32 to Q8_0, as quantizers fall back."""
    weights = synthetic.random_internal_weights(GGUF_CONFIG, seed=8)
    path = transformer_files.write_gguf_transformer(tmp_path / f"h3-{main}.gguf", GGUF_CONFIG, weights, _gguf_types(main, "Q8_0"), seed=3)
    source = SourceWeights(path)
    assert source.format == "gguf" and source.config == GGUF_CONFIG  # inferred from shapes and rope.inv_freq
    types = source.describe()["quant_types"]
    assert main in types and "F32" in types and "ComfyUI-GGUF" in source.describe()["dequantized"]
    ours = synthetic.to_original_names(source.read(list(source.shapes())), GGUF_CONFIG)
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    for name, tensor in ours.items():
        dtype = torch.float32 if name.startswith(_FP32_NAMES) else torch.bfloat16
        assert tensor.dtype == dtype, name
        reference = _reference_read(path, name, torch.float32)
        if stored[name] in ("F32", "F16", "BF16") or stored[name] in _ONE_PRODUCT:
            expected = reference if stored[name] in ("F32", "F16", "BF16") else reference.half()
            assert_bitwise(tensor, expected.to(dtype), f"{name} ({stored[name]})")
        else:
            assert ((tensor.float() - reference).abs() <= 2.0 ** -8 * reference.abs().max()).all(), f"{name} ({stored[name]})"


def test_gguf_reads_in_row_chunks_as_whole(tmp_path, monkeypatch):
    """Large tensors are dequantized a few rows at a time; fused pieces (fc1's halves) and chunks give the same bits."""
    from vflash_core.weights import gguf_file

    weights = synthetic.random_internal_weights(GGUF_CONFIG, seed=8)
    path = transformer_files.write_gguf_transformer(tmp_path / "h3-Q4_K.gguf", GGUF_CONFIG, weights, _gguf_types("Q4_K", "Q8_0"))
    names = ["blocks.0.ffn.in.weight", "blocks.0.ffn.out.weight", "blocks.1.attn.qkv.weight"]
    whole = SourceWeights(path).read(names)
    monkeypatch.setattr(gguf_file, "_CHUNK", 300)  # a row or two at a time
    for name, tensor in SourceWeights(path).read(names).items():
        assert_bitwise(tensor, whole[name], name)


@pytest.mark.parametrize("main", ["Q8_0", "Q4_K"])
def test_gguf_file_is_exact_for_its_weights(tmp_path, main):
    """Compiled, a GGUF generates the BF16 file of its dequantized weights bit for bit; the artifact records the
    format and the quant types (GGUF_CONFIG's ffn.out rows hold Q4_K blocks; its other rows Q8_0)."""
    weights = synthetic.random_internal_weights(GGUF_CONFIG, seed=9)
    path = transformer_files.write_gguf_transformer(tmp_path / f"h3-{main}.gguf", GGUF_CONFIG, weights, _gguf_types(main, "Q8_0"))
    artifact = _same_latents_as_its_dequantized_bf16_file(tmp_path, path)
    assert artifact.base_weights["format"] == "gguf" and artifact.base_weights["quant_types"][main] > 0


def test_pruned_gguf_compiles_for_pruned_profiles_only(tmp_path, base_weights):
    path = transformer_files.write_gguf_transformer(tmp_path / "h3_pruned-Q8_0.gguf", TINY, transformer_files.prune_adaln(base_weights, TINY), _gguf_types("Q8_0"))
    source = SourceWeights(path)
    assert source.pruned and source.curve == (1025, 8) and source.dtype_of("blocks.0.adaln.weight") == torch.float32
    with pytest.raises(IdentityMismatchError, match="compiles only for a -pruned profile"):
        prepare(EXACT_CPU, path, tmp_path / "a.json")
    (tmp_path / "pruned").mkdir()
    paths = compile_tiny(tmp_path / "pruned", path, "t2va-base4-pruned-cpu")
    assert CompiledArtifact(**paths).base_weights["pruned"] == {"grid": 1025, "rank": 8}


def test_gguf_without_the_gguf_package_is_refused_in_one_line(tmp_path, base_weights, monkeypatch):
    path = transformer_files.write_gguf_transformer(tmp_path / "h3-Q8_0.gguf", TINY, base_weights, _gguf_types("Q8_0"))
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(WeightFileError, match=r"^reading a GGUF file needs the gguf package: pip install 'vflash\[gguf\]' \(or pip install gguf\)$"):
        SourceWeights(path)


def test_gguf_types_vflash_does_not_read_are_refused(tmp_path, base_weights):
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), arch="minimax_h3")
    writer.add_tensor("blocks.0.attn.qkv_proj.weight", np.zeros((4, 136), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightFileError, match=r"GGUF quantization type\(s\) Vflash does not read: IQ4_XS \(1 tensors, e.g. blocks.0.attn.qkv_proj.weight\)"):
        SourceWeights(tmp_path / "iq.gguf")
