"""ComfyUI core's own MiniMax-H3 nodes against Vflash's, in a real ComfyUI server, on the same model files.

Both sides read the same Comfy-Org single files (the transformer in `diffusion_models/`, the Qwen3-VL text encoder in
`text_encoders/`, the video and audio VAEs in `vae/`) with the same prompt, seed, canvas, length and evaluations:

* core: `UNETLoader`, `CLIPLoader` (type `minimax`), two `VAELoader`, `MiniMaxH3ImageToVideo`, `RandomNoise`,
  `BasicGuider`, `KSamplerSelect` (euler), `BasicScheduler` (simple, the profile's evaluation count), core's own
  shifts (12 video, 3 audio), `SamplerCustomAdvanced`, `VAEDecode`, `VAEDecodeAudio`, `CreateVideo` (24 fps),
  `SaveVideo`: core's text-to-video template without the Turbo LoRA;
* Vflash: the "Text to video + audio from Comfy-Org files" template (`workflows/api/t2va_core_loaders.json`: core's
  CLIP and VAE loaders, Vflash's model loader, encode, sampler and decode, `SaveVideo`) with the profile of the same
  schedule (`t2va-base16-bf16-sm90` on an H100/H200: 16 evaluations, shifts 12 and 3, no guidance; on the CPU
  `t2va-base4-exact-cpu`, 4).

The math is not the same, so the frames are compared by PSNR, not bitwise: the two draw the initial noise with
different generators and layouts, core's sampler steps its own sigma schedule, and core's transformer runs its own
attention kernels (see docs/comfyui.md). The Turbo4 settings are not used because core's Turbo template keeps its
shift of 12 where Vflash's Turbo4 profile uses 6: the base schedule is the one both sides run with the same shifts.

Each (side, cap) runs in its own fresh server, so a peak belongs to one side: a first run (models loaded and, for
Vflash, compiled on first use) and `--warm-runs` more with other seeds: warm runs as a user sees them, with ComfyUI's
default cache (no `--cache-none`), so the loaders and the unchanged prompt's encoding are cached on both sides and
only sampling, decoding and saving run again (a repeated graph would be skipped whole). Measured per run:

* `workflow_seconds` and `node_seconds`: from the websocket's `executing` events (a node's time runs until the next
  node starts or the prompt ends; cached nodes report nothing);
* `peak_device_bytes`: the device memory in use by the server, the driver's count (`cudaMemGetInfo` in the server
  process, `comfy_bench_probe/`, sampled every 50 ms) less what was in use before the server started: core's
  dynamic VRAM allocates its weights outside PyTorch's allocator, so the allocator's peak
  (`torch_allocator_peak_bytes`, `torch.cuda.max_memory_allocated`, reset before each run) misses them; null on the
  CPU;
* `host_rss_peak_bytes`: psutil's RSS of the server process, sampled every 50 ms;
* `host_pinned_bytes`: the largest of what each side pins, sampled in the server: core's own count of the host
  memory it registers (`comfy.model_management.TOTAL_PINNED_MEMORY`) and PyTorch's page-locked allocator (Vflash's
  pinned buffers), both given under `host_pinned`.

Device caps, as each side's users cap memory: core with `--reserve-vram` (the card's memory less the cap), one server
per cap; the Vflash server gets the same `--reserve-vram` (Vflash's engines take the card less core's reserve as
their device cap, and ask core for room within it). In both servers PyTorch's allocator is also capped at the cap
(`VFLASH_BENCH_DEVICE_CAP_GIB`); core's dynamic VRAM allocates outside that allocator, so `within_device_cap` says
whether each side's measured peak stayed within the cap. Caps need CUDA: on the CPU only the resident rows run.

The approximate row: core's `EasyCache` (its step cache; 0.33.0 has no sparse-attention node) against Vflash's
`fast_mode` `step-cache`, both marked approximate.

    python benchmarks/vs_comfy_core.py --comfyui /path/to/ComfyUI --models DIR [--rows resident 32 24 fast] [--warm-runs 2]
        [--keep-other-rows]
    python benchmarks/vs_comfy_core.py --comfyui /path/to/ComfyUI --tiny      # CPU dry run on the small family
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import runpy
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Self

import torch
from _common import RESULTS, environment, gpu_tag, write_result
from comfy_server import API, TEST_PROBES, Server

BENCH_PROBE = Path(__file__).resolve().parent / "comfy_bench_probe"
PROMPT = "A robot dances in the rain on a neon street at night, while drums and bass play."
SEED = 0
GIB = 1 << 30


@dataclass(frozen=True)
class Files:
    """The model files both sides read, by their names in the ComfyUI model folders."""

    dit: str
    text_encoder: str
    video_vae: str
    audio_vae: str


@dataclass(frozen=True)
class Settings:
    width: int
    height: int
    length: int
    steps: int
    profile: str
    files: Files
    warm_runs: int = 2
    launch: tuple[str, ...] = ()

    def request(self) -> dict:
        return {"prompt": PROMPT, "seed": SEED, "width": self.width, "height": self.height, "length": self.length,
                "evaluations": self.steps, "vflash_profile": self.profile}


TINY_FILES = Files("h3_small_comfy_fp8_scaled.safetensors", "h3_small_te.safetensors", "h3_small_video_vae.safetensors",
                   "h3_small_audio_vae.safetensors")
FULL_FILES = Files("minimax_h3_fl2va_fp8_scaled.safetensors", "qwen3vl_32b_minimax_h3_fp8_scaled.safetensors",
                   "minimax_h3_video_vae_fp16.safetensors", "minimax_h3_audio_vae_fp32.safetensors")
TINY = Settings(128, 128, 124, 4, "t2va-base4-exact-cpu", TINY_FILES, warm_runs=1, launch=("--cpu",))
FULL = Settings(960, 544, 124, 16, "t2va-base16-bf16-sm90", FULL_FILES)


# -- the two workflows ----------------------------------------------------------------------------------------------


def core_workflow(s: Settings, seed: int, prefix: str, fast: bool = False) -> dict:
    """Core's text-to-video graph (its template's nodes, without the Turbo LoRA), API format."""
    f = s.files
    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": f.dit, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": f.text_encoder, "type": "minimax", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": f.video_vae}},
        "12": {"class_type": "VAELoader", "inputs": {"vae_name": f.audio_vae}},
        "4": {"class_type": "MiniMaxH3ImageToVideo", "inputs": {
            "clip": ["2", 0], "vae": ["3", 0], "prompt": PROMPT, "width": s.width, "height": s.height, "length": s.length}},
        "5": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "6": {"class_type": "BasicGuider", "inputs": {"model": ["1", 0], "conditioning": ["4", 0]}},
        "7": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "8": {"class_type": "BasicScheduler", "inputs": {"model": ["1", 0], "scheduler": "simple", "steps": s.steps, "denoise": 1.0}},
        "9": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["5", 0], "guider": ["6", 0], "sampler": ["7", 0], "sigmas": ["8", 0], "latent_image": ["4", 1]}},
        "10": {"class_type": "VAEDecode", "inputs": {"samples": ["9", 0], "vae": ["3", 0]}},
        "11": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["9", 0], "vae": ["12", 0]}},
        "13": {"class_type": "CreateVideo", "inputs": {"images": ["10", 0], "audio": ["11", 0], "fps": 24.0}},
        "14": {"class_type": "SaveVideo", "inputs": {"video": ["13", 0], "filename_prefix": prefix, "format": "auto", "codec": "auto"}},
    }
    if fast:
        graph["15"] = {"class_type": "EasyCache", "inputs": {
            "model": ["1", 0], "reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}}
        graph["6"]["inputs"]["model"] = ["15", 0]
    return graph


def vflash_workflow(s: Settings, seed: int, prefix: str, fast: bool = False) -> dict:
    """The "Text to video + audio from Comfy-Org files" template on the same files and request."""
    graph = json.loads((API / "t2va_core_loaders.json").read_text())
    f = s.files
    graph["1"]["inputs"].update(model=f.dit, profile=s.profile, fast_mode="step-cache" if fast else "exact")
    graph["2"]["inputs"]["clip_name"] = f.text_encoder
    graph["3"]["inputs"]["vae_name"] = f.video_vae
    graph["12"]["inputs"]["vae_name"] = f.audio_vae
    graph["4"]["inputs"].update(prompt=PROMPT, width=s.width, height=s.height, length=s.length, seconds=0.0)
    graph["5"]["inputs"]["seed"] = seed
    graph["7"]["inputs"]["filename_prefix"] = prefix
    return graph


WORKFLOWS: dict[str, Callable[..., dict]] = {"core": core_workflow, "vflash": vflash_workflow}


# -- the files ------------------------------------------------------------------------------------------------------


def write_tiny_family(root: Path, models: Path) -> None:
    """The small random family (released channel counts on a tiny network) in the layouts of the full-size files,
    written by the same writer (`comfy_core_files.py --small`, with ComfyUI's Python): the transformer as a Comfy-Org
    fp8_scaled single file, the text encoder and the VAEs in the layouts core's loaders detect."""
    python = os.environ.get("COMFYUI_PYTHON", "python")
    out = subprocess.run([python, str(Path(__file__).resolve().parent / "comfy_core_files.py"), str(models), "--small", "--device", "cpu"],
                         cwd=root, check=False, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])


