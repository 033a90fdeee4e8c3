"""One memory plan for a pipeline's device: where each part lives, chosen from the parts' sizes, the profile's largest
request and the memory the device has (or a user cap), with one margin; one log line; refusals with the numbers.

The planner takes numbers only (`PartSizes`, each stage's transient bytes) and returns a placement; each part states
its own: the core's weights (`CompiledArtifact.part_sizes`) and one evaluation's activations (`core_memory.CoreMemory`)
in the engine, the text encoder's (`TextConditioner.part_sizes`, `TextConditioner.encode_need`) and the VAEs'
(`MediaVAEs.part_sizes`, `MediaVAEs.decode_need`) in media; the parts apply the placement themselves (`place`).
A part also answers, for one stage of one request, what it needs on its device (`MemoryNeed`: the weights it brings
for the stage and the stage's transient tensors); `room` turns the needs of a stage into the bytes to free on each
device, with the margin, for a host that frees memory before a stage (the node pack's ComfyUI).

Parts and their placements:

* the core's main blocks: `resident` (every block on the device), `block-ring` (two device slots fed from a pinned
  host arena, `residency.BlockRing`) or `disk-ring` (the same slots fed from the compiled block files, read on every
  pass into `DISK_RING_BLOCKS` pinned staging buffers; one device only); its auxiliary tensors (patch
  projections, text refiner, heads) are always on the device;
* the text encoder: `resident` (on the device between requests), `offload` (on the device for its stage only),
  `stream` (for its stage, the embeddings and the vision tower on the device and the decoder layers passing through
  two device slots of one layer from a pinned host arena, `residency.ModuleRing`) or `disk-stream` (the same, the
  layers read from the model root's files on every encode into `DISK_RING_BLOCKS` staging buffers, where they can
  be: `PartSizes.encoder_layers_on_disk`);
* the VAEs: `resident` or `offload`; the video decode `diffusers` (its `decode`, whose working memory grows with the
  clip) or `native` (`vae_decode.NativeVideoDecoder`: the same frames bit for bit, working memory of one window; with
  a peer device, split between the two, see `vae.decode_bytes`).

A request runs three stages one after the other: encode, denoise, decode. A stage's peak is what stays on the device
between stages (the core's weights, the resident parts) plus what the stage brings (an offloaded or streamed part)
plus its transient tensors (the parts' `encode_bytes`, `denoise_bytes`, `decode_bytes`: upper estimates from the
shapes). A placement fits when every stage's peak plus `MARGIN_BYTES` is within the budget.

Host memory: a placement holds, between requests, the block-ring arena (every block) or the disk ring's staging
buffers, the offloaded or streamed text encoder (all of it: streamed layers in their arena, the rest offloaded; from
disk, the rest and the staging buffers) and the offloaded VAEs; with a host budget (`max_host_memory`) that plus
`HOST_MARGIN_BYTES` (the process itself: the CUDA libraries, a request's host tensors, reads in flight while loading)
must fit it too. The host budget is planned against, never enforced: the host has no allocator to cap.

Choice (`plan_memory`): the first placement, in the order of preference, whose stages all fit the profile's largest
request and whose host bytes fit the host budget: the core resident before block-ring before disk-ring, the encoder
offloaded before streamed, streamed from disk only after every core placement, the native decode before diffusers'
(the same frames, faster; explicit `weight_residency` / `encoder_residency` choices are kept). When none fits the
largest request, the most frugal placement is taken if the weights alone fit, and each request is checked before it
runs (`MemoryPlan.check`); when even the weights do not fit, or no placement fits the host budget, loading is
refused with the numbers.

Budget: on CUDA the least over the plan's devices of the driver's free memory plus this process's cached blocks,
within the allocator limit a host may have set for the process and within a user cap (`max_device_memory`), which
the session also enforces through PyTorch's allocator (`DeviceCap`), even where an estimate was low. On the CPU a
cap is planned against (the tests exercise streaming and refusals there) but host memory is not limited; without a
cap nothing is planned on the CPU.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from .errors import Number, RequestError, RunFailedError, VflashError
from .fileio import GIB, size_text

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_MEMORY_GIB", "HOST_MARGIN_BYTES", "PLANNED_PICTURES", "PLANNED_TEXT_ROWS", "DeviceCap", "MemoryNeed",
    "MemoryPlan", "PartSizes", "Placement", "cap_bytes", "cap_leaving_free", "check_disk_ring",
    "check_host_budget_on_cpu", "device_budget", "plan_memory", "room",
]

logger = logging.getLogger(__name__)

# Device memory kept free beyond the estimates: allocator fragmentation, kernels' workspaces, the audio decode and the
# VAE encode of conditioning frames (not estimated), other users of the device.
MARGIN_BYTES = 2 * GIB
STAGES = ("encode", "denoise", "decode")
# Host memory kept beyond the parts' weights under a host budget: the process itself (the CUDA and torch libraries'
# resident pages, ~2 GiB on an H200 machine), a request's host tensors, the block or auxiliary reads in flight while
# the core loads.
HOST_MARGIN_BYTES = 4 * GIB
# Pinned staging buffers of a disk ring (`residency.BlockFiles`), one block each: one being copied to the device, two
# being read ahead, so a read has about two blocks' compute to finish in before the ring waits for it.
DISK_RING_BLOCKS = 3
# The request the plan is sized for: the profile's longest clip on the model's 16:9 canvas, with this many text rows
# and, in keyframe and reference modes, two canvas-sized pictures.
PLANNED_TEXT_ROWS = 512
PLANNED_PICTURES = 2


# -- sizes ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartSizes:
    """Bytes of each part's weights (0: the part is not planned here)."""

    core_blocks: int = 0  # every main block
    core_block: int = 0  # the largest main block: one ring slot
    core_auxiliary: int = 0  # always on the device with the core
    encoder: int = 0  # the whole text encoder as loaded
    encoder_layers: int = 0  # its decoder layers: what streams
    encoder_layer: int = 0  # its largest decoder layer: one ring slot
    encoder_layers_on_disk: int = 0  # its decoder layers' bytes that can stream from their files (0: they cannot)
    vaes: int = 0  # video and audio VAE

    def __add__(self, other: PartSizes) -> PartSizes:
        """The sizes of two sets of parts together (each part states only its own fields)."""
        return PartSizes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def core_on_device(self, placement: str | None) -> int:
        """The core's weights on each of its devices: every block (`resident`) or two ring slots (`block-ring`,
        `disk-ring`), with the auxiliary tensors; none where the core is not planned (None)."""
        if placement is None:
            return 0
        blocks = self.core_blocks if placement == "resident" else 2 * self.core_block
        return blocks + self.core_auxiliary

    def encoder_brought(self, placement: str | None) -> int:
        """The text encoder's weights its stage brings to the device: all of it (`offload`), or all but the decoder
        layers and two layer slots (`stream`, `disk-stream`); none where it stays (`resident`) or is not planned."""
        streamed = self.encoder - self.encoder_layers + 2 * self.encoder_layer
        return {"offload": self.encoder, "stream": streamed, "disk-stream": streamed}.get(placement or "", 0)


