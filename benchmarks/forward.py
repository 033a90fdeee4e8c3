"""diffusers 0.42.1 vs the Vflash resident fast path, one process, the same full-width random weights, one H200.

    python benchmarks/forward.py [--blocks 4] [--rounds 3] [--cache /tmp/vflash-bench]

Both sides run one evaluation (step 1 of the t2va schedule, two distinct timesteps) of a full-width model with a
few blocks on packed 960x544 and 1344x768, 5 s requests with 512 text rows (N = 19,796 and 38,222). Per-block time is
the block loop's CUDA-event time divided by the block count (diffusers: hooks on its first and last block), median of
5 after 2 warm-ups.

The roofline is computed in the same run: linear FLOPs at the measured rate of an 8192^3 BF16 GEMM plus attention
FLOPs at the measured rate of the attention kernel Vflash uses, alone, on the same shape. Both rates are measured in
the GPU's sustained state, right after each Vflash timing (`_common.sustained_ms`: a second of the same call back to
back, then the median over another second), because the H200 holds its 700 W cap by lowering its clock under load
and the block loop runs in that state; `--rounds` repeats (Vflash timing, GEMM rate, attention rate) and every round
is recorded. For comparison `roofline_ratio_burst_rates` uses the earlier method's rates: the GEMM timed on the cool
GPU before anything else ran (3 warm-ups, median of 10) and the attention kernel for 2 warm-ups + 5 calls.

`bitwise_equal_to_diffusers` compares the final outputs with both sides on cuDNN attention (diffusers' default
pick on this GPU); `max_abs_diff` compares Vflash's default (FlashAttention-3 where available) with diffusers.

Writes benchmarks/results/forward_h200.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    PROFILE,
    attention_flops,
    attention_tflops,
    compiled_model,
    environment,
    full_width,
    gemm_tflops,
    gpu_clocks,
    linear_flops_per_block,
    request,
    write_result,
)

from vflash_core import get_profile
from vflash_core.engine import fused
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.attention import resolve_attention
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.fused import FusedOps
from vflash_core.engine.profiler import StageTimer
from vflash_core.engine.residency import ResidentBlocks

STEP = 1


class BlockLoopTimer:
    """CUDA events at the entry of a diffusers model's first block and the exit of its last."""

    def __init__(self, model: torch.nn.Module):
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        blocks = model.transformer_blocks
        blocks[0].register_forward_pre_hook(lambda *_: self.pairs.append((self._event(), None)))
        blocks[-1].register_forward_hook(lambda *_: self.pairs.__setitem__(-1, (self.pairs[-1][0], self._event())))

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def last_ms(self) -> float:
        start, end = self.pairs[-1]
        end.synchronize()
        return start.elapsed_time(end)


def vflash_denoiser(artifact: CompiledArtifact, attention_backend: str) -> tuple[str, Denoiser]:
    device = torch.device("cuda:0")
    name, attention = resolve_attention(attention_backend, device)
    return name, Denoiser(artifact, ResidentBlocks(artifact, device), device, FusedOps(artifact.config, attention))


def vflash_times(den: Denoiser, state) -> tuple[list[float], tuple[torch.Tensor, torch.Tensor]]:
    """Block-loop times (ms) of 5 evaluations of step STEP after 2 warm-ups, and the last evaluation's output."""
    times = []
    for i in range(7):
        timer = StageTimer(torch.device("cuda:0"), True)
        out = den.evaluate(state, STEP, timer)
        if i >= 2:
            times.append(timer.summary()["total_ms"]["blocks"])
    return times, out


def roofline_ms(config, rows: int, gemm_rate: float, attention_rate: float) -> float:
    """Per-block roofline: linear FLOPs at `gemm_rate` plus attention FLOPs at `attention_rate` (TFLOP/s)."""
    return linear_flops_per_block(config, rows) / (gemm_rate * 1e9) + attention_flops(rows) / (attention_rate * 1e9)


