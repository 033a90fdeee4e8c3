"""Requests per hour through `vflash serve` (its HTTP API, its queue, real spawned workers): serial vs pipelined
workers, and on the CPU one worker vs two.

    python benchmarks/service_throughput.py                          # CPU: the embedded demo model
    python benchmarks/service_throughput.py --prepared-assets R --gpu 0 --requests 8 --width 1344 --height 768

Each phase starts a service on loopback, runs one warm-up request per worker (the model loads on a worker's first
job, which is not what is measured), then submits `--requests` requests at once and times them from the first
submission to the last video. Pipelining cannot hide the first request's GPU work nor the last one's MP4, so its gain
grows with the queue (on one H100 at 1344x768 5 s: 1.096x with 4 requests, 1.115x with 8); the full-size run queues 8.
CPU: each worker is pinned to `--threads` threads, torch's and the H.264 encoder's (by
default FFmpeg gives the encoder a thread per core), so two workers on a two-core machine get a core each, as one
worker with two threads gets both. GPU: `gpu_busy_fraction` is NVML's utilisation
(`nvidia-smi` sampled every 200 ms) averaged over the measured window. `same_mp4_bytes`: the serial and the pipelined
phase wrote byte-identical MP4s for the same requests. Writes `results/service_throughput_<gpu or cpu>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, gpu_tag, write_result

from vflash_core.pipeline.options import RunOptions
from vflash_core.service import ServiceConfig, create_app

TERMINAL = ("succeeded", "failed", "cancelled")


class GpuBusySampler:
    """NVML's GPU utilisation through `nvidia-smi`, sampled every 200 ms while the phase runs (None on the CPU)."""

    def __init__(self, gpu: int | None):
        self.samples: list[float] = []
        self._process = None
        if gpu is not None:
            self._process = subprocess.Popen(
                ["nvidia-smi", f"--id={gpu}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", "200"], stdout=subprocess.PIPE, text=True,
            )
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            if line.strip().isdigit():
                self.samples.append(float(line) / 100)

    def busy_fraction(self, since: int) -> float | None:
        window = self.samples[since:]
        return statistics.fmean(window) if window else None

    def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()


async def run_phase(config: ServiceConfig, requests: list[dict[str, Any]], sampler: GpuBusySampler) -> dict[str, Any]:
    runner = web.AppRunner(create_app(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession() as http:
            while (await (await http.get(f"{base}/readyz")).json())["workers"][-1]["state"] != "ready":
                await asyncio.sleep(0.1)
            workers = len(config.worker_options())
            await run_requests(http, base, [dict(requests[0], seed=1000 + i) for i in range(workers)])  # warm-up
            first_sample = len(sampler.samples)
            start = time.perf_counter()
            jobs = await run_requests(http, base, requests)
            wall = time.perf_counter() - start
            busy = sampler.busy_fraction(first_sample)
    finally:
        await runner.cleanup()
    assert all(job["status"] == "succeeded" for job in jobs), jobs
    videos = [(config.output_dir / f"{job['id']}.mp4").read_bytes() for job in jobs]
    return {
        "mode": "pipelined" if config.pipelined else "serial", "workers": len(config.worker_options()),
        "requests": len(requests), "wall_seconds": round(wall, 3),
        "requests_per_hour": round(len(requests) / wall * 3600, 1), "gpu_busy_fraction": busy,
        "request_seconds": [round(job["result"]["elapsed_seconds"], 3) for job in jobs], "_videos": videos,
    }


async def run_requests(http: ClientSession, base: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ids = []
    for fields in requests:
        async with http.post(f"{base}/v1/jobs", json=fields) as response:
            body = await response.json()
            assert response.status == 202, body
            ids.append(body["id"])
    jobs: dict[str, dict[str, Any]] = {}
    while len(jobs) < len(ids):
        await asyncio.sleep(0.1)
        for job_id in ids:
            if job_id not in jobs:
                job = await (await http.get(f"{base}/v1/jobs/{job_id}")).json()
                if job["status"] in TERMINAL:
                    jobs[job_id] = job
    return [jobs[job_id] for job_id in ids]


def phases(args: argparse.Namespace) -> list[tuple[bool, int]]:
    """(pipelined, workers) of each phase: on a GPU one worker serial and pipelined; on the CPU also two workers."""
    return [(False, 1), (True, 1)] + ([] if args.gpu is not None else [(False, 2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepared-assets", type=Path, help="a receipt to serve (default: the embedded demo, CPU)")
    parser.add_argument("--gpu", type=int, help="the GPU of the one worker (with --prepared-assets)")
    parser.add_argument("--requests", type=int, default=6, help="requests queued at once per phase (default 6)")
    parser.add_argument("--width", type=int, default=224)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=5.0, help="clip length of each request")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch and H.264 encoder threads per worker (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="build each phase's configuration, run nothing")
    args = parser.parse_args()
    if (args.gpu is None) != (args.prepared_assets is None):
        parser.error("--gpu and --prepared-assets go together (neither: the CPU demo)")
    if args.prepared_assets is None:
        from vflash_core.pipeline.demo import ensure_demo_assets

        args.prepared_assets = ensure_demo_assets()
    options = RunOptions(media_video_threads=args.threads) if args.gpu is None else RunOptions(device=f"cuda:{args.gpu}")
    requests = [
        {"prompt": f"a lighthouse at dusk, take {i}", "seed": i, "width": args.width, "height": args.height,
         "duration_seconds": args.seconds}
        for i in range(args.requests)
    ]
    records, videos = [], {}
    sampler = GpuBusySampler(None if args.dry_run else args.gpu)
    try:
        for pipelined, workers in phases(args):
            with tempfile.TemporaryDirectory(prefix="vflash-throughput-") as out:
                config = ServiceConfig(
                    args.prepared_assets, Path(out), options, workers=workers, pipelined=pipelined,
                    torch_threads=args.threads if args.gpu is None else None, max_queue=max(16, args.requests),
                )
                print(f"phase: {'pipelined' if pipelined else 'serial'}, {workers} worker(s)", flush=True)
                if args.dry_run:
                    continue
                record = asyncio.run(run_phase(config, requests, sampler))
            videos[(pipelined, workers)] = record.pop("_videos")
            records.append(record)
            print(record, flush=True)
    finally:
        sampler.close()
    if args.dry_run:
        return
    rate = {(r["mode"] == "pipelined", r["workers"]): r["requests_per_hour"] for r in records}
    result: dict[str, Any] = {
        **environment(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores" if args.gpu is None else None,
        "request": {k: v for k, v in requests[0].items() if k not in ("prompt", "seed")},
        "requests_per_hour": records,
        "pipelined_speedup": round(rate[(True, 1)] / rate[(False, 1)], 3),
        "gpu_busy_fraction": {r["mode"]: r["gpu_busy_fraction"] for r in records if r["workers"] == 1},
        "same_mp4_bytes": videos[(False, 1)] == videos[(True, 1)],
    }
    if args.gpu is None:
        result["threads_per_worker"] = args.threads
        result["two_worker_speedup"] = round(rate[(False, 2)] / rate[(False, 1)], 3)
        result["same_mp4_bytes"] = result["same_mp4_bytes"] and videos[(False, 2)] == videos[(False, 1)]
    write_result(f"service_throughput_{'cpu' if args.gpu is None else gpu_tag(args.gpu)}", result)


if __name__ == "__main__":
    main()
