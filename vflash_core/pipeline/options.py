"""How a pipeline runs its requests, never what they generate: one options object for the command line, the HTTP
service and its worker, `H3Pipeline.from_prepared` and any other front end.

`RunOptions` holds the engine's options whole (`engine.engine_options.EngineOptions`, handed to the session as they
are) beside the pipeline's own (the encoder's placement, MP4 delivery, diagnostics). It checks its choices when it is
built; `check_devices` checks, before anything loads, that this machine has the devices and that they are of the
architecture the profile's tables were computed on.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from ..engine.engine_options import EngineOptions
from ..errors import VflashError, check_choice
from ..formats import check_device
from ..media.mp4_options import (
    DEFAULT_CRF,
    DEFAULT_PRESET,
    VIDEO_CRF,
    VIDEO_INPUTS,
    VIDEO_PRESETS,
    VIDEO_THREADS,
    check_delivery_options,
)

if TYPE_CHECKING:  # this module imports no torch: the command line's parsers are built from it
    import torch

    from ..profiles import Profile

__all__ = ["RunOptions"]

ENCODER_RESIDENCIES = ("offload", "resident")  # where the text encoder and the VAEs live between their stages


@dataclass(frozen=True, init=False)
class RunOptions:
    """engine: the native core's options (`EngineOptions`: devices, strategy, residency, attention, execution, the
    device cap and host budget, which the pipeline plans for every part, the fast mode), given whole or by their
    keywords (`RunOptions(device=0, max_device_memory=20)`; with `engine`, the keywords replace its fields) and read
    through (`options.device`); a pipeline uses one peer GPU at most. encoder_residency: where the text encoder and
    the VAEs live on a GPU; media_video_input, media_video_threads: MP4 delivery; media_video_crf, media_video_preset:
    the H.264 encoder's quality (CRF 0-51) and speed (an x264 preset); profile_denoise: per-evaluation device timings
    in the result (a diagnostic); verify_weights: re-hash the compiled weights against their compile-time sha256
    before loading them (slow)."""

    engine: EngineOptions
    encoder_residency: str = "offload"
    media_video_input: str = "stream"
    media_video_threads: int | None = None
    media_video_crf: int = DEFAULT_CRF
    media_video_preset: str = DEFAULT_PRESET
    profile_denoise: bool = False
    verify_weights: bool = False

    def __init__(self, engine: EngineOptions | None = None, **values: Any) -> None:
        own = {f.name for f in fields(RunOptions)}
        engine_values = {name: value for name, value in values.items() if name not in own}
        if engine is None:
            engine = EngineOptions(**engine_values)
        elif not isinstance(engine, EngineOptions):
            raise VflashError(f"engine must be an EngineOptions, got {type(engine).__name__}")
        elif engine_values:
            engine = replace(engine, **engine_values)
        object.__setattr__(self, "engine", engine)
        for f in fields(RunOptions):
            if f.name != "engine":
                object.__setattr__(self, f.name, values.get(f.name, f.default))
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """The engine's options read through: `options.device` is `options.engine.device`."""
        engine = self.__dict__.get("engine")
        if engine is None or name not in engine.__dataclass_fields__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(engine, name)

    def __post_init__(self) -> None:
        check_choice("encoder_residency", self.encoder_residency, ENCODER_RESIDENCIES)
        if len(self.engine.peers) > 1:
            raise VflashError(
                f"a pipeline splits a request over two GPUs at most; got {len(self.engine.peers)} peer devices"
            )
        check_delivery_options(
            self.media_video_input, self.media_video_threads, self.media_video_crf, self.media_video_preset
        )
        for name in ("profile_denoise", "verify_weights"):
            if not isinstance(getattr(self, name), bool):
                raise VflashError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def check_devices(self, profile: Profile) -> tuple[torch.device, torch.device | None]:
        """(device, peer) resolved and checked against this machine and the profile's architecture; the attention
        backend is resolved on the device too, so an unknown or unavailable kernel is refused before any load (an
        approximate one unless the profile is an FP8 profile)."""
        from ..engine.attention import resolve_attention

        engine = self.engine
        primary = check_device(engine.device, profile.arch, profile_id=profile.id)
        resolve_attention(engine.attention_backend, primary, profile.fp8 is not None)
        peer = None if not engine.peers else check_device(engine.peers[0], profile.arch, "peer device", profile.id)
        return primary, peer

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The command-line flags of the run options (`vflash generate`, `vflash compare`, `vflash serve`): the
        engine's (`EngineOptions.add_arguments`, as `vflash denoise` has them) and the pipeline's."""
        EngineOptions.add_arguments(parser)
        parser.add_argument("--encoder-residency", default="offload", choices=ENCODER_RESIDENCIES,
                            help="GPU: move the text encoder and VAEs off the device after each use (default), or "
                                 "keep them there")
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

    @classmethod
    def from_arguments(cls, args: argparse.Namespace, **extra: object) -> RunOptions:
        """The options from `add_arguments`' flags (plus `extra` fields, e.g. profile_denoise)."""
        return cls(
            EngineOptions.from_arguments(args),
            encoder_residency=args.encoder_residency,
            media_video_input=args.media_video_input, media_video_threads=args.media_video_threads,
            media_video_crf=args.media_video_crf, media_video_preset=args.media_video_preset,
            verify_weights=args.verify_weights, **extra,
        )
