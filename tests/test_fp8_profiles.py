"""FP8 profiles and artifacts (approximate, default off): compile, identity, loading, the execution a session picks.

The tiny model is compiled for `t2va-base4-fp8-cpu` (weight-only FP8, the CPU stand-in of the SM90 w8a8 profiles) and
for `t2va-base4-exact-cpu` from the same files: the FP8 artifact's blocks are `fp8.quantize_block` of the BF16
artifact's, everything else (auxiliary tensors, schedule tables) is the same bytes' worth of values, the identities keep
the two kinds apart, and an FP8 trajectory equals the BF16 reference operations over the dequantized weights bit for
bit (resident, block ring and sequence-head alike), while staying close to the exact trajectory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from bundles import keyframe_bundle
from conftest import TINY, assert_bitwise, compile_tiny

from vflash_core.engine import fp8
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.model import BlockOps, LayerWeights, RowScaledWeight, sdpa_attention
from vflash_core.engine.profiler import NO_TIMER
from vflash_core.engine.residency import BlockArena, BlockRing, BlockSource, ResidentBlocks
from vflash_core.engine.session import NativeEngineSession
from vflash_core.errors import IdentityMismatchError, VflashError
from vflash_core.formats import ARTIFACT_FORMAT, ARTIFACT_FP8_FORMAT
from vflash_core.profiles import PROFILES, get_profile

FP8_CPU = "t2va-base4-fp8-cpu"
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_fp8_compiled(tmp_path_factory, tiny_transformer):
    return compile_tiny(tmp_path_factory.mktemp("compiled_fp8"), tiny_transformer, FP8_CPU)


def test_fp8_profiles_are_named_and_off_by_default():
    fp8_profiles = sorted(p for p, v in PROFILES.items() if v.fp8)
    assert {"t2va-turbo4-fp8-sm90", "i2va-base16-fp8-sm90", FP8_CPU} <= set(fp8_profiles)
    assert all("-fp8-" in p for p in fp8_profiles) and not any(v.fp8 for p, v in PROFILES.items() if "-fp8-" not in p)
    assert {PROFILES[p].fp8 for p in fp8_profiles if p.endswith("-sm90")} == {"w8a8"} and PROFILES[FP8_CPU].fp8 == "weight-only"
    # BF16 identities are unchanged (artifacts compiled before FP8 profiles existed still load)
    assert "fp8" not in get_profile("t2va-base4-exact-cpu").identity() and get_profile(FP8_CPU).identity()["fp8"] == "weight-only"
    turbo, exact = get_profile("t2va-turbo4-fp8-sm90"), get_profile("t2va-turbo4-exact-sm90")
    assert {k: v for k, v in turbo.identity().items() if k != "fp8"} == exact.identity()


def test_fp8_artifact_is_the_bf16_blocks_quantized(tiny_compiled, tiny_fp8_compiled):
    exact, quantized = CompiledArtifact(**tiny_compiled), CompiledArtifact(**tiny_fp8_compiled)
    assert exact.manifest["format"] == ARTIFACT_FORMAT and not exact.fp8
    assert quantized.manifest["format"] == ARTIFACT_FP8_FORMAT and quantized.fp8
    assert quantized.manifest["fp8"]["linears"] == list(fp8.FP8_LINEARS)
    for i in range(exact.config.num_layers):
        expected = fp8.quantize_block(exact.read_block(i).tensors)
        block = quantized.read_block(i)
        assert set(block.tensors) == set(expected)
        for name, tensor in expected.items():
            got = block.tensors[name]
            if tensor.dtype == torch.float8_e4m3fn:
                got, tensor = got.view(torch.uint8), tensor.view(torch.uint8)
            assert_bitwise(got, tensor, f"block {i} {name}")
        assert isinstance(block.weight("ffn.in"), RowScaledWeight) and isinstance(exact.read_block(i).weight("ffn.in"), torch.Tensor)
    aux, aux_fp8 = exact.read_auxiliary()[0], quantized.read_auxiliary()[0]
    for name in aux:
        assert_bitwise(aux_fp8[name], aux[name], name)
    step = quantized.overlay.read_step(1, 0)
    for got, expected in zip(step.blocks, exact.overlay.read_step(1, 0).blocks):
        assert_bitwise(got, expected, "AdaLN table")
    notes = quantized.base_weight_notes()
    assert any("approximate FP8 block linears" in n and "weight-only" in n for n in notes) and not exact.base_weight_notes()


def test_fp8_blocks_take_about_half_the_bytes(tiny_compiled, tiny_fp8_compiled):
    exact, quantized = CompiledArtifact(**tiny_compiled), CompiledArtifact(**tiny_fp8_compiled)
    linear_bytes = lambda w: sum(t.nbytes for n, t in w.tensors.items() if n.split(".weight")[0] in fp8.FP8_LINEARS)
    a, b = exact.read_block(0), quantized.read_block(0)
    config = exact.config
    # one byte per weight, plus a 4-byte scale per output row of each linear
    rows = 3 * config.inner_dim + config.hidden_size + 2 * config.ffn_dim + config.hidden_size
    assert linear_bytes(b) == linear_bytes(a) // 2 + 4 * rows
    assert sum(r["size"] for r in quantized.manifest["blocks"]) < sum(r["size"] for r in exact.manifest["blocks"])


def test_identities_keep_the_kinds_apart(tiny_compiled, tiny_fp8_compiled):
    with pytest.raises(IdentityMismatchError, match="fp8"):
        CompiledArtifact(**tiny_fp8_compiled).check_profile(get_profile("t2va-base4-exact-cpu"))
    with pytest.raises(IdentityMismatchError, match="fp8"):
        CompiledArtifact(**tiny_compiled).check_profile(get_profile(FP8_CPU))
    CompiledArtifact(**tiny_fp8_compiled).check_profile(get_profile(FP8_CPU))


class DequantizedBlocks(BlockSource):
    """An FP8 artifact's blocks with each linear dequantized to BF16: what weight-only FP8 multiplies by."""

    def __init__(self, artifact: CompiledArtifact):
        self.blocks = []
        for w in artifact.iter_blocks():
            tensors = {n: t for n, t in w.tensors.items() if not n.endswith(".weight_scale")}
            for linear in fp8.FP8_LINEARS:
                tensors[f"{linear}.weight"] = fp8.dequantize_rows(w.tensors[f"{linear}.weight"], w.tensors[f"{linear}.weight_scale"])
            self.blocks.append(LayerWeights(tensors, w.loras))

    def __iter__(self):
        return iter(self.blocks)


