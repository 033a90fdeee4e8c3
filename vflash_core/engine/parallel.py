"""Several GPUs for one request.

A `LocalGroup` owns P explicitly named devices, one submitting thread per rank and a local process group built
directly on an in-process store (NCCL on CUDA, Gloo on the CPU for tests): no global `torch.distributed` state, no
launcher. A failure on any rank aborts the group, so no peer waits forever in a collective, and the request ends
with one error naming the rank.

`sequence-head` (Ulysses): the packed rows are split into contiguous ranges, one per rank (uneven lengths allowed;
the first S % P ranks get one more row). Each rank runs norms, projections, FFN and the latent update on its rows.
Attention exchanges Q, K and V with one all-to-all each (issued back to back, so K's relayout overlaps Q's transfer),
after which every rank holds the complete sequence for its 1/P of the heads; the attention output returns with a
fourth all-to-all and is merged back into global head order. Every per-row and per-head operation is the
single-device one, so only GEMM reduction order can differ from a single GPU.

`tensor`: every rank holds the whole residual stream and 1/P of each block's heads and FFN channels (column-sharded
QKV / FFN input, row-sharded output projections whose partial products are summed with an all-reduce, LoRA branches
sharded alongside). Partial sums change rounding; outputs are close to, not bitwise equal to, a single GPU.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import VflashError
from . import model as M

__all__ = [
    "LocalGroup", "RankAborted", "RankFailure", "SequenceHeadAttention", "TensorShard", "head_groups",
    "merge_heads_reference", "pack_heads_reference", "relayout_ops", "split_rows", "tensor_parallel_ops",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def split_rows(total: int, ranks: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) row ranges; the first `total % ranks` ranks get one extra row."""
    if ranks < 1:
        raise VflashError(f"need at least one rank, got {ranks}")
    base, extra = divmod(total, ranks)
    starts = [r * base + min(r, extra) for r in range(ranks + 1)]
    return list(itertools.pairwise(starts))


def head_groups(heads: int, ranks: int) -> list[tuple[int, int]]:
    """Head range [first, stop) each rank attends; the head count must divide by the rank count."""
    if heads % ranks:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise VflashError(f"{heads} attention heads cannot be split over {ranks} GPUs; use a GPU count in {divisors}")
    per = heads // ranks
    return [(r * per, (r + 1) * per) for r in range(ranks)]


class RankFailure(VflashError):
    """A rank raised; the group was aborted."""


