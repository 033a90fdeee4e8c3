"""One request through the native pipeline and through diffusers 0.42.1's `MiniMaxH3` modular pipeline, compared
stage by stage, bit for bit (the CPU parity tests and their GPU twins)."""

from __future__ import annotations

import torch
from conftest import assert_bitwise

from vflash_core.pipeline.h3_pipeline import VideoRequest

FRAMES = 124


def reference_run(reference, request: VideoRequest, nfe: int, height: int, width: int) -> dict:
    """The whole reference pipeline, plus its noise: the condition and target draws replayed by its own blocks."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3FL2VAPrepareLatentsStep,
        MiniMaxH3PrepareConditionLatentsStep,
        MiniMaxH3PrepareLatentsStep,
        MiniMaxH3Ref2VAPrepareLatentsStep,
    )
    from diffusers.utils import load_image

    kwargs = dict(prompt=request.prompt, num_inference_steps=nfe + 1, generator=torch.Generator().manual_seed(request.seed), height=height, width=width, num_frames=FRAMES, output_type="pt")
    if request.first_frame is not None:
        kwargs["image"] = load_image(request.first_frame)
    if request.last_frame is not None:
        kwargs["last_image"] = load_image(request.last_frame)
    if request.references:
        readers = {".png": MiniMaxH3ImageReference, ".wav": MiniMaxH3AudioReference, ".mp4": MiniMaxH3VideoReference}
        kwargs["references"] = [readers[r[-4:]].from_file(r) for r in request.references]
    names = ["prompt_embeds", "text_token_tags", "position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "condition_latents", "audio_condition_latents", "num_condition_video_rows", "num_condition_audio_rows", "num_latent_frames", "latent_height", "latent_width", "num_audio_latents", "latents", "audio_latents", "videos", "audio"]
    out = reference(**kwargs, output=names)  # a dict of the named state values, on the reference's device
    out = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    # The reference's own noise blocks, run on its components with a fresh generator of the request's seed.
    state = PipelineState()
    for name in ("num_latent_frames", "latent_height", "latent_width", "num_audio_latents", "condition_latents", "audio_condition_latents", "num_condition_video_rows", "num_condition_audio_rows"):
        state.set(name, out[name])
    state.set("generator", torch.Generator().manual_seed(request.seed))
    steps = [MiniMaxH3PrepareLatentsStep()]
    if out["condition_latents"]:
        prepend = MiniMaxH3Ref2VAPrepareLatentsStep() if request.references else MiniMaxH3FL2VAPrepareLatentsStep()
        steps = [MiniMaxH3PrepareConditionLatentsStep(), *steps, prepend]
    for step in steps:
        step(reference, state)
    out["initial_video_rows"], out["initial_audio_rows"] = state.get("latents").cpu(), state.get("audio_latents").cpu()
    return out


def check_against_diffusers(native, reference, request: VideoRequest, height: int, width: int) -> None:
    """The native pipeline's bundle, latents, frames and waveform for `request` equal the reference's, bit for bit."""
    expected = reference_run(reference, request, native.profile.nfe, height, width)
    bundle = native.encode(request).consume()
    assert bundle.mode == request.mode
    vision_rows = int((bundle.layout.token_tags[: bundle.layout.text_indices.numel()] == 0).sum())
    assert (vision_rows > 0) == (request.mode != "t2va")  # keyframes and image references reach Qwen as vision blocks
    assert (bundle.geometry.height, bundle.geometry.width, bundle.geometry.num_frames) == (height, width, FRAMES)
    assert_bitwise(bundle.prompt_embeds, expected["prompt_embeds"][0], "prompt embeddings")
    assert_bitwise(bundle.layout.token_tags[: bundle.layout.text_indices.numel()], expected["text_token_tags"], "text row tags")
    for name in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        assert_bitwise(getattr(bundle.layout, name), expected[name], name)
    assert_bitwise(bundle.video_rows, expected["initial_video_rows"], "initial video rows (noised conditions + noise)")
    assert_bitwise(bundle.audio_rows, expected["initial_audio_rows"], "initial audio rows (references + noise)")

    generation = native.denoise(bundle)
    assert_bitwise(generation.video_latents, expected["latents"], "final video latents")
    assert_bitwise(generation.audio_latents, expected["audio_latents"], "final audio latents")
    decoded = native.decode(generation.video_latents, generation.audio_latents)
    assert_bitwise(decoded.frames, expected["videos"][0].permute(0, 2, 3, 1), "decoded frames")
    assert_bitwise(decoded.waveform, expected["audio"][0], "decoded waveform")
