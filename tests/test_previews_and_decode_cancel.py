"""Live previews from the denoising loop (`preview(done, total, video x0)`) and cancelling a decode between blocks.

The preview is the scheduler's x0 prediction of each evaluation; on the last step the Euler step lands exactly on it
(sigma_next = 0), so the last preview must equal the returned latents bit for bit. The trajectory itself must be bitwise
that of a run without previews, even when the preview writes into the tensor it is handed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from bundles import keyframe_bundle
from conftest import assert_bitwise, compile_tiny

from vflash_core import NativeEngineSession
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.media.vae import MediaVAEs, calling_between_blocks, decode_latents
from vflash_core.pipeline.h3_pipeline import H3Pipeline, RequestCancelled, VideoRequest

PROFILE = "t2va-base4-exact-cpu"


class Abort(BaseException):
    """Like ComfyUI's InterruptProcessingException: a BaseException raised from a callback."""


def recording_preview(seen: list):
    """A preview that keeps a copy of each x0 and then scribbles over the tensor it was handed."""

    def preview(done: int, total: int, video: torch.Tensor) -> None:
        seen.append((done, total, video.clone()))
        video.fill_(float("nan"))

    return preview


# -- the engine's preview hook --------------------------------------------------------------------------------------


def test_preview_once_per_evaluation_is_x0_and_leaves_the_latents_bitwise(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        plain = session.generate(keyframe_bundle(2))
        seen, progress = [], []
        previewed = session.generate(keyframe_bundle(2), progress=lambda done, total: progress.append(done), preview=recording_preview(seen))
    assert_bitwise(previewed.video_latents, plain.video_latents, "video with previews")
    assert_bitwise(previewed.audio_latents, plain.audio_latents, "audio with previews")
    assert [(done, total) for done, total, _ in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)] and progress == [1, 2, 3, 4]
    for _, _, video in seen:  # the generated frames only (the l2va keyframe's conditioning rows are dropped)
        assert video.shape == plain.video_latents.shape and video.dtype == torch.float32 and video.device.type == "cpu"
    assert_bitwise(seen[-1][2], plain.video_latents, "the last x0 is the result")
    assert not torch.equal(seen[0][2], seen[-1][2])  # each evaluation's own prediction


