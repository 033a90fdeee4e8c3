"""The complete pipeline on a Hopper GPU equals diffusers 0.42.1 there, bit for bit, in the released precision (bf16
Qwen3-VL and video-VAE decoder, fp32 audio VAE, the mixed bf16/fp32 transformer on the fused kernels and cuDNN
attention). With torchaudio installed, this also covers what the CPU suite cannot: video references compared with
the reference's own Qwen video processor (which needs torchvision), and off-rate soundtracks (44.1 and 48 kHz) through
the resampler.

Serial ownership is checked too: after each stage the text encoder and the VAEs are back on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_bitwise
from diffusers_parity import check_against_diffusers
from PIL import Image

from vflash_core.pipeline.h3_pipeline import H3Pipeline, VideoRequest, prepare_pipeline
from vflash_core.pipeline.options import RunOptions


@pytest.fixture(scope="module")
def sm90(tmp_path_factory, h3_family):
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the base16 profiles of both partitions are compiled for SM90 (H100/H200)")
    receipts = {}
    for profile, partition in (("t2va-base16-bf16-sm90", "transformer"), ("ref2va-base16-bf16-sm90", "transformer_ref")):
        tmp = tmp_path_factory.mktemp(profile)
        from vflash_core.weights.compiler import compile_receipt, prepare

        prepare(profile, h3_family / partition, tmp / "receipt.json")
        out = compile_receipt(tmp / "receipt.json", tmp / "compiled", "cuda:0")
        assets = {"model_root": str(h3_family), "decoder_root": str(h3_family), "adapter_path": None, "artifact": str(out / "artifact"),
                  "schedule_overlay": str(out / "schedule"), "auxiliary_tensor": str(out / "auxiliary.safetensors")}
        (tmp / "assets.json").write_text(json.dumps(assets))
        receipts[partition] = prepare_pipeline(profile, tmp / "assets.json", tmp / "pipeline.json").path
    return receipts


@pytest.fixture(scope="module")
def reference_gpu(h3_family):
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(h3_family))
    pipe.load_components(torch_dtype=torch.bfloat16)
    pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def gpu_media(tmp_path_factory):
    import av

    from vflash_core.media.mp4 import write_mp4

    folder = tmp_path_factory.mktemp("gpu-media")
    g = np.random.default_rng(0)
    paths = {}
    for name, (w, h) in {"first": (120, 80), "last": (80, 80), "picture": (90, 60)}.items():
        Image.fromarray(g.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"{name}.png")
        paths[name] = str(folder / f"{name}.png")
    t = np.arange(2 * 44100) / 44100
    pcm = (np.stack([np.sin(2 * np.pi * 330 * t), np.sin(2 * np.pi * 550 * t)]) * 9000).astype(np.int16)
    with av.open(str(folder / "voice.wav"), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=44100)
        stream.layout = "stereo"
        frame = av.AudioFrame.from_ndarray(pcm.T.reshape(1, -1).copy(), format="s16", layout="stereo")
        frame.sample_rate = 44100
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    paths["voice"] = str(folder / "voice.wav")
    clip = torch.rand(60, 64, 96, 3, generator=torch.Generator().manual_seed(1))
    paths["video"] = str(write_mp4(folder / "motion.mp4", clip, torch.rand(2, 96000, generator=torch.Generator().manual_seed(2)) - 0.5, 48000))
    return paths


CASES = {
    "t2va-tiled": ("transformer", lambda m: VideoRequest("A robot dances in the rain.", seed=3, width=320, height=96)),
    "i2va": ("transformer", lambda m: VideoRequest("<Picture 1>: a cat jumps.", first_frame=m["first"], seed=5, width=96, height=64)),
    "fl2va": ("transformer", lambda m: VideoRequest("<Picture 1> to <Picture 2>", first_frame=m["first"], last_frame=m["last"], seed=7, width=96, height=64)),
    "ref2va-image-audio44k": ("transformer_ref", lambda m: VideoRequest("<Picture 1> sings <Audio 1>", references=(m["picture"], m["voice"]), seed=11, width=96, height=64)),
    "ref2va-video-soundtrack48k": ("transformer_ref", lambda m: VideoRequest("<Audio 1> <Video 1> then <Picture 1>", references=(m["video"], m["picture"]), seed=12, width=96, height=64)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_pipeline_matches_diffusers_on_gpu(case, sm90, reference_gpu, gpu_media):
    partition, make = CASES[case]
    request = make(gpu_media)
    with H3Pipeline.from_prepared(sm90[partition], RunOptions(device=0, attention_backend="torch-cudnn")) as pipeline:
        pipeline.load()
        check_against_diffusers(pipeline, reference_gpu, request, request.height, request.width)
        assert next(pipeline.conditioner.text_encoder.parameters()).device.type == "cpu"
        assert next(pipeline.vaes.video_vae.parameters()).device.type == "cpu"


@pytest.mark.gpu
def test_resident_encoders_stay_on_the_gpu_and_change_no_bits(sm90, tmp_path):
    first = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (80, 120, 3), dtype=np.uint8)).save(first)
    requests = [VideoRequest("A robot dances in the rain.", seed=3, width=96, height=64),
                VideoRequest("<Picture 1>: a cat jumps.", first_frame=str(first), seed=5, width=96, height=64)]
    results = {}
    for residency in ("offload", "resident"):
        with H3Pipeline.from_prepared(sm90["transformer"], RunOptions(device=0, encoder_residency=residency)) as pipeline:
            results[residency] = [pipeline.generate(request, None) for request in requests]
            on_gpu = {next(m.parameters()).device.type == "cuda" for m in (pipeline.conditioner.text_encoder, pipeline.vaes.video_vae, pipeline.vaes.audio_vae)}
            assert on_gpu == {residency == "resident"}
    for kept, moved in zip(results["resident"], results["offload"]):
        assert kept.metadata["encoder_residency"] == "resident"
        assert_bitwise(kept.media.frames, moved.media.frames, "frames")
        assert_bitwise(kept.media.waveform, moved.media.waveform, "waveform")


@pytest.mark.parametrize("rate", [16000, 22050, 44100, 48000])
def test_resampler_equals_torchaudio(rate):
    """Wherever torchaudio can be installed (not next to this repository's CPU torch build)."""
    torchaudio = pytest.importorskip("torchaudio")
    from vflash_core.media.references import resample_audio

    wave = torch.rand(2, 3 * rate, generator=torch.Generator().manual_seed(rate)) - 0.5
    assert_bitwise(resample_audio(wave, rate, 32000), torchaudio.transforms.Resample(rate, 32000)(wave), f"{rate} Hz -> 32 kHz")
