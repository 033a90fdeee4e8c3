"""What a player sees of an MP4 the engine wrote: the tests' check of its streams."""

from __future__ import annotations

from pathlib import Path

from vflash_core.errors import VflashError


def probe_mp4(path: str | Path) -> dict[str, object]:
    """What a player sees: decoded video frame count, rate and size; audio codec, duration, rate and channels."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video or not container.streams.audio:
            raise VflashError(f"{path}: expected one video and one audio stream")
        video, audio = container.streams.video[0], container.streams.audio[0]
        if video.average_rate is None or audio.duration is None or audio.time_base is None:
            raise VflashError(f"{path}: the container gives no video frame rate or no audio duration")
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
