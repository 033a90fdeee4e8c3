"""One native evaluation equals `MiniMaxH3Transformer3DModel.forward` bit for bit, on the same random weights.

The tiny config keeps the real quirks (inner 32 != hidden 24, 12 of 16 channels rotated, mixed fp32/bf16). The native
side runs from compiled artifacts, built from a diffusers-layout folder and from an original-layout single file (both
QKV layouts), in fp32 and in the released mixed bf16 precision; the AdaLN rows come from the schedule overlay, where
diffusers runs `adaln_proj` itself."""

from __future__ import annotations

import pytest
import torch
import transformer_files
from conftest import TINY, assert_bitwise, compile_tiny, diffusers_transformer

from vflash_core import Geometry, build_keyframe_bundle
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.model import BlockOps, sdpa_attention
from vflash_core.engine.residency import ResidentBlocks
from vflash_core.weights import synthetic


def _reference_forward(model, bundle, state_plan, video_rows, audio_rows):
    lay = bundle.layout
    with torch.no_grad():
        video, audio = model(
            video_rows[None], audio_rows[None], bundle.prompt_embeds[None], state_plan.tables.timesteps, state_plan.timestep_indices,
            lay.token_tags, lay.position_ids, lay.video_indices, lay.audio_indices, lay.text_indices, return_dict=False,
        )
    return video[0], audio[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("source", ["diffusers", "original-stacked", "original-interleaved"])
def test_native_forward_equals_diffusers(tmp_path, dtype, source):
    weights = synthetic.random_internal_weights(TINY, seed=21, dtype=dtype)
    folder = synthetic.write_diffusers_transformer(tmp_path / "transformer", TINY, weights)
    qkv_layout = None
    if source == "diffusers":
        path = folder
    else:
        qkv_layout = source.split("-")[1]
        path = transformer_files.write_original_transformer(tmp_path / "h3.safetensors", TINY, weights, qkv_layout)
    paths = compile_tiny(tmp_path, path, "t2va-base4-exact-cpu", qkv_layout=qkv_layout)
    artifact = CompiledArtifact(**paths)
    denoiser = Denoiser(artifact, ResidentBlocks(artifact, torch.device("cpu")), torch.device("cpu"), BlockOps(artifact.config, sdpa_attention))
    reference = diffusers_transformer(folder, dtype)

    g = torch.Generator().manual_seed(4)
    embeds = torch.randn(1, 7, TINY.text_dim, generator=g).to(dtype)
    tags = torch.ones(7, dtype=torch.long)
    tags[3:5] = 0
    keyframes = (torch.randn(1, TINY.in_channels, 1, 4, 6, generator=g),) * 2
    bundle = build_keyframe_bundle(embeds[0], tags, Geometry(64, 96, 124), TINY, g, keyframes, ("first", "last"))
    state = denoiser.start_request(bundle)
    for step in (0, 2):  # T = 2 ({0, 0.999}) and T = 3 distinct timesteps
        video, audio = denoiser.evaluate(state, step)
        expected_video, expected_audio = _reference_forward(reference, bundle, state.plans[step], state.video_rows, state.audio_rows)
        assert_bitwise(video, expected_video, f"video velocity, step {step}")
        assert_bitwise(audio, expected_audio, f"audio velocity, step {step}")