@dataclass(frozen=True)
class MemoryNeed:
    """What one part needs on one device for one stage of a request: the weights it brings there for the stage (0:
    they stay there, or stay in host memory) and the stage's transient tensors (upper estimates from the shapes)."""

    device: torch.device
    weights: int = 0
    transient: int = 0


def room(needs: Iterable[MemoryNeed]) -> dict[torch.device, int]:
    """The bytes to free on each device for the needs of parts that run one stage together: their weights and
    transients, plus the plan's margin once per device."""
    by_device: dict[torch.device, int] = {}
    for need in needs:
        by_device[need.device] = by_device.get(need.device, MARGIN_BYTES) + need.weights + need.transient
    return by_device


# -- the budget and the cap -----------------------------------------------------------------------------------------


def device_budget(devices: Sequence[torch.device], cap: int | None) -> int:
    """Bytes this process may still allocate on each of `devices` now (the least over them): on CUDA the driver's free
    memory plus its own cached blocks, within the cap and within the limit PyTorch's allocator enforces for this
    process (`set_per_process_memory_fraction`, which a host may have set: an allocation past it fails however much
    the driver has free); on the CPU, the cap."""
    if devices[0].type != "cuda":
        if cap is None:
            raise VflashError("a memory plan on the CPU needs a cap (max_device_memory)")
        return cap
    import torch  # here, not above: the command line's parsers import this module's names without torch

    budgets = []
    for device in devices:
        allocated = torch.cuda.memory_allocated(device)
        budget = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - allocated
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        if fraction < 1.0:
            limit = int(fraction * torch.cuda.get_device_properties(device).total_memory)
            budget = min(budget, limit - allocated)
        budgets.append(budget if cap is None else min(budget, cap - allocated))
    return min(budgets)


