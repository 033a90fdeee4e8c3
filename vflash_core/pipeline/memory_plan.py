"""One memory plan for a pipeline's device: where each part lives, chosen from the parts' sizes, the profile's largest
request and the memory the device has (or a user cap), with one margin; one log line; refusals with the numbers.

Parts and their placements:

* the core's main blocks: `resident` (every block on the device) or `block-ring` (two device slots fed from a pinned
  host arena, `residency.BlockRing`); its auxiliary tensors (patch projections, text refiner, heads) are always on the
  device;
* the text encoder: `resident` (on the device between requests), `offload` (on the device for its stage only) or
  `stream` (for its stage, the embeddings and the vision tower on the device and the decoder layers passing through
  two device slots of one layer from a pinned host arena, `residency.ModuleRing`);
* the VAEs: `resident` or `offload`; the video decode `diffusers` (its `decode`, whose working memory grows with the
  clip) or `native` (`vae_decode.NativeVideoDecoder`: the same frames bit for bit, working memory of one window; with
  a peer device, split between the two, see `decode_bytes`).

A request runs three stages one after the other: encode, denoise, decode. A stage's peak is what stays on the device
between stages (the core's weights, the resident parts) plus what the stage brings (an offloaded or streamed part)
plus its transient tensors (`encode_bytes`, `denoise_bytes`, `decode_bytes`: upper estimates from the shapes). A
placement fits when every stage's peak plus `MARGIN_BYTES` is within the budget.

Choice (`plan_memory`): the first placement, in the order of preference, whose stages all fit the profile's largest
request: the core resident before block-ring, the encoder offloaded before streamed, the diffusers decode before the
native one (explicit `weight_residency` / `encoder_residency` choices are kept). When none fits the largest request,
the most frugal placement is taken if the weights alone fit, and each request is checked before it runs
(`MemoryPlan.check`); when even the weights do not fit, loading is refused with the numbers.

Budget: on CUDA the least over the plan's devices of the driver's free memory plus this process's cached blocks,
within a user cap (`max_device_memory`), which the session also enforces through PyTorch's allocator (`DeviceCap`),
even where an estimate was low. On the CPU a cap is planned against (the tests exercise streaming and refusals
there) but host memory is not limited; without a cap nothing is planned on the CPU.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..engine.config import H3Config
from ..engine.device_owner import module_tensors
from ..engine.layout import (
    FPS,
    VAE_FRAMES_PER_CHUNK,
    VAE_LATENTS_PER_CHUNK,
    Geometry,
    audio_latent_count,
    video_latent_frames,
)
from ..errors import Number, RequestError, RunFailedError, VflashError
from ..media.references import CanvasRules
from ..media.vae_decode import CALLS_IN_FLIGHT_PER_DEVICE, DEFAULT_WINDOWS_PER_CALL, DecodeGeometry

__all__ = [
    "DEVICE_MEMORY_GIB", "GIB", "DeviceCap", "MemoryPlan", "PartSizes", "cap_bytes", "decode_bytes", "denoise_bytes",
    "encode_bytes", "largest_clip_frames", "largest_request", "largest_request_rows", "plan_memory", "request_rows",
]

if TYPE_CHECKING:
    from ..engine.artifact import CompiledArtifact
    from ..media.conditioning import TextConditioner
    from ..media.vae import MediaVAEs
    from ..profiles import Profile

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Device memory kept free beyond the estimates: allocator fragmentation, kernels' workspaces, the audio decode and the
# VAE encode of conditioning frames (not estimated), other users of the device.
MARGIN_BYTES = 2 * GIB
RELEASED_CANVAS = CanvasRules()  # the released model's canvas rules, what the plan is sized for by default
STAGES = ("encode", "denoise", "decode")
# The request the plan is sized for: the profile's longest clip on the model's 16:9 canvas, with this many text rows
# and, in keyframe and reference modes, two canvas-sized pictures.
PLANNED_TEXT_ROWS = 512
PLANNED_PICTURES = 2


# -- estimates ------------------------------------------------------------------------------------------------------


def largest_clip_frames(profile: Profile) -> int:
    """The longest clip a profile accepts, in frames of the form 17 n + 5."""
    return (int(profile.max_seconds * FPS + 1e-6) - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK * VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


def request_rows(config: H3Config, geometry: Geometry, text_rows: int) -> int:
    """Packed rows of a t2va request: text, both audio channels' latents, every latent frame's patches."""
    return text_rows + 2 * audio_latent_count(geometry.num_frames) + geometry.num_latent_frames * geometry.rows_per_frame(config.patch_size)


def largest_request_rows(profile: Profile, config: H3Config, canvas: CanvasRules = RELEASED_CANVAS) -> int:
    """Packed rows of the profile's longest clip on the model's 16:9 canvas with the planned text rows."""
    return request_rows(config, Geometry(*canvas.default_canvas(), largest_clip_frames(profile)), PLANNED_TEXT_ROWS)


def denoise_bytes(config: H3Config, rows: int) -> int:
    """Upper estimate of one evaluation's transient device memory at `rows` packed rows (bf16 blocks).

    Per row, the main block's largest live set with the reference operations (the fused ones hold less): the residual
    stream and the normalised input (2H), plus either the attention's fused QKV (3I, kept by v), q and k normalised
    (2I) and rotated (2I) and its output (I), or the FFN's [value; gate] projection (2F), SiLU (F) and product (F);
    plus 2 KiB of request state (rotary cos/sin, fp32 latent rows and velocities, each evaluation's row indices); with
    a 10 % allowance for the allocator and the attention kernel's workspace.
    """
    h, i, f = config.hidden_size, config.inner_dim, config.ffn_dim
    per_row = 2 * (2 * h + max(8 * i, 4 * f)) + 2048
    return int(rows * per_row * 1.1)


def encode_bytes(text_config, vision_config, tokens: int, patches: int, itemsize: int) -> int:
    """Upper estimate of one text encode's transient device memory: `tokens` presentation tokens, `patches` vision
    patches (before merging), `itemsize` bytes per element of the encoder's dtype.

    Per token: every layer's hidden state, kept for `hidden_states[50]` (layers + 1 rows of the hidden width), the
    residual and normalised streams, and the larger of a layer's MLP (gate, up, SiLU and product: 4 x intermediate)
    and its attention (q, k, v with their normalised and rotated copies and the output). Per patch: the vision
    block's stream and normalised input, the larger of its attention (QKV, output, one more) and its MLP (projection
    and activation), and the merger's four outputs (the final one and the deepstack taps) at the text width, counted
    per patch as an upper bound. A 25 % allowance.
    """
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    q = text_config.num_attention_heads * text_config.head_dim
    kv = text_config.num_key_value_heads * text_config.head_dim
    per_token = (text_config.num_hidden_layers + 1) * hidden + 2 * hidden + max(4 * inter, 4 * q + 6 * kv + hidden)
    width, vision_inter = vision_config.hidden_size, vision_config.intermediate_size
    per_patch = 2 * width + max(5 * width, 2 * vision_inter) + 4 * vision_config.out_hidden_size
    return int((tokens * per_token + patches * per_patch) * itemsize * 1.25)


def decode_bytes(video_vae, num_frames: int, height: int, width: int, decoder: str, windows_per_call: int) -> int:
    """Upper estimate of the video decode's transient device memory for a clip of `num_frames` at `height` x `width`.

    One tile-window (a spatial tile of one temporal window) is a ViT sequence of D-wide tokens, one per latent voxel:
    per token the fp32 residual stream in and out (8D), the normalised input (2D) and the larger of the attention (q, k,
    v, their fp32 norms, rotated copies and output: 20D) and the SwiGLU (projection, SiLU, product: 8 x inner). Its
    pixels take 3 channels x 4 bytes per output pixel. Both decoders hold a window's tiles and its stitched clip
    (twice, while it is concatenated). `diffusers` decodes one tile-window at a time but keeps the whole video on the
    device, then maps it to [0, 1] in fp32 (12 bytes per channel and pixel at the peak); `native` runs
    `windows_per_call` tile-windows per call (at most the clip's) with the outputs of the calls in flight, and copies
    each window's frames to the host. A 10 % allowance.

    With a peer device the native decode splits its calls between the two devices. The first device's transient is
    then no larger (its own calls, one window, and the peer's tiles arriving one call at a time from host memory); the
    peer holds a replica of the decoder's weights (part of the VAEs' bytes the first device holds) and its own calls
    in flight, both below the first device's share, and a plan's budget is the least over its devices, so this one
    estimate bounds the peer's decode as well.
    """
    config = video_vae.config
    geometry = DecodeGeometry.from_vae(video_vae)
    plan = geometry.plan(video_latent_frames(num_frames), height // geometry.spatial_ratio, width // geometry.spatial_ratio)
    d = config.decoder_num_attention_heads * config.decoder_attention_head_dim
    tokens = plan.window_latents * plan.tile_height * plan.tile_width + config.decoder_num_register_tokens + 1
    vit = tokens * (10 * d + max(20 * d, 8 * config.decoder_ffn_mult * d))
    window_frames = plan.window_latents * geometry.temporal_ratio
    tile = 3 * window_frames * plan.tile_height * plan.tile_width * geometry.spatial_ratio**2 * 4
    clip = 3 * window_frames * height * width * 4
    window = plan.tiles_per_window * tile + 2 * clip
    if decoder == "diffusers":
        total = vit + window + 12 * 3 * plan.output_frames * height * width
    else:
        per_call = min(windows_per_call, len(plan.tile_windows()))
        in_flight = min((CALLS_IN_FLIGHT_PER_DEVICE + 1) * per_call, len(plan.tile_windows()))
        total = per_call * vit + in_flight * tile + window
    return int(total * 1.1)


# -- sizes ----------------------------------------------------------------------------------------------------------


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module_tensors(module).values())


@dataclass(frozen=True)
class PartSizes:
    """Bytes of each part's weights (0: the part is not planned here)."""

    core_blocks: int = 0  # every main block
    core_block: int = 0  # the largest main block: one ring slot
    core_auxiliary: int = 0  # always on the device with the core
    encoder: int = 0  # the whole text encoder as loaded
    encoder_layers: int = 0  # its decoder layers: what streams
    encoder_layer: int = 0  # its largest decoder layer: one ring slot
    vaes: int = 0  # video and audio VAE

    @classmethod
    def of(cls, artifact: CompiledArtifact | None = None, conditioner: TextConditioner | None = None, vaes: MediaVAEs | None = None) -> PartSizes:
        """The sizes of loaded parts: the compiled core's from its manifest, the encoder's and the VAEs' tensors."""
        sizes = cls()
        if artifact is not None:
            blocks = [int(b["size"]) for b in artifact.manifest["blocks"]]
            sizes = replace(sizes, core_blocks=sum(blocks), core_block=max(blocks), core_auxiliary=int(artifact.manifest["auxiliary"]["size"]))
        if conditioner is not None:
            layers = [_nbytes(layer) for layer in conditioner.decoder_layers()]
            sizes = replace(sizes, encoder=_nbytes(conditioner.text_encoder), encoder_layers=sum(layers), encoder_layer=max(layers))
        if vaes is not None:
            sizes = replace(sizes, vaes=_nbytes(vaes.video_vae) + _nbytes(vaes.audio_vae))
        return sizes


def largest_request(
    profile: Profile, config: H3Config | None = None, conditioner: TextConditioner | None = None, vaes: MediaVAEs | None = None,
    canvas: CanvasRules = RELEASED_CANVAS,
) -> dict[str, int]:
    """Transient bytes of each stage of the largest request the plan is sized for (the profile's longest clip on the
    model's 16:9 canvas, see `PLANNED_TEXT_ROWS`), for the parts given: stage -> bytes, with the decode as
    `decode.diffusers` and `decode.native`."""
    height, width = canvas.default_canvas()
    frames = largest_clip_frames(profile)
    needs: dict[str, int] = {}
    if config is not None:
        needs["denoise"] = denoise_bytes(config, largest_request_rows(profile, config, canvas))
    if conditioner is not None:
        processor = conditioner.image_processor
        pictures = PLANNED_PICTURES if set(profile.modes) - {"t2va"} else 0
        patches = pictures * (height // processor.patch_size) * (width // processor.patch_size)
        needs["encode"] = conditioner.encode_bytes(PLANNED_TEXT_ROWS + patches // processor.merge_size**2, patches)
    if vaes is not None:
        for decoder in ("diffusers", "native"):
            needs[f"decode.{decoder}"] = decode_bytes(vaes.video_vae, frames, height, width, decoder, DEFAULT_WINDOWS_PER_CALL)
    return needs


# -- the budget and the cap -----------------------------------------------------------------------------------------


def device_budget(devices: Sequence[torch.device], cap: int | None) -> int:
    """Bytes this process may still allocate on each of `devices` now (the least over them): on CUDA the driver's free
    memory plus its own cached blocks, within the cap; on the CPU, the cap."""
    if devices[0].type != "cuda":
        if cap is None:
            raise VflashError("a memory plan on the CPU needs a cap (max_device_memory)")
        return cap
    budgets = []
    for device in devices:
        allocated = torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - allocated
        budgets.append(free if cap is None else min(free, cap - allocated))
    return min(budgets)


#: A user cap on device memory in GiB: positive, and bounded (1 PiB, far above any device) so that its byte count is
#: an integer.
DEVICE_MEMORY_GIB = Number(float, 0, 2**20, above=True, unit="GiB")


def cap_bytes(max_device_memory: object, name: str = "max_device_memory") -> int | None:
    """A user cap in GiB (`max_device_memory`, None for none) in bytes, checked by `DEVICE_MEMORY_GIB` (`name` in the
    refusal)."""
    return None if max_device_memory is None else int(DEVICE_MEMORY_GIB.check(name, max_device_memory) * GIB)


class DeviceCap:
    """A cap enforced by PyTorch's CUDA caching allocator on each device until `release()`: the per-process memory
    fraction is set to cap / total, so an allocation that would take this process's reserved memory past the cap
    fails (out of memory) whatever the estimates said. Memory outside the allocator (the CUDA context, NCCL's
    buffers) is not counted. The fraction is per process and device: `release()` restores the one it replaced."""

    def __init__(self, cap: int, devices: Sequence[torch.device]):
        self.cap = cap
        self.previous: dict[torch.device, float] = {}
        for device in devices:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                self.previous[device] = torch.cuda.get_per_process_memory_fraction(device)
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)

    def release(self) -> None:
        for device, fraction in self.previous.items():
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        self.previous = {}


# -- the plan -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where each part lives (None: the part is not planned here)."""

    core: str | None = None  # "resident" | "block-ring"
    encoder: str | None = None  # "resident" | "offload" | "stream"
    vaes: str | None = None  # "resident" | "offload"
    video_decoder: str | None = None  # "diffusers" | "native"


def _size(n: int) -> str:
    """Bytes for a person: GiB from 1 GiB on, MiB below."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def _cap_note(cap: int | None) -> str:
    return "" if cap is None else f" (cap {_size(cap)})"


@dataclass(frozen=True)
class MemoryPlan:
    """A placement of the parts on `devices` (the first holds the encoder and the VAEs; every one a copy of the core)
    with the numbers it was chosen from."""

    devices: tuple[torch.device, ...]
    budget: int
    cap: int | None
    sizes: PartSizes
    placement: Placement
    largest: Mapping[str, int]  # stage transients of the largest planned request
    fits_largest: bool

    def resident_bytes(self) -> int:
        """What stays on the device between stages: the core's weights and the resident parts."""
        s, p = self.sizes, self.placement
        core = {None: 0, "resident": s.core_blocks + s.core_auxiliary, "block-ring": 2 * s.core_block + s.core_auxiliary}[p.core]
        return core + (s.encoder if p.encoder == "resident" else 0) + (s.vaes if p.vaes == "resident" else 0)

    def brought_bytes(self, stage: str) -> int:
        """The weights a stage brings to the device for its duration."""
        s, p = self.sizes, self.placement
        if stage == "encode":
            return {"offload": s.encoder, "stream": s.encoder - s.encoder_layers + 2 * s.encoder_layer}.get(p.encoder or "", 0)
        if stage == "decode":
            return s.vaes if p.vaes == "offload" else 0
        return 0

    def transient(self, needs: Mapping[str, int], stage: str) -> int:
        """A stage's transient bytes in `needs` (the decode's for this plan's video decoder)."""
        return needs.get(f"decode.{self.placement.video_decoder}", needs.get("decode", 0)) if stage == "decode" else needs.get(stage, 0)

    def peaks(self, needs: Mapping[str, int]) -> dict[str, int]:
        """Each stage's device peak for a request's stage transients."""
        resident = self.resident_bytes()
        return {stage: resident + self.brought_bytes(stage) + self.transient(needs, stage) for stage in STAGES}

    def fits(self, needs: Mapping[str, int]) -> bool:
        return all(peak + MARGIN_BYTES <= self.budget for peak in self.peaks(needs).values())

    def summary(self) -> str:
        """The plan in one line: sizes, choices, the largest request's stage peaks and the budget."""
        s, p = self.sizes, self.placement
        parts = []
        if p.core is not None:
            parts.append(f"core {_size(s.core_blocks)} blocks + {_size(s.core_auxiliary)} auxiliary -> {p.core}")
        if p.encoder is not None:
            parts.append(f"text encoder {_size(s.encoder)} ({_size(s.encoder_layers)} in decoder layers) -> {p.encoder}")
        if p.vaes is not None:
            parts.append(f"VAEs {_size(s.vaes)} -> {p.vaes}, video decode {p.video_decoder}")
        planned = {"encode": p.encoder, "denoise": p.core, "decode": p.vaes}  # the part that runs each stage
        peaks = ", ".join(f"{stage} {_size(peak)}" for stage, peak in self.peaks(self.largest).items()
                          if planned[stage])
        verdict = "fits" if self.fits_largest else "does not fit: each request is checked before it runs"
        return (
            f"memory plan on {', '.join(str(d) for d in self.devices)}: {'; '.join(parts)}; the largest planned request peaks at "
            f"{peaks} + {_size(MARGIN_BYTES)} margin, {_size(self.budget)} available{_cap_note(self.cap)}: {verdict}"
        )

    def available(self) -> int:
        """Bytes a stage may add now on each device (the least over them): on CUDA the allocator's and the driver's
        numbers within the cap, on the CPU the cap less the resident parts."""
        if self.devices[0].type != "cuda":
            return self.budget - self.resident_bytes()
        return device_budget(self.devices, self.cap)

    def check(self, needs: Mapping[str, int], what: str, advice: str = "Use a smaller canvas or a shorter clip.") -> None:
        """Refuse, before it runs, a request whose stages (stage -> transient bytes; the decode's for this plan's
        video decoder) do not fit what is available now beside the parts already on the device, with the margin."""
        available = self.available()
        for stage in (s for s in STAGES if s in needs):
            brought, transient = self.brought_bytes(stage), needs[stage]
            if brought + transient + MARGIN_BYTES > available:
                detail = f"{_size(transient)} transient" + (f" + {_size(brought)} of weights it brings" if brought else "")
                raise RequestError(
                    f"{what}: the {stage} stage needs about {_size(brought + transient)} on {self.devices[0]} ({detail}) plus a "
                    f"{_size(MARGIN_BYTES)} margin; {_size(available)} are available{_cap_note(self.cap)}. {advice}"
                )

    def place(self, conditioner: TextConditioner | None = None, vaes: MediaVAEs | None = None) -> None:
        """Apply the placement to a loaded encoder and VAEs (before they read their weights: see `materialize`)."""
        if conditioner is not None:
            conditioner.keep_on_device = self.placement.encoder == "resident"
            if self.placement.encoder == "stream":
                conditioner.stream_layers()
            conditioner.memory_plan = self
        if vaes is not None:
            vaes.keep_on_device = self.placement.vaes == "resident"
            vaes.video_decoder = self.placement.video_decoder


def _candidates(sizes: PartSizes, weight_residency: str, encoder_residency: str) -> list[Placement]:
    """Placements in the order of preference (fastest first, most frugal last); None for a part not planned here."""
    resident = encoder_residency == "resident"
    core = ["resident", "block-ring"] if weight_residency == "auto" else [weight_residency]
    cores = core if sizes.core_blocks else [None]
    encoders = (["resident"] if resident else ["offload", "stream"]) if sizes.encoder else [None]
    vaes = (["resident"] if resident else ["offload"]) if sizes.vaes else [None]
    decoders = ["diffusers", "native"] if sizes.vaes else [None]
    return [Placement(*choice) for choice in itertools.product(cores, encoders, vaes, decoders)]


def plan_memory(
    sizes: PartSizes,
    largest: Mapping[str, int],
    devices: Sequence[torch.device],
    cap: int | None = None,
    weight_residency: str = "auto",
    encoder_residency: str = "offload",
    budget: int | None = None,
) -> MemoryPlan:
    """Choose the placement (see the module docstring), log it in one line, or refuse with the numbers.

    `largest`: stage -> transient bytes of the largest request to plan for (`largest_request`). `budget` defaults to
    `device_budget(devices, cap)`."""
    devices = tuple(devices)
    budget = device_budget(devices, cap) if budget is None else budget
    plans = [MemoryPlan(devices, budget, cap, sizes, p, largest, True) for p in _candidates(sizes, weight_residency, encoder_residency)]
    plan = next((p for p in plans if p.fits(largest)), None)
    if plan is None:
        plan = replace(plans[-1], fits_largest=False)
        if not plan.fits({}):
            stage, peak = max(plan.peaks({}).items(), key=lambda item: item[1])
            p = plan.placement
            placement = ", ".join(f"{name} {choice}" for name, choice in (("core", p.core), ("text encoder", p.encoder), ("VAEs", p.vaes)) if choice)
            explicit = [f"{name}={value!r}" for name, value, default in (("weight_residency", weight_residency, "auto"), ("encoder_residency", encoder_residency, "offload")) if value != default]
            if devices[0].type != "cuda":  # on the CPU the budget is the cap: nothing else is measured
                advice = " Raise max_device_memory, or leave it out on the CPU (no cap: everything stays in host memory)."
            elif explicit:
                advice = f" Leave {' and '.join(explicit)} to the plan, or use a larger GPU."
            else:
                advice = " This GPU is too small for H3."
            raise RunFailedError(
                f"the weights do not fit on {devices[0]}: with the most frugal placement ({placement}) the {stage} stage holds "
                f"{_size(peak)} of weights, plus a {_size(MARGIN_BYTES)} margin; {_size(budget)} are available"
                f"{_cap_note(cap)}.{advice}"
            )
    logger.info(plan.summary())
    return plan
