"""The host-memory budget (`max_host_memory`) and the disk ring: the plan's choices and refusals at the released sizes,
the block files read into staging buffers (`TensorReader`, `BlockFiles`), and on the CPU a session and a pipeline whose
blocks stream from their compiled files, bit for bit the resident result."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
from concurrent import futures

import pytest
import torch
from bundles import keyframe_bundle
from conftest import TINY, assert_bitwise, compile_tiny
from memory_sizes import FULL, LARGEST, PROFILE, REQUEST, placement_choice

from vflash_core import NativeEngineSession
from vflash_core import memory_plan as MP
from vflash_core.engine import residency as R
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.engine.denoise import denoise_bytes
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.layout import largest_request_rows
from vflash_core.engine.weight_io import TensorReader
from vflash_core.errors import RunFailedError, VflashError, WeightFileError
from vflash_core.fileio import GIB
from vflash_core.pipeline.h3_pipeline import H3Pipeline, PreparedAssets
from vflash_core.pipeline.options import RunOptions
from vflash_core.profiles import get_profile
from vflash_core.tensor_store import TensorStore
from vflash_core.weights import synthetic

CUDA = [torch.device("cuda:0")]
CORE = MP.PartSizes(core_blocks=FULL.core_blocks, core_block=FULL.core_block, core_auxiliary=FULL.core_auxiliary)
# The released sizes with the text encoder's layers in files as loaded (what `TextConditioner.from_pretrained` reads).
ON_DISK = dataclasses.replace(FULL, encoder_layers_on_disk=FULL.encoder_layers)
# The tiny model with more blocks than a disk ring stages.
FIVE = dataclasses.replace(TINY, num_layers=5)


@pytest.fixture(scope="module")
def five_compiled(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("five-blocks")
    weights = synthetic.random_internal_weights(FIVE, seed=5, dtype=torch.bfloat16)
    transformer = synthetic.write_diffusers_transformer(folder / "transformer", FIVE, weights, max_shard_bytes=40_000)
    return compile_tiny(folder, transformer, PROFILE)


def _plan(sizes: MP.PartSizes, device_gib: float, host_gib: float | None, devices=CUDA, **choices) -> MP.MemoryPlan:
    host = None if host_gib is None else int(host_gib * GIB)
    return MP.plan_memory(sizes, LARGEST, devices, budget=int(device_gib * GIB), host_budget=host, **choices)


# -- the plan at the released sizes (no device needed) ---------------------------------------------------------------


@pytest.mark.parametrize(("sizes", "device_gib", "host_gib", "expected"), [
    # a 24 GiB card beside 64 GiB: the encoder's arena (48 GiB) fits, the blocks' (36 GiB) no longer beside it
    (FULL, 24, 64, ("disk-ring", "stream", "offload", "native", True)),
    (FULL, 24, 96, ("block-ring", "stream", "offload", "native", True)),
    (FULL, 24, None, ("block-ring", "stream", "offload", "native", True)),  # not planned: never a disk ring
    (FULL, 12, None, ("block-ring", "stream", "offload", "native", False)),
    (CORE, 24, 32, ("disk-ring", None, None, None, True)),  # the core alone beside 32 GiB
    (CORE, 24, 48, ("block-ring", None, None, None, True)),
    (CORE, 139, 8, ("resident", None, None, None, True)),  # resident blocks hold no host memory
    # the encoder's layers readable from their files: they stream from disk only once the core does
    (ON_DISK, 24, 64, ("disk-ring", "stream", "offload", "native", True)),
    (ON_DISK, 24, 32, ("disk-ring", "disk-stream", "offload", "native", True)),
    (ON_DISK, 24, 20, ("disk-ring", "disk-stream", "offload", "native", True)),
    (ON_DISK, 24, None, ("block-ring", "stream", "offload", "native", True)),
])
def test_plan_under_a_host_budget(sizes, device_gib, host_gib, expected):
    plan = _plan(sizes, device_gib, host_gib)
    assert placement_choice(plan) == expected
    if host_gib is not None:
        assert plan.host_bytes() + MP.HOST_MARGIN_BYTES <= host_gib * GIB


def test_host_bytes_of_each_placement():
    s = FULL
    disk = _plan(FULL, 24, 64)
    assert disk.host_parts() == {"core (disk-ring)": MP.DISK_RING_BLOCKS * s.core_block, "text encoder (stream)": s.encoder,
                                 "VAEs (offload)": s.vaes}
    assert _plan(FULL, 139, None).host_parts() == {"text encoder (offload)": s.encoder, "VAEs (offload)": s.vaes}
    assert _plan(FULL, 139, None, encoder_residency="resident").host_parts() == {}
    assert disk.summary().endswith("; host memory 55.9 GiB of weights + 4.0 GiB margin, budget 64.0 GiB")


def test_the_encoder_from_disk_holds_its_staging_buffers_only():
    s = ON_DISK
    plan = _plan(ON_DISK, 24, 32)
    assert plan.host_parts()["text encoder (disk-stream)"] == s.encoder - s.encoder_layers + MP.DISK_RING_BLOCKS * s.encoder_layer
    assert plan.brought_bytes("encode") == _plan(FULL, 24, None).brought_bytes("encode")  # as streamed from the arena
    assert plan.host_bytes() + MP.HOST_MARGIN_BYTES < 20 * GIB


def test_a_host_budget_too_small_for_every_placement_is_refused_with_the_numbers():
    with pytest.raises(RunFailedError) as refused:
        _plan(FULL, 24, 32)
    assert str(refused.value) == (
        "the host memory budget does not fit: the most frugal placement holds core (disk-ring) 2.2 GiB, text encoder "
        "(stream) 48.0 GiB, VAEs (offload) 5.7 GiB in host memory, plus a 4.0 GiB margin for the process: 59.9 GiB; "
        "max_host_memory is 32.0 GiB. Raise max_host_memory. The text encoder is held in host memory whole: its decoder "
        "layers cannot stream from their files (a text_encoder_loader's model, or files in another dtype than loaded)."
    )
    with pytest.raises(RunFailedError, match=r"core \(block-ring\) 35.9 GiB .* Leave weight_residency='block-ring' to the plan, or raise"):
        _plan(CORE, 24, 32, weight_residency="block-ring")
    with pytest.raises(VflashError, match="'disk-ring' streams the blocks to one GPU"):
        _plan(CORE, 24, 32, devices=CUDA * 2, weight_residency="disk-ring")
    # two GPUs under a host budget: the disk ring is no candidate, so the arena must fit
    with pytest.raises(RunFailedError, match=r"core \(block-ring\) 35.9 GiB"):
        _plan(CORE, 24, 32, devices=CUDA * 2)


def test_max_host_memory_option():
    assert RunOptions(device=0, max_host_memory=32).max_host_memory == 32
    for bad in ("32", float("nan"), -1, 0, True):
        with pytest.raises(VflashError, match="max_host_memory"):
            RunOptions(device=0, max_host_memory=bad)
    with pytest.raises(VflashError, match="on the CPU give max_device_memory too"):
        RunOptions(max_host_memory=32)
    with pytest.raises(VflashError, match="'disk-ring' streams the blocks to one GPU"):
        RunOptions(device=0, peer_device=1, strategy="sequence-head", weight_residency="disk-ring")
    parser = argparse.ArgumentParser()
    RunOptions.add_arguments(parser)
    args = parser.parse_args(["--gpu", "0", "--max-host-memory", "48", "--weight-residency", "disk-ring"])
    options = RunOptions.from_arguments(args)
    assert (options.max_host_memory, options.weight_residency) == (48.0, "disk-ring")
    with pytest.raises(VflashError, match="--max-host-memory must be a number of GiB above 0"):
        parser.parse_args(["--max-host-memory", "lots"])


# -- reading block files into staging buffers ------------------------------------------------------------------------


def test_tensor_reader_reads_exact_bytes_again_and_refuses_a_changed_file(tiny_compiled, tmp_path):
    source = CompiledArtifact(**tiny_compiled).block_file(0)
    path = tmp_path / "block.safetensors"
    path.write_bytes(source.read_bytes())
    store = TensorStore(path)
    names = [n for n in store.names if not n.startswith("lora.")]
    expected = store.read(names)
    reader = TensorReader(path, names, read_workers=4, chunk_bytes=1000, drop_cache=True)  # several chunks per tensor
    for _ in range(2):
        targets = {n: torch.full((expected[n].nbytes,), 7, dtype=torch.uint8) for n in names}
        assert reader.read_into(targets) == reader.nbytes == sum(t.nbytes for t in expected.values())
        for n in names:
            assert_bitwise(targets[n].view(expected[n].dtype).view(expected[n].shape), expected[n], n)
    with pytest.raises(VflashError, match=f"{names[0]} has {expected[names[0]].nbytes} bytes; its buffer holds 1"):
        reader.read_into({**targets, names[0]: torch.empty(1, dtype=torch.uint8)})
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(WeightFileError, match="changed on disk since it was indexed"):
        reader.read_into(targets)


def test_block_files_hold_a_few_blocks_and_read_ahead_in_pass_order(five_compiled, tiny_compiled):
    artifact = CompiledArtifact(**five_compiled)
    files = R.BlockFiles(artifact, pin=False)
    assert artifact.config.num_layers == 5
    assert files.nbytes == MP.DISK_RING_BLOCKS * files.item_bytes and len(files.staging) == MP.DISK_RING_BLOCKS
    order = [*range(5), *range(5), 3, 4, 0]  # two whole passes, then a pass that starts elsewhere (a stopped request)
    for index in order:
        span = files.host_span(index)
        block = artifact.read_block(index)
        for name, tensor in files.views(span).items():
            assert_bitwise(tensor, block.tensors[name], f"block {index} {name}")
        files.copied(index, None)
        assert len(files._reads) == MP.DISK_RING_BLOCKS  # always this many read or being read ahead, never more
    assert [block for block, _, _ in files._reads] == [1, 2, 3]
    files.close()
    assert files.staging == []
    # fewer blocks than staging buffers: one buffer per block
    two = R.BlockFiles(CompiledArtifact(**tiny_compiled), pin=False)
    assert len(two.staging) == 2 and two.nbytes == 2 * two.item_bytes
    two.close()


# -- a session and a pipeline whose blocks stream from their files (the CPU) -----------------------------------------


def test_disk_ring_equals_resident_and_reuses_its_buffers(five_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled)) as resident:
        expected = resident.generate(keyframe_bundle(6))
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(weight_residency="disk-ring")) as session:
        ring = session._denoisers[0].blocks
        files = ring.source
        assert isinstance(files, R.BlockFiles)
        pointers = [t.data_ptr() for t in ring.slots + files.staging]
        # counted with the read-ahead settled: a read in flight holds its own objects for the moment
        futures.wait([read for _, _, read in files._reads])
        gc.collect()
        live_before = len(gc.get_objects())
        for _ in range(10):
            got = session.generate(keyframe_bundle(6))
        futures.wait([read for _, _, read in files._reads])
        gc.collect()
        assert len(gc.get_objects()) - live_before < 200, "objects accumulate across requests"
        assert [t.data_ptr() for t in ring.slots + files.staging] == pointers
        memory = got.metadata["memory"]
        assert got.metadata["weight_residency"] == "disk-ring" and memory["blocks_on_device"] == 2
        assert memory["pinned_host_bytes"] == files.nbytes
        # every pass reads every block file (4 evaluations x 5 blocks per request; reads ahead at most 3 more)
        assert 10 * 4 * 5 <= memory["block_file_reads"] <= 10 * 4 * 5 + MP.DISK_RING_BLOCKS
        assert "weights disk-ring, read from the compiled block files on every pass" in session.memory_plan()
    assert_bitwise(got.video_latents, expected.video_latents, "disk-ring vs resident")
    assert_bitwise(got.audio_latents, expected.audio_latents, "disk-ring vs resident audio")
    assert ring.slots == [] and files.staging == []


def test_a_request_stopped_mid_pass_leaves_the_disk_ring_exact(five_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled)) as resident:
        expected = resident.generate(keyframe_bundle(6))
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(weight_residency="disk-ring")) as session:
        calls = []

        def stop_in_the_second_evaluation():
            calls.append(1)
            if len(calls) == 7:  # a block boundary inside the second evaluation
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            session.generate(keyframe_bundle(6), between_blocks=stop_in_the_second_evaluation)
        got = session.generate(keyframe_bundle(6))
    assert_bitwise(got.video_latents, expected.video_latents, "disk-ring after a stopped request")


def test_a_block_file_changed_during_the_session_is_refused(tiny_compiled, tmp_path):
    copies = {}
    for key, path in tiny_compiled.items():
        target = tmp_path / path.name
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, target)
        copies[key] = target
    with NativeEngineSession(PROFILE, CompiledPaths(**copies), EngineOptions(weight_residency="disk-ring")) as session:
        session.generate(keyframe_bundle(6))
        block = CompiledArtifact(**copies).block_file(1)
        stat = block.stat()
        os.utime(block, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
        with pytest.raises(WeightFileError, match=f"{block}: changed on disk (since it was indexed|while it was read)"):
            session.generate(keyframe_bundle(6))


def test_session_plans_the_disk_ring_under_a_host_budget(five_compiled, no_margin):
    sizes = CompiledArtifact(**five_compiled).part_sizes()
    cap = 1.0  # the device (the CPU here) holds everything
    staging = MP.DISK_RING_BLOCKS * sizes.core_block
    assert staging < sizes.core_blocks  # 3 of 5 blocks; the budget lies between the two
    host = (MP.HOST_MARGIN_BYTES + staging + (sizes.core_blocks - staging) // 2) / GIB
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(max_device_memory=cap, weight_residency="block-ring", max_host_memory=(MP.HOST_MARGIN_BYTES + sizes.core_blocks) / GIB)) as session:
        assert session.weight_residency == "block-ring"
    with pytest.raises(RunFailedError, match="the host memory budget does not fit"):
        NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(max_device_memory=cap, weight_residency="block-ring", max_host_memory=host))
    with pytest.raises(VflashError, match="on the CPU give max_device_memory too"):
        NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(max_host_memory=host))
    # auto: resident holds no host memory, so a ring is chosen only where the device asks for one; here the arena
    # does not fit the host budget, so the disk ring
    config = CompiledArtifact(**five_compiled).config
    largest = denoise_bytes(config, largest_request_rows(get_profile(PROFILE), config))
    ring = 2 * sizes.core_block + sizes.core_auxiliary + largest
    between = (ring + (sizes.core_blocks - 2 * sizes.core_block) // 2) / GIB  # room for the ring, not for every block
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(max_device_memory=between, max_host_memory=host)) as session:
        assert session.weight_residency == "disk-ring" and session.plan.host_budget == int(host * GIB)
    with NativeEngineSession(PROFILE, CompiledPaths(**five_compiled), EngineOptions(max_device_memory=between)) as session:
        assert session.weight_residency == "block-ring"  # no host budget: the arena


def test_encoder_layers_stream_from_their_files_bit_for_bit(h3_family):
    from encoder_inputs import encodings

    from vflash_core.media.conditioning import TextConditioner

    # The files hold bf16; read in fp32 (the CPU default) the layers cannot stream from them as loaded.
    assert TextConditioner.from_pretrained(h3_family, "cpu").decoder_layer_files() is None
    resident = encodings(TextConditioner.from_pretrained(h3_family, "cpu", dtype=torch.bfloat16))
    conditioner = TextConditioner.from_pretrained(h3_family, "cpu", dtype=torch.bfloat16)
    sizes = conditioner.part_sizes()
    assert sizes.encoder_layers_on_disk == sizes.encoder_layers > 0
    layers = list(conditioner.decoder_layers())
    conditioner.stream_layers(from_files=True)
    files = conditioner.layer_ring.source
    assert isinstance(files, R.StagedFiles) and len(files.staging) == min(MP.DISK_RING_BLOCKS, len(layers))
    assert all(p.is_meta for layer in layers for p in layer.parameters())  # no weights held between encodes
    for _ in range(2):
        for got, expected in zip(encodings(conditioner), resident):
            assert_bitwise(got, expected, "encoder layers from their files vs resident")
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    assert len(files.read_seconds) >= 4 * len(layers)  # every layer read again for each of the 4 encodes
    conditioner.close()
    assert files.staging == []
    loaded = TextConditioner.from_pretrained(h3_family, "cpu", dtype=torch.bfloat16, text_encoder_loader=_loader_of(h3_family))
    assert loaded.decoder_layer_files() is None and loaded.part_sizes().encoder_layers_on_disk == 0
    with pytest.raises(VflashError, match="cannot stream from their files: the weights came from a text_encoder_loader"):
        loaded.stream_layers(from_files=True)


def _loader_of(root):
    def load(model_root):
        from transformers import Qwen3VLModel

        return Qwen3VLModel.from_pretrained(model_root / "text_encoder", dtype=torch.bfloat16, local_files_only=True)

    return load


@pytest.fixture
def no_margin(monkeypatch):
    monkeypatch.setattr(MP, "MARGIN_BYTES", 0)


def test_pipeline_under_a_host_budget_streams_its_blocks_from_disk(h3_prepared, no_margin):
    with H3Pipeline.from_prepared(h3_prepared) as pipe:
        expected = pipe.generate(REQUEST, None)
    with H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=1.0, weight_residency="disk-ring",
                                                          max_host_memory=8.0)) as pipe:
        result = pipe.generate(REQUEST, None)
        assert pipe.session.plan.host_budget == 8 * GIB
    assert result.metadata["memory_plan"]["core"] == "disk-ring"
    assert_bitwise(result.media.frames, expected.media.frames, "frames, blocks from disk")
    assert_bitwise(result.media.waveform, expected.media.waveform, "waveform, blocks from disk")


@pytest.fixture
def loads_nothing(monkeypatch):
    """A function of a prepared receipt: the `PartSizes` of its core, text encoder and VAEs as loaded on the CPU (what
    the plan's numbers are), after which the text encoder and the VAEs refuse to load."""
    from vflash_core.media.conditioning import TextConditioner
    from vflash_core.media.vae import MediaVAEs

    def never(*args, **kwargs):
        raise AssertionError("a model loaded for a memory budget no placement fits")

    def sizes(receipt):
        assets = PreparedAssets.load(receipt)
        conditioner, vaes = TextConditioner.from_pretrained(assets.model_root), MediaVAEs.from_pretrained(assets.decoder_root)
        answer = CompiledArtifact.at(assets.compiled_paths()).part_sizes(), conditioner.part_sizes(), vaes.part_sizes()
        conditioner.close()
        vaes.close()
        monkeypatch.setattr(TextConditioner, "from_pretrained", never)
        monkeypatch.setattr(MediaVAEs, "from_pretrained", never)
        return answer

    return sizes


@pytest.mark.parametrize("fits", ["nothing", "the core and the text encoder"])
def test_a_host_budget_no_placement_fits_is_refused_before_the_encoder_and_vaes_load(h3_prepared, loads_nothing, fits):
    """Refused with the plan of every part, its numbers those of the loaded parts, before any of them loads (before,
    a budget that only the encoder and the VAEs pushed over was refused once they had loaded)."""
    core, encoder, vaes = loads_nothing(h3_prepared)
    staging = min(MP.DISK_RING_BLOCKS, 2) * core.core_block  # the tiny model's two blocks: the frugal disk ring
    held = staging + encoder.encoder + vaes.vaes
    host = 1.0 if fits == "nothing" else (MP.HOST_MARGIN_BYTES + staging + encoder.encoder) / GIB
    pipe = H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=1.0, weight_residency="disk-ring",
                                                            max_host_memory=host))
    with pytest.raises(RunFailedError, match=(
        rf"^the host memory budget does not fit: the most frugal placement holds core \(disk-ring\) "
        rf"{MP.size_text(staging)}, text encoder \(offload\) {MP.size_text(encoder.encoder)}, VAEs \(offload\) "
        rf"{MP.size_text(vaes.vaes)} in host memory, plus a 4.0 GiB margin for the process: "
        rf"{MP.size_text(held + MP.HOST_MARGIN_BYTES)}; max_host_memory is {MP.size_text(int(host * GIB))}"
    )):
        pipe.load()
    assert not pipe.loaded


