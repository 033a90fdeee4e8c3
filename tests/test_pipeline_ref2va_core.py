"""ref2va packing and trajectories against diffusers 0.42.1.

The layout (every reference kind, a long video whose clock span needs the sequential fp64 sum) equals
`MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence` exactly, and a whole 4-evaluation trajectory of the
native core equals `MiniMaxH3Ref2VACoreDenoiseStep` bit for bit, with and without reference audio."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY, assert_bitwise, compile_tiny, diffusers_transformer

from vflash_core import Geometry, NativeEngineSession, get_profile
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.bundle import EncodedReference, build_ref2va_bundle
from vflash_core.engine.layout import ref2va_layout

HEIGHT, WIDTH, FRAMES = 64, 96, 124


def _diffusers_reference(ref: EncodedReference):
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    # The packing reads only a reference's kind and whether it carries audio; the media itself is not used.
    if ref.kind == "image":
        return MiniMaxH3ImageReference(image=np.zeros((32, 32, 3), np.uint8))
    if ref.kind == "video":
        return MiniMaxH3VideoReference(frames=np.zeros((1, 32, 32, 3), np.uint8), audio=None if ref.audio_rows is None else torch.zeros(2, 8))
    return MiniMaxH3AudioReference(audio=torch.zeros(2, 8))


def _references(seed: int, with_audio: bool, long_video: bool = False) -> tuple[EncodedReference, ...]:
    g = torch.Generator().manual_seed(seed)
    c, a = TINY.in_channels, TINY.audio_in_channels
    refs = [
        EncodedReference("image", torch.randn(1, c, 1, 6, 4, generator=g)),
        EncodedReference("video", torch.randn(1, c, 17 if long_video else 7, 4, 6, generator=g), torch.randn(2 * 13, a, generator=g) if with_audio else None),
        EncodedReference("image", torch.randn(1, c, 1, 4, 4, generator=g)),
    ]
    if with_audio:
        refs.insert(1, EncodedReference("audio", audio_rows=torch.randn(2 * 9, a, generator=g)))
    return tuple(refs)


def _text_tags(length: int, vision_rows: tuple[int, ...]) -> torch.Tensor:
    tags = torch.ones(length, dtype=torch.long)
    tags[list(vision_rows)] = 0
    return tags


def test_ref2va_layout_matches_diffusers():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep

    tags = _text_tags(9, (2, 3, 4))
    refs = _references(0, with_audio=True, long_video=True)
    geometry = Geometry(HEIGHT, WIDTH, 243)
    layout = ref2va_layout(tags, geometry, TINY.patch_size, tuple(r.block() for r in refs))
    expected = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags, [_diffusers_reference(r) for r in refs], [r.video_latents for r in refs if r.video_latents is not None],
        [r.audio_rows for r in refs if r.audio_rows is not None], geometry.num_latent_frames, geometry.latent_height,
        geometry.latent_width, geometry.num_audio_latents, TINY.patch_size, 2, 2, 0,
    )
    names = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")
    for name, want in zip(names, expected[:5]):
        assert_bitwise(getattr(layout, name), want, name)
    assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == expected[5:]


@pytest.fixture(scope="module")
def ref_compiled(tmp_path_factory, tiny_transformer):
    return compile_tiny(tmp_path_factory.mktemp("ref4"), tiny_transformer, "ref2va-base4-exact-cpu")


@pytest.mark.parametrize("with_audio", [False, True], ids=["images-video", "with-audio"])
def test_ref2va_trajectory_matches_diffusers(with_audio, ref_compiled, tiny_transformer):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Ref2VACoreDenoiseStep

    profile = get_profile("ref2va-base4-exact-cpu")
    g = torch.Generator().manual_seed(21)
    embeds = torch.randn(1, 9, TINY.text_dim, generator=g).to(torch.bfloat16)
    tags = _text_tags(9, (2, 3, 4))
    refs = _references(3, with_audio)

    pipe = MiniMaxH3Ref2VACoreDenoiseStep().init_pipeline()
    pipe.update_components(
        transformer_ref=diffusers_transformer(tiny_transformer),
        scheduler=MiniMaxH3Scheduler(profile.video_shift),
        audio_scheduler=MiniMaxH3Scheduler(profile.audio_shift),
    )
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        prompt_embeds=embeds, text_token_tags=tags, num_inference_steps=profile.nfe + 1, generator=torch.Generator().manual_seed(5),
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, normalized_references=[_diffusers_reference(r) for r in refs],
        condition_latents=[r.video_latents for r in refs if r.video_latents is not None],
        audio_condition_latents=[r.audio_rows for r in refs if r.audio_rows is not None],
        output=["latents", "audio_latents"],
    )

    bundle = build_ref2va_bundle(embeds, tags, Geometry(HEIGHT, WIDTH, FRAMES), TINY, torch.Generator().manual_seed(5), refs, seed=5)
    with NativeEngineSession(profile, CompiledPaths(**ref_compiled)) as session:
        result = session.generate(bundle)
    assert_bitwise(result.video_latents, expected["latents"], "video latents")
    assert_bitwise(result.audio_latents, expected["audio_latents"], "audio latents")
    assert result.metadata["mode"] == "ref2va"