class LocalGroup:
    """P ranks in this process on explicit devices; see the module docstring."""

    def __init__(self, devices: list[torch.device], timeout_seconds: float = 120.0):
        if devices[0].type == "cuda" and len({str(d) for d in devices}) != len(devices):
            raise VflashError(f"GPUs must be distinct, got {[str(d) for d in devices]}")
        if len({d.type for d in devices}) != 1:
            raise VflashError("all ranks must use the same device type")
        self.devices = devices
        self.size = len(devices)
        self.timeout = datetime.timedelta(seconds=timeout_seconds)
        self.failed: BaseException | None = None
        store = dist.HashStore()
        self.groups: list[dist.ProcessGroup | None] = [None] * self.size
        self.barrier = threading.Barrier(self.size)
        self.run(lambda rank: self._init_rank(store, rank))

    def _init_rank(self, store: dist.Store, rank: int) -> None:
        device = self.devices[rank]
        # A c10d backend: torch's stubs give `Backend` none of the collectives it has at run time.
        group: Any
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            group = dist.ProcessGroupNCCL(store, rank, self.size, options)
            # Create the communicator now, on this rank's device, rather than lazily inside the first block.
            group.allreduce([torch.zeros(1, device=device)]).wait()
        else:
            group = dist.ProcessGroupGloo(store, rank, self.size, self.timeout)
        self.groups[rank] = group

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Run `fn(rank)` on one thread per rank (each bound to its device); abort everything if any rank raises."""
        if self.failed is not None:
            raise VflashError(f"this GPU group failed earlier ({self.failed}); close the session and create a new one")
        results: list[T | None] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []
        lock = threading.Lock()

        def body(rank: int) -> None:
            try:
                if self.devices[rank].type == "cuda":
                    torch.cuda.set_device(self.devices[rank])
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - every failure must abort the peers
                with lock:
                    errors.append((rank, exc))
                self._abort()

        threads = [
            threading.Thread(target=body, args=(r,), name=f"vflash-rank{r}", daemon=True) for r in range(self.size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            first = next(
                (e for e in errors if not isinstance(e[1], (threading.BrokenBarrierError, RankAborted))), errors[0]
            )
            rank, exc = first
            if isinstance(exc, VflashError) or not isinstance(exc, Exception):
                raise exc
            raise RankFailure(f"rank {rank} on {self.devices[rank]} failed: {type(exc).__name__}: {exc}") from exc
        return results  # type: ignore[return-value]

    def _abort(self) -> None:
        """Unblock every peer: break the host barrier and abort the communicators (they are unusable after)."""
        self.barrier.abort()
        if self.failed is None:
            self.failed = RankAborted("a rank failed")
            for group in self.groups:
                abort = (
                    getattr(group, "abort", None) or getattr(group, "_abort", None)
                    or getattr(group, "shutdown", None)
                )
                if abort is not None:
                    try:
                        abort()
                    except RuntimeError as exc:
                        logger.warning("aborting a process group raised: %s", exc)

    def close(self) -> None:
        for group in self.groups:
            if group is not None and self.failed is None:
                group.shutdown()
        self.groups = [None] * self.size


class RankAborted(VflashError):
    """Raised on peers of a failed rank."""


class SequenceHeadAttention:
    """Attention for one rank's rows: exchange Q, K, V so each rank attends its heads over the whole sequence.

    q, k, v: (1, S_r, heads, D) for this rank's rows (any strides). Returns (1, S_r, heads, D) in global head order.
    `local` attends a sequence held whole on this device (used by the text refiner).
    """

    def __init__(
        self, group: dist.ProcessGroup, rows: list[tuple[int, int]], heads: int, local: M.AttentionFn, pack: Callable,
        merge: Callable
    ):
        self.group = group
        self.size = len(rows)
        self.rows = rows
        self.heads = heads
        self.heads_per_rank = heads // self.size  # the session checked that the rank count divides the heads
        self.local = local
        self.pack = pack  # (x (S_r, heads, D) strided, out (P, S_r, Hp, D)) -> out
        self.merge = merge  # (received (P, S_r, Hp, D), out (S_r, heads, D)) -> out

    def assign_rows(self, rows: list[tuple[int, int]]) -> None:
        """Every rank's [start, stop) rows of the next request's packed sequence (one range per rank, in rank order)."""
        self.rows = rows

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p, hp = self.size, self.heads_per_rank
        s_r = q.shape[1]
        d = q.shape[-1]
        total = self.rows[-1][1]
        in_splits = [s_r * hp * d] * p
        out_splits = [(stop - start) * hp * d for start, stop in self.rows]
        received, works, keep = [], [], []
        for x in (q, k, v):
            send = self.pack(x[0], torch.empty(p, s_r, hp, d, dtype=x.dtype, device=x.device))
            full = torch.empty(total, hp, d, dtype=x.dtype, device=x.device)
            works.append(
                self.group.alltoall_base(full.view(-1), send.view(-1), out_splits, in_splits, dist.AllToAllOptions())
            )
            received.append(full)
            keep.append(send)
        for work in works:
            work.wait()
        out = self.local(*(t[None] for t in received))[0].contiguous()  # (S, Hp, D)
        back = torch.empty(p, s_r, hp, d, dtype=out.dtype, device=out.device)
        self.group.alltoall_base(back.view(-1), out.view(-1), in_splits, out_splits, dist.AllToAllOptions()).wait()
        return self.merge(back, torch.empty(s_r, self.heads, d, dtype=out.dtype, device=out.device))[None]


def pack_heads_reference(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(S_r, heads, D) -> destination-major (P, S_r, heads/P, D): destination j gets heads [j*Hp, (j+1)*Hp)."""
    p = out.shape[0]
    out.copy_(x.unflatten(1, (p, -1)).permute(1, 0, 2, 3))
    return out


