"""Weight reading: the safetensors tensor store and the two official checkpoint layouts."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import transformer_files
from conftest import TINY, assert_bitwise
from safetensors.torch import save_file

from vflash_core.errors import WeightFileError
from vflash_core.tensor_store import ReadRequest, SafetensorsFile, TensorStore
from vflash_core.weights import synthetic
from vflash_core.weights.checkpoint import SourceWeights


@pytest.fixture()
def sample_file(tmp_path):
    tensors = {"a": torch.randn(5, 7).to(torch.bfloat16), "b": torch.arange(12, dtype=torch.int64).reshape(3, 4), "c": torch.randn(3)}
    path = tmp_path / "sample.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    return path, tensors


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reads_exact_values_into_owned_storage(sample_file):
    path, tensors = sample_file
    before = _open_fds()
    store = TensorStore(path)
    out = store.read(["a", "b", "c"])
    assert _open_fds() == before, "the store must not keep a file descriptor open"
    for name, tensor in tensors.items():
        assert_bitwise(out[name], tensor, name)
    path.unlink()  # tensors own their storage: valid after the file is gone
    assert_bitwise(out["a"], tensors["a"], "after delete")
    assert store.metadata == {"k": "v"}


def test_row_range_reads_into_slices(sample_file):
    path, tensors = sample_file
    dest = torch.zeros(5, 7, dtype=torch.bfloat16)
    TensorStore(path).read_into([ReadRequest("a", dest[3:5], 0, 2), ReadRequest("a", dest[0:3], 2, 5)])
    assert_bitwise(dest, torch.cat([tensors["a"][2:5], tensors["a"][0:2]]), "swapped rows")


def test_sharded_diffusers_folder_reads_through_its_index(tmp_path, tiny_weights):
    folder = synthetic.write_diffusers_transformer(tmp_path / "t", TINY, tiny_weights, max_shard_bytes=20_000)
    store = TensorStore(folder)
    assert len(store.files) > 3
    name = "transformer_blocks.1.attn.to_k.weight"
    assert_bitwise(store.read([name])[name], tiny_weights["blocks.1.attn.qkv.weight"][TINY.inner_dim : 2 * TINY.inner_dim], name)


def test_truncated_file_is_rejected(sample_file):
    path, _ = sample_file
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(WeightFileError, match="truncated"):
        SafetensorsFile(path)
    path.write_bytes(data[:5])
    with pytest.raises(WeightFileError, match="truncated"):
        SafetensorsFile(path)


def test_corrupt_header_is_rejected(sample_file):
    path, _ = sample_file
    data = bytearray(path.read_bytes())
    data[8:9] = b"#"
    path.write_bytes(bytes(data))
    with pytest.raises(WeightFileError, match="not JSON"):
        SafetensorsFile(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(WeightFileError, match="needs 16"):
        SafetensorsFile(path)


def _raw_safetensors(path, header_json: str, data_bytes: int) -> None:
    header = header_json.encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * data_bytes)


def test_a_header_naming_a_tensor_twice_or_sharing_bytes_is_refused(tmp_path):
    """A header that named one tensor twice was read silently (Python's JSON parser keeps the last), so one block's
    weights came from another's bytes; the safetensors library, and so ComfyUI, refuses both files."""
    from safetensors import SafetensorError, safe_open

    path = tmp_path / "forged.safetensors"

    def entry(start: int, end: int) -> str:
        return json.dumps({"dtype": "F32", "shape": [2], "data_offsets": [start, end]})

    # A header naming a key twice, which a dict cannot hold: written as text.
    _raw_safetensors(path, f'{{"blocks.0.w": {entry(0, 8)}, "blocks.1.w": {entry(8, 16)}, "blocks.0.w": {entry(8, 16)}}}', 16)
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")
    with pytest.raises(WeightFileError, match=r"forged.safetensors: corrupt safetensors header: 'blocks.0.w' is given twice$"):
        SafetensorsFile(path)
    _raw_safetensors(path, f'{{"blocks.0.w": {entry(0, 8)}, "blocks.1.w": {entry(4, 12)}}}', 16)
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")
    with pytest.raises(WeightFileError, match=r"corrupt safetensors header: tensors 'blocks.0.w' and 'blocks.1.w' share bytes$"):
        SafetensorsFile(path)


def test_file_changed_after_indexing_is_refused(sample_file):
    path, _ = sample_file
    indexed = SafetensorsFile(path)
    with open(path, "ab") as handle:
        handle.write(b"extra")
    with pytest.raises(WeightFileError, match="changed on disk"):
        indexed.read_group([ReadRequest("c", torch.empty(3))])


def test_require_reports_missing_wrong_shape_and_dtype(sample_file):
    path, _ = sample_file
    store = TensorStore(path)
    with pytest.raises(WeightFileError) as info:
        store.require({"a": ((5, 7), torch.float32), "b": ((4, 3), torch.int64), "zz": ((1,), torch.float32)})
    message = str(info.value)
    assert "missing 1 tensor(s): zz" in message
    assert "a: expected [5, 7] float32, found [5, 7] bfloat16" in message
    assert "b: expected [4, 3] int64, found [3, 4] int64" in message


# -- official layouts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qkv_layout", ["stacked", "interleaved"])
def test_original_layout_reads_same_internal_tensors_as_diffusers(tmp_path, tiny_transformer, tiny_weights, qkv_layout):
    single = transformer_files.write_original_transformer(tmp_path / "h3.safetensors", TINY, tiny_weights, qkv_layout, embed_config=False)
    diffusers = SourceWeights(tiny_transformer)
    original = SourceWeights(single, qkv_layout=qkv_layout)
    assert original.layout == "original" and diffusers.layout == "diffusers"
    # No config in the file: inferred from tensor shapes (rotary width from the release's 3/4 of a head).
    assert original.config == TINY
    names = list(diffusers.shapes())
    a, b = diffusers.read(names), original.read(names)
    for name in names:
        assert_bitwise(b[name], tiny_weights[name], name)
        assert_bitwise(a[name], tiny_weights[name], name)


def test_original_layout_with_prefix_and_embedded_config(tmp_path, tiny_weights):
    state = synthetic.to_original_names(tiny_weights, TINY)
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(tmp_path / "p.safetensors"), metadata={"config": json.dumps(TINY.to_dict())})
    source = SourceWeights(tmp_path / "p.safetensors")
    assert source.config == TINY
    assert_bitwise(source.read(["blocks.0.ffn.in.weight"])["blocks.0.ffn.in.weight"], tiny_weights["blocks.0.ffn.in.weight"], "fc1 swapped")


