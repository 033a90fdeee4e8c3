"""The complete pipeline equals diffusers 0.42.1's `MiniMaxH3` modular pipeline on the same model family, bit for bit.

Both sides load the same random-weight family from its official folder layout (diffusers through
`ModularPipeline.from_pretrained`). For t2va, i2va, fl2va and a ref2va request with an image and an audio reference,
the Vflash bundle (text embeddings and row tags, the packed layout, the noised conditioning and the drawn noise), the
final latents, the decoded frames and the waveform all equal the reference's.

The reference's `Qwen3VLProcessor` cannot be constructed without torchvision (its video processor needs it), which is
not installable next to this CPU torch build; here it is the official class minus its video processor, so every call
the reference makes (`image_processor`, `create_mm_token_type_ids`) runs the official code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_bitwise
from diffusers_parity import FRAMES, check_against_diffusers
from PIL import Image

from vflash_core.pipeline.h3_pipeline import H3Pipeline, VideoRequest


def _processor(root):
    from transformers import AutoImageProcessor, Qwen2TokenizerFast, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(root / "processor")

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyQwen3VLProcessor(AutoImageProcessor.from_pretrained(root / "processor"), Qwen2TokenizerFast.from_pretrained(root / "tokenizer"))


@pytest.fixture(scope="module")
def reference(h3_family):
    """diffusers' MiniMaxH3 modular pipeline over the family, in the dtypes the native side uses on the CPU."""
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(h3_family))
    pipe.load_components(names=["transformer", "transformer_ref"], torch_dtype=torch.bfloat16)
    pipe.load_components(names=["text_encoder", "vae", "audio_vae", "tokenizer", "scheduler", "audio_scheduler"], torch_dtype=torch.float32)
    pipe.update_components(processor=_processor(h3_family))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def native(h3_prepared):
    with H3Pipeline.from_prepared(h3_prepared) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def native_ref(h3_prepared_ref):
    with H3Pipeline.from_prepared(h3_prepared_ref) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A keyframe, a last frame of another aspect (cover-cropped), an image reference and a 32 kHz stereo WAV."""
    import av

    folder = tmp_path_factory.mktemp("media")
    g = np.random.default_rng(0)

    def image(name: str, width: int, height: int) -> str:
        x = np.linspace(0, 255, width)[None, :, None]
        y = np.linspace(0, 255, height)[:, None, None]
        pixels = np.clip(np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2) + g.normal(0, 20, (height, width, 3)), 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(folder / name)
        return str(folder / name)

    wav = folder / "voice.wav"
    t = np.arange(2 * 32000) / 32000
    pcm = (np.stack([np.sin(2 * np.pi * 330 * t), 0.5 * np.sin(2 * np.pi * 550 * t)]) * 12000).astype(np.int16)
    with av.open(str(wav), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=32000)
        stream.layout = "stereo"
        frame = av.AudioFrame.from_ndarray(pcm.T.reshape(1, -1).copy(), format="s16", layout="stereo")
        frame.sample_rate = 32000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return {"first": image("first.png", 120, 80), "last": image("last.png", 80, 80), "picture": image("picture.png", 90, 60), "voice": str(wav)}


def test_t2va_matches_diffusers(native, reference):
    # 320 px wide: the video VAE decodes two blended tiles.
    check_against_diffusers(native, reference, VideoRequest("A robot dances in the rain.", seed=3, width=320, height=96), 96, 320)


def test_i2va_matches_diffusers(native, reference, media):
    # The 120x80 keyframe is stretched onto the 96x64 canvas.
    check_against_diffusers(native, reference, VideoRequest("<Picture 1>: a cat jumps onto the table.", first_frame=media["first"], seed=5, width=96, height=64), 64, 96)


def test_canvas_follows_the_keyframe_or_the_default_aspect(media):
    from vflash_core.media.references import CanvasRules
    from vflash_core.pipeline.h3_pipeline import plan_request
    from vflash_core.profiles import get_profile

    family, released = CanvasRules(256, 256 * 448, 128), CanvasRules()

    def canvas(rules, profile="t2va-base4-exact-cpu", **kwargs):
        geometry = plan_request(VideoRequest("x", **kwargs), get_profile(profile), rules).geometry
        return geometry.height, geometry.width

    assert canvas(family, first_frame=media["first"]) == (256, 384)  # the 3:2 keyframe sets the aspect
    assert canvas(released, last_frame=media["last"]) == (768, 768)  # l2va: the last frame does
    assert canvas(released) == (768, 1344)  # t2va: H3's 16:9
    assert canvas(family, "ref2va-base4-exact-cpu", references=(media["picture"],)) == (256, 448)  # references never bind it


def test_fl2va_matches_diffusers(native, reference, media):
    request = VideoRequest("From <Picture 1> to <Picture 2>, slow motion.", first_frame=media["first"], last_frame=media["last"], seed=7, width=96, height=64)
    check_against_diffusers(native, reference, request, 64, 96)


def test_ref2va_with_image_and_audio_references_matches_diffusers(native_ref, reference, media):
    request = VideoRequest("<Picture 1> sings <Audio 1> on a stage.", references=(media["picture"], media["voice"]), seed=11, width=96, height=64)
    check_against_diffusers(native_ref, reference, request, 64, 96)
    bundle = native_ref.encode(request).consume()
    # The 2 s soundtrack is 80 latents per channel; the 90x60 picture is encoded at the family's 128 px short edge.
    assert bundle.layout.num_condition_audio_rows == 160
    assert bundle.layout.num_condition_video_rows == (192 // 32) * (128 // 32)


# -- video references: the parts that do not need torchvision, each against the reference's own code ---------------


def test_reference_normalisation_matches_the_setup_step(reference, media):
    """Image, 30 fps video with a 32 kHz soundtrack, and audio: the same media diffusers' Ref2VA setup step makes."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    from vflash_core.media.references import CanvasRules, load_image, normalize_references

    g = torch.Generator().manual_seed(0)
    raw = [
        MiniMaxH3ImageReference(image=load_image(media["picture"])),
        MiniMaxH3VideoReference(frames=(torch.rand(40, 60, 100, 3, generator=g).numpy() * 255).astype(np.uint8), fps=30.0, audio=torch.rand(1, 40000, generator=g) - 0.5, sample_rate=32000),
        MiniMaxH3AudioReference(audio=torch.rand(2, 50000, generator=g) - 0.5, sample_rate=32000),
    ]
    state = PipelineState()
    for name, value in (("references", raw), ("height", None), ("width", None), ("num_frames", FRAMES)):
        state.set(name, value)
    MiniMaxH3Ref2VASetupStep()(reference, state)
    expected = state.get("normalized_references")
    mine = normalize_references(raw, FRAMES, CanvasRules(256, 256 * 448, 128), 32000)
    assert np.array_equal(np.asarray(mine[0].image), np.asarray(expected[0].image)) and mine[0].image.size == (192, 128)
    assert mine[1].frames.shape == expected[1].frames.shape == (32, 256, 416, 3)  # 40 frames at 30 fps -> 32 at 24
    assert np.array_equal(mine[1].frames, expected[1].frames)
    for ours, theirs in ((mine[1].audio, expected[1].audio), (mine[2].audio, expected[2].audio)):
        assert_bitwise(ours, theirs, "soundtrack")


