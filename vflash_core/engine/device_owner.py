"""`SerialDeviceOwner`: a pipeline part that holds its device only for its own stage (the text encoder, the VAEs and
the core share one GPU in turn)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

__all__ = [
    "HostCopy", "SerialDeviceOwner", "copy_to_host", "module_bytes", "module_tensors", "point_module_at",
    "release_device_memory", "release_host_memory",
]


def release_device_memory(device: torch.device) -> None:
    """Return cached blocks to the driver so the next owner of the GPU can use them (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def release_host_memory() -> None:
    """Return the page-locked host blocks PyTorch's host allocator keeps cached to the system (no-op without CUDA).

    The allocator caches a freed pinned block for reuse, so a closed block ring's or streamed encoder's arena (40-50 GB
    at full size) would stay page-locked for the life of the process: the host memory the next configuration needs.
    Called when a part that pinned memory is closed."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch._C._host_emptyCache()


class HostCopy(NamedTuple):
    """A tensor's bytes on their way to the host: `host` (contiguous) holds them once `ready` completes (a CUDA
    event; None: they are there already)."""

    host: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        """`host`, once the copy is done."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


def copy_to_host(tensor: torch.Tensor) -> HostCopy:
    """`tensor` copied to the host without waiting for it: from CUDA into pinned memory, queued on its device's
    current stream behind the work that made it (a blocking copy into pageable memory would stop the caller's
    launches until the device drained); from elsewhere, a plain copy."""
    if tensor.device.type != "cuda":
        return HostCopy(tensor.cpu().contiguous(), None)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.contiguous(), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))
    return HostCopy(host, ready)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's and buffer's current tensor, by qualified name (tied parameters once)."""
    return {**{name: p.data for name, p in module.named_parameters()}, **dict(module.named_buffers())}


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (tied parameters once)."""
    return sum(t.numel() * t.element_size() for t in module_tensors(module).values())


def point_module_at(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Point the parameters and buffers named in `tensors` at those tensors (no copy)."""
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if leaf in sub._parameters:
            param = sub._parameters[leaf]
            try:
                param.data = tensor  # type: ignore[union-attr]
            except RuntimeError:  # a device whose tensors cannot share a Parameter with host ones (meta): a new one
                sub._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=param.requires_grad)  # type: ignore[union-attr]
        else:
            sub._buffers[leaf] = tensor


def _available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where it cannot be read, which disables page-locking)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class SerialDeviceOwner:
    """Base of `TextConditioner` and `MediaVAEs`: `on_device()` moves the part's modules to `device` for a block and
    hands the device back afterwards (`offload`), unless `keep_on_device` (`encoder_residency="resident"`).

    The weights never change, so the host tensors are kept while the modules run on the device and handing the device
    back only points the modules at them again: a 54 GB text encoder is copied to the GPU once per stage, never back.
    """

    device: torch.device
    keep_on_device: bool = False  # True: the modules stay on `device` after their first use (until `close`)
    _host: dict[int, dict[str, torch.Tensor]] | None = None  # id(module) -> its host tensors while on the device

    def device_modules(self) -> list[torch.nn.Module]:
        """The modules that move between the CPU and `device`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def on_device(self) -> Iterator[SerialDeviceOwner]:
        """Hold the modules on `device` for the block, then hand the device back unless `keep_on_device`."""
        if self.device.type != "cpu":
            if self._host is None:
                self._host = {}
            for module in self.device_modules():
                if not self.keep_on_device:  # a resident part never comes back: its host copy is not kept
                    self._host.setdefault(id(module), module_tensors(module))
                module.to(self.device)
        try:
            yield self
        finally:
            if not self.keep_on_device:
                self.offload()

    def materialize(self) -> None:
        """Load the weights now, so the first request does not pay for it.

        Loaders leave weights memory-mapped from their files until first touched (transformers does for the text
        encoder: at full size the first request then read 54 GB from disk inside its encode stage). A resident part
        moves to its device here; an offloaded one gets owned host copies, page-locked on a CUDA machine with room
        for them (MemAvailable at least twice their size), which also makes every later host-to-device copy faster.
        """
        if self.device.type != "cpu" and self.keep_on_device:
            with self.on_device():
                return
        modules = self.device_modules()
        nbytes = sum(t.numel() * t.element_size() for m in modules for t in module_tensors(m).values())
        pin = self.device.type == "cuda" and 2 * nbytes <= _available_host_bytes()
        for module in modules:
            point_module_at(
                module, {name: t.pin_memory() if pin else t.clone() for name, t in module_tensors(module).items()}
            )

    def offload(self) -> None:
        """Point the modules back at their host tensors and release cached device memory (no-op for a CPU part)."""
        if self.device.type == "cpu":
            return
        for module in self.device_modules():
            tensors = (self._host or {}).pop(id(module), None)
            if tensors is not None:
                point_module_at(module, tensors)
            else:
                module.to("cpu")
        release_device_memory(self.device)
