"""Exact BF16 blocks vs the approximate FP8 executions, one process, the same full-width random weights, one H200.

    python benchmarks/fp8.py [--blocks 4] [--cache /tmp/vflash-bench] [--shapes 960x544 1344x768] [--rounds 3]
    python benchmarks/fp8.py --small        # dry run on the CPU: a narrow model, weight-only FP8, no FP8 attention

Weights: the full-width random model of `_common.compiled_model` (5376 hidden, 56 x 128 heads, 14336 FFN, a few
blocks, released mixed precision), compiled twice from the same folder: for `t2va-base16-bf16-sm90` and for
`t2va-base16-fp8-sm90` (the four block linears as E4M3 codes with FP32 row scales), both at 4 evaluations of their
schedule (benchmark-only ids `bench-...-base4-...`, so a whole trajectory is 4 evaluations).

Executions, each the block loop of the session that would run it:

* `exact`: `FusedOps` with FlashAttention-3 (`fa3`), the exact profiles' fast path;
* `fp8_linear`: `FusedRowFP8Ops`, w8a8 through `torch._scaled_mm` with row-wise scales, activations quantized by the
  Triton kernels that produce them, FA3 attention (the FP8 profiles' default);
* `fp8_linear_attention`: the same with the approximate `fa3-fp8` attention (fa3-fwd's SM90 E4M3 forward);
* `fp8_attention`: exact linears (`FusedOps`) with `fa3-fp8`, FP8 attention measured on its own;
* `fp8_scaled_linear`: `fp8_linear`'s execution over the FP8 artifact compiled straight from a Comfy-Org fp8_scaled
  single file of the same weights (each linear's E4M3 codes with one per-tensor scale, `amax / 448`, as ComfyUI's
  files have them; the artifact keeps the file's codes, the scale repeated per row): what a user's fp8_scaled file
  runs, its error against the exact BF16 path reported like the others'.

Time: per canvas (5 s, 512 text rows; N = 19,796 and 38,222), one evaluation (step 1: two distinct timesteps); per
round the executions run one after the other, each after a second of its evaluations back to back (the H200's
sustained clock, as `_common.sustained_ms` explains), then 5 evaluations' block-loop CUDA-event time; per-block ms =
median / blocks, then the median over --rounds. `speedup_fp8_linear` = exact / fp8_linear,
`speedup_fp8_linear_attention` = exact / fp8_linear_attention.

Error, on the same model and request from the same initial latents: the exact 4-evaluation trajectory, and at each of
its evaluations every FP8 execution's velocity on the exact trajectory's inputs (each evaluation's own error) against
the exact velocity: `velocity_rel_l2` = ||v - v_exact|| / ||v_exact|| and `velocity_max_abs`, video and audio rows.
Then every FP8 execution's own whole trajectory: `latent_psnr_db` = 10 log10(R^2 / MSE) of its final video latents
against the exact final latents, R = max - min of the exact latents (`audio_latent_psnr_db` likewise).

Weights: device bytes of one resident block, exact and FP8 (`weights_device_bytes_per_block`, `fp8_block_fraction`),
and of the 50-block model with its BF16 auxiliary tensors (patch projections, text refiner, heads) as the session holds
them (`model_device_bytes`, `fp8_weight_fraction`).

Targets, reported and not asserted: speedup_fp8_linear >= 1.25 at 960x544; speedup_fp8_linear_attention >= 1.5 at
1344x768; the 50-block model's weights on the device <= 55 % of BF16. Where `fa3-fp8` is refused (no SM90, a build without FP8 kernels), the
FP8-attention executions are left out and the refusal is recorded.

Writes benchmarks/results/fp8_h200.json (--small: fp8_small_cpu.json).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compiled_model, environment, full_width, gpu_clocks, request, write_result

from vflash_core.engine import fp8
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.attention import resolve_attention
from vflash_core.engine.config import H3Config
from vflash_core.engine.denoise import Denoiser, RequestState
from vflash_core.engine.fused import FusedOps
from vflash_core.engine.model import BlockOps
from vflash_core.engine.profiler import StageTimer
from vflash_core.engine.residency import ResidentBlocks
from vflash_core.errors import VflashError
from vflash_core.profiles import Profile, get_profile
from vflash_core.weights import synthetic
from vflash_core.weights.compiler import compile_receipt, prepare

STEP = 1
EVALUATIONS = 4
MODEL_BLOCKS = 50
TARGETS = {"speedup_fp8_linear": ("960x544", 1.25), "speedup_fp8_linear_attention": ("1344x768", 1.5), "fp8_weight_fraction": (None, 0.55)}


def bench_profiles(small: bool) -> tuple[Profile, Profile]:
    """The exact and FP8 profiles' schedules at 4 evaluations (benchmark-only ids)."""
    if small:
        return get_profile("t2va-base4-exact-cpu"), get_profile("t2va-base4-fp8-cpu")
    exact, approximate = get_profile("t2va-base16-bf16-sm90"), get_profile("t2va-base16-fp8-sm90")
    return replace(exact, id="bench-t2va-base4-bf16-sm90", nfe=EVALUATIONS), replace(approximate, id="bench-t2va-base4-fp8-sm90", nfe=EVALUATIONS)


