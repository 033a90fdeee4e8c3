"""`H3Pipeline.generate`: MP4 delivery, stage timings, reuse across serial requests, composition from
separately loaded parts, cancellation and failures that leave nothing behind."""

from __future__ import annotations

import threading
import time

import av
import numpy as np
import pytest
import torch
from conftest import assert_bitwise
from mp4_probe import probe_mp4

from vflash_core.engine.session import NativeEngineSession
from vflash_core.errors import SessionClosedError, VflashError
from vflash_core.media import mp4
from vflash_core.media.conditioning import TextConditioner
from vflash_core.media.vae import MediaVAEs
from vflash_core.pipeline.h3_pipeline import H3Pipeline, PreparedAssets, RequestCancelled, VideoRequest
from vflash_core.pipeline.options import RunOptions

REQUEST = VideoRequest("A train crosses a snowy bridge, whistle echoing.", seed=4, width=96, height=64)


@pytest.fixture(scope="module")
def pipeline(h3_prepared):
    with H3Pipeline.from_prepared(h3_prepared) as p:
        yield p


def test_generate_writes_the_mp4_and_times_its_stages(pipeline, tmp_path):
    events = []
    loaded_before = pipeline.loaded
    start = time.perf_counter()
    result = pipeline.generate(REQUEST, tmp_path / "clip.mp4", progress=lambda *e: events.append(e))
    wall = time.perf_counter() - start
    info = probe_mp4(result.path)
    assert (info["frames"], info["fps"], info["width"], info["height"]) == (124, 24.0, 96, 64)
    assert (info["audio_codec"], info["sample_rate"], info["channels"]) == ("aac", 32000, 2)
    assert info["audio_seconds"] == pytest.approx(124 / 24, abs=2e-3)  # the soundtrack is cut to the video's length
    assert (result.mode, result.width, result.height, result.num_frames, result.fps, result.sample_rate) == ("t2va", 96, 64, 124, 24, 32000)
    assert result.metadata["audio_samples"] == round(124 / 24 * 32000) and result.metadata["seed"] == 4
    assert result.metadata["encoder_residency"] == "offload"

    stages = result.stages
    top = {k: v for k, v in stages.items() if "." not in k}
    assert set(top) == {"validate", "encode", "denoise", "decode", "write"}
    assert set(stages) - set(top) == {"encode.inputs", "encode.text", "encode.vae", "encode.bundle", "decode.video", "decode.audio"}
    assert sum(v for k, v in stages.items() if k.startswith("encode.")) <= stages["encode"]
    assert stages["decode.video"] + stages["decode.audio"] <= stages["decode"]
    assert sum(top.values()) <= result.elapsed_seconds
    # On the pipeline's first use, generate loads the models after its input checks; that is initialization, which
    # `elapsed_seconds` excludes.
    assert pipeline.initialization_seconds > 0
    assert result.elapsed_seconds <= wall - (0.0 if loaded_before else pipeline.initialization_seconds) + 1e-3
    assert result.timing.request_wall_seconds <= stages["denoise"]

    done = [(stage, done, total) for stage, done, total in events]
    # Each stage reports 0 as it starts, so a bar times the whole stage: one created at the end of the write drew
    # "write mp4 ... 9404 file/s" for a 3.5 s write.
    assert [e for e in done if e[0] != "load"] == [
        ("encode", 0, 1), ("encode", 1, 1), *[("denoise", i, 4) for i in range(5)], ("decode", 0, 2), ("decode", 1, 2),
        ("decode", 2, 2), ("write", 0, 1), ("write", 1, 1),
    ]
    assert loaded_before or next(e for e in done if e[0] == "load") == ("load", 0, 4)


def test_serial_requests_reuse_the_models_and_repeat_exactly(pipeline):
    pipeline.load()  # loaded by the test before, or here when this one runs alone
    initialization = pipeline.initialization_seconds
    first = pipeline.generate(REQUEST, None)
    second = pipeline.generate(REQUEST, None)
    other = pipeline.generate(VideoRequest(REQUEST.prompt, seed=5, width=96, height=64), None)
    assert first.path is None and first.media is not None
    assert pipeline.initialization_seconds == initialization
    assert second.timing.request_index == first.timing.request_index + 1
    assert second.timing.initialization_charged_seconds == 0.0
    assert_bitwise(second.media.frames, first.media.frames, "frames of a repeated request")
    assert_bitwise(second.media.waveform, first.media.waveform, "waveform of a repeated request")
    assert not torch.equal(other.media.frames, first.media.frames)