def link_models(source: Path) -> Callable[[Path, Path], None]:
    """A `write_models` that links the files of a prepared Comfy-Org model folder (`source/<folder>/<file>`)."""

    def link(root: Path, models: Path) -> None:
        for file in source.glob("*/*"):
            (models / file.parent.name).mkdir(parents=True, exist_ok=True)
            (models / file.parent.name / file.name).symlink_to(file.resolve())

    return link


def sharing_compiled(write_models: Callable[[Path, Path], None], compiled: Path) -> Callable[[Path, Path], None]:
    """`write_models`, with the server's `models/vflash` a link to one folder shared by every server of the run: Vflash
    compiles the transformer file for its profile once (the first Vflash server's first run), not once per server (at
    full size a BF16 compile is ~62 GiB, twice that does not fit the disk). The compile is keyed by the file it was
    made from, which every server links to the same place, so later servers find it current."""

    def write(root: Path, models: Path) -> None:
        write_models(root, models)
        compiled.mkdir(parents=True, exist_ok=True)
        (models / "vflash").rmdir()
        (models / "vflash").symlink_to(compiled)

    return write


# -- one side under one cap -----------------------------------------------------------------------------------------


class Sampler:
    """Samples the server process's RSS (psutil), the device memory in use and the probe's pinned counts while a
    run goes on."""

    def __init__(self, server: Server, period: float = 0.05):
        import psutil

        self.process, self.server, self.period = psutil.Process(server.proc.pid), server, period
        self.rss_peak = self.device_used = self.comfy_pinned = self.torch_pinned = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)
            memory = probe_memory(self.server)
            self.device_used = max(self.device_used, memory["device_used_bytes"])
            self.comfy_pinned = max(self.comfy_pinned, memory["comfy_pinned_bytes"])
            self.torch_pinned = max(self.torch_pinned, memory["torch_pinned_bytes"])
            self._stop.wait(self.period)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def probe_memory(server: Server) -> dict:
    with urllib.request.urlopen(server.url + "/vflash_bench/memory", timeout=10) as r:
        return json.loads(r.read())


