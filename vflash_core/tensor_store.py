"""Read tensors from immutable safetensors files straight into their final CPU storage.

A `SafetensorsFile` parses and validates the header once and keeps no file descriptor open. Reads open the file,
`readinto` each requested byte range directly into the storage of the tensor that is returned (or into a slice of a
caller-provided tensor, which is how fused and reordered weights are assembled without intermediate copies), and close
it again. Returned tensors own their storage and stay valid after the file is gone.

`TensorIndex` is the one interface over what the headers say (names, metadata, shapes and dtypes, `require`), for a
single file and for a sharded checkpoint described by a `*.safetensors.index.json` (the diffusers `transformer/`
folder layout). Its two readers: `TensorStore`, tensor by tensor (selective reads, row ranges into caller tensors),
and `weight_io.SequentialWeights`, one whole file by several threads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import WeightFileError
from .fileio import check_input_file

__all__ = [
    "ReadRequest", "SafetensorsFile", "TensorIndex", "TensorInfo", "TensorStore", "describe_files", "file_sha256",
    "read_fully", "write_safetensors", "write_safetensors_streamed",
]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# A header larger than this is not a tensor index but a corrupt length prefix.
_MAX_HEADER_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in its file: absolute byte range [start, end), dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along dim 0."""
        return (self.end - self.start) // self.shape[0] if self.shape and self.shape[0] else 0


@dataclass(frozen=True)
class ReadRequest:
    """Copy rows [row_start, row_stop) of tensor `name` (dim 0) into `out`, which must be contiguous."""

    name: str
    out: torch.Tensor
    row_start: int = 0
    row_stop: int | None = None


def read_fully(view: memoryview, read: Callable[[memoryview, int], int | None]) -> int:
    """Fill `view` by calls `read(the rest of view, bytes filled so far)` until it is full or a read returns nothing
    (the data ended): the bytes filled. A read may return fewer bytes than asked (a pipe, a signal, a stream)."""
    filled = 0
    while filled < len(view):
        count = read(view[filled:], filled)
        if not count:
            break
        filled += count
    return filled