def test_generate_is_the_stage_api_end_to_end(pipeline):
    """encode -> denoise -> decode by hand gives exactly what `generate` decodes."""
    direct = pipeline.generate(REQUEST, None).media
    generation = pipeline.denoise(pipeline.encode(REQUEST))
    staged = pipeline.decode(generation.video_latents, generation.audio_latents)
    assert_bitwise(staged.frames, direct.frames, "frames")
    assert_bitwise(staged.waveform, direct.waveform, "waveform")
    assert staged.frames.shape == (124, 64, 96, 3) and staged.waveform.shape == (2, 207 * 800)


def test_pipeline_composes_from_separately_loaded_parts(pipeline, h3_prepared):
    assets = PreparedAssets.load(h3_prepared)
    parts = (
        TextConditioner.from_pretrained(assets.model_root),
        MediaVAEs.from_pretrained(assets.decoder_root),
        NativeEngineSession(assets.profile, assets.compiled_paths()),
    )
    with H3Pipeline(assets.profile, *parts) as composed:
        assert composed.loaded and composed.initialization_seconds == 0.0
        media = composed.generate(REQUEST, None).media
    assert_bitwise(media.frames, pipeline.generate(REQUEST, None).media.frames, "frames")
    with pytest.raises(VflashError, match="needs a conditioner, VAEs and a session"):
        H3Pipeline(assets.profile, None, None, None)


def test_overwrite_flag_replaces_an_existing_output(pipeline, tmp_path):
    target = tmp_path / "again.mp4"
    target.write_bytes(b"old")
    result = pipeline.generate(REQUEST, target, overwrite=True)
    assert probe_mp4(result.path)["frames"] == 124
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.mp4"]


def test_encode_failure_leaves_no_file_and_closes_the_pipeline(h3_prepared, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("AAC encoder crashed")

    fresh = H3Pipeline.from_prepared(h3_prepared)
    monkeypatch.setattr(av.AudioFrame, "from_ndarray", broken)
    with pytest.raises(RuntimeError, match="AAC encoder crashed"):
        fresh.generate(REQUEST, tmp_path / "never.mp4")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SessionClosedError, match="this pipeline is closed"):
        fresh.generate(REQUEST, tmp_path / "never.mp4")


class CallerStop(Exception):
    """What a caller's callback raises to abort its request."""


@pytest.mark.parametrize("callback", ["progress", "preview"])
def test_a_callback_that_raises_aborts_the_request_and_leaves_the_pipeline_usable(callback, pipeline, tmp_path):
    """What a progress or preview callback raised closed the whole pipeline: the next call got SessionClosedError."""

    def stop(*args: object) -> None:
        if callback == "preview" or args[0] == "denoise":
            raise CallerStop(f"{callback} stopped it")

    with pytest.raises(CallerStop, match=f"{callback} stopped it"):
        pipeline.generate(REQUEST, tmp_path / "stopped.mp4", **{callback: stop})
    assert list(tmp_path.iterdir()) == [] and pipeline.loaded
    result = pipeline.generate(REQUEST, tmp_path / "next.mp4")
    assert probe_mp4(result.path)["frames"] == 124


def test_cancel_between_evaluations_closes_the_pipeline(h3_prepared, tmp_path):
    polls = []

    def cancel() -> None:
        polls.append(1)
        if len(polls) == 4:  # after encoding, during the trajectory
            raise KeyboardInterrupt("user pressed stop")

    fresh = H3Pipeline.from_prepared(h3_prepared)
    with pytest.raises(RequestCancelled, match="request cancelled: user pressed stop"):
        fresh.generate(REQUEST, tmp_path / "stopped.mp4", cancel=cancel)
    assert list(tmp_path.iterdir()) == [] and fresh.session is None
    with pytest.raises(SessionClosedError):
        fresh.validate(REQUEST)