def cap_leaving_free(device: str | torch.device, reserved: int) -> float:
    """The cap in GiB (`max_device_memory`) that leaves `reserved` bytes of `device` (a CUDA device) free for other
    software: the card's memory less those bytes; refused where nothing is left."""
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    if reserved >= total:
        raise VflashError(
            f"{size_text(reserved)} of {device} is reserved for other software, all of its {size_text(total)}: "
            "nothing is left for the model (lower the reserve, e.g. ComfyUI's --reserve-vram)"
        )
    return (total - reserved) / GIB


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
        import torch

        self.cap = cap
        self.previous: dict[torch.device, float] = {}
        for device in devices:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                self.previous[device] = torch.cuda.get_per_process_memory_fraction(device)
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)

    def release(self) -> None:
        import torch

        for device, fraction in self.previous.items():
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        self.previous = {}


# -- the plan -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where each part lives (None: the part is not planned here)."""

    core: str | None = None  # "resident" | "block-ring" | "disk-ring"
    encoder: str | None = None  # "resident" | "offload" | "stream" | "disk-stream"
    vaes: str | None = None  # "resident" | "offload"
    video_decoder: str | None = None  # "diffusers" | "native"


def _cap_note(cap: int | None) -> str:
    return "" if cap is None else f" (cap {size_text(cap)})"


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
    host_budget: int | None = None  # max_host_memory in bytes; None: not planned

    def resident_bytes(self) -> int:
        """What stays on the device between stages: the core's weights and the resident parts."""
        s, p = self.sizes, self.placement
        resident = s.core_on_device(p.core)
        return resident + (s.encoder if p.encoder == "resident" else 0) + (s.vaes if p.vaes == "resident" else 0)

    def host_parts(self) -> dict[str, int]:
        """What each part holds in host memory between requests (the module docstring), by part; none held: absent."""
        s, p = self.sizes, self.placement
        held = {
            f"core ({p.core})": {
                "block-ring": s.core_blocks,
                "disk-ring": min(DISK_RING_BLOCKS * s.core_block, s.core_blocks),
            }.get(p.core or "", 0),
            f"text encoder ({p.encoder})": {
                "offload": s.encoder,
                "stream": s.encoder,
                "disk-stream": s.encoder - s.encoder_layers + min(DISK_RING_BLOCKS * s.encoder_layer, s.encoder_layers),
            }.get(p.encoder or "", 0),
            "VAEs (offload)": s.vaes if p.vaes == "offload" else 0,
        }
        return {name: nbytes for name, nbytes in held.items() if nbytes}

    def host_bytes(self) -> int:
        """What the parts hold in host memory between requests, without the margin."""
        return sum(self.host_parts().values())

    def fits_host(self, extra_bytes: int = 0) -> bool:
        """Whether the parts, the margin and `extra_bytes` (a request's host memory beside them) fit the budget."""
        return self.host_budget is None or self.host_bytes() + HOST_MARGIN_BYTES + extra_bytes <= self.host_budget

    def brought_bytes(self, stage: str) -> int:
        """The weights a stage brings to the device for its duration."""
        s, p = self.sizes, self.placement
        if stage == "encode":
            return s.encoder_brought(p.encoder)
        if stage == "decode":
            return s.vaes if p.vaes == "offload" else 0
        return 0

    def transient(self, needs: Mapping[str, int], stage: str) -> int:
        """A stage's transient bytes in `needs` (the decode's for this plan's video decoder)."""
        return (
            needs.get(f"decode.{self.placement.video_decoder}", needs.get("decode", 0)) if stage == "decode"
            else needs.get(stage, 0)
        )

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
            parts.append(
                f"core {size_text(s.core_blocks)} blocks + {size_text(s.core_auxiliary)} auxiliary -> {p.core}"
            )
        if p.encoder is not None:
            parts.append(
                f"text encoder {size_text(s.encoder)} ({size_text(s.encoder_layers)} in decoder layers) -> {p.encoder}"
            )
        if p.vaes is not None:
            parts.append(f"VAEs {size_text(s.vaes)} -> {p.vaes}, video decode {p.video_decoder}")
        planned = {"encode": p.encoder, "denoise": p.core, "decode": p.vaes}  # the part that runs each stage
        peaks = ", ".join(f"{stage} {size_text(peak)}" for stage, peak in self.peaks(self.largest).items()
                          if planned[stage])
        verdict = "fits" if self.fits_largest else "does not fit: each request is checked before it runs"
        host = f"; host memory {size_text(self.host_bytes())} of weights"
        if self.host_budget is not None:
            host += f" + {size_text(HOST_MARGIN_BYTES)} margin, budget {size_text(self.host_budget)}"
        return (
            f"memory plan on {', '.join(str(d) for d in self.devices)}: {'; '.join(parts)}; "
            f"the largest planned request peaks at {peaks} + {size_text(MARGIN_BYTES)} margin, "
            f"{size_text(self.budget)} available{_cap_note(self.cap)}: {verdict}{host}"
        )

    def available(self) -> int:
        """Bytes a stage may add now on each device (the least over them): on CUDA the allocator's and the driver's
        numbers within the cap, on the CPU the cap less the resident parts."""
        if self.devices[0].type != "cuda":
            return self.budget - self.resident_bytes()
        return device_budget(self.devices, self.cap)

    def check(
        self, needs: Mapping[str, int], what: str, advice: str = "Use a smaller canvas or a shorter clip."
    ) -> None:
        """Refuse, before it runs, a request whose stages (stage -> transient bytes; the decode's for this plan's
        video decoder) do not fit what is available now beside the parts already on the device, with the margin."""
        available = self.available()
        for stage in (s for s in STAGES if s in needs):
            brought, transient = self.brought_bytes(stage), needs[stage]
            if brought + transient + MARGIN_BYTES > available:
                detail = f"{size_text(transient)} transient" + (
                    f" + {size_text(brought)} of weights it brings" if brought else ""
                )
                raise RequestError(
                    f"{what}: the {stage} stage needs about {size_text(brought + transient)} on {self.devices[0]} "
                    f"({detail}) plus a {size_text(MARGIN_BYTES)} margin; "
                    f"{size_text(available)} are available{_cap_note(self.cap)}. {advice}"
                )



