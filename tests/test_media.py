"""MP4 delivery: exact frame count and timing, AAC of the right length, file/pipe/stream equivalence, atomic
publication."""

from __future__ import annotations

import threading

import av
import numpy as np
import pytest
import torch
from mp4_probe import probe_mp4

from vflash_core.errors import VflashError
from vflash_core.fileio import OutputExistsError
from vflash_core.media import mp4 as media
from vflash_core.media.mp4 import mp4_stream, write_mp4

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
        (dict(video_input="socket"), "video_input must be one of file, pipe, stream, got 'socket'"),
        (dict(video_threads=0), "video_threads must be an integer from 1 to 256, got 0"),
        (dict(video_threads=257), "video_threads must be an integer from 1 to 256, got 257"),
        (dict(video_crf=52), "video_crf must be an integer from 0 to 51, got 52"),
        (dict(video_crf=18.0), "video_crf must be an integer from 0 to 51, got float 18.0"),
        (dict(video_preset="turbo"), "video_preset must be one of ultrafast, .*, placebo, got 'turbo'"),
        (dict(sample_rate=12345), "AAC cannot encode 12345 Hz audio"),
        (dict(frames=torch.zeros(3, 63, 96, 3)), "even frame size, got 96x63"),
        (dict(fps=True), "fps must be a positive integer, got True"),  # a bool is no frame rate
        (dict(fps=0), "fps must be a positive integer, got 0"),
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


