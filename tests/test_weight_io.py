"""Buffered sequential weight reads: bitwise equal to `TensorStore`, and refusing changed files and short reads without
leaking descriptors."""

from __future__ import annotations

import gc
import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from vflash_core.engine.weight_io import SequentialWeights
from vflash_core.errors import VflashError, WeightFileError
from vflash_core.tensor_store import TensorStore, read_fully

# Small enough that the test file has several shards, a tensor larger than a shard, and tensors across chunks.
SMALL = {"shard_bytes": 4096, "chunk_bytes": 1000}


@pytest.fixture()
def mixed_file(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "blocks.0.qkv.weight": torch.randn(61, 37, generator=generator).to(torch.bfloat16),
        "blocks.0.ffn.weight": torch.randn(33, 29, generator=generator),
        "blocks.1.big.weight": torch.randn(40, 100, generator=generator).to(torch.bfloat16),
        "positions": torch.randint(-(2**40), 2**40, (97,), generator=generator, dtype=torch.int64),
        "scale": torch.tensor(0.125),
        "empty": torch.empty(0, 8, dtype=torch.float16),
        "mask": torch.rand(13, generator=generator) > 0.5,
        "codes": torch.randint(0, 256, (3,), generator=generator, dtype=torch.int64).to(torch.uint8),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    return path


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{what}: {actual.dtype} {actual.shape}"
    assert torch.equal(actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), what


def _assert_matches_store(weights: SequentialWeights, path) -> None:
    expected = TensorStore(path).read(TensorStore(path).names)
    assert sorted(weights.names) == sorted(expected)
    for name, tensor in weights.tensors().items():
        _assert_same_bits(tensor, expected[name], name)


def _spans_boundary(weights: SequentialWeights, boundaries: list[int]) -> bool:
    return any(info.start < b < info.end for b in boundaries for info in map(weights.info, weights.names))


def _open_fds() -> int:
    """This process's open files, after a garbage collection: an earlier test's unreferenced file objects (another
    test file's, in the same xdist worker) must not close in the middle of a check and count as this one's."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_bitwise_equal_to_the_tensor_store(mixed_file, workers):
    with SequentialWeights(mixed_file, workers, **SMALL) as weights:
        assert len(weights.shards) > 2 and len(weights.chunks) > len(weights.shards)
        assert _spans_boundary(weights, [start for start, _ in weights.chunks]), "no tensor crosses a chunk boundary"
        assert any(end - start > SMALL["shard_bytes"] for start, end in weights.shards), "no tensor-sized shard"
        _assert_matches_store(weights, mixed_file)
        assert weights.bytes_read == weights.nbytes == weights.shards[-1][1] - weights.shards[0][0]
        assert weights.metadata == {"k": "v"}


def test_views_outlive_the_context_and_the_file(mixed_file):
    expected = TensorStore(mixed_file).read(["blocks.0.qkv.weight", "blocks.0.ffn.weight"])
    before = _open_fds()
    with SequentialWeights(mixed_file, 2) as weights:
        qkv, ffn = weights.get_tensor("blocks.0.qkv.weight"), weights.get_tensor("blocks.0.ffn.weight")
        assert len(weights.shards) == 1
        assert qkv.untyped_storage().data_ptr() == ffn.untyped_storage().data_ptr(), "views of one shard buffer"
    assert _open_fds() == before
    mixed_file.unlink()
    _assert_same_bits(qkv, expected["blocks.0.qkv.weight"], "after exit and delete")
    _assert_same_bits(ffn, expected["blocks.0.ffn.weight"], "after exit and delete")
    with pytest.raises(VflashError, match="after close"):
        weights.get_tensor("scale")


def test_first_use_reads_without_a_context(mixed_file):
    weights = SequentialWeights(mixed_file, 1)
    assert weights.bytes_read == 0
    _assert_same_bits(weights.get_tensor("positions"), TensorStore(mixed_file).read(["positions"])["positions"], "lazy")
    assert weights.bytes_read == weights.nbytes


def test_unaligned_tensor_is_read_exactly(tmp_path):
    """A file not written by the safetensors library may put a float32 at an odd offset."""
    header = json.dumps({
        "u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
    }).encode()
    path = tmp_path / "unaligned.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes([1, 2, 3]) + struct.pack("<2f", 1.5, -2.25))
    with SequentialWeights(path, 1) as weights:
        _assert_matches_store(weights, path)


@pytest.mark.parametrize("change", ["size", "mtime"])
def test_changed_source_is_refused(mixed_file, change):
    weights = SequentialWeights(mixed_file, 2, **SMALL)
    before = _open_fds()
    if change == "size":
        with open(mixed_file, "ab") as handle:
            handle.write(b"\0")
    else:
        stat = mixed_file.stat()
        os.utime(mixed_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(WeightFileError, match="changed on disk"), weights:
        pass
    assert _open_fds() == before


def test_short_read_names_file_and_offset(mixed_file, monkeypatch):
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    weights = SequentialWeights(mixed_file, 4, **SMALL)
    before = _open_fds()
    with pytest.raises(WeightFileError, match=rf"{mixed_file}: short read at byte \d+"):
        weights.read_all()
    assert _open_fds() == before


def test_sequential_weights_refuses_bad_workers_and_pinning_without_cuda(mixed_file):
    with pytest.raises(ValueError, match="read_workers"):
        SequentialWeights(mixed_file, 3)
    if not torch.cuda.is_available():
        with pytest.raises(VflashError, match="need CUDA"):
            SequentialWeights(mixed_file, 1, pin_memory=True)


def test_read_fully_takes_short_reads_and_stops_where_the_data_ends():
    data = bytes(range(10))
    seen: list[int] = []

    def three_at_a_time(rest: memoryview, filled: int) -> int:
        seen.append(filled)
        part = data[filled : filled + min(3, len(rest))]
        rest[: len(part)] = part
        return len(part)

    view = memoryview(bytearray(10))
    assert read_fully(view, three_at_a_time) == 10 and bytes(view) == data and seen == [0, 3, 6, 9]
    longer = memoryview(bytearray(14))
    assert read_fully(longer, three_at_a_time) == 10 and bytes(longer[:10]) == data  # the data ended 4 bytes short