def test_missing_and_misshapen_weights_are_listed(tmp_path, tiny_weights):
    broken = dict(tiny_weights)
    del broken["blocks.1.ffn.out.weight"]
    broken["blocks.0.norm1.weight"] = torch.ones(7, dtype=torch.bfloat16)
    folder = synthetic.write_diffusers_transformer(tmp_path / "t", TINY, broken)
    with pytest.raises(WeightFileError) as info:
        SourceWeights(folder)
    assert "transformer_blocks.1.ff.net.2.weight" in str(info.value)
    assert "transformer_blocks.0.norm1.weight: expected [24]" in str(info.value)


def test_malformed_adaln_t_table_is_rejected(tmp_path, tiny_weights):
    """Pruned files are read (tests/test_comfy_transformer_files.py); a curve table that is not [grid >= 2, rank] fp32
    is refused."""
    state = synthetic.to_original_names(tiny_weights, TINY)
    state["adaln_t_table"] = torch.zeros(4)
    save_file(state, str(tmp_path / "pruned.safetensors"))
    with pytest.raises(WeightFileError, match=r"`adaln_t_table` must be a \[grid >= 2, rank\] fp32 table"):
        SourceWeights(tmp_path / "pruned.safetensors")


def test_not_an_h3_checkpoint(tmp_path):
    save_file({"foo": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(WeightFileError, match="not an H3 transformer"):
        SourceWeights(tmp_path / "x.safetensors")


def test_safetensors_writer_round_trips_and_hashes_what_it_wrote(tmp_path):
    """The compiler's writer: the library reads its files back exactly, with metadata, and the hash is the file's."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import load_file

    from vflash_core.tensor_store import write_safetensors

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "f64": torch.randn(7, dtype=torch.float64), "scalar": torch.tensor(3),
        "empty": torch.empty(0, 4), "u8": torch.arange(5, dtype=torch.uint8), "f32": torch.randn(2, 2).t(),  # not contiguous
    }
    path = tmp_path / "x.safetensors"
    size, sha256 = write_safetensors(path, tensors, {"format": "test"})
    data = path.read_bytes()
    assert size == len(data) and sha256 == hashlib.sha256(data).hexdigest()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(path, "pt") as handle:
        assert handle.metadata() == {"format": "test"}


@pytest.mark.parametrize("qkv_layout", ["stacked", "interleaved"])
def test_original_layout_reads_as_diffusers_own_converter_reads_it(tmp_path, tiny_weights, qkv_layout):
    """An oracle for the original single-file conventions that is not our own writer: diffusers' single-file
    converter (`from_single_file`) and `SourceWeights` read the same file into the same values, name for name
    (fused QKV per-head interleaved or stacked, `mlp.fc1` stored [gate; value], `final_layer.*`)."""
    from diffusers import MiniMaxH3Transformer3DModel

    folder = synthetic.write_diffusers_transformer(tmp_path / "transformer", TINY, tiny_weights)  # its config.json only
    path = transformer_files.write_original_transformer(tmp_path / "h3.safetensors", TINY, tiny_weights, qkv_layout)
    converted = MiniMaxH3Transformer3DModel.from_single_file(str(path), config=str(folder), qkv_layout=qkv_layout, torch_dtype=torch.float32).state_dict()
    source = SourceWeights(path, qkv_layout=qkv_layout)
    ours = source.read(list(source.shapes()))
    seen = set()
    for name, tensor in ours.items():
        for diffusers_name, rows in synthetic.diffusers_names(name, TINY):
            assert_bitwise(tensor[rows].float(), converted[diffusers_name], diffusers_name)
            seen.add(diffusers_name)
    assert seen == set(converted)


def test_the_streamed_safetensors_writer_makes_each_tensor_when_it_is_written(tmp_path):
    """`write_safetensors_streamed` asks for each tensor once, in file order, and refuses one that does not match its
    layout (a header would lie about it)."""
    from safetensors.torch import load_file

    from vflash_core.tensor_store import write_safetensors_streamed

    tensors = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.randn(5), "c": torch.arange(6, dtype=torch.uint8)}
    asked = []
    path = tmp_path / "x.safetensors"

    def produce(name):
        asked.append(name)
        return tensors[name]

    layout = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    size, _ = write_safetensors_streamed(path, layout, produce)
    assert asked == ["b", "a", "c"] and size == path.stat().st_size  # by decreasing element size
    assert all(torch.equal(load_file(path)[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError, match="b: produced torch.float32 \\(4,\\), the layout says"):
        write_safetensors_streamed(path, {"b": (torch.float32, (5,))}, lambda name: torch.zeros(4))