def _candidates(
    sizes: PartSizes, weight_residency: str, encoder_residency: str, devices: int, host_planned: bool
) -> list[Placement]:
    """Placements in the order of preference (fastest first, most frugal last); None for a part not planned here. The
    disk ring and the encoder streamed from disk, which hold as much device memory as their pinned twins, are
    candidates only under a host budget (the disk ring for one device, the encoder where its layers' files allow)."""
    resident = encoder_residency == "resident"
    rings = ["block-ring"] + ["disk-ring"] * (devices == 1 and host_planned)
    core = ["resident", *rings] if weight_residency == "auto" else [weight_residency]
    cores = core if sizes.core_blocks else [None]
    streams = ["stream"] + ["disk-stream"] * bool(host_planned and sizes.encoder_layers_on_disk)
    encoders = (["resident"] if resident else ["offload", *streams]) if sizes.encoder else [None]
    vaes = (["resident"] if resident else ["offload"]) if sizes.vaes else [None]
    decoders = ["native", "diffusers"] if sizes.vaes else [None]
    placements = [Placement(*choice) for choice in itertools.product(cores, encoders, vaes, decoders)]
    # The encoder from disk after every core placement: its layers are read once per request with little compute to
    # hide the reads (45 GB at full size), where the disk ring's reads hide behind the blocks' compute on most cards.
    return sorted(placements, key=lambda p: p.encoder == "disk-stream")


def plan_memory(
    sizes: PartSizes,
    largest: Mapping[str, int],
    devices: Sequence[torch.device],
    cap: int | None = None,
    weight_residency: str = "auto",
    encoder_residency: str = "offload",
    budget: int | None = None,
    host_budget: int | None = None,
    log: bool = True,
) -> MemoryPlan:
    """Choose the placement (see the module docstring), log it in one line, or refuse with the numbers.

    `largest`: stage -> transient bytes of the largest request to plan for (`largest_request`). `budget` defaults to
    `device_budget(devices, cap)`; `host_budget`: `max_host_memory` in bytes (None: host memory is not planned).
    Every part and stage only adds bytes, so a plan of some of the parts (those whose sizes are known before
    anything loads), `log=False`, refuses what the plan of all of them would refuse, before the others load."""
    devices = tuple(devices)
    check_disk_ring(weight_residency, len(devices))
    budget = device_budget(devices, cap) if budget is None else budget
    candidates = _candidates(sizes, weight_residency, encoder_residency, len(devices), host_budget is not None)
    plans = [MemoryPlan(devices, budget, cap, sizes, p, largest, True, host_budget) for p in candidates]
    within_host = [p for p in plans if p.fits_host()]
    on_device = [p for p in plans if p.fits({})]  # the placements whose weights fit the device
    if not within_host or (on_device and not any(p.fits({}) for p in within_host)):
        _refuse_host(min(on_device or plans, key=MemoryPlan.host_bytes), weight_residency, encoder_residency)
    plans = within_host
    plan = next((p for p in plans if p.fits(largest)), None)
    if plan is None:
        plan = _fastest_twin(plans, _most_frugal(plans, largest))
        plan = replace(plan, fits_largest=False)
        if not plan.fits({}):
            stage, peak = max(plan.peaks({}).items(), key=lambda item: item[1])
            p = plan.placement
            placement = ", ".join(
                f"{name} {choice}"
                for name, choice in (("core", p.core), ("text encoder", p.encoder), ("VAEs", p.vaes))
                if choice
            )
            explicit = _explicit_choices(weight_residency, encoder_residency)
            if devices[0].type != "cuda":  # on the CPU the budget is the cap: nothing else is measured
                advice = (
                    " Raise max_device_memory, or leave it out on the CPU (no cap: everything stays in host memory)."
                )
            elif explicit:
                advice = f" Leave {' and '.join(explicit)} to the plan, or use a larger GPU."
            else:
                advice = " This GPU is too small for H3."
            raise RunFailedError(
                f"the weights do not fit on {devices[0]}: with the most frugal placement ({placement}) "
                f"the {stage} stage holds {size_text(peak)} of weights, plus a {size_text(MARGIN_BYTES)} margin; "
                f"{size_text(budget)} are available{_cap_note(cap)}.{advice}"
            )
    if log:
        logger.info(plan.summary())
    return plan


