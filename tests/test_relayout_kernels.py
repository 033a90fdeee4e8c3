"""Parity of the sequence-head relayouts `pack_heads` / `merge_heads` (`vflash_kernels.relayout`) with their torch
references. Both are pure copies, so they are checked bit for bit for every dtype and input bit pattern.

CPU tests run the kernels in Triton's interpreter through kernel_harness.py's `interp` fixture (the private interpreted
copy of the package; its docstring says why and how), on odd shapes: 37 rows (7 with the small tile setting: two
4-row programs, the last masked), 8 heads of 16 channels over 2, 4 and 8 ranks, with q-like contiguous, v-like
strided (a view into padded QKV rows) and head-major inputs, written into NaN-poisoned outputs. GPU tests (`-m gpu`)
compare the compiled kernels with the references on CUDA at the released width (56 heads of 128 channels) for
S_r = 19,111 and 38,222 rows and 2, 4 and 8 ranks, and beyond 2**31 addressed elements (v as a view into
(100,000, 3 * 7168) QKV rows: the INDEX_64 variant).
"""

from __future__ import annotations

import pytest
import torch
from kernel_harness import (
    DTYPES,
    S_CPU,
    S_SMALL_TILE,
    TILES,
    assert_all_written,
    assert_bitwise,
    compiled_kernels,
    configure,
    generator,
    interpreter_rows,
    packed_qkv,
    poisoned,
    randn,
)

from vflash_core.engine import parallel

