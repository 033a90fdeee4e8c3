"""An FP8 profile compiled straight from a Comfy-Org fp8_scaled file (approximate, default off): the file's own E4M3
codes are the artifact's, bit for bit, and its per-tensor scale is every row's scale; never dequantized and
re-quantized. The small files are written in ComfyUI's layouts (`synthetic.write_comfy_transformer`)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, assert_bitwise, compile_tiny
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vflash_core import Geometry, NativeEngineSession, build_keyframe_bundle
from vflash_core.engine import fp8
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.errors import IdentityMismatchError
from vflash_core.weights import synthetic
from vflash_core.weights.checkpoint import SourceWeights
from vflash_core.weights.compiler import prepare

FP8_CPU = "t2va-base4-fp8-cpu"
# internal linear -> (the file's original name below `blocks.{i}.`, whether its halves swap: fc1 is [gate; value])
FILE_LINEARS = {"attn.qkv": ("attn.qkv_proj", False), "attn.out": ("attn.out_proj", False), "ffn.in": ("mlp.fc1", True), "ffn.out": ("mlp.fc2", False)}


@pytest.fixture(scope="module")
def base_weights():
    return synthetic.random_internal_weights(TINY, seed=21)


def _file_codes_and_scale(state: dict[str, torch.Tensor], i: int, linear: str, scale_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's codes of one block linear in internal row order, and its one scale."""
    name, swapped = FILE_LINEARS[linear]
    codes = state[f"blocks.{i}.{name}.weight"]
    if swapped:
        codes = torch.cat(codes.chunk(2, dim=0)[::-1])
    return codes, state[f"blocks.{i}.{name}.{scale_key}"]


@pytest.mark.parametrize("marking,scale_key", [("metadata", "weight_scale"), ("legacy", "scale_weight")])
def test_fp8_scaled_file_compiles_to_an_fp8_artifact_of_its_own_codes(tmp_path, base_weights, marking, scale_key):
    path = synthetic.write_comfy_transformer(tmp_path / "h3_fp8_scaled.safetensors", TINY, base_weights, fp8=marking)
    state = load_file(path)
    paths = compile_tiny(tmp_path, path, FP8_CPU)
    artifact = CompiledArtifact(**paths)
    assert artifact.fp8 and artifact.manifest["fp8"]["source_format"] == "fp8_scaled" and artifact.manifest["fp8"]["origin"] == "kept"
    assert artifact.manifest["fp8"]["kept_linears"] == TINY.num_layers * 4 and artifact.manifest["fp8"]["quantized_linears"] == 0
    assert artifact.base_weights["format"] == "fp8_scaled"
    for i in range(TINY.num_layers):
        block = artifact.read_block(i).tensors
        for linear in fp8.FP8_LINEARS:
            codes, scale = _file_codes_and_scale(state, i, linear, scale_key)
            assert block[f"{linear}.weight"].dtype == torch.float8_e4m3fn
            assert_bitwise(block[f"{linear}.weight"].view(torch.uint8), codes.view(torch.uint8), f"block {i} {linear} codes")
            assert_bitwise(block[f"{linear}.weight_scale"], scale.float().expand(codes.shape[0], 1).contiguous(), f"block {i} {linear} scales")
    # not what quantizing the dequantized weights again would give (row absmax / 448 scales, other codes)
    _, requantized_scales = fp8.quantize_rows(SourceWeights(path).read(["blocks.0.ffn.out.weight"])["blocks.0.ffn.out.weight"])
    assert not torch.equal(requantized_scales, artifact.read_block(0).tensors["ffn.out.weight_scale"])
    # the approximate label stays visible: an FP8 profile's id, and the notes say where the codes come from
    notes = artifact.base_weight_notes()
    assert "-fp8-" in artifact.profile_id and any("approximate FP8 block linears: the fp8_scaled file's own E4M3 codes" in n for n in notes)


def test_fp8_artifact_of_an_fp8_scaled_file_runs(tmp_path, base_weights):
    """The compiled artifact loads and denoises in its FP8 execution (weight-only on the CPU); its result's metadata
    carries the source format and the FP8 note."""
    path = synthetic.write_comfy_transformer(tmp_path / "h3_fp8_scaled.safetensors", TINY, base_weights, fp8="comfy_quant")
    paths = compile_tiny(tmp_path, path, FP8_CPU)
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(6, TINY.text_dim, generator=g).to(torch.bfloat16)
    bundle = build_keyframe_bundle(embeds, torch.ones(6, dtype=torch.long), Geometry(64, 96, 124), TINY, torch.Generator().manual_seed(3), seed=3)
    with NativeEngineSession(FP8_CPU, CompiledPaths(**paths)) as session:
        output = session.generate(bundle)
    assert torch.isfinite(output.video_latents.float()).all() and output.metadata["base_weights"]["format"] == "fp8_scaled"
    assert "kept" in json.dumps(CompiledArtifact(**paths).manifest["fp8"])


def test_fp8_profile_refuses_e5m2_codes_rather_than_requantizing(tmp_path, base_weights):
    path = synthetic.write_comfy_transformer(tmp_path / "h3_fp8.safetensors", TINY, base_weights, fp8="metadata")
    with safe_open(path, "pt") as handle:
        metadata = json.loads(handle.metadata()["_quantization_metadata"])
    state = load_file(path)
    for layer, conf in metadata["layers"].items():
        if layer.startswith("blocks.0.mlp.fc2"):
            conf["format"] = "float8_e5m2"
            state[f"{layer}.weight"] = state[f"{layer}.weight"].float().to(torch.float8_e5m2)
    e5m2 = tmp_path / "h3_e5m2.safetensors"
    save_file(state, str(e5m2), metadata={"config": json.dumps(TINY.to_dict()), "_quantization_metadata": json.dumps(metadata)})
    with pytest.raises(IdentityMismatchError, match=r"stores block linears as float8_e5m2 \(e.g. blocks.0.mlp.fc2.weight\): FP8 profile t2va-base4-fp8-cpu keeps a file's float8_e4m3fn codes and never re-quantizes them; choose a BF16 profile$"):
        prepare(FP8_CPU, e5m2, tmp_path / "receipt.json")
    prepare("t2va-base4-exact-cpu", e5m2, tmp_path / "exact.json")  # a BF16 profile dequantizes it, as core does