def _trajectory(artifact: CompiledArtifact, blocks: BlockSource, ops) -> tuple[torch.Tensor, torch.Tensor]:
    output = Denoiser(artifact, blocks, CPU, ops).run(keyframe_bundle(5), NO_TIMER)
    return output.video_latents, output.audio_latents


def test_weight_only_trajectory_is_bf16_math_over_dequantized_weights(tiny_compiled, tiny_fp8_compiled):
    artifact = CompiledArtifact(**tiny_fp8_compiled)
    config = artifact.config
    got = _trajectory(artifact, ResidentBlocks(artifact, CPU), fp8.RowFP8Ops(config, sdpa_attention, fp8.RowFP8Matmul("weight-only")))
    expected = _trajectory(artifact, DequantizedBlocks(artifact), BlockOps(config, sdpa_attention))
    assert_bitwise(got[0], expected[0], "video latents")
    assert_bitwise(got[1], expected[1], "audio latents")
    ring = _trajectory(artifact, BlockRing(BlockArena(artifact, pin=False), CPU), fp8.RowFP8Ops(config, sdpa_attention, fp8.RowFP8Matmul("weight-only")))
    assert_bitwise(ring[0], got[0], "block ring vs resident")
    exact_artifact = CompiledArtifact(**tiny_compiled)
    exact = _trajectory(exact_artifact, ResidentBlocks(exact_artifact, CPU), BlockOps(config, sdpa_attention))
    relative = ((got[0] - exact[0]).norm() / exact[0].norm()).item()
    assert 0 < relative < 0.1, relative