def test_preview_from_a_sequence_head_group_gathers_every_rank(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head")) as group:
        plain = group.generate(keyframe_bundle(5))
        seen = []
        previewed = group.generate(keyframe_bundle(5), preview=recording_preview(seen))
    assert_bitwise(previewed.video_latents, plain.video_latents, "group video with previews")
    assert [done for done, _, _ in seen] == [1, 2, 3, 4]
    assert_bitwise(seen[-1][2], plain.video_latents, "the group's last x0 is its result")


def test_a_preview_that_raises_aborts_and_the_session_stays_usable(tiny_compiled):
    def stop_at_two(done: int, total: int, video: torch.Tensor) -> None:
        if done == 2:
            raise Abort()

    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        with pytest.raises(Abort):
            session.generate(keyframe_bundle(3), preview=stop_at_two)
        after = session.generate(keyframe_bundle(3))
        assert_bitwise(after.video_latents, session.generate(keyframe_bundle(3)).video_latents, "after an aborted preview")
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as fresh, pytest.raises(Exception, match="preview must be"):
        fresh.generate(keyframe_bundle(3), preview="not callable")


@pytest.mark.gpu
def test_preview_on_the_gpu_is_on_the_device_and_leaves_the_latents_bitwise(tmp_path_factory, tiny_transformer):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("needs an SM90 GPU for the sm90 profile")
    profile = "t2va-base16-bf16-sm90"
    compiled = compile_tiny(tmp_path_factory.mktemp("gpu-preview"), tiny_transformer, profile, device="cuda:0")
    with NativeEngineSession(profile, CompiledPaths(**compiled), EngineOptions(device="cuda:0")) as session:
        plain = session.generate(keyframe_bundle(6))
        seen = []
        previewed = session.generate(keyframe_bundle(6), preview=recording_preview(seen))
    assert_bitwise(previewed.video_latents, plain.video_latents, "GPU video with previews")
    assert len(seen) == 16 and all(video.device.type == "cuda" for _, _, video in seen)
    assert_bitwise(seen[-1][2].cpu(), plain.video_latents, "the GPU's last x0 is the result")


# -- cancelling the decode between blocks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae_root(tmp_path_factory):
    from vflash_core.weights.family import DEMO_FAMILY, build_model_family

    return build_model_family(tmp_path_factory.mktemp("vaes") / "model", DEMO_FAMILY, seed=0, with_ref=False, parts=("vaes",))


def counting_then(stop_at: int | None, calls: list):
    def between_blocks() -> None:
        calls.append(1)
        if stop_at is not None and len(calls) == stop_at:
            raise Abort()

    return between_blocks


@pytest.mark.parametrize("decoder", ["diffusers", "native"])
def test_decode_polls_before_every_block_stops_at_once_and_decodes_again(vae_root, decoder):
    vaes = MediaVAEs.from_pretrained(vae_root, video_decoder=decoder)
    blocks = len(vaes.video_vae.decoder.transformer_blocks)
    z = torch.randn(1, 8, 7, 20, 24, generator=torch.Generator().manual_seed(3))  # one window of 2 x 2 tiles
    plain = vaes.decode_video(z)
    calls: list = []
    polled = vaes.decode_video(z, counting_then(None, calls))
    assert_bitwise(polled, plain, f"{decoder} decode with the hook")
    # diffusers: one ViT call per tile; native: the window's 4 tile-windows in one call
    assert len(calls) == blocks * (4 if decoder == "diffusers" else 1) + (decoder == "native")
    stopped: list = []
    with pytest.raises(Abort):
        vaes.decode_video(z, counting_then(blocks + 1, stopped))
    assert len(stopped) == blocks + 1  # nothing ran after the raise
    assert all(not block._forward_pre_hooks for block in vaes.video_vae.decoder.transformer_blocks)
    assert_bitwise(vaes.decode_video(z), plain, f"{decoder} decode after a cancel")


@pytest.mark.parametrize("decoder", ["diffusers", "native"])
def test_a_streamed_video_decode_hands_the_sink_the_decoded_frames_in_order(vae_root, decoder):
    """`stream_video`: the frames `decode_video` returns, bit for bit, handed over part by part in order (the native
    decoder as each window's frames are final: several parts here), on the decoding device."""
    vaes = MediaVAEs.from_pretrained(vae_root, video_decoder=decoder)
    z = torch.randn(1, 8, 12, 4, 4, generator=torch.Generator().manual_seed(4))  # 12 latent frames: two windows
    parts: list = []
    count = vaes.stream_video(z, lambda start, frames: parts.append((start, frames.clone())))
    whole = vaes.decode_video(z)
    assert count == whole.shape[0] and [start for start, _ in parts] == list(itertools.accumulate([0] + [f.shape[0] for _, f in parts[:-1]]))
    assert len(parts) == 1 if decoder == "diffusers" else len(parts) > 1
    assert_bitwise(torch.cat([frames for _, frames in parts]), whole, f"{decoder} streamed frames")


def test_decode_latents_polls_the_video_decoder_and_before_the_audio(vae_root):
    vaes = MediaVAEs.from_pretrained(vae_root)
    video = torch.randn(1, 8, 7, 4, 4, generator=torch.Generator().manual_seed(1))  # one window of one tile
    audio = torch.randn(2, vaes.audio_latent_channels, 10, generator=torch.Generator().manual_seed(2))
    stages: list = []
    calls: list = []
    media = decode_latents(vaes, video, audio, stages.append, counting_then(None, calls))
    assert len(calls) == len(vaes.video_vae.decoder.transformer_blocks) + 1 and stages == ["decode.video", "decode.audio"]
    assert_bitwise(media.frames, decode_latents(vaes, video, audio).frames, "decode_latents with the hook")
    with pytest.raises(Abort):
        decode_latents(vaes, video, audio, stages.append, counting_then(len(calls), []))
    assert stages[-1] == "decode.video"  # stopped before the audio decode


def test_calling_between_blocks_without_a_hook_registers_nothing(vae_root):
    vaes = MediaVAEs.from_pretrained(vae_root)
    with calling_between_blocks(vaes.video_vae.decoder, None):
        assert all(not block._forward_pre_hooks for block in vaes.video_vae.decoder.transformer_blocks)


def test_pipeline_cancel_during_the_decode(h3_prepared, tmp_path):
    request = VideoRequest("A train crosses a snowy bridge, whistle echoing.", seed=4, width=96, height=64)
    denoised: list = []
    polls_after: list = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "denoise" and done == total:
            denoised.append(1)

    def cancel() -> None:
        if denoised:
            polls_after.append(1)
            if len(polls_after) == 3:  # the last evaluation's poll, the poll after the denoise, then the decoder's first block
                raise KeyboardInterrupt("user pressed stop")

    pipeline = H3Pipeline.from_prepared(h3_prepared)
    with pytest.raises(RequestCancelled, match="request cancelled: user pressed stop"):
        pipeline.generate(request, tmp_path / "stopped.mp4", progress=progress, cancel=cancel)
    assert len(polls_after) == 3 and list(tmp_path.iterdir()) == [] and pipeline.session is None


# -- the node side (headless host: the pack's real modules over the stand-in ComfyUI modules) -----------------------


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    from comfy_standins import harness

    with harness.installed(tmp_path_factory.mktemp("vflash-cache"), tmp_path_factory.mktemp("comfyui")) as loaded:
        yield loaded


def test_preview_strip_puts_frames_spread_over_the_clip_side_by_side(pack):
    host = pack.package.host
    video = torch.arange(31.0).view(1, 1, 31, 1, 1).expand(1, 2, 31, 3, 5).contiguous()  # each frame holds its index
    strip = host.preview_strip(video)
    assert strip.shape == (1, 2, 1, 3, 20)
    assert strip[0, 0, 0, 0, ::5].tolist() == [0.0, 10.0, 20.0, 30.0]
    assert torch.equal(strip[:, :, 0, :, 5:10], video[:, :, 10])
    assert host.preview_strip(video[:, :, :2]).shape == (1, 2, 1, 3, 10) and host.preview_strip(video[:, :, :1]).shape == (1, 2, 1, 3, 5)


def test_a_host_without_latent_preview_runs_without_previews_and_says_so_once(pack):
    host = pack.package.host
    assert host.HOST.preview(4, torch.device("cpu"), 24) is None and host.HOST.preview(4, torch.device("cpu"), 24) is None
    assert host._missing_preview_logged == ["this host has no latent_preview or comfy.latent_formats module"]