def test_a_device_cap_the_encoder_and_vaes_push_over_is_refused_before_they_load(h3_prepared, loads_nothing):
    """On the CPU a cap is planned: one the core's block ring fits but not beside the streamed encoder or the VAEs."""
    core, encoder, vaes = loads_nothing(h3_prepared)
    ring = core.core_on_device("block-ring")
    peaks = {"encode": ring + encoder.encoder_brought("stream"), "decode": ring + vaes.vaes}
    stage = max(peaks, key=peaks.get)
    cap = (MP.MARGIN_BYTES + ring + min(encoder.encoder_brought("stream"), vaes.vaes) // 2) / GIB
    pipe = H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=cap))
    with pytest.raises(RunFailedError, match=(
        rf"^the weights do not fit on cpu: with the most frugal placement \(core block-ring, text encoder stream, "
        rf"VAEs offload\) the {stage} stage holds {MP.size_text(peaks[stage])} of weights, plus a 2.0 GiB margin; "
        rf"{MP.size_text(int(cap * GIB))} are available"
    )):
        pipe.load()
    assert not pipe.loaded


# -- on the GPU: the copy stream, the staging buffers' events (`pytest -m gpu`) ---------------------------------------

GPU_PROFILE = "t2va-base16-bf16-sm90"


@pytest.fixture(scope="module")
def five_gpu_compiled(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("needs an SM90 GPU for the sm90 profile")
    folder = tmp_path_factory.mktemp("five-blocks-gpu")
    weights = synthetic.random_internal_weights(FIVE, seed=5, dtype=torch.bfloat16)
    transformer = synthetic.write_diffusers_transformer(folder / "transformer", FIVE, weights, max_shard_bytes=40_000)
    return compile_tiny(folder, transformer, GPU_PROFILE, device="cuda:0")


@pytest.mark.gpu
def test_disk_ring_equals_resident_on_gpu(five_gpu_compiled):
    def pinned() -> int:
        stats = torch.cuda.host_memory_stats()
        return int(next(v for k, v in stats.items() if k in ("allocated_bytes.current", "allocated_bytes.all.current")))

    with NativeEngineSession(GPU_PROFILE, CompiledPaths(**five_gpu_compiled), EngineOptions(device="cuda:0", weight_residency="resident")) as resident:
        expected = resident.generate(keyframe_bundle(2))
    before = pinned()
    with NativeEngineSession(GPU_PROFILE, CompiledPaths(**five_gpu_compiled), EngineOptions(device="cuda:0", weight_residency="disk-ring")) as session:
        first = session.generate(keyframe_bundle(2), profile_denoise=True)

        class Interrupt(BaseException):
            pass

        def stop(done, total):
            raise Interrupt()

        with pytest.raises(Interrupt):
            session.generate(keyframe_bundle(2), progress=stop)
        results = [session.generate(keyframe_bundle(2)) for _ in range(3)]
        staging = first.metadata["memory"]["pinned_host_bytes"]
        assert staging == MP.DISK_RING_BLOCKS * session._host_blocks[0].item_bytes
        assert pinned() - before >= staging, "the staging buffers are not page-locked"
        assert first.denoise_profile["h2d_copy_ms"] > 0
    gc.collect()
    assert pinned() <= before + staging // 2, "the staging buffers outlive the closed session"
    for result in (first, *results):
        assert result.metadata["weight_residency"] == "disk-ring"
        assert_bitwise(result.video_latents, expected.video_latents, "disk ring vs resident on the GPU")
        assert_bitwise(result.audio_latents, expected.audio_latents, "disk ring vs resident audio on the GPU")