def test_generate_command_with_delivery_options_and_denoise_profile(h3_prepared, tmp_path, capsys):
    from vflash_core.cli.main import main

    out = tmp_path / "cli.mp4"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("A cat jumps onto a wooden table.\n", encoding="utf-8")
    args = ["generate", "--prepared-assets", str(h3_prepared), "--prompt-file", str(prompt), "--width", "96", "--height", "64", "--seed", "9",
            "--output", str(out), "--media-video-input", "pipe", "--media-video-threads", "2", "--profile-denoise", "--encoder-residency", "resident"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: 124 frames 96x64 at 24 fps, t2va" in printed and "request total" in printed
    assert '"denoise_profile": {' in printed
    assert probe_mp4(out)["frames"] == 124
    assert main(args) == 2 and "already exists" in capsys.readouterr().err


def test_encoder_residency_keeps_the_encoder_and_vaes_on_their_device(pipeline, h3_prepared, monkeypatch):
    pipeline.load()
    offloads = []
    for part in (pipeline.conditioner, pipeline.vaes):
        monkeypatch.setattr(part, "offload", lambda part=part: offloads.append(part))
    with pipeline.conditioner.on_device(), pipeline.vaes.on_device():
        pass
    assert offloads == [pipeline.vaes, pipeline.conditioner]  # default: each hands the device back after its stage
    monkeypatch.setattr(pipeline.conditioner, "keep_on_device", True)
    monkeypatch.setattr(pipeline.vaes, "keep_on_device", True)
    with pipeline.conditioner.on_device(), pipeline.vaes.on_device():
        pass
    assert len(offloads) == 2
    with pytest.raises(VflashError, match="encoder_residency must be one of offload, resident"):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(encoder_residency="always"))


def test_a_streamed_request_encodes_what_the_file_path_encodes(pipeline, h3_prepared, tmp_path, monkeypatch):
    """`media_video_input="stream"` (the default): the MP4 is encoded while the video decodes; the muxer gets the same
    frames as the file path gives it after the decode, and the stages and progress are the same."""
    seen: list[list[np.ndarray]] = []
    add_frame = mp4._Muxer.add_frame

    def recording(self, rgb):
        seen[-1].append(np.array(rgb))
        add_frame(self, rgb)

    monkeypatch.setattr(mp4._Muxer, "add_frame", recording)
    results, events = [], []
    for name, loaded in (("file", H3Pipeline.from_prepared(h3_prepared, RunOptions(media_video_input="file"))), ("stream", pipeline)):
        seen.append([])
        events.append([])
        results.append(loaded.generate(REQUEST, tmp_path / f"{name}.mp4", progress=lambda *e: events[-1].append(e)))
    file_result, stream_result = results
    assert len(seen[0]) == len(seen[1]) == 124 and all(np.array_equal(a, b) for a, b in zip(*seen))
    assert stream_result.path == tmp_path / "stream.mp4" and probe_mp4(stream_result.path)["frames"] == 124
    assert set(stream_result.stages) == set(file_result.stages)
    assert [e for e in events[1] if e[0] != "load"] == [e for e in events[0] if e[0] != "load"]
    assert stream_result.num_frames == 124 and stream_result.metadata["media_video_input"] == "stream"
    assert stream_result.metadata["audio_samples"] == file_result.metadata["audio_samples"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.mp4", "stream.mp4"]


def test_a_cancel_during_a_streamed_decode_publishes_nothing(h3_prepared, tmp_path, monkeypatch):
    fresh = H3Pipeline.from_prepared(h3_prepared)
    added = []
    add = mp4.MP4Stream.add

    def counting_add(self, start, frames):
        added.append(start)
        add(self, start, frames)

    def cancel() -> None:
        if added:  # the first part is in the encoder's queue: stop while the decode goes on
            raise KeyboardInterrupt("user pressed stop")

    monkeypatch.setattr(mp4.MP4Stream, "add", counting_add)
    with pytest.raises(RequestCancelled, match="user pressed stop"):
        fresh.generate(REQUEST, tmp_path / "stopped.mp4", cancel=cancel)
    assert added and list(tmp_path.iterdir()) == []
    assert not any(t.name == "vflash-mp4-stream" and t.is_alive() for t in threading.enumerate())


def test_loading_the_models_prints_no_third_party_noise(h3_family, capfd, caplog):
    """Every run printed torch's weight_norm FutureWarning (diffusers' audio VAE), transformers' unlabelled "Loading
    weights" bar and an INFO line that torchvision is not installed (a video reference is refused with that reason)."""
    import logging
    import subprocess
    import sys

    from vflash_core.media.conditioning import TextConditioner

    caplog.set_level(logging.INFO)
    TextConditioner.from_pretrained(h3_family, "cpu").close()
    assert "Loading weights" not in capfd.readouterr().err
    assert "torchvision" not in caplog.text
    # In a process of its own: pytest's settings ignore every FutureWarning.
    load_vaes = f"from vflash_core.media.vae import MediaVAEs; MediaVAEs.from_pretrained({str(h3_family)!r}, 'cpu')"
    done = subprocess.run([sys.executable, "-c", load_vaes], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "weight_norm" not in done.stderr, done.stderr
