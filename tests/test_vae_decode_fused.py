"""The native video decoder's fused ops (`vae_vit.FusedDecoderOps`, kernels in `kernels/vae_decoder.py` and
`kernels/swiglu.py`) against its torch ops (`DecoderOps`), bit for bit.

On the CPU the kernels run in Triton's interpreter: the `interp` fixture imports the kernels folder a second time,
as a private package, with TRITON_INTERPRET=1 set only during that import (as tests/kernel_harness.py does, for the same
reason), and the decoder is pointed at it through `vae_vit._decoder_kernels`. The per-op shapes keep every masked
path: row blocks with masked rows (37 rows), a norm width with a masked last chunk (1040 = 2 x 512 + 16) and one
below a chunk (32, the demo's), head dims that are and are not a power of two (16, 24, 64), SwiGLU and residual
widths that leave masked column blocks.

What the interpreter cannot show: torch's CPU `F.rms_norm` sums squares in another order than its CUDA kernel, which
the norm kernels reproduce, so on the CPU the fused norms are compared with their emulation of that order
(`kernel_references.rms_norm_cast_reference`, fma included), and a whole decode with the fused norms with the reference decode whose
norms are that emulation; with the fused norms off, the fused decode equals the untouched reference decode. On the
CPU the decode runs in bf16 (diffusers' fp32 pins): in fp32 the interpreter's SwiGLU `exp` is numpy's, a few ulp from
torch's (tests/test_kernels.py). The GPU test compares the fused and reference decodes bit for bit on CUDA at the
released decoder width, fp32 and bf16, with every fused op on, and with diffusers' own decode.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import random
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from kernel_references import fma_f32, rms_norm_block_order_reference, rms_norm_cast_reference

pytest.importorskip("triton")

from vae_inputs import SMALL_TILES, allocation_sizes, latents

from vflash_core.engine.model import apply_rotary
from vflash_core.errors import VflashError
from vflash_core.media import vae_vit
from vflash_core.media.vae import MediaVAEs
from vflash_core.media.vae_decode import NativeVideoDecoder
from vflash_core.media.vae_vit import DecoderOps, DecoderWeights, FusedDecoderOps, resolve_decoder_execution

_INTERPRETED = "_vflash_kernels_decoder_interpreted"
_FOLDER = Path(__file__).resolve().parent.parent / "kernels"


@pytest.fixture(scope="module")
def interp():
    """`vae_decoder` and `swiglu` of the kernels folder decorated for Triton's interpreter (a private package)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(
            _INTERPRETED, _FOLDER / "__init__.py", submodule_search_locations=[str(_FOLDER)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[_INTERPRETED] = package
        spec.loader.exec_module(package)
        kernels = SimpleNamespace(
            vae_decoder=importlib.import_module(f"{_INTERPRETED}.vae_decoder"),
            swiglu=importlib.import_module(f"{_INTERPRETED}.swiglu"),
        )
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    assert kernels.vae_decoder._launch.INTERPRET, "the private copy was not decorated for the interpreter"
    yield kernels
    for key in [k for k in sys.modules if k == _INTERPRETED or k.startswith(_INTERPRETED + ".")]:
        del sys.modules[key]


@pytest.fixture
def fused_ops(interp, monkeypatch):
    """`FusedDecoderOps` (and the decoder's "fused" execution) on the interpreted kernels."""
    monkeypatch.setattr(vae_vit, "_decoder_kernels", lambda: interp)
    return FusedDecoderOps(lambda q, k, v: None, torch.device("cpu"))


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


class CudaOrderNormOps(DecoderOps):
    """The reference ops with the norms in torch's CUDA reduction order (`reference_norm`, the fused norms'
    emulation): on the CPU the only difference `FusedDecoderOps` may have from `DecoderOps`."""

    def __init__(self, attend, reference_norm):
        super().__init__(attend)
        self.reference_norm = reference_norm

    def norm(self, x, weight, eps, dtype):
        return self.reference_norm(x, weight, eps, dtype)


# -- the norm's emulation -------------------------------------------------------------------------------------------


def test_fma_emulation_rounds_once():
    """`fma_f32` against exact rational arithmetic on random fp32 triples, near-cancelling sums and ties included."""
    rng = random.Random(0)
    a = randn(4000, seed=1) * 2.0 ** torch.randint(-20, 20, (4000,)).float()
    b = randn(4000, seed=2)
    c = torch.where(torch.rand(4000) < 0.3, -(a * b), randn(4000, seed=3) * 8)  # a third nearly cancel
    got = fma_f32(a, b, c)
    for i in rng.sample(range(4000), 1500):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        # the fp32 nearest to `exact` (ties to even): fp64 of the rational is exact enough to pick among neighbours
        candidates = torch.tensor(float(exact), dtype=torch.float32)
        near = [candidates, torch.nextafter(candidates, torch.tensor(math.inf)),
                torch.nextafter(candidates, torch.tensor(-math.inf))]
        best = min(near, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(torch.int32)) & 1))
        assert got[i].item() == best.item(), (i, a[i].item(), b[i].item(), c[i].item())


