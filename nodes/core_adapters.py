"""ComfyUI core's own text encoder and VAEs behind Vflash's interfaces: `CoreTextConditioner` (core CLIP loaded
with `CLIPLoader(type="minimax")`) and `CoreVAEs` (core's H3 video VAE and audio VAE), so the pipeline's steps run on
them; the notes a result carries of how they differ from the diffusers pipeline; and the choice, per node input,
between a Vflash spec and a core object."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import PIL.Image
import torch

from vflash_core.errors import RequestError, VflashError
from vflash_core.media.conditioning import TextConditioner, TextConditioning, sample_video_frames
from vflash_core.media.references import CanvasRules
from vflash_core.media.vae import MediaVAEs, calling_between_blocks

from . import comfy_latent as cl
from .engines import ComponentSpec, EngineRegistry, load_component_engine
from .interfaces import Host

__all__ = [
    "CORE_TEXT_NOTE",
    "CORE_VAE_NOTE",
    "CoreTextConditioner",
    "CoreVAEs",
    "core_text_conditioner",
    "pil_to_image",
    "text_conditioner",
    "vae_pair",
]

# What Vflash measured of core's text conditioning (ComfyUI 0.33.0 `comfy/text_encoders/minimax.py` on the same
# Qwen3-VL weights as the diffusers conditioner): docs/comfyui.md has the numbers, docs/development.md the test.
CORE_TEXT_NOTE = (
    "text conditioning from ComfyUI core's CLIP (its own Qwen3-VL code): the same presentation (labels, vision "
    "blocks, row tags) as diffusers' hidden_states[50], but not bitwise equal to it (measured on ComfyUI 0.33.0 with a "
    "small Qwen3-VL: up to 2e-6 apart with fp32 weights, up to 0.17 with bf16 weights, for values up to 5), so "
    "results are not bitwise those of the diffusers pipeline"
)
CORE_VAE_NOTE = (
    "keyframe / reference latents from ComfyUI core's VAE (its own H3 VAE code, posterior mean); the diffusers "
    "pipeline samples the posterior with seed 42, so conditioning latents differ from it"
)


def pil_to_image(picture: PIL.Image.Image) -> torch.Tensor:
    """PIL RGB -> core IMAGE (1, H, W, 3) fp32 0..1."""
    return torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32) / 255.0)[None]


class CoreTextConditioner:
    """Vflash's text-conditioner interface over core's CLIP loaded with `CLIPLoader(type="minimax")`.

    The presentation is core's `MiniMaxH3Tokenizer` (labels and vision blocks in Vflash's order: keyframes as
    `images`, references as `minimax_ref_items`); the conditioning is core's CONDITIONING tensor and its
    `minimax_token_tags`. ComfyUI owns the model's memory (core loads and offloads it as for its own nodes).
    """

    def __init__(self, clip: Any, canvas: CanvasRules | None = None):
        self.clip = clip
        self.canvas = canvas or CanvasRules()

    def _ref_items(self, references: list) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for ref in references:
            if ref.has_audio:
                items.append({"type": "audio"})
            if ref.kind == "image":
                items.append({"type": "image", "data": pil_to_image(ref.image)})
            elif ref.kind == "video":
                frames, _ = sample_video_frames(np.asarray(ref.frames), 2)
                items.append({"type": "video", "data": torch.from_numpy(np.stack(frames).astype(np.float32) / 255.0)})
        return items

    @torch.no_grad()
    def encode(self, prompt: str, keyframes: list | None = None, references: list | None = None):
        if references:
            tokens = self.clip.tokenize(prompt, minimax_ref_items=self._ref_items(references))
        else:
            tokens = self.clip.tokenize(prompt, images=[pil_to_image(k) for k in keyframes or []])
        conditioning = self.clip.encode_from_tokens_scheduled(tokens)
        if not conditioning:
            raise VflashError("core CLIP returned no conditioning")
        embeds, extra = conditioning[0][0], conditioning[0][1]
        tags = extra.get("minimax_token_tags") if isinstance(extra, dict) else None
        if tags is None or embeds.ndim != 3 or embeds.shape[0] != 1:
            raise RequestError(
                "this CLIP is not MiniMax-H3's text encoder: load the Qwen3-VL file from text_encoders/ with core "
                "CLIPLoader, type 'minimax' (its conditioning carries minimax_token_tags)"
            )
        tags = tags.reshape(-1).long().cpu()
        if tags.shape[0] != embeds.shape[1]:
            raise VflashError(f"core CLIP returned {embeds.shape[1]} conditioning rows and {tags.shape[0]} token tags")
        return TextConditioning(embeds[0].detach().cpu(), tags, [])


class CoreVAEs:
    """Vflash's VAE-pair interface (`MediaVAEs`) over core's H3 video VAE and, optionally, its audio VAE.

    Core's VAEs take and return the normalised latents the transformer works on (the same as Vflash's), pixels in
    0..1, and manage their own device memory; the audio VAE is needed to decode and for soundtracks.
    """

    def __init__(self, video_vae: Any, audio_vae: Any = None):
        if getattr(video_vae, "latent_dim", 3) != 3:
            raise RequestError(
                "the vae input takes MiniMax-H3's video VAE (VAELoader of the video VAE file); connect the audio VAE "
                "to audio_vae"
            )
        if audio_vae is not None and getattr(audio_vae, "latent_dim", 2) != 2:
            raise RequestError("the audio_vae input takes MiniMax-H3's audio VAE (VAELoader of the audio VAE file)")
        self.video_vae = video_vae
        self.audio_vae = audio_vae

    def require_audio(self) -> Any:
        if self.audio_vae is None:
            raise RequestError(
                "a core video VAE is connected without its audio VAE: connect MiniMax-H3's audio VAE (VAELoader) to "
                "audio_vae"
            )
        return self.audio_vae

    @property
    def latent_channels(self) -> int:
        """The video latent's channels: the model's own (its post-quant conv), else what core records (24)."""
        conv = getattr(getattr(self.video_vae, "first_stage_model", None), "post_quant_conv", None)
        channels = getattr(conv, "in_channels", None)
        return int(channels if channels else getattr(self.video_vae, "latent_channels", 24))

    @property
    def audio_latent_channels(self) -> int:
        mean = getattr(getattr(self.audio_vae, "first_stage_model", None), "latents_mean", None)
        return int(mean.shape[0]) if mean is not None else int(getattr(self.audio_vae, "latent_channels", 32))

    @property
    def sample_rate(self) -> int:
        """The audio VAE's rate (H3's 32 kHz when no audio VAE is connected: references are resampled to it)."""
        return int(getattr(self.audio_vae, "audio_sample_rate", 32000))

    @contextlib.contextmanager
    def on_device(self):
        yield self  # ComfyUI moves core's VAEs itself

    @torch.no_grad()
    def encode_pixels(self, frames) -> torch.Tensor:
        """(F, H, W, 3) uint8 -> (1, C, f, H/16, W/16) fp32 normalised, CPU."""
        pixels = (
            torch.from_numpy(frames.astype("float32") / 255.0)
            if not isinstance(frames, torch.Tensor)
            else frames.float() / 255.0
        )
        return self.video_vae.encode(pixels).float().cpu()

    @torch.no_grad()
    def encode_soundtrack(self, waveform: torch.Tensor) -> torch.Tensor:
        """(2, S) at the VAE's rate -> (2 A, C) normalised channel-major rows, CPU."""
        latents = self.require_audio().encode(waveform.float()[None].movedim(1, -1)).float().cpu()  # (1, C, 2, A)
        return latents[0].permute(1, 2, 0).reshape(-1, latents.shape[1])

    @torch.no_grad()
    def decode_video(
        self, video_latents: torch.Tensor, between_blocks: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """(1, C, F, h, w) normalised -> (F', 16 h, 16 w, 3) fp32 in [0, 1], CPU; `between_blocks()` before each block
        of core's ViT decoder (`first_stage_model.decoder.transformer_blocks`; a model without them is not polled)."""
        decoder = getattr(getattr(self.video_vae, "first_stage_model", None), "decoder", None)
        with calling_between_blocks(decoder, between_blocks if hasattr(decoder, "transformer_blocks") else None):
            images = self.video_vae.decode(video_latents)
        return images.reshape(-1, *images.shape[-3:]).float().clamp(0, 1).cpu()

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> torch.Tensor:
        """(2, C, A) normalised -> (2, A * hop) fp32 waveform, CPU (core's decode, without VAEDecodeAudio's loudness
        normalisation)."""
        waveform = self.require_audio().decode(cl.audio_to_comfy(audio_latents))  # (1, T, 2)
        return waveform[0].movedim(-1, 0).float().cpu()


def core_text_conditioner(te: Any) -> CoreTextConditioner:
    """Core's CLIP behind the text-conditioner interface; anything else connected to `te` is refused by name."""
    if callable(getattr(te, "tokenize", None)) and callable(getattr(te, "encode_from_tokens_scheduled", None)):
        return CoreTextConditioner(te)
    raise RequestError(
        "te takes a Vflash text encoder (VflashTextEncoderLoader) or core CLIP (CLIPLoader, type minimax), got "
        f"{type(te).__name__}"
    )


def text_conditioner(registry: EngineRegistry, host: Host, te: Any) -> TextConditioner | CoreTextConditioner:
    """The text conditioner of a `te` input: a Vflash text encoder spec's engine (loaded now if it is not), or core's
    CLIP."""
    if isinstance(te, ComponentSpec):
        if te.kind != "te":
            raise RequestError(f"te takes a Vflash text encoder (VflashTextEncoderLoader), got a {te.kind} spec")
        engine = load_component_engine(registry, host, te)
        assert isinstance(engine, TextConditioner)  # what a "te" spec loads
        return engine
    return core_text_conditioner(te)


def vae_pair(registry: EngineRegistry, host: Host, vae: Any, audio_vae: Any = None) -> MediaVAEs | CoreVAEs:
    """The VAE pair of the `vae` / `audio_vae` inputs: a Vflash VAE pair spec's engine, or core's VAEs."""
    if isinstance(vae, ComponentSpec):
        if audio_vae is not None:
            raise RequestError("audio_vae goes with a core video VAE; a Vflash VAE loader already holds both VAEs")
        if vae.kind != "vae":
            raise RequestError(f"vae takes a Vflash VAE pair (VflashVAELoader), got a {vae.kind} spec")
        engine = load_component_engine(registry, host, vae)
        assert isinstance(engine, MediaVAEs)  # what a "vae" spec loads
        return engine
    if callable(getattr(vae, "decode", None)) and callable(getattr(vae, "encode", None)):  # core VAE
        return CoreVAEs(vae, audio_vae)
    raise RequestError(
        f"vae takes a Vflash VAE pair (VflashVAELoader) or core's H3 video VAE (VAELoader), got {type(vae).__name__}"
    )
