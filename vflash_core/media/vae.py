"""The official video and audio VAEs of H3: conditioning encodes and the final decode.

Encoding keyframes and visual references follows the released recipe exactly: ImageNet-normalised pixels over a
[0, 1] base, the posterior *sampled* under its own `Generator().manual_seed(42)` (never the request's), a round trip
through float16, then `(z - mean) / std` on the CPU. Soundtracks take the audio posterior's mean.

Decoding denormalises (`z * std + mean`), decodes with `AutoencoderKLMiniMaxH3` as loaded — spatial tiling on (its
default; the released frames are the blended-tile ones, and the tile geometry is the model's own, 256 px tiles with
at least 64 px overlap) and the model's temporal windowing, which decodes 7 latent frames at a time with cross-fades,
so 10 s and 15 s clips fit — and maps ImageNet space back to [0, 1]. The mono audio VAE decodes the two stereo
channels as two batch items. `video_decoder="native"` decodes the video with `vae_decode.NativeVideoDecoder` instead:
the same frames bit for bit, several tile-windows per ViT call, each window's frames copied out as it completes; with a
`peer_device` it splits the tile-windows between the two devices (a replica of the decoder's weights on the peer for
the decode's duration), the same frames again.

Both decodes can hand their frames to a sink instead of returning the clip (`stream_video`): the
native one window by window as each completes, diffusers' once for the whole clip; an MP4 stream (`mp4.MP4Stream.add`)
is such a sink, so the encoder works while the native decoder decodes the next windows.

Both decodes take a `between_blocks()` hook, called before each of the ViT decoder's blocks (in diffusers' decode
through a forward pre-hook on each block, for the decode's duration only), so a cancel raised there stops a decode
within one block of one tile call; it reads nothing and the frames are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.device_owner import (
    SerialDeviceOwner,
    module_bytes,
    point_module_at,
    release_device_memory,
    release_host_memory,
)
from ..engine.layout import AUDIO_CHANNELS, FPS, video_latent_frames
from ..errors import VflashError
from ..memory_plan import MemoryNeed, MemoryPlan, PartSizes
from .conditioning import default_dtype
from .vae_decode import (
    CALLS_IN_FLIGHT_PER_DEVICE,
    DEFAULT_WINDOWS_PER_CALL,
    DecodeGeometry,
    FrameLanding,
    NativeVideoDecoder,
    resolve_decoder_execution,
)

__all__ = [
    "PIXEL_MEAN", "PIXEL_STD", "DecodedMedia", "FrameSink", "MediaVAEs", "calling_between_blocks", "decode_bytes",
    "decode_latents",
]

logger = logging.getLogger(__name__)

# The video VAE's pixel convention: ImageNet statistics over a [0, 1] base.
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
CONDITION_ENCODE_SEED = 42
VIDEO_DECODERS = ("diffusers", "native")
# sink(start, frames): frames `start ..` of the clip, (f, H, W, 3) float32 in [0, 1] on the decoding device, in order.
FrameSink = Callable[[int, torch.Tensor], None]


def decode_bytes(video_vae, num_frames: int, height: int, width: int, decoder: str, windows_per_call: int) -> int:
    """Upper estimate of the video decode's transient device memory for a clip of `num_frames` at `height` x `width`.

    One tile-window (a spatial tile of one temporal window) is a ViT sequence of D-wide tokens, one per latent voxel,
    in bf16 with an fp32 residual stream. Its pixels take 3 channels x 4 bytes per output pixel. Both decoders hold a
    window's tiles and its stitched clip (twice, while it is concatenated).

    `diffusers` decodes one tile-window at a time, per token the fp32 residual stream in and out (8D), the normalised
    input (2D) and the larger of the attention (q, k, v, their fp32 norms, rotated copies and output: 20D) and the
    SwiGLU (projection, SiLU, product: 8 x inner), but keeps the whole video on the device, then maps it to [0, 1] in
    fp32 (12 bytes per channel and pixel at the peak).

    `native` runs `windows_per_call` tile-windows per call (at most the clip's), with the outputs of the calls in
    flight, and copies each window's frames to the host. Per token of a call: the fp32 stream and the first block's
    bf16 input (6D) and the larger sublayer, the attention (the normalised input, q, k and v, or q, k, v and the
    output: 8D) or the feed-forward (the SwiGLU and `ff_out`'s output: 2 x inner + 2D); `ff_in`'s projection (4 x
    inner) and its normalised input (2D) exist for one tile-window at a time (`vae_decode.block`). A 10 % allowance.

    With a peer device the native decode splits its calls between the two devices. The first device's transient is
    then no larger (its own calls, one window, and the peer's tiles arriving one call at a time from host memory); the
    peer holds a replica of the decoder's weights (part of the VAEs' bytes the first device holds) and its own calls
    in flight, both below the first device's share, and a plan's budget is the least over its devices, so this one
    estimate bounds the peer's decode as well.
    """
    config = video_vae.config
    geometry = DecodeGeometry.from_vae(video_vae)
    plan = geometry.plan(
        video_latent_frames(num_frames), height // geometry.spatial_ratio, width // geometry.spatial_ratio
    )
    d = config.decoder_num_attention_heads * config.decoder_attention_head_dim
    inner = config.decoder_ffn_mult * d
    tokens = plan.window_latents * plan.tile_height * plan.tile_width + config.decoder_num_register_tokens + 1
    window_frames = plan.window_latents * geometry.temporal_ratio
    tile = 3 * window_frames * plan.tile_height * plan.tile_width * geometry.spatial_ratio**2 * 4
    clip = 3 * window_frames * height * width * 4
    window = plan.tiles_per_window * tile + 2 * clip
    if decoder == "diffusers":
        vit = tokens * (10 * d + max(20 * d, 8 * inner))
        total = vit + window + 12 * 3 * plan.output_frames * height * width
    else:
        per_call = min(windows_per_call, len(plan.tile_windows()))
        in_flight = min((CALLS_IN_FLIGHT_PER_DEVICE + 1) * per_call, len(plan.tile_windows()))
        call = per_call * tokens * (6 * d + max(8 * d, 2 * inner + 2 * d)) + tokens * (4 * inner + 2 * d)
        total = call + in_flight * tile + window
    return int(total * 1.1)


def _cast_as_loaded(vae: Any, dtype: torch.dtype) -> None:
    """Give a VAE built on the meta device the dtypes diffusers' `from_pretrained(torch_dtype=dtype)` gives what it
    reads: every floating tensor of the state in `dtype`, but those under one of `_keep_in_fp32_modules` (a part of
    the tensor's name) in fp32; what the state does not hold stays as built."""
    keep: set[str] = set(vae._keep_in_fp32_modules or ())
    point_module_at(vae, {
        name: torch.empty_like(tensor, dtype=torch.float32 if keep & set(name.split(".")) else dtype)
        for name, tensor in vae.state_dict().items()
        if tensor.is_floating_point()
    })


@dataclass
class DecodedMedia:
    """frames: (F, H, W, 3) float32 in [0, 1], or None when they went to a sink; waveform: (2, T) float32 in
    [-1, 1]; num_frames: F (given when the frames went to a sink)."""

    frames: torch.Tensor | None
    waveform: torch.Tensor
    sample_rate: int
    fps: int = FPS
    num_frames: int = field(default=0)

    def __post_init__(self) -> None:
        if self.frames is not None:
            self.num_frames = int(self.frames.shape[0])


class MediaVAEs(SerialDeviceOwner):
    """Owns `AutoencoderKLMiniMaxH3` (video) and `AutoencoderKLMiniMaxH3Audio` (audio, always fp32)."""

    def __init__(
        self, video_vae, audio_vae, device: str | torch.device = "cpu", video_decoder: str = "diffusers",
        peer_device: str | torch.device | None = None, decoder_execution: str = "auto",
    ):
        if video_decoder not in VIDEO_DECODERS:
            raise VflashError(f"unknown video_decoder {video_decoder!r}; choose one of {', '.join(VIDEO_DECODERS)}")
        self.decoder_execution = resolve_decoder_execution(decoder_execution, torch.device(device))
        self.video_decoder: str | None = video_decoder  # None once a plan that places no decoder is taken: diffusers
        self.video_vae = video_vae.eval()
        self.audio_vae = audio_vae.eval()
        self.device = torch.device(device)
        self.peer_device = None if peer_device is None else torch.device(peer_device)
        if not self.video_vae.use_tiling:
            logger.warning("video VAE tiling is off; the released decodes are tiled, so frames will differ")

    @classmethod
    def from_pretrained(
        cls, decoder_root: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
        video_decoder: str = "diffusers",
        peer_device: str | torch.device | None = None,
        decoder_execution: str = "auto",
    ) -> MediaVAEs:
        """Load `vae/` and `audio_vae/` from a decoder root (an official model root works), offline.

        `dtype` applies to the video VAE's decoder stack (its cast-sensitive modules stay fp32, as diffusers pins
        them); default bf16 on CUDA, fp32 on the CPU. `video_decoder`: "diffusers" (its `decode`) or "native";
        `peer_device`: a second device the native decode shares its work with; `decoder_execution`: the native
        decode's "reference" torch ops or its "fused" Triton kernels (same bits, CUDA only); "auto" (the default)
        takes the fused ones on CUDA.
        """
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

        root = Path(decoder_root).resolve()
        device = torch.device(device)
        video = AutoencoderKLMiniMaxH3.from_pretrained(
            root / "vae", torch_dtype=dtype or default_dtype(device), local_files_only=True
        )
        audio = AutoencoderKLMiniMaxH3Audio.from_pretrained(root / "audio_vae", local_files_only=True)
        return cls(video, audio, device, video_decoder, peer_device, decoder_execution)

    @classmethod
    def on_meta_device(
        cls, decoder_root: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
        video_decoder: str = "diffusers", peer_device: str | torch.device | None = None,
        decoder_execution: str = "auto",
    ) -> MediaVAEs:
        """The pair `from_pretrained` loads from `decoder_root`, built from the configs with the weights on the meta
        device (no weight read): it decodes nothing, and answers the memory plan (`part_sizes`, `decode_need`) as the
        loaded pair will, before that loads."""
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

        root, device = Path(decoder_root).resolve(), torch.device(device)
        with torch.device("meta"):
            video, audio = (
                model.from_config(model.load_config(root / folder, local_files_only=True))
                for model, folder in ((AutoencoderKLMiniMaxH3, "vae"), (AutoencoderKLMiniMaxH3Audio, "audio_vae"))
            )
        _cast_as_loaded(video, dtype or default_dtype(device))
        return cls(video, audio, device, video_decoder, peer_device, decoder_execution)

    # -- geometry -----------------------------------------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        return int(self.video_vae.config.latent_channels)

    @property
    def audio_latent_channels(self) -> int:
        return int(self.audio_vae.config.latent_channels)

    @property
    def sample_rate(self) -> int:
        return int(self.audio_vae.config.sampling_rate)

    def _stats(self, vae, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.device]:
        """`vae`'s latent mean and std on the CPU, viewed as `shape`, and the device its parameters are on."""
        if vae is None:
            raise VflashError("these VAEs were closed")
        mean, std = torch.tensor(vae.config.latents_mean).view(shape), torch.tensor(vae.config.latents_std).view(shape)
        return mean, std, next(vae.parameters()).device

    # -- ownership ----------------------------------------------------------------------------------------------------

    def device_modules(self) -> list[torch.nn.Module]:
        return [self.video_vae, self.audio_vae]

    def part_sizes(self) -> PartSizes:
        """The memory plan's size of the VAEs: both, as loaded."""
        return PartSizes(vaes=module_bytes(self.video_vae) + module_bytes(self.audio_vae))

    def _stay_on_device(self) -> bool:
        """Whether the VAEs stay on their device between stages (the CPU's, or resident) rather than in host memory."""
        return self.device.type == "cpu" or self.keep_on_device

    def _brought_bytes(self) -> int:
        """The weights a stage of the VAEs brings to the device."""
        return 0 if self._stay_on_device() else self.part_sizes().vaes

    def resident_bytes(self) -> int:
        """The bytes the VAEs hold on their device between requests (none where they wait in host memory)."""
        return self.part_sizes().vaes if self._stay_on_device() else 0

    def encode_need(self) -> MemoryNeed:
        """What encoding keyframes or references needs on the device: the weights it brings (the encode's own transient
        is within the memory plan's margin)."""
        return MemoryNeed(self.device, self._brought_bytes())

    def decode_need(self, num_frames: int, height: int, width: int, decoder: str | None = None) -> MemoryNeed:
        """What decoding a clip of `num_frames` at `height` x `width` needs on the device: the weights it brings and
        the video decode's transient (`decode_bytes`) with `decoder` (default: this pair's video decoder)."""
        decoder = decoder or self.video_decoder or "diffusers"  # a plan that places no decoder leaves diffusers'
        transient = decode_bytes(self.video_vae, num_frames, height, width, decoder, DEFAULT_WINDOWS_PER_CALL)
        return MemoryNeed(self.device, self._brought_bytes(), transient)

    def place(self, plan: MemoryPlan) -> None:
        """Take the plan's placement of the VAEs and its video decoder (before the weights are read: `materialize`)."""
        self.keep_on_device = plan.placement.vaes == "resident"
        self.video_decoder = plan.placement.video_decoder

    def close(self) -> None:
        self.video_vae = self.audio_vae = None
        self._host = None
        release_device_memory(self.device)
        release_host_memory()

    # -- encoding -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_pixels(self, frames: np.ndarray) -> torch.Tensor:
        """(F, H, W, 3) uint8 RGB (F = 1 for a keyframe or image) -> (1, C, f, H/16, W/16) fp32 normalised, CPU."""
        mean, std, device = self._stats(self.video_vae, (1, -1, 1, 1, 1))
        # Copies only when the array is not contiguous or read-only (as `np.asarray` of a PIL image is).
        pixels = torch.from_numpy(np.require(frames, requirements=["C", "W"])).to(device).permute(3, 0, 1, 2)[None]
        pixel_mean, pixel_std = (
            torch.tensor(stats, device=device).view(1, -1, 1, 1, 1) for stats in (PIXEL_MEAN, PIXEL_STD)
        )
        pixels = (pixels.to(torch.float32).div(255.0) - pixel_mean) / pixel_std
        posterior = self.video_vae.encode(pixels, return_dict=False)[0]
        latents = posterior.sample(generator=torch.Generator().manual_seed(CONDITION_ENCODE_SEED))
        latents = latents.to(torch.float16).float().cpu()
        return (latents - mean) / std

    @torch.no_grad()
    def encode_soundtrack(self, waveform: torch.Tensor) -> torch.Tensor:
        """(2, S) float32 at the VAE's rate -> (2 A, C) fp32 normalised channel-major rows, CPU."""
        mean, std, device = self._stats(self.audio_vae, (1, 1, -1))
        posterior = self.audio_vae.encode(waveform.to(device)[:, None], return_dict=False)[0]
        latents = posterior.mode().float().cpu().transpose(1, 2)
        return ((latents - mean) / std).reshape(-1, self.audio_latent_channels)

    # -- decoding -----------------------------------------------------------------------------------------------------

    def _video_decode(self, video_latents: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Denormalised latents on the VAE's device, and the map of decoded pixels (1, 3, f, H, W) to frames
        (f, H, W, 3) in [0, 1], applied on the device (the same ops per element on a window as on the whole video)."""
        mean, std, device = self._stats(self.video_vae, (1, -1, 1, 1, 1))
        latents = video_latents.to(device) * std.to(device) + mean.to(device)
        pixel_mean, pixel_std = (
            torch.tensor(stats, device=device).view(1, -1, 1, 1, 1) for stats in (PIXEL_MEAN, PIXEL_STD)
        )

        def unit_frames(video: torch.Tensor) -> torch.Tensor:
            return (video.float() * pixel_std + pixel_mean).clamp(0, 1)[0].permute(1, 2, 3, 0)

        return latents, unit_frames

    def _native_decoder(self, latents: torch.Tensor) -> NativeVideoDecoder:
        devices = () if self.peer_device is None else (latents.device, self.peer_device)
        return NativeVideoDecoder.from_vae(self.video_vae, devices, execution=self.decoder_execution)

    @torch.no_grad()
    def decode_video(
        self, video_latents: torch.Tensor, between_blocks: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """(1, C, F, h, w) normalised -> (F', 16h, 16w, 3) float32 in [0, 1] on the CPU, F' = 17 n + 5 for F = 5 n + 2.
        `between_blocks()` runs before each ViT decoder block (it may raise to abandon the decode)."""
        latents, unit_frames = self._video_decode(video_latents)
        if self.video_decoder != "native":
            with calling_between_blocks(self.video_vae.decoder, between_blocks):
                return unit_frames(self.video_vae.decode(latents, return_dict=False)[0]).cpu()
        # Each window's frames are copied to the host as the window completes, so the video never occupies the device.
        decoder = self._native_decoder(latents)
        plan = decoder.plan(latents.shape)
        frames = torch.empty((plan.output_frames, plan.pixel_height, plan.pixel_width, 3), dtype=torch.float32)
        landing = FrameLanding(frames, frame_dim=0)
        decoder.decode(latents, lambda start, chunk: landing(start, unit_frames(chunk)), between_blocks=between_blocks)
        landing.finish()
        return frames

    @torch.no_grad()
    def stream_video(
        self, video_latents: torch.Tensor, sink: FrameSink, between_blocks: Callable[[], None] | None = None
    ) -> int:
        """`decode_video`'s frames handed to `sink(start, frames)` on the decoding device instead of returned: the
        native decoder's window by window as each completes, diffusers' once; returns the frame count F'."""
        latents, unit_frames = self._video_decode(video_latents)
        if self.video_decoder != "native":
            with calling_between_blocks(self.video_vae.decoder, between_blocks):
                frames = unit_frames(self.video_vae.decode(latents, return_dict=False)[0])
            sink(0, frames)
            return int(frames.shape[0])
        decoder = self._native_decoder(latents)
        decoder.decode(latents, lambda start, chunk: sink(start, unit_frames(chunk)), between_blocks=between_blocks)
        return decoder.plan(latents.shape).output_frames

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> torch.Tensor:
        """(2, C, A) normalised, one item per stereo channel -> (2, A * hop) float32 in [-1, 1]."""
        mean, std, device = self._stats(self.audio_vae, (1, -1, 1))
        latents = audio_latents.to(device) * std.to(device) + mean.to(device)
        return self.audio_vae.decode(latents, return_dict=False)[0].float()[:, 0].cpu()

    def decode(self, video_latents: torch.Tensor, audio_latents: torch.Tensor) -> DecodedMedia:
        """Both streams, holding the device for the duration."""
        if audio_latents.shape[0] != AUDIO_CHANNELS:
            raise VflashError(f"audio latents must be (2, C, A), got {list(audio_latents.shape)}")
        return decode_latents(self, video_latents, audio_latents)


@contextlib.contextmanager
def calling_between_blocks(decoder: Any, between_blocks: Callable[[], None] | None) -> Iterator[None]:
    """Inside the `with`, `between_blocks()` runs before each of `decoder.transformer_blocks` (the H3 ViT
    decoder's, in diffusers' and in ComfyUI core's VAE alike) through forward pre-hooks that return nothing, so the
    blocks' inputs are untouched; the hooks are removed on exit, whatever happened."""
    if between_blocks is None:
        yield
        return
    handles = [
        block.register_forward_pre_hook(lambda module, args: between_blocks()) for block in decoder.transformer_blocks
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def decode_latents(
    vaes, video_latents: torch.Tensor, audio_latents: torch.Tensor, after_stage: Callable[[str], None] | None = None,
    between_blocks: Callable[[], None] | None = None, video_sink: FrameSink | None = None,
) -> DecodedMedia:
    """(1, C, F, h, w) and (2, C_a, A) normalised latents -> frames and the whole stereo waveform, the VAEs on their
    device for the duration; `after_stage` is called after decode.video and decode.audio, `between_blocks()` before
    each block of the video decoder and once before the audio decode (either may raise to abandon the decode). With a
    `video_sink` the frames go to it as they are decoded (`MediaVAEs.stream_video`) and the result holds none. `vaes`
    is a `MediaVAEs` or any object with its `on_device` / `decode_video(latents, between_blocks)` / `decode_audio` /
    `sample_rate` (an adapter over another implementation's VAEs; a `video_sink` needs its `stream_video` too)."""
    after_stage = after_stage or (lambda name: None)
    with vaes.on_device():
        if video_sink is None:
            frames, num_frames = vaes.decode_video(video_latents, between_blocks), 0
        else:
            frames, num_frames = None, vaes.stream_video(video_latents, video_sink, between_blocks)
        after_stage("decode.video")
        if between_blocks is not None:
            between_blocks()
        waveform = vaes.decode_audio(audio_latents)
        after_stage("decode.audio")
    return DecodedMedia(frames, waveform, vaes.sample_rate, num_frames=num_frames)
