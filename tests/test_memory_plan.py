"""The memory plan: its choices and refusals at full size (sizes in GiB, no device needed), its estimates, the cap
option, and the plan at work on the CPU under a cap (the session, the pipeline: streamed encoder, windowed decode,
refusals before anything runs)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from bundles import keyframe_bundle
from conftest import assert_bitwise
from memory_sizes import FULL, LARGEST, PROFILE, REQUEST, placement_choice

from vflash_core import NativeEngineSession
from vflash_core import memory_plan as MP
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.engine.config import H3Config
from vflash_core.engine.denoise import denoise_bytes
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.layout import Geometry, largest_clip_frames, largest_request_rows, request_rows
from vflash_core.errors import RequestError, RunFailedError, VflashError
from vflash_core.fileio import GIB
from vflash_core.media.conditioning import encode_bytes
from vflash_core.media.vae import decode_bytes
from vflash_core.pipeline.h3_pipeline import H3Pipeline
from vflash_core.pipeline.options import RunOptions
from vflash_core.profiles import get_profile

CUDA = [torch.device("cuda:0")]


def _plan(budget_gib: float, **choices) -> MP.MemoryPlan:
    return MP.plan_memory(FULL, LARGEST, CUDA, budget=int(budget_gib * GIB), **choices)


@pytest.mark.parametrize("budget, expected", [
    (139, ("resident", "offload", "offload", "native", True)),  # an H200: everything as fast as it goes
    (80, ("resident", "stream", "offload", "native", True)),  # the encoder streams before the core does
    (48, ("block-ring", "stream", "offload", "native", True)),
    (16, ("block-ring", "stream", "offload", "native", True)),
    (12, ("block-ring", "stream", "offload", "native", False)),  # the most frugal; requests are checked one by one
])
def test_plan_prefers_speed_then_frugality(budget, expected):
    assert placement_choice(_plan(budget)) == expected


def test_the_native_decode_comes_first_and_diffusers_where_only_its_decode_fits():
    # A short clip at many tile-windows per call: the native decode's estimate above diffusers'.
    largest = dict(LARGEST, **{"decode.native": int(7.0 * GIB)})
    native = MP.plan_memory(FULL, largest, CUDA, budget=int(139 * GIB))
    assert native.placement.video_decoder == "native" and native.fits_largest
    # 2.9 GiB ring + 5.7 GiB VAEs + 2 GiB margin: 6.3 GiB of transient fits in 17.5 GiB, 7.0 GiB does not
    only_diffusers = MP.plan_memory(FULL, largest, CUDA, budget=int(17.5 * GIB))
    assert only_diffusers.placement.video_decoder == "diffusers" and only_diffusers.fits_largest


def test_plan_logs_one_line_with_sizes_and_choices(caplog):
    with caplog.at_level("INFO", logger="vflash_core.memory_plan"):
        plan = _plan(48, cap=48 * GIB)
    assert [r.getMessage() for r in caplog.records] == [plan.summary()]
    assert plan.summary() == (
        "memory plan on cuda:0: core 35.9 GiB blocks + 1.5 GiB auxiliary -> block-ring; text encoder 48.0 GiB (45.4 GiB in decoder "
        "layers) -> stream; VAEs 5.7 GiB -> offload, video decode native; the largest planned request peaks at encode 7.8 GiB, "
        "denoise 8.4 GiB, decode 11.9 GiB + 2.0 GiB margin, 48.0 GiB available (cap 48.0 GiB): fits; host memory 89.6 GiB of weights"
    )
    # the peaks: resident core weights (2 slots + auxiliary), plus what each stage brings and its transient
    ring = 2 * FULL.core_block + FULL.core_auxiliary
    assert plan.peaks(LARGEST) == {
        "encode": ring + FULL.encoder - FULL.encoder_layers + 2 * FULL.encoder_layer + LARGEST["encode"],
        "denoise": ring + LARGEST["denoise"], "decode": ring + FULL.vaes + LARGEST["decode.native"],
    }


def test_explicit_choices_are_kept_and_refused_with_the_numbers():
    assert placement_choice(_plan(139, weight_residency="block-ring"))[0] == "block-ring"
    assert placement_choice(_plan(139, encoder_residency="resident")) == ("resident", "resident", "resident", "native", True)
    assert placement_choice(_plan(80, encoder_residency="resident")) == ("block-ring", "resident", "resident", "native", True)
    with pytest.raises(RunFailedError) as info:
        _plan(40, weight_residency="resident")
    assert str(info.value) == (
        "the weights do not fit on cuda:0: with the most frugal placement (core resident, text encoder stream, VAEs offload) the decode "
        "stage holds 43.1 GiB of weights, plus a 2.0 GiB margin; 40.0 GiB are available. Leave weight_residency='resident' to the plan, "
        "or use a larger GPU."
    )
    with pytest.raises(RunFailedError, match=r"\(core block-ring, text encoder resident, VAEs resident\) the .* stage holds 56\.6 GiB .* "
                                             r"Leave encoder_residency='resident' to the plan"):
        _plan(50, encoder_residency="resident")


def test_refused_when_not_even_the_weights_fit():
    with pytest.raises(RunFailedError) as info:
        MP.plan_memory(FULL, LARGEST, CUDA, cap=8 * GIB, budget=8 * GIB)
    assert str(info.value) == (
        "the weights do not fit on cuda:0: with the most frugal placement (core block-ring, text encoder stream, VAEs offload) the decode "
        "stage holds 8.7 GiB of weights, plus a 2.0 GiB margin; 8.0 GiB are available (cap 8.0 GiB). This GPU is too small for H3."
    )


def test_a_request_is_checked_against_what_is_available_now():
    # On the CPU (a cap) what is available is the cap less the resident parts: here the block ring's 2.9 GiB.
    plan = MP.plan_memory(FULL, LARGEST, [torch.device("cpu")], cap=20 * GIB)
    assert plan.available() == 20 * GIB - 2 * FULL.core_block - FULL.core_auxiliary
    plan.check({"denoise": 15 * GIB, "decode": 9 * GIB, "encode": 1 * GIB}, "a request")
    with pytest.raises(RequestError) as info:
        plan.check({"denoise": 15 * GIB, "decode": 12 * GIB}, "a 1344x768 clip of 345 frames", "Use a shorter clip.")
    assert str(info.value) == (
        "a 1344x768 clip of 345 frames: the decode stage needs about 17.7 GiB on cpu (12.0 GiB transient + 5.7 GiB of weights it brings) "
        "plus a 2.0 GiB margin; 17.1 GiB are available (cap 20.0 GiB). Use a shorter clip."
    )


def test_memory_estimates_of_each_part_at_the_released_sizes():
    from diffusers import AutoencoderKLMiniMaxH3
    from transformers import Qwen3VLTextConfig, Qwen3VLVisionConfig

    config = H3Config.preset("h3")
    # the block body's live set at 1344x768 (38,222 rows at 5 s): about 5 GiB, in proportion to the rows
    assert denoise_bytes(config, 38_222) / GIB == pytest.approx(5.41, abs=0.01)
    assert denoise_bytes(config, 2 * 38_222) == pytest.approx(2 * denoise_bytes(config, 38_222), rel=1e-6)
    assert [largest_clip_frames(get_profile(p)) for p in ("t2va-turbo4-exact-sm90", "i2va-base16-bf16-sm90", "t2va-base16-bf16-sm90")] == [124, 243, 345]
    assert largest_request_rows(get_profile("t2va-turbo4-exact-sm90"), config) == 38_222

    with torch.device("meta"):
        vae = AutoencoderKLMiniMaxH3()  # the released configuration, no memory
    native = [decode_bytes(vae, frames, 768, 1344, "native", 8) for frames in (124, 243, 345)]
    diffusers = [decode_bytes(vae, frames, 768, 1344, "diffusers", 8) for frames in (124, 243, 345)]
    assert native[0] == native[1] == native[2] < diffusers[0] < diffusers[1] < diffusers[2]  # one window vs the whole clip
    assert diffusers[2] / GIB == pytest.approx(14.6, abs=0.1)

    text = Qwen3VLTextConfig(hidden_size=5120, intermediate_size=25600, num_hidden_layers=50, num_attention_heads=64, num_key_value_heads=8, head_dim=128)
    vision = Qwen3VLVisionConfig(hidden_size=1152, intermediate_size=4304, out_hidden_size=5120)
    # every layer's hidden state is kept: about 0.9 MB per token at full size
    assert encode_bytes(text, vision, 1000, 0, 2) == pytest.approx(1000 * 2 * 1.25 * (51 * 5120 + 2 * 5120 + 4 * 25600))
    assert encode_bytes(text, vision, 512, 4032, 2) > encode_bytes(text, vision, 512, 0, 2)


def test_max_device_memory_option():
    assert RunOptions(max_device_memory=20).max_device_memory == 20
    for bad in (0, -1.0, math.nan, math.inf, True, "20"):
        with pytest.raises(VflashError, match=r"max_device_memory must be a number of GiB above 0 and at most 1,048,576, got "):
            RunOptions(max_device_memory=bad)
    parser = argparse.ArgumentParser()
    RunOptions.add_arguments(parser)
    assert RunOptions.from_arguments(parser.parse_args(["--max-device-memory", "20.5"])).max_device_memory == 20.5
    assert RunOptions.from_arguments(parser.parse_args([])).max_device_memory is None


# -- the plan at work on the CPU, under a cap (the margin set to 0 at this size) ----------------------------------


@pytest.fixture
def no_margin(monkeypatch):
    monkeypatch.setattr(MP, "MARGIN_BYTES", 0)


def test_session_under_a_cap(tiny_compiled, no_margin):
    sizes = CompiledArtifact(**tiny_compiled).part_sizes()
    ring_weights = 2 * sizes.core_block + sizes.core_auxiliary
    cap = (ring_weights + 64 * 1024) / GIB  # room for the ring and a small request's activations only
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(max_device_memory=cap)) as session:
        assert session.weight_residency == "block-ring" and session.plan is not None and not session.plan.fits_largest
        with pytest.raises(RequestError, match=r"this request's activations \(\d+ packed rows, weights block-ring\): the denoise stage needs about"):
            session.generate(keyframe_bundle(6))
    with pytest.raises(RunFailedError, match="the weights do not fit on cpu"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(max_device_memory=ring_weights / 2 / GIB))
    with pytest.raises(VflashError, match="disagrees with the memory plan"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(weight_residency="resident"), plan=session.plan)


@pytest.fixture(scope="module")
def uncapped(h3_prepared):
    """The request through the pipeline without a plan (the CPU, no cap), and its encode."""
    with H3Pipeline.from_prepared(h3_prepared) as pipe:
        return pipe.generate(REQUEST, None), pipe.encode(REQUEST).consume()


def test_pipeline_under_a_cap_equals_the_uncapped_pipeline(h3_prepared, uncapped, no_margin):
    # 1 GiB: the diffusers decode of the profile's longest clip does not fit, the windowed one does
    with H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=1.0)) as pipe:
        result = pipe.generate(REQUEST, None)
    assert result.metadata["memory_plan"] == {"core": "resident", "encoder": "offload", "vaes": "offload", "video_decoder": "native"}
    assert_bitwise(result.media.frames, uncapped[0].media.frames, "frames under a 1 GiB cap")
    assert_bitwise(result.media.waveform, uncapped[0].media.waveform, "waveform under a 1 GiB cap")


def test_pipeline_streams_the_encoder_and_refuses_before_anything_runs(h3_prepared, uncapped, no_margin):
    with H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=1.0)) as pipe:
        pipe.load()
        sizes, config = pipe.session.plan.sizes, pipe.config
        encode = pipe.conditioner.encode_bytes(64, 0)
        decode = decode_bytes(pipe.vaes.video_vae, 124, 64, 96, "native", 8)
    denoise = denoise_bytes(config, request_rows(config, Geometry(64, 96, 124), 64))
    ring = 2 * sizes.core_block + sizes.core_auxiliary
    streamed = sizes.encoder - sizes.encoder_layers + 2 * sizes.encoder_layer
    # Room beside the block ring for this request's encode (its layers streamed) and denoise, not for its decode.
    room = 2 * denoise
    assert streamed + encode < room < sizes.vaes + decode
    with H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=(ring + room) / GIB)) as pipe:
        pipe.load()
        placement = pipe.session.plan.placement
        assert (placement.core, placement.encoder, placement.video_decoder) == ("block-ring", "stream", "native")
        assert pipe.conditioner.layer_ring is not None
        bundle = pipe.encode(REQUEST).consume()
        assert_bitwise(bundle.prompt_embeds, uncapped[1].prompt_embeds, "streamed encoder's prompt embeddings")
        calls = []
        pipe.conditioner.encode = lambda *args, **kwargs: calls.append(args)
        with pytest.raises(RequestError, match=r"a 96x64 clip of 124 frames: the decode stage needs about [\d.]+ MiB on cpu .* are available \(cap "):
            pipe.generate(REQUEST, None)
        assert calls == []  # refused before the encode
    with pytest.raises(RunFailedError, match="the weights do not fit on cpu"):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(max_device_memory=ring / 2 / GIB)).load()


@pytest.mark.gpu
def test_device_cap_is_enforced_and_released():
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0)
    cap = MP.DeviceCap(1 * GIB, CUDA)
    assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(GIB / total)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * GIB, dtype=torch.uint8, device="cuda:0")
    cap.release()
    assert torch.cuda.get_per_process_memory_fraction(0) == before


def test_the_device_budget_keeps_within_the_allocator_limit_a_host_set(monkeypatch):
    """A host that limits PyTorch's allocator for its process (`set_per_process_memory_fraction`) is obeyed: the driver
    may report far more free memory than the process may still allocate (ComfyUI run under a device limit: a plan
    from the driver's numbers alone placed 36 GiB of weights in a 24 GiB limit and failed mid-load)."""
    total, allocated, reserved, free = 80 * GIB, 4 * GIB, 6 * GIB, 54 * GIB
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Properties", (), {"total_memory": total}))
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction["value"])
    assert MP.device_budget(CUDA, None) == free + reserved - allocated  # no limit: the driver's free + own cache
    assert MP.device_budget(CUDA, 20 * GIB) == 16 * GIB  # a cap counts what is already allocated
    fraction["value"] = 0.3  # 24 GiB of 80
    assert MP.device_budget(CUDA, None) == int(0.3 * total) - allocated
    assert MP.device_budget(CUDA, 10 * GIB) == 6 * GIB  # the tighter of the cap and the limit


@pytest.mark.gpu
def test_the_device_budget_follows_the_allocator_fraction():
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0)
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        assert MP.device_budget(CUDA, None) <= int(0.25 * total) - torch.cuda.memory_allocated(0)
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)