def check_disk_ring(weight_residency: str, devices: int) -> None:
    """A disk ring feeds one device: asked for with more, refused in one line."""
    if weight_residency == "disk-ring" and devices > 1:
        raise VflashError(
            "weight_residency='disk-ring' streams the blocks to one GPU; "
            "with a peer device use 'block-ring' or 'resident'"
        )


def check_host_budget_on_cpu(host_budget: object, cap: object) -> None:
    """On the CPU a host budget is planned only beside a device cap (the plan's budget there): refused without one."""
    if host_budget is not None and cap is None:
        raise VflashError("max_host_memory is planned with the device memory: on the CPU give max_device_memory too")


def _explicit_choices(weight_residency: str, encoder_residency: str) -> list[str]:
    """The placement options a caller set away from their defaults, as `name='value'` (for a refusal's advice)."""
    return [
        f"{name}={value!r}"
        for name, value, default in (
            ("weight_residency", weight_residency, "auto"), ("encoder_residency", encoder_residency, "offload")
        )
        if value != default
    ]


def _most_frugal(plans: list[MemoryPlan], largest: Mapping[str, int]) -> MemoryPlan:
    """The most frugal placement on the device: the last one's weights (the candidates end with them) with the video
    decoder whose largest request peaks lower."""
    last = plans[-1].placement
    twins = [p for p in plans if replace(p.placement, video_decoder=last.video_decoder) == last]
    return min(twins, key=lambda p: max(p.peaks(largest).values()))


def _fastest_twin(plans: list[MemoryPlan], plan: MemoryPlan) -> MemoryPlan:
    """`plan`, or among `plans` the same placement with a pinned twin for what it reads from disk (the block ring for
    the disk ring, the arena-streamed encoder for the disk-streamed one: the same device memory, faster)."""
    p = plan.placement
    twins = [
        replace(
            p, core="block-ring" if p.core == "disk-ring" else p.core,
            encoder="stream" if p.encoder == "disk-stream" else p.encoder,
        ),
        replace(p, core="block-ring" if p.core == "disk-ring" else p.core),
        replace(p, encoder="stream" if p.encoder == "disk-stream" else p.encoder),
    ]
    return next((q for twin in twins for q in plans if q.placement == twin), plan)


def _refuse_host(plan: MemoryPlan, weight_residency: str, encoder_residency: str) -> None:
    """Refuse a host budget that not even the most frugal placement fits, naming what holds the host memory."""
    held = plan.host_parts()
    parts = ", ".join(f"{name} {size_text(nbytes)}" for name, nbytes in held.items()) or "no weights"
    explicit = _explicit_choices(weight_residency, encoder_residency)
    advice = (
        f"Leave {' and '.join(explicit)} to the plan, or raise max_host_memory." if explicit
        else "Raise max_host_memory."
    )
    if any(name in held for name in ("text encoder (offload)", "text encoder (stream)")):
        advice += (" The text encoder is held in host memory whole: its decoder layers cannot stream from their files "
                   "(a text_encoder_loader's model, or files in another dtype than loaded).")
    raise RunFailedError(
        f"the host memory budget does not fit: the most frugal placement holds {parts} in host memory, plus a "
        f"{size_text(HOST_MARGIN_BYTES)} margin for the process: {size_text(plan.host_bytes() + HOST_MARGIN_BYTES)}; "
        f"max_host_memory is {size_text(plan.host_budget or 0)}. {advice}"
    )
