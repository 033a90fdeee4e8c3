"""The core-vs-Vflash benchmark's CPU dry run against a real ComfyUI server (skipped unless `COMFYUI_ROOT` and
`COMFYUI_PYTHON` are set, as for the other real-server tests): `benchmarks/vs_comfy_core.py --tiny` runs core's own
MiniMax-H3 nodes and Vflash's on the same small Comfy-Org files, end to end, and writes its result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (os.environ.get("COMFYUI_ROOT") and os.environ.get("COMFYUI_PYTHON")),
                                reason="set COMFYUI_ROOT and COMFYUI_PYTHON to run the real-server tests")


def test_tiny_dry_run_writes_both_sides_records_and_real_mp4s(tmp_path):
    from mp4_probe import probe_mp4

    env = {**os.environ, "VFLASH_RESULTS": str(tmp_path / "results"), "PYTHONPATH": str(REPO / "benchmarks")}
    out = subprocess.run([sys.executable, "-P", str(REPO / "benchmarks" / "vs_comfy_core.py"), "--tiny", "--work", str(tmp_path / "work")],
                         cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "results" / "vs_comfy_core_cpu_tiny.json").read_text())
    assert data["tiny"] is True and data["comfyui_version"] and {"gpu", "torch", "commit", "date"} <= set(data)
    assert {r["side"] for r in data["records"]} == {"core", "vflash"}
    assert {r["mode"] for r in data["records"]} == {"exact", "EasyCache", "fast_mode step-cache"}
    for record in data["records"]:
        assert record["status"] == "success", record
        assert {"device_cap_gib", "workflow_seconds", "peak_device_bytes", "host_rss_peak_bytes", "host_pinned_bytes",
                "node_seconds"} <= set(record)
        assert record["workflow_seconds"] > 0 and record["host_rss_peak_bytes"] > 0 and record["node_seconds"]
        # warm runs keep the models: the loaders ran in the first run only (ComfyUI's cache, no --cache-none)
        loaders = {"1", "2", "3", "12"}
        assert loaders <= set(record["first_run"]["node_seconds"]) and not loaders & set(record["warm_runs"][0]["node_seconds"]), record
        info = probe_mp4(record["first_run"]["video"])
        assert (info["width"], info["height"]) == (128, 128) and info["frames"] == 124, info
    for summary in data["summaries"]:
        assert summary["speedup_vflash_vs_core"] > 0 and summary["frames_psnr_core_vs_vflash_db"] is not None