HEADS_CPU, D_CPU = 8, 16
LAYOUTS = ["contiguous", "qkv-view", "head-major"]
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _input(layout: str, S: int, heads: int, D: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """(S, heads, D): q / k as the rope output (contiguous), v as a view into padded QKV rows, or heads outermost."""
    if layout == "contiguous":
        return randn((1, S, heads, D), dtype, g)[0]
    if layout == "qkv-view":
        return packed_qkv(S, heads, D, dtype, g)[3][0]
    return randn((heads, S, D), dtype, g).transpose(0, 1)


def _random_bits(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every bit pattern is possible: NaNs with payloads, infinities, subnormals, signed zeros."""
    bits = _BITS[dtype]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=torch.int64, device=g.device).to(bits).view(dtype)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    differ = actual.contiguous().view(_BITS[actual.dtype]) != expected.contiguous().view(_BITS[expected.dtype])
    assert not bool(differ.any()), f"{what}: {int(differ.sum())}/{differ.numel()} bit patterns differ, first at {tuple(differ.nonzero()[0].tolist())}"


def _check_pack_merge(kernels, x: torch.Tensor, ranks: int, g: torch.Generator, what: str) -> None:
    """pack into a poisoned send buffer, merge into a poisoned contiguous out and into the v slot of poisoned QKV
    rows (nothing else of those rows may be written); both against the references, and merge(pack(x)) == x."""
    S, heads, D = x.shape
    hp = heads // ranks
    relayout = kernels.relayout
    send = poisoned((ranks, S, hp, D), x.dtype)
    assert relayout.pack_heads(x, send) is send
    assert_all_written(send, f"pack {what}")
    assert_bitwise(send, parallel.pack_heads_reference(x, torch.empty_like(send)), f"pack {what}")

    received = randn((ranks, S, hp, D), x.dtype, g)
    expected = parallel.merge_heads_reference(received, torch.empty(S, heads, D, dtype=x.dtype))
    out = poisoned((S, heads, D), x.dtype)
    assert relayout.merge_heads(received, out) is out
    assert_all_written(out, f"merge {what}")
    assert_bitwise(out, expected, f"merge {what}")
    rows = poisoned((S, 3 * heads * D + 8), x.dtype)
    v_slot = rows[:, 2 * heads * D : 3 * heads * D].unflatten(-1, (heads, D))
    relayout.merge_heads(received, v_slot)
    assert_bitwise(v_slot, expected, f"merge into a strided view {what}")
    untouched = torch.cat([rows[:, : 2 * heads * D], rows[:, 3 * heads * D :]], dim=1)
    assert bool(untouched.isnan().all()), f"merge {what} wrote outside its strided out view"

    assert_bitwise(relayout.merge_heads(send, poisoned((S, heads, D), x.dtype)), x, f"merge(pack(x)) {what}")


# -- CPU: host-side checks (no kernels run) -----------------------------------------------------------------------


def test_session_keeps_the_references_on_the_cpu():
    """Gloo ranks are CPU threads, and the Triton interpreter is not thread-safe: the CPU uses the torch references."""
    assert parallel.relayout_ops(torch.device("cpu")) == (parallel.pack_heads_reference, parallel.merge_heads_reference)


@pytest.mark.gpu
def test_session_uses_the_kernels_on_cuda():
    kernels = compiled_kernels()
    assert parallel.relayout_ops(torch.device("cuda:0")) == (kernels.relayout.pack_heads, kernels.relayout.merge_heads)


def test_relayout_refuses_bad_shapes_and_dtypes(interp):
    relayout = interp.relayout
    x = torch.zeros(5, 8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be >= 1 and divide x's 8 heads"):
        relayout.pack_heads(x, torch.empty(3, 5, 2, 4, dtype=x.dtype))
    with pytest.raises(ValueError, match=r"out must be \(2, 5, 4, 4\)"):
        relayout.pack_heads(x, torch.empty(2, 5, 4, 8, dtype=x.dtype))
    with pytest.raises(ValueError, match=r"x must be \(S_r, heads, D\)"):
        relayout.pack_heads(x[None], torch.empty(2, 5, 4, 4, dtype=x.dtype))
    with pytest.raises(TypeError, match="differs from x dtype"):
        relayout.pack_heads(x, torch.empty(2, 5, 4, 4, dtype=torch.float32))
    with pytest.raises(TypeError, match="unsupported dtype"):
        relayout.pack_heads(x.double(), torch.empty(2, 5, 4, 4, dtype=torch.float64))
    received = torch.zeros(2, 5, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be \(5, 8, 4\)"):
        relayout.merge_heads(received, torch.empty(5, 4, 8, dtype=received.dtype))
    with pytest.raises(ValueError, match=r"received must be \(P, S_r, Hp, D\)"):
        relayout.merge_heads(received[0], torch.empty(5, 8, 4, dtype=received.dtype))
    with pytest.raises(ValueError, match="at least one part"):
        relayout.merge_heads(received[:0], torch.empty(5, 0, 4, dtype=received.dtype))
    with pytest.raises(TypeError, match="differs from received dtype"):
        relayout.merge_heads(received, torch.empty(5, 8, 4, dtype=torch.float16))
    # empty row ranges (a rank with no rows) launch nothing
    empty = torch.zeros(0, 8, 4, dtype=torch.bfloat16)
    assert relayout.pack_heads(empty, torch.empty(2, 0, 4, 4, dtype=empty.dtype)).shape == (2, 0, 4, 4)
    assert relayout.merge_heads(torch.empty(2, 0, 4, 4, dtype=empty.dtype), torch.empty(0, 8, 4, dtype=empty.dtype)).shape == (0, 8, 4)


def test_cpu_tensors_need_the_interpreter():
    kernels = compiled_kernels()
    if kernels._launch.INTERPRET:
        pytest.skip("TRITON_INTERPRET is set for the whole process")
    x = torch.zeros(5, 8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.relayout.pack_heads(x, torch.empty(2, 5, 4, 4, dtype=x.dtype))
    with pytest.raises(ValueError, match="CUDA"):
        kernels.relayout.merge_heads(torch.empty(2, 5, 4, 4, dtype=x.dtype), x)


# -- CPU: the kernels in the interpreter ---------------------------------------------------------------------------


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_pack_merge_interpreter(interp, monkeypatch, request, ranks, layout, dtype, tile):
    configure(interp, monkeypatch, tile)
    g = generator(request)
    rows = interpreter_rows(tile)  # the small tile's 4-row blocks: two programs, the last with 3 rows
    _check_pack_merge(interp, _input(layout, rows, HEADS_CPU, D_CPU, dtype, g), ranks, g, f"P={ranks} {layout} {dtype}")


@pytest.mark.parametrize("head_dim", [16, 24])
def test_int64_variant_interpreter(interp, monkeypatch, request, head_dim):
    """The INDEX_64 variant (forced on small shapes) gives the same bits; D = 24 also masks channels (BLOCK_D 32)."""
    configure(interp, monkeypatch, "small", index_64=True)
    g = generator(request)
    _check_pack_merge(interp, _input("qkv-view", S_SMALL_TILE, HEADS_CPU, head_dim, torch.bfloat16, g), 4, g, f"int64 D={head_dim}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_bit_pattern_interpreter(interp, request, dtype):
    """A pure copy: random bit patterns (NaN payloads, infinities, subnormals, -0) come through unchanged."""
    g = generator(request)
    x = _random_bits((S_CPU, 3 * HEADS_CPU, D_CPU), dtype, g)[:, HEADS_CPU : 2 * HEADS_CPU]
    send = interp.relayout.pack_heads(x, torch.empty(2, S_CPU, HEADS_CPU // 2, D_CPU, dtype=dtype))
    assert_same_bits(send, parallel.pack_heads_reference(x, torch.empty_like(send)), f"pack {dtype}")
    received = _random_bits((2, S_CPU, HEADS_CPU // 2, D_CPU), dtype, g)
    out = interp.relayout.merge_heads(received, torch.empty(S_CPU, HEADS_CPU, D_CPU, dtype=dtype))
    assert_same_bits(out, parallel.merge_heads_reference(received, torch.empty_like(out)), f"merge {dtype}")


# -- GPU: the released width, bit for bit against torch on CUDA ---------------------------------------------------

HEADS, HEAD_DIM = 56, 128
INNER = HEADS * HEAD_DIM


def _gpu_case(gpu, x: torch.Tensor, ranks: int, g: torch.Generator, what: str) -> None:
    """pack x and merge a random receive buffer (both into poisoned outputs), against the references on CUDA."""
    S = x.shape[0]
    hp = HEADS // ranks
    relayout = gpu.relayout
    send = poisoned((ranks, S, hp, HEAD_DIM), x.dtype, "cuda")
    relayout.pack_heads(x, send)
    assert_bitwise(send, parallel.pack_heads_reference(x, torch.empty_like(send)), f"pack {what}")
    out = poisoned((S, HEADS, HEAD_DIM), x.dtype, "cuda")
    assert_bitwise(relayout.merge_heads(send, out), x, f"merge(pack(x)) {what}")
    received = randn(send.shape, x.dtype, g, device="cuda")
    relayout.merge_heads(received, out.fill_(float("nan")))
    assert_bitwise(out, parallel.merge_heads_reference(received, torch.empty_like(out)), f"merge {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("S", [19_111, 38_222])
def test_relayout_gpu(gpu, request, S, ranks):
    """q / k (contiguous rope output) and v (a view into the fused (S, 3I) QKV GEMM output), bf16."""
    g = generator(request, "cuda")
    qkv = randn((S, 3 * INNER), torch.bfloat16, g, device="cuda")
    q, _, v = (part.unflatten(-1, (HEADS, HEAD_DIM)) for part in qkv.split(INNER, dim=-1))
    _gpu_case(gpu, q.contiguous(), ranks, g, f"q S={S} P={ranks}")
    _gpu_case(gpu, v, ranks, g, f"v S={S} P={ranks}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_relayout_gpu_dtypes(gpu, request, dtype):
    g = generator(request, "cuda")
    qkv = randn((4099, 3 * INNER), dtype, g, device="cuda")
    _gpu_case(gpu, qkv[:, 2 * INNER :].unflatten(-1, (HEADS, HEAD_DIM)), 2, g, f"v {dtype}")


@pytest.mark.gpu
def test_relayout_gpu_every_bit_pattern(gpu, request):
    g = generator(request, "cuda")
    x = _random_bits((4099, HEADS, HEAD_DIM), torch.bfloat16, g)
    send = gpu.relayout.pack_heads(x, torch.empty(4, 4099, HEADS // 4, HEAD_DIM, dtype=x.dtype, device="cuda"))
    assert_same_bits(send, parallel.pack_heads_reference(x, torch.empty_like(send)), "pack")
    assert_same_bits(gpu.relayout.merge_heads(send, torch.empty_like(x)), x, "merge(pack(x))")


@pytest.mark.gpu
def test_relayout_forced_int64_gpu(gpu, monkeypatch, request):
    """The INDEX_64 variant compiled for the GPU gives the int32 variant's bits (forced at a small size)."""
    monkeypatch.setattr(gpu._launch, "needs_int64", lambda *views: True)
    g = generator(request, "cuda")
    qkv = randn((4099, 3 * INNER), torch.bfloat16, g, device="cuda")
    _gpu_case(gpu, qkv[:, 2 * INNER :].unflatten(-1, (HEADS, HEAD_DIM)), 8, g, "forced int64")


@pytest.mark.gpu
def test_relayout_gpu_beyond_int32(gpu, request):
    """v as a view into (100,000, 3 * 7168) QKV rows spans 2.15e9 elements: pack reads and merge writes it (INDEX_64)."""
    S, ranks = 100_000, 2
    g = generator(request, "cuda")
    qkv = randn((S, 3 * INNER), torch.bfloat16, g, device="cuda")
    v = qkv[:, 2 * INNER :].unflatten(-1, (HEADS, HEAD_DIM))
    assert gpu._launch.needs_int64(v)
    send = poisoned((ranks, S, HEADS // ranks, HEAD_DIM), torch.bfloat16, "cuda")
    assert not gpu._launch.needs_int64(send)
    gpu.relayout.pack_heads(v, send)
    assert_bitwise(send, parallel.pack_heads_reference(v, torch.empty_like(send)), "pack S=100,000")
    expected = v.contiguous()
    qkv.fill_(float("nan"))
    gpu.relayout.merge_heads(send, v)  # into the same strided view, now poisoned
    assert_bitwise(v, expected, "merge(pack(v)) into the strided view S=100,000")
    del expected
    assert bool(qkv[:, : 2 * INNER].isnan().all()), "merge wrote outside its strided out view"
