"""What the core needs on its devices, stated by the core from its compile and how it runs: its weights as placed
(`PartSizes.core_on_device`), one evaluation's activations (`denoise.denoise_bytes`) of a request or of the profile's
largest, and, before it loads, the room its preferred placement needs (`load_room`). The memory plan, the pipeline
and a host that frees memory for a load (the node pack's ComfyUI) ask this instead of computing bytes themselves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..memory_plan import MemoryNeed, cap_bytes, room
from ..profiles import Profile
from .artifact import CompiledArtifact
from .denoise import denoise_bytes
from .engine_options import EngineOptions
from .fast_mode import FastMode
from .layout import largest_request_rows

__all__ = ["CoreMemory"]


@dataclass(frozen=True)
class CoreMemory:
    """The core of one compile run with one fast mode (None: exact) for `profile`'s requests."""

    compiled: CompiledArtifact
    profile: Profile
    fast_mode: FastMode | None = None

    def weights(self, placement: str | None) -> int:
        """The core's weights on each of its devices placed `placement` (`memory_plan.Placement.core`)."""
        return self.compiled.part_sizes().core_on_device(placement)

    def evaluation_bytes(self, rows: int) -> int:
        """One evaluation's transient bytes at `rows` packed rows."""
        return denoise_bytes(self.compiled.config, rows, self.fast_mode)

    def largest_evaluation_bytes(self, canvas: tuple[int, int] | None = None) -> int:
        """One evaluation of the profile's largest request (`layout.largest_request_rows`, on a (height, width)
        canvas, by default the released model's 16:9 one)."""
        return self.evaluation_bytes(largest_request_rows(self.profile, self.compiled.config, canvas))

    def request_needs(self, devices: Sequence[torch.device], rows: int) -> list[MemoryNeed]:
        """A request's denoise on every device of a loaded session (its weights already there): one evaluation of the
        whole sequence of `rows` packed rows on each (an upper bound where sequence-head splits the rows)."""
        return [MemoryNeed(torch.device(device), transient=self.evaluation_bytes(rows)) for device in devices]

    def load_room(self, options: EngineOptions) -> dict[torch.device, int]:
        """The bytes to free on each device `options` name before the core loads, for its preferred placement
        (resident unless a ring was asked for): its weights, one evaluation of the profile's largest request, the
        plan's margin; within the options' cap. Where less is free, the session's plan falls back to a ring itself."""
        residency = options.weight_residency
        placement = residency if residency in ("block-ring", "disk-ring") else "resident"
        needs = room(
            MemoryNeed(torch.device(device), self.weights(placement), self.largest_evaluation_bytes())
            for device in options.devices_named
        )
        cap = cap_bytes(options.max_device_memory)
        return {device: need if cap is None else min(need, cap) for device, need in needs.items()}