def node_seconds(result: dict) -> dict[str, float]:
    """Seconds per executed node: from its `executing` event to the next one (the last: to the prompt's last event,
    whether or not the server announces the end with an `executing` event of no node)."""
    times = [(e["data"].get("node"), e["received"]) for e in result["events"] if e["type"] == "executing"]
    times.append((None, result["events"][-1]["received"]))
    return {node: round(times[i + 1][1] - at, 4) for i, (node, at) in enumerate(times[:-1]) if node is not None}


def workflow_seconds(result: dict) -> float:
    start = next(e["received"] for e in result["events"] if e["type"] == "execution_start")
    return round(result["events"][-1]["received"] - start, 4)


def device_used() -> int | None:
    """The devices' memory in use now, all processes (the driver's count); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return sum(total - free for free, total in map(torch.cuda.mem_get_info, range(torch.cuda.device_count())))


def one_run(server: Server, graph: dict, out: Path, baseline: int | None) -> dict:
    urllib.request.urlopen(urllib.request.Request(server.url + "/vflash_bench/reset_peaks", data=b"{}", method="POST"), timeout=10)
    with Sampler(server) as sampled:
        result = asyncio.run(server.run_prompt(graph, timeout=3600.0))
    if result["status"] != "success":
        return {"status": result["status"], "error": result.get("body"), "log_tail": server.tail(40)}
    videos = server.history_files(result["prompt_id"], out)
    allocator_peak = probe_memory(server)["device_peak_bytes"]
    return {
        "status": "success", "workflow_seconds": workflow_seconds(result), "node_seconds": node_seconds(result),
        "peak_device_bytes": sampled.device_used - baseline if baseline is not None else None,
        "torch_allocator_peak_bytes": allocator_peak if baseline is not None else None, "host_rss_peak_bytes": sampled.rss_peak,
        "host_pinned_bytes": max(sampled.comfy_pinned, sampled.torch_pinned),
        "host_pinned": {"comfy_registered_peak": sampled.comfy_pinned, "torch_host_allocator_peak": sampled.torch_pinned},
        "video": str(videos[0]) if videos else None,
    }


def device_total_gib() -> float:
    return torch.cuda.get_device_properties(0).total_memory / GIB


def run_side(comfyui: Path, work: Path, side: str, s: Settings, cap: int | None, fast: bool,
             write_models: Callable[[Path, Path], None]) -> dict:
    """One fresh server, one side's first run and warm runs; the record."""
    # No frontend: an empty web root, so the frontend package need not be installed (a headless API run serves none).
    (work.parent / "no-frontend").mkdir(parents=True, exist_ok=True)
    launch = [*s.launch, "--front-end-root", str(work.parent / "no-frontend")]
    env = {}
    if cap is not None:
        launch += ["--reserve-vram", f"{max(0.0, device_total_gib() - cap):.3f}"]
        env["VFLASH_BENCH_DEVICE_CAP_GIB"] = str(cap)
    probes = {"vflash_bench_probe": BENCH_PROBE}
    if s.files == TINY_FILES:
        probes["vflash_test_small_core"] = TEST_PROBES["vflash_test_small_core"]
    compiled_before = any(work.parent.joinpath("vflash-compiled").glob("*"))
    baseline = device_used()  # before the server: this process's own CUDA context and whatever else holds the device
    server = Server(comfyui, work, probes=probes, write_models=sharing_compiled(write_models, work.parent / "vflash-compiled"),
                    launch_args=launch, env=env)
    out = work / "videos"
    out.mkdir()
    try:
        server.wait_ready(600.0)
        runs = []
        for k in range(1 + s.warm_runs):
            graph = WORKFLOWS[side](s, SEED + k, f"video/{side}_{k}", fast)
            runs.append(one_run(server, graph, out, baseline))
            if runs[-1]["status"] != "success":
                break
    finally:
        server.stop()
    first = runs[0]
    warm = [r for r in runs[1:] if r["status"] == "success"]
    record = {
        "side": side, "device_cap_gib": cap, "approximate": fast,
        "mode": ("EasyCache" if side == "core" else "fast_mode step-cache") if fast else "exact",
        "status": "success" if all(r["status"] == "success" for r in runs) else "failed",
        "launch_args": launch, "device_used_before_bytes": baseline, "first_run": first, "warm_runs": warm,
        "node_classes": {node: n["class_type"] for node, n in WORKFLOWS[side](s, SEED, "video", fast).items()},
        # Vflash's first run compiles the transformer file unless an earlier server of this run did (the compile is
        # shared, see `sharing_compiled`); core's first run has nothing to compile.
        "compiled_before_first_run": compiled_before if side == "vflash" else None,
    }
    best = min(warm, key=lambda r: r["workflow_seconds"]) if warm else first
    for key in ("workflow_seconds", "node_seconds"):  # the best warm run's
        record[key] = best.get(key)
    for key in ("peak_device_bytes", "torch_allocator_peak_bytes", "host_rss_peak_bytes", "host_pinned_bytes"):  # over all runs
        device = key in ("peak_device_bytes", "torch_allocator_peak_bytes")
        record[key] = None if device and baseline is None else max((r.get(key) or 0 for r in runs), default=0)
    record["within_device_cap"] = None if cap is None or baseline is None else record["peak_device_bytes"] <= cap * GIB
    return record