def run(blocks: int, cache: Path, shapes: list[str], rounds: int) -> dict[str, object]:
    import diffusers

    folder, paths = compiled_model(cache, blocks)
    config = full_width(blocks)
    artifact = CompiledArtifact(**paths)
    artifact.check_profile(get_profile(PROFILE))
    gemm_burst = gemm_tflops()
    print(f"bf16 GEMM 8192^3, short burst on the cool GPU: {gemm_burst:.0f} TFLOP/s {gpu_clocks()}")
    reference = diffusers.MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to("cuda").eval()
    loop_timer = BlockLoopTimer(reference)
    backend, fast = vflash_denoiser(artifact, "auto")
    _, cudnn = vflash_denoiser(artifact, "torch-cudnn")
    results = []
    for shape in shapes:
        bundle = request(config, shape)
        rows = bundle.layout.sequence_length
        lay = bundle.layout

        with torch.no_grad():
            state = fast.start_request(bundle)
            cudnn_state = cudnn.start_request(bundle)
            plan = state.plans[STEP]
            inputs = (
                state.video_rows[None], state.audio_rows[None], bundle.prompt_embeds[None].cuda(), plan.tables.timesteps, plan.timestep_indices,
                lay.token_tags.cuda(), lay.position_ids.cuda(), lay.video_indices.cuda(), lay.audio_indices.cuda(), lay.text_indices.cuda(),
            )

            diffusers_times = []
            for i in range(7):
                expected = reference(*inputs, return_dict=False)
                if i >= 2:
                    diffusers_times.append(loop_timer.last_ms())

            cudnn_times, cudnn_out = vflash_times(cudnn, cudnn_state)
            measured = []
            for _ in range(rounds):
                fast_times, fast_out = vflash_times(fast, state)
                clocks = gpu_clocks()
                gemm, attention = gemm_tflops(sustained=True), attention_tflops(fast.ops.attention, rows, sustained=True)
                v_ms = statistics.median(fast_times) / blocks
                measured.append({"vflash_ms_per_block": round(v_ms, 3), "gemm_tflops": round(gemm, 1), "attention_tflops": round(attention, 1),
                                 "roofline_ratio": round(v_ms / roofline_ms(config, rows, gemm, attention), 4), "gpu_after_vflash": clocks})
                print(measured[-1])
            attention_burst = attention_tflops(fast.ops.attention, rows)
            bitwise = all(torch.equal(a, b[0]) for a, b in zip(cudnn_out, expected))
            max_abs = max((a - b[0]).abs().max().item() for a, b in zip(fast_out, expected))
            cudnn_max_abs = max((a - b[0]).abs().max().item() for a, b in zip(cudnn_out, expected))
        d_ms = statistics.median(diffusers_times) / blocks
        v_ms = statistics.median(m["vflash_ms_per_block"] for m in measured)
        gemm = statistics.median(m["gemm_tflops"] for m in measured)
        attention = statistics.median(m["attention_tflops"] for m in measured)
        roofline = roofline_ms(config, rows, gemm, attention)
        row = {
            "name": shape,
            "N": rows,
            "blocks": blocks,
            "diffusers_ms_per_block": round(d_ms, 3),
            "vflash_ms_per_block": round(v_ms, 3),
            "vflash_cudnn_ms_per_block": round(statistics.median(cudnn_times) / blocks, 3),
            "speedup": round(d_ms / v_ms, 4),
            "roofline_ms_per_block": round(roofline, 3),
            "roofline_ratio": round(v_ms / roofline, 4),
            "roofline_ratio_max_over_rounds": max(m["roofline_ratio"] for m in measured),
            "attention_backend": backend,
            "attention_tflops": attention,
            "gemm_tflops": gemm,
            "rounds": measured,
            "gemm_tflops_burst": round(gemm_burst, 1),
            "attention_tflops_burst": round(attention_burst, 1),
            "roofline_ratio_burst_rates": round(v_ms / roofline_ms(config, rows, gemm_burst, attention_burst), 4),
            "bitwise_equal_to_diffusers": bitwise,
            "bitwise_compared_with": "torch-cudnn on both sides",
            "cudnn_max_abs_diff": cudnn_max_abs,
            "max_abs_diff": max_abs,
        }
        print({k: v for k, v in row.items() if k != "rounds"})
        results.append(row)
        del state, cudnn_state, inputs, expected, fast_out, cudnn_out
        gc.collect()
        torch.cuda.empty_cache()
    return {**environment(), "profile": PROFILE, "shapes": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--shapes", nargs="+", default=["960x544", "1344x768"])
    parser.add_argument("--rounds", type=int, default=3, help="(Vflash timing, sustained GEMM rate, sustained attention rate) repeats per shape")
    parser.add_argument("--fused-norm", choices=("on", "off"), help="override vflash_core.engine.fused.FUSED_NORM_MODULATE for this run")
    args = parser.parse_args()
    if args.fused_norm is not None:
        fused.FUSED_NORM_MODULATE = args.fused_norm == "on"
    data = run(args.blocks, args.cache, args.shapes, args.rounds)
    data["fused_norm_modulate"] = fused.FUSED_NORM_MODULATE
    write_result("forward_h200", data)


if __name__ == "__main__":
    main()
