"""The MP4 encoder's options (`mp4`'s `video_input`, `video_threads`, `video_crf`, `video_preset`) and their check,
without torch or PyAV: the command line's parsers and the run options check them before anything heavy imports."""

from __future__ import annotations

from ..errors import Number, check_choice

__all__ = [
    "DEFAULT_CRF", "DEFAULT_PRESET", "H264_OPTIONS", "VIDEO_CRF", "VIDEO_INPUTS", "VIDEO_PRESETS", "VIDEO_THREADS",
    "check_delivery_options", "check_encoder_options",
]

VIDEO_INPUTS = ("file", "pipe", "stream")
#: The H.264 encoder's thread count, when given (None: FFmpeg's automatic choice).
VIDEO_THREADS = Number(int, 1, 256)
# x264 quality: visually lossless for generated content at moderate size (the defaults of `video_crf`, `video_preset`).
H264_OPTIONS = {"crf": "18", "preset": "medium"}
#: libx264's constant rate factor for 8-bit video: 0 (lossless) to 51.
VIDEO_CRF = Number(int, 0, 51)
#: libx264's presets, fastest first.
VIDEO_PRESETS = (
    "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow", "placebo"
)
DEFAULT_CRF, DEFAULT_PRESET = int(H264_OPTIONS["crf"]), H264_OPTIONS["preset"]


def check_delivery_options(
    video_input: str, video_threads: int | None, video_crf: int = DEFAULT_CRF, video_preset: str = DEFAULT_PRESET
) -> None:
    """Validate the encoder options before any heavy work; raises `VflashError` naming the value."""
    check_choice("video_input", video_input, VIDEO_INPUTS)
    check_encoder_options(video_threads, video_crf, video_preset)


def check_encoder_options(video_threads: int | None, video_crf: int, video_preset: str) -> None:
    if video_threads is not None:
        VIDEO_THREADS.check("video_threads", video_threads)
    VIDEO_CRF.check("video_crf", video_crf)
    check_choice("video_preset", video_preset, VIDEO_PRESETS)
