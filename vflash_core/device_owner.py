"""`SerialDeviceOwner`: a pipeline part that holds its device only for its own stage (seed 001: the text encoder, the
VAEs and the core share one GPU in turn)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def release_device_memory(device: torch.device) -> None:
    """Return cached blocks to the driver so the next owner of the GPU can use them (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class SerialDeviceOwner:
    """Base of `TextConditioner` and `MediaVAEs`: `on_device()` moves the part's modules to `device` for a block and
    hands the device back afterwards (`offload`), unless `keep_on_device` (`encoder_residency="resident"`)."""

    device: torch.device
    keep_on_device: bool = False  # True: the modules stay on `device` after their first use (until `close`)

    def device_modules(self) -> list[torch.nn.Module]:
        """The modules that move between the CPU and `device`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def on_device(self) -> Iterator[SerialDeviceOwner]:
        """Hold the modules on `device` for the block, then hand the device back unless `keep_on_device`."""
        for module in self.device_modules():
            module.to(self.device)
        try:
            yield self
        finally:
            if not self.keep_on_device:
                self.offload()

    def offload(self) -> None:
        """Move the modules to the CPU and release cached device memory (a no-op for a CPU part)."""
        if self.device.type != "cpu":
            for module in self.device_modules():
                module.to("cpu")
            release_device_memory(self.device)
