"""Buffered sequential reads of one immutable safetensors file.

`TensorStore` reads each requested tensor with its own `readinto` into its own storage, which suits selective reads.
Loading a whole file (a compiled block, the auxiliary tensors) goes faster as a few large reads issued by several
threads at once: storage sees a deep queue of long sequential requests, and no per-tensor allocation or system call
remains. `SequentialWeights` does that:

* The data region (the bytes after the header) is cut at tensor boundaries into *shards* of at most `shard_bytes` (a
  larger tensor gets a shard of its own). Each shard is one owned uint8 buffer, so every tensor is a view into
  exactly one buffer.
* Shards are filled in *chunks* of at most `chunk_bytes`, read with `os.preadv` by a pool of `read_workers` threads
  sharing one descriptor (`preadv` takes an explicit offset, so the threads share no file position). Chunks bound
  one thread's work; without them the H3 blocks' largest tensors (150-300 MB) would each serialise on one thread.
* The descriptor is open only while the buffers are filled. The file's size and mtime are recorded when it is
  indexed and checked before and after the reads: the engine's weight files are immutable, and one that changed is
  refused rather than mixed.

`TensorReader` reads chosen tensors of one file into buffers the caller owns (a pinned staging buffer), the same
way (chunks, a thread pool, `preadv`), as often as asked: weights streamed from their files pass after pass. It can
drop the file's pages from the page cache after each read, so that streaming a model larger than the machine's memory
does not evict everything else the machine caches.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Self

import torch

from ..errors import VflashError, WeightFileError
from ..tensor_store import SafetensorsFile, TensorIndex, read_fully

__all__ = ["SequentialWeights", "TensorReader"]

READ_WORKERS = (1, 2, 4, 8)
DEFAULT_SHARD_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 64 << 20

# A byte range [start, end) of a file.
Range = tuple[int, int]


def data_region(file: SafetensorsFile) -> Range:
    """Where the tensor bytes of `file` lie.

    The format allows no holes, so the lowest tensor offset is where the header ends; a file without tensors has an
    empty region at its end.
    """
    if not file.tensors:
        return file.file_size, file.file_size
    return min(i.start for i in file.tensors.values()), max(i.end for i in file.tensors.values())


def plan_shards(file: SafetensorsFile, shard_bytes: int) -> list[Range]:
    """Cut the data region, only where no tensor crosses, into ranges of at most `shard_bytes` (or one tensor)."""
    start, end = data_region(file)
    cuts = [start]
    reach = start  # no tensor seen so far extends past this offset
    for info in sorted(file.tensors.values(), key=lambda i: (i.start, i.end)):
        if info.start >= reach and info.start > cuts[-1] and info.end - cuts[-1] > shard_bytes:
            cuts.append(info.start)
        reach = max(reach, info.end)
    cuts.append(end)
    return [(a, b) for a, b in pairwise(cuts) if b > a]


def _split(span: Range, chunk_bytes: int) -> list[Range]:
    """`span` in equal pieces of at most `chunk_bytes` (equal, so no piece is a tiny remainder)."""
    start, end = span
    count = max(1, -(-(end - start) // chunk_bytes))
    bounds = [start + (end - start) * k // count for k in range(count + 1)]
    return list(pairwise(bounds))


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as exc:
        raise WeightFileError(f"{path}: cannot read ({exc.strerror})") from None


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise WeightFileError(f"{path}: cannot read ({exc.strerror})") from None


def _check_identity(path: Path, stat: os.stat_result, expected: tuple[int, int], when: str) -> None:
    size, mtime_ns = _identity(stat)
    if (size, mtime_ns) != expected:
        raise WeightFileError(
            f"{path}: changed on disk {when} (size {expected[0]} -> {size} bytes, mtime_ns {expected[1]} -> "
            f"{mtime_ns}); weight files must not change while they are used"
        )


def _pread_into(fd: int, path: Path, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset`; a read that ends early is an error naming the file and the offset."""

    def read(rest: memoryview, filled: int) -> int:
        try:
            return os.preadv(fd, [rest], offset + filled)
        except OSError as exc:
            raise WeightFileError(f"{path}: read failed at byte {offset + filled} ({exc.strerror})") from None

    filled = read_fully(view, read)
    if filled < len(view):
        raise WeightFileError(
            f"{path}: short read at byte {offset + filled}: end of file {len(view) - filled} bytes before the "
            f"end of the range [{offset}, {offset + len(view)})"
        )