def test_w8a8_trajectory_runs_the_fp8_gemm(tiny_fp8_compiled, monkeypatch):
    """The same artifact with w8a8 operations (the device rule patched: torch's CPU `_scaled_mm`) stays close to
    weight-only; the Triton activation quantizer is compared with the torch one in test_fp8.py."""
    monkeypatch.setattr(fp8, "w8a8_refusal", lambda device: None)
    artifact = CompiledArtifact(**tiny_fp8_compiled)
    config = artifact.config
    blocks = ResidentBlocks(artifact, CPU)
    w8a8 = _trajectory(artifact, blocks, fp8.RowFP8Ops(config, sdpa_attention, fp8.RowFP8Matmul("w8a8")))
    weight_only = _trajectory(artifact, blocks, fp8.RowFP8Ops(config, sdpa_attention, fp8.RowFP8Matmul("weight-only")))
    relative = ((w8a8[0] - weight_only[0]).norm() / weight_only[0].norm()).item()
    assert 0 < relative < 0.1, relative


# -- sessions ----------------------------------------------------------------------------------------------------


def test_fp8_session_runs_its_profile_resident_ring_and_sequence_head(tiny_fp8_compiled):
    artifact = CompiledArtifact(**tiny_fp8_compiled)
    expected = _trajectory(artifact, ResidentBlocks(artifact, CPU), fp8.RowFP8Ops(artifact.config, sdpa_attention, fp8.RowFP8Matmul("weight-only")))
    with NativeEngineSession(FP8_CPU, CompiledPaths(**tiny_fp8_compiled)) as session:
        assert isinstance(session._denoisers[0].ops, fp8.RowFP8Ops) and session._denoisers[0].ops.fp8.mode == "weight-only"
        assert "approximate FP8 weight-only block linears" in session.memory_plan()
        result = session.generate(keyframe_bundle(5))
    assert result.metadata["fp8"] == "weight-only"
    assert_bitwise(result.video_latents, expected[0], "session vs denoiser")
    with NativeEngineSession(FP8_CPU, CompiledPaths(**tiny_fp8_compiled), EngineOptions(weight_residency="block-ring")) as ring:
        assert_bitwise(ring.generate(keyframe_bundle(5)).video_latents, expected[0], "block ring")
    with NativeEngineSession(FP8_CPU, CompiledPaths(**tiny_fp8_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head")) as group:
        got = group.generate(keyframe_bundle(5))
    assert_bitwise(got.video_latents, expected[0], "sequence-head")
    assert_bitwise(got.audio_latents, expected[1], "sequence-head audio")


def test_fp8_session_refusals(tiny_compiled, tiny_fp8_compiled):
    with pytest.raises(VflashError, match="tensor strategy shards BF16 blocks only"):
        NativeEngineSession(FP8_CPU, CompiledPaths(**tiny_fp8_compiled), EngineOptions(peer_device="cpu", strategy="tensor"))
    with pytest.raises(VflashError, match="approximate .FP8 attention."):
        NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(attention_backend="fa3-fp8"))
    with pytest.raises(VflashError, match="fa3-fp8 needs a CUDA device"):
        NativeEngineSession(FP8_CPU, CompiledPaths(**tiny_fp8_compiled), EngineOptions(attention_backend="fa3-fp8"))
    with pytest.raises(IdentityMismatchError):
        NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_fp8_compiled))


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from bundles import keyframe_bundle
from vflash_core.engine import fp8
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.model import sdpa_attention
from vflash_core.engine.residency import ResidentBlocks

paths = json.loads(sys.argv[2])
fp8.w8a8_refusal = lambda device: None  # torch's CPU _scaled_mm stands in for the SM90 GEMM
artifact = CompiledArtifact(**paths)
cpu = torch.device("cpu")
blocks = ResidentBlocks(artifact, cpu)

def velocity(quantizer, keep_values):
    ops = fp8.FusedRowFP8Ops(artifact.config, sdpa_attention, fp8.RowFP8Matmul("w8a8", quantizer), keep_values)
    denoiser = Denoiser(artifact, blocks, cpu, ops)
    return denoiser.evaluate(denoiser.start_request(keyframe_bundle(5, num_frames=22, height=64, width=128)), 1)

