"""Where weights live: resident on the device, or streamed from pinned host memory through two device slots (a ring).

Ring: items of one byte layout (the transformer's main blocks, the text encoder's decoder layers: same names, shapes
and dtypes in every item) are copied once, back to back, into ONE segmented pinned host arena that spans items (no
per-item allocation padding). Two device slots, each the size of one item, alternate: a copy stream fills slot k+1
while item k computes from slot k. A copy event marks a slot ready (the compute stream waits on it); a compute event
marks the item that read a slot finished (the copy stream waits on it before overwriting). Nothing waits on the host
per item. The arena is kept until its owner is closed; the slots live as long as their ring (`close()`).

Two users of the same arena, slots and events (`PinnedArena`, `WeightRing`):

* `BlockRing`: the main blocks, read once from the compiled block files (`BlockArena`), one pass per evaluation; the
  next evaluation's block 0 is fetched while the last block finishes. With tensor parallelism each rank's arena holds
  its shard of every block. Resident and block-ring sources yield the same `LayerWeights` (same tensors, same
  values), so the math, and the bits, are identical.
* `ModuleRing`: the modules of an `nn.ModuleList` (the text encoder's decoder layers), whose parameters move into the
  arena; while the ring is attached to a device, a forward pre-hook points each module's parameters at its slot just
  before the module runs, so the model's own forward runs unchanged on the same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import VflashError
from ..tensor_store import TensorStore
from .artifact import CompiledArtifact
from .device_owner import module_tensors, point_module_at
from .model import LayerWeights, LoraResidual

__all__ = [
    "BlockArena", "BlockRing", "BlockSource", "LoadedBlocks", "ModuleRing", "ResidentBlocks", "WeightRing",
    "block_layout", "device_loras",
]

if TYPE_CHECKING:
    from .parallel import TensorShard  # one rank's share of a block's weights (tensor strategy); None: whole blocks

# Tensors start at multiples of this inside the arena and the slots (cuBLAS- and vector-load friendly). The full
# model's tensors are all multiples of it, so no padding is added there.
_ALIGN = 256
# Pinned segments are allocated separately so no single host allocation has to hold the whole model.
_SEGMENT_BYTES = 4 << 30


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

    def __init__(self, artifact: CompiledArtifact, device: torch.device, on_block=None, shard: TensorShard | None = None):
        blocks = []
        for i, w in enumerate(artifact.iter_blocks()):
            tensors, loras = (dict(w.tensors), dict(w.loras)) if shard is None else (shard.tensors(w.tensors), shard.loras(w.loras))
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
            raise VflashError(f"block_loader returned {len(blocks)} blocks; the artifact has {artifact.config.num_layers}")
        names = list(artifact.block_tensors())
        for index, block in enumerate(blocks):
            if not isinstance(block, LayerWeights):
                raise VflashError(f"block_loader: block {index} is a {type(block).__name__}, not a vflash_core.engine.model.LayerWeights")
            if set(block.tensors) != set(names):
                raise VflashError(f"block_loader: block {index} holds {sorted(block.tensors)}; the artifact's blocks hold {sorted(names)}")
            store = TensorStore(artifact.block_file(index))  # its header only
            for name in names:
                tensor, info = block.tensors[name], store.info(name)
                if tuple(tensor.shape) != tuple(info.shape) or tensor.dtype != info.dtype or tensor.device != device:
                    raise VflashError(
                        f"block_loader: block {index} {name} is {tensor.dtype} {list(tensor.shape)} on {tensor.device}; "
                        f"the artifact's is {info.dtype} {list(info.shape)}, wanted on {device}"
                    )
            expected = artifact.block_lora_linears(index)
            if set(block.loras) != expected:
                raise VflashError(f"block_loader: block {index} has LoRA residuals on {sorted(block.loras)}; the artifact's on {sorted(expected)}")
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
    return pack_layout((name, i.dtype, i.shape if shard is None else shard.shape(name, i.shape)) for name, i in infos.items())


class PinnedArena:
    """`count` items of one layout back to back in segmented pinned host memory (pageable with `pin=False`).

    `read(i)` gives item i's tensors by name; two items are read and copied in at once, reported to `on_item` in
    order. `what` names an item in errors.
    """

    def __init__(
        self, layout: list[_Slot], item_bytes: int, count: int, read: Callable[[int], Mapping[str, torch.Tensor]],
        pin: bool = True, on_item: Callable[[int], None] | None = None, what: str = "item",
    ):
        self.layout, self.item_bytes, self.what = layout, item_bytes, what
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

    def views(self, span: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layout's tensors as views of one item-sized byte buffer (an item's span here, or a device slot)."""
        return {s.name: span[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.layout}

    def _fill(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy one item's tensors into its span."""
        targets = self.views(self.spans[index])
        if set(tensors) != {s.name for s in self.layout}:
            raise VflashError(f"{self.what} {index} holds {sorted(tensors)}, {self.what} 0 {sorted(s.name for s in self.layout)}")
        for slot in self.layout:
            tensor = tensors[slot.name]
            if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                raise VflashError(f"{self.what} {index}: {slot.name} is {tensor.dtype} {list(tensor.shape)}, {self.what} 0 has {slot.dtype} {list(slot.shape)}")
            targets[slot.name].copy_(tensor)


class BlockArena(PinnedArena):
    """Every main block's weights (or this rank's shard of them), each block file read once (several threads per
    file); their LoRA residuals stay beside the arena, by block."""

    def __init__(self, artifact: CompiledArtifact, pin: bool = True, on_block: Callable[[int], None] | None = None, shard: TensorShard | None = None):
        count = artifact.config.num_layers
        self.loras: list[dict[str, tuple[LoraResidual, ...]]] = [{} for _ in range(count)]

        def read(index: int) -> Mapping[str, torch.Tensor]:
            block = artifact.read_block(index)
            self.loras[index] = dict(block.loras) if shard is None else shard.loras(block.loras)
            return block.tensors if shard is None else shard.tensors(block.tensors)

        super().__init__(*block_layout(artifact, shard), count, read, pin, on_block, "block")


class WeightRing:
    """Two device slots fed from a `PinnedArena` by a copy stream, ordered by events (see the module docstring).

    Iterating makes one pass: each item's tensors, as views of its slot, in order; the caller computes with them
    before asking for the next. With `cyclic` the first item of the next pass is fetched as a pass ends. On the CPU
    (tests) the same slots are filled by plain synchronous copies.
    """

    def __init__(self, arena: PinnedArena, device: torch.device, cyclic: bool = True):
        self.arena = arena
        self.device = device
        self.cyclic = cyclic
        self.slots = [torch.empty(arena.item_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.views = [arena.views(slot) for slot in self.slots]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.copy_done = [torch.cuda.Event() for _ in range(2)]
            self.compute_done = [torch.cuda.Event() for _ in range(2)]
        self.device_weight_bytes = 2 * arena.item_bytes
        self._first_ready = False
        # (start, end) timing events of every copy, while a profiled request asks for them (`time_copies`).
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def time_copies(self, events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None) -> None:
        """Append the (start, end) timing events of every copy from now on to `events`; None stops the timing."""
        self._copy_events = events

    def _issue_copy(self, index: int) -> None:
        s = index % 2
        if not self.cuda:
            self.slots[s].copy_(self.arena.spans[index])
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.compute_done[s])  # the item that last read this slot has finished
            timing = None
            if self._copy_events is not None:
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record(self.copy_stream)
            self.slots[s].copy_(self.arena.spans[index], non_blocking=True)
            if timing is not None:
                timing[1].record(self.copy_stream)
                self._copy_events.append(timing)  # type: ignore[union-attr]
            self.copy_done[s].record(self.copy_stream)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        count = len(self.arena.spans)
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
            yield self.views[s]
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
    """The main blocks streamed through a `WeightRing` from a `BlockArena`, one pass per evaluation."""

    def __init__(self, arena: BlockArena, device: torch.device):
        super().__init__(arena, device)
        self.loras = [device_loras(lora, device) for lora in arena.loras]

    def __iter__(self) -> Iterator[LayerWeights]:  # type: ignore[override]
        for index, views in enumerate(super().__iter__()):
            yield LayerWeights(views, self.loras[index])

    def close(self) -> None:
        super().close()
        self.loras = []


class ModuleRing:
    """Modules of one structure (same parameter names, shapes and dtypes) run with their weights streamed.

    Their parameters and buffers move once into a `PinnedArena` (the modules point at their spans from then on, so
    the host holds them once). `attach(device)` allocates a `WeightRing` there and hooks the modules: before module i
    runs its tensors are pointed at the slot the ring filled (the next module's copy is issued meanwhile), and after
    the last one the pass is closed; `detach()` removes the hooks, frees the slots and points the modules back at the
    arena. The modules must run in order, each once per pass, as a model's layer loop runs them.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], pin: bool, what: str = "module"):
        self.modules = list(modules)
        first = module_tensors(self.modules[0])
        layout, item_bytes = pack_layout((name, t.dtype, tuple(t.shape)) for name, t in first.items())
        self.arena = PinnedArena(layout, item_bytes, len(self.modules), lambda i: module_tensors(self.modules[i]), pin, what=what)
        self.host = [self.arena.views(span) for span in self.arena.spans]
        for module, tensors in zip(self.modules, self.host):
            point_module_at(module, tensors)
        self.ring: WeightRing | None = None
        self._pass: Iterator[dict[str, torch.Tensor]] | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, device: torch.device) -> None:
        """Stream the modules through two slots on `device` from now on."""
        self.ring = WeightRing(self.arena, device, cyclic=False)
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