# -- frames ---------------------------------------------------------------------------------------------------------


def frames_psnr(a: Path, b: Path) -> float | None:
    """PSNR (dB, 8-bit frames) between the decoded videos of two MP4s over their common frames."""
    import av
    import numpy as np

    def frames(path: Path):
        with av.open(str(path)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float64)

    x, y = frames(a), frames(b)
    n = min(len(x), len(y))
    if n == 0 or x.shape[1:] != y.shape[1:]:
        return None
    mse = float(((x[:n] - y[:n]) ** 2).mean())
    return round(10 * math.log10(255.0**2 / mse), 3) if mse > 0 else math.inf


# -- the benchmark --------------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    settings: Settings
    records: list[dict] = field(default_factory=list)
    kept: int = 0  # records kept from an earlier run (`keep_other_rows`)
    # Each pair's summary, made once both its sides ran (the frames are decoded once), or kept from an earlier run.
    made: dict[tuple[int | None, bool], dict] = field(default_factory=dict)

    def keep_other_rows(self, earlier: dict, plan: list[tuple[int | None, bool]]) -> None:
        """The records of an earlier result file for the same request on the same files whose pairs `plan` does not
        measure again, each naming the commit it was measured at."""
        if earlier["request"] != self.settings.request() or earlier["files"] != vars(self.settings.files):
            print("the earlier result file measured another request or other files: none of its rows is kept", flush=True)
            return
        kept = [{**r, "commit": r.get("commit", earlier["commit"])} for r in earlier["records"]
                if (r["device_cap_gib"], r["approximate"]) not in plan]
        self.records += kept
        self.kept = len(kept)
        self.made = {(r["device_cap_gib"], r["approximate"]): r for r in earlier["summaries"]
                     if (r["device_cap_gib"], r["approximate"]) not in plan}

    def summaries(self) -> list[dict]:
        """Per cap (and the approximate row): Vflash's speedup on warm workflow seconds, PSNR of the first runs' frames
        (a kept pair's as its run made them: its videos are gone)."""
        rows = []
        for cap, fast in sorted({(r["device_cap_gib"], r["approximate"]) for r in self.records}, key=lambda k: (k[1], -(k[0] or 1e9))):
            if (cap, fast) in self.made:
                rows.append(self.made[cap, fast])
                continue
            pair = {r["side"]: r for r in self.records if r["device_cap_gib"] == cap and r["approximate"] == fast}
            core, vflash = pair.get("core"), pair.get("vflash")
            ok = core and vflash and core["status"] == vflash["status"] == "success"
            videos = (core["first_run"].get("video"), vflash["first_run"].get("video")) if ok else (None, None)
            rows.append({
                "device_cap_gib": cap, "approximate": fast,
                "speedup_vflash_vs_core": round(core["workflow_seconds"] / vflash["workflow_seconds"], 4) if ok else None,
                "frames_psnr_core_vs_vflash_db": frames_psnr(Path(videos[0]), Path(videos[1])) if all(videos) else None,
            })
            if core and vflash:
                self.made[cap, fast] = rows[-1]
        return rows


