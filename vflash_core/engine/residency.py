"""Where weights live: resident on the device, or streamed from pinned host memory through two device slots (a ring).

Ring: items of one byte layout (the transformer's main blocks, the text encoder's decoder layers: same names, shapes
and dtypes in every item) are copied once, back to back, into ONE segmented pinned host arena that spans items (no
per-item allocation padding). Two device slots, each the size of one item, alternate: a copy stream fills slot k+1
while item k computes from slot k. A copy event marks a slot ready (the compute stream waits on it); a compute event
marks the item that read a slot finished (the copy stream waits on it before overwriting). Nothing waits on the host
per item. The arena is kept until its owner is closed; the slots live as long as their ring (`close()`).

Disk ring: where host memory cannot hold every block, the same two device slots are fed from the compiled block
files themselves (`BlockFiles`): a reader thread reads block after block, in pass order, into a few item-sized pinned
staging buffers, ahead of the ring; a staging buffer is read into again only once the device copy out of it has
completed. The host holds those few blocks whatever the model's size; each pass reads every block file again.

Users of the slots and events (`WeightRing`, fed by a `HostItems`: a `PinnedArena`, or `StagedFiles` such as
`BlockFiles`):

* `BlockRing`: the main blocks, read once from the compiled block files (`BlockArena`), or on every pass
  (`BlockFiles`), one pass per evaluation; the next evaluation's block 0 is fetched while the last block finishes.
  With tensor parallelism each rank's arena holds its shard of every block. Resident, block-ring and disk-ring
  sources yield the same `LayerWeights` (same tensors, same values), so the math, and the bits, are identical.
* `ModuleRing`: the modules of an `nn.ModuleList` (the text encoder's decoder layers), whose parameters move into the
  arena; while the ring is attached to a device, a forward pre-hook points each module's parameters at its slot just
  before the module runs, so the model's own forward runs unchanged on the same values.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import VflashError
from ..memory_plan import DISK_RING_BLOCKS
from ..tensor_store import TensorStore
from .artifact import CompiledArtifact
from .device_owner import module_tensors, point_module_at
from .model import LayerWeights, LoraResidual
from .weight_io import TensorReader

__all__ = [
    "BlockArena", "BlockFiles", "BlockRing", "BlockSource", "HostItems", "ItemFiles", "LoadedBlocks", "ModuleRing",
    "ResidentBlocks", "StagedFiles", "WeightRing", "block_layout", "device_loras",
]

if TYPE_CHECKING:
    from .parallel import TensorShard  # one rank's share of a block's weights (tensor strategy); None: whole blocks

# Tensors start at multiples of this inside the arena and the slots (cuBLAS- and vector-load friendly). The full
# model's tensors are all multiples of it, so no padding is added there.
_ALIGN = 256
# Pinned segments are allocated separately so no single host allocation has to hold the whole model.
_SEGMENT_BYTES = 4 << 30
# Threads reading one block file (see `artifact.READ_WORKERS`).
_READ_WORKERS = 8


class BlockSource:
    """Yields the main blocks' weights on the compute device, in order, once per evaluation."""

    device_weight_bytes: int = 0

    def __iter__(self) -> Iterator[LayerWeights]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the device (and host) memory the source owns."""


def device_loras(
    loras: Mapping[str, tuple[LoraResidual, ...]], device: torch.device
) -> dict[str, tuple[LoraResidual, ...]]:
    return {k: tuple(r.to(device) for r in rs) for k, rs in loras.items()}


class _DeviceBlocks(BlockSource):
    """A block stack that stays on the device for the whole session."""

    def __init__(self, blocks: list[LayerWeights]):
        self.blocks = blocks
        self.device_weight_bytes = sum(t.nbytes for w in blocks for t in w.tensors.values())

    def __iter__(self) -> Iterator[LayerWeights]:
        return iter(self.blocks)

    def close(self) -> None:
        self.blocks = []


class ResidentBlocks(_DeviceBlocks):
    """Every block's weights (or this rank's shard of them), loaded from the artifact onto the device."""

    def __init__(
        self, artifact: CompiledArtifact, device: torch.device, on_block=None, shard: TensorShard | None = None
    ):
        blocks = []
        for i, w in enumerate(artifact.iter_blocks()):
            tensors, loras = (
                (dict(w.tensors), dict(w.loras)) if shard is None
                else (shard.tensors(w.tensors), shard.loras(w.loras))
            )
            blocks.append(LayerWeights({k: v.to(device) for k, v in tensors.items()}, device_loras(loras, device)))
            if on_block is not None:
                on_block(i)
        super().__init__(blocks)


class LoadedBlocks(_DeviceBlocks):
    """The resident block stack as a trusted `block_loader` supplied it, checked against the artifact before use: the
    block count, each block's tensor names, shapes, dtypes and device, and which linears carry LoRA residuals."""

    def __init__(self, artifact: CompiledArtifact, device: torch.device, blocks: Sequence[LayerWeights]):
        blocks = list(blocks)
        if len(blocks) != artifact.config.num_layers:
            raise VflashError(
                f"block_loader returned {len(blocks)} blocks; the artifact has {artifact.config.num_layers}"
            )
        names = list(artifact.block_tensors())
        for index, block in enumerate(blocks):
            if not isinstance(block, LayerWeights):
                raise VflashError(
                    f"block_loader: block {index} is a {type(block).__name__}, "
                    "not a vflash_core.engine.model.LayerWeights"
                )
            if set(block.tensors) != set(names):
                raise VflashError(
                    f"block_loader: block {index} holds {sorted(block.tensors)}; "
                    f"the artifact's blocks hold {sorted(names)}"
                )
            store = TensorStore(artifact.block_file(index))  # its header only
            for name in names:
                tensor, info = block.tensors[name], store.info(name)
                if tuple(tensor.shape) != tuple(info.shape) or tensor.dtype != info.dtype or tensor.device != device:
                    raise VflashError(
                        f"block_loader: block {index} {name} is {tensor.dtype} {list(tensor.shape)} "
                        f"on {tensor.device}; the artifact's is {info.dtype} {list(info.shape)}, wanted on {device}"
                    )
            expected = artifact.block_lora_linears(index)
            if set(block.loras) != expected:
                raise VflashError(
                    f"block_loader: block {index} has LoRA residuals on {sorted(block.loras)}; "
                    f"the artifact's on {sorted(expected)}"
                )
        super().__init__(blocks)


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of an item sits inside an item's byte span."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def pack_layout(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[_Slot], int]:
    """(name, dtype, shape) in order -> their byte layout in one item's span, and the span's size."""
    slots, offset = [], 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        slots.append(_Slot(name, dtype, shape, offset, nbytes))
        offset = (offset + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN  # the next tensor starts aligned
    return slots, offset


def block_layout(artifact: CompiledArtifact, shard: TensorShard | None = None) -> tuple[list[_Slot], int]:
    """Byte layout shared by every main block (same names, shapes and dtypes), or by every block's shard; an FP8
    artifact's codes take one byte per weight and their row scales sit beside them."""
    store = TensorStore(artifact.block_file(0))
    infos = {name: store.info(name) for name in artifact.block_tensors()}
    return pack_layout(
        (name, i.dtype, i.shape if shard is None else shard.shape(name, i.shape)) for name, i in infos.items()
    )


class HostItems:
    """What a `WeightRing` copies from: `count` items of one byte layout in host memory, each handed over as an
    item-sized uint8 span when the ring asks for it (`host_span`), and told when the device copy out of that span was
    issued (`copied`, with an event that completes with the copy, on CUDA). `nbytes`: the host bytes it holds."""

    layout: list[_Slot]
    item_bytes: int
    count: int
    nbytes: int = 0
    #: Whether `copied` needs the copy's own completion event (else the ring passes None and records none).
    wants_copy_events = False

    def views(self, span: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layout's tensors as views of one item-sized byte buffer (an item's span here, or a device slot)."""
        return {s.name: span[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.layout}

    def host_span(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def copied(self, index: int, done: torch.cuda.Event | None) -> None:
        """The copy out of `host_span(index)` is issued; `done` completes with it (None: it has completed)."""

    def close(self) -> None:
        """Drop the host memory."""


class PinnedArena(HostItems):
    """`count` items of one layout back to back in segmented pinned host memory (pageable with `pin=False`).

    `read(i)` gives item i's tensors by name; two items are read and copied in at once, reported to `on_item` in
    order. `what` names an item in errors.
    """

    def __init__(
        self, layout: list[_Slot], item_bytes: int, count: int, read: Callable[[int], Mapping[str, torch.Tensor]],
        pin: bool = True, on_item: Callable[[int], None] | None = None, what: str = "item",
    ):
        self.layout, self.item_bytes, self.count, self.what = layout, item_bytes, count, what
        per_segment = max(1, _SEGMENT_BYTES // item_bytes)
        sizes = [min(per_segment, count - first) * item_bytes for first in range(0, count, per_segment)]
        self.segments = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in sizes]
        # per item: uint8 view of its bytes in a segment
        self.spans = [self.segments[i // per_segment].view(-1, item_bytes)[i % per_segment] for i in range(count)]
        with ThreadPoolExecutor(2) as pool:
            for i, _ in enumerate(pool.map(lambda i: self._fill(i, read(i)), range(count))):
                if on_item is not None:
                    on_item(i)
        self.nbytes = sum(s.nbytes for s in self.segments)

    def close(self) -> None:
        """Drop the host memory, whoever still holds this arena: page-locked blocks go back to PyTorch's host
        allocator now, before the owner empties its cache (`release_host_memory`), not when a reference cycle is
        collected later (the block would stay cached, page-locked, for the life of the process)."""
        self.segments, self.spans = [], []

    def host_span(self, index: int) -> torch.Tensor:
        return self.spans[index]

    def _fill(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy one item's tensors into its span."""
        targets = self.views(self.spans[index])
        if set(tensors) != {s.name for s in self.layout}:
            raise VflashError(
                f"{self.what} {index} holds {sorted(tensors)}, {self.what} 0 {sorted(s.name for s in self.layout)}"
            )
        for slot in self.layout:
            tensor = tensors[slot.name]
            if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                raise VflashError(
                    f"{self.what} {index}: {slot.name} is {tensor.dtype} {list(tensor.shape)}, "
                    f"{self.what} 0 has {slot.dtype} {list(slot.shape)}"
                )
            targets[slot.name].copy_(tensor)


class BlockArena(PinnedArena):
    """Every main block's weights (or this rank's shard of them), each block file read once (several threads per
    file); their LoRA residuals stay beside the arena, by block."""

    def __init__(
        self, artifact: CompiledArtifact, pin: bool = True, on_block: Callable[[int], None] | None = None,
        shard: TensorShard | None = None,
    ):
        count = artifact.config.num_layers
        self.loras: list[dict[str, tuple[LoraResidual, ...]]] = [{} for _ in range(count)]

        def read(index: int) -> Mapping[str, torch.Tensor]:
            block = artifact.read_block(index)
            self.loras[index] = dict(block.loras) if shard is None else shard.loras(block.loras)
            return block.tensors if shard is None else shard.tensors(block.tensors)

        super().__init__(*block_layout(artifact, shard), count, read, pin, on_block, "block")


#: Where one item's tensors lie: (file, {tensor name in the file: the layout's name}) for each file holding some.
ItemFiles = list[tuple[Path, dict[str, str]]]


class StagedFiles(HostItems):
    """`count` items of one layout read from their files each time a pass needs them, into `depth` item-sized staging
    buffers (pinned; pageable with `pin=False`): the module docstring's disk ring, for a `WeightRing`.

    One reader thread reads the items in pass order (item 0 after the last), each file by several threads at once, at
    most `depth` items ahead of the ring; a buffer is read into again once the device copy out of it has completed. A
    pass that asks for another item than the next one read (a request stopped mid-pass) waits for the reads in flight
    and starts over there. With `drop_cache` each file's pages leave the page cache once read, so streaming a model
    larger than the machine's memory does not evict the rest of what it caches (and every read is a real one). Each
    file's header is checked against the layout when the source is made (names, dtypes, shapes); its size and mtime
    on every read. `what` names an item in errors.

    `read_seconds` / `bytes_read`: each item's read time, in order, and the bytes read in all.
    """

    wants_copy_events = True

    def __init__(self, layout: list[_Slot], item_bytes: int, items: list[ItemFiles], pin: bool = True,
                 depth: int = DISK_RING_BLOCKS, drop_cache: bool = True, what: str = "item"):
        self.layout, self.item_bytes, self.count = layout, item_bytes, len(items)
        slots = {slot.name: slot for slot in layout}
        self.readers: list[list[tuple[TensorReader, dict[str, str]]]] = []
        for index, files in enumerate(items):
            readers = []
            for path, names in files:
                reader = TensorReader(path, list(names), drop_cache=drop_cache)
                for key, name in names.items():
                    info, slot = reader.infos[key], slots[name]
                    if info.dtype != slot.dtype or tuple(info.shape) != slot.shape:
                        raise VflashError(
                            f"{what} {index}: {name} is {info.dtype} {list(info.shape)} in {path}, "
                            f"{what} 0 has {slot.dtype} {list(slot.shape)}"
                        )
                readers.append((reader, names))
            if sorted(name for _, names in readers for name in names.values()) != sorted(slots):
                raise VflashError(f"{what} {index}: its files hold another set of tensors than {what} 0's layout")
            self.readers.append(readers)
        depth = min(depth, self.count)  # more would hold an item twice
        self.staging = [torch.empty(self.item_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(depth)]
        self.nbytes = depth * self.item_bytes
        self._targets = [
            {s.name: buffer[s.offset : s.offset + s.nbytes] for s in self.layout} for buffer in self.staging
        ]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vflash-staged-files")
        self._io = ThreadPoolExecutor(_READ_WORKERS, thread_name_prefix="vflash-staged-reads")  # each file's chunks
        self._free = deque(range(depth))  # staging buffers neither being read into nor copied out of
        self._reads: deque[tuple[int, int, Future[None]]] = deque()  # (item, buffer, its read), in pass order
        self._copies: list[torch.cuda.Event | None] = [None] * depth  # per buffer: the last copy out of it
        self._next = 0  # the item the next read is of
        self._copying: int | None = None  # the buffer handed to the ring, until `copied`
        self.read_seconds: list[float] = []
        self.bytes_read = 0
        self._read_ahead()  # the first items are read while the owner finishes loading

    def host_span(self, index: int) -> torch.Tensor:
        if not self._reads or self._reads[0][0] != index:
            self._start_at(index)
        _, buffer, read = self._reads.popleft()
        read.result()  # a read's error (a changed or unreadable file) surfaces here, in the pass
        self._copying = buffer
        return self.staging[buffer]

    def copied(self, index: int, done: torch.cuda.Event | None) -> None:
        buffer, self._copying = self._copying, None
        assert buffer is not None, "copied() without host_span()"
        self._copies[buffer] = done
        self._free.append(buffer)
        self._read_ahead()

    def _read_ahead(self) -> None:
        while self._free:
            buffer = self._free.popleft()
            item, self._next = self._next, (self._next + 1) % self.count
            self._reads.append((item, buffer, self._pool.submit(self._read, item, buffer)))

    def _read(self, item: int, buffer: int) -> None:
        done = self._copies[buffer]
        if done is not None:
            done.synchronize()  # the device has the item this buffer held before
        start = time.perf_counter()
        targets = self._targets[buffer]
        for reader, names in self.readers[item]:
            self.bytes_read += reader.read_into({key: targets[name] for key, name in names.items()}, self._io)
        self.read_seconds.append(time.perf_counter() - start)

    def _start_at(self, index: int) -> None:
        """Wait for the reads in flight, then read ahead from item `index`."""
        # Items no pass uses now: a failed one is read again, and fails there.
        wait([read for _, _, read in self._reads])
        self._free.extend(buffer for _, buffer, _ in self._reads)
        self._reads.clear()
        self._next = index
        self._read_ahead()

    def close(self) -> None:
        """Wait for the reads in flight and drop the staging buffers."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True)
        self._reads.clear()
        self.staging, self._targets = [], []


class BlockFiles(StagedFiles):
    """Every main block's weights read from its compiled file each time a pass needs the block (`StagedFiles`), for a
    `BlockRing`; each file's header is checked against the artifact's block tensors. LoRA residuals are read once and
    stay beside the files, by block."""

    def __init__(self, artifact: CompiledArtifact, pin: bool = True, on_block: Callable[[int], None] | None = None,
                 depth: int = DISK_RING_BLOCKS, drop_cache: bool = True):
        layout, item_bytes = block_layout(artifact)
        specs = artifact.block_tensors()
        self.loras: list[dict[str, tuple[LoraResidual, ...]]] = []
        items = []
        for index in range(artifact.config.num_layers):
            TensorStore(artifact.block_file(index)).require(specs)  # the header: names, shapes, allowed dtypes
            items.append([(artifact.block_file(index), {slot.name: slot.name for slot in layout})])
            self.loras.append(artifact.read_block_loras(index))
            if on_block is not None:
                on_block(index)
        super().__init__(layout, item_bytes, items, pin, depth, drop_cache, "block")


class WeightRing:
    """Two device slots fed from a `HostItems` (a `PinnedArena`, `BlockFiles`) by a copy stream, ordered by events
    (see the module docstring).

    Iterating makes one pass: each item's tensors, as views of its slot, in order; the caller computes with them
    before asking for the next. With `cyclic` the first item of the next pass is fetched as a pass ends. On the CPU
    (tests) the same slots are filled by plain synchronous copies.
    """

    def __init__(self, source: HostItems, device: torch.device, cyclic: bool = True):
        self.source = source
        self.device = device
        self.cyclic = cyclic
        self.slots = [torch.empty(source.item_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.views = [source.views(slot) for slot in self.slots]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.copy_done = [torch.cuda.Event() for _ in range(2)]
            self.compute_done = [torch.cuda.Event() for _ in range(2)]
        self.device_weight_bytes = 2 * source.item_bytes
        self._first_ready = False
        # (start, end) timing events of every copy, while a profiled request asks for them (`time_copies`).
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def time_copies(self, events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None) -> None:
        """Append the (start, end) timing events of every copy from now on to `events`; None stops the timing."""
        self._copy_events = events

    def _issue_copy(self, index: int) -> None:
        s = index % 2
        span = self.source.host_span(index)
        if not self.cuda:
            self.slots[s].copy_(span)
            self.source.copied(index, None)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.compute_done[s])  # the item that last read this slot has finished
            timing = None
            if self._copy_events is not None:
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record(self.copy_stream)
            self.slots[s].copy_(span, non_blocking=True)
            if timing is not None:
                timing[1].record(self.copy_stream)
                self._copy_events.append(timing)  # type: ignore[union-attr]
            self.copy_done[s].record(self.copy_stream)
            done = None
            if self.source.wants_copy_events:  # its own event: `copy_done[s]` is recorded again by a later copy
                done = torch.cuda.Event()
                done.record(self.copy_stream)
        self.source.copied(index, done)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        count = self.source.count
        if not self.cuda:
            for i in range(count):
                self._issue_copy(i)
                yield self.views[i % 2]
            return
        compute = torch.cuda.current_stream(self.device)
        if not self._first_ready:
            self._issue_copy(0)
        self._first_ready = False
        for i in range(count):
            s = i % 2
            if i + 1 < count:
                self._issue_copy(i + 1)  # overlaps item i's compute
            compute.wait_event(self.copy_done[s])
            try:
                yield self.views[s]
            finally:  # also when the caller leaves the pass here (a step cache's skip, a stop): the slot's last reader
                self.compute_done[s].record(compute)
        if self.cyclic:
            # Every pass starts with item 0: fetch it now, so the copy overlaps what runs between passes (the output
            # heads, the latent update, the next evaluation's input packing) instead of stalling the next pass.
            self._issue_copy(0)
            self._first_ready = True

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.slots, self.views = [], []


class BlockRing(WeightRing, BlockSource):
    """The main blocks streamed through a `WeightRing` from a `BlockArena` or from their files (`BlockFiles`), one
    pass per evaluation."""

    def __init__(self, source: BlockArena | BlockFiles, device: torch.device):
        super().__init__(source, device)
        self.loras = [device_loras(lora, device) for lora in source.loras]

    def __iter__(self) -> Iterator[LayerWeights]:  # type: ignore[override]
        for index, views in enumerate(super().__iter__()):
            yield LayerWeights(views, self.loras[index])

    def close(self) -> None:
        super().close()
        self.loras = []


class ModuleRing:
    """Modules of one structure (same parameter names, shapes and dtypes) run with their weights streamed.

    Their parameters and buffers move once into a `PinnedArena` (the modules point at their spans from then on, so
    the host holds them once), or with `files` (where each module's tensors lie, by its own names) they are read from
    those files on every pass into a few staging buffers (`StagedFiles`) and the modules hold no weights in between
    (meta tensors). `attach(device)` allocates a `WeightRing` there and hooks the modules: before module i runs its
    tensors are pointed at the slot the ring filled (the next module's copy is issued meanwhile), and after the last
    one the pass is closed; `detach()` removes the hooks, frees the slots and points the modules back at the arena (or
    at nothing). The modules must run in order, each once per pass, as a model's layer loop runs them.
    """

    def __init__(
        self, modules: Sequence[torch.nn.Module], pin: bool, what: str = "module", files: list[ItemFiles] | None = None
    ):
        self.modules = list(modules)
        first = module_tensors(self.modules[0])
        layout, item_bytes = pack_layout((name, t.dtype, tuple(t.shape)) for name, t in first.items())
        self.source: PinnedArena | StagedFiles
        if files is None:
            self.source = PinnedArena(
                layout, item_bytes, len(self.modules), lambda i: module_tensors(self.modules[i]), pin, what=what
            )
            self.host = [self.source.views(span) for span in self.source.spans]
        else:
            self.source = StagedFiles(layout, item_bytes, files, pin, what=what)
            self.host = [
                {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in module_tensors(m).items()}
                for m in self.modules
            ]
        for module, tensors in zip(self.modules, self.host):
            point_module_at(module, tensors)
        self.ring: WeightRing | None = None
        self._pass: Iterator[dict[str, torch.Tensor]] | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, device: torch.device) -> None:
        """Stream the modules through two slots on `device` from now on."""
        self.ring = WeightRing(self.source, device, cyclic=False)
        for index, module in enumerate(self.modules):
            self._hooks.append(module.register_forward_pre_hook(lambda m, args, i=index: self._before(i, m)))
        self._hooks.append(self.modules[-1].register_forward_hook(lambda m, args, out: self._end_pass()))

    def _before(self, index: int, module: torch.nn.Module) -> None:
        if index == 0:
            self._pass = iter(self.ring)  # type: ignore[arg-type]
        point_module_at(module, next(self._pass))  # type: ignore[arg-type]

    def _end_pass(self) -> None:
        next(self._pass, None)  # type: ignore[arg-type]  # records the last module's completion
        self._pass = None

    def detach(self) -> None:
        """Remove the hooks, wait for the device and free the slots; the modules point at the arena again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._pass = [], None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for module, tensors in zip(self.modules, self.host):
            point_module_at(module, tensors)

    def close(self) -> None:
        """Drop the host memory (the arena, or the staging buffers and their reader); the modules are unusable after."""
        self.detach()
        self.source.close()
