"""Stand-in for `VideoComponents` / `VideoFromComponents` (ComfyUI 0.33.0 `comfy_api/latest/_input_impl`).

`save_to` encodes like core: PyAV, h264 yuv420p from `(frame * 255).byte()` RGB frames, the first batch item of the
AUDIO waveform trimmed to the video's length and encoded as AAC at its own sample rate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Optional

import av
import torch


class VideoCodec(str, Enum):
    AUTO = "auto"
    H264 = "h264"
    AV1 = "av1"


class VideoContainer(str, Enum):
    AUTO = "auto"
    MP4 = "mp4"
    MKV = "mkv"
    WEBM = "webm"

    @classmethod
    def get_extension(cls, value) -> str:
        value = cls(value)
        return "mp4" if value in (cls.MP4, cls.AUTO) else value.value


@dataclass
class VideoComponents:
    images: torch.Tensor
    frame_rate: Fraction
    audio: Optional[dict] = None
    metadata: Optional[dict] = None
    alpha: Optional[torch.Tensor] = None


class VideoFromComponents:
    def __init__(self, components: VideoComponents, bit_depth: int = 8):
        images = components.images
        if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[-1] != 3:
            raise TypeError(f"VideoComponents.images must be an IMAGE [F, H, W, 3], got {getattr(images, 'shape', type(images))}")
        if components.audio is not None:
            waveform = components.audio["waveform"]
            if waveform.ndim != 3:
                raise TypeError(f"AUDIO waveform must be [B, C, T], got {list(waveform.shape)}")
            int(components.audio["sample_rate"])
        self.__components = components
        self.__bit_depth = bit_depth

    def get_components(self) -> VideoComponents:
        c = self.__components
        return VideoComponents(images=c.images, audio=c.audio, frame_rate=c.frame_rate)

    def get_dimensions(self) -> tuple[int, int]:
        return int(self.__components.images.shape[2]), int(self.__components.images.shape[1])

    def get_frame_count(self) -> int:
        return int(self.__components.images.shape[0])

    def get_frame_rate(self) -> Fraction:
        return Fraction(self.__components.frame_rate)

    def get_duration(self) -> float:
        return self.get_frame_count() / float(self.__components.frame_rate)

    def save_to(self, path, format=VideoContainer.AUTO, codec=VideoCodec.AUTO, metadata=None, bit_depth=None, crf=None, color_space=None):
        if VideoContainer(format) not in (VideoContainer.AUTO, VideoContainer.MP4) or VideoCodec(codec) not in (VideoCodec.AUTO, VideoCodec.H264):
            raise ValueError(f"the stand-in encodes mp4/h264 only, not {format}/{codec}")
        c = self.__components
        frame_rate = Fraction(round(c.frame_rate * 1000), 1000)
        with av.open(str(path), mode="w", format="mp4") as output:
            for key, value in (metadata or {}).items():
                output.metadata[key] = json.dumps(value)
            stream = output.add_stream("h264", rate=frame_rate)
            stream.width, stream.height = self.get_dimensions()
            stream.pix_fmt = "yuv420p"
            audio_stream = None
            if c.audio:
                rate = int(c.audio["sample_rate"])
                waveform = c.audio["waveform"][0, :, : math.ceil((rate / frame_rate) * c.images.shape[0])]
                layout = {1: "mono", 2: "stereo"}.get(waveform.shape[0], "stereo")
                audio_stream = output.add_stream("aac", rate=rate, layout=layout)
            for frame in c.images:
                img = (frame * 255).clamp(0, 255).byte().cpu().numpy()
                video_frame = av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p")
                output.mux(stream.encode(video_frame))
            output.mux(stream.encode(None))
            if audio_stream is not None:
                audio_frame = av.AudioFrame.from_ndarray(waveform.float().cpu().contiguous().numpy(), format="fltp", layout=layout)
                audio_frame.sample_rate = rate
                audio_frame.pts = 0
                output.mux(audio_stream.encode(audio_frame))
                output.mux(audio_stream.encode(None))