def test_norm_emulation_is_the_block_order_for_bf16_inputs():
    """For bf16 inputs (exact squares, so fma = multiply and add) the emulation equals the transformer kernels' order
    reference, and it stays within rounding of `F.rms_norm` for the decoder's fp32 stream."""
    x, w = randn(37, 1040, dtype=torch.bfloat16, seed=4), randn(1040, seed=5)
    expected = rms_norm_block_order_reference(x.float(), w, 1e-5).to(torch.bfloat16)
    assert_bitwise(rms_norm_cast_reference(x, w, 1e-5, torch.bfloat16), expected, "bf16 input")
    h = randn(37, 1040, seed=6, scale=30.0)
    torch.testing.assert_close(
        rms_norm_cast_reference(h, w, 1e-5, torch.float32), F.rms_norm(h, (1040,), w, 1e-5)
    )


# -- per op, in the interpreter ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [32, 1040])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [True, False])
def test_norm_bitwise(fused_ops, width, x_dtype, out_dtype, weighted):
    """`norm` of a (W, S, D) stream (fp32, or bf16 as the first block's input) against the CUDA-order emulation."""
    x = randn(2, 37, width, dtype=x_dtype, seed=width, scale=20.0)
    weight = randn(width, seed=7) if weighted else None
    eps = 1e-5 if weighted else None  # None: fp32's machine epsilon, as F.rms_norm has it
    expected = rms_norm_cast_reference(x, weight, eps, out_dtype)
    assert_bitwise(fused_ops.norm(x, weight, eps, out_dtype), expected, f"norm {width} {x_dtype} -> {out_dtype}")


