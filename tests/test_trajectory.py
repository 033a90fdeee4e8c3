"""Whole fixed-schedule trajectories through `NativeEngineSession` equal the diffusers 0.42.1 denoise loop, bit for bit.

Same weights, same embeddings, same seed: the bundle draws the noise under the reference's contract, the session runs
the compiled blocks with precomputed tables, and the final latents must equal `MiniMaxH3CoreDenoiseStep` (t2va) and
`MiniMaxH3FL2VACoreDenoiseStep` (first, last, both keyframes)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, assert_bitwise, compile_tiny, diffusers_denoise, diffusers_transformer

from vflash_core import Geometry, NativeEngineSession, build_keyframe_bundle, get_profile
from vflash_core.engine.artifact import CompiledPaths

HEIGHT, WIDTH, FRAMES = 64, 96, 124


def _prompt(seed: int, length: int = 6, vision_rows: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, length, TINY.text_dim, generator=g).to(torch.bfloat16)
    tags = torch.ones(length, dtype=torch.long)
    tags[list(vision_rows)] = 0  # rows of a Qwen vision block are tagged video
    return embeds, tags


def _keyframes(count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, TINY.in_channels, 1, HEIGHT // 16, WIDTH // 16, generator=g) for _ in range(count))


@pytest.fixture(scope="module")
def reference_model(tiny_transformer):
    return diffusers_transformer(tiny_transformer)


@pytest.fixture(scope="module")
def compiled16(tmp_path_factory, tiny_transformer):
    return compile_tiny(tmp_path_factory.mktemp("c16"), tiny_transformer, "t2va-base16-exact-cpu")


@pytest.mark.parametrize(
    "anchors",
    [(), ("first",), ("last",), ("first", "last")],
    ids=["t2va", "i2va-first", "l2va-last", "fl2va-both"],
)
def test_trajectory_4nfe_matches_diffusers(anchors, tiny_compiled, reference_model):
    profile = get_profile("t2va-base4-exact-cpu")
    embeds, tags = _prompt(11, vision_rows=(1, 2) if anchors else ())
    keyframes = _keyframes(len(anchors), 5)
    expected_video, expected_audio = diffusers_denoise(reference_model, profile, embeds, tags, HEIGHT, WIDTH, FRAMES, seed=7, condition_latents=keyframes, keyframe_anchors=anchors)

    bundle = build_keyframe_bundle(embeds, tags, Geometry(HEIGHT, WIDTH, FRAMES), TINY, torch.Generator().manual_seed(7), keyframes, anchors, seed=7)
    with NativeEngineSession(profile, CompiledPaths(**tiny_compiled)) as session:
        result = session.generate(bundle)
    assert_bitwise(result.video_latents, expected_video, "video latents")
    assert_bitwise(result.audio_latents, expected_audio, "audio latents")
    assert result.metadata["mode"] == {(): "t2va", ("first",): "i2va", ("last",): "l2va", ("first", "last"): "fl2va"}[anchors]


@pytest.mark.parametrize("anchors", [(), ("first", "last")], ids=["t2va", "fl2va"])
def test_trajectory_16nfe_matches_diffusers(anchors, compiled16, reference_model):
    profile = get_profile("t2va-base16-exact-cpu")
    embeds, tags = _prompt(12, length=9)
    keyframes = _keyframes(len(anchors), 6)
    # 10 s: 243 frames, so the last-keyframe time exercises numpy's pairwise sum over 72 latent frames.
    expected_video, expected_audio = diffusers_denoise(reference_model, profile, embeds, tags, HEIGHT, WIDTH, 243, seed=3, condition_latents=keyframes, keyframe_anchors=anchors)
    bundle = build_keyframe_bundle(embeds, tags, Geometry(HEIGHT, WIDTH, 243), TINY, torch.Generator().manual_seed(3), keyframes, anchors)
    with NativeEngineSession(profile, CompiledPaths(**compiled16)) as session:
        result = session.generate(bundle)
    assert_bitwise(result.video_latents, expected_video, "video latents")
    assert_bitwise(result.audio_latents, expected_audio, "audio latents")
