"""Request media: reading keyframes and ref2va references, and putting them on H3's rates and resolutions.

Files are decoded with diffusers' official readers (`load_image`, and `MiniMaxH3{Image,Video,Audio}Reference.from_file`,
which bring a video's frame rate and a soundtrack's sample rate along). Normalisation then reproduces diffusers 0.42.1
(as diffusers' H3 pipeline normalises media):

* keyframes: the first is stretched onto the canvas (PIL LANCZOS); a second one is cover-cropped with the reference
  implementation's rounding and centring;
* image references: resized (LANCZOS) so the short edge is `reference_image_short_edge` (2048 released), each axis
  rounded to a multiple of 32, upscaling included, no area cap;
* video references: resampled onto 24 fps by holding or dropping whole frames, truncated to the generated frame
  count, resized onto the canvas their own aspect ratio resolves to;
* soundtracks: truncated to the generated duration at their own rate, upmixed to stereo, resampled to the audio
  VAE's rate (torchaudio's default windowed-sinc resampler, reimplemented here because torchaudio is not installable
  next to every torch build; a soundtrack already at the VAE's rate is passed through untouched, as the reference does).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..engine.layout import FPS, MAX_ASPECT_RATIO, MIN_ASPECT_RATIO, resolve_canvas_size
from ..errors import RequestError, VflashError
from ..fileio import GIB, check_input_file

__all__ = [
    "CANVAS_MULTIPLE", "MAX_AUDIOS", "MAX_IMAGES", "MAX_REFERENCES", "MAX_VIDEOS", "CanvasRules", "MediaProbe",
    "fit_keyframes", "frames_to_uint8", "load_image", "load_reference", "normalize_references", "normalize_soundtrack",
    "probe_media", "reference_kind", "resample_audio",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v")
AUDIO_EXTENSIONS = (".wav", ".mp3", ".flac", ".ogg", ".m4a", ".aac", ".opus")
CANVAS_MULTIPLE = 32
# Limits of the released checkpoint (diffusers' Ref2VA setup step).
MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS, MAX_REFERENCES = 9, 3, 3, 12
# What one input file may decode to. The readers decode a whole file before it is cut to the clip (15 s at most), so
# these bound the memory and time a single input can cost; they are checked from headers and packet times only.
MAX_INPUT_IMAGE_PIXELS = 1 << 26  # 67 MP, e.g. 8192 x 8192 (below PIL's decompression-bomb warning)
MAX_INPUT_SECONDS = 300.0  # a reference video or audio file
MAX_INPUT_VIDEO_BYTES = 4 << 30  # a reference video's decoded RGB frames, e.g. 1080p at 30 fps for 23 s
# A soundtrack's header (an audio reference's, a reference video's): mono or stereo, as `normalize_soundtrack` takes
# them (the decoder crashes the process on some other channel layouts), at a sample rate the resampler handles in
# bounded memory (its filters grow with the ratio to the VAE's rate). An audio reference must last long enough to give
# the audio VAE at least one latent frame (800 samples at 32 kHz, 25 ms), with a margin.
AUDIO_CHANNELS = (1, 2)
MIN_AUDIO_SAMPLE_RATE, MAX_AUDIO_SAMPLE_RATE = 8_000, 192_000
MIN_AUDIO_SECONDS = 0.1
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class CanvasRules:
    """The canvas a model family generates on: `canvas_short_edge`, `canvas_max_pixels` and the short edge image
    references are encoded at. Read from the model root's `modular_model_index.json` (diffusers' config values);
    the defaults are the released checkpoint's."""

    short_edge: int = 768
    max_pixels: int = 768 * 1344
    reference_image_short_edge: int = 2048

    @classmethod
    def from_model_root(cls, root: str | Path) -> CanvasRules:
        index = Path(root) / "modular_model_index.json"
        default = cls()
        try:
            values = json.loads(index.read_text(encoding="utf-8")) if index.is_file() else {}
            rules = cls(
                int(values.get("canvas_short_edge", default.short_edge)),
                int(values.get("canvas_max_pixels", default.max_pixels)),
                int(values.get("reference_image_short_edge", default.reference_image_short_edge)),
            )
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # unreadable, not JSON, not an object, not numbers
            raise VflashError(f"{index} does not hold the model's canvas rules: {exc}") from None
        if min(rules.short_edge, rules.max_pixels, rules.reference_image_short_edge) <= 0:
            raise VflashError(f"{index}: canvas rules must be positive, got {rules.to_dict()}")
        return rules

    def default_canvas(self, aspect_width: float = 16, aspect_height: float = 9) -> tuple[int, int]:
        """(height, width) for an aspect ratio, by the released rule."""
        return resolve_canvas_size(aspect_width, aspect_height, CANVAS_MULTIPLE, self.short_edge, self.max_pixels)

    def to_dict(self) -> dict[str, int]:
        return {
            "canvas_short_edge": self.short_edge, "canvas_max_pixels": self.max_pixels,
            "reference_image_short_edge": self.reference_image_short_edge
        }


