"""Sequence-head scaling over 1..P GPUs of one host, full-width compiled blocks, one process.

    python benchmarks/multi_gpu.py --gpus 1 2 4 8 [--blocks 4] [--cache /tmp/vflash-bench]

For each GPU count, whole fixed-schedule trajectories at 1344x768 for 5 s and 10 s (N = 38,222 and 73,898 with 512
text rows) with the denoise profiler on; per-block time as in two_gpu.py (rank 0's block loop, evaluations 2..16,
divided by the block count). Parity: max abs difference of the final latents against one GPU.

Writes benchmarks/results/multi_gpu_h200.json:
`{"gpu", "torch", "commit", "runs": [{"gpus", "N", "ms_per_block", "speedup_vs_1", "max_abs_diff_vs_single"}]}`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROFILE, compiled_model, environment, full_width, request, write_result
from two_gpu import link_type, per_block_ms

from vflash_core import NativeEngineSession
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions


def run(gpu_counts: list[int], blocks: int, cache: Path, seconds: list[float]) -> dict[str, object]:
    _, paths = compiled_model(cache, blocks)
    config = full_width(blocks)
    runs = []
    for duration in seconds:
        bundle = request(config, "1344x768", duration)
        baseline_ms, baseline = None, None
        for gpus in sorted(gpu_counts):
            peers = list(range(1, gpus)) or None
            with NativeEngineSession(PROFILE, CompiledPaths(**paths), EngineOptions(device="cuda:0", peer_device=peers, strategy="sequence-head" if peers else None)) as session:
                session.generate(bundle)
                result = session.generate(bundle, profile_denoise=True)
            ms = per_block_ms(result, blocks)
            if gpus == 1:
                baseline_ms, baseline = ms, result
            row = {
                "gpus": gpus,
                "N": bundle.layout.sequence_length,
                "ms_per_block": round(ms, 3),
                "speedup_vs_1": None if baseline_ms is None else round(baseline_ms / ms, 4),
                "max_abs_diff_vs_single": None if baseline is None else (result.video_latents - baseline.video_latents).abs().max().item(),
            }
            print(row)
            runs.append(row)
    return {**environment(), "link": link_type(), "profile": PROFILE, "blocks": blocks, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--seconds", type=float, nargs="+", default=[5.0, 10.0])
    args = parser.parse_args()
    write_result("multi_gpu_h200", run(args.gpus, args.blocks, args.cache, args.seconds))


if __name__ == "__main__":
    main()
