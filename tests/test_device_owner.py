"""`SerialDeviceOwner`: a part handed back to the CPU points at its original host tensors (nothing copied back)."""

from __future__ import annotations

import torch

from vflash_core.engine.device_owner import SerialDeviceOwner


class _Part(SerialDeviceOwner):
    def __init__(self, device: str):
        self.device = torch.device(device)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        self.module[0].weight.data = self.module[0].weight.data.to(torch.bfloat16)

    def device_modules(self) -> list[torch.nn.Module]:
        return [self.module]


def _state(module: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return {name: (t.data_ptr(), t.clone()) for name, t in module.state_dict(keep_vars=True).items()}


def test_offload_restores_the_host_tensors_without_copying():
    # The meta device stands in for a GPU: moving there drops the values, so only a restore can bring them back.
    part = _Part("meta")
    before = _state(part.module)
    with part.on_device():
        assert all(t.device.type == "meta" for t in part.module.state_dict().values())
    after = _state(part.module)
    assert after.keys() == before.keys()
    for name, (pointer, value) in before.items():
        assert after[name][0] == pointer, name  # the same storage, not a copy
        assert torch.equal(after[name][1], value) and after[name][1].dtype == value.dtype, name
    with part.on_device():  # and again: the host tensors were handed back, not lost
        pass
    assert all(torch.equal(_state(part.module)[n][1], v) for n, (_, v) in before.items())


def test_resident_part_keeps_no_host_copy():
    part = _Part("meta")
    part.keep_on_device = True
    with part.on_device():
        pass
    assert not part._host and all(t.device.type == "meta" for t in part.module.state_dict().values())


def test_materialize_replaces_file_mapped_weights_with_owned_copies(tmp_path):
    """Loaders may leave weights memory-mapped; after `materialize` every tensor owns its memory, values unchanged."""
    import mmap

    part = _Part("cpu")
    weight = part.module[0].weight.data
    path = tmp_path / "weight.bin"
    path.write_bytes(weight.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    part.module[0].weight.data = torch.frombuffer(mapped, dtype=weight.dtype).view(weight.shape)
    mapped_pointer = part.module[0].weight.data_ptr()
    before = _state(part.module)
    part.materialize()
    assert part.module[0].weight.data_ptr() != mapped_pointer
    assert all(torch.equal(_state(part.module)[n][1], v) for n, (_, v) in before.items())


def test_materialize_moves_a_resident_part_to_its_device():
    part = _Part("meta")
    part.keep_on_device = True
    part.materialize()
    assert all(t.device.type == "meta" for t in part.module.state_dict().values())


def _file_mapped_ranges() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def test_prepared_pipeline_holds_no_weights_mapped_from_their_files(h3_prepared):
    """transformers leaves the text encoder memory-mapped; the pipeline reads it at load instead of in the first request."""
    from vflash_core.pipeline.h3_pipeline import H3Pipeline

    with H3Pipeline.from_prepared(h3_prepared) as pipeline:
        pipeline.load()
        mapped = _file_mapped_ranges()
        modules = [pipeline.conditioner.text_encoder, pipeline.vaes.video_vae, pipeline.vaes.audio_vae]
        for module in modules:
            for name, tensor in module.state_dict().items():
                pointer = tensor.data_ptr()
                assert not any(start <= pointer < end for start, end in mapped), f"{name} still points into a mapped weight file"
