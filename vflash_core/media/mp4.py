"""MP4 delivery through PyAV: H.264 (yuv420p) video and AAC audio, published atomically and never overwriting.

Frames are quantised to 8-bit RGB once (`round(x * 255)`, as diffusers' postprocessing does), converted to yuv420p by
FFmpeg's swscale (single-threaded, so the output is reproducible) and encoded with libx264; the waveform is encoded with FFmpeg's native AAC encoder. Every
video frame carries an exact presentation time `i / fps`, so the container holds exactly the frames given.

Two ways to feed the encoder the same 8-bit frames:

* `video_input="file"` (default): the quantised RGB clip is first written to a temporary raw file next to the output
  and encoded from there (one bounded pass over the frames, then the encoder reads a plain file), with plain I/O both
  ways: a full disk is an error (`fileio.WriteFailedError`), never a SIGBUS;
* `video_input="pipe"`: each frame is quantised and handed to the encoder directly, without the temporary file.

`video_threads` sets the H.264 encoder's thread count (1-256); `None` leaves FFmpeg's automatic choice. Thread counts
can change the lossy bitstream, never the frame count or timing. (libx264's bitstream for identical input was seen to
differ occasionally between runs in one process, so byte identity of two MP4s is not promised.)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from ..errors import Number, VflashError, check_choice
from ..fileio import atomic_file, temporary, write_errors

__all__ = [
    "VIDEO_INPUTS", "VIDEO_THREADS", "check_delivery_options", "probe_mp4", "quantize_frames", "rgb_frames",
    "write_mp4",
]

logger = logging.getLogger(__name__)

VIDEO_INPUTS = ("file", "pipe")
#: The H.264 encoder's thread count, when given (None: FFmpeg's automatic choice).
VIDEO_THREADS = Number(int, 1, 256)
# x264 quality: visually lossless for generated content at moderate size.
H264_OPTIONS = {"crf": "18", "preset": "medium"}
AAC_BITRATE = 192_000
# Sample rates the AAC encoder accepts.
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
_AAC_FRAME = 1024


def check_delivery_options(video_input: str, video_threads: int | None) -> None:
    """Validate the encoder options before any heavy work; raises `VflashError` naming the value."""
    check_choice("video_input", video_input, VIDEO_INPUTS)
    if video_threads is not None:
        VIDEO_THREADS.check("video_threads", video_threads)


def quantize_frames(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    """(F, H, W, 3) float in [0, 1] or uint8 -> contiguous uint8 RGB: `round(clip(x, 0, 1) * 255)` in float32.

    Computed with torch's multi-threaded CPU ops (the same float32 multiply and round-half-to-even as numpy, so the
    same bytes); one thread of numpy took ~2 s for a 5 s 1344x768 clip.
    """
    tensor = frames.detach().cpu() if isinstance(frames, torch.Tensor) else torch.from_numpy(np.asarray(frames))
    if tensor.dtype == torch.uint8:
        return np.ascontiguousarray(tensor.numpy())
    return tensor.to(torch.float32).clamp(0.0, 1.0).mul_(255.0).round_().to(torch.uint8).contiguous().numpy()


def _check_inputs(frames, waveform, sample_rate: int, fps: int) -> tuple[tuple[int, ...], np.ndarray]:
    shape = tuple(frames.shape)
    if len(shape) != 4 or shape[3] != 3 or shape[0] < 1:
        raise VflashError(f"frames must be (F, H, W, 3) RGB with F >= 1, got {list(shape)}")
    if shape[1] % 2 or shape[2] % 2:
        raise VflashError(f"H.264 yuv420p needs an even frame size, got {shape[2]}x{shape[1]}")
    if not isinstance(fps, int) or fps <= 0:
        raise VflashError(f"fps must be a positive integer, got {fps!r}")
    audio = waveform.detach().cpu().float().numpy() if isinstance(waveform, torch.Tensor) else np.asarray(waveform, dtype=np.float32)
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or audio.shape[1] < 1:
        raise VflashError(f"waveform must be (channels, samples) with 1 or 2 channels, got {list(audio.shape)}")
    if sample_rate not in AAC_SAMPLE_RATES:
        raise VflashError(f"AAC cannot encode {sample_rate} Hz audio; supported rates: {', '.join(map(str, AAC_SAMPLE_RATES))}")
    return shape, np.ascontiguousarray(np.clip(audio, -1.0, 1.0))


class _RawFrames:
    """The frames of a raw uint8 RGB file, each read on demand with plain I/O (a memory map of a file on a disk that
    fills, or that someone truncates, turns a read or a write into SIGBUS instead of an error)."""

    def __init__(self, fd: int, shape: tuple[int, ...]):
        self.fd, self.shape = fd, shape
        self.frame_bytes = shape[1] * shape[2] * shape[3]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        data = os.pread(self.fd, self.frame_bytes, i * self.frame_bytes)
        if len(data) != self.frame_bytes:
            raise VflashError(f"the raw frames file ended at frame {i} of {self.shape[0]}; it was changed while the clip was encoded")
        return np.frombuffer(data, dtype=np.uint8).reshape(self.shape[1:])


@contextlib.contextmanager
def rgb_frames(frames, shape: tuple[int, ...], video_input: str, destination: Path) -> Iterator:
    """Yields an indexable of uint8 (H, W, 3) frames: a raw temporary file beside `destination`, named for it and this
    writer (`fileio.temporary`, so a killed run's is removed by the next) ("file"), or per-frame quantisation ("pipe")."""
    if video_input == "pipe":

        class _Frames:
            def __len__(self) -> int:
                return shape[0]

            def __getitem__(self, i: int) -> np.ndarray:
                return quantize_frames(frames[i : i + 1])[0]

        yield _Frames()
        return
    path = temporary(destination, ".rgb")
    try:
        with write_errors(destination), open(path, "r+b") as raw:  # the free space is measured before it is removed
            # frame by frame, so one frame's bytes are in memory at a time; a full disk is ENOSPC here, never SIGBUS
            raw.writelines(quantize_frames(frames[i : i + 1])[0].data for i in range(shape[0]))
            raw.flush()
            yield _RawFrames(raw.fileno(), shape)
    finally:
        path.unlink(missing_ok=True)


def _encode(
    target: Path, rgb, shape: tuple[int, ...], audio: np.ndarray, sample_rate: int, fps: int, video_threads: int | None,
    metadata: Mapping[str, str],
) -> None:
    import av

    frames_count, height, width, _ = shape
    layout = "stereo" if audio.shape[0] == 2 else "mono"
    # MP4 keeps only the tags FFmpeg knows unless it writes them as free-form (mdta) keys.
    movflags = "+faststart+use_metadata_tags" if metadata else "+faststart"
    with av.open(str(target), mode="w", format="mp4", options={"movflags": movflags}) as container:
        container.metadata.update(metadata)
        video = container.add_stream("libx264", rate=fps, options=dict(H264_OPTIONS))
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.time_base = Fraction(1, fps)
        video.codec_context.thread_count = 0 if video_threads is None else video_threads
        sound = container.add_stream("aac", rate=sample_rate)
        sound.layout = layout
        sound.bit_rate = AAC_BITRATE
        for i in range(frames_count):
            # Converted here, on one thread, so the yuv420p planes never depend on swscale's slice threading (the
            # encoder would otherwise convert an RGB frame with its own thread count).
            frame = av.VideoFrame.from_ndarray(rgb[i], format="rgb24").reformat(format="yuv420p", threads=1)
            frame.pts = i
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        for start in range(0, audio.shape[1], _AAC_FRAME):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio[:, start : start + _AAC_FRAME]), format="fltp", layout=layout)
            chunk.sample_rate, chunk.pts = sample_rate, start
            container.mux(sound.encode(chunk))
        container.mux(sound.encode(None))


