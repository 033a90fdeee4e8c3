"""Every Triton kernel compiles ahead of time for every GPU family's targets (sm80, sm86, sm89, sm90, sm100, sm103,
sm120, sm121) at the launch settings the engine uses at H3's full width (`vflash_kernels.aot`): on a GPU, where the
launches are captured from the real device and must equal the CPU's capture, for all eight; on the CPU (Triton lowers
to PTX and runs the `ptxas` it ships; no GPU) for sm80 and sm120.

The kernels are this checkout's `kernels/` folder, imported under a private name (an installed `vflash_kernels` may
be another checkout's), in a fresh Triton cache so that every compile really runs."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
from kernel_harness import KERNELS_FOLDER, import_folder

_PRIVATE = "_vflash_kernels_aot"
# What the engine launches: one per distinct (kernel, specialisation) at H3's shapes (`rms_norm_modulate_quantize`
# launches `_rms_norm_modulate_kernel` with its quantizing passes on).
KERNELS = {
    "_rms_norm_modulate_kernel", "_modulate_kernel", "_gated_residual_kernel", "_qk_norm_rope_kernel", "_rope_kernel",
    "_swiglu_kernel", "_relayout_kernel", "_quantize_rows_kernel", "_swiglu_quantize_kernel",
}


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    saved = pytest.MonkeyPatch()
    saved.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
    saved.delenv("TRITON_INTERPRET", raising=False)
    import_folder(_PRIVATE, KERNELS_FOLDER)
    yield importlib.import_module(f"{_PRIVATE}.aot")
    saved.undo()
    for key in [k for k in list(sys.modules) if k == _PRIVATE or k.startswith(_PRIVATE + ".")]:
        del sys.modules[key]


@pytest.fixture(scope="module")
def cpu_launches(aot):
    return aot.capture_launches("cpu")


def test_every_kernel_is_captured_at_h3_shapes(aot, cpu_launches):
    assert {launch.name for launch in cpu_launches} == KERNELS
    import triton

    assert not isinstance(triton.runtime.driver._active, aot._CaptureDriver)  # the stand-in is gone after the capture
    by_name = {launch.name: dict(launch.constexprs) for launch in cpu_launches}
    fn = {launch.name: launch.kernel.arg_names for launch in cpu_launches}
    value = lambda kernel, arg: by_name[kernel][(fn[kernel].index(arg),)]
    # the launch settings of the released width: H = 5376, 56 heads of 128, 96 rotary channels, 32-bit indices
    assert value("_rms_norm_modulate_kernel", "HIDDEN") == 5376 and value("_qk_norm_rope_kernel", "HEAD_DIM") == 128
    assert value("_rope_kernel", "ROTARY") == value("_qk_norm_rope_kernel", "ROTARY") == 96 and value("_swiglu_kernel", "BLOCK_COLS") == 2048
    assert not any(value(name, "INDEX_64") for name in KERNELS) and not any(value(name, "EMULATE_CASTS") for name in KERNELS - {"_relayout_kernel"})


def test_the_launches_use_the_models_adaln_layout(aot):
    """The AdaLN blocks `h3_launches` passes are the ones the engine passes (the model's `MODULATION_BLOCKS`)."""
    from vflash_core.engine.model import MODULATION_BLOCKS

    for which, (shift, scale, gate) in aot.H3_ADALN_BLOCKS.items():
        blocks = MODULATION_BLOCKS[which]
        assert (blocks.shift, blocks.scale, blocks.gate, blocks.count) == (shift, scale, gate, aot.H3_ADALN_TABLE_BLOCKS)
    assert set(aot.H3_ADALN_BLOCKS) == {which for which, blocks in MODULATION_BLOCKS.items() if blocks.gate is not None}


# On the CPU (each compile ~2.5 s on the CI machine) the oldest family and the consumer Blackwell one, neither of which
# this project's machines have; the GPU test below compiles for all eight.
@pytest.mark.parametrize("capability", [80, 120])
def test_every_kernel_compiles_for_the_target(aot, cpu_launches, capability):
    arch = f"sm_{capability}{'a' if capability >= 90 else ''}"
    for launch in cpu_launches:
        kernel = aot.compile_for(launch, capability)
        assert kernel.metadata.target.arch == capability and f".target {arch}" in kernel.asm["ptx"], launch.name
        assert len(kernel.asm["cubin"]) > 1000 and kernel.metadata.num_warps == launch.num_warps, launch.name


@pytest.mark.gpu
def test_gpu_launches_equal_the_cpu_capture_and_compile_everywhere(aot, cpu_launches):
    """On a GPU the launchers run their real device checks on CUDA tensors: the launches they make are the CPU's, and
    each compiles for every target; the local target's cubin loads on this device."""
    launches = aot.capture_launches("cuda")
    assert launches == cpu_launches
    major, minor = torch.cuda.get_device_capability()
    for capability in aot.CAPABILITIES:
        for launch in launches:
            kernel = aot.compile_for(launch, capability)
            if capability == major * 10 + minor:
                kernel._init_handles()  # loads the cubin into this device's context


# -- the sparse-attention fast mode's kernel, whose pipeline depth follows the device's shared memory ---------------

#: The shared memory one program may take (the opt-in limit, bytes) by compute capability, as CUDA documents it.
SHARED_MEMORY_LIMIT = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 103: 227, 120: 99, 121: 99}


@pytest.fixture(scope="module")
def sparse_launch(aot):
    """(module, launch): the block-sparse attention kernel as the mode launches it at 1344x768 5 s, captured on the
    CPU (with the H100's 3 stages)."""
    bsa = importlib.import_module(f"{_PRIVATE}.block_sparse_attention")
    rows, heads, prefix = 38_222, 56, 8
    video = -(-rows // bsa.BLOCK_ROWS) - prefix
    q = torch.empty(1, rows, heads, 128, dtype=torch.bfloat16)
    kv_blocks = torch.zeros(heads, video, prefix + 74, dtype=torch.int32)
    kv_counts = torch.ones(heads, video, dtype=torch.int32)
    launches = []
    with aot._capturing(launches, True):
        bsa.block_sparse_attention(q, q, q, kv_blocks, kv_counts, prefix)
    (launch,) = launches
    assert launch.num_stages == 3
    return bsa, launch


@pytest.mark.parametrize("capability", [80, 120])
def test_sparse_attention_fits_the_shared_memory_of_the_target(aot, sparse_launch, capability):
    """An A100 or an RTX 50xx gives a program less shared memory than the H100's 3 stages take: the stages chosen for
    its limit fit it."""
    bsa, launch = sparse_launch
    limit = SHARED_MEMORY_LIMIT[capability] * 1024
    assert aot.compile_for(launch, capability).metadata.shared > limit
    stages = bsa.pipeline_stages(limit)
    assert stages < 3 and aot.compile_for(dataclasses.replace(launch, num_stages=stages), capability).metadata.shared <= limit


@pytest.mark.gpu
def test_sparse_attention_stages_fit_every_family_and_this_device(aot, sparse_launch):
    """The launcher reads this device's limit (the table's for its capability) and the stages chosen for each family's
    limit compile within it."""
    bsa, launch = sparse_launch
    major, minor = torch.cuda.get_device_capability()
    assert bsa._max_shared_bytes(torch.cuda.current_device()) == SHARED_MEMORY_LIMIT[major * 10 + minor] * 1024
    for capability, kib in SHARED_MEMORY_LIMIT.items():
        chosen = dataclasses.replace(launch, num_stages=bsa.pipeline_stages(kib * 1024))
        assert aot.compile_for(chosen, capability).metadata.shared <= kib * 1024, capability