def _read_pieces(fd: int, path: Path, pieces: list[tuple[int, memoryview]]) -> int:
    for offset, view in pieces:
        _pread_into(fd, path, view, offset)
    return sum(len(view) for _, view in pieces)


def _run_jobs(workers: int, jobs: Sequence[Callable[[], int]]) -> int:
    """Run `jobs` on `workers` threads and return the sum of their results.

    The first failure cancels the jobs not yet started; it is raised only after the running ones have finished, so
    no thread still reads a descriptor or a buffer that the caller releases next.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vflash-weight-io")
    try:
        return _run_on(pool, jobs)
    finally:
        pool.shutdown(wait=True)


def _run_on(pool: ThreadPoolExecutor, jobs: Sequence[Callable[[], int]]) -> int:
    """`_run_jobs` on a pool the caller keeps (the same first-failure semantics; the pool stays up)."""
    futures = [pool.submit(job) for job in jobs]
    pending = wait(futures, return_when=FIRST_EXCEPTION).not_done
    if pending:  # a job failed: the ones not started are cancelled, the running ones finish
        for future in pending:
            future.cancel()
        wait(futures)
    for future in futures:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            raise error
    return sum(future.result() for future in futures)


class SequentialWeights(TensorIndex):
    """Every tensor of one safetensors file, read into owned shard buffers by a thread pool; see the module docstring.

    Entering the context reads the whole data region (so does the first `get_tensor` outside a context); leaving it
    drops this object's references to the buffers. No file descriptor outlives a read. `pin_memory` allocates
    page-locked buffers for asynchronous host-to-device copies and needs CUDA.

    Its header is `TensorIndex`'s (`names`, `info`, `require`: checked before the context reads anything). Not for
    concurrent use while reading; once read, `get_tensor` may be called from any thread.
    """

    def __init__(
        self,
        path: str | Path,
        read_workers: int = 4,
        *,
        pin_memory: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if read_workers not in READ_WORKERS:
            raise ValueError(f"read_workers must be one of {READ_WORKERS}, not {read_workers}")
        if shard_bytes <= 0 or chunk_bytes <= 0:
            raise ValueError(f"shard_bytes and chunk_bytes must be positive, not {shard_bytes} and {chunk_bytes}")
        if pin_memory and not torch.cuda.is_available():
            raise VflashError("pinned weight buffers need CUDA, which is not available; read with pin_memory=False")
        self._identity = _identity(_stat(Path(path)))
        self.file = SafetensorsFile(path)
        super().__init__(path, [self.file])
        self.read_workers = read_workers
        self.pin_memory = pin_memory
        _check_identity(self.path, _stat(self.path), self._identity, "while it was indexed")
        start, end = data_region(self.file)
        self.nbytes = end - start
        self.shards = plan_shards(self.file, shard_bytes)
        self._shard_starts = [s for s, _ in self.shards]
        self.chunks = [chunk for shard in self.shards for chunk in _split(shard, chunk_bytes)]
        self.bytes_read = 0
        self._buffers: list[torch.Tensor] | None = None
        self._closed = False

    def __enter__(self) -> Self:
        self.read_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_all(self) -> None:
        """Fill every shard buffer, once; the threads and the descriptor are gone when it returns."""
        if self._closed:
            raise VflashError(f"{self.path}: read after close")
        if self._buffers is not None:
            return
        buffers = [
            torch.empty(end - start, dtype=torch.uint8, pin_memory=self.pin_memory) for start, end in self.shards
        ]
        # numpy's stubs declare the buffer protocol (`__buffer__`) for Python >= 3.12 only
        views = [memoryview(buffer.numpy()) for buffer in buffers]  # type: ignore[arg-type]
        fd = _open(self.path)
        try:
            _check_identity(self.path, os.fstat(fd), self._identity, "since it was indexed")
            jobs = [partial(_read_pieces, fd, self.path, self._pieces(views, chunk)) for chunk in self.chunks]
            self.bytes_read += _run_jobs(self.read_workers, jobs)
            _check_identity(self.path, _stat(self.path), self._identity, "while it was read")
        finally:
            os.close(fd)
        self._buffers = buffers

    def _pieces(self, views: list[memoryview], chunk: Range) -> list[tuple[int, memoryview]]:
        """(file offset, destination) of each part of `chunk` that lies in one shard buffer."""
        start, end = chunk
        index = bisect.bisect_right(self._shard_starts, start) - 1
        pieces = []
        while start < end:
            shard_start, shard_end = self.shards[index]
            stop = min(end, shard_end)
            pieces.append((start, views[index][start - shard_start : stop - shard_start]))
            start, index = stop, index + 1
        return pieces

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as a view into the shard buffer that holds it.

        The view stays valid after the context exits and keeps its whole shard buffer alive (up to `shard_bytes`, or
        the tensor alone when it is larger); `clone()` a small tensor kept for long to let its buffer go. An empty
        tensor is a fresh one (it has no bytes to view).
        """
        info = self.file.info(name)
        if self._buffers is None:
            self.read_all()
        nbytes = info.end - info.start
        if nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        index = bisect.bisect_right(self._shard_starts, info.start) - 1
        offset = info.start - self.shards[index][0]
        data = self._buffers[index][offset : offset + nbytes]  # type: ignore[index]
        if offset % info.dtype.itemsize:
            # Torch views bytes as a wider dtype only at a multiple of its size; the safetensors library always
            # aligns tensors, so only a file written otherwise pays for this copy.
            data = data.clone()
        return data.view(info.dtype).view(info.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, by name, as `get_tensor` returns it."""
        return {name: self.get_tensor(name) for name in self.file.tensors}

    def close(self) -> None:
        """Drop the buffers; tensors already handed out keep theirs alive."""
        self._buffers = None
        self._closed = True


class TensorReader:
    """Tensors `names` of the safetensors file `path`, read into caller buffers on every `read_into` (module docstring).

    The header is parsed once; the file's size and mtime recorded then are checked before and after every read, so a
    file that changed is refused rather than mixed. `drop_cache` asks the kernel to drop the file's cached pages after
    each read (`POSIX_FADV_DONTNEED`, where the platform has it): the bytes then come from storage every time.
    """

    def __init__(
        self, path: str | Path, names: list[str], read_workers: int = 8, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        drop_cache: bool = False,
    ):
        if read_workers not in READ_WORKERS:
            raise ValueError(f"read_workers must be one of {READ_WORKERS}, not {read_workers}")
        self.path = Path(path)
        self._identity = _identity(_stat(self.path))
        file = SafetensorsFile(self.path)
        self.infos = {name: file.info(name) for name in names}
        self.read_workers, self.chunk_bytes, self.drop_cache = read_workers, chunk_bytes, drop_cache
        self.nbytes = sum(i.end - i.start for i in self.infos.values())

    def read_into(self, targets: dict[str, torch.Tensor], pool: ThreadPoolExecutor | None = None) -> int:
        """Fill each `targets[name]` (a contiguous CPU uint8 tensor of the tensor's byte count) with the tensor's bytes;
        returns the bytes read. `pool`: the caller's reader threads, kept across reads (else `read_workers` threads
        are started for this read)."""
        jobs = []
        for name, info in self.infos.items():
            view = memoryview(targets[name].numpy())  # type: ignore[arg-type]
            if len(view) != info.end - info.start:
                raise VflashError(
                    f"{self.path}: {name} has {info.end - info.start} bytes; its buffer holds {len(view)}"
                )
            for start, end in _split((info.start, info.end), self.chunk_bytes):
                jobs.append((start, view[start - info.start : end - info.start]))
        fd = _open(self.path)
        try:
            _check_identity(self.path, os.fstat(fd), self._identity, "since it was indexed")
            reads = [partial(_read_pieces, fd, self.path, [job]) for job in jobs]
            read = _run_jobs(self.read_workers, reads) if pool is None else _run_on(pool, reads)
            _check_identity(self.path, _stat(self.path), self._identity, "while it was read")
            if self.drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return read