def write_mp4(
    path: str | Path,
    frames: torch.Tensor | np.ndarray,
    waveform: torch.Tensor | np.ndarray,
    sample_rate: int,
    fps: int = 24,
    video_input: str = "file",
    video_threads: int | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Encode `frames` (F, H, W, 3; float32 in [0, 1] or uint8) and `waveform` (channels, samples; float32 in [-1, 1])
    into an MP4 at `path`, written under a temporary name in the same folder and published atomically.

    An existing `path` is an error unless `overwrite`; on any failure nothing appears at `path`. `metadata`: container
    tags, kept under their own names.
    """
    check_delivery_options(video_input, video_threads)
    shape, audio = _check_inputs(frames, waveform, sample_rate, fps)
    path = Path(path)
    with atomic_file(path, overwrite=overwrite, suffix=".mp4") as tmp, rgb_frames(frames, shape, video_input, path) as rgb:
        _encode(tmp, rgb, shape, audio, sample_rate, fps, video_threads, metadata or {})
    logger.debug("wrote %s: %d frames %dx%d at %d fps, %.3f s of %d Hz audio", path, shape[0], shape[2], shape[1], fps, audio.shape[1] / sample_rate, sample_rate)
    return path


def probe_mp4(path: str | Path) -> dict[str, object]:
    """What a player sees: decoded video frame count, rate and size; audio codec, duration, rate and channels."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video or not container.streams.audio:
            raise VflashError(f"{path}: expected one video and one audio stream")
        video, audio = container.streams.video[0], container.streams.audio[0]
        info = {
            "fps": float(video.average_rate),
            "width": video.codec_context.width,
            "height": video.codec_context.height,
            "video_codec": video.codec_context.name,
            "audio_codec": audio.codec_context.name,
            # The stream duration honours the edit list that hides the AAC encoder's priming and padding samples.
            "audio_seconds": float(audio.duration * audio.time_base),
            "sample_rate": audio.codec_context.sample_rate,
            "channels": audio.codec_context.channels,
        }
        info["frames"] = sum(1 for _ in container.decode(video=0))
    return info
