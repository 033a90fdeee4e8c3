"""Ahead-of-time compilation of every kernel of this package for CUDA targets, at the released model's launch settings.

    python -m vflash_kernels.aot                       # sm80 sm86 sm89 sm90 sm100 sm103 sm120 sm121, S = 19,796
    python -m vflash_kernels.aot --capabilities 120 --rows 38222

No GPU is needed: Triton lowers a kernel through TTIR, TTGIR, LLVM IR and PTX to a cubin with the `ptxas` it ships.
What is compiled is what the engine launches: `capture_launches` runs every launcher, as the fused block and the
sequence-head relayout call them, on tensors of H3's full-width shapes (`h3_launches`), with Triton's
`jit_cache_hook` taking each launch's signature, specialisation (alignment attributes), constexprs and options
instead of compiling or running it. `compile_for` then compiles each of them with `triton.compile` for
`GPUTarget("cuda", capability, 32)`.

On the CPU the capture stands in a driver that names a target (`_CaptureDriver`, the few calls `JITFunction.run`
makes before its hook) and lets the launchers take CPU tensors; every shape, stride and dtype is the real one, and
CPU and CUDA allocations are both 16-byte aligned, so the captured launches are the ones a GPU run captures (the GPU
test compares the two).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import _launch

#: The compute capabilities of the GPU families Vflash has profiles for (`vflash_core.formats.ARCH_FAMILIES`).
CAPABILITIES = (80, 86, 89, 90, 100, 103, 120, 121)
#: Packed rows of a 5 s 960x544 t2va request at full width (video and audio tokens).
H3_ROWS = 19_796
#: The main blocks' AdaLN table layout, as the engine passes it to the kernels from the model's `MODULATION_BLOCKS`
#: (`vflash_core.engine.model`; the AOT test checks the two agree): the (shift, scale, gate) block of each sublayer in
#: a row of `H3_ADALN_TABLE_BLOCKS` H-wide blocks.
H3_ADALN_BLOCKS = {"msa": (0, 1, 2), "mlp": (3, 4, 5)}
H3_ADALN_TABLE_BLOCKS = 6


@dataclass(frozen=True)
class Launch:
    """One launch of a kernel as its launcher makes it: what `triton.compile` needs to build it for any target."""

    kernel: triton.runtime.JITFunction
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], object], ...]
    attrs: tuple[tuple[tuple[int, ...], tuple], ...]
    num_warps: int
    num_stages: int
    num_ctas: int
    enable_fp_fusion: bool

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def source(self) -> ASTSource:
        return ASTSource(self.kernel, dict(self.signature), dict(self.constexprs), {k: list(v) for k, v in self.attrs})

    def options(self) -> dict[str, object]:
        return {
            "num_warps": self.num_warps, "num_stages": self.num_stages, "num_ctas": self.num_ctas,
            "enable_fp_fusion": self.enable_fp_fusion
        }


class _CaptureDriver:
    """What `JITFunction.run` asks of Triton's driver before it calls `jit_cache_hook`: a device key (its own, so no
    real device's binder cache is touched), a stream and the target."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> str:
        return "vflash-aot-capture"

    def get_current_stream(self, device: object = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextlib.contextmanager
def _capturing(launches: list[Launch], on_cpu: bool) -> Iterator[None]:
    """Within: every kernel launch is recorded in `launches` and skipped (neither compiled nor run). `on_cpu`: with
    the stand-in driver, and the launchers' device check accepting CPU tensors."""

    def hook(*, fn, compile, **_: object) -> bool:
        (attrs,) = compile["configs"]
        launches.append(Launch(
            fn.jit_function, tuple(compile["signature"].items()), tuple(sorted(compile["constants"].items())),
            tuple(sorted((k, tuple(tuple(a) for a in v)) for k, v in attrs.items())),
            compile["num_warps"], compile["num_stages"], compile["num_ctas"], compile["enable_fp_fusion"],
        ))
        return True  # skip: nothing is compiled or launched

    drivers = triton.runtime.driver
    # The driver slot as it was (None until first used): `reset_active` would create the default driver, which fails
    # on a machine without a GPU.
    saved_hook, saved_check, saved_driver = triton.knobs.runtime.jit_cache_hook, _launch.check_device, drivers._active
    triton.knobs.runtime.jit_cache_hook = hook
    if on_cpu:
        drivers.set_active(_CaptureDriver(GPUTarget("cuda", 90, 32)))
        _launch.check_device = lambda *tensors: None  # the capture reads shapes and strides only
    try:
        yield
    finally:
        triton.knobs.runtime.jit_cache_hook = saved_hook
        _launch.check_device = saved_check
        drivers._active = saved_driver


def h3_launches(device: torch.device | str, rows: int = H3_ROWS) -> list[tuple[str, Callable[[], object]]]:
    """(label, call) of every launcher as the engine calls it at H3's full width (`vflash_core.engine.fused`,
    `fp8.FusedRowFP8Ops`, `parallel.SequenceHeadAttention` with two ranks), on uninitialised tensors of `rows` packed
    rows. Both AdaLN blocks ("msa", "mlp") and the unfused fallbacks (`modulate`, `rope`) are included."""
    from . import fp8_quantize, gated_residual, modulate, relayout, rms_norm_modulate, rope, swiglu

    h, heads, head_dim, ffn, rotary, eps = 5376, 56, 128, 14336, 96, 1e-5
    inner = heads * head_dim
    bf16 = torch.bfloat16

    def empty(*shape: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    table = empty(2, 18 * h).view(6, 6 * h)  # the (T, 18H) AdaLN GEMM output viewed as (3T, 6H)
    index = torch.zeros(rows, dtype=torch.int64, device=device)
    x, y, norm_weight = empty(1, rows, h), empty(1, rows, h), empty(h)
    qkv, p, attn_out = empty(1, rows, 3 * inner), empty(1, rows, 2 * ffn), empty(1, rows, inner)
    norm_q, norm_k, cos, sin = empty(head_dim), empty(head_dim), empty(rows, rotary), empty(rows, rotary)
    q, k, _ = (part.unflatten(-1, (heads, head_dim)) for part in qkv.split(inner, dim=-1))
    shard_rows = -(-rows // 2)
    send, merged = empty(2, shard_rows, heads // 2, head_dim), empty(shard_rows, heads, head_dim)
    q_rows = empty(shard_rows, heads, head_dim)  # q / k: the contiguous rotary output
    v_view = empty(shard_rows, 3 * inner)[:, 2 * inner :].unflatten(-1, (heads, head_dim))  # v: inside the QKV rows
    calls: list[tuple[str, Callable[[], object]]] = []
    for which, (shift, scale, gate) in H3_ADALN_BLOCKS.items():
        blocks = H3_ADALN_TABLE_BLOCKS
        calls += [
            (
                f"rms_norm_modulate {which}",
                partial(
                    rms_norm_modulate.rms_norm_modulate, x, norm_weight, eps, table, index, shift_block=shift,
                    scale_block=scale, table_blocks=blocks
                ),
            ),
            (
                f"modulate {which}",
                partial(modulate.modulate, x, table, index, shift_block=shift, scale_block=scale, table_blocks=blocks),
            ),
            (
                f"gated_residual {which}",
                partial(
                    gated_residual.gated_residual, x, y, table, index, gate_block=gate, table_blocks=blocks,
                    inplace=True
                ),
            ),
        ]
        for keep in (False, True):
            calls.append((
                f"rms_norm_modulate_quantize {which} keep_value={keep}",
                partial(
                    fp8_quantize.rms_norm_modulate_quantize, x, norm_weight, eps, table, index, shift_block=shift,
                    scale_block=scale, table_blocks=blocks, keep_value=keep
                ),
            ))
    calls += [
        ("qk_norm_rope", lambda: rope.qk_norm_rope(qkv, norm_q, norm_k, eps, cos, sin, head_dim=head_dim)),
        ("rope", lambda: rope.rope(q, k, cos, sin)),
        ("swiglu", lambda: swiglu.swiglu(p)),
        ("quantize_rows", lambda: fp8_quantize.quantize_rows(attn_out)),
        ("swiglu_quantize keep_value=False", lambda: fp8_quantize.swiglu_quantize(p, keep_value=False)),
        ("swiglu_quantize keep_value=True", lambda: fp8_quantize.swiglu_quantize(p, keep_value=True)),
        ("pack_heads q", lambda: relayout.pack_heads(q_rows, send)),
        ("pack_heads v", lambda: relayout.pack_heads(v_view, send)),
        ("merge_heads", lambda: relayout.merge_heads(send, merged)),
    ]
    return calls


def capture_launches(device: torch.device | str = "cpu", rows: int = H3_ROWS) -> list[Launch]:
    """The distinct launches of `h3_launches` (in first-seen order), captured without compiling or running any."""
    if _launch.INTERPRET:
        raise RuntimeError(
            "the kernels were decorated for Triton's interpreter (TRITON_INTERPRET=1): nothing to compile"
        )
    launches: list[Launch] = []
    with _capturing(launches, torch.device(device).type == "cpu"):
        for _, call in h3_launches(device, rows):
            call()
    return list(dict.fromkeys(launches))


def compile_for(launch: Launch, capability: int) -> triton.compiler.CompiledKernel:
    """`launch` compiled to a cubin for CUDA compute capability `capability` (e.g. 120), without a GPU."""
    return triton.compile(launch.source(), target=GPUTarget("cuda", capability, 32), options=launch.options())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vflash_kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capabilities", type=int, nargs="+", default=list(CAPABILITIES), help="e.g. 89 120")
    parser.add_argument("--rows", type=int, default=H3_ROWS, help="packed rows of the launches")
    args = parser.parse_args(argv)
    launches = capture_launches("cpu", args.rows)
    for capability in args.capabilities:
        for launch in launches:
            kernel = compile_for(launch, capability)
            print(
                f"sm{capability} {launch.name}: {len(kernel.asm['cubin'])} "
                f"bytes of cubin, {kernel.metadata.num_warps} warps"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
