"""`vflash compare` and `pipeline.compare`: the metrics, the command end to end on the embedded demo family, and the
MP4 encoder options (`RunOptions.media_video_crf` / `media_video_preset`) through the pipeline."""

from __future__ import annotations

import json
import math

import av
import numpy as np
import pytest
import torch
from mp4_probe import probe_mp4

from vflash_core.cli.main import main
from vflash_core.errors import VflashError
from vflash_core.pipeline.compare import frame_psnr, frame_ssim, log_spectral_distance, measure, side_by_side
from vflash_core.pipeline.h3_pipeline import H3Pipeline, VideoRequest
from vflash_core.pipeline.options import RunOptions

SMALL = {"duration_seconds": 5.0, "width": 32, "height": 32}  # the cheapest request the demo profile takes


def _clip(seed: int, frames: int = 3, height: int = 24, width: int = 40) -> torch.Tensor:
    return torch.rand(frames, height, width, 3, generator=torch.Generator().manual_seed(seed))


def _sound(seed: int, samples: int = 32000) -> torch.Tensor:
    return torch.rand(2, samples, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# -- the metrics -----------------------------------------------------------------------------------------------------


def test_identical_inputs_give_infinite_psnr_ssim_one_and_zero_distance():
    clip, sound = _clip(0), _sound(0)
    assert torch.isinf(frame_psnr(clip, clip.clone())).all()
    assert frame_ssim(clip, clip.clone()).tolist() == [1.0, 1.0, 1.0]
    assert log_spectral_distance(sound, sound.clone()) == 0.0
    metrics = measure(clip, clip.clone(), sound, sound.clone())
    assert metrics["video"]["psnr_db"] == {"clip": None, "min": None, "per_frame": [None, None, None]}  # inf -> null
    assert metrics["video"]["ssim"]["mean"] == 1.0 and metrics["audio"]["log_spectral_distance_db"] == 0.0
    json.dumps(metrics, allow_nan=False)  # strict JSON


def test_different_inputs_give_finite_values_that_track_the_difference():
    clip, sound = _clip(0), _sound(0)
    slightly = (clip + 2 / 255).clamp(0, 1)
    psnr_near, psnr_far = frame_psnr(clip, slightly), frame_psnr(clip, _clip(1))
    assert torch.isfinite(psnr_near).all() and torch.isfinite(psnr_far).all()
    assert (psnr_near > 40).all() and (psnr_far < 15).all() and (psnr_near > psnr_far).all()
    # PSNR of a known error: every 8-bit value off by exactly 1 -> 10 log10(255^2 / 1)
    ones = torch.full((1, 16, 16, 3), 100, dtype=torch.uint8)
    assert frame_psnr(ones, ones + 1).item() == pytest.approx(20 * math.log10(255))
    ssim_near, ssim_far = frame_ssim(clip, slightly), frame_ssim(clip, _clip(1))
    assert (ssim_near < 1).all() and (ssim_near > 0.9).all() and (ssim_far < 0.2).all()
    quiet = sound * 0.5  # -6.02 dB everywhere above the floor
    assert log_spectral_distance(sound, quiet) == pytest.approx(20 * math.log10(2), rel=1e-3)
    assert 0 < log_spectral_distance(sound, sound + 1e-3 * _sound(1)) < log_spectral_distance(sound, _sound(1))
    metrics = measure(clip, _clip(1), sound, _sound(1))
    assert metrics["video"]["psnr_db"]["clip"] == pytest.approx(
        10 * math.log10(255**2 / np.mean([255**2 / 10 ** (p / 10) for p in psnr_far.tolist()])), abs=1e-4
    )
    assert metrics["video"]["psnr_db"]["min"] == pytest.approx(psnr_far.min().item(), abs=1e-4)


def test_metrics_refuse_mismatched_inputs():
    with pytest.raises(VflashError, match="one shape"):
        frame_psnr(_clip(0), _clip(0, frames=2))
    with pytest.raises(VflashError, match="SSIM needs frames of at least 11x11"):
        frame_ssim(_clip(0, height=8), _clip(0, height=8))
    with pytest.raises(VflashError, match="soundtracks must be"):
        log_spectral_distance(_sound(0), _sound(0, samples=100))
    assert side_by_side(_clip(0), _clip(1)).shape == (3, 24, 80, 3)


# -- the command on the demo family -------------------------------------------------------------------------------


def _decoded(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_compare_command_writes_three_mp4s_and_a_report(demo_receipt, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = [
        "compare", "--prepared-assets", str(demo_receipt), "--prompt", "Rain on a tin roof.", "--seed", "3",
        "--width", "32", "--height", "32", "--fast-mode", "step-cache", "--step-cache-threshold", "10",
        "--media-video-crf", "30", "--media-video-preset", "ultrafast", "--output-dir", str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "exact vs step-cache: 124 frames" in printed and "PSNR clip / min" in printed and "SSIM mean / min" in printed
    assert f"report: {out / 'comparison.json'}" in printed and "never quality" in printed
    exact, fast, both = (probe_mp4(out / name) for name in ("exact.mp4", "fast.mp4", "side_by_side.mp4"))
    assert (exact["width"], exact["height"], exact["frames"]) == (fast["width"], fast["height"], fast["frames"]) == (32, 32, 124)
    assert (both["width"], both["height"], both["frames"]) == (64, 32, 124) and both["audio_codec"] == "aac"
    halves = _decoded(out / "side_by_side.mp4")
    assert halves.shape == (124, 32, 64, 3)

    report = json.loads((out / "comparison.json").read_text())
    video, audio = report["metrics"]["video"], report["metrics"]["audio"]
    assert report["fast_mode"] == "step-cache" and report["request"]["seed"] == 3
    assert report["exact"]["metadata"]["exact"] is True and report["fast"]["metadata"]["exact"] is False
    assert report["fast"]["metadata"]["fast_mode"]["step_cache"]["evaluations_cached"] == [2]
    assert "fast_mode" not in report["exact"]["metadata"]
    # the cached evaluation changes the clip: every metric finite and off its identical value
    assert len(video["psnr_db"]["per_frame"]) == len(video["ssim"]["per_frame"]) == 124
    assert all(math.isfinite(p) for p in video["psnr_db"]["per_frame"]) and video["psnr_db"]["clip"] > 0
    assert 0 < video["ssim"]["min"] <= video["ssim"]["mean"] < 1
    assert audio["log_spectral_distance_db"] > 0
    assert report["exact"]["denoise_seconds"] > 0 and report["fast"]["denoise_seconds"] > 0
    for side in ("exact", "fast"):  # the encoder options travel with the one RunOptions
        assert report[side]["metadata"]["media_video_crf"] == 30
        assert report[side]["metadata"]["media_video_preset"] == "ultrafast"
    assert b"crf=30.0" in (out / "side_by_side.mp4").read_bytes()

    # existing files are refused before anything renders; exact is refused in one line
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    exact_argv = [a for a in argv[:-2] if a not in ("--step-cache-threshold", "10")]
    assert main([*exact_argv, "--fast-mode", "exact", "--output-dir", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["vflash: error: vflash compare needs --fast-mode (e.g. sparse-attention or step-cache), not exact"]
    assert not (tmp_path / "other").exists()


def test_compare_refuses_an_exact_pipeline(demo_receipt, tmp_path):
    from vflash_core.pipeline.compare import compare

    with H3Pipeline.from_prepared(demo_receipt) as pipeline:
        with pytest.raises(VflashError, match="needs a pipeline loaded with a fast mode"):
            compare(pipeline, VideoRequest("x", **SMALL), tmp_path / "cmp")
        assert not pipeline.loaded and not (tmp_path / "cmp").exists()


# -- the encoder options through the pipeline -------------------------------------------------------------------------


def test_run_options_refuse_bad_encoder_settings_and_flags(demo_receipt, tmp_path, capsys):
    with pytest.raises(VflashError, match="video_crf must be an integer from 0 to 51, got 52"):
        RunOptions(media_video_crf=52)
    with pytest.raises(VflashError, match="video_preset must be one of ultrafast, .*, got 'quick'"):
        RunOptions(media_video_preset="quick")
    base = ["generate", "--prepared-assets", str(demo_receipt), "--prompt", "x", "--output", str(tmp_path / "o.mp4")]
    assert main([*base, "--media-video-crf", "-1"]) == 2
    assert "--media-video-crf must be an integer from 0 to 51, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--media-video-preset", "quick"])
    assert "invalid choice: 'quick'" in capsys.readouterr().err


def test_generate_prints_what_its_fast_mode_did(demo_receipt, tmp_path, capsys):
    argv = ["generate", "--prepared-assets", str(demo_receipt), "--prompt", "x", "--width", "32", "--height", "32",
            "--fast-mode", "step-cache", "--step-cache-threshold", "10", "--output", str(tmp_path / "o.mp4")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    layers = json.loads(demo_receipt.read_text())["transformer"]["num_layers"]  # a reusing evaluation runs one block
    expected = f"  approximate fast mode step-cache: reused 1 of 4 evaluations, {3 * layers + 1} of {4 * layers} block evaluations"
    assert [line for line in lines if "fast mode" in line] == [expected]


@pytest.mark.parametrize("video_input", ["stream", "file"])
def test_pipeline_encodes_with_the_crf_and_preset_of_its_options(demo_receipt, tmp_path, video_input):
    options = RunOptions(media_video_input=video_input, media_video_crf=35, media_video_preset="veryfast")
    with H3Pipeline.from_prepared(demo_receipt, options) as pipeline:
        result = pipeline.generate(VideoRequest("x", **SMALL), tmp_path / "o.mp4")
    data = (tmp_path / "o.mp4").read_bytes()
    assert b" crf=35.0 " in data and b" subme=2 " in data  # veryfast: subpixel refinement 2
    assert (result.metadata["media_video_crf"], result.metadata["media_video_preset"]) == (35, "veryfast")
