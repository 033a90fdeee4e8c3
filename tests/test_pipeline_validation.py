"""Every bad request is refused before any model loads, with a message naming the values, and writes nothing."""

from __future__ import annotations

import pytest
from PIL import Image

from vflash_core.cli.main import main
from vflash_core.errors import VflashError
from vflash_core.pipeline.h3_pipeline import H3Pipeline, PreparedAssets, VideoRequest, prepare_pipeline
from vflash_core.pipeline.options import RunOptions


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    Image.new("RGB", (96, 64), (200, 40, 40)).save(folder / "a.png")
    Image.new("RGB", (64, 64), (40, 200, 40)).save(folder / "b.png")
    (folder / "broken.png").write_bytes(b"not a png at all")
    (folder / "voice.wav").write_bytes(b"RIFF....WAVEfmt not really")
    (folder / "notes.xyz").write_text("?")
    for name, channels, rate, samples in AUDIO_FILES:
        write_wav(folder / name, channels, rate, samples)
    return folder


#: (name, channels, sample rate, samples) of the WAVs the `files` fixture writes.
AUDIO_FILES = (
    ("eight-channels.wav", 8, 32000, 3200), ("three-channels.wav", 3, 32000, 3200), ("empty.wav", 1, 32000, 0),
    ("one-hertz.wav", 1, 1, 3), ("short.wav", 2, 32000, 1600),
)


def write_wav(path, channels: int, rate: int, samples: int) -> None:
    """A silent 16-bit PCM WAV."""
    import wave

    with wave.open(str(path), "wb") as audio:
        audio.setnchannels(channels)
        audio.setsampwidth(2)
        audio.setframerate(rate)
        audio.writeframes(bytes(2 * channels * samples))


class F(str):
    """A file of the `files` fixture, named in a case and resolved in the test."""


def _resolve(value, folder):
    if isinstance(value, F):
        return str(folder / value)
    if isinstance(value, tuple):
        return tuple(_resolve(v, folder) for v in value)
    return value


KEYFRAME_PROFILE_CASES = {
    # width x height, as every other message (it said "got 64x100")
    "canvas-multiple": (dict(prompt="x", width=100, height=64), r"width and height must be positive multiples of 32, got 100x64$"),
    "canvas-aspect": (dict(prompt="x", width=640, height=64), r"canvas 640x64 has aspect ratio 10, outside H3's 1:4 .. 4:1"),
    "canvas-half": (dict(prompt="x", width=320), r"width and height go together: got width=320, height=None"),
    "too-short": (dict(prompt="x", duration_seconds=3), r"duration 3 s aligns to 73 frames \(3.042 s\); H3 generates 5-15 s"),
    "too-long": (dict(prompt="x", duration_seconds=15.1), r"duration 15.1 s aligns to 362 frames \(15.083 s\)"),
    "empty-prompt": (dict(prompt="   "), r"the prompt must be a non-empty string"),
    "negative-seed": (dict(prompt="x", seed=-1), r"seed must be an integer from 0 to 9,223,372,036,854,775,807, got -1"),
    "keyframes-and-references": (dict(prompt="x", first_frame=F("a.png"), references=(F("b.png"),)), r"either keyframes \(first/last frame\) or references, not both"),
    "label-t2va": (dict(prompt="<Picture 1> dances"), r"prompt label <Picture 1> is not bound to an input: this t2va request provides 0 pictures, 0 videos and 0 audio clips"),
    "label-i2va": (dict(prompt="<Picture 1> to <Picture 2>", first_frame=F("a.png")), r"prompt label <Picture 2> is not bound to an input: this i2va request provides 1 picture, 0 videos"),
    "label-zero": (dict(prompt="<Picture 0>", first_frame=F("a.png"), last_frame=F("b.png")), r"prompt label <Picture 0> is not bound .* fl2va request provides 2 pictures"),
    "mode-not-in-profile": (dict(prompt="x", references=(F("a.png"),)), r"profile t2va-base4-exact-cpu accepts t2va, i2va, l2va, fl2va; a ref2va request was given"),
    "missing-file": (dict(prompt="x", first_frame=F("missing.png")), r"first frame .*missing.png does not exist"),
    "unreadable-image": (dict(prompt="x", last_frame=F("broken.png")), r"last frame .*broken.png cannot be read as image"),
    "keyframe-not-an-image": (dict(prompt="x", first_frame=F("voice.wav")), r"first frame .*voice.wav (cannot be read as audio|is not an image)"),
}

