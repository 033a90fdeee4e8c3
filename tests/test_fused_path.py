"""The fused (Triton) execution path equals the reference path bit for bit through whole trajectories.

On the CPU the kernels run in Triton's interpreter, which must be switched on before triton is imported, so the
comparison runs in a child process. The kernels emulate round-to-nearest-even casts there (the interpreter truncates),
so bf16 parity is checked end to end here too; the same comparison on a GPU is in test_gpu.py. (The interpreter is
not thread-safe, so several ranks, each on its own thread, are compared on GPUs only.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from bundles import keyframe_bundle
from vflash_core import CompiledPaths, EngineOptions, NativeEngineSession
from vflash_core.engine import fused
# The fused 5376-wide norm sums squares in torch's CUDA order, which CPU F.rms_norm does not share; it is compared
# with its order reference in test_rms_norm_modulate.py and with F.rms_norm on the GPU.
fused.FUSED_NORM_MODULATE = False
paths = json.loads(sys.argv[2])
with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**paths), EngineOptions(execution="reference")) as ref:
    expected = ref.generate(keyframe_bundle(8))
with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**paths), EngineOptions(execution="fused")) as fused:
    got = fused.generate(keyframe_bundle(8), profile_denoise=True)
print(json.dumps({
    "video_equal": torch.equal(got.video_latents, expected.video_latents),
    "audio_equal": torch.equal(got.audio_latents, expected.audio_latents),
    "max_abs_diff": (got.video_latents - expected.video_latents).abs().max().item(),
    "execution": got.metadata["execution"],
    "stages": sorted(got.denoise_profile["total_ms"].keys()),
}))
"""


@pytest.mark.slow
def test_fused_trajectory_equals_reference_in_the_interpreter(tiny_compiled):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    paths = {k: str(v) for k, v in tiny_compiled.items()}
    tests_dir = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-c", CHILD, tests_dir, json.dumps(paths)], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["execution"] == "fused"
    assert r["video_equal"] and r["audio_equal"], f"max abs diff {r['max_abs_diff']}"
    assert {"adaln_modulation", "qkv_projection", "qk_norm_rope", "attention", "attention_output", "ffn_norm_modulation", "ffn_input", "swiglu", "ffn_output", "final_layer", "latent_update", "pack_inputs"} <= set(r["stages"])