# -- reading -------------------------------------------------------------------------------------------------------


def reference_kind(item: str | os.PathLike[str] | Image.Image, what: str = "reference") -> str:
    """`"image"`, `"video"` or `"audio"` from a PIL image or a file extension."""
    if isinstance(item, Image.Image):
        return "image"
    suffix = Path(item).suffix.lower()
    for kind, extensions in (("image", IMAGE_EXTENSIONS), ("video", VIDEO_EXTENSIONS), ("audio", AUDIO_EXTENSIONS)):
        if suffix in extensions:
            return kind
    raise RequestError(
        f"{what} {item}: unknown media type {suffix or '(no extension)'!r}; images {', '.join(IMAGE_EXTENSIONS)}, "
        f"videos {', '.join(VIDEO_EXTENSIONS)}, audio {', '.join(AUDIO_EXTENSIONS)}"
    )


@dataclass(frozen=True)
class MediaProbe:
    """What a media input's headers say: its kind, an image's displayed (width, height), whether a video has sound."""

    kind: str
    size: tuple[int, int] | None = None
    has_soundtrack: bool = False


def probe_media(item: str | os.PathLike[str] | Image.Image, what: str, kind: str | None = None) -> MediaProbe:
    """Check a media input before any model loads, from its headers and packet times (no pixels or samples are
    decoded): a readable regular file of a known kind (`kind`, else its extension's) that opens, has the stream it
    needs and stays within the input limits. Raises `RequestError` naming `what`."""
    if isinstance(item, Image.Image):
        return MediaProbe("image", item.size)
    path = check_input_file(item, what, RequestError)
    kind = kind or reference_kind(path, what)
    try:
        if kind == "image":
            return _probe_image(path, what)
        return _probe_stream(path, kind, what)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL and FFmpeg raise many types for unreadable files
        raise RequestError(f"{what} {path} cannot be read as {kind}: {exc}") from None


def _probe_image(path: Path, what: str) -> MediaProbe:
    with Image.open(path) as image:
        width, height = image.size
        if width * height > MAX_INPUT_IMAGE_PIXELS:
            raise RequestError(
                f"{what} {path} is {width}x{height} pixels; images of at most "
                f"{MAX_INPUT_IMAGE_PIXELS / 1e6:.0f} megapixels are accepted"
            )
        orientation = image.getexif().get(_EXIF_ORIENTATION)
    with Image.open(path) as image:  # `verify` must come first after opening, and leaves the image unusable
        image.verify()
    if orientation in (5, 6, 7, 8):  # EXIF transposes: displayed the other way round (as `load_image` returns it)
        width, height = height, width
    return MediaProbe("image", (width, height))


def _probe_stream(path: Path, kind: str, what: str) -> MediaProbe:
    import av

    with av.open(str(path)) as container:
        streams = container.streams.video if kind == "video" else container.streams.audio
        if not streams:
            raise RequestError(f"{what} {path} has no {kind} stream")
        stream = streams[0]
        width = height = 0
        if kind == "video":
            video = container.streams.video[0]
            width, height = video.codec_context.width, video.codec_context.height
        frame_bytes = 3 * width * height
        max_packets = MAX_INPUT_VIDEO_BYTES // frame_bytes if frame_bytes else None
        if container.streams.audio:  # an audio reference's stream, or a reference video's soundtrack
            _check_soundtrack_header(container.streams.audio[0], path, what)
        seconds, packets = _stream_extent(container, stream, max_packets)
        if kind == "audio" and seconds < MIN_AUDIO_SECONDS:
            raise RequestError(
                f"{what} {path} lasts {seconds:g} s; audio references must last at least {MIN_AUDIO_SECONDS:g} s"
            )
        if seconds > MAX_INPUT_SECONDS:
            raise RequestError(
                f"{what} {path} lasts more than {MAX_INPUT_SECONDS:g} s; trim it (at most the clip's length is used)"
            )
        if max_packets is not None and packets > max_packets:
            raise RequestError(
                f"{what} {path} decodes to more than {MAX_INPUT_VIDEO_BYTES / GIB:g} GiB of frames "
                f"({width}x{height}); "
                "trim it to the clip's length or scale it down"
            )
        return MediaProbe(kind, has_soundtrack=kind == "video" and bool(container.streams.audio))


