"""The request path's steps, functions of the parts they run on, so that a front end whose text encoder and VAEs come
from separate loaders (or from another implementation) runs this code and no copy of it: `encode_request` (the
request's media on H3's rates, the prompt, the keyframes and references through the VAEs), `EncodedRequest.bundle`
(the seed's noise, handed over one-shot), then the core (`NativeEngineSession.generate`), `vae.decode_latents` and
`delivered_soundtrack`. `build_request_bundle` is the encode of a validated `VideoRequest` from its files."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch

from ..engine.bundle import BundleHandoff, EncodedReference, build_keyframe_bundle, build_ref2va_bundle
from ..engine.config import H3Config
from ..engine.layout import FPS, Geometry, align_num_frames_down
from ..media.conditioning import TextConditioner
from ..media.references import CanvasRules, fit_keyframes, load_image, load_reference, normalize_references
from ..media.vae import DecodedMedia, MediaVAEs
from .validation import RequestPlan, VideoRequest

__all__ = [
    "EncodedRequest", "StageCallback", "build_request_bundle", "delivered_soundtrack", "encode_request", "stage_timer",
]

# after_stage(name): called when a nested stage ends (encode.inputs, encode.text, encode.vae, decode.video,
# decode.audio)
StageCallback = Callable[[str], None]


def stage_timer(timings: dict[str, float] | None, then: StageCallback | None = None) -> StageCallback:
    """A stage callback that records in `timings` each stage's seconds since the previous one (or since it was made),
    then calls `then`."""
    last = [time.perf_counter()]

    def after_stage(name: str) -> None:
        now = time.perf_counter()
        if timings is not None:
            timings[name] = now - last[0]
        last[0] = now
        if then is not None:
            then(name)

    return after_stage


@dataclass(frozen=True)
class EncodedRequest:
    """The seed-independent half of a request's bundle (CPU tensors): the encoded prompt and keyframe / reference
    latents, with the mode and the canvas they were encoded for. One encoding serves every seed (`bundle`)."""

    mode: str
    geometry: Geometry
    prompt_embeds: torch.Tensor  # (L, text_dim)
    token_tags: torch.Tensor  # (L,) int64
    keyframe_latents: tuple[torch.Tensor, ...] = ()  # one (1, C, 1, h, w) per keyframe, packed order
    anchors: tuple[str, ...] = ()  # "first" / "last" per keyframe
    references: tuple[EncodedReference, ...] = ()  # request order
    notes: tuple[str, ...] = ()  # how this encoding differs from the diffusers pipeline's (other encoders passed in)

    def bundle(self, config: H3Config, seed: int, geometry: Geometry | None = None) -> BundleHandoff:
        """The conditioning bundle of one seed (its noise drawn by the bundle contract), handed over one-shot;
        `geometry` replaces the encoded canvas (a t2va encoding is bound to none)."""
        geometry = geometry or self.geometry
        generator = torch.Generator().manual_seed(seed)
        if self.mode == "ref2va":
            bundle = build_ref2va_bundle(
                self.prompt_embeds, self.token_tags, geometry, config, generator, self.references, seed=seed
            )
        else:
            bundle = build_keyframe_bundle(
                self.prompt_embeds, self.token_tags, geometry, config, generator, self.keyframe_latents, self.anchors,
                seed=seed,
            )
        return BundleHandoff(bundle)


def encode_request(
    conditioner: TextConditioner, vaes: MediaVAEs, prompt: str, mode: str, geometry: Geometry,
    keyframes: dict[str, PIL.Image.Image] | None = None, references: list | None = None,
    canvas: CanvasRules | None = None, after_stage: StageCallback | None = None,
) -> EncodedRequest:
    """Put a validated request's media on H3's rates and resolutions, then encode the prompt, and the keyframes and
    each reference's frames and soundtrack with the VAEs.

    `keyframes`: anchor ("first", "last") -> image, in packed order; `references`: the decoded diffusers
    `MiniMaxH3*Reference`s in request order; `canvas`: the model's canvas rules (default: the conditioner's). The
    conditioner and the VAEs may be any objects with their interfaces (e.g. another implementation's).
    `after_stage` is called after encode.inputs, encode.text and encode.vae.
    """
    after_stage = after_stage or (lambda name: None)
    fitted: list[PIL.Image.Image] = []
    normalized: list = []
    if mode == "ref2va":
        normalized = normalize_references(
            list(references or ()), geometry.num_frames, canvas or conditioner.canvas, vaes.sample_rate
        )
    elif keyframes:
        fitted = fit_keyframes(list(keyframes.values()), geometry.height, geometry.width)
    after_stage("encode.inputs")
    text = conditioner.encode(prompt, fitted, normalized)
    after_stage("encode.text")
    conditions: list[torch.Tensor] = []
    encoded: list[EncodedReference] = []
    if fitted or normalized:
        with vaes.on_device():  # the VAEs hold their device only for their stage
            conditions = [vaes.encode_pixels(np.array(k)[None]) for k in fitted]
            for ref in normalized:
                latents = rows = None
                if ref.kind == "image":
                    latents = vaes.encode_pixels(np.array(ref.image)[None])
                elif ref.kind == "video":
                    # Snapped down to 17 n + 5 frames so the VAE encodes without padding (the reference's arithmetic).
                    latents = vaes.encode_pixels(ref.frames[: align_num_frames_down(ref.frames.shape[0])])
                if ref.has_audio:
                    rows = vaes.encode_soundtrack(ref.audio)
                encoded.append(EncodedReference(ref.kind, latents, rows))
    after_stage("encode.vae")
    return EncodedRequest(
        mode, geometry, text.prompt_embeds, text.token_tags, tuple(conditions), tuple(keyframes or ()), tuple(encoded)
    )


def build_request_bundle(
    conditioner: TextConditioner, vaes: MediaVAEs, request: VideoRequest, request_plan: RequestPlan, config: H3Config,
    canvas: CanvasRules | None = None, timings: dict[str, float] | None = None,
) -> BundleHandoff:
    """Read the request's media files, encode them and the prompt (`encode_request`), draw the noise, and hand the
    bundle over one-shot. `request_plan` is the request's `plan_request` result; `timings` (optional) receives
    `encode.inputs` (reading included), `encode.text`, `encode.vae`, `encode.bundle`."""
    after_stage = stage_timer(timings)
    keyframes = {anchor: load_image(k) for anchor, k in request.keyframes.items()}
    references = [load_reference(r) for r in request.references]
    encoded = encode_request(
        conditioner, vaes, request.prompt, request_plan.mode, request_plan.geometry, keyframes, references, canvas,
        after_stage,
    )
    handoff = encoded.bundle(config, request.seed)
    after_stage("encode.bundle")
    return handoff


def delivered_soundtrack(media: DecodedMedia) -> torch.Tensor:
    """The waveform cut to the video's exact length: the audio latents cover round(F / 24 * 40) / 40 s."""
    return media.waveform[:, : round(media.num_frames / FPS * media.sample_rate)]