REF2VA_PROFILE_CASES = {
    "label-video": (dict(prompt="<Video 1> moves", references=(F("a.png"),)), r"prompt label <Video 1> is not bound .* ref2va request provides 1 picture, 0 videos and 0 audio clips"),
    "label-audio": (dict(prompt="<Audio 1>", references=(F("a.png"),)), r"prompt label <Audio 1> is not bound"),
    "unknown-media": (dict(prompt="x", references=(F("notes.xyz"),)), r"reference .*notes.xyz: unknown media type '.xyz'"),
    "unreadable-audio": (dict(prompt="x", references=(F("a.png"), F("voice.wav"))), r"reference 2 .*voice.wav cannot be read as audio"),
    "mode-not-in-profile": (dict(prompt="x"), r"profile ref2va-base4-exact-cpu accepts ref2va; a t2va request was given"),
    "ten-images": (dict(prompt="x", references=(F("a.png"),) * 10), r"H3 takes at most 9 image references, got 10"),
    # The audio header's limits, from the header alone: an 8-channel file crashed the decoder (SIGSEGV) after the
    # models loaded, a 0-sample one failed in the encoder with torch's message.
    "eight-channel-audio": (dict(prompt="x", references=(F("a.png"), F("eight-channels.wav"))), r"reference 2 .*eight-channels.wav has 8 audio channels; soundtracks must be mono or stereo \(1 or 2 channels\)"),
    "three-channel-audio": (dict(prompt="x", references=(F("a.png"), F("three-channels.wav"))), r"reference 2 .*three-channels.wav has 3 audio channels"),
    "empty-audio": (dict(prompt="x", references=(F("a.png"), F("empty.wav"))), r"reference 2 .*empty.wav lasts 0 s; audio references must last at least 0.1 s"),
    "short-audio": (dict(prompt="x", references=(F("a.png"), F("short.wav"))), r"reference 2 .*short.wav lasts 0.05 s"),
    "one-hertz-audio": (dict(prompt="x", references=(F("a.png"), F("one-hertz.wav"))), r"reference 2 .*one-hertz.wav has a sample rate of 1 Hz; soundtracks must be sampled at 8,000-192,000 Hz"),
}


def _assert_refused(pipeline: H3Pipeline, request: VideoRequest, message: str, out) -> None:
    with pytest.raises(VflashError, match=message):
        pipeline.validate(request)
    with pytest.raises(VflashError, match=message):
        pipeline.generate(request, out)
    assert not pipeline.loaded, "a model was loaded for a request that was refused"
    assert not out.exists() and list(out.parent.iterdir()) == []


@pytest.mark.parametrize("case", KEYFRAME_PROFILE_CASES)
def test_bad_keyframe_and_t2va_requests_are_refused_before_loading(case, files, h3_prepared, tmp_path):
    kwargs, message = KEYFRAME_PROFILE_CASES[case]
    pipeline = H3Pipeline.from_prepared(h3_prepared)
    _assert_refused(pipeline, VideoRequest(**{k: _resolve(v, files) for k, v in kwargs.items()}), message, tmp_path / "out.mp4")


@pytest.mark.parametrize("case", REF2VA_PROFILE_CASES)
def test_bad_ref2va_requests_are_refused_before_loading(case, files, h3_prepared_ref, tmp_path):
    kwargs, message = REF2VA_PROFILE_CASES[case]
    pipeline = H3Pipeline.from_prepared(h3_prepared_ref)
    _assert_refused(pipeline, VideoRequest(**{k: _resolve(v, files) for k, v in kwargs.items()}), message, tmp_path / "out.mp4")