expected = velocity("torch", False)
print(json.dumps([torch.equal(a, b) for a, b in zip(velocity("triton", True), expected)]))
"""


@pytest.mark.slow
def test_fused_fp8_quantizers_in_the_block_in_the_interpreter(tiny_fp8_compiled):
    """In Triton's interpreter (a child process, as test_fused_path.py), one evaluation with w8a8: the Triton quantizers
    fused into RMSNorm + modulation and SwiGLU (keeping the BF16 values) and alone for the attention output give the
    torch quantizer's velocities bit for bit.

    The shape is the smallest that still runs every path of the three kernels in the block (test_fp8.py checks
    each kernel alone, wide rows and int64 indexing included): 22 frames on a 64x128 canvas pack 143 rows (64 video,
    74 audio, 5 text), so the row quantizers' 128-row tiles run as two programs with a masked last one, the fused
    norm's 8-row tiles as 18 programs with a masked last one (143 = 17 * 8 + 7), and its 24-wide rows fill its
    512-lane column chunk only in part (column masks). The interpreter's cost is about the norm's programs: 39 frames
    on 64x96 (213 rows, 27 programs) and 124 frames (647 rows) before ran the same paths with more rows."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    paths = {k: str(v) for k, v in tiny_fp8_compiled.items()}
    done = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__), json.dumps(paths)], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True]


def test_fused_execution_picks_the_fused_fp8_operations(tiny_fp8_compiled):
    """The session's choice (no kernel runs: CPU tensors need the interpreter): FP8 operations over FusedOps."""
    with NativeEngineSession(FP8_CPU, CompiledPaths(**tiny_fp8_compiled), EngineOptions(execution="fused")) as session:
        ops = session._denoisers[0].ops
        assert isinstance(ops, fp8.FusedRowFP8Ops) and ops.fp8.mode == "weight-only" and not ops.keep_values


def test_w8a8_profile_is_refused_off_sm90_and_uses_the_triton_quantizer(tmp_path, tiny_transformer, monkeypatch):
    """A w8a8 profile's session on the CPU is refused when it loads (no fallback to weight-only); where w8a8 runs,
    the fused execution quantizes with the Triton kernels and the reference execution with torch."""
    profile = replace(get_profile(FP8_CPU), id="t2va-base4-w8a8-cpu-test", fp8="w8a8")
    paths = compile_tiny(tmp_path, tiny_transformer, profile)
    with pytest.raises(VflashError, match="FP8 w8a8 execution needs FP8 tensor cores, a CUDA device of sm89, sm90, sm100, sm120; cpu is not a CUDA device"):
        NativeEngineSession(profile, CompiledPaths(**paths))
    monkeypatch.setattr(fp8, "w8a8_refusal", lambda device: None)
    for execution, quantizer, kind in (("fused", "triton", fp8.FusedRowFP8Ops), ("reference", "torch", fp8.RowFP8Ops)):
        with NativeEngineSession(profile, CompiledPaths(**paths), EngineOptions(execution=execution)) as session:
            ops = session._denoisers[0].ops
            assert type(ops) is kind and ops.fp8.mode == "w8a8" and ops.fp8.activation_quantizer == quantizer


# -- GPU (SM90): FP8 sessions on the device ------------------------------------------------------------------------

# The tiny model with linear widths that are multiples of 16 (what torch._scaled_mm takes on CUDA); its bundle layout
# (text width, patch and channels) is the tiny model's, so `keyframe_bundle` requests run on it.
GPU_FP8_CONFIG = replace(TINY, hidden_size=64, attention_head_dim=32, ffn_dim=96, rope_freq_dim=4, time_embed_hidden_dim=64)


