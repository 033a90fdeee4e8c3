"""Time each Triton kernel of `vflash_kernels` against its torch-op reference at the released model's full width.

    python benchmarks/kernel_ops.py                       # N = 19,796 and 38,222 packed rows, writes the JSON below
    python benchmarks/kernel_ops.py --sizes 19796 --ops swiglu rope
    python benchmarks/kernel_ops.py --sweep-tiles         # also time TARGET_TILE_ELEMENTS in {2048, 4096, 8192}

Baseline provider: each kernel's torch reference in `vflash_core.engine.model` (what the reference path runs). Before timing, every
op checks that the kernel equals its reference bit for bit on the benchmark inputs and stops with an error if not;
the fused `qk_norm_rope` only reports its count of differing elements (it is exact only if the GPU reproduces torch's
RMSNorm reduction), and its `parity` field says so. Times are medians of `triton.testing.do_bench` (L2 flushed between
runs); GB/s counts the bytes each op must move at least (inputs read once, outputs written once).

Writes `benchmarks/results/kernels_h200.json`:
`{"gpu", "torch", "triton", "commit", "ops": [{"name", "N", "torch_ms", "triton_ms", "speedup", "gbps", ...}]}`; commit is
the environment variable VFLASH_COMMIT when set, else `git rev-parse HEAD` (`_common.commit_id`).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit_id

from vflash_core.engine import model as reference
from vflash_core.engine import parallel


def modulate_reference(normed, table, row_index, which="msa", out_dtype=None):
    y = reference.modulate(normed, table, row_index, which)
    return y if out_dtype is None else y.to(out_dtype)

ROOT = Path(__file__).resolve().parent.parent
H, HEADS, HEAD_DIM, ROTARY, FFN, EPS = 5376, 56, 128, 96, 14336, 1e-5
INNER = HEADS * HEAD_DIM
DEFAULT_SIZES = (19_796, 38_222)
BF16 = torch.bfloat16
MODULES = ("_launch", "modulate", "gated_residual", "rope", "swiglu", "relayout")
#: Ranks of the sequence-head relayouts: each rank packs / merges the rows of its share of N (rank 0: N / P rounded up).
RANKS = 2


def load_kernels() -> SimpleNamespace:
    """The `vflash_kernels` modules (installed with the package, like the `vflash_core` that `_common` imports)."""
    return SimpleNamespace(**{m: importlib.import_module(f"vflash_kernels.{m}") for m in MODULES})


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    return int((a != b).sum())


@dataclass
class Case:
    """One op at one N: the two providers, the bytes the op must move, and whether parity is required."""

    name: str
    reference: Callable[[], object]
    triton: Callable[[], object]
    bytes_moved: int
    exact_required: bool = True


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def build_cases(k: SimpleNamespace, n: int, g: torch.Generator, ops: set[str]) -> list[Case]:
    dev = "cuda"

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=dev) * scale).to(BF16)

    cases: list[Case] = []
    T = 2
    table = randn(T, 18 * H, scale=0.5).view(3 * T, 6 * H)  # the (T, 18H) AdaLN GEMM output viewed as (3T, 6H)
    idx = torch.randint(0, 3 * T, (n,), generator=g, device=dev)
    if "modulate" in ops:
        normed = randn(1, n, H)
        cases.append(Case(
            "modulate", lambda: modulate_reference(normed, table, idx, "msa"),
            lambda: k.modulate.modulate(normed, table, idx, "msa"), 2 * n * H * 2 + 2 * 3 * T * H * 2,
        ))
    if "norm_out" in ops:
        normed_out = randn(1, n, H)
        out_table = randn(T, 2 * H, scale=0.5)
        t_idx = torch.randint(0, T, (n,), generator=g, device=dev)
        cases.append(Case(
            "norm_out", lambda: modulate_reference(normed_out, out_table, t_idx, "out", torch.float32),
            lambda: k.modulate.modulate(normed_out, out_table, t_idx, "out", out_dtype=torch.float32), n * H * (2 + 4) + 2 * T * H * 2,
        ))
    if "gated_residual" in ops:
        x, y = randn(1, n, H, scale=4.0), randn(1, n, H)
        cases.append(Case(
            "gated_residual", lambda: reference.gated_residual(x, y, table, idx, "msa"),
            lambda: k.gated_residual.gated_residual(x, y, table, idx, "msa"), 3 * n * H * 2 + 3 * T * H * 2,
        ))
    if "swiglu" in ops:
        p = randn(1, n, 2 * FFN, scale=3.0)
        cases.append(Case("swiglu", lambda: reference.swiglu(p), lambda: k.swiglu.swiglu(p), n * 3 * FFN * 2))
    if ops & {"rope", "qk_norm_rope", "rms_norm+rope"}:
        qkv = randn(1, n, 3 * INNER, scale=2.0)
        wq, wk = randn(HEAD_DIM, scale=0.2) + 1, randn(HEAD_DIM, scale=0.2) + 1
        angles = torch.rand((n, ROTARY // 2), generator=g, device=dev) * 200.0
        freqs = torch.cat([angles, angles], -1)
        cos, sin = freqs.cos().to(BF16), freqs.sin().to(BF16)
        q_view, k_view, _ = (part.unflatten(-1, (HEADS, HEAD_DIM)) for part in qkv.split(INNER, dim=-1))
        angle_bytes = 2 * n * ROTARY * 2
        if "rope" in ops:
            q_n, k_n = F.rms_norm(q_view, (HEAD_DIM,), wq, EPS), F.rms_norm(k_view, (HEAD_DIM,), wk, EPS)
            cases.append(Case(
                "rope", lambda: reference.rope(q_n, k_n, cos, sin), lambda: k.rope.rope(q_n, k_n, cos, sin),
                4 * n * INNER * 2 + angle_bytes,
            ))
        norm_rope_bytes = 4 * n * INNER * 2 + angle_bytes  # q, k read from the QKV rows, q, k written
        qk_reference = lambda: reference.qk_norm_rope(qkv, wq, wk, EPS, cos, sin, head_dim=HEAD_DIM)[:2]
        if "rms_norm+rope" in ops:  # variant (a) in the model: torch's F.rms_norm, then the Triton rope
            cases.append(Case(
                "rms_norm+rope", qk_reference,
                lambda: k.rope.rope(F.rms_norm(q_view, (HEAD_DIM,), wq, EPS), F.rms_norm(k_view, (HEAD_DIM,), wk, EPS), cos, sin),
                norm_rope_bytes,
            ))
        if "qk_norm_rope" in ops:  # variant (b): fused, exact only where the reduction order matches
            cases.append(Case(
                "qk_norm_rope", qk_reference, lambda: k.rope.qk_norm_rope(qkv, wq, wk, EPS, cos, sin, head_dim=HEAD_DIM)[:2],
                norm_rope_bytes, exact_required=False,
            ))
    if ops & {"pack_heads", "pack_heads_v", "merge_heads"}:
        s_r = -(-n // RANKS)
        # One output buffer per provider (the ops write into a given `out`), so the parity check compares two results.
        send_ref, send = (torch.empty(RANKS, s_r, HEADS // RANKS, HEAD_DIM, dtype=BF16, device=dev) for _ in range(2))
        merged_ref, merged = (torch.empty(s_r, HEADS, HEAD_DIM, dtype=BF16, device=dev) for _ in range(2))
        relayout_bytes = 2 * s_r * INNER * 2  # every element read once and written once
        if "pack_heads" in ops:  # q / k: the contiguous rope output
            q_rows = randn(s_r, HEADS, HEAD_DIM)
            cases.append(Case(
                "pack_heads", lambda: parallel.pack_heads_reference(q_rows, send_ref), lambda: k.relayout.pack_heads(q_rows, send), relayout_bytes,
            ))
        if "pack_heads_v" in ops:  # v: a view into the fused QKV GEMM output (row stride 3I)
            v_rows = randn(s_r, 3 * INNER)[:, 2 * INNER :].unflatten(-1, (HEADS, HEAD_DIM))
            cases.append(Case(
                "pack_heads_v", lambda: parallel.pack_heads_reference(v_rows, send_ref), lambda: k.relayout.pack_heads(v_rows, send), relayout_bytes,
            ))
        if "merge_heads" in ops:
            received = randn(RANKS, s_r, HEADS // RANKS, HEAD_DIM)
            cases.append(Case(
                "merge_heads", lambda: parallel.merge_heads_reference(received, merged_ref), lambda: k.relayout.merge_heads(received, merged),
                relayout_bytes,
            ))
    return cases


def run_case(case: Case, n: int, warmup: int, rep: int, do_bench) -> dict:
    expected, got = _outputs(case.reference()), _outputs(case.triton())
    differing = sum(mismatches(a, b) for a, b in zip(got, expected))
    total = sum(t.numel() for t in expected)
    del expected, got
    if differing and case.exact_required:
        raise SystemExit(f"PARITY FAILURE: {case.name} N={n}: {differing}/{total} elements differ from the torch reference")
    torch_ms = do_bench(case.reference, warmup=warmup, rep=rep, return_mode="median")
    triton_ms = do_bench(case.triton, warmup=warmup, rep=rep, return_mode="median")
    return {
        "name": case.name,
        "N": n,
        "torch_ms": round(torch_ms, 5),
        "triton_ms": round(triton_ms, 5),
        "speedup": round(torch_ms / triton_ms, 3),
        "gbps": round(case.bytes_moved / (triton_ms * 1e-3) / 1e9, 1),
        "torch_gbps": round(case.bytes_moved / (torch_ms * 1e-3) / 1e9, 1),
        "bytes": case.bytes_moved,
        "parity": "bitwise" if not differing else f"{differing}/{total} differ",
    }


def main(argv: list[str] | None = None) -> int:
    all_ops = ["modulate", "norm_out", "gated_residual", "swiglu", "rope", "rms_norm+rope", "qk_norm_rope", "pack_heads", "pack_heads_v", "merge_heads"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="packed row counts N")
    parser.add_argument("--ops", nargs="+", default=all_ops, choices=all_ops)
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "kernels_h200.json")
    parser.add_argument("--sweep-tiles", action="store_true", help="also time each kernel at tile sizes 1024..8192 elements")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("benchmarks/kernel_ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    k = load_kernels()
    if k._launch.INTERPRET:
        print("TRITON_INTERPRET is set: unset it to time compiled kernels", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    print(f"{gpu} | torch {torch.__version__} | triton {triton.__version__}")
    results, sweep = [], []
    for n in args.sizes:
        g = torch.Generator(device="cuda").manual_seed(n)
        for case in build_cases(k, n, g, set(args.ops)):
            row = run_case(case, n, args.warmup, args.rep, do_bench)
            results.append(row)
            print(f"{row['name']:>15} N={n:>6}  torch {row['torch_ms']:8.4f} ms  triton {row['triton_ms']:8.4f} ms  "
                  f"x{row['speedup']:5.2f}  {row['gbps']:7.1f} GB/s (torch {row['torch_gbps']:7.1f})  {row['parity']}", flush=True)
            if args.sweep_tiles:  # the tile-size constants: the package default and the fused QK-norm's own
                defaults = k._launch.TARGET_TILE_ELEMENTS, k.rope.QK_NORM_TILE_ELEMENTS
                try:
                    for elements in (1024, 2048, 4096, 8192):
                        k._launch.TARGET_TILE_ELEMENTS = k.rope.QK_NORM_TILE_ELEMENTS = elements
                        ms = do_bench(case.triton, warmup=args.warmup, rep=args.rep, return_mode="median")
                        sweep.append({"name": case.name, "N": n, "tile_elements": elements, "triton_ms": round(ms, 5)})
                        print(f"{'':>15} tile {elements:5d}: {ms:8.4f} ms", flush=True)
                finally:
                    k._launch.TARGET_TILE_ELEMENTS, k.rope.QK_NORM_TILE_ELEMENTS = defaults
            del case
        gc.collect()
        torch.cuda.empty_cache()

    report = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "commit": commit_id(), "ops": results}
    if sweep:
        report["tile_sweep"] = sweep
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
