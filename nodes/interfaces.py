"""What the node operations need of their host, as two small interfaces, and the host's progress bars as the core's
progress callbacks.

* `Host`: progress bars, the interrupt check, live previews, the host's memory management (each loaded engine held
  in it, `HeldEngine`, and room asked of it in bytes per device), the default device, the host's `NestedTensor` class
  and VIDEO type, its log (`host.ComfyHost` in ComfyUI and over the headless host);
* `Folders`: listing and resolving model files (ComfyUI's `folder_paths`, or the headless host's; `host.ComfyFolders`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

__all__ = ["Folders", "HeldEngine", "Host", "HostStageProgress", "LatentRGB", "ProgressSink", "host_progress"]

# A latent-to-RGB projection: one (r, g, b) row per latent channel, and the (r, g, b) bias; RGB in [-1, 1].
LatentRGB = tuple[Sequence[Sequence[float]], Sequence[float]]


class ProgressSink(Protocol):  # comfy.utils.ProgressBar
    def update_absolute(self, value: int, total: int | None = None) -> None: ...


class HeldEngine(Protocol):
    """The host's record of one loaded engine (in ComfyUI, its entry in core's model management). The host may
    release the engine itself (an unload, `/free`, eviction for another model): it closes it and calls the
    `on_release` it was held with."""

    def release(self) -> None:
        """Close the engine and drop the host's record (calls `on_release`); idempotent."""


class Host(Protocol):
    nested: type  # the host's NestedTensor class (constructor takes a tuple of tensors)

    def progress(self, total: int) -> ProgressSink: ...

    def check_interrupt(self) -> None: ...

    def preview(
        self, total: int, device: torch.device, channels: int, latent_rgb: LatentRGB | None = None
    ) -> Callable[[int, int, torch.Tensor], None] | None:
        """A per-evaluation preview callback for video latents of `channels` channels, or None; `latent_rgb`: the
        model's own latent-to-RGB projection (factors, one row per channel, and bias) where its latents are not the
        host's H3 format (the demo's)."""

    def hold(
        self, kind: str, label: str, engine: Any, device_bytes: int, device: torch.device,
        on_release: Callable[[], None],
    ) -> HeldEngine:
        """Enter a loaded engine ("dit", "te" or "vae"; `label` its option name) holding `device_bytes` on `device`
        in the host's memory management."""

    def make_room(self, needs: Mapping[torch.device, int], keep: Sequence[HeldEngine] = ()) -> None:
        """Have `needs[device]` bytes free on each device for the next load or stage, releasing the host's models
        (and engines it holds) only as far as needed, never those in `keep`."""

    def running(self, held: Sequence[HeldEngine]) -> contextlib.AbstractContextManager:
        """For the duration of a stage on these engines: nothing the host loads meanwhile may release them."""

    def default_device(self) -> str: ...

    def device_cap_gib(self, device: str) -> float | None:
        """GiB the host lets Vflash's engines hold on `device` (None: no limit of the host's)."""

    def make_video(self, images: torch.Tensor, audio: dict[str, Any], fps: float) -> Any: ...

    def log(self, line: str) -> None: ...


class Folders(Protocol):
    def filenames(self, key: str) -> list[str]: ...

    def folders(self, key: str) -> list[str]: ...

    def full_path(self, key: str, name: str) -> str | None: ...


class HostStageProgress:
    """A `(stage, done, total)` callback (demo build, pipeline load, compile) on a host progress bar, a fresh bar for
    each new stage; every update checks for an interrupt."""

    def __init__(self, host: Host):
        self.host = host
        self.bar: ProgressSink | None = None
        self.stage: str | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.host.check_interrupt()
        if self.bar is None or stage != self.stage:
            self.bar, self.stage = self.host.progress(max(1, total)), stage
        self.bar.update_absolute(done, total)


def host_progress(host: Host) -> Callable[[int, int], None]:
    """A `(done, total)` callback of one long call on a host progress bar, checking for an interrupt on every update."""
    stages = HostStageProgress(host)
    return lambda done, total: stages("", done, total)
