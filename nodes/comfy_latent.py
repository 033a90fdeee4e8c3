"""ComfyUI's MiniMax-H3 AV latent <-> Vflash latents, and the other tensor layouts the node pack exchanges with core.

Pure torch: no ComfyUI import. ComfyUI core (`comfy_extras/nodes_minimax_h3.py`, `EmptyMiniMaxH3LatentAV`) carries
an H3 latent as ``{"samples": NestedTensor((video, audio))}`` with

* video: ``(B, 24, T, H/16, W/16)``, T = 5 n + 2 latent frames for 17 n + 5 pixel frames at 24 fps;
* audio: ``(B, 32, 2, A)``, 32 latent channels, 2 stereo channels, A = round(frames / 24 * 40) latents.

Both are the normalised latents the transformer works on (core's `MiniMaxH3AV` latent format has scale 1 and no
shift; the VAEs apply the per-channel mean/std), so a conversion is a pure relayout, bit-exact both ways. Vflash
carries the video latent as ``(1, C, T, h, w)`` (the same) and the audio latent as ``(2, C_a, A)``: one batch item
per stereo channel, which is the audio VAE's mono view. Channel counts are the model's (24 and 32 for the released
VAEs, fewer for the small embedded demo family); the geometry (T, h, w, A) is what the layouts share.

The `nested` argument of the builders is the NestedTensor class of the running host (ComfyUI's
`comfy.nested_tensor.NestedTensor`, or the headless runner's); only its constructor ``cls((video, audio))`` and
the ``.tensors`` / ``.is_nested`` attributes of its instances are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vflash_core.engine.layout import (
    AUDIO_CHANNELS,
    VAE_LATENTS_PER_CHUNK,
    VAE_SPATIAL_RATIO,
    Geometry,
    align_num_frames,
)
from vflash_core.errors import RequestError

VIDEO_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32


@dataclass(frozen=True)
class AVLatents:
    """video: (1, C, T, h, w) fp32; audio: (2, C_a, A) fp32 (Vflash layout)."""

    video: torch.Tensor
    audio: torch.Tensor

    @property
    def geometry(self) -> Geometry:
        return Geometry.of_latents(self.video, self.audio)


# -- core AV latent <-> Vflash ------------------------------------------------------------------------------------


def audio_to_comfy(audio: torch.Tensor) -> torch.Tensor:
    """(2, C_a, A) -> (1, C_a, 2, A)."""
    return audio.permute(1, 0, 2).unsqueeze(0).contiguous()


def to_comfy_latent(video: torch.Tensor, audio: torch.Tensor, nested: type) -> dict[str, Any]:
    """Vflash (video (1, C, T, h, w), audio (2, C_a, A)) -> core ``{"samples": NestedTensor((video, audio))}``."""
    Geometry.of_latents(video, audio)
    return {"samples": nested((video.float().contiguous(), audio_to_comfy(audio.float())))}


def from_comfy_latent(latent: dict[str, Any]) -> AVLatents:
    """Core H3 AV latent -> Vflash latents (fp32, CPU). Refuses other latents, batches and noise masks by name."""
    if not isinstance(latent, dict) or "samples" not in latent:
        raise RequestError(f"expected a LATENT dict with 'samples', got {type(latent).__name__}")
    samples = latent["samples"]
    if not getattr(samples, "is_nested", False) or len(samples.tensors) != 2:
        shape = list(samples.shape) if hasattr(samples, "shape") else type(samples).__name__
        raise RequestError(
            "expected a MiniMax-H3 AV latent (a nested video + audio pair, as EmptyMiniMaxH3LatentAV makes), "
            f"got {shape}"
        )
    if "noise_mask" in latent:
        raise RequestError("H3 AV latents with a noise_mask are not supported by Vflash (no masked / partial denoise)")
    video, audio = samples.tensors
    if video.ndim != 5 or audio.ndim != 4:
        raise RequestError(f"not a MiniMax-H3 AV latent: video {list(video.shape)}, audio {list(audio.shape)}")
    if video.shape[0] != 1 or audio.shape[0] != 1:
        raise RequestError(f"Vflash runs one clip per request; the latent has batch size {int(video.shape[0])}")
    if audio.shape[2] != AUDIO_CHANNELS:
        raise RequestError(f"a core H3 audio latent is (1, C, {AUDIO_CHANNELS}, A), got {list(audio.shape)}")
    out = AVLatents(
        video.detach().float().cpu().contiguous(), audio[0].detach().float().cpu().permute(1, 0, 2).contiguous()
    )
    Geometry.of_latents(out.video, out.audio)
    return out


def empty_latents(
    geometry: Geometry, video_channels: int = VIDEO_LATENT_CHANNELS, audio_channels: int = AUDIO_LATENT_CHANNELS
) -> AVLatents:
    """Zero latents of a geometry (what `EmptyMiniMaxH3LatentAV` makes, in Vflash layout)."""
    video = torch.zeros(1, video_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width)
    audio = torch.zeros(AUDIO_CHANNELS, audio_channels, geometry.num_audio_latents)
    return AVLatents(video, audio)


def is_empty(latents: AVLatents) -> bool:
    return not bool(latents.video.any()) and not bool(latents.audio.any())


def core_length_geometry(width: int, height: int, length: int) -> Geometry:
    """Geometry of core's ``EmptyMiniMaxH3LatentAV(width, height, length)``: length snapped up to 17 n + 5 (min 5)."""
    if width <= 0 or height <= 0 or width % VAE_SPATIAL_RATIO or height % VAE_SPATIAL_RATIO:
        raise RequestError(f"width and height must be positive multiples of {VAE_SPATIAL_RATIO}, got {width}x{height}")
    return Geometry(int(height), int(width), align_num_frames(max(VAE_LATENTS_PER_CHUNK, int(length))))