@pytest.mark.parametrize(("head_dim", "rotary"), [(16, 12), (24, 18), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_norm_rope_bitwise(fused_ops, head_dim, rotary, dtype):
    """Unweighted per-head norm and rotary of (W, S, heads, Dh) q and k with (1, S, 1, R) angles shared by the W
    stacked tile-windows, against the reference rotary of the CUDA-order norm."""
    windows, seq, heads = 3, 37, 3
    angles = randn(1, seq, 1, rotary, seed=8, scale=3.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = randn(windows, seq, heads, head_dim, dtype=dtype, seed=9, scale=4.0)
    k = randn(windows, seq, heads, head_dim, dtype=dtype, seed=10, scale=4.0)
    got = [fused_ops.head_norm_rope(x, 1e-5, cos, sin) for x in (q, k)]
    for name, x, out in (("q", q, got[0]), ("k", k, got[1])):
        assert_bitwise(out, apply_rotary(rms_norm_cast_reference(x, None, 1e-5, dtype), cos, sin), f"{name} Dh={head_dim} {dtype}")
    if dtype == torch.bfloat16:  # bf16 squares are exact, and per head CPU F.rms_norm agrees to the bit here too
        assert_bitwise(got[0], DecoderOps(None).head_norm_rope(q, 1e-5, cos, sin), "q against DecoderOps")


def test_swiglu_bitwise(fused_ops):
    """bf16 (S, 2 I) [value | gate] with I = 72 (masked column blocks), each tile-window's written into its rows of
    the call's (W, S, I) result, as the feed-forward does."""
    p = randn(2, 37, 144, dtype=torch.bfloat16, seed=11, scale=4.0)
    got, expected = (torch.full((2, 37, 72), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    for window in range(2):
        assert fused_ops.swiglu(p[window], got[window]).data_ptr() == got[window].data_ptr()
        DecoderOps(None).swiglu(p[window], expected[window])
    value, gate = p.chunk(2, dim=-1)
    assert_bitwise(expected, value * F.silu(gate), "DecoderOps swiglu")
    assert_bitwise(got, expected, "swiglu")


@pytest.mark.parametrize(
    ("h_dtype", "y_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                             (torch.float32, torch.float32)]
)
def test_scaled_residual_bitwise(fused_ops, h_dtype, y_dtype):
    """`h + y * scale` with the fp32 scale: the fp32 stream (updated in place), the first block's bf16 stream (a new
    fp32 one), an fp32 VAE's."""
    h = randn(2, 37, 300, dtype=h_dtype, seed=12, scale=10.0)
    y, scale = randn(2, 37, 300, dtype=y_dtype, seed=13), randn(300, seed=14)
    expected = DecoderOps(None).scaled_residual(h, y, scale)
    got = fused_ops.scaled_residual(h, y, scale)
    assert (got.data_ptr() == h.data_ptr()) == (h_dtype == torch.float32)
    assert_bitwise(got, expected, f"residual {h_dtype} + {y_dtype}")


def test_fused_execution_is_refused_on_the_cpu_outside_the_interpreter(vae_root):
    vae = MediaVAEs.from_pretrained(vae_root, dtype=torch.bfloat16).video_vae
    with pytest.raises(VflashError, match="runs Triton kernels on CUDA, not on cpu"):
        NativeVideoDecoder.from_vae(vae, execution="fused")
    with pytest.raises(VflashError, match="unknown decoder_execution 'fast'"):
        NativeVideoDecoder.from_vae(vae, execution="fast")
    with pytest.raises(VflashError, match="unknown decoder_execution"):
        MediaVAEs.from_pretrained(vae_root, dtype=torch.bfloat16, decoder_execution="fast")
    # "auto", the default: the fused ops where they run (CUDA), the torch ops elsewhere
    assert NativeVideoDecoder.from_vae(vae).execution == "reference"
    assert MediaVAEs.from_pretrained(vae_root, dtype=torch.bfloat16).decoder_execution == "reference"
    assert resolve_decoder_execution("auto", torch.device("cuda", 0)) == "fused"


# -- whole decodes, in the interpreter ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae_root(h3_family):
    return h3_family


@pytest.fixture(scope="module")
def bf16_vae(vae_root):
    """The demo family's video VAE as the pipeline loads it in bf16 (diffusers' fp32 pins), 64 px tiles."""
    vae = MediaVAEs.from_pretrained(vae_root, dtype=torch.bfloat16).video_vae
    vae.enable_tiling(*SMALL_TILES)
    return vae


# 8 latent frames: 2 windows, the second ending in repeated latents; 4 x 6 latents: 1 x 2 tiles of 64 px (blended
# across their 32 px overlap). 4 tile-windows: a call of 3 stacked ones and a last call of one.
DECODE_LATENTS = (1, 8, 8, 4, 6)
# The cheapest decode that stacks tile-windows in a call: 4 latent frames, one window (ending in repeated latents),
# its 2 tiles as one call of 2. The interpreter's cost is per tile-window (each of the same size): the fully fused
# decode of DECODE_LATENTS' first shape (8 tile-windows) ran the same ops four times over.
STACKED_LATENTS, STACKED_PER_CALL = (1, 8, 4, 4, 6), 2


def test_fused_decode_with_torch_norms_equals_the_reference(fused_ops, vae_root, bf16_vae, monkeypatch):
    """SwiGLU and the scaled residuals fused, the norms torch's: the reference decode's pixels bit for bit, three
    tile-windows per call (the last call has one); through `MediaVAEs`' option too."""
    monkeypatch.setattr(vae_vit, "FUSED_DECODER_NORM", False)
    monkeypatch.setattr(vae_vit, "FUSED_DECODER_QK_NORM", False)
    z = latents(DECODE_LATENTS, seed=3)
    expected = NativeVideoDecoder.from_vae(bf16_vae, windows_per_call=3).decode(z)
    fused = NativeVideoDecoder.from_vae(bf16_vae, windows_per_call=3, execution="fused")
    assert isinstance(fused.ops[0], FusedDecoderOps)
    assert_bitwise(fused.decode(z), expected, "fused SwiGLU and residuals")
    # the same through `MediaVAEs`' option (its own native decode of normalised latents, mapped to [0, 1])
    audio = MediaVAEs.from_pretrained(vae_root, dtype=torch.bfloat16).audio_vae
    frames = {
        execution: MediaVAEs(bf16_vae, audio, video_decoder="native", decoder_execution=execution).decode_video(z)
        for execution in ("reference", "fused")
    }
    assert_bitwise(frames["fused"], frames["reference"], "MediaVAEs decoder_execution='fused'")


def test_fully_fused_decode_equals_the_cuda_order_reference(fused_ops, bf16_vae):
    """Every fused op on: the reference decode with its norms in torch's CUDA order, bit for bit."""
    z = latents(STACKED_LATENTS, seed=4)
    reference = NativeVideoDecoder.from_vae(bf16_vae, windows_per_call=STACKED_PER_CALL)
    reference.ops = [CudaOrderNormOps(ops.attend_fn, rms_norm_cast_reference) for ops in reference.ops]
    expected = reference.decode(z)
    got = NativeVideoDecoder.from_vae(bf16_vae, windows_per_call=STACKED_PER_CALL, execution="fused").decode(z)
    assert_bitwise(got, expected, "fully fused")


@pytest.mark.parametrize("execution", ["reference", "fused"])
def test_a_call_makes_its_feed_forward_projection_one_tile_window_at_a_time(bf16_vae, execution, request):
    """`ff_in`'s output (8 D per token, a call's largest tensor) is made per tile-window: over a call of 2 stacked
    tile-windows, it is allocated at one tile-window's size (once per window and block) and never at the call's;
    the fused ops' kernels run in Triton's interpreter."""
    if execution == "fused":
        request.getfixturevalue("fused_ops")
    w = DecoderWeights.from_vae(bf16_vae)
    z = latents(STACKED_LATENTS, seed=6)
    decoder = NativeVideoDecoder.from_vae(bf16_vae, windows_per_call=STACKED_PER_CALL, execution=execution)
    plan = decoder.plan(z.shape)
    rows = plan.window_latents * plan.tile_height * plan.tile_width + w.register_tokens.shape[1] + 1
    one_window = rows * w.blocks[0].ff_in.shape[0] * w.blocks[0].ff_in.element_size()
    sizes = allocation_sizes(lambda: decoder.decode(z, lambda start, frames: None))
    assert sizes.count(one_window) >= len(plan.tile_windows()) * len(w.blocks)
    assert len(plan.tile_windows()) == STACKED_PER_CALL and 2 * one_window not in sizes


# -- on a GPU ------------------------------------------------------------------------------------------------------


def released_width_vae(dtype: torch.dtype):
    """`AutoencoderKLMiniMaxH3` with the released decoder (36 blocks, 2048 wide, 32 heads of 64) and random weights
    (norm weights near 1, the scales and register tokens nonzero), built on cuda:0 in `dtype` with the modules
    diffusers pins to fp32 (`_keep_in_fp32_modules`: the norms, the scales) kept in fp32, as its loader does."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    with torch.device("cuda:0"):
        vae = AutoencoderKLMiniMaxH3()
    with torch.no_grad():
        for name, p in vae.decoder.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif "scale" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.02)
        vae.to(dtype)
        for name, p in vae.named_parameters():
            if any(pinned in name.split(".") for pinned in AutoencoderKLMiniMaxH3._keep_in_fp32_modules):
                p.data = p.data.float()
    return vae.eval()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_decode_bitwise_on_a_gpu(dtype):
    """At the released decoder width on CUDA, every fused op on: the reference decode's pixels bit for bit at the
    released tiling (2 x 2 tiles of 256 px, 3 windows), default calls (8 tile-windows per call in bf16, 1 in fp32)."""
    vae = released_width_vae(dtype)
    assert vae.decoder.transformer_blocks[0].norm1.weight.dtype == torch.float32
    z = latents((1, vae.config.latent_channels, 17, 20, 24)).to("cuda:0")
    expected = NativeVideoDecoder.from_vae(vae).decode(z)
    got = NativeVideoDecoder.from_vae(vae, execution="fused").decode(z)
    assert_bitwise(got, expected, f"fused {dtype} released width")
    with torch.no_grad():  # and so diffusers' own decode (the native decode brings the frames to the host)
        assert_bitwise(got, vae.decode(z, return_dict=False)[0].cpu(), f"fused {dtype} against diffusers")
