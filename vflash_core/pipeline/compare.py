"""Exact against a named fast mode on one request: what the mode costs in quality, measured.

`compare(pipeline, request, output_dir)` renders `request` twice on ONE `H3Pipeline` loaded with a fast mode
(`RunOptions.fast_mode`), so the model loads once: with the mode, then exactly (`generate(..., exact=True)`: the bits of
a pipeline without the mode); the same request and seed, so the same conditioning and noise. It writes into
`output_dir`:

* `exact.mp4` and `fast.mp4`: each side with its own soundtrack;
* `side_by_side.mp4`: the exact frames on the left, the fast ones on the right (twice the width), with the exact side's
  soundtrack (one soundtrack has to be chosen; the exact one is the reference both are judged against, and the fast
  side's is in `fast.mp4`);
* `comparison.json`: the metrics, each side's times and result metadata (the fast side's says what the mode did:
  density reached, evaluations cached ...).

The MP4s are encoded with the pipeline's encoder options (`media_video_crf`, `media_video_preset`,
`media_video_threads`), from the decoded frames already in memory.

Metrics are computed on the decoded media before the lossy H.264 / AAC encode, exactly what each encoder is given, so
they measure the fast mode and never the codec:

* video, per frame, on the 8-bit RGB frames the MP4 encoder gets (`mp4.quantize`): PSNR in dB over the three channels
  with peak 255 (the clip's PSNR is that of the mean squared error over all its frames; identical frames have an
  infinite PSNR, written as null in the JSON), and SSIM (Wang et al. 2004: an 11x11 Gaussian window of sigma 1.5,
  K1 = 0.01, K2 = 0.03, L = 255, over the valid window positions, no padding) on the BT.601 luma
  Y = 0.299 R + 0.587 G + 0.114 B of those frames; 1.0 for identical frames;
* audio, on the delivered soundtracks (cut to the video's length, what the AAC encoder gets): the log-spectral
  distance in dB: per channel a Hann-windowed STFT of 2048 samples (64 ms at 32 kHz) with a hop of 512, the power
  spectra floored at 1e-10 (-100 dB), for each STFT frame the root mean square over frequency of the difference of
  the two 10 log10 power spectra, averaged over the STFT frames and the channels; 0 for identical waveforms.

Only this comparison, on the real weights, speaks to a fast mode's quality: random weights (the embedded demo) make
noise either way and prove speed, never quality. Each side is timed once; the fast side runs first and carries any
first-request warm-up (kernels compiled or tuned on first use, caches filled), so the speed-up reported is never
flattered by it (for speed alone, `benchmarks/fast_mode.py` repeats and warms up).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..engine.layout import FPS
from ..errors import VflashError
from ..fileio import atomic_file, check_writable_destination, path_argument
from ..media.mp4 import mp4_stream, quantize
from ..progress import StageProgress
from .h3_pipeline import H3Pipeline, VideoResult
from .steps import delivered_soundtrack
from .validation import VideoRequest, check_output_is_not_an_input

__all__ = [
    "OUTPUT_NAMES", "REPORT_FORMAT", "ComparisonResult", "compare", "comparison_report", "frame_psnr", "frame_ssim",
    "log_spectral_distance", "measure", "side_by_side", "summary_lines",
]

REPORT_FORMAT = "vflash-comparison-1"
OUTPUT_NAMES = {"exact": "exact.mp4", "fast": "fast.mp4", "side_by_side": "side_by_side.mp4",
                "report": "comparison.json"}
# Frames measured and encoded at a time: bounds the float copies of two 1344x768 clips to a few hundred MB.
_CHUNK_FRAMES = 16
_SSIM_WINDOW, _SSIM_SIGMA, _SSIM_K1, _SSIM_K2 = 11, 1.5, 0.01, 0.03
_LUMA = (0.299, 0.587, 0.114)  # BT.601
_STFT_SIZE, _STFT_HOP, _POWER_FLOOR = 2048, 512, 1e-10
NOTE = ("only a comparison on the real weights speaks to quality; random weights (the embedded demo) prove speed, "
        "never quality")


@dataclass
class ComparisonResult:
    """The files `compare` wrote, its report (`comparison.json`'s content) and both sides' results (no media)."""

    exact_path: Path
    fast_path: Path
    side_by_side_path: Path
    report_path: Path
    report: dict[str, Any]
    exact: VideoResult
    fast: VideoResult


# -- metrics ---------------------------------------------------------------------------------------------------------


def _rgb8(frames: torch.Tensor) -> torch.Tensor:
    """(F, H, W, 3) float in [0, 1] or uint8 -> uint8, as the MP4 encoder gets them."""
    return quantize(frames.detach().cpu())


def _check_pair(exact: torch.Tensor, fast: torch.Tensor) -> None:
    if exact.ndim != 4 or exact.shape[-1] != 3 or exact.shape != fast.shape:
        raise VflashError(
            f"compared clips must both be (F, H, W, 3) RGB of one shape, got {list(exact.shape)} and {list(fast.shape)}"
        )


def frame_psnr(exact: torch.Tensor, fast: torch.Tensor) -> torch.Tensor:
    """(F,) float64 PSNR in dB of each frame pair's 8-bit RGB (peak 255); inf where a pair is identical."""
    _check_pair(exact, fast)
    mse = _frame_mse(_rgb8(exact), _rgb8(fast))
    return 10.0 * torch.log10(255.0**2 / mse)  # a zero error gives inf


def _frame_mse(exact8: torch.Tensor, fast8: torch.Tensor) -> torch.Tensor:
    diff = exact8.to(torch.float64) - fast8.to(torch.float64)
    return diff.square().flatten(1).mean(1)


def _gaussian_window() -> torch.Tensor:
    offsets = torch.arange(_SSIM_WINDOW, dtype=torch.float64) - (_SSIM_WINDOW - 1) / 2
    weights = torch.exp(-(offsets**2) / (2 * _SSIM_SIGMA**2))
    return weights / weights.sum()


def _luma(frames8: torch.Tensor) -> torch.Tensor:
    """(F, H, W, 3) uint8 -> (F, 1, H, W) float64 BT.601 luma in 0..255."""
    weights = torch.tensor(_LUMA, dtype=torch.float64)
    return (frames8.to(torch.float64) @ weights)[:, None]


def _blur(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian filter over the valid positions of (F, 1, H, W)."""
    x = F.conv2d(x, window.view(1, 1, -1, 1))
    return F.conv2d(x, window.view(1, 1, 1, -1))


def frame_ssim(exact: torch.Tensor, fast: torch.Tensor) -> torch.Tensor:
    """(F,) float64 SSIM of each frame pair's luma (the module docstring says which SSIM); 1.0 where identical.
    Frames must be at least 11 pixels on each side."""
    _check_pair(exact, fast)
    if min(exact.shape[1:3]) < _SSIM_WINDOW:
        raise VflashError(f"SSIM needs frames of at least {_SSIM_WINDOW}x{_SSIM_WINDOW}, got {list(exact.shape[1:3])}")
    x, y = _luma(_rgb8(exact)), _luma(_rgb8(fast))
    window = _gaussian_window()
    c1, c2 = (_SSIM_K1 * 255.0) ** 2, (_SSIM_K2 * 255.0) ** 2
    mu_x, mu_y = _blur(x, window), _blur(y, window)
    var_x = _blur(x * x, window) - mu_x**2
    var_y = _blur(y * y, window) - mu_y**2
    cov = _blur(x * y, window) - mu_x * mu_y
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return ssim_map.flatten(1).mean(1)


def _log_power(waveform: torch.Tensor) -> torch.Tensor:
    """(channels, samples) -> (channels, bins, STFT frames) 10 log10 power, floored."""
    spectrum = torch.stft(
        waveform.to(torch.float64), _STFT_SIZE, _STFT_HOP, window=torch.hann_window(_STFT_SIZE, dtype=torch.float64),
        center=True, pad_mode="constant", return_complex=True,
    )
    return 10.0 * torch.log10(spectrum.abs().square().clamp_min(_POWER_FLOOR))


def log_spectral_distance(exact: torch.Tensor, fast: torch.Tensor) -> float:
    """The log-spectral distance in dB of two (channels, samples) waveforms of one shape (the module docstring says
    how); 0.0 for identical waveforms."""
    if exact.ndim != 2 or exact.shape != fast.shape or exact.shape[1] < 1:
        raise VflashError(
            f"compared soundtracks must be (channels, samples) of one shape, got {list(exact.shape)} and "
            f"{list(fast.shape)}"
        )
    difference = _log_power(exact.detach().cpu()) - _log_power(fast.detach().cpu())
    return float(difference.square().mean(1).sqrt().mean())


def side_by_side(exact: torch.Tensor, fast: torch.Tensor) -> torch.Tensor:
    """(F, H, 2W, 3): the exact frames on the left, the fast ones on the right."""
    _check_pair(exact, fast)
    return torch.cat([exact, fast], dim=2)


def _db(value: float) -> float | None:
    """A PSNR for JSON: None where it is infinite (identical frames)."""
    return None if math.isinf(value) else round(value, 4)


def measure(
    exact_frames: torch.Tensor, fast_frames: torch.Tensor, exact_audio: torch.Tensor, fast_audio: torch.Tensor,
) -> dict[str, Any]:
    """The metrics section of a report: per-frame PSNR and SSIM of two clips ((F, H, W, 3) float in [0, 1] or uint8),
    with the clip's PSNR, the worst frame's and the mean SSIM, and the log-spectral distance of two soundtracks
    ((channels, samples)); measured a chunk of frames at a time."""
    _check_pair(exact_frames, fast_frames)
    psnr, ssim, squared = [], [], 0.0
    for start in range(0, exact_frames.shape[0], _CHUNK_FRAMES):
        exact8 = _rgb8(exact_frames[start : start + _CHUNK_FRAMES])
        fast8 = _rgb8(fast_frames[start : start + _CHUNK_FRAMES])
        psnr.append(frame_psnr(exact8, fast8))
        ssim.append(frame_ssim(exact8, fast8))
        squared += float(_frame_mse(exact8, fast8).sum())
    frame_psnrs, frame_ssims = torch.cat(psnr), torch.cat(ssim)
    clip_psnr = 10.0 * math.log10(255.0**2 / (squared / len(frame_psnrs))) if squared else math.inf
    return {
        "video": {
            "frames": len(frame_psnrs),
            "psnr_db": {
                "clip": _db(clip_psnr), "min": _db(float(frame_psnrs.min())),
                "per_frame": [_db(float(v)) for v in frame_psnrs],
            },
            "ssim": {
                "mean": round(float(frame_ssims.mean()), 6), "min": round(float(frame_ssims.min()), 6),
                "per_frame": [round(float(v), 6) for v in frame_ssims],
            },
            "measured_on": "the 8-bit RGB frames given to the H.264 encoder; PSNR over RGB (peak 255), SSIM on "
                           "BT.601 luma (11x11 Gaussian window, sigma 1.5); null PSNR: identical (infinite)",
        },
        "audio": {
            "log_spectral_distance_db": round(log_spectral_distance(exact_audio, fast_audio), 6),
            "measured_on": "the soundtracks given to the AAC encoder; per channel, Hann STFT 2048 / hop 512, "
                           "power floored at -100 dB, RMS over frequency of the dB difference, mean over frames",
        },
    }


# -- the report ------------------------------------------------------------------------------------------------------


def _json_ready(value: object) -> object:
    """Result metadata as JSON types (a dataclass becomes a dict, a path a string)."""

    def default(obj: object) -> object:
        if is_dataclass(obj) and not isinstance(obj, type):
            return asdict(obj)
        if isinstance(obj, Path):
            return str(obj)
        raise TypeError(f"the comparison holds a {type(obj).__name__}, which is not JSON-serialisable")

    return json.loads(json.dumps(value, default=default))


def comparison_report(
    fast_mode: str, metrics: dict[str, Any], sides: dict[str, dict[str, Any]], request: dict[str, Any]
) -> dict[str, Any]:
    """`comparison.json`'s content: the mode, the request, the metrics and each side ("exact", "fast": its
    `seconds`, `denoise_seconds`, metadata and file), with the denoise speed-up of the fast side."""
    exact, fast = sides["exact"]["denoise_seconds"], sides["fast"]["denoise_seconds"]
    return {
        "format": REPORT_FORMAT,
        "fast_mode": fast_mode,
        "request": request,
        "metrics": metrics,
        "exact": _json_ready(sides["exact"]),
        "fast": _json_ready(sides["fast"]),
        "denoise_speedup": round(exact / fast, 4) if fast > 0 else None,
        "side_by_side": "exact left, fast right; the exact side's soundtrack",
        "note": NOTE,
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A short table of a report for a terminal or a node's text output."""
    video, audio = report["metrics"]["video"], report["metrics"]["audio"]

    def db(value: float | None) -> str:
        return "inf (identical)" if value is None else f"{value:.2f} dB"

    exact, fast = report["exact"], report["fast"]
    speedup = report["denoise_speedup"]
    return [
        f"exact vs {report['fast_mode']}: {video['frames']} frames",
        f"  {'PSNR clip / min':<24} {db(video['psnr_db']['clip'])} / {db(video['psnr_db']['min'])}",
        f"  {'SSIM mean / min':<24} {video['ssim']['mean']:.4f} / {video['ssim']['min']:.4f}",
        f"  {'audio log-spectral dist':<24} {audio['log_spectral_distance_db']:.3f} dB",
        f"  {'':<24} {'exact':>10} {'fast':>10}",
        f"  {'request seconds':<24} {exact['seconds']:>10.2f} {fast['seconds']:>10.2f}",
        f"  {'denoise seconds':<24} {exact['denoise_seconds']:>10.2f} {fast['denoise_seconds']:>10.2f}"
        + ("" if speedup is None else f"  ({speedup:.2f}x)"),
        f"note: {NOTE}",
    ]


# -- the comparison --------------------------------------------------------------------------------------------------


def _write_clip(path: Path, parts, width: int, height: int, soundtrack: torch.Tensor, sample_rate: int,
                pipeline: H3Pipeline, overwrite: bool) -> None:
    """An MP4 from `parts` ((start, frames) in order) with the pipeline's encoder options."""
    options = pipeline.options
    with mp4_stream(
        path, width, height, sample_rate, FPS, video_threads=options.media_video_threads, overwrite=overwrite,
        video_crf=options.media_video_crf, video_preset=options.media_video_preset,
    ) as stream:
        for start, frames in parts:
            stream.add(start, frames)
        stream.finish(soundtrack)


def _chunks(*clips: torch.Tensor):
    for start in range(0, clips[0].shape[0], _CHUNK_FRAMES):
        yield start, [clip[start : start + _CHUNK_FRAMES] for clip in clips]


def _render(
    pipeline: H3Pipeline, request: VideoRequest, progress: StageProgress | None, exact: bool
) -> tuple[VideoResult, tuple[torch.Tensor, torch.Tensor]]:
    """One side: its result (without media), its 8-bit frames (a quarter of the float frames' bytes, while the other
    side runs) and its delivered soundtrack."""
    result = pipeline.generate(request, None, progress=progress, exact=exact)
    assert result.media is not None and result.media.frames is not None  # no output file: the media stay
    media, result.media = result.media, None
    assert media.frames is not None
    return result, (_rgb8(media.frames), delivered_soundtrack(media))


def _side(result: VideoResult, path: Path) -> dict[str, Any]:
    return {
        "file": path.name, "seconds": result.elapsed_seconds, "denoise_seconds": result.stages["denoise"],
        "stages": result.stages, "metadata": result.metadata,
    }


def compare(
    pipeline: H3Pipeline, request: VideoRequest, output_dir: str | Path, overwrite: bool = False,
    progress: StageProgress | None = None,
) -> ComparisonResult:
    """Render `request` with the pipeline's fast mode and exactly, measure the difference and write the four files of
    the module docstring into `output_dir` (created if missing; existing files are refused unless `overwrite`).
    Everything that can be checked is checked before anything renders."""
    mode = pipeline.options.fast_mode
    if mode.exact:
        raise VflashError(
            "a comparison needs a pipeline loaded with a fast mode (RunOptions(fast_mode=...), --fast-mode): "
            "exact against exact measures nothing"
        )
    folder = path_argument(output_dir, "the output folder")
    pipeline.validate(request)
    inputs: dict[str, object] = {f"{anchor} frame": item for anchor, item in request.keyframes.items()}
    inputs.update({f"reference {index + 1}": item for index, item in enumerate(request.references)})
    if folder.exists() and not folder.is_dir():
        raise VflashError(f"output folder {folder} is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    paths = {key: folder / name for key, name in OUTPUT_NAMES.items()}
    for path in paths.values():
        check_writable_destination(path, overwrite)
        check_output_is_not_an_input(path, inputs)

    fast, (fast_frames, fast_audio) = _render(pipeline, request, progress, exact=False)
    exact, (exact_frames, exact_audio) = _render(pipeline, request, progress, exact=True)
    sample_rate = exact.sample_rate

    metrics = measure(exact_frames, fast_frames, exact_audio, fast_audio)
    width, height = exact.width, exact.height
    _write_clip(paths["exact"], ((s, c[0]) for s, c in _chunks(exact_frames)), width, height, exact_audio,
                sample_rate, pipeline, overwrite)
    _write_clip(paths["fast"], ((s, c[0]) for s, c in _chunks(fast_frames)), width, height, fast_audio,
                sample_rate, pipeline, overwrite)
    _write_clip(paths["side_by_side"], ((s, side_by_side(*c)) for s, c in _chunks(exact_frames, fast_frames)),
                2 * width, height, exact_audio, sample_rate, pipeline, overwrite)
    request_record = {
        "prompt": request.prompt, "seed": request.seed, "mode": exact.mode, "width": width, "height": height,
        "num_frames": exact.num_frames, "fps": exact.fps, "profile": pipeline.profile.id,
    }
    report = comparison_report(
        mode.name, metrics, {"exact": _side(exact, paths["exact"]), "fast": _side(fast, paths["fast"])},
        request_record,
    )
    with atomic_file(paths["report"], overwrite=overwrite, suffix=".json") as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return ComparisonResult(
        paths["exact"], paths["fast"], paths["side_by_side"], paths["report"], report, exact, fast
    )
