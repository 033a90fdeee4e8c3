"""What the kernel tests share: the kernels package decorated for Triton's interpreter (`interp`) or compiled
(`gpu`), the bitwise assertion, seeded inputs and the shapes and tile settings of the interpreter and GPU cases.

`triton.jit` reads TRITON_INTERPRET when it *decorates* a function (triton 3.9: `knobs.runtime.interpret` in
`triton.jit`), so `interp` imports the kernels folder a second time, as the private package
`_vflash_kernels_interpreted`, with the variable set only during that import. The real `vflash_kernels` (and every
other test module in this pytest process) is untouched, in whichever order things import. A test module takes the
fixtures by importing them (`from kernel_harness import gpu, interp`): `interp` is module-scoped, a private copy per
module.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vflash_core.engine import model as reference  # the torch reference of every kernel op


def modulate_reference(normed, table, row_index, which="msa", out_dtype=None):
    """`vflash_core.engine.model.modulate`, cast to a kernel's `out_dtype` (the output heads take it in fp32)."""
    y = reference.modulate(normed, table, row_index, which)
    return y if out_dtype is None else y.to(out_dtype)

KERNEL_MODULES = ("_launch", "modulate", "gated_residual", "rope", "swiglu", "relayout")
INTERPRETED_PACKAGE = "_vflash_kernels_interpreted"
KERNELS_FOLDER = Path(__file__).resolve().parent.parent / "kernels"


def import_folder(name: str, folder: Path) -> SimpleNamespace:
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return SimpleNamespace(**{m: importlib.import_module(f"{name}.{m}") for m in KERNEL_MODULES})


def compiled_kernels() -> SimpleNamespace:
    """The real package: `vflash_kernels` if installed, else the repository's `kernels/` registered under that name."""
    try:
        importlib.import_module("vflash_kernels")
    except ModuleNotFoundError:
        return import_folder("vflash_kernels", KERNELS_FOLDER)
    return SimpleNamespace(**{m: importlib.import_module(f"vflash_kernels.{m}") for m in KERNEL_MODULES})


@pytest.fixture(scope="module")
def interp():
    """The kernels decorated for Triton's interpreter, as a private copy of the package (see the module docstring)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        kernels = import_folder(INTERPRETED_PACKAGE, KERNELS_FOLDER)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    assert kernels._launch.INTERPRET, "the private copy was not decorated for the interpreter"
    yield kernels
    for key in [k for k in sys.modules if k == INTERPRETED_PACKAGE or k.startswith(INTERPRETED_PACKAGE + ".")]:
        del sys.modules[key]


# -- helpers -------------------------------------------------------------------------------------------------------


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """atol = rtol = 0, NaNs equal only to NaNs; on failure: count, max abs diff, max ulp (bf16/fp32), first index."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{what}: {actual.shape}/{actual.dtype} vs {expected.shape}/{expected.dtype}"
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    if bool(same.all()):
        return
    bad = ~same
    diff = (actual.double() - expected.double()).abs()
    first = tuple(int(i) for i in bad.nonzero()[0])
    raise AssertionError(
        f"{what}: {int(bad.sum())}/{same.numel()} elements differ, max abs diff {diff[bad].max().item():.3e}, "
        f"max {ulp_distance(actual, expected).max().item()} ulp, first at {first}: {actual[first].item()!r} vs {expected[first].item()!r}"
    )


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of the dtype (bf16/fp16 via their 16-bit patterns, fp32 via 32-bit); for
    integer tensors (FP8 codes compared as bytes) the plain difference."""
    if not a.dtype.is_floating_point:
        return (a.long() - b.long()).abs()
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]

    def ordered(t):
        i = t.contiguous().view(bits).long()
        sign = 1 << (16 if bits == torch.int16 else 32) - 1
        return torch.where(i < 0, -(i + sign), i)  # monotone integer line through -0 / +0

    return (ordered(a) - ordered(b)).abs()


def assert_all_written(out: torch.Tensor, what: str) -> None:
    """Outputs are poisoned with NaN before each run and inputs are finite: no NaN may survive."""
    missed = out.isnan()
    assert not bool(missed.any()), f"{what}: {int(missed.sum())} elements not written, first at {tuple(int(i) for i in missed.nonzero()[0])}"


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def generator(request, device="cpu") -> torch.Generator:
    """A fresh generator per test case, seeded from its id (reproducible, different for every case)."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, dtype, g, scale=1.0, device="cpu") -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def strided(shape, dtype, g, pad=8, scale=1.0, device="cpu") -> torch.Tensor:
    """A random (rows, cols) tensor that is a non-contiguous view: each row padded by `pad` trailing elements."""
    rows, cols = shape
    return randn((rows, cols + pad), dtype, g, scale, device)[:, :cols]


def small_tile(kernels):
    """A tile heuristic replacement that forces many programs and partial blocks along every axis."""

    def tile(n_rows, n_groups, group_size=1, target_elements=None):
        return kernels._launch.Tile(block_rows=4, block_groups=16 if group_size == 1 else 2, num_warps=1)

    return tile


TILES = ["heuristic", "small"]
DTYPES = [torch.bfloat16, torch.float32]
S_CPU = 37
#: The interpreter's width for the row-norm kernels (`rms_norm_modulate` and its FP8 quantizing twin), which read a
#: row in chunks of 512 channels whatever the width: 2.5 chunks, as the released H = 5376 is 10.5 (whole chunks summed
#: in turn, then a half-full masked one), for a quarter of the interpreted work. The GPU tests run H_FULL.
H_INTERPRETED = 1280


#: Rows of the interpreter cases with the small tile setting (`small_tile`: 4-row blocks): two row
#: programs, the last with 3 of its 4 rows (S_CPU = 37 gave ten programs, the same paths at five times the work).
#: The heuristic settings keep S_CPU rows.
S_SMALL_TILE = 7


def interpreter_rows(tile: str) -> int:
    return S_SMALL_TILE if tile == "small" else S_CPU


def configure(kernels, monkeypatch, tile: str, index_64: bool = False) -> None:
    if tile == "small":
        monkeypatch.setattr(kernels._launch, "elementwise_tile", small_tile(kernels))
    if index_64:
        monkeypatch.setattr(kernels._launch, "needs_int64", lambda *views: True)



def packed_qkv(S, heads, D, dtype, g, pad=8):
    """(1, S, 3I) packed QKV rows with a row stride of 3I + pad (a view), and q, k, v views of it."""
    inner = heads * D
    qkv = strided((S, 3 * inner), dtype, g, pad=pad)[None]
    q, k, v = (part.unflatten(-1, (heads, D)) for part in qkv.split(inner, dim=-1))
    return qkv, q, k, v


# -- GPU: full width ---------------------------------------------------------------------------------------------

H_FULL, HEADS, HEAD_DIM, ROTARY, FFN = 5376, 56, 128, 96, 14336
S_GPU = [19_796, 38_222]


@pytest.fixture
def gpu():
    """The compiled kernels on cuda:0; frees every tensor of the case afterwards (big cases use tens of GiB)."""
    kernels = compiled_kernels()
    assert not kernels._launch.INTERPRET, "TRITON_INTERPRET is set: GPU tests need compiled kernels"
    torch.cuda.empty_cache()
    yield kernels
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def adaln_table(T, dtype, g, device="cuda"):
    """A (3T, 6H) AdaLN table as the model builds it: the (T, 18H) GEMM output viewed as (3T, 6H)."""
    return randn((T, 18 * H_FULL), dtype, g, 0.5, device).view(3 * T, 6 * H_FULL)

