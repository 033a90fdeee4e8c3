"""Where the main blocks' weights live: resident on the device, or streamed from pinned host memory (block ring).

Block ring: every compiled block file is read once (several threads per file) and its tensors are copied back to back
into ONE segmented pinned host arena that spans blocks (no per-block allocation padding). Two device slots, each the size of one block, alternate: a copy stream fills slot
k+1 while block k computes from slot k, and block 0 of the next evaluation while the last block finishes. A copy
event marks a slot ready (the compute stream waits on it); a compute event marks the block that read a slot
finished (the copy stream waits on it before overwriting). Nothing waits on the host per block. The arena and the
slots are reused across requests and released by `close()`. With tensor parallelism each rank's arena holds its
shard of every block.

Resident and block-ring sources yield the same `LayerWeights` (same tensors, same values), so the math, and the
bits, are identical.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from .artifact import CompiledArtifact
from .checkpoint import block_shapes
from .config import H3Config
from .errors import RequestError, VflashError
from .model import LayerWeights, LoraResidual
from .tensor_store import TensorStore

logger = logging.getLogger(__name__)

# Tensors start at multiples of this inside the arena and the slots (cuBLAS- and vector-load friendly). The full
# model's tensors are all multiples of it, so no padding is added there.
_ALIGN = 256
# Pinned segments are allocated separately so no single host allocation has to hold the whole model.
_SEGMENT_BYTES = 4 << 30


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class BlockSource:
    """Yields the main blocks' weights on the compute device, in order, once per evaluation."""

    device_weight_bytes: int = 0

    def __iter__(self) -> Iterator[LayerWeights]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the device (and host) memory the source owns."""


def _device_loras(loras: dict[str, tuple[LoraResidual, ...]], device: torch.device) -> dict[str, tuple[LoraResidual, ...]]:
    return {k: tuple(r.to(device) for r in rs) for k, rs in loras.items()}


class WeightShard(Protocol):
    """One rank's share of a block's weights (tensor parallelism); identity when absent."""

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def loras(self, loras: Mapping[str, tuple[LoraResidual, ...]]) -> dict[str, tuple[LoraResidual, ...]]: ...


class ResidentBlocks(BlockSource):
    """Every block's weights (or this rank's shard of them) live on the device for the whole session."""

    def __init__(self, artifact: CompiledArtifact, device: torch.device, on_block=None, shard: WeightShard | None = None):
        self.blocks: list[LayerWeights] = []
        for i, w in enumerate(artifact.iter_blocks()):
            tensors, loras = (dict(w.tensors), dict(w.loras)) if shard is None else (shard.tensors(w.tensors), shard.loras(w.loras))
            self.blocks.append(LayerWeights({k: v.to(device) for k, v in tensors.items()}, _device_loras(loras, device)))
            if on_block is not None:
                on_block(i)
        self.device_weight_bytes = sum(t.nbytes for w in self.blocks for t in w.tensors.values())

    def __iter__(self) -> Iterator[LayerWeights]:
        return iter(self.blocks)

    def close(self) -> None:
        self.blocks = []


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of a block sits inside a block's byte span."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def block_layout(config: H3Config, artifact: CompiledArtifact, shard: WeightShard | None = None) -> tuple[list[_Slot], int]:
    """Byte layout shared by every main block (same names, shapes and dtypes), or by every block's shard."""
    store = TensorStore(artifact.artifact_dir / artifact.manifest["blocks"][0]["file"])
    slots, offset = [], 0
    for internal in block_shapes(config, "blocks.0", with_adaln=False):
        name = internal.split(".", 2)[2]
        info = store.info(name)
        shape = info.shape if shard is None else shard.shape(name, info.shape)
        nbytes = math.prod(shape) * info.dtype.itemsize
        slots.append(_Slot(name, info.dtype, shape, offset, nbytes))
        offset = _aligned(offset + nbytes)
    return slots, offset


