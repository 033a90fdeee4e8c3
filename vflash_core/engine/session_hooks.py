"""A session's trusted hooks: its load-progress callback and the loaders that replace its own loading of the resident
blocks (`native_denoiser_loader`, `block_loader`). Hooks are Python callables given by the caller (code, never options:
never read from a file, a command line or a request, never names resolved to code)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import VflashError, check_callback
from .artifact import CompiledArtifact
from .denoise import Denoiser
from .model import BlockOps, LayerWeights

__all__ = ["BlockLoader", "DenoiserLoad", "NativeDenoiserLoader", "SessionHooks", "check_loader_hooks"]


@dataclass(frozen=True)
class DenoiserLoad:
    """What a `native_denoiser_loader` is handed beside the verified artifact: the device, the block operations the
    session chose for it (execution, attention, FP8) and a callback to call with each block's index once it is loaded
    (None when nobody listens)."""

    device: torch.device
    ops: BlockOps
    on_block: Callable[[int], None] | None


#: (verified artifact, load arguments) -> the `Denoiser` of the session's one device, its blocks resident.
NativeDenoiserLoader = Callable[[CompiledArtifact, DenoiserLoad], Denoiser]
#: (verified artifact, device) -> every main block's weights on that device, in order (checked against the artifact).
BlockLoader = Callable[[CompiledArtifact, torch.device], Sequence[LayerWeights]]


@dataclass(frozen=True)
class SessionHooks:
    """on_load_progress: called with (blocks loaded, total) while weights load. native_denoiser_loader: a callable
    `(artifact, DenoiserLoad) -> Denoiser` that builds the denoiser in place of the session's own loading; resident
    weights on one device only. block_loader: a callable `(artifact, device) -> blocks` supplying the resident block
    stack (names, shapes, dtypes, device and LoRA linears are checked against the artifact); not with
    `native_denoiser_loader` (which loads its own) nor the tensor strategy (which shards blocks)."""

    on_load_progress: Callable[[int, int], None] | None = None
    native_denoiser_loader: NativeDenoiserLoader | None = None
    block_loader: BlockLoader | None = None

    def check(self, strategy: str | None, devices: int) -> list[str]:
        """The names of the loaders given, after checking every hook is a callable used where it can be."""
        check_callback(self.on_load_progress, "on_load_progress")
        return check_loader_hooks(self.native_denoiser_loader, self.block_loader, strategy, devices)

    def load_denoiser(self, artifact: CompiledArtifact, load: DenoiserLoad) -> Denoiser:
        """Call the caller's denoiser loader and check what it returned is a denoiser of this artifact on this
        device."""
        assert self.native_denoiser_loader is not None
        denoiser = self.native_denoiser_loader(artifact, load)
        if not isinstance(denoiser, Denoiser):
            raise VflashError(
                "native_denoiser_loader must return a vflash_core.engine.denoise.Denoiser, "
                f"got {type(denoiser).__name__}"
            )
        if denoiser.artifact is not artifact or denoiser.device != load.device:
            denoiser.close()
            raise VflashError(
                f"native_denoiser_loader returned a denoiser of another artifact or device ({denoiser.device}); "
                "it must use the artifact and device it is handed"
            )
        return denoiser


def check_loader_hooks(
    native_denoiser_loader: object, block_loader: object, strategy: str | None, devices: int
) -> list[str]:
    """The names of the loader hooks given, after checking they are callables used where they can be."""
    hooks = {"native_denoiser_loader": native_denoiser_loader, "block_loader": block_loader}
    given = [name for name, hook in hooks.items() if hook is not None]
    for name in given:
        if not callable(hooks[name]):
            raise VflashError(f"{name} must be a Python callable, got {type(hooks[name]).__name__}")
    if len(given) == 2:
        raise VflashError(
            "give a native_denoiser_loader or a block_loader, not both: the denoiser loader loads its own blocks"
        )
    if native_denoiser_loader is not None and devices > 1:
        raise VflashError(
            "native_denoiser_loader builds the denoiser of one device (resident, single-device only); "
            "leave peer_device and strategy out"
        )
    if block_loader is not None and strategy == "tensor":
        raise VflashError(
            "block_loader supplies whole blocks; the tensor strategy shards them (use sequence-head or one device)"
        )
    return given
