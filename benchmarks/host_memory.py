"""The core under a host-memory budget at full size on one H200: the blocks' pinned arena where the budget holds it
(block-ring), else the blocks streamed from their compiled files (disk-ring), each request bitwise against resident.

    python benchmarks/host_memory.py --work /root/e2e --shm /dev/shm/vflash [--runs 64:24 32:24 64:20 32:20] [--deadline-minutes 20] [--small]

The family is staged as `end_to_end.py` stages it (the same `--work` / `--shm`; only the transformer: its source in the
tmpfs, compiled onto the disk, the source removed). Each run is its own child process (so its host peaks are its own),
on cuda:0, with the page cache dropped before it: a `NativeEngineSession` of the Turbo4 profile with
`max_host_memory` / `max_device_memory` as given (`HOST:CAP` in GiB; the memory plan chooses the placement), then one
t2va request at 1344x768 5 s (4 evaluations of 50 blocks, 512 text rows), its latents written and compared with the
resident twin's (the first run, uncapped, `weight_residency="resident"`, with `profile_denoise` for the blocks'
compute time).

One record per run: `host_budget_gib`, `cap_gib`, `placement`, `completed`, `bitwise_equal_to_resident`,
`request_seconds`, `load_seconds`, `host_rss_peak_bytes` (the child's resident set, sampled every 20 ms),
`host_pinned_bytes`, `peak_device_bytes`, `memory_plan`; for a disk ring `block_read_seconds` (median, min, max of
every block read), `block_reads`, `block_read_gbps`; `error` where refused. Top level: `block_bytes`,
`block_compute_seconds` (the resident twin's block loop over its 200 block evaluations), `disk_read_gbps` (cold reads
of block files in this run, as the disk ring reads them) and `projection`: the request's block work on a card that
computes a block in 0.6 s (4090-class at 1344x768) beside a 3.5 GB/s drive, pinned arena against disk ring, from those
rates (the model: in steady state a block costs max(compute, read); the request's first read is not hidden), with the
same model's prediction of this machine's disk-ring run beside the measurement.

Writes benchmarks/results/host_memory_h200.json (host_memory_small.json with --small: the demo-sized family on the CPU,
a dry run whose numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import request as bundle_request
from end_to_end import HostPeak, Run, Setup, drop_page_cache, first_use

from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions

CANVAS, SMALL_CANVAS = "1344x768", "448x256"
RUNS = ("64:24", "32:24", "64:20", "32:20")
CARD_BLOCK_SECONDS = 0.6  # a 4090-class card's block at 1344x768 (71 TFLOP at ~120-165 TFLOP/s of dense BF16)
DRIVE_GBPS = 3.5  # a PCIe 4 NVMe drive's sequential read


def _run_spec(text: str) -> tuple[float | None, float | None]:
    host, cap = text.split(":")
    return (None if host == "-" else float(host)), (None if cap == "-" else float(cap))


# -- one run, in its own process -------------------------------------------------------------------------------------


def child(spec: dict) -> dict:
    """Load a session under the spec's limits, run one request, write its latents; the record."""
    from end_to_end import pinned_host_bytes

    from vflash_core.engine.residency import BlockFiles
    from vflash_core.engine.session import NativeEngineSession

    host = HostPeak()
    device = torch.device(spec["device"])
    start = time.perf_counter()
    session = NativeEngineSession(spec["profile"], CompiledPaths(**{k: Path(v) for k, v in spec["paths"].items()}), EngineOptions(device=device, weight_residency=spec["residency"], max_device_memory=spec["cap_gib"], max_host_memory=spec["host_budget_gib"]))
    record: dict[str, object] = {"load_seconds": round(time.perf_counter() - start, 3), "memory_plan": session.memory_plan(),
                                 "placement": session.weight_residency,
                                 "plan": session.plan.summary() if session.plan is not None else None}
    with session:
        bundle = bundle_request(session.compiled.config, spec["canvas"], 5.0)
        result = session.generate(bundle, output_latents=spec["latents"], profile_denoise=spec["profile_denoise"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record["request_seconds"] = round(result.timing.request_wall_seconds, 3)
        memory = result.metadata["memory"]
        record["peak_device_bytes"] = max(memory.get("peak_allocated_bytes", [0]))  # type: ignore[arg-type]
        record["pinned_host_bytes_held"] = memory["pinned_host_bytes"]
        if result.denoise_profile is not None:
            blocks_ms = [e.get("blocks", 0.0) for e in result.denoise_profile["evaluations"]]  # type: ignore[index,union-attr]
            record["blocks_ms_per_evaluation"] = [round(ms, 1) for ms in blocks_ms]
            record["block_evaluations"] = len(blocks_ms) * session.compiled.config.num_layers
        files = next((h for h in session._host_blocks if isinstance(h, BlockFiles)), None)
        if files is not None:
            reads = list(files.read_seconds)
            record["block_reads"] = len(reads)
            record["block_read_seconds"] = {"median": round(statistics.median(reads), 4), "min": round(min(reads), 4), "max": round(max(reads), 4)}
            record["block_read_gbps"] = round(files.bytes_read / sum(reads) / 1e9, 3)
        peaks = host.reset()
    # (not getrusage's ru_maxrss: Linux carries the parent's peak across exec)
    record["host_rss_peak_bytes"] = peaks["host_rss_peak_bytes"]
    record["host_pinned_bytes"] = max(peaks["host_pinned_bytes"], pinned_host_bytes(peak=True))
    return record


# -- the parent ------------------------------------------------------------------------------------------------------


def stage_core(run: Run, setup: Setup) -> None:
    """The transformer only: source into the tmpfs, compiled onto the disk (first use), the source removed."""
    staged = setup.staged
    if (setup.compiled / "artifact" / "manifest.json").exists():
        run.log(f"compiled weights found in {setup.compiled}: not compiled again")
    else:
        with run.phase("family_transformer", 120) as rec:
            if rec is not None:
                rec.update(staged.write_source())
        with run.phase("first_use", 240) as rec:
            if rec is not None:
                first_use(run, setup, rec)
    staged.remove_source()


def disk_read_gbps(setup: Setup, blocks: int = 4) -> dict[str, float]:
    """Cold reads of `blocks` block files into one pinned buffer, as the disk ring reads them."""
    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.engine.residency import BlockFiles

    drop_page_cache()
    artifact = CompiledArtifact(**setup.session_paths())
    files = BlockFiles(artifact, pin=torch.cuda.is_available(), depth=1)  # one read at a time: each read's own time
    try:
        for index in range(blocks):
            files.host_span(index)
            files.copied(index, None)
        reads = files.read_seconds[:blocks]
    finally:
        files.close()
    return {"blocks": blocks, "block_bytes": files.item_bytes, "seconds": [round(s, 4) for s in reads],
            "read_gbps": round(files.item_bytes * len(reads) / sum(reads) / 1e9, 3)}


def spawn(spec: dict, timeout: float) -> dict:
    drop_page_cache()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"completed": False, "error": f"did not finish within {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"completed": False, "error": " | ".join(tail)}
    return {"completed": True, **json.loads(lines[-1].removeprefix("RESULT "))}


def latents_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def projection(block_bytes: int, compute: float, evaluations: int, blocks: int, disk_gbps: float, measured: dict | None) -> dict:
    """The block work of one request, pinned against disk ring, on the target card and on this machine (module docstring)."""

    def model(c: float, gbps: float) -> dict[str, float]:
        read = block_bytes / (gbps * 1e9)
        pinned = evaluations * blocks * c
        disk = evaluations * blocks * max(c, read) + read
        return {"block_compute_seconds": round(c, 4), "block_read_seconds": round(read, 4), "pinned_seconds": round(pinned, 2),
                "disk_ring_seconds": round(disk, 2), "overhead": round(disk / pinned - 1, 4)}

    out: dict[str, object] = {"card": {**model(CARD_BLOCK_SECONDS, DRIVE_GBPS), "drive_gbps": DRIVE_GBPS},
                              "this_machine": {**model(compute, disk_gbps), "drive_gbps": disk_gbps}}
    if measured is not None:
        out["this_machine"]["measured_disk_ring_request_seconds"] = measured["request_seconds"]  # type: ignore[index]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--shm", type=Path)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="HOST:CAP budgets in GiB ('-' for none)")
    parser.add_argument("--deadline-minutes", type=float, default=20.0)
    parser.add_argument("--small", action="store_true", help="dry run: demo-sized family on the CPU")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.work is None or args.shm is None:
        parser.error("--work and --shm are required")
    setup = Setup(args)
    run = Run("host_memory_small" if setup.small else "host_memory_h200", time.perf_counter() + args.deadline_minutes * 60, setup.small)
    canvas = SMALL_CANVAS if setup.small else CANVAS
    run.data["setup"] = {"device": setup.device, "profile": setup.profile, "canvas": canvas, "seconds": 5, "runs": args.runs,
                         "card_block_seconds": CARD_BLOCK_SECONDS, "drive_gbps": DRIVE_GBPS}
    run.data["records"] = []
    with run.phase("stage", 420) as rec:
        if rec is not None:
            stage_core(run, setup)
    out = Path(os.environ.get("VFLASH_RESULTS", setup.staged.work)) / "host_memory_latents"
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: str(v) for k, v in setup.session_paths().items()}

    def spec(host: float | None, cap: float | None, residency: str, name: str, profile_denoise: bool = False) -> dict:
        latents = out / f"{name}.safetensors"
        latents.unlink(missing_ok=True)
        return {"device": setup.device, "profile": setup.profile, "paths": paths, "canvas": canvas, "residency": residency,
                "host_budget_gib": host, "cap_gib": cap if setup.cuda or cap is not None else (1e6 if host is not None else None),
                "latents": str(latents), "profile_denoise": profile_denoise}

    with run.phase("disk", 60) as rec:
        if rec is not None and not setup.small:
            rec.update(disk_read_gbps(setup))
            run.data["disk_read_gbps"] = rec["read_gbps"]
            run.data["block_bytes"] = rec["block_bytes"]
    twin = spec(None, None, "resident", "resident", profile_denoise=True)
    with run.phase("resident", 240) as rec:
        if rec is not None:
            record = {"host_budget_gib": None, "cap_gib": None, **spawn(twin, max(60.0, run.left() - 30))}
            run.data["resident"] = record
            run.log(f"resident: {record}")
            if record["completed"] and record.get("block_evaluations"):
                run.data["block_compute_seconds"] = round(sum(record["blocks_ms_per_evaluation"]) / 1e3 / record["block_evaluations"], 4)
    for text in args.runs:
        host, cap = _run_spec(text)
        with run.phase(f"run {text}", 150) as rec:
            if rec is None:
                continue
            run_spec = spec(host, cap, "auto", f"host{host}-cap{cap}")
            record = {"host_budget_gib": host, "cap_gib": cap, **spawn(run_spec, max(60.0, run.left() - 20))}
            twin_done = run.data.get("resident", {}).get("completed")
            record["bitwise_equal_to_resident"] = latents_equal(Path(run_spec["latents"]), Path(twin["latents"])) if record["completed"] and twin_done else None
            if record["completed"] and host is not None:
                record["host_peak_within_budget"] = record["host_rss_peak_bytes"] <= host * 2**30
            run.data["records"].append(record)
            run.log(f"host {host} GiB, cap {cap} GiB: {record}")
            run.save()
    disk = next((r for r in run.data["records"] if r.get("placement") == "disk-ring" and r.get("completed")), None)
    if "block_compute_seconds" in run.data and "disk_read_gbps" in run.data:
        resident = run.data["resident"]
        run.data["projection"] = projection(run.data["block_bytes"], run.data["block_compute_seconds"], len(resident["blocks_ms_per_evaluation"]),
                                            resident["block_evaluations"] // len(resident["blocks_ms_per_evaluation"]), run.data["disk_read_gbps"], disk)
    run.save()
    run.log("done")


if __name__ == "__main__":
    main()
