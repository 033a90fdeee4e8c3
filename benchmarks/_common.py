"""Shared by the GPU benchmarks: full-width random H3 artifacts, real packed requests, timing and result files.

Benchmarks time blocks, not whole models: a full-width model with a few blocks is built once (random weights in the
released mixed precision, written in the diffusers layout, then prepared and compiled like real weights) and per-block
times come from CUDA events around the block loop, divided by the block count.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from vflash_core import Geometry, build_keyframe_bundle
from vflash_core.engine.bundle import ConditioningBundle
from vflash_core.engine.config import H3Config
from vflash_core.profiles import Profile
from vflash_core.weights import synthetic
from vflash_core.weights.compiler import compile_receipt, prepare

ROOT = Path(__file__).resolve().parent.parent
# VFLASH_RESULTS redirects result files (a long run on a device machine keeps them outside the synced tree).
RESULTS = Path(os.environ.get("VFLASH_RESULTS") or ROOT / "benchmarks" / "results")
TEXT_ROWS = 512
# (name, height, width) at 5 s (124 frames): N = 512 text + audio + video rows.
SHAPES = {"640x352": (352, 640), "960x544": (544, 960), "1344x768": (768, 1344)}
PROFILE = "t2va-base16-bf16-sm90"


def commit_id() -> str:
    """VFLASH_COMMIT when set (a device copy's own git metadata may lag the tree it was sent), else git's HEAD."""
    if os.environ.get("VFLASH_COMMIT"):
        return os.environ["VFLASH_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def environment() -> dict[str, object]:
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "commit": commit_id(),
    }


def gpu_tag(index: int = 0) -> str:
    """`h100`, `h200`, ... from the CUDA device name (`gpu` where it names no such model): result files' suffix."""
    import re

    found = re.search(r"\b([a-z]\d{2,3})\b", torch.cuda.get_device_name(index).lower())
    return found.group(1) if found else "gpu"


def write_result(name: str, data: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def full_width(num_layers: int) -> H3Config:
    return replace(H3Config.preset("h3"), num_layers=num_layers)


def compiled_model(
    cache: Path, num_layers: int, device: str = "cuda:0", profile: Profile | str = PROFILE, config: H3Config | None = None,
) -> tuple[Path, dict[str, Path]]:
    """(diffusers transformer folder, compiled paths) of a random model, full width unless `config` says otherwise,
    compiled for `profile` (default `PROFILE`); the weights are written once per cache folder, each profile's compile
    once beside them, so several profiles compile the same weights."""
    config = config or full_width(num_layers)
    root = cache / (f"h3-{num_layers}-blocks" if config == full_width(num_layers) else f"h3-{config.hidden_size}-wide-{num_layers}-blocks")
    profile_id = profile if isinstance(profile, str) else profile.id
    suffix = "" if profile_id == PROFILE else f"-{profile_id}"
    folder = root / "transformer"
    out = root / f"compiled{suffix}"
    if not out.exists():
        if not folder.exists():
            synthetic.write_diffusers_transformer(folder, config, synthetic.random_internal_weights(config, seed=0, device=device), max_shard_bytes=4 << 30)
        receipt = root / f"receipt{suffix}.json"
        if not receipt.exists():
            prepare(profile, folder, receipt)
        compile_receipt(receipt, out, device)
    return folder, {"artifact": out / "artifact", "schedule_overlay": out / "schedule", "auxiliary": out / "auxiliary.safetensors"}


def request(config: H3Config, shape: str, seconds: float = 5.0, seed: int = 0) -> ConditioningBundle:
    """A t2va request with the real packing rules: 512 text rows, the canvas `shape` ("WIDTHxHEIGHT"), `seconds` of clip."""
    width, height = (int(v) for v in shape.split("x"))
    frames = {5.0: 124, 10.0: 243, 15.0: 345}[seconds]
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(TEXT_ROWS, config.text_dim, generator=g).to(torch.bfloat16)
    return build_keyframe_bundle(embeds, torch.ones(TEXT_ROWS, dtype=torch.long), Geometry(height, width, frames), config, g)


def median_ms(fn: Callable[[], object], warmup: int = 2, repeat: int = 5) -> float:
    """Median wall time of `fn` on the current CUDA stream, measured with events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sustained_ms(fn: Callable[[], object], seconds: float = 1.0, warm_seconds: float = 1.0) -> float:
    """Median time of `fn` called back to back for about `seconds`, after `warm_seconds` of the same load.

    An H200 holds its 700 W cap by lowering the SM clock under sustained tensor-core load (measured 2026-11-30: 1980 MHz
    cool, 1400-1600 MHz after a second of GEMMs or attention), so a rate from a few calls on a cool GPU overstates what
    a block loop running for seconds can get by up to ~15 %. Rates for a roofline are measured in that steady state.
    """
    once = median_ms(fn, 1, 1)
    for _ in range(max(1, round(warm_seconds * 1e3 / once))):
        fn()
    events = []
    for _ in range(max(3, round(seconds * 1e3 / once))):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    events[-1][1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def gemm_tflops(n: int = 8192, sustained: bool = False) -> float:
    """Rate of an n^3 BF16 GEMM: a short burst (3 warm-ups, median of 10) or the sustained rate (`sustained_ms`)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = sustained_ms(lambda: a @ b) if sustained else median_ms(lambda: a @ b, 3, 10)
    return 2 * n**3 / ms / 1e9


def attention_tflops(attention: Callable, rows: int, heads: int = 56, head_dim: int = 128, sustained: bool = False) -> float:
    """Rate of `attention` alone on (1, rows, heads, head_dim): a short burst (2 warm-ups, median of 5) or sustained."""
    q, k, v = (torch.randn(1, rows, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = sustained_ms(lambda: attention(q, k, v)) if sustained else median_ms(lambda: attention(q, k, v), 2, 5)
    return attention_flops(rows, heads, head_dim) / ms / 1e9


def gpu_clocks() -> dict[str, object] | None:
    """SM clock, power draw and active clock-limit reasons from nvidia-smi, or None where it is missing."""
    fields = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sm, power, temp, reasons = (v.strip() for v in out.stdout.strip().split(","))
    return {"sm_mhz": int(sm), "power_w": float(power), "temperature_c": int(temp), "limit_reasons": reasons}


def attention_flops(rows: int, heads: int = 56, head_dim: int = 128) -> float:
    return 4.0 * rows * rows * heads * head_dim


def linear_flops_per_block(config: H3Config, rows: int) -> float:
    h, i, f = config.hidden_size, config.inner_dim, config.ffn_dim
    params = 3 * i * h + h * i + 2 * f * h + h * f
    return 2.0 * params * rows