def _noisy_clip(frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient clip with noise (so the encoder's decisions vary frame to frame), values outside [0, 1] included."""
    rgb, wave = _clip(frames=frames)
    noise = torch.rand(rgb.shape, generator=torch.Generator().manual_seed(frames)) * 0.3 - 0.1
    return rgb + noise, wave


def _encoder_inputs(monkeypatch) -> dict[str, list]:
    """What every writer hands the muxer, recorded: each RGB frame, and the soundtrack."""
    seen: dict[str, list] = {"frames": [], "audio": []}
    add_frame, finish = media._Muxer.add_frame, media._Muxer.finish

    def recording_add_frame(self, rgb):
        seen["frames"].append(np.array(rgb))
        add_frame(self, rgb)

    def recording_finish(self, audio):
        seen["audio"].append(np.array(audio))
        finish(self, audio)

    monkeypatch.setattr(media._Muxer, "add_frame", recording_add_frame)
    monkeypatch.setattr(media._Muxer, "finish", recording_finish)
    return seen


def test_a_stream_fed_in_parts_encodes_what_the_whole_clip_encodes(tmp_path, monkeypatch):
    """Parts of uneven sizes (as decode windows come), float frames quantised by the stream: the muxer receives the
    same uint8 frames, in the same order, and the same soundtrack as `write_mp4` gives it for the whole clip. (The
    files' bytes are not compared: this libx264 build's output for the same frames, single-threaded, differed between
    processes and between calls in one process on this clip, so bytes cannot be promised even for one writer.)"""
    frames, wave = _noisy_clip(41)
    seen = _encoder_inputs(monkeypatch)
    write_mp4(tmp_path / "whole.mp4", frames, wave, SR)
    whole = {k: v[:] for k, v in seen.items()}
    seen["frames"].clear(), seen["audio"].clear()
    with mp4_stream(tmp_path / "streamed.mp4", 96, 64, SR) as stream:
        for start, stop in ((0, 5), (5, 22), (22, 39), (39, 41)):
            stream.add(start, frames[start:stop])
        stream.finish(wave)
    assert len(seen["frames"]) == len(whole["frames"]) == 41
    assert all(np.array_equal(a, b) for a, b in zip(seen["frames"], whole["frames"]))
    assert np.array_equal(seen["audio"][0], whole["audio"][0])
    info = probe_mp4(tmp_path / "streamed.mp4")
    assert (info["frames"], info["width"], info["height"], info["channels"]) == (41, 96, 64, 2)
    assert _leftovers(tmp_path) == []


def test_a_stream_of_uint8_frames_and_mono_audio(tmp_path):
    frames, wave = _clip(frames=7)
    with mp4_stream(tmp_path / "m.mp4", 96, 64, SR, channels=1) as stream:
        stream.add(0, media.quantize(frames))
        stream.finish(wave[:1])
    assert (probe_mp4(tmp_path / "m.mp4")["frames"], probe_mp4(tmp_path / "m.mp4")["channels"]) == (7, 1)


@pytest.mark.parametrize(
    "feed, message",
    [
        (lambda s, f, w: s.add(3, f[:3]), "expected frame 0 next, got a part starting at frame 3"),
        (lambda s, f, w: s.add(0, f[:3, :32]), r"takes \(f, 64, 96, 3\) RGB frames, got \[3, 32, 96, 3\]"),
        (lambda s, f, w: s.finish(w), "was given no frames"),
        (lambda s, f, w: (s.add(0, f), s.finish(w[:1])), "opened for 2 audio channels, got 1"),
        (lambda s, f, w: s.add(0, f), "ended without finish\\(\\); nothing was written"),
    ],
)
def test_a_misfed_stream_is_refused_and_publishes_nothing(tmp_path, feed, message):
    frames, wave = _clip(frames=5)
    with pytest.raises(VflashError, match=message), mp4_stream(tmp_path / "x.mp4", 96, 64, SR) as stream:
        feed(stream, frames, wave)
    assert list(tmp_path.iterdir()) == []
    assert not stream._thread.is_alive()


def test_an_encoder_failure_reaches_the_producer_and_publishes_nothing(tmp_path, monkeypatch):
    """The encoder thread fails on frame 4 while the producer keeps adding: the producer sees that error (not a hang
    on the full queue), the thread ends and nothing appears at the path."""
    frames, wave = _clip(frames=12)
    original, seen = media._Muxer.add_frame, []

    def failing(self, rgb):
        seen.append(1)
        if len(seen) == 4:
            raise OSError(28, "No space left on device")
        original(self, rgb)

    monkeypatch.setattr(media._Muxer, "add_frame", failing)
    with pytest.raises(VflashError, match="No space left on device"), mp4_stream(tmp_path / "x.mp4", 96, 64, SR) as stream:
        for i in range(12):
            stream.add(i, frames[i : i + 1])
        stream.finish(wave)
    assert list(tmp_path.iterdir()) == []
    assert not stream._thread.is_alive() and len(seen) == 4


def test_a_producer_failure_stops_the_encoder_and_publishes_nothing(tmp_path):
    frames, _ = _clip(frames=6)
    with pytest.raises(RuntimeError, match="decoder died"), mp4_stream(tmp_path / "x.mp4", 96, 64, SR) as stream:
        stream.add(0, frames[:3])
        raise RuntimeError("decoder died")
    assert list(tmp_path.iterdir()) == []
    assert not stream._thread.is_alive()
    assert not any(t.name == "vflash-mp4-stream" and t.is_alive() for t in threading.enumerate())


def test_a_stream_never_overwrites(tmp_path):
    target = tmp_path / "keep.mp4"
    target.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="already exists"), mp4_stream(target, 96, 64, SR):
        pass
    assert target.read_bytes() == b"precious"


@pytest.mark.gpu
def test_quantizing_on_the_gpu_gives_the_hosts_bytes():
    """The stream quantises where the frames were decoded: on CUDA the same bytes as on the CPU (one correctly
    rounded float32 multiply, round-half-to-even), over values that straddle every rounding boundary."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    steps = (torch.arange(256, dtype=torch.float32) + 0.5) / 255  # x * 255 lands on every .5 tie
    values = torch.cat([torch.rand(1 << 22, generator=g) * 1.2 - 0.1, steps, torch.nextafter(steps, steps + 1), torch.nextafter(steps, steps - 1)])
    assert torch.equal(media.quantize(values.cuda()).cpu(), media.quantize(values))


@pytest.mark.gpu
def test_a_stream_of_cuda_frames_copies_them_asynchronously_and_encodes_the_hosts_bytes(tmp_path, monkeypatch):
    """Parts on CUDA, each a permuted view as the decoder's frames are, queued behind more device work: the stream
    copies them into pinned memory without waiting, and the muxer gets the frames the CPU path gives it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    frames, wave = _noisy_clip(29)
    seen = _encoder_inputs(monkeypatch)
    write_mp4(tmp_path / "host.mp4", frames, wave, SR)
    expected = seen["frames"][:]
    seen["frames"].clear(), seen["audio"].clear()
    channels_first = frames.permute(3, 0, 1, 2).contiguous().cuda()  # (3, F, H, W), as a decoded clip is laid out
    with mp4_stream(tmp_path / "cuda.mp4", 96, 64, SR) as stream:
        for start, stop in ((0, 17), (17, 29)):
            part = channels_first[:, start:stop].permute(1, 2, 3, 0)
            stream.add(start, part)
            channels_first[:, start:stop] = -1.0  # queued after the part was quantised and its copy queued
        stream.finish(wave)
    assert len(seen["frames"]) == len(expected) == 29
    assert all(np.array_equal(a, b) for a, b in zip(seen["frames"], expected))
    assert _leftovers(tmp_path) == []



def _x264_settings(path) -> bytes:
    """libx264's own record of its settings, the SEI text it writes into the first frame's bitstream."""
    data = path.read_bytes()
    start = data.index(b"x264 - core")
    return data[start : data.index(b"\x00", start)]


def test_crf_and_preset_reach_the_encoder_in_every_writer(tmp_path):
    frames, wave = _clip(frames=9)
    default = _x264_settings(write_mp4(tmp_path / "default.mp4", frames, wave, SR))
    assert b" crf=18.0 " in default and b" subme=7 " in default  # H264_OPTIONS: crf 18, preset medium
    for video_input in ("file", "pipe"):
        out = write_mp4(tmp_path / f"{video_input}.mp4", frames, wave, SR, video_input=video_input, video_crf=30,
                        video_preset="ultrafast")
        assert b" crf=30.0 " in _x264_settings(out) and b" subme=0 " in _x264_settings(out), video_input
    with mp4_stream(tmp_path / "stream.mp4", 96, 64, SR, video_crf=0, video_preset="veryslow") as stream:
        stream.add(0, frames)
        stream.finish(wave)
    streamed = _x264_settings(tmp_path / "stream.mp4")
    assert streamed.endswith(b" qp=0") and b" ref=16 " in streamed  # CRF 0: lossless constant QP 0; veryslow: 16 refs
    with (
        pytest.raises(VflashError, match="video_preset must be one of"),
        mp4_stream(tmp_path / "refused.mp4", 96, 64, SR, video_preset="turbo"),
    ):
        pass
    assert not (tmp_path / "refused.mp4").exists()
