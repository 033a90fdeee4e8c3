"""The users' int8_convrot and GGUF transformer files against the real ComfyUI and the real ComfyUI-GGUF.

* `COMFYUI_ROOT` (and `COMFYUI_PYTHON`, see `test_comfyui_server.py`): core's own reading of an int8_convrot file
  against Vflash's (`comfy_core_probe/measure_int8_convrot.py`), and both kinds of file through the Vflash loader of a
  running server to an MP4 (the server's Python needs the `gguf` package for the GGUF file).
* `COMFYUI_GGUF_ROOT`, a checkout of city96's ComfyUI-GGUF: its own `dequant.py` against Vflash's dequantization of
  every quantization type, bitwise (its dequantization imports only torch, gguf and tqdm).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformer_files
from comfyui_server_helpers import COMFYUI_ROOT, PROBE, small_core_workflow
from conftest import assert_bitwise

from vflash_core.weights.gguf_file import DEQUANTIZERS, dequantize_gguf

COMFYUI_GGUF_ROOT = os.environ.get("COMFYUI_GGUF_ROOT")
needs_comfyui = pytest.mark.skipif(not COMFYUI_ROOT, reason="set COMFYUI_ROOT to a ComfyUI checkout to run the real-server tests")


def test_int8_convrot_file_against_core(tmp_path):
    """Core's `weight.dequantize()` of every int8_convrot layer (ComfyUI 0.33.0, comfy_kitchen's eager fp32 rotation
    on the CPU) against the weight Vflash reads, the exact value rounded once: equal but for 248 of 135,168 elements
    (0.18 %), each within one BF16 step (or the fp32 summation error where the value cancels). Core then runs the
    layers as int8 GEMMs on per-row-quantized activations; Vflash's velocity on the dequantized weights is within 0.1
    of core's at values ~5 (measured 0.044; core's BF16-file velocity differs from Vflash's by ~0.03 already)."""
    if not COMFYUI_ROOT:
        pytest.skip("set COMFYUI_ROOT to a ComfyUI checkout")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run([python, str(PROBE / "measure_int8_convrot.py"), str(tmp_path)], cwd=COMFYUI_ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert row["base_weights"]["format"] == "int8_convrot" and row["base_weights"]["quant_types"] == {"int8_convrot": 15}
    d = row["dequantized"]
    assert d["layers"] == 15 and d["core_dtype"] == "torch.bfloat16"
    assert d["worst_in_allowed_steps"] <= 1.0 and d["differing"] < 0.01 * d["elements"], d
    for stream in ("video", "audio"):
        assert row["velocity"][stream]["max_abs_diff"] < 0.1 and row["velocity"][stream]["max_abs_value"] > 1.0, row["velocity"]


def _comfyui_gguf_dequant():
    spec = importlib.util.spec_from_file_location("comfyui_gguf_dequant", Path(COMFYUI_GGUF_ROOT) / "dequant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not COMFYUI_GGUF_ROOT, reason="set COMFYUI_GGUF_ROOT to a ComfyUI-GGUF checkout")
@pytest.mark.parametrize("qtype", [t for t in DEQUANTIZERS if t not in ("F32", "F16")])
def test_gguf_dequantization_is_comfyui_ggufs(qtype):
    """ComfyUI-GGUF's own dequantization (`dequant.dequantize`, then the cast `dequantize_tensor` makes) of random
    blocks with finite fp16 scales equals Vflash's bitwise, in its default (fp16) and float32 dequant_dtype, to BF16
    and to FP32."""
    import gguf
    from transformer_files import random_gguf_blocks

    theirs = _comfyui_gguf_dequant()
    cols = 512
    raw = torch.from_numpy(random_gguf_blocks(qtype, 4, cols, seed=11) if qtype != "BF16" else torch.randn(4, cols).bfloat16().view(torch.uint8).numpy())
    ggml = gguf.GGMLQuantizationType[qtype]
    for arithmetic, their_dtype in ((torch.float16, None), (torch.float32, torch.float32)):
        for target in (torch.bfloat16, torch.float32):
            expected = theirs.dequantize(raw, ggml, (4, cols), dtype=their_dtype).to(target)
            assert_bitwise(dequantize_gguf(raw, qtype, (4, cols), target, arithmetic), expected, f"{qtype} {arithmetic} -> {target}")


def _small_config():
    from vflash_core.engine.config import H3Config

    return replace(H3Config.preset("demo"), in_channels=24, audio_in_channels=32)


@needs_comfyui
@pytest.mark.parametrize("form", ["int8_convrot", "gguf"])
def test_int8_convrot_and_gguf_small_files_generate(server, tmp_path, form):
    """The small family's transformer as an int8_convrot safetensors file and as a Q8_0 GGUF in diffusion_models/,
    with core's text encoder and VAEs: the Vflash loader lists it, compiles it on first use, and the graph runs to an
    MP4; the compiled artifact records the file's format."""
    from mp4_probe import probe_mp4

    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.weights import synthetic

    config = _small_config()
    weights = synthetic.random_internal_weights(config, seed=6)
    folder = server.work / "models" / "diffusion_models"
    if form == "gguf":
        name = "h3_small-Q8_0.gguf"
        transformer_files.write_gguf_transformer(folder / name, config, weights, lambda n, shape: "F32" if len(shape) < 2 else "Q8_0" if shape[1] % 32 == 0 else "BF16")
    else:
        name = "h3_small_int8_convrot.safetensors"
        synthetic.write_comfy_transformer(folder / name, config, weights, int8_convrot=16)
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/object_info/VflashModelLoader") as r:
        options = json.loads(r.read())["VflashModelLoader"]["input"]["required"]["model"]
    assert f"\"{name}\"" in json.dumps(options) and "diffusion_models/" not in json.dumps(options)  # named as core lists it
    workflow = small_core_workflow(23)
    workflow["1"]["inputs"]["model"] = name
    workflow["7"]["inputs"]["filename_prefix"] = f"video/user_file_{form}"
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    files = server.history_files(result["prompt_id"], tmp_path)
    assert len(files) == 1 and probe_mp4(files[0])["frames"] == 124
    (manifest,) = [p for p in (server.work / "models" / "vflash").rglob("artifact/manifest.json") if Path(name).stem in str(p)]
    artifact = CompiledArtifact(manifest.parent, manifest.parent.parent / "schedule", manifest.parent.parent / "auxiliary.safetensors")
    assert artifact.base_weights["format"] == form and "dequantized" in artifact.base_weights