def comfyui_version(comfyui: Path) -> str:
    namespace = runpy.run_path(str(comfyui / "comfyui_version.py"))
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=comfyui, capture_output=True, text=True, check=False)
    return namespace["__version__"] + (f" ({out.stdout.strip()[:8]})" if out.returncode == 0 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_ROOT"), help="the ComfyUI checkout")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run on the small random family")
    parser.add_argument("--models", type=Path, help="a Comfy-Org model folder (diffusion_models/, text_encoders/, vae/) with FULL_FILES")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vs-comfy-core"))
    parser.add_argument("--rows", nargs="+", help="the pairs to run, in order: resident, fast (the approximate pair, "
                        "resident) and device caps in GiB (default: resident 32 24 fast; resident fast without CUDA)")
    parser.add_argument("--keep-other-rows", action="store_true",
                        help="keep the pairs of the existing result file that this run does not measure (each record names its commit)")
    parser.add_argument("--warm-runs", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--height", type=int)
    args = parser.parse_args()
    s = TINY if args.tiny else FULL
    for name in ("warm_runs", "width", "height"):
        if getattr(args, name) is not None:
            s = replace(s, **{name: getattr(args, name)})
    rows = args.rows or (["resident", "32", "24", "fast"] if torch.cuda.is_available() else ["resident", "fast"])
    try:
        plan = [(None, False) if row == "resident" else (None, True) if row == "fast" else (int(row), False) for row in rows]
    except ValueError:
        parser.error(f"--rows takes resident, fast and caps in GiB, not {' '.join(rows)}")
    if any(cap is not None for cap, _ in plan) and not torch.cuda.is_available():
        parser.error("device caps need CUDA")
    if not args.tiny and args.models is None:
        parser.error("a full-size run needs --models (the Comfy-Org files FULL_FILES names)")
    write_models = write_tiny_family if args.tiny else link_models(args.models)
    shutil.rmtree(args.work, ignore_errors=True)
    env = environment()
    gpu = "cpu_tiny" if args.tiny else gpu_tag()
    version = comfyui_version(args.comfyui)
    comparison = Comparison(s)
    if args.keep_other_rows and (RESULTS / f"vs_comfy_core_{gpu}.json").is_file():
        comparison.keep_other_rows(json.loads((RESULTS / f"vs_comfy_core_{gpu}.json").read_text()), plan)
    for cap, fast in plan:
        for side in ("core", "vflash"):
            name = f"{side}-{'resident' if cap is None else f'cap{cap}'}{'-fast' if fast else ''}"
            print(f"== {name}", flush=True)
            record = {**run_side(args.comfyui, args.work / name, side, s, cap, fast, write_models), "commit": env["commit"],
                      "files": vars(s.files), "comfyui_version": version}
            print(json.dumps({k: record[k] for k in ("status", "workflow_seconds", "peak_device_bytes", "host_rss_peak_bytes")}), flush=True)
            comparison.records.append(record)
            # Written after every side, so a run cut short (a machine's time is bounded) still leaves what it measured.
            data = {
                **env, "date": datetime.date.today().isoformat(), "tiny": args.tiny, "comfyui_version": version,
                "files": vars(s.files), "request": s.request(),
                "same_math": False,
                "math_note": "not the same: different initial-noise generators, core's own sigma schedule and attention kernels",
                "planned": [{"device_cap_gib": c, "approximate": f} for c, f in plan],
                "complete": len(comparison.records) - comparison.kept == 2 * len(plan),
                "records": comparison.records, "summaries": comparison.summaries(),
            }
            write_result(f"vs_comfy_core_{gpu}", data)
    print(f"results in {RESULTS}")


if __name__ == "__main__":
    main()
