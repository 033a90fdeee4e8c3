"""`NativeEngineSession`: one profile, one device, one loaded compiled model, reused across serial requests.

Ownership (seed 001): the session owns its profile, device and weights; each `generate` call owns its request's
tensors. Closing waits for the device, then drops every weight reference. A trajectory that fails (anything other
than bad input, or an abort raised by the caller's own progress callback) marks the session failed: it refuses
further calls and must be closed and replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .artifact import CompiledArtifact
from .attention import resolve_attention
from .bundle import MODE_VARIANT, BundleHandoff, ConditioningBundle
from .compiler import device_arch
from .denoise import DenoiseOutput, Denoiser, ProgressFn, ResidentBlocks
from .errors import IdentityMismatchError, SessionClosedError, VflashError
from .layout import FPS
from .profiles import Profile, get_profile

logger = logging.getLogger(__name__)

RESIDENCIES = ("auto", "resident")


@dataclass
class SessionTiming:
    """Seed 002 timing fields of one request."""

    request_index: int  # 1-based index of this request in the session
    initialization_seconds: float  # time the session took to initialise
    initialization_charged_seconds: float  # initialization_seconds on the first request, 0 afterwards
    request_wall_seconds: float  # this request inside the initialised session (incl. writing an output file)


@dataclass
class GenerationResult:
    """video_latents: (1, C, F, h, w) fp32 CPU; audio_latents: (2, C_audio, A) fp32 CPU."""

    video_latents: torch.Tensor
    audio_latents: torch.Tensor
    session: SessionTiming
    metadata: dict[str, object] = field(default_factory=dict)


class NativeEngineSession:
    """Run fixed-schedule H3 trajectories for one profile on one device.

    Args:
        profile: a registered profile id or a `Profile`.
        artifact, schedule_overlay, auxiliary: the three outputs of one `compile`.
        device: `"cpu"` or `"cuda:N"`; must match the architecture the artifact was compiled on.
        weight_residency: `"resident"` (weights on the device) or `"auto"`.
        attention_backend: see `attention.BACKENDS`; the backend used is logged once and reported per result.
        on_load_progress: called with (blocks loaded, total) while weights load.
    """

    def __init__(
        self,
        profile: Profile | str,
        artifact: str | Path,
        schedule_overlay: str | Path,
        auxiliary: str | Path,
        device: str | torch.device = "cpu",
        weight_residency: str = "auto",
        attention_backend: str = "auto",
        on_load_progress: Callable[[int, int], None] | None = None,
    ):
        start = time.perf_counter()
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if weight_residency not in RESIDENCIES:
            raise VflashError(f"weight_residency must be one of {', '.join(RESIDENCIES)}, got {weight_residency!r}")
        self.compiled = CompiledArtifact(artifact, schedule_overlay, auxiliary)
        self.compiled.check_profile(self.profile)
        arch = device_arch(self.device)
        if arch != self.compiled.arch:
            raise IdentityMismatchError(f"the artifact was compiled on {self.compiled.arch}; device {self.device} is {arch}")
        self.attention_backend, attention = resolve_attention(attention_backend, self.device)
        self.weight_residency = "resident"
        total = self.compiled.config.num_layers
        blocks = ResidentBlocks(self.compiled, self.device, None if on_load_progress is None else lambda i: on_load_progress(i + 1, total))
        self._denoiser: Denoiser | None = Denoiser(self.compiled, blocks, self.device, attention)
        self._failure: str | None = None
        self._requests = 0
        self.initialization_seconds = time.perf_counter() - start
        logger.info(
            "Vflash session %s on %s: attention %s, weights %s, initialised in %.2f s",
            self.profile.id, self.device, self.attention_backend, self.weight_residency, self.initialization_seconds,
        )

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> NativeEngineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._denoiser is None

    def close(self) -> None:
        """Wait for the device, then release every weight this session owns. Idempotent."""
        if self._denoiser is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._denoiser.close()
        self._denoiser = None

    def _check_usable(self) -> Denoiser:
        if self._failure is not None:
            raise SessionClosedError(f"this session failed earlier ({self._failure}); close it and create a new one")
        if self._denoiser is None:
            raise SessionClosedError("this session is closed; create a new NativeEngineSession")
        return self._denoiser

    # -- requests -------------------------------------------------------------------------------------------------

    def validate(self, bundle: ConditioningBundle) -> None:
        """Everything about a request that can be checked before any heavy work; raises `VflashError`."""
        bundle.validate()
        bundle.check_model(self.compiled.config)
        self.profile.check_mode(bundle.mode)
        if MODE_VARIANT[bundle.mode] != self.profile.variant:
            raise VflashError(f"a {bundle.mode} request needs the {MODE_VARIANT[bundle.mode]} partition; profile {self.profile.id} runs {self.profile.variant}")
        self.profile.check_duration(bundle.geometry.num_frames / FPS)

    def generate(
        self,
        bundle: ConditioningBundle | BundleHandoff | str | Path,
        progress: ProgressFn | None = None,
        between_blocks: Callable[[], None] | None = None,
        output_latents: str | Path | None = None,
    ) -> GenerationResult:
        """Denoise one request. `bundle` may be a bundle, a one-shot handoff, or a persisted bundle folder.

        `progress(done, total)` runs after every evaluation and `between_blocks()` between blocks; an exception they
        raise aborts the request and leaves the session usable. With `output_latents`, the latents are also written
        there atomically, inside the timed region.
        """
        denoiser = self._check_usable()
        if isinstance(bundle, BundleHandoff):
            bundle = bundle.consume()
        elif not isinstance(bundle, ConditioningBundle):
            bundle = ConditioningBundle.load(bundle)
        self.validate(bundle)
        if output_latents is not None:
            from .fileio import check_writable_destination

            check_writable_destination(output_latents)
        aborted = False

        def guarded(fn: Callable[..., None] | None) -> Callable[..., None] | None:
            if fn is None:
                return None

            def call(*args: int) -> None:
                nonlocal aborted
                try:
                    fn(*args)
                except BaseException:
                    aborted = True
                    raise

            return call

        start = time.perf_counter()
        try:
            output = denoiser.run(bundle, guarded(progress), guarded(between_blocks))
            if output_latents is not None:
                write_latents(output_latents, output, {"profile": self.profile.id, "mode": bundle.mode})
        except BaseException as exc:
            if not aborted and not isinstance(exc, VflashError):
                self._failure = f"{type(exc).__name__}: {exc}"
            raise
        wall = time.perf_counter() - start
        self._requests += 1
        timing = SessionTiming(self._requests, self.initialization_seconds, self.initialization_seconds if self._requests == 1 else 0.0, wall)
        metadata = {
            "profile": self.profile.id,
            "mode": bundle.mode,
            "device": str(self.device),
            "attention_backend": self.attention_backend,
            "weight_residency": self.weight_residency,
            "compile_id": self.compiled.compile_id,
            "nfe": denoiser.nfe,
        }
        return GenerationResult(output.video_latents, output.audio_latents, timing, metadata)


def write_latents(path: str | Path, output: DenoiseOutput, metadata: dict[str, str]) -> Path:
    """Latents as safetensors (`video_latents`, `audio_latents`), published atomically, never overwriting."""
    from safetensors.torch import save_file

    from .fileio import atomic_file

    with atomic_file(path) as tmp:
        save_file({"video_latents": output.video_latents.contiguous(), "audio_latents": output.audio_latents.contiguous()}, str(tmp), metadata=metadata)
    return Path(path)