def test_video_reference_sampling_presentation_and_encoding(native_ref, reference):
    """Qwen's 2 fps frame sampling and block labels, the ref2va presentation (with a video processor stand-in giving
    fixed grids), and the VAE encode of a frame stack, each equal to diffusers."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep, encode_vae_condition

    from vflash_core.media.conditioning import sample_video_frames

    frames = (torch.rand(60, 64, 64, 3, generator=torch.Generator().manual_seed(1)).numpy() * 255).astype(np.uint8)
    sampled, stamps = sample_video_frames(frames, temporal_patch=2)
    want_frames, want_stamps = MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(frames, 24.0, 2.0, 2)
    assert stamps == want_stamps == [0.25, 1.25, 2.0] and all(np.array_equal(a, b) for a, b in zip(sampled, want_frames))

    class VideoProcessorStandIn:
        temporal_patch_size, merge_size = 2, 2

        def __call__(self, videos, **kwargs):
            grids = torch.tensor([[(len(v) + 1) // 2, 4, 6] for v in videos])
            return {"pixel_values_videos": torch.zeros(1), "video_grid_thw": grids}

    native_ref.load()
    conditioner = native_ref.conditioner
    conditioner.video_processor, saved = VideoProcessorStandIn(), conditioner.video_processor
    try:
        refs = [
            MiniMaxH3VideoReference(frames=frames, audio=torch.zeros(2, 10)),
            MiniMaxH3ImageReference(image=Image.new("RGB", (64, 96))),
            MiniMaxH3AudioReference(audio=torch.zeros(2, 10)),
            MiniMaxH3VideoReference(frames=frames[:30]),
        ]
        ids, tags, _ = conditioner.reference_presentation("<Video 2> then <Picture 1>", refs)
    finally:
        conditioner.video_processor = saved
    want_ids, want_tags = MiniMaxH3Ref2VATextEncoderStep._build_presentation(
        reference.tokenizer, "<Video 2> then <Picture 1>", refs, [6], [6, 6], [[0.25, 1.25, 2.0], [0.25, 1.0]]
    )
    assert (ids, tags) == (want_ids, want_tags)

    with native_ref.vaes.on_device():
        latents = native_ref.vaes.encode_pixels(frames[:22])
    pixels = torch.from_numpy(frames[:22].copy()).permute(3, 0, 1, 2)[None]
    expected = encode_vae_condition(reference.vae, pixels, reference.pixel_mean, reference.pixel_std, 42)
    assert latents.shape == (1, 8, 7, 4, 4)
    assert_bitwise(latents, expected, "video reference latents")


def test_soundtrack_resampling_is_band_limited_and_exact_in_length():
    """Off-rate soundtracks are resampled with torchaudio's default windowed sinc (torchaudio itself cannot be
    installed next to this torch build, so the check is against the signal, not against torchaudio's bits)."""
    from vflash_core.media.references import normalize_soundtrack, resample_audio

    t = torch.arange(48000, dtype=torch.float64) / 48000
    tone = torch.sin(2 * torch.pi * 1000 * t).float()[None]
    out = resample_audio(tone, 48000, 32000)
    assert out.shape == (1, 32000)
    want = torch.sin(2 * torch.pi * 1000 * torch.arange(32000, dtype=torch.float64) / 32000).float()
    assert (out[0, 200:-200] - want[200:-200]).abs().max() < 2e-3
    # Above the new Nyquist frequency nothing survives.
    assert resample_audio(torch.sin(2 * torch.pi * 20000 * t).float()[None], 48000, 32000)[0, 200:-200].abs().max() < 0.02
    stereo = normalize_soundtrack(tone, 48000, 32000, seconds=0.5)
    assert stereo.shape == (2, 16000) and torch.equal(stereo[0], stereo[1])