@pytest.fixture(scope="module")
def gpu_fp8(tmp_path_factory):
    """The same random weights compiled on the GPU for the exact and the FP8 Base16 SM90 profiles."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("needs an SM90 GPU for the sm90 profiles")
    from vflash_core.weights import synthetic

    tmp = tmp_path_factory.mktemp("gpu-fp8")
    weights = synthetic.random_internal_weights(GPU_FP8_CONFIG, seed=3, dtype=torch.bfloat16)
    folder = synthetic.write_diffusers_transformer(tmp / "transformer", GPU_FP8_CONFIG, weights)
    compiled = {}
    for profile in ("t2va-base16-bf16-sm90", "t2va-base16-fp8-sm90"):
        (tmp / profile).mkdir()
        compiled[profile] = compile_tiny(tmp / profile, folder, profile, device="cuda:0")
    return compiled


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["torch-cudnn", "auto"])
def test_fp8_fused_equals_reference_on_gpu(gpu_fp8, attention):
    """w8a8 on the H200: the fused execution (Triton quantizers inside RMSNorm + modulation and SwiGLU, alone after
    attention) equals the reference execution (torch ops, torch quantizer) bit for bit, as the exact path does."""
    paths = gpu_fp8["t2va-base16-fp8-sm90"]
    with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0", execution="reference", attention_backend=attention)) as ref:
        expected = ref.generate(keyframe_bundle(1))
    with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0", execution="fused", attention_backend=attention)) as fused:
        assert isinstance(fused._denoisers[0].ops, fp8.FusedRowFP8Ops) and fused._denoisers[0].ops.fp8.activation_quantizer == "triton"
        got = fused.generate(keyframe_bundle(1))
    assert got.metadata["fp8"] == "w8a8"
    assert_bitwise(got.video_latents, expected.video_latents, f"video latents ({got.metadata['attention_backend']})")
    assert_bitwise(got.audio_latents, expected.audio_latents, "audio latents")


@pytest.mark.gpu
def test_fp8_block_ring_equals_resident_on_gpu(gpu_fp8):
    paths = gpu_fp8["t2va-base16-fp8-sm90"]
    with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0", weight_residency="resident")) as resident:
        expected = resident.generate(keyframe_bundle(2))
        resident_bytes = resident._denoisers[0].blocks.device_weight_bytes
    with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0", weight_residency="block-ring")) as ring:
        got = ring.generate(keyframe_bundle(2))
    assert_bitwise(got.video_latents, expected.video_latents, "block ring vs resident")
    with NativeEngineSession("t2va-base16-bf16-sm90", CompiledPaths(**gpu_fp8["t2va-base16-bf16-sm90"]), EngineOptions(device="cuda:0", weight_residency="resident")) as exact:
        exact_bytes = exact._denoisers[0].blocks.device_weight_bytes
    print(f"FP8 / BF16 resident block bytes: {resident_bytes / exact_bytes:.3f}")
    assert resident_bytes < 0.6 * exact_bytes


@pytest.mark.gpu
def test_fp8_error_against_exact_on_gpu(gpu_fp8):
    """The same request through the exact and the FP8 profile (and with fa3-fp8 where it runs): the relative L2 of the
    final latents is printed; FP8 stays close to exact on these random weights."""
    with NativeEngineSession("t2va-base16-bf16-sm90", CompiledPaths(**gpu_fp8["t2va-base16-bf16-sm90"]), EngineOptions(device="cuda:0")) as exact:
        expected = exact.generate(keyframe_bundle(3))
    paths = gpu_fp8["t2va-base16-fp8-sm90"]
    backends = ["auto"]
    try:
        from vflash_core.engine.attention import resolve_attention

        resolve_attention("fa3-fp8", torch.device("cuda:0"), approximate_allowed=True)
        backends.append("fa3-fp8")
    except VflashError as exc:
        print(f"fa3-fp8 not measured: {exc}")
    for backend in backends:
        with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0", attention_backend=backend)) as session:
            got = session.generate(keyframe_bundle(3))
        relative = ((got.video_latents - expected.video_latents).norm() / expected.video_latents.norm()).item()
        print(f"t2va-base16-fp8-sm90 ({got.metadata['attention_backend']}) vs exact, final video latents: relative L2 {relative:.4f}")
        assert relative < 0.1


@pytest.mark.multigpu
def test_fp8_sequence_head_equals_one_gpu(gpu_fp8):
    paths = gpu_fp8["t2va-base16-fp8-sm90"]
    with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0")) as single:
        expected = single.generate(keyframe_bundle(4))
    with NativeEngineSession("t2va-base16-fp8-sm90", CompiledPaths(**paths), EngineOptions(device="cuda:0", peer_device=1, strategy="sequence-head")) as group:
        got = group.generate(keyframe_bundle(4))
    assert_bitwise(got.video_latents, expected.video_latents, "sequence-head vs one GPU")
    assert_bitwise(got.audio_latents, expected.audio_latents, "sequence-head vs one GPU (audio)")