def small_config(blocks: int) -> H3Config:
    """Released head width and rotary, narrow elsewhere: a CPU runs it in seconds."""
    return replace(H3Config.preset("h3"), num_layers=blocks, num_attention_heads=4, hidden_size=512, ffn_dim=1024, text_dim=64, time_embed_hidden_dim=512, time_embed_dim=64)


def fp8_scaled_model(cache: Path, config: H3Config, profile: Profile, device: torch.device) -> dict[str, Path]:
    """Compiled paths of `profile` from a Comfy-Org fp8_scaled single file of `compiled_model`'s weights (the same
    seed), written and compiled once per cache folder."""
    root = cache / f"h3-{config.hidden_size}-wide-{config.num_layers}-blocks-fp8-scaled"
    source, out, receipt = root / "h3_fp8_scaled.safetensors", root / "compiled", root / "receipt.json"
    if not out.exists():
        if not source.exists():
            root.mkdir(parents=True, exist_ok=True)
            weights = synthetic.random_internal_weights(config, seed=0, device=str(device))
            synthetic.write_comfy_transformer(source, config, {k: v.cpu() for k, v in weights.items()}, fp8="metadata")
            del weights
        if not receipt.exists():
            prepare(profile, source, receipt)
        compile_receipt(receipt, out, str(device))
    return {"artifact": out / "artifact", "schedule_overlay": out / "schedule", "auxiliary": out / "auxiliary.safetensors"}


def executions(
    exact: CompiledArtifact, approximate: CompiledArtifact, scaled: CompiledArtifact, device: torch.device,
) -> tuple[dict[str, Denoiser], dict[str, str]]:
    """name -> denoiser over resident blocks (the FP8 ones share one copy per artifact), and the FP8 attention's
    refusal if any."""
    config = exact.config
    cuda = device.type == "cuda"
    exact_blocks, fp8_blocks = ResidentBlocks(exact, device), ResidentBlocks(approximate, device)
    attention = resolve_attention("fa3" if cuda else "auto", device)[1]
    # The CPU dry run: weight-only (w8a8 is refused off SM90), the reference elementwise ops (the kernels need CUDA).
    mode, quantizer = ("w8a8", "triton") if cuda else ("weight-only", "torch")

    def fp8_ops(attend):
        matmul = fp8.RowFP8Matmul(mode, quantizer)
        return fp8.FusedRowFP8Ops(config, attend, matmul, keep_values=False) if cuda else fp8.RowFP8Ops(config, attend, matmul)

    exact_ops = FusedOps if cuda else BlockOps
    dens = {
        "exact": Denoiser(exact, exact_blocks, device, exact_ops(config, attention)),
        "fp8_linear": Denoiser(approximate, fp8_blocks, device, fp8_ops(attention)),
        "fp8_scaled_linear": Denoiser(scaled, ResidentBlocks(scaled, device), device, fp8_ops(attention)),
    }
    skipped = {}
    try:
        fp8_attention = resolve_attention("fa3-fp8", device, approximate_allowed=True)[1]
    except VflashError as exc:
        skipped["fa3-fp8"] = str(exc)
    else:
        dens["fp8_linear_attention"] = Denoiser(approximate, fp8_blocks, device, fp8_ops(fp8_attention))
        dens["fp8_attention"] = Denoiser(exact, exact_blocks, device, exact_ops(config, fp8_attention))
    return dens, skipped