def _check_soundtrack_header(stream, path: Path, what: str) -> None:
    """Channels and sample rate from the stream's header, before anything decodes it."""
    channels, rate = stream.codec_context.layout.nb_channels, stream.codec_context.sample_rate
    if channels not in AUDIO_CHANNELS:
        raise RequestError(
            f"{what} {path} has {channels} audio channels; soundtracks must be mono or stereo (1 or 2 channels): "
            "downmix it first"
        )
    if not MIN_AUDIO_SAMPLE_RATE <= rate <= MAX_AUDIO_SAMPLE_RATE:
        raise RequestError(
            f"{what} {path} has a sample rate of {rate} Hz; soundtracks must be sampled at "
            f"{MIN_AUDIO_SAMPLE_RATE:,}-{MAX_AUDIO_SAMPLE_RATE:,} Hz: resample it first"
        )


def _stream_extent(container, stream, max_packets: int | None) -> tuple[float, int]:
    """(seconds, packets) of one stream from its packets' times, without decoding; stops once past a limit, so a
    header that lies about the length cannot hide a long file."""
    start = end = None
    seconds, packets = 0.0, 0
    for packet in container.demux(stream):
        if packet.size == 0:  # the demuxer's final empty packet
            continue
        packets += 1
        if packet.pts is not None and packet.time_base is not None:
            begin = float(packet.pts * packet.time_base)
            start = begin if start is None else min(start, begin)
            stop = float((packet.pts + (packet.duration or 0)) * packet.time_base)
            end = stop if end is None else max(end, stop)
            seconds = end - start
        if seconds > MAX_INPUT_SECONDS or (max_packets is not None and packets > max_packets):
            break
    return seconds, packets


def load_image(item: str | os.PathLike[str] | Image.Image) -> Image.Image:
    """An RGB PIL image, EXIF orientation applied (diffusers' `load_image`)."""
    from diffusers.utils import load_image as official_load_image

    return official_load_image(item if isinstance(item, Image.Image) else str(item))


def load_reference(item: str | os.PathLike[str] | Image.Image):
    """A diffusers `MiniMaxH3*Reference` decoded at the rates the file carries."""
    import diffusers.modular_pipelines.minimax_h3 as h3

    kind = reference_kind(item)
    if kind == "image":
        return h3.MiniMaxH3ImageReference(image=load_image(item))
    if kind == "video":
        return h3.MiniMaxH3VideoReference.from_file(str(item))
    return h3.MiniMaxH3AudioReference.from_file(str(item))


# -- normalisation -------------------------------------------------------------------------------------------------


def _lanczos(image: Image.Image, height: int, width: int) -> Image.Image:
    # `VaeImageProcessor.resize` in its default mode: exactly PIL's LANCZOS resize.
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=16).resize(image, height=height, width=width)


