"""How a pipeline runs its requests, never what they generate: one options object for the command line, the HTTP
service and its worker, `H3Pipeline.from_prepared` and any other front end.

`RunOptions` checks its choices when it is built; `check_devices` checks, before anything loads, that this machine
has the devices and that they are of the architecture the profile's tables were computed on.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine.attention_backends import BACKENDS, CPU_BACKENDS
from ..engine.fast_mode import FastMode
from ..engine.session_options import STRATEGIES, WEIGHT_RESIDENCIES
from ..errors import VflashError, check_choice
from ..formats import GPU_INDEX, check_device, gpu_device
from ..media.mp4_options import (
    DEFAULT_CRF,
    DEFAULT_PRESET,
    VIDEO_CRF,
    VIDEO_INPUTS,
    VIDEO_PRESETS,
    VIDEO_THREADS,
    check_delivery_options,
)
from ..memory_plan import DEVICE_MEMORY_GIB, cap_bytes, check_disk_ring, check_host_budget_on_cpu

if TYPE_CHECKING:  # this module imports no torch: the command line's parsers are built from it
    import torch

    from ..profiles import Profile

__all__ = ["RunOptions"]

ENCODER_RESIDENCIES = ("offload", "resident")  # where the text encoder and the VAEs live between their stages


@dataclass(frozen=True)
class RunOptions:
    """device / peer_device: "cpu", a CUDA index or "cuda:N" (the peer only with a `strategy`); attention_backend: see
    `attention_backends.BACKENDS`; weight_residency, encoder_residency: memory placement on a GPU; max_device_memory: a
    cap in GiB on what the pipeline may hold on each of its devices (the memory plan is made against it and it is
    enforced through PyTorch's allocator; None: the device's free memory); max_host_memory: a budget in GiB for the
    weights the pipeline holds in host memory, with a margin for the process (planned against, not enforced; where the
    blocks' pinned arena does not fit it, the core's blocks stream from their compiled files:
    `weight_residency="disk-ring"`; None: not planned; on the CPU only with max_device_memory); media_video_input,
    media_video_threads: MP4 delivery; media_video_crf, media_video_preset: the H.264 encoder's quality (CRF 0-51) and
    speed (an x264 preset); profile_denoise: per-evaluation device timings in the result (a diagnostic); verify_weights:
    re-hash the compiled weights against their compile-time sha256 before loading them (slow); fast_mode: exact by
    default, or a named approximate mode (`engine.fast_mode.FastMode`, or its names: "sparse-attention", "step-cache" or
    both)."""

    device: int | str = "cpu"
    peer_device: int | str | None = None
    strategy: str | None = None
    attention_backend: str = "auto"
    weight_residency: str = "auto"
    encoder_residency: str = "offload"
    max_device_memory: float | None = None
    max_host_memory: float | None = None
    media_video_input: str = "stream"
    media_video_threads: int | None = None
    media_video_crf: int = DEFAULT_CRF
    media_video_preset: str = DEFAULT_PRESET
    profile_denoise: bool = False
    verify_weights: bool = False
    fast_mode: FastMode = field(default_factory=FastMode)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fast_mode", FastMode.parse(self.fast_mode))  # a name is taken too
        check_choice("weight_residency", self.weight_residency, WEIGHT_RESIDENCIES)
        check_choice("encoder_residency", self.encoder_residency, ENCODER_RESIDENCIES)
        if self.attention_backend not in BACKENDS:  # the name now; whether it runs on the device, in check_devices
            raise VflashError(
                f"unknown attention backend {self.attention_backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if self.strategy is not None:
            check_choice("strategy", self.strategy, STRATEGIES)
        if (self.peer_device is None) != (self.strategy is None):
            raise VflashError("a peer GPU and a strategy go together (e.g. --peer-gpu 1 --strategy sequence-head)")
        check_delivery_options(
            self.media_video_input, self.media_video_threads, self.media_video_crf, self.media_video_preset
        )
        cap_bytes(self.max_device_memory)
        cap_bytes(self.max_host_memory, "max_host_memory")
        if str(self.device) == "cpu":
            check_host_budget_on_cpu(self.max_host_memory, self.max_device_memory)
        check_disk_ring(self.weight_residency, 1 + (self.peer_device is not None))
        self.fast_mode.check_placement(1 + (self.peer_device is not None), self.strategy)
        for name in ("profile_denoise", "verify_weights"):
            if not isinstance(getattr(self, name), bool):
                raise VflashError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def check_devices(self, profile: Profile) -> tuple[torch.device, torch.device | None]:
        """(device, peer) resolved and checked against this machine and the profile's architecture; the attention
        backend is resolved on the device too, so an unknown or unavailable kernel is refused before any load (an
        approximate one unless the profile is an FP8 profile)."""
        from ..engine.attention import resolve_attention

        primary = check_device(self.device, profile.arch, profile_id=profile.id)
        resolve_attention(self.attention_backend, primary, profile.fp8 is not None)
        peer = (
            None if self.peer_device is None
            else check_device(self.peer_device, profile.arch, "peer device", profile.id)
        )
        return primary, peer

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The command-line flags of the run options (`vflash generate`, `vflash compare`, `vflash serve`)."""
        parser.add_argument("--gpu", type=GPU_INDEX.option("--gpu"), help="CUDA device index (default: CPU)")
        parser.add_argument("--peer-gpu", type=GPU_INDEX.option("--peer-gpu"),
                            help="second GPU for the native core (needs --strategy)")
        parser.add_argument("--strategy", choices=STRATEGIES,
                            help="how the core splits one request over two GPUs: sequence-head (one all-to-all per "
                                 "block) or tensor (the weights split, one all-reduce per block)")
        parser.add_argument("--attention-backend", default="auto",
                            help=f"attention kernel, pinned on every call: {', '.join(BACKENDS)}; on the CPU "
                                 f"{', '.join(CPU_BACKENDS)} (default auto: the exact default for the device)")
        parser.add_argument("--weight-residency", default="auto", choices=WEIGHT_RESIDENCIES,
                            help="GPU: the core's blocks all on the device, streamed from pinned host memory "
                                 "(block-ring) or from their compiled files (disk-ring); auto: the memory plan chooses")
        parser.add_argument("--encoder-residency", default="offload", choices=ENCODER_RESIDENCIES,
                            help="GPU: move the text encoder and VAEs off the device after each use (default), or "
                                 "keep them there")
        parser.add_argument("--max-device-memory", type=DEVICE_MEMORY_GIB.option("--max-device-memory"), metavar="GIB",
                            help="cap on the device memory the pipeline may use, in GiB (default: what the GPU has "
                                 "free); placement is planned against it and it is enforced")
        parser.add_argument("--max-host-memory", type=DEVICE_MEMORY_GIB.option("--max-host-memory"), metavar="GIB",
                            help="budget for the host memory the pipeline's weights may hold, in GiB, with a margin "
                                 "for the process (default: not planned); where the core's pinned blocks do not fit, "
                                 "they stream from their compiled files (disk-ring)")
        parser.add_argument("--media-video-input", default="stream", choices=VIDEO_INPUTS,
                            help="feed the H.264 encoder from a temporary RGB file, frame by frame, or while the "
                                 "video decodes (stream)")
        parser.add_argument("--media-video-threads", type=VIDEO_THREADS.option("--media-video-threads"),
                            help="H.264 encoder threads, "
                                 f"{VIDEO_THREADS.describe().removeprefix('an integer ')} (default: automatic)")
        parser.add_argument("--media-video-crf", type=VIDEO_CRF.option("--media-video-crf"), default=DEFAULT_CRF,
                            metavar="CRF", help="H.264 constant rate factor, 0 (lossless) to 51; lower is better "
                                                f"quality and a larger file (default {DEFAULT_CRF})")
        parser.add_argument("--media-video-preset", default=DEFAULT_PRESET, choices=VIDEO_PRESETS, metavar="PRESET",
                            help=f"x264 preset, {', '.join(VIDEO_PRESETS)}: slower compresses better at the same "
                                 f"quality (default {DEFAULT_PRESET})")
        parser.add_argument("--verify-weights", action="store_true",
                            help="re-hash the compiled weights before loading them (slow; loading checks sizes only)")
        FastMode.add_arguments(parser)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace, **extra: object) -> RunOptions:
        """The options from `add_arguments`' flags (plus `extra` fields, e.g. profile_denoise)."""
        return cls(
            device=gpu_device(args.gpu), peer_device=gpu_device(args.peer_gpu, None),
            strategy=args.strategy, attention_backend=args.attention_backend, weight_residency=args.weight_residency,
            encoder_residency=args.encoder_residency,
            max_device_memory=args.max_device_memory, max_host_memory=args.max_host_memory,
            media_video_input=args.media_video_input, media_video_threads=args.media_video_threads,
            media_video_crf=args.media_video_crf, media_video_preset=args.media_video_preset,
            verify_weights=args.verify_weights, fast_mode=FastMode.from_arguments(args),
            **extra,  # type: ignore[arg-type]
        )