def block_ms(den: Denoiser, state: RequestState, blocks: int, warm_seconds: float) -> float:
    """Median block-loop ms of 5 evaluations of step STEP, per block, after `warm_seconds` of them back to back."""
    start = time.perf_counter()
    while time.perf_counter() - start < warm_seconds:
        den.evaluate(state, STEP)
        if den.device.type == "cuda":
            torch.cuda.synchronize(den.device)
    times = []
    for _ in range(5):
        timer = StageTimer(den.device, True)
        den.evaluate(state, STEP, timer)
        times.append(timer.summary()["total_ms"]["blocks"])
    return statistics.median(times) / blocks


def _errors(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, a, b in (("video", got[0], expected[0]), ("audio", got[1], expected[1])):
        a, b = a.double(), b.double()
        out[f"{name}_velocity_rel_l2"] = round(((a - b).norm() / b.norm()).item(), 6)
        out[f"{name}_velocity_max_abs"] = round((a - b).abs().max().item(), 6)
    return out


def psnr_db(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected, got = expected.double(), got.double()
    mse = ((got - expected) ** 2).mean().item()
    span = (expected.max() - expected.min()).item()
    return round(10 * math.log10(span**2 / mse), 3) if mse > 0 else math.inf


def trajectory_errors(dens: dict[str, Denoiser], bundle) -> dict[str, object]:
    """Per evaluation errors on the exact trajectory's inputs, and each FP8 trajectory's final-latent PSNR."""
    exact = dens["exact"]
    lay = bundle.layout
    state = exact.start_request(bundle)
    per_evaluation: dict[str, list[dict[str, float]]] = {name: [] for name in dens if name != "exact"}
    for step in range(exact.nfe):
        expected = exact.evaluate(state, step)
        for name, evaluations in per_evaluation.items():
            # The exact state's inputs: its latents, text rows, rotary and the (equal) overlay tables.
            evaluations.append({"evaluation": step, **_errors(dens[name].evaluate(state, step), expected)})
        exact.update(state, step, *expected, lay.num_condition_video_rows, lay.num_condition_audio_rows)
    final = exact.finish(bundle, state.video_rows, state.audio_rows)
    out: dict[str, object] = {}
    for name, evaluations in per_evaluation.items():
        own = dens[name].run(bundle, StageTimer(exact.device, False))
        out[name] = {
            "per_evaluation": evaluations,
            "latent_psnr_db": psnr_db(own.video_latents, final.video_latents),
            "audio_latent_psnr_db": psnr_db(own.audio_latents, final.audio_latents),
        }
    return out


def run(blocks: int, cache: Path, shapes: list[str], rounds: int, small: bool) -> dict[str, object]:
    device = torch.device("cpu" if small else "cuda:0")
    config = small_config(blocks) if small else full_width(blocks)
    exact_profile, fp8_profile = bench_profiles(small)
    artifacts = [CompiledArtifact(**compiled_model(cache, blocks, str(device), profile, config)[1]) for profile in (exact_profile, fp8_profile)]
    artifacts.append(CompiledArtifact(**fp8_scaled_model(cache, config, fp8_profile, device)))
    dens, skipped = executions(*artifacts, device)
    block_bytes = {"exact": dens["exact"].blocks.device_weight_bytes // blocks, "fp8": dens["fp8_linear"].blocks.device_weight_bytes // blocks}
    den = dens["exact"]
    aux_bytes = sum(t.nbytes for t in den.aux.values()) + sum(t.nbytes for w in den.refiner for t in w.tensors.values())
    model_bytes = {k: v * MODEL_BLOCKS + aux_bytes for k, v in block_bytes.items()}
    warm = 0.0 if small else 1.0
    records = []
    for shape in shapes:
        bundle = request(config, shape)
        state = dens["exact"].start_request(bundle)
        measured = []
        for _ in range(rounds):
            measured.append({name: round(block_ms(den, state, blocks, warm), 3) for name, den in dens.items()})
            measured[-1]["gpu_after"] = gpu_clocks() if not small else None
            print(shape, measured[-1])
        ms = {name: statistics.median(m[name] for m in measured) for name in dens}
        record: dict[str, object] = {
            "canvas": shape,
            "N": bundle.layout.sequence_length,
            "blocks": blocks,
            "ms_per_block": ms,
            "speedup_fp8_linear": round(ms["exact"] / ms["fp8_linear"], 4),
            "speedup_fp8_linear_attention": round(ms["exact"] / ms["fp8_linear_attention"], 4) if "fp8_linear_attention" in ms else None,
            "speedup_fp8_attention": round(ms["exact"] / ms["fp8_attention"], 4) if "fp8_attention" in ms else None,
            "speedup_fp8_scaled_linear": round(ms["exact"] / ms["fp8_scaled_linear"], 4),
            "rounds": measured,
        }
        del state
        record["error"] = trajectory_errors(dens, bundle)
        print({k: v for k, v in record.items() if k != "rounds"})
        records.append(record)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fraction = model_bytes["fp8"] / model_bytes["exact"]
    by_canvas = {r["canvas"]: r for r in records}
    targets = {}
    for key, (canvas, bound) in TARGETS.items():
        if key == "fp8_weight_fraction":
            targets[key] = {"bound": f"<= {bound}", "value": round(fraction, 4), "met": fraction <= bound}
        elif canvas in by_canvas and by_canvas[canvas][key] is not None:
            targets[key] = {"canvas": canvas, "bound": f">= {bound}", "value": by_canvas[canvas][key], "met": by_canvas[canvas][key] >= bound}
    return {
        **environment(),
        "profiles": {"exact": exact_profile.id, "fp8": fp8_profile.id},
        "fp8_execution": repr(dens["fp8_linear"].ops.fp8),
        "fp8_scaled_source": {"format": artifacts[2].base_weights["format"], "fp8": artifacts[2].manifest["fp8"]},
        "attention": {"exact": "fa3" if not small else "torch-sdpa", "fp8": "fa3-fp8", "skipped": skipped},
        "step": STEP,
        "evaluations": EVALUATIONS if not small else exact_profile.nfe,
        "weights_device_bytes_per_block": block_bytes,
        "fp8_block_fraction": round(block_bytes["fp8"] / block_bytes["exact"], 4),
        "model_device_bytes": model_bytes,
        "fp8_weight_fraction": round(fraction, 4),
        "records": records,
        "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--shapes", nargs="+", default=["960x544", "1344x768"])
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per canvas (each: every execution after its warm-up)")
    parser.add_argument("--small", action="store_true", help="dry run on the CPU: a narrow 2-block model at 320x192, weight-only FP8")
    args = parser.parse_args()
    if args.small:
        blocks, shapes, rounds = 2, ["320x192"], 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --small)")
        blocks, shapes, rounds = args.blocks, args.shapes, args.rounds
    data = run(blocks, args.cache, shapes, rounds, args.small)
    data["small"] = args.small
    write_result("fp8_small_cpu" if args.small else "fp8_h200", data)


if __name__ == "__main__":
    main()