def merge_heads_reference(received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Source-major (P, S_r, Hp, D) -> (S_r, P * Hp, D) in global head order."""
    out.unflatten(1, (received.shape[0], -1)).copy_(received.permute(1, 0, 2, 3))
    return out


def relayout_ops(device: torch.device) -> tuple[Callable, Callable]:
    """(pack, merge) for `SequenceHeadAttention` on `device`: the Triton kernels of `vflash_kernels.relayout` on CUDA
    (the same bits: pure copies), the torch references elsewhere (Gloo ranks are CPU threads, and Triton's interpreter
    is not thread-safe)."""
    if device.type != "cuda":
        return pack_heads_reference, merge_heads_reference
    from .._imports import vflash_kernels

    vflash_kernels()
    from vflash_kernels.relayout import merge_heads, pack_heads

    return pack_heads, merge_heads


class TensorShard:
    """Rank `rank` of `size`: its heads of Q/K/V and of the output projection's input, its FFN channels.

    Column-sharded (output rows): `attn.qkv` (its heads' rows of q, k and v), `ffn.in` (its value and gate channels,
    kept [value; gate]). Row-sharded (input columns): `attn.out`, `ffn.out`; their partial products are summed across
    ranks. Norm weights are whole. LoRA residuals follow their linear: B rows for column shards, A columns for row
    shards (the partial B(A_r x_r) sums to B(A x)).
    """

    def __init__(self, config, rank: int, size: int):
        if config.ffn_dim % size:  # (the session checked the heads)
            raise VflashError(f"FFN width {config.ffn_dim} cannot be split over {size} GPUs")
        self.rank, self.size = rank, size
        self.inner, self.ffn = config.inner_dim, config.ffn_dim
        self.inner_r, self.ffn_r = config.inner_dim // size, config.ffn_dim // size

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        rows = {"attn.qkv.weight": 3 * self.inner_r, "ffn.in.weight": 2 * self.ffn_r}
        cols = {"attn.out.weight": self.inner_r, "ffn.out.weight": self.ffn_r}
        if name in rows:
            return (rows[name], shape[1])
        if name in cols:
            return (shape[0], cols[name])
        return shape

    def _rows(self, t: torch.Tensor, part: int, width: int) -> torch.Tensor:
        start = part * width * self.size + self.rank * width
        return t[start : start + width]

    def _columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        return t[:, self.rank * width : (self.rank + 1) * width].contiguous()

    def tensors(self, tensors) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        qkv, ffn_in = tensors["attn.qkv.weight"], tensors["ffn.in.weight"]
        out["attn.qkv.weight"] = torch.cat([self._rows(qkv, k, self.inner_r) for k in range(3)])
        out["ffn.in.weight"] = torch.cat([self._rows(ffn_in, k, self.ffn_r) for k in range(2)])
        out["attn.out.weight"] = self._columns(tensors["attn.out.weight"], self.inner_r)
        out["ffn.out.weight"] = self._columns(tensors["ffn.out.weight"], self.ffn_r)
        return out

    def loras(self, loras) -> dict[str, tuple[M.LoraResidual, ...]]:
        out = {}
        for name, residuals in loras.items():
            sharded = []
            for r in residuals:
                # the factor holding the output rows: B, or a full-rank delta (no B) itself
                rows_of = "down" if r.up is None else "up"
                if name == "attn.qkv":  # one residual per q / k / v part; keep this rank's heads of it
                    part = r.row_start // self.inner
                    rows = self._rows(getattr(r, rows_of), 0, self.inner_r).contiguous()
                    sharded.append(replace(r, **{rows_of: rows, "row_start": part * self.inner_r}))
                elif name == "ffn.in":
                    rows = torch.cat([self._rows(getattr(r, rows_of), k, self.ffn_r) for k in range(2)])
                    sharded.append(replace(r, **{rows_of: rows}))
                else:  # attn.out / ffn.out: this rank's input columns of A (or of the delta)
                    down = self._columns(r.down, self.inner_r if name == "attn.out" else self.ffn_r)
                    sharded.append(replace(r, down=down))
            out[name] = tuple(sharded)
        return out


def tensor_parallel_ops(
    config, group: dist.ProcessGroup, size: int, attention: M.AttentionFn, ops_class: type[M.BlockOps] = M.BlockOps
) -> M.BlockOps:
    """The block's operations on one tensor-parallel rank: this rank's heads and FFN channels (the block's shape as
    the rank sees it), and an all-reduce of the two output projections' partial products (bf16, so the rounding
    differs from one GPU)."""

    def reduce(partial: torch.Tensor) -> torch.Tensor:
        group.allreduce([partial]).wait()
        return partial

    shard = replace(config, num_attention_heads=config.num_attention_heads // size, ffn_dim=config.ffn_dim // size)
    return ops_class(shard, attention, reduce)