def fit_keyframes(keyframes: list[Image.Image], height: int, width: int) -> list[Image.Image]:
    """Put keyframes (packed order) on the canvas: the first stretched, a second one cover-cropped."""
    fitted = []
    for index, image in enumerate(keyframes):
        if image.size == (width, height):
            fitted.append(image)
        elif index == 0:
            fitted.append(_lanczos(image, height, width))
        else:
            # The reference implementation's cover crop: round the scaled size, centre with (scaled - canvas) // 2.
            scale = max(width / image.size[0], height / image.size[1])
            scaled = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
            left, top = max(0, (scaled[0] - width) // 2), max(0, (scaled[1] - height) // 2)
            fitted.append(image.resize(scaled, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return fitted


def check_aspect(width: int, height: int, what: str) -> None:
    if width <= 0 or height <= 0 or not MIN_ASPECT_RATIO <= width / height <= MAX_ASPECT_RATIO:
        raise RequestError(f"{what} is {width}x{height}; H3 accepts aspect ratios from 1:4 to 4:1")


def normalize_image_reference(image: Image.Image, short_edge: int) -> Image.Image:
    width, height = image.size
    check_aspect(width, height, "an image reference")
    scale = short_edge / min(width, height)
    target_h = max(CANVAS_MULTIPLE, round(height * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)
    target_w = max(CANVAS_MULTIPLE, round(width * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)
    return image if image.size == (target_w, target_h) else _lanczos(image, target_h, target_w)


def frames_to_uint8(frames) -> np.ndarray:
    """A list of PIL images, (F, H, W, 3) array or (F, 3, H, W) tensor (uint8 or float in [0, 1]) -> uint8 FHWC."""
    if isinstance(frames, list):
        frames = np.stack([np.asarray(frame.convert("RGB")) for frame in frames])
    if isinstance(frames, torch.Tensor):
        frames = frames.movedim(-3, -1).cpu().numpy()
    frames = np.asarray(frames)
    if frames.dtype != np.uint8:
        frames = (frames * 255.0).round().clip(0, 255).astype(np.uint8)
    if frames.ndim != 4 or frames.shape[3] != 3:
        raise RequestError(f"a reference video must be (frames, height, width, 3) RGB, got {list(frames.shape)}")
    return frames


def normalize_video_frames(frames, fps: float, num_frames: int, canvas: CanvasRules) -> np.ndarray:
    """Onto 24 fps (each frame held until the next one's slot), truncated, on the canvas of its own aspect ratio."""
    frames = frames_to_uint8(frames)
    if fps <= 0:
        raise RequestError(f"a reference video must have a positive frame rate, got {fps}")
    if fps != FPS:
        scale = FPS / fps
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        frames = np.repeat(frames, np.diff(slots, append=math.floor(frames.shape[0] * scale + 0.5)), axis=0)
    frames = frames[:num_frames]
    check_aspect(frames.shape[2], frames.shape[1], "a reference video")
    height, width = canvas.default_canvas(frames.shape[2], frames.shape[1])
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS)) for f in frames])


def resample_audio(
    waveform: torch.Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6, rolloff: float = 0.99
) -> torch.Tensor:
    """Band-limited windowed-sinc resampling (Hann window), torchaudio's `Resample` defaults. (C, S) -> (C, S')."""
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    # One filter per output phase, built in float64 (the phase offsets in float32, as torchaudio computes them) and
    # applied in float32.
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1)[:, None, None] / new + idx) * base
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.ones_like(t), t.sin() / t) * (window * (base / orig))
    kernels = kernels.to(torch.float32)
    channels, length = waveform.shape
    padded = torch.nn.functional.pad(waveform.float()[:, None], (width, width + orig))
    out = torch.nn.functional.conv1d(padded.reshape(channels, 1, -1), kernels, stride=orig)
    out = out.transpose(1, 2).reshape(channels, -1)
    return out[:, : math.ceil(new * length / orig)]


def normalize_soundtrack(waveform: torch.Tensor, sample_rate: int, target_rate: int, seconds: float) -> torch.Tensor:
    """(channels, samples) mono or stereo -> (2, samples') float32 at `target_rate`, truncated to `seconds` first."""
    waveform = torch.as_tensor(waveform)
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2):
        raise RequestError(f"a soundtrack must be (channels, samples), mono or stereo, got {list(waveform.shape)}")
    waveform = waveform.to(torch.float32)[:, : int(seconds * sample_rate)]
    if waveform.shape[0] != 2:
        waveform = waveform.expand(2, -1).contiguous()
    return waveform if sample_rate == target_rate else resample_audio(waveform, sample_rate, target_rate)


def normalize_references(references: list, num_frames: int, canvas: CanvasRules, sample_rate: int) -> list:
    """Decoded `MiniMaxH3*Reference`s -> the same types on H3's rates and resolutions, in request order."""
    import diffusers.modular_pipelines.minimax_h3 as h3

    seconds = num_frames / FPS
    out = []
    for ref in references:
        soundtrack = None
        if ref.has_audio:
            soundtrack = normalize_soundtrack(ref.audio, ref.sample_rate or sample_rate, sample_rate, seconds)
        if ref.kind == "image":
            out.append(
                h3.MiniMaxH3ImageReference(
                    image=normalize_image_reference(ref.image, canvas.reference_image_short_edge)
                )
            )
        elif ref.kind == "video":
            frames = normalize_video_frames(ref.frames, float(ref.fps), num_frames, canvas)
            out.append(
                h3.MiniMaxH3VideoReference(
                    frames=frames, fps=float(FPS), audio=soundtrack,
                    sample_rate=None if soundtrack is None else sample_rate
                )
            )
        else:
            out.append(h3.MiniMaxH3AudioReference(audio=soundtrack, sample_rate=sample_rate))
    return out
