"""MP4 delivery: exact frame count and timing, AAC of the right length, file/pipe equivalence, atomic publication."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from vflash_core.errors import VflashError
from vflash_core.fileio import OutputExistsError
from vflash_core.media import mp4 as media
from vflash_core.media.mp4 import probe_mp4, write_mp4

SR = 32000


def _clip(frames: int = 29, height: int = 64, width: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth moving gradient (codes well, so decoded pixels stay close) and a stereo chirp-like waveform."""
    y = torch.linspace(0, 1, height)[None, :, None, None]
    x = torch.linspace(0, 1, width)[None, None, :, None]
    t = torch.linspace(0, 1, frames)[:, None, None, None]
    full = (frames, height, width, 1)
    rgb = torch.cat([((x + t) % 1.0).expand(full), y.expand(full), ((x + y) / 2).expand(full)], dim=-1)
    samples = round(frames / 24 * SR)
    s = torch.arange(samples) / SR
    wave = torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * s), 0.25 * torch.sin(2 * torch.pi * 660 * s)])
    return rgb.float(), wave.float()


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial" in p.name)


def test_mp4_metadata_tags_are_kept_under_their_own_names(tmp_path):
    """Free-form keys (as ComfyUI stores a graph's prompt) survive the MP4 muxer and read back unchanged."""
    frames, wave = _clip()
    prompt = '{"1": {"class_type": "VflashGenerate", "inputs": {"prompt": "a fox, \u00e9t\u00e9"}}}'
    out = write_mp4(tmp_path / "tagged.mp4", frames, wave, SR, metadata={"prompt": prompt})
    with av.open(str(out)) as container:
        assert container.metadata["prompt"] == prompt
    assert probe_mp4(out)["frames"] == 29


def test_mp4_has_exact_frames_timing_and_audio(tmp_path):
    frames, wave = _clip()
    out = write_mp4(tmp_path / "clip.mp4", frames, wave, SR)
    info = probe_mp4(out)
    assert (info["frames"], info["fps"], info["width"], info["height"]) == (29, 24.0, 96, 64)
    assert (info["video_codec"], info["audio_codec"], info["sample_rate"], info["channels"]) == ("h264", "aac", SR, 2)
    assert info["audio_seconds"] == pytest.approx(wave.shape[1] / SR, abs=2e-3)
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        decoded = [f for f in container.decode(stream)]
        assert [int(f.pts * stream.time_base * 24) for f in decoded] == list(range(29))
        rgb = np.stack([f.to_ndarray(format="rgb24") for f in decoded]).astype(np.float32) / 255
        container.seek(0)
        pcm = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    # Lossy, but a smooth gradient survives H.264 + yuv420p and AAC survives a pure tone.
    assert np.abs(rgb - frames.numpy()).mean() < 0.02
    assert pcm.shape[0] == 2
    for channel, (tone, rms) in enumerate([(440, 0.5 / 2**0.5), (660, 0.25 / 2**0.5)]):
        spectrum = np.abs(np.fft.rfft(pcm[channel]))
        assert np.fft.rfftfreq(pcm.shape[1], 1 / SR)[spectrum.argmax()] == pytest.approx(tone, abs=2)
        assert np.sqrt(np.mean(pcm[channel, 4096:-4096] ** 2)) == pytest.approx(rms, rel=0.05)


def test_file_and_pipe_inputs_feed_identical_frames(tmp_path):
    frames, _ = _clip()
    shape = tuple(frames.shape)
    clip = tmp_path / "clip.mp4"
    with media.rgb_frames(frames, shape, "file", clip) as from_file, media.rgb_frames(frames, shape, "pipe", clip) as piped:
        assert len(from_file) == len(piped) == 29
        assert _leftovers(tmp_path) != []  # the file mode's raw RGB clip exists while encoding
        for i in range(29):
            assert np.array_equal(from_file[i], piped[i]) and np.array_equal(from_file[i], media.quantize_frames(frames)[i])
    assert _leftovers(tmp_path) == []
    for mode in ("file", "pipe"):
        assert probe_mp4(write_mp4(tmp_path / f"{mode}.mp4", frames, _clip()[1], SR, video_input=mode, video_threads=2))["frames"] == 29
    assert _leftovers(tmp_path) == []


def test_uint8_frames_and_mono_audio(tmp_path):
    frames, wave = _clip(frames=5)
    out = write_mp4(tmp_path / "m.mp4", (frames * 255).round().to(torch.uint8), wave[:1], SR)
    info = probe_mp4(out)
    assert (info["frames"], info["channels"]) == (5, 1)


def test_existing_output_is_not_overwritten(tmp_path):
    frames, wave = _clip(frames=5)
    target = tmp_path / "keep.mp4"
    target.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="already exists"):
        write_mp4(target, frames, wave, SR)
    assert target.read_bytes() == b"precious"
    write_mp4(target, frames, wave, SR, overwrite=True)
    assert probe_mp4(target)["frames"] == 5
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("video_input", ["file", "pipe"])
def test_encode_failure_leaves_no_partial_file(tmp_path, monkeypatch, video_input):
    frames, wave = _clip(frames=9)

    def broken(*args, **kwargs):
        raise RuntimeError("encoder died")

    # Video has been encoded into the temporary file when the audio encoder fails.
    monkeypatch.setattr(av.AudioFrame, "from_ndarray", broken)
    with pytest.raises(RuntimeError, match="encoder died"):
        write_mp4(tmp_path / "x.mp4", frames, wave, SR, video_input=video_input)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(video_input="socket"), "video_input must be one of file, pipe, got 'socket'"),
        (dict(video_threads=0), "video_threads must be an integer from 1 to 256, got 0"),
        (dict(video_threads=257), "video_threads must be an integer from 1 to 256, got 257"),
        (dict(sample_rate=12345), "AAC cannot encode 12345 Hz audio"),
        (dict(frames=torch.zeros(3, 63, 96, 3)), "even frame size, got 96x63"),
        (dict(frames=torch.zeros(3, 64, 96)), r"frames must be \(F, H, W, 3\) RGB"),
        (dict(waveform=torch.zeros(3, 100)), r"waveform must be \(channels, samples\) with 1 or 2 channels, got \[3, 100\]"),
    ],
)
def test_bad_delivery_arguments_are_rejected(tmp_path, kwargs, message):
    frames, wave = _clip(frames=3)
    args = dict(frames=frames, waveform=wave, sample_rate=SR) | kwargs
    with pytest.raises(VflashError, match=message):
        write_mp4(tmp_path / "bad.mp4", **args)
    assert list(tmp_path.iterdir()) == []


def test_quantization_rounds_like_diffusers():
    values = torch.tensor([0.0, 0.5 / 255, 1.5 / 255, 0.999, 1.2, -0.1]).view(1, 1, 2, 3)
    assert media.quantize_frames(values).reshape(-1).tolist() == [0, 0, 2, 255, 255, 0]
