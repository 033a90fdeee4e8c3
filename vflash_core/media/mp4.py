"""MP4 delivery through PyAV: H.264 (yuv420p) video and AAC audio, published atomically and never overwriting.

Frames are quantised to 8-bit RGB once (`round(x * 255)`, as diffusers' postprocessing does), converted to yuv420p by
FFmpeg's swscale (single-threaded, so the output is reproducible) and encoded with libx264; the waveform is encoded with
FFmpeg's native AAC encoder. Every video frame carries an exact presentation time `i / fps`, so the container holds
exactly the frames given.

Three ways to feed the encoder the same 8-bit frames:

* `video_input="file"` (`write_mp4`'s default): the quantised RGB clip is first written to a temporary raw file next to
  the output and encoded from there (one bounded pass over the frames, then the encoder reads a plain file), with plain
  I/O both ways: a full disk is an error (`fileio.WriteFailedError`), never a SIGBUS;
* `video_input="pipe"`: each frame is quantised and handed to the encoder directly, without the temporary file;
* `video_input="stream"` (`mp4_stream`; the pipeline's default): the frames arrive part by part while they are still
  being decoded, are quantised where they were decoded (the same float32 multiply and rounding, so the same bytes), and
  are converted and encoded on the stream's own thread, so the encoder works while the decoder does; at most
  `STREAM_QUEUE_PARTS` parts wait for it. The muxer sees the same calls with the same frames in the same order as for a
  whole clip (every video frame, the flush, then the audio): the encoder gets exactly what `write_mp4` gives it.

`video_threads` sets the H.264 encoder's thread count (1-256); `None` leaves FFmpeg's automatic choice. Thread counts
can change the lossy bitstream, never the frame count or timing. `video_crf` (0-51: lower is better quality and a
larger file, 0 is lossless) and `video_preset` (one of x264's `VIDEO_PRESETS`: slower compresses better at the same
quality) are libx264's quality and speed settings; their defaults are `H264_OPTIONS`'. The options and their check
live in `mp4_options`, which imports neither torch nor PyAV. (libx264's bitstream for identical input, even on one
thread, was seen to differ between processes and between calls in one process for some clips, so byte identity of two
MP4s is not promised; their encoder inputs are.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from ..engine.device_owner import HostCopy, copy_to_host
from ..errors import VflashError
from ..fileio import atomic_file, temporary, write_errors
from ..formats import is_positive
from .mp4_options import DEFAULT_CRF, DEFAULT_PRESET, H264_OPTIONS, check_delivery_options, check_encoder_options

__all__ = [
    "STREAM_QUEUE_PARTS", "MP4Stream", "mp4_stream", "quantize", "quantize_frames", "rgb_frames",
    "write_mp4",
]

logger = logging.getLogger(__name__)

# Decoded parts (a native decode's window, or a whole clip) an `MP4Stream` holds for its encoder before `add` waits.
STREAM_QUEUE_PARTS = 2
AAC_BITRATE = 192_000
# Sample rates the AAC encoder accepts.
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
_AAC_FRAME = 1024


def quantize(frames: torch.Tensor) -> torch.Tensor:
    """Float frames in [0, 1] (or uint8) -> uint8, on their own device: `round(clip(x, 0, 1) * 255)` in float32.

    One float32 multiply (correctly rounded) and round-half-to-even: the same bytes on the CPU and on a GPU, and the
    same as numpy's, which is why a stream may quantise where the frames were decoded and copy a quarter of the bytes.
    """
    if frames.dtype == torch.uint8:
        return frames
    return frames.to(torch.float32).clamp(0.0, 1.0).mul_(255.0).round_().to(torch.uint8)


def quantize_frames(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    """(F, H, W, 3) float in [0, 1] or uint8 -> contiguous uint8 RGB on the host (`quantize`).

    Computed with torch's multi-threaded CPU ops; one thread of numpy took ~2 s for a 5 s 1344x768 clip.
    """
    tensor = frames.detach().cpu() if isinstance(frames, torch.Tensor) else torch.from_numpy(np.asarray(frames))
    return np.ascontiguousarray(quantize(tensor).numpy())


def _check_frame_size(width: int, height: int, fps: int) -> None:
    if width % 2 or height % 2:
        raise VflashError(f"H.264 yuv420p needs an even frame size, got {width}x{height}")
    if not is_positive(fps):
        raise VflashError(f"fps must be a positive integer, got {fps!r}")


def _check_soundtrack(waveform: torch.Tensor | np.ndarray, sample_rate: int) -> np.ndarray:
    """(channels, samples) float -> contiguous float32 clipped to [-1, 1]; raises `VflashError` naming the fault."""
    if isinstance(waveform, torch.Tensor):
        audio = waveform.detach().cpu().float().numpy()
    else:
        audio = np.asarray(waveform, dtype=np.float32)
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or audio.shape[1] < 1:
        raise VflashError(f"waveform must be (channels, samples) with 1 or 2 channels, got {list(audio.shape)}")
    if sample_rate not in AAC_SAMPLE_RATES:
        raise VflashError(
            f"AAC cannot encode {sample_rate} Hz audio; supported rates: {', '.join(map(str, AAC_SAMPLE_RATES))}"
        )
    return np.ascontiguousarray(np.clip(audio, -1.0, 1.0))


def _check_inputs(frames, waveform, sample_rate: int, fps: int) -> tuple[tuple[int, ...], np.ndarray]:
    shape = tuple(frames.shape)
    if len(shape) != 4 or shape[3] != 3 or shape[0] < 1:
        raise VflashError(f"frames must be (F, H, W, 3) RGB with F >= 1, got {list(shape)}")
    _check_frame_size(shape[2], shape[1], fps)
    return shape, _check_soundtrack(waveform, sample_rate)


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
            raise VflashError(
                f"the raw frames file ended at frame {i} of {self.shape[0]}; it was changed while the clip was encoded"
            )
        return np.frombuffer(data, dtype=np.uint8).reshape(self.shape[1:])


@contextlib.contextmanager
def rgb_frames(frames, shape: tuple[int, ...], video_input: str, destination: Path) -> Iterator:
    """Yields an indexable of uint8 (H, W, 3) frames: a raw temporary file beside `destination`, named for it and this
    writer (`fileio.temporary`, so a killed run's is removed by the next) ("file"), or per-frame quantisation
    ("pipe")."""
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


class _Muxer:
    """One MP4 being written: an H.264 (yuv420p) and an AAC stream, fed in the one order every writer here uses
    (all video frames, the video flush, then the audio), so equal frames and audio make equal files."""

    def __init__(
        self, target: Path, width: int, height: int, channels: int, sample_rate: int, fps: int,
        video_threads: int | None, video_crf: int, video_preset: str,
        metadata: Mapping[str, str],
    ):
        import av

        self.av, self.frames, self.sample_rate = av, 0, sample_rate
        self.layout = "stereo" if channels == 2 else "mono"
        # MP4 keeps only the tags FFmpeg knows unless it writes them as free-form (mdta) keys.
        movflags = "+faststart+use_metadata_tags" if metadata else "+faststart"
        self.container = av.open(str(target), mode="w", format="mp4", options={"movflags": movflags})
        try:
            self.container.metadata.update(metadata)
            self.video = self.container.add_stream(
                "libx264", rate=fps, options={**H264_OPTIONS, "crf": str(video_crf), "preset": video_preset}
            )
            self.video.width, self.video.height, self.video.pix_fmt = width, height, "yuv420p"
            self.video.time_base = Fraction(1, fps)
            self.video.codec_context.thread_count = 0 if video_threads is None else video_threads
            self.sound = self.container.add_stream("aac", rate=sample_rate)
            self.sound.layout = self.layout
            self.sound.bit_rate = AAC_BITRATE
        except BaseException:
            self.container.close()
            raise

    def add_frame(self, rgb: np.ndarray) -> None:
        """One (H, W, 3) uint8 RGB frame, presented at `index / fps`."""
        # Converted here, on one thread, so the yuv420p planes never depend on swscale's slice threading (the
        # encoder would otherwise convert an RGB frame with its own thread count).
        frame = self.av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p", threads=1)
        frame.pts = self.frames
        self.frames += 1
        self.container.mux(self.video.encode(frame))

    def finish(self, audio: np.ndarray) -> None:
        """Flush the video, encode the (channels, samples) float32 soundtrack, close the file."""
        self.container.mux(self.video.encode(None))
        for start in range(0, audio.shape[1], _AAC_FRAME):
            chunk = self.av.AudioFrame.from_ndarray(
                np.ascontiguousarray(audio[:, start : start + _AAC_FRAME]), format="fltp", layout=self.layout
            )
            chunk.sample_rate, chunk.pts = self.sample_rate, start
            self.container.mux(self.sound.encode(chunk))
        self.container.mux(self.sound.encode(None))
        self.container.close()

    def close(self) -> None:
        self.container.close()


def _encode(
    target: Path, rgb, shape: tuple[int, ...], audio: np.ndarray, sample_rate: int, fps: int, video_threads: int | None,
    video_crf: int, video_preset: str, metadata: Mapping[str, str],
) -> None:
    muxer = _Muxer(
        target, shape[2], shape[1], audio.shape[0], sample_rate, fps, video_threads, video_crf, video_preset, metadata
    )
    try:
        for i in range(shape[0]):
            muxer.add_frame(rgb[i])
        muxer.finish(audio)
    finally:
        muxer.close()


class MP4Stream:
    """An MP4 encoded while its frames are still being made (`video_input="stream"`; open it with `mp4_stream`).

    `add(start, frames)` takes each decoded part in order: (f, H, W, 3) float in [0, 1] (or uint8) on any device,
    quantised there (`quantize`) and copied to the host; from CUDA into pinned memory without waiting for the copy, so
    the caller goes on queueing device work (the decoder's next windows) while the part is still in flight. The
    stream's thread waits for each part's copy, then converts and encodes the parts as they come. `add` waits while
    `STREAM_QUEUE_PARTS` parts are queued, and raises the encoder's error (a full disk, say) as soon as there is one.
    `finish(waveform)` waits for the video, then muxes the soundtrack.
    """

    _END = None

    def __init__(self, target: Path, width: int, height: int, channels: int, sample_rate: int, fps: int,
                 video_threads: int | None, metadata: Mapping[str, str], video_crf: int = DEFAULT_CRF,
                 video_preset: str = DEFAULT_PRESET):
        self.width, self.height, self.channels, self.sample_rate = width, height, channels, sample_rate
        self.frames = 0  # frames handed to `add`
        self.finished = False
        self._muxer = _Muxer(
            target, width, height, channels, sample_rate, fps, video_threads, video_crf, video_preset, metadata
        )
        self._parts: queue.Queue[HostCopy | None] = queue.Queue(maxsize=STREAM_QUEUE_PARTS)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._encode_parts, name="vflash-mp4-stream", daemon=True)
        self._thread.start()

    def _encode_parts(self) -> None:
        try:
            while (part := self._parts.get()) is not self._END and not self._stop.is_set():
                for rgb in part.wait().numpy():
                    if self._stop.is_set():
                        break
                    self._muxer.add_frame(rgb)
        except BaseException as exc:  # noqa: BLE001 - handed to the producer, which raises it on its own thread
            self._error = exc
            self._stop.set()
            while self._parts.get() is not self._END:  # free a producer blocked on a full queue until it sees the error
                pass

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def add(self, start: int, frames: torch.Tensor) -> None:
        """Frames `start .. start + f - 1` of the clip; parts come in order, without gaps."""
        if start != self.frames:
            raise VflashError(f"the MP4 stream expected frame {self.frames} next, got a part starting at frame {start}")
        shape = tuple(frames.shape)
        if len(shape) != 4 or shape[1:] != (self.height, self.width, 3) or shape[0] < 1:
            raise VflashError(f"the MP4 stream takes (f, {self.height}, {self.width}, 3) RGB frames, got {list(shape)}")
        part = copy_to_host(quantize(frames.detach()))
        while True:
            self._raise_error()
            try:
                self._parts.put(part, timeout=0.1)
                break
            except queue.Full:
                continue
        self.frames += shape[0]

    def _join(self) -> None:
        self._parts.put(self._END)
        self._thread.join()

    def finish(self, waveform: torch.Tensor | np.ndarray) -> None:
        """Wait for every frame's encode, then mux the (channels, samples) soundtrack and close the file."""
        audio = _check_soundtrack(waveform, self.sample_rate)
        if audio.shape[0] != self.channels:
            raise VflashError(f"the MP4 stream was opened for {self.channels} audio channels, got {audio.shape[0]}")
        if self.frames < 1:
            raise VflashError("the MP4 stream was given no frames")
        self._join()
        self._raise_error()
        self._muxer.finish(audio)
        self.finished = True

    def abandon(self) -> None:
        """Stop the encoder and close the file without finishing it (its owner removes it)."""
        self._stop.set()
        while self._thread.is_alive():  # the encoder drains the queue down to the end marker once stopped
            with contextlib.suppress(queue.Full):
                self._parts.put(self._END, timeout=0.1)
            self._thread.join(timeout=0.1)
        self._muxer.close()


@contextlib.contextmanager
def mp4_stream(
    path: str | Path, width: int, height: int, sample_rate: int, fps: int = 24, channels: int = 2,
    video_threads: int | None = None, overwrite: bool = False, metadata: Mapping[str, str] | None = None,
    video_crf: int = DEFAULT_CRF, video_preset: str = DEFAULT_PRESET,
) -> Iterator[MP4Stream]:
    """An `MP4Stream` written under a temporary name beside `path` and published atomically when the block ends after
    `finish`; on any failure inside the block (or a block that never called `finish`) nothing appears at `path`."""
    check_encoder_options(video_threads, video_crf, video_preset)
    _check_frame_size(width, height, fps)
    path = Path(path)
    with atomic_file(path, overwrite=overwrite, suffix=".mp4") as tmp:
        stream = MP4Stream(
            tmp, width, height, channels, sample_rate, fps, video_threads, metadata or {}, video_crf, video_preset
        )
        try:
            yield stream
        finally:
            if not stream.finished:
                stream.abandon()
        if not stream.finished:
            raise VflashError(f"the MP4 stream for {path} ended without finish(); nothing was written")
    logger.debug("wrote %s: %d frames %dx%d at %d fps (streamed)", path, stream.frames, width, height, fps)


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
    video_crf: int = DEFAULT_CRF,
    video_preset: str = DEFAULT_PRESET,
) -> Path:
    """Encode `frames` (F, H, W, 3; float32 in [0, 1] or uint8) and `waveform` (channels, samples; float32 in [-1, 1])
    into an MP4 at `path`, written under a temporary name in the same folder and published atomically.

    An existing `path` is an error unless `overwrite`; on any failure nothing appears at `path`. `metadata`: container
    tags, kept under their own names.
    """
    check_delivery_options(video_input, video_threads, video_crf, video_preset)
    shape, audio = _check_inputs(frames, waveform, sample_rate, fps)
    path = Path(path)
    with (
        atomic_file(path, overwrite=overwrite, suffix=".mp4") as tmp,
        rgb_frames(frames, shape, video_input, path) as rgb,
    ):
        _encode(tmp, rgb, shape, audio, sample_rate, fps, video_threads, video_crf, video_preset, metadata or {})
    logger.debug(
        "wrote %s: %d frames %dx%d at %d fps, %.3f s of %d Hz audio", path, shape[0], shape[2], shape[1], fps,
        audio.shape[1] / sample_rate, sample_rate
    )
    return path
