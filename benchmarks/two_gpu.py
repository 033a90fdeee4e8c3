"""One GPU vs sequence-head over several GPUs of one host, the same full-width compiled blocks, one process.

    python benchmarks/two_gpu.py [--gpus 2] [--blocks 4] [--cache /tmp/vflash-bench]

Whole fixed-schedule trajectories (16 evaluations) through `NativeEngineSession` with the denoise profiler on: the
per-block time is the median over evaluations 2..16 of the block loop's CUDA-event time on rank 0 (which includes
waiting for the peers' collectives) divided by the block count. Parity: the final latents of the group against the
single GPU (max abs difference and a PSNR over the latents' range). `two_workers_throughput_ratio`: the wall time of
sequence-head serving two requests in turn over that of two independent single-GPU workers serving one each at the
same time (above 1: latency mode costs fleet throughput).

Writes benchmarks/results/two_gpu_<P>xh200.json (two_gpu_2xh200.json by default; multi_gpu.py sweeps GPU counts).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROFILE, compiled_model, environment, full_width, request, write_result

from vflash_core import NativeEngineSession
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions


def per_block_ms(result, blocks: int) -> float:
    profile = result.denoise_profile
    ranks = profile.get("ranks", [profile])
    loops = [e["blocks"] for e in ranks[0]["evaluations"][1:]]
    return statistics.median(loops) / blocks


def psnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    mse = (actual.double() - expected.double()).pow(2).mean().item()
    span = (expected.max() - expected.min()).item()
    return math.inf if mse == 0 else 10 * math.log10(span * span / mse)


def link_type() -> str:
    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or out.stderr.strip()


def run(gpus: int, blocks: int, cache: Path, shapes: list[str]) -> dict[str, object]:
    _, paths = compiled_model(cache, blocks)
    config = full_width(blocks)
    single = NativeEngineSession(PROFILE, CompiledPaths(**paths), EngineOptions(device="cuda:0", weight_residency="resident"))
    group = NativeEngineSession(PROFILE, CompiledPaths(**paths), EngineOptions(device="cuda:0", peer_device=list(range(1, gpus)), strategy="sequence-head", weight_residency="resident"))
    second_worker = NativeEngineSession(PROFILE, CompiledPaths(**paths), EngineOptions(device="cuda:1", weight_residency="resident"))
    tensor = NativeEngineSession(PROFILE, CompiledPaths(**paths), EngineOptions(device="cuda:0", peer_device=list(range(1, gpus)), strategy="tensor", weight_residency="resident"))
    rows = []
    for shape in shapes:
        bundle = request(config, shape)
        group.generate(bundle)  # warm-up (kernel autotuning, communicator buffers)
        single.generate(bundle)
        base = single.generate(bundle, profile_denoise=True)
        split = group.generate(bundle, profile_denoise=True)
        single_ms, group_ms = per_block_ms(base, blocks), per_block_ms(split, blocks)
        tensor.generate(bundle)
        sharded = tensor.generate(bundle, profile_denoise=True)
        tensor_ms = per_block_ms(sharded, blocks)

        start = time.perf_counter()
        group.generate(bundle)
        group.generate(bundle)
        latency_mode = time.perf_counter() - start
        start = time.perf_counter()
        workers = [threading.Thread(target=s.generate, args=(bundle,)) for s in (single, second_worker)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        throughput_mode = time.perf_counter() - start

        diff = max((a - b).abs().max().item() for a, b in ((split.video_latents, base.video_latents), (split.audio_latents, base.audio_latents)))
        row = {
            "name": shape,
            "N": bundle.layout.sequence_length,
            "blocks": blocks,
            "gpus": gpus,
            "single_ms_per_block": round(single_ms, 3),
            "sequence_head_ms_per_block": round(group_ms, 3),
            "speedup": round(single_ms / group_ms, 4),
            "tensor_ms_per_block": round(tensor_ms, 3),
            "tensor_speedup": round(single_ms / tensor_ms, 4),
            "tensor_max_abs_diff_vs_single": (sharded.video_latents - base.video_latents).abs().max().item(),
            "max_abs_diff_vs_single": diff,
            "bitwise_equal_to_single": diff == 0.0,
            "latent_psnr_db_vs_single": psnr(split.video_latents, base.video_latents),
            "two_workers_throughput_ratio": round(latency_mode / throughput_mode, 4),
            "attention_backend": split.metadata["attention_backend"],
        }
        print(row)
        rows.append(row)
    for s in (single, group, second_worker, tensor):
        s.close()
    return {**environment(), "link": link_type(), "profile": PROFILE, "shapes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--shapes", nargs="+", default=["960x544", "1344x768"])
    args = parser.parse_args()
    data = run(args.gpus, args.blocks, args.cache, args.shapes)
    write_result(f"two_gpu_{args.gpus}xh200", data)


if __name__ == "__main__":
    main()