class SafetensorsFile:
    """Validated index of one safetensors file; see the module docstring."""

    def __init__(self, path: str | Path):
        self.path = check_input_file(path, "safetensors file", WeightFileError)  # a FIFO would block the open
        try:
            self.file_size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                prefix = handle.read(8)
                if len(prefix) < 8:
                    raise WeightFileError(f"{self.path}: truncated safetensors file ({self.file_size} bytes)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > _MAX_HEADER_BYTES or 8 + header_len > self.file_size:
                    raise WeightFileError(
                        f"{self.path}: corrupt or truncated safetensors header (declares {header_len} header bytes, "
                        f"file has {self.file_size})"
                    )
                header_bytes = handle.read(header_len)
        except OSError as exc:
            raise WeightFileError(f"{self.path}: cannot read ({exc.strerror})") from None
        try:
            header = json.loads(header_bytes, object_pairs_hook=self._unique_keys)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise WeightFileError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise WeightFileError(f"{self.path}: corrupt safetensors header (not an object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        self.tensors = {name: self._parse_entry(name, entry, data_start) for name, entry in header.items()}
        self._check_disjoint()
        data_end = max((info.end for info in self.tensors.values()), default=data_start)
        if data_end > self.file_size:
            raise WeightFileError(
                f"{self.path}: truncated safetensors file: tensors need {data_end} bytes, file has {self.file_size}"
            )

    def _unique_keys(self, pairs: list[tuple[str, object]]) -> dict[str, object]:
        """A JSON object whose keys are all different: Python's parser keeps the last of a repeated key, so a name
        given twice would silently read one of two byte ranges (the safetensors library refuses such a file)."""
        seen: dict[str, object] = {}
        for key, value in pairs:
            if key in seen:
                raise WeightFileError(f"{self.path}: corrupt safetensors header: {key!r} is given twice")
            seen[key] = value
        return seen

    def _check_disjoint(self) -> None:
        """No two tensors share bytes: a header whose ranges overlap would read one tensor's weights as another's."""
        ranges = sorted((info.start, info.end, name) for name, info in self.tensors.items() if info.end > info.start)
        for (_, end, name), (start, _, other) in itertools.pairwise(ranges):
            if start < end:
                raise WeightFileError(
                    f"{self.path}: corrupt safetensors header: tensors {name!r} and {other!r} share bytes"
                )

    def _parse_entry(self, name: str, entry: object, data_start: int) -> TensorInfo:
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]  # type: ignore[index]
            shape = tuple(int(d) for d in entry["shape"])  # type: ignore[index]
            begin, stop = (int(o) for o in entry["data_offsets"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            raise WeightFileError(f"{self.path}: corrupt header entry for tensor {name!r}: {entry!r}") from None
        expected = math.prod(shape) * dtype.itemsize
        if begin < 0 or stop - begin != expected:
            raise WeightFileError(
                f"{self.path}: corrupt header entry for tensor {name!r}: {stop - begin} bytes for shape {list(shape)} "
                f"{entry['dtype']}, which needs {expected}"  # type: ignore[index]
            )
        return TensorInfo(dtype, shape, data_start + begin, data_start + stop)

    def read_group(self, requests: Iterable[ReadRequest]) -> None:
        """Serve `requests` with one open of the file, in file order."""
        jobs = []
        for request in requests:
            info = self.info(request.name)
            if info.shape:
                stop = info.shape[0] if request.row_stop is None else request.row_stop
                start_byte = info.start + request.row_start * info.row_bytes
                nbytes = (stop - request.row_start) * info.row_bytes
            else:  # 0-d tensor
                stop, start_byte, nbytes = 0, info.start, info.end - info.start
            if not request.out.is_contiguous() or request.out.dtype != info.dtype or request.out.nbytes != nbytes:
                raise ValueError(
                    f"read of {request.name!r} rows [{request.row_start}, {stop}) needs a contiguous {info.dtype} "
                    f"destination of {nbytes} bytes, got {request.out.dtype} {list(request.out.shape)}"
                )
            jobs.append((start_byte, nbytes, request.out))
        jobs.sort(key=lambda job: job[0])
        size = self.path.stat().st_size  # immutable means immutable: a file whose size changed is refused
        if size != self.file_size:
            raise WeightFileError(
                f"{self.path}: changed on disk since it was opened ({self.file_size} -> {size} bytes)"
            )
        with open(self.path, "rb", buffering=0) as handle:
            for start_byte, nbytes, out in jobs:
                if nbytes == 0:
                    continue
                # numpy's stubs declare the buffer protocol (`__buffer__`) for Python >= 3.12 only
                view = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                handle.seek(start_byte)
                filled = read_fully(view, lambda rest, _: handle.readinto(rest))
                if filled < nbytes:
                    raise WeightFileError(f"{self.path}: truncated while reading at byte {start_byte + filled}")

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightFileError(f"{self.path}: missing tensor {name!r}") from None


class TensorIndex:
    """The tensors of parsed safetensors files (one file, or the shards of one checkpoint at `path`), by name."""

    def __init__(self, path: str | Path, files: Iterable[SafetensorsFile]):
        self.path = Path(path)
        self.files: list[SafetensorsFile] = []
        self._file_of: dict[str, SafetensorsFile] = {}
        for shard in files:
            self.files.append(shard)
            for name in shard.tensors:
                if name in self._file_of:
                    raise WeightFileError(f"{self.path}: tensor {name!r} appears in two shards")
                self._file_of[name] = shard

    @property
    def names(self) -> list[str]:
        return list(self._file_of)

    @property
    def metadata(self) -> dict[str, str]:
        """`__metadata__` of the first file (single-file stores carry their metadata there)."""
        return dict(self.files[0].metadata) if self.files else {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def info(self, name: str) -> TensorInfo:
        if name not in self._file_of:
            raise WeightFileError(f"{self.path}: missing tensor {name!r}")
        return self._file_of[name].info(name)

    def file_path(self, name: str) -> Path:
        """The file (the shard) that holds tensor `name`."""
        self.info(name)  # a missing name is refused as `info` refuses it
        return self._file_of[name].path

    def require(self, expect: Mapping[str, tuple[tuple[int, ...], torch.dtype | tuple[torch.dtype, ...]]]) -> None:
        """Check names, shapes and dtypes; the error lists every problem, not just the first."""
        problems = []
        missing = sorted(name for name in expect if name not in self._file_of)
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            problems.append(f"missing {len(missing)} tensor(s): {shown}")
        for name, (shape, dtypes) in expect.items():
            if name not in self._file_of:
                continue
            info = self.info(name)
            allowed = dtypes if isinstance(dtypes, tuple) else (dtypes,)
            if info.shape != tuple(shape) or info.dtype not in allowed:
                want = "/".join(str(d).removeprefix("torch.") for d in allowed)
                problems.append(
                    f"{name}: expected {list(shape)} {want}, found {list(info.shape)} "
                    f"{str(info.dtype).removeprefix('torch.')}"
                )
        if problems:
            raise WeightFileError(f"{self.path}: " + "; ".join(problems))


class TensorStore(TensorIndex):
    """One view over a single safetensors file or a sharded checkpoint, read tensor by tensor.

    `path` may be a `.safetensors` file, a `*.safetensors.index.json`, or a directory holding either exactly one
    index or exactly one `.safetensors` file.
    """

    def __init__(self, path: str | Path):
        super().__init__(path, (SafetensorsFile(file_path) for file_path in _resolve_files(Path(path))))

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read whole tensors into fresh CPU tensors that own their storage."""
        out = {}
        for name in names:
            info = self.info(name)
            out[name] = torch.empty(info.shape, dtype=info.dtype)
        self.read_into([ReadRequest(name, tensor) for name, tensor in out.items()])
        return out

    def read_into(self, requests: Iterable[ReadRequest]) -> None:
        """Serve row-range reads into caller-provided tensors, one open per shard."""
        by_file: dict[int, list[ReadRequest]] = {}
        for request in requests:
            if request.name not in self._file_of:
                raise WeightFileError(f"{self.path}: missing tensor {request.name!r}")
            by_file.setdefault(id(self._file_of[request.name]), []).append(request)
        for shard in self.files:
            if id(shard) in by_file:
                shard.read_group(by_file[id(shard)])


def _resolve_files(path: Path) -> list[Path]:
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        singles = sorted(path.glob("*.safetensors"))
        if len(indexes) == 1:
            path = indexes[0]
        elif len(indexes) > 1:
            raise WeightFileError(f"{path}: more than one *.safetensors.index.json: {[p.name for p in indexes]}")
        elif len(singles) == 1:
            return singles
        else:
            raise WeightFileError(
                f"{path}: expected one .safetensors file or a *.safetensors.index.json, found {len(singles)} files"
            )
    if not path.exists():
        raise WeightFileError(f"{path}: no such file")
    if path.name.endswith(".index.json"):
        check_input_file(path, "safetensors index", WeightFileError)
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightFileError(f"{path}: not a valid safetensors index ({exc})") from None
        return [path.parent / name for name in dict.fromkeys(weight_map.values())]
    return [path]


def write_safetensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Write CPU `tensors` as a safetensors file and return (size in bytes, sha256), hashing the bytes as they go out.

    The tensors' own memory is written and hashed (no serialised copy of the file is built), so a writer thread moves
    each byte once; `hashlib` and file writes release the GIL, so several writers run in parallel.
    """
    layout = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()}
    return write_safetensors_streamed(path, layout, tensors.__getitem__, metadata)


def write_safetensors_streamed(
    path: str | Path,
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Write a safetensors file whose tensors (name -> (dtype, shape) in `layout`) are made one at a time by
    `produce(name)` (a CPU tensor of that dtype and shape) and dropped once written, so a file larger than host memory
    can be written; returns (size in bytes, sha256). Tensors are laid out by decreasing element size, like the
    safetensors library does, so each one is aligned for zero-copy reads.
    """
    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    order = sorted(layout, key=lambda name: -layout[name][0].itemsize)
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = layout[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        for chunk in (struct.pack("<Q", len(encoded)), encoded):
            digest.update(chunk)
            handle.write(chunk)
        for name in order:
            tensor = produce(name).contiguous()
            if (tensor.dtype, tuple(tensor.shape)) != layout[name]:
                made = (tensor.dtype, tuple(tensor.shape))
                raise ValueError(f"{name}: produced {made[0]} {made[1]}, the layout says {layout[name]}")
            if tensor.numel():
                # numpy's stubs declare the buffer protocol (`__buffer__`) for Python >= 3.12 only
                data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                digest.update(data)
                handle.write(data)
            del tensor
    return 8 + len(encoded) + offset, digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a whole file, read in large chunks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def describe_files(paths: Iterable[Path], with_hash: bool) -> list[dict[str, object]]:
    """Identity records (name, size, modification time in ns, and optionally sha256) for a list of files, in order."""
    records = []
    for path in paths:
        stat = os.stat(path)
        record: dict[str, object] = {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if with_hash:
            record["sha256"] = file_sha256(path)
        records.append(record)
    return records