# -- core IMAGE / AUDIO ------------------------------------------------------------------------------------------


def frames_to_image(frames: torch.Tensor) -> torch.Tensor:
    """Decoded frames (F, H, W, 3) fp32 0..1 -> core IMAGE (F, H, W, 3) fp32 0..1 (a batch of frames)."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"decoded frames must be (F, H, W, 3), got {list(frames.shape)}")
    return frames.detach().float().clamp(0.0, 1.0).cpu().contiguous()


def waveform_to_audio(waveform: torch.Tensor, sample_rate: int) -> dict[str, Any]:
    """Decoded stereo waveform (2, T) -> core AUDIO ``{"waveform": (1, 2, T), "sample_rate": int}``."""
    if waveform.ndim != 2:
        raise ValueError(f"a decoded waveform is (channels, samples), got {list(waveform.shape)}")
    return {"waveform": waveform.detach().float().cpu().unsqueeze(0).contiguous(), "sample_rate": int(sample_rate)}


def image_to_clip(image: torch.Tensor, what: str) -> torch.Tensor:
    """Core IMAGE batch (F, H, W, C) 0..1 -> (F, H, W, 3) fp32 CPU; alpha is dropped."""
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (3, 4):
        raise RequestError(
            f"{what} must be an IMAGE batch (F, H, W, 3 or 4), got {getattr(image, 'shape', type(image).__name__)}"
        )
    return image[..., :3].detach().float().cpu().contiguous()


def image_to_frame(image: torch.Tensor, what: str) -> torch.Tensor:
    """Core IMAGE -> its first frame (H, W, 3) fp32 CPU."""
    return image_to_clip(image[:1] if isinstance(image, torch.Tensor) else image, what)[0]


def audio_to_waveform(audio: dict[str, Any], what: str) -> tuple[torch.Tensor, int]:
    """Core AUDIO -> (waveform (C, T) fp32 CPU of the first batch item, sample_rate)."""
    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise RequestError(f"{what} must be an AUDIO dict with 'waveform' and 'sample_rate'")
    waveform = audio["waveform"]
    if not isinstance(waveform, torch.Tensor) or waveform.ndim != 3:
        raise RequestError(
            f"{what}: an AUDIO waveform is (B, C, T), got {getattr(waveform, 'shape', type(waveform).__name__)}"
        )
    return waveform[0].detach().float().cpu().contiguous(), int(audio["sample_rate"])