class PinnedArena:
    """Every main block's weights in one segmented pinned host arena, filled once from memory-mapped block files."""

    def __init__(self, artifact: CompiledArtifact, pin: bool = True, on_block=None, shard: WeightShard | None = None):
        config = artifact.config
        self.shard = shard
        self.layout, self.block_bytes = block_layout(config, artifact, shard)
        per_segment = max(1, _SEGMENT_BYTES // self.block_bytes)
        self.segments: list[torch.Tensor] = []
        self.spans: list[torch.Tensor] = []  # per block: uint8 view of its bytes in a segment
        self.loras: list[dict[str, tuple[LoraResidual, ...]]] = []
        for first in range(0, config.num_layers, per_segment):
            count = min(per_segment, config.num_layers - first)
            self.segments.append(torch.empty(count * self.block_bytes, dtype=torch.uint8, pin_memory=pin))
        for i in range(config.num_layers):
            start = (i % per_segment) * self.block_bytes
            self.spans.append(self.segments[i // per_segment][start : start + self.block_bytes])
        # Two blocks fill their spans at once (each read by several threads), reported in order.
        with ThreadPoolExecutor(2) as pool:
            for i, loras in enumerate(pool.map(lambda i: self._fill(artifact, i, self.spans[i]), range(config.num_layers))):
                self.loras.append(loras)
                if on_block is not None:
                    on_block(i)
        self.nbytes = sum(s.nbytes for s in self.segments)

    def _fill(self, artifact: CompiledArtifact, index: int, span: torch.Tensor) -> dict[str, tuple[LoraResidual, ...]]:
        """Read one block file and copy its tensors (or this rank's shard of them) into its span of the arena."""
        block = artifact.read_block(index)
        tensors = block.tensors if self.shard is None else self.shard.tensors(block.tensors)
        for slot in self.layout:
            tensor = tensors[slot.name]
            if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                raise VflashError(f"block {index}: {slot.name} is {tensor.dtype} {list(tensor.shape)}, block 0 has {slot.dtype} {list(slot.shape)}")
            span[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(tensor)
        return dict(block.loras) if self.shard is None else self.shard.loras(block.loras)


class BlockRing(BlockSource):
    """Two device slots fed from a `PinnedArena` by a copy stream, ordered by events (see the module docstring).

    On the CPU (tests) the same slots are filled by plain synchronous copies.
    """

    def __init__(self, arena: PinnedArena, device: torch.device):
        self.arena = arena
        self.device = device
        self.slots = [torch.empty(arena.block_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.views = [self._views(slot) for slot in self.slots]
        self.loras = [_device_loras(lora, device) for lora in arena.loras]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.copy_done = [torch.cuda.Event() for _ in range(2)]
            self.compute_done = [torch.cuda.Event() for _ in range(2)]
        self.device_weight_bytes = 2 * arena.block_bytes
        self._first_block_ready = False
        # Set by the profiler: (start, end) timing events of every copy.
        self.copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def _views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        return {s.name: slot[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.arena.layout}

    def _issue_copy(self, block: int) -> None:
        s = block % 2
        if not self.cuda:
            self.slots[s].copy_(self.arena.spans[block])
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.compute_done[s])  # the block that last read this slot has finished
            timing = None
            if self.copy_events is not None:
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record(self.copy_stream)
            self.slots[s].copy_(self.arena.spans[block], non_blocking=True)
            if timing is not None:
                timing[1].record(self.copy_stream)
                self.copy_events.append(timing)  # type: ignore[union-attr]
            self.copy_done[s].record(self.copy_stream)

    def __iter__(self) -> Iterator[LayerWeights]:
        count = len(self.arena.spans)
        if not self.cuda:
            for i in range(count):
                self._issue_copy(i)
                yield LayerWeights(self.views[i % 2], self.loras[i])
            return
        compute = torch.cuda.current_stream(self.device)
        if not self._first_block_ready:
            self._issue_copy(0)
        self._first_block_ready = False
        for i in range(count):
            s = i % 2
            if i + 1 < count:
                self._issue_copy(i + 1)  # overlaps block i's compute
            compute.wait_event(self.copy_done[s])
            yield LayerWeights(self.views[s], self.loras[i])
            self.compute_done[s].record(compute)
        # Every pass starts with block 0: fetch it now, so the copy overlaps the output heads, the latent update and
        # the next evaluation's input packing instead of stalling the next pass.
        self._issue_copy(0)
        self._first_block_ready = True

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.slots, self.views, self.loras = [], [], []


def check_fits(need_bytes: int, free_bytes: int, margin_bytes: int, what: str, device: torch.device, advice: str) -> None:
    """Refuse, before anything moves, a placement whose estimate plus margin exceeds the free device memory."""
    if need_bytes + margin_bytes > free_bytes:
        gib = 1 << 30
        raise RequestError(
            f"{what} needs about {need_bytes / gib:.1f} GiB on {device} plus a {margin_bytes / gib:.1f} GiB margin; "
            f"{free_bytes / gib:.1f} GiB are free. {advice}"
        )


def activation_bytes(config: H3Config, sequence_length: int) -> int:
    """Upper estimate of one evaluation's transient device memory at S packed rows (bf16 block dtype).

    Residual and normalised streams (3 x S x H), fused QKV (S x 3I), q/k copies and attention output (3 x S x I), the
    SwiGLU input and product (S x 2F + S x F), fp32 head inputs (S x H x 4), with a 25 % allowance for the
    allocator and the attention kernel's workspace.
    """
    h, i, f = config.hidden_size, config.inner_dim, config.ffn_dim
    per_row = 2 * (3 * h + 3 * i + 3 * i + 2 * f + f) + 4 * h
    return int(sequence_length * per_row * 1.25)