def test_reference_counts_per_modality(files, h3_prepared_ref, tmp_path):
    import av
    import numpy as np

    wav = tmp_path.parent / f"{tmp_path.name}-tone.wav"
    with av.open(str(wav), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=32000)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 3200), np.int16), format="s16", layout="mono")
        frame.sample_rate = 32000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    pipeline = H3Pipeline.from_prepared(h3_prepared_ref)
    a = str(files / "a.png")
    _assert_refused(pipeline, VideoRequest("x", references=(str(wav),)), r"audio references need at least one image or video reference", tmp_path / "o.mp4")
    _assert_refused(pipeline, VideoRequest("x", references=(a, *[str(wav)] * 4)), r"H3 takes at most 3 audio references, got 4", tmp_path / "o.mp4")
    # Bound labels pass: one picture, one audio clip.
    pipeline.validate(VideoRequest("<Picture 1> sings <Audio 1>", references=(a, str(wav))))
    assert not pipeline.loaded


def test_output_problems_are_refused_before_loading(h3_prepared, tmp_path):
    pipeline = H3Pipeline.from_prepared(h3_prepared)
    with pytest.raises(VflashError, match=r"output folder .*nowhere does not exist"):
        pipeline.generate(VideoRequest("x"), tmp_path / "nowhere" / "out.mp4")
    existing = tmp_path / "taken.mp4"
    existing.write_bytes(b"keep me")
    with pytest.raises(VflashError, match=r"taken.mp4 already exists; refusing to overwrite it"):
        pipeline.generate(VideoRequest("x"), existing)
    assert existing.read_bytes() == b"keep me" and not pipeline.loaded
    with pytest.raises(VflashError, match=r"video_threads must be an integer from 1 to 256, got 0"):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(media_video_threads=0))


def test_cli_reports_one_line_and_exit_status_2(h3_prepared, tmp_path, capsys):
    out = tmp_path / "cli.mp4"
    code = main(["generate", "--prepared-assets", str(h3_prepared), "--prompt", "<Picture 1> waves", "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert err[-1] == "vflash: error: prompt label <Picture 1> is not bound to an input: this t2va request provides 0 pictures, 0 videos and 0 audio clips"


def test_cli_refuses_an_eight_channel_audio_reference_in_one_line(files, h3_prepared_ref, tmp_path, capsys):
    """The decoder crashed the process (SIGSEGV, no message) on this file after the models loaded."""
    out = tmp_path / "cli.mp4"
    code = main([
        "generate", "--prepared-assets", str(h3_prepared_ref), "--prompt", "<Picture 1> sings",
        "--reference", str(files / "a.png"), "--reference", str(files / "eight-channels.wav"), "--output", str(out),
    ])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert err == [(f"vflash: error: reference 2 {files / 'eight-channels.wav'} has 8 audio channels; soundtracks must "
                    "be mono or stereo (1 or 2 channels): downmix it first")]


def test_prepare_pipeline_checks_the_assets(h3_prepared, tmp_path):
    import json

    record = PreparedAssets.load(h3_prepared).record
    assets = {k: record["assets"][k] for k in ("model_root", "decoder_root", "adapter_path", "artifact", "schedule_overlay", "auxiliary_tensor")}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**assets, "extra": 1}))
    with pytest.raises(VflashError, match=r"must have exactly the fields .*; unknown extra"):
        prepare_pipeline("t2va-base4-exact-cpu", bad, tmp_path / "r.json")
    bad.write_text(json.dumps(assets))
    with pytest.raises(VflashError, match=r"does not match profile ref2va-base4-exact-cpu"):
        prepare_pipeline("ref2va-base4-exact-cpu", bad, tmp_path / "r.json")
    bad.write_text(json.dumps({**assets, "decoder_root": str(tmp_path)}))
    with pytest.raises(VflashError, match=r"video VAE config .*vae/config.json does not exist"):
        prepare_pipeline("t2va-base4-exact-cpu", bad, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(VflashError, match=r"not a Vflash prepared-assets receipt"):
        PreparedAssets.load(bad)

