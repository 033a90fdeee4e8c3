"""What the node operations need of their host, as two small interfaces, and the host's progress bars as the core's
progress callbacks.

* `Host`: progress bars, the interrupt check, live previews, freeing the host's own models, the default device, the
  host's `NestedTensor` class and VIDEO type, its log (`host.ComfyHost` in ComfyUI and over the headless host);
* `Folders`: listing and resolving model files (ComfyUI's `folder_paths`, or the headless host's; `host.ComfyFolders`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Folders", "Host", "HostStageProgress", "ProgressSink", "host_progress"]


class ProgressSink(Protocol):  # comfy.utils.ProgressBar
    def update_absolute(self, value: int, total: int | None = None) -> None: ...


class Host(Protocol):
    nested: type  # the host's NestedTensor class (constructor takes a tuple of tensors)

    def progress(self, total: int) -> ProgressSink: ...

    def check_interrupt(self) -> None: ...

    def preview(
        self, total: int, device: torch.device, channels: int
    ) -> Callable[[int, int, torch.Tensor], None] | None: ...

    def free_memory(self) -> None: ...

    def default_device(self) -> str: ...

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
