"""The native video decode on several devices (`vae_decode.NativeVideoDecoder`): the calls split into contiguous parts,
one per device; every part after the first decoded on a host thread of its own driving its own stream (`PeerPart`),
its tiles staged in host memory until the first device stitches them in the one-device order."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ..engine.device_owner import HostCopy, copy_to_host
from .vae_tiles import TileWindow

__all__ = ["DecodedCalls", "PeerPart", "split_calls"]

#: A part's calls run on one device from that device's copy of the latents: each as (tile-windows, pixels there).
DecodedCalls = Callable[[torch.Tensor], Iterator[tuple[list[TileWindow], torch.Tensor]]]


def split_calls(calls: list[list[TileWindow]], parts: int) -> list[list[list[TileWindow]]]:
    """`calls` in `parts` contiguous runs as even as possible, the later runs the longer: the first device, which also
    stitches and blends every window, gets the shorter share."""
    base, extra = divmod(len(calls), parts)
    sizes = [base + (i >= parts - extra) for i in range(parts)]
    bounds = [sum(sizes[:i]) for i in range(parts + 1)]
    return [calls[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """The device made current for a thread's launches, and a stream of its own for them on CUDA."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stream = torch.cuda.Stream(device)
    # The replica of the weights and the latents were copied in on the device's current stream: this one starts after.
    stream.wait_stream(torch.cuda.current_stream(device))
    stack.enter_context(torch.cuda.stream(stream))
    stack.callback(stream.synchronize)  # nothing of the thread's may still run once its tensors are released
    return stack


class StagedCall(NamedTuple):
    """A call decoded on another device, its pixels on their way to the host."""

    batch: list[TileWindow]
    pixels: HostCopy


class PeerPart:
    """One contiguous part of the calls decoded on a device other than the first, on a host thread of its own; each
    call's tiles are staged in host memory until the first device takes them (`results`), in order."""

    def __init__(self, device: torch.device, index: int, z: torch.Tensor, decode: DecodedCalls):
        self.outbox: queue.SimpleQueue[StagedCall | BaseException | None] = queue.SimpleQueue()
        self.stopping = threading.Event()
        # The part's own copy of the latents, made before the first device's work is queued: reading them on their
        # device from the thread would queue each read behind that work.
        latents = z.to(device, copy=True)
        self.thread = threading.Thread(
            target=self._run, args=(device, latents, decode), name=f"vae-decode-device-{index}", daemon=True
        )
        self.thread.start()

    def _run(self, device: torch.device, latents: torch.Tensor, decode: DecodedCalls) -> None:
        try:
            with torch.no_grad(), _device_context(device):
                for batch, pixels in decode(latents):
                    if self.stopping.is_set():
                        break
                    self.outbox.put(StagedCall(batch, copy_to_host(pixels)))
            self.outbox.put(None)
        except BaseException as error:  # noqa: BLE001 - handed to the first device's thread, which raises it
            self.outbox.put(error)

    def results(self) -> Iterator[tuple[list[TileWindow], torch.Tensor]]:
        """The part's calls in order, (tile-windows, pixels on the host), as they are staged."""
        while (item := self.outbox.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item.batch, item.pixels.wait()

    def stop(self) -> None:
        """Let the thread finish (after its current call) and wait for it."""
        self.stopping.set()
        self.thread.join()


