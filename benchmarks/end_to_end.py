"""The real model at its real size, prompt to MP4, on one H200: Vflash's `H3Pipeline` in the configurations users run,
its final latents against diffusers 0.42.1's, and the first use of the weights.

    python benchmarks/end_to_end.py --work /root/e2e --shm /dev/shm/vflash [--deadline-minutes 20] [--skip PHASE ...] [--small]

One process. The full-size random family of `full_family.py` (66.3 GB transformer source, Turbo4 LoRA, the
Qwen3-VL-32B-shaped text encoder as H3 reads it, both released VAEs) is staged by its `StagingPlan` (printed first,
with the sizes): the source in the tmpfs `--shm`, compiled onto the disk of `--work`, the source removed, then the
text encoder into the tmpfs and the VAEs onto the disk. Phases, each recorded in the result file as soon as it ends
(a run stopped by its deadline keeps what it measured; a resumed run with the same `--work` and `--shm` repeats no
staging step, and `--skip` leaves phases out):

1. `disk`: sequential write and read bandwidth of the work folder's disk (dd with O_DIRECT) and of the tmpfs.
2. `family_transformer`: the transformer source (tmpfs) and the LoRA (disk).
3. `first_use`: `prepare` (hashes every source byte) and `compile` for `t2va-turbo4-exact-sm90`, as a user's first
   use runs them; wall time and bytes read and written (/proc/self/io), against the time to read the source once at
   the disk's bandwidth (where a user's source is) and at the tmpfs's (where it is here).
4. `weight_io`: cold reads of compiled block files through the session's block reader and `SequentialWeights`.
5. `family_rest`: the source removed; text encoder, tokenizer, processor and index (tmpfs), VAEs and index (disk).
6. `vflash_resident`: a pipeline with the text encoder, VAEs and weights resident, loaded from a dropped page cache
   (cold initialization), a first request and `--warm-requests` more per canvas (1344x768 and 960x544, 5 s t2va);
   the text of the 960x544 request is kept for `bitwise`. Then `denoise_overhead`: one more 1344x768 denoise with
   per-stage device timings, its wall time against evaluations x blocks x its own mean per-block time.
7. `bitwise`: a `NativeEngineSession` on cuDNN attention denoises that request's bundle; diffusers' transformer,
   rebuilt in GPU memory from the same seed (equal to the compiled file) with the same LoRA through
   `load_lora_weights`, denoises the same prompt embeddings and seed through the modular pipeline's core denoise
   step (SDPA, which picks cuDNN here); the final latents are compared bit for bit.
8. `vflash_encoder_offload` (the default: text encoder and VAEs on the GPU for their stage only) and
   `vflash_block_ring` (the blocks stream from pinned host memory), each loaded anew from a warm page cache, at both
   canvases; `vflash_two_gpu_sequence_head` where two GPUs are present.
9. `diffusers`: the modular pipeline end to end, where its text encoder's host copy fits this machine's host memory
   beside the staged files (it loads all 64 layers); otherwise skipped with the numbers, and the report compares with
   `--diffusers-from` (an earlier run's diffusers records on the same family and request).

Every request record carries `canvas`, `mode`, `side`, `config`, `elapsed_seconds`, `stages` (text_encode,
vae_encode, denoise, video_decode, audio_decode, mp4), `peak_device_bytes` per stage, `host_rss_peak_bytes`,
`host_pinned_bytes` (page-locked bytes held by PyTorch's host allocator, peak), `host_in_use_peak_bytes` (the
machine's memory in use, tmpfs included) and `mp4_sha256`; `stage_digests` holds the sha256 of each stage's
output of one resident 1344x768 request (the uncapped twin of `memory_caps.py`'s runs, with its MP4's).
`summary` holds warm medians and the ratios to diffusers. `--small` runs the same phases on the demo-sized family on
the CPU (a dry run of the script; its numbers mean nothing).

Writes benchmarks/results/end_to_end_<gpu>.json (end_to_end_h200.json on an H200, `_common.gpu_tag`; end_to_end_small.json
with --small).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, environment, gpu_tag, write_result
from full_family import SEED, STAGED_FAMILY, StagedFamily, folder_bytes, host_memory_bytes, host_memory_in_use

from vflash_core import get_profile
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.config import H3Config
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.weights import synthetic
from vflash_core.weights.family import DEMO_FAMILY

PROMPT = "A robot dances in the rain on a neon street at night, drums and bass play, the camera slowly pans left."
REQUEST_SEED = 1234
WARM_REQUESTS = 2
STAGES = ("text_encode", "vae_encode", "denoise", "video_decode", "audio_decode", "mp4")
PROFILE, SMALL_PROFILE = "t2va-turbo4-exact-sm90", "t2va-turbo4-exact-cpu"
CANVASES, SMALL_CANVASES = ["1344x768", "960x544"], ["448x256", "256x256"]
# Vflash's side of the bitwise comparison runs the attention kernel diffusers' SDPA picks on an H200.
BITWISE_ATTENTION = "torch-cudnn"


class Run:
    """The result file, written after every phase, and the deadline phases check before they start."""

    def __init__(self, name: str, deadline: float, small: bool, skip: tuple[str, ...] = ()):
        self.name, self.deadline, self.small, self.skip = name, deadline, small, skip
        self.data: dict[str, object] = {**environment(), "small": small, "phases": {}, "requests": [], "errors": []}
        self.start = time.perf_counter()
        self.carried: dict[str, dict] = {}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)

    def save(self) -> None:
        write_result(self.name, self.data)

    def carry_skipped(self, earlier: Path, records: str, phase_of: Callable[[dict], str], results_of: Mapping[str, tuple[str, ...]] = {}) -> None:
        """Phases left out with `--skip` keep what an earlier run measured instead of nothing: its phase record, its
        `records` (those `phase_of` assigns to the phase), each marked `measured_at_commit`, and the top-level results
        the phase writes (`results_of[phase]`, e.g. the bitwise phase's `bitwise_equal_to_diffusers`), whose commit is
        the phase record's. A phase the earlier run skipped or failed is not carried."""
        if not earlier.exists():
            return
        data = json.loads(earlier.read_text())
        for name in self.skip:
            measured = data.get("phases", {}).get(name)
            if not measured or "skipped" in measured or "error" in measured:
                continue
            commit = measured.get("measured_at_commit", data["commit"])
            self.carried[name] = {**measured, "measured_at_commit": commit}
            for record in data.get(records, []):
                if phase_of(record) == name:
                    self.data.setdefault(records, []).append({**record, "measured_at_commit": record.get("measured_at_commit", commit)})
            self.data.update({key: data[key] for key in results_of.get(name, ()) if key in data})

    @contextmanager
    def phase(self, name: str, needs_seconds: float):
        """Run a phase if the deadline leaves `needs_seconds`; record its wall time or its error, then save."""
        if name in self.skip:
            self.data["phases"][name] = self.carried.get(name, {"skipped": "--skip"})
            yield None
            return
        if self.left() < needs_seconds:
            self.log(f"skip {name}: {self.left():.0f} s left, needs ~{needs_seconds:.0f}")
            self.data["phases"][name] = {"skipped": f"deadline: {self.left():.0f} s left, needs ~{needs_seconds:.0f}"}
            self.save()
            yield None
            return
        self.log(f"phase {name}")
        record: dict[str, object] = {}
        self.data["phases"][name] = record
        start = time.perf_counter()
        try:
            yield record
        except Exception as exc:  # noqa: BLE001 - a benchmark keeps what it measured and says what broke
            import traceback

            record["error"] = f"{type(exc).__name__}: {exc}"
            self.data["errors"].append({"phase": name, "error": record["error"], "traceback": traceback.format_exc()[-4000:]})
            self.log(f"phase {name} failed: {record['error']}")
        record["wall_seconds"] = round(time.perf_counter() - start, 3)
        self.save()

    def skip_phase(self, name: str, reason: str) -> None:
        self.log(f"skip {name}: {reason}")
        self.data["phases"][name] = {"skipped": reason}
        self.save()


# -- machine -----------------------------------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only; tmpfs files stay); False where the machine does not allow it."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def io_counters() -> dict[str, int]:
    """Bytes this process read from and wrote to storage (page-cache and tmpfs hits not counted)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


def bandwidth(folder: Path, gib: int, direct: bool = True) -> dict[str, float]:
    """Sequential write then read of `gib` GiB of random bytes in 64 MiB blocks (dd; with O_DIRECT where the file
    system has it, bypassing the page cache; a tmpfs has none and is memory)."""
    folder.mkdir(parents=True, exist_ok=True)
    path, seed = folder / "bandwidth.bin", folder / "seed.bin"
    flags = (["oflag=direct"], ["iflag=direct"]) if direct else ([], [])
    subprocess.run(["dd", "if=/dev/urandom", f"of={seed}", "bs=64M", "count=16", "status=none"], check=True)  # 1 GiB
    start = time.perf_counter()
    for k in range(gib):
        subprocess.run(["dd", f"if={seed}", f"of={path}", "bs=64M", f"seek={16 * k}", "conv=notrunc", *flags[0], "status=none"], check=True)
    subprocess.run(["sync"], check=True)
    write = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", *flags[1], "status=none"], check=True)
    read = time.perf_counter() - start
    path.unlink()
    seed.unlink()
    return {"write_bandwidth_gbps": round(gib * (1 << 30) / write / 1e9, 3), "read_bandwidth_gbps": round(gib * (1 << 30) / read / 1e9, 3)}


def pinned_host_bytes(peak: bool = False) -> int:
    """Page-locked host bytes PyTorch's host allocator holds now (or its peak since the last reset); 0 without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    stats = torch.cuda.host_memory_stats()
    key = next((k for k in stats if re.fullmatch(r"allocated_bytes(\.all)?\." + ("peak" if peak else "current"), k)), None)
    return int(stats[key]) if key else 0


class HostPeak:
    """Host memory between `reset()` calls, sampled every 20 ms: this process's peak resident set, the machine's peak
    memory in use (tmpfs files included) and the host allocator's peak page-locked bytes."""

    def __init__(self) -> None:
        self.peak = self.in_use = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.rss())
            self.in_use = max(self.in_use, host_memory_in_use())

    def reset(self) -> dict[str, int]:
        """The peaks since the last reset; a new window starts."""
        out = {"host_rss_peak_bytes": max(self.peak, self.rss()), "host_in_use_peak_bytes": max(self.in_use, host_memory_in_use()),
               "host_pinned_bytes": max(pinned_host_bytes(peak=True), pinned_host_bytes())}
        self.peak, self.in_use = self.rss(), host_memory_in_use()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_host_memory_stats()
        return out


def merge_host(windows: list[dict[str, int]]) -> dict[str, int]:
    return {k: max((w[k] for w in windows), default=0) for k in ("host_rss_peak_bytes", "host_in_use_peak_bytes", "host_pinned_bytes")}


class DevicePeak:
    """Peak allocated device memory per stage: read and reset at each stage boundary."""

    def __init__(self, devices: list[torch.device]):
        self.devices = [d for d in devices if d.type == "cuda"]

    def reset(self) -> int:
        peak = sum(torch.cuda.max_memory_allocated(d) for d in self.devices)
        for d in self.devices:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
        return peak


def sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


# -- staging: the family, its first use, the pipeline receipt --------------------------------------------------


class Setup:
    """Where this run's parts are: the staged family, the profile, the canvases, the compiled folder, the receipt."""

    def __init__(self, args: argparse.Namespace):
        self.small = args.small
        self.cuda = torch.cuda.is_available() and not self.small
        self.device = "cuda:0" if self.cuda else "cpu"
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        spec = replace(DEMO_FAMILY, text_vocab_size=None, text_layers_written=50) if self.small else STAGED_FAMILY
        self.staged = StagedFamily(args.work, args.shm, spec, self.device)
        self.spec = spec
        self.profile = args.profile or (SMALL_PROFILE if self.small else PROFILE)
        self.adapter = self.staged.lora if get_profile(self.profile).adapter else None
        self.canvases = SMALL_CANVASES if self.small else CANVASES
        self.config = H3Config.preset(spec.transformer)
        # another profile is staged alone: its compile and receipt sit beside the Turbo4 ones under their own names
        self.staged_alone = self.profile not in (PROFILE, SMALL_PROFILE)
        self.suffix = f"-{self.profile}" if self.staged_alone else ""
        self.compiled = self.staged.compiled.with_name(self.staged.compiled.name + self.suffix)
        self.receipt = Path(args.work) / f"pipeline{self.suffix}.json"
        self.out_dir = Path(args.work) / "out"
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def session_paths(self) -> dict[str, Path]:
        return {"artifact": self.compiled / "artifact", "schedule_overlay": self.compiled / "schedule", "auxiliary": self.compiled / "auxiliary.safetensors"}


def stage(run: Run, setup: Setup, measure_storage: bool = True) -> None:
    """The staging plan (printed, recorded, refused when it cannot fit), then every staging phase not yet done;
    `measure_storage`: also the disk's and the tmpfs's bandwidth and the weight reads (`disk`, `weight_io`)."""
    staged = setup.staged
    plan = staged.plan()
    run.log("\n".join(plan.lines()))
    run.data["staging"] = plan.to_dict()
    run.save()
    if plan.problems() and not setup.small:
        raise SystemExit("the family does not fit this machine: " + "; ".join(plan.problems()))

    with run.phase("disk", 60) as rec:
        if rec is not None and measure_storage and not setup.small:
            rec["disk"] = bandwidth(staged.work / "bandwidth", 8)
            rec["tmpfs"] = bandwidth(staged.shm / "bandwidth", 8, direct=False)
            run.data["read_bandwidth_gbps"] = rec["disk"]["read_bandwidth_gbps"]
            run.data["tmpfs_read_bandwidth_gbps"] = rec["tmpfs"]["read_bandwidth_gbps"]
    if setup.compiled.exists() and (setup.compiled / "artifact" / "manifest.json").exists():
        run.log(f"compiled weights found in {setup.compiled}: first use not repeated")
    else:
        with run.phase("family_transformer", 120) as rec:
            if rec is not None:
                rec.update(staged.write_source())
        with run.phase("first_use", 240) as rec:
            if rec is not None:
                first_use(run, setup, rec)
        if measure_storage:
            with run.phase("weight_io", 120) as rec:
                if rec is not None:
                    weight_io(setup, rec)
    staged.remove_source()
    with run.phase("family_rest", 240) as rec:
        if rec is not None:
            rec.update(staged.write_rest())
            run.data.setdefault("setup", {})["disk_after_family"] = shutil.disk_usage(staged.work)._asdict()
            run.data["setup"]["shm_after_family"] = shutil.disk_usage(staged.shm)._asdict()
    if setup.receipt.exists():
        run.log(f"pipeline receipt found: {setup.receipt}")
        return
    with run.phase("prepare_pipeline", 60) as rec:
        if rec is not None:
            from vflash_core.pipeline.assets import prepare_pipeline

            paths = setup.session_paths()
            assets = {"model_root": str(staged.model_root), "decoder_root": str(staged.decoder_root),
                      "adapter_path": str(setup.adapter) if setup.adapter else None,
                      "artifact": str(paths["artifact"]), "schedule_overlay": str(paths["schedule_overlay"]), "auxiliary_tensor": str(paths["auxiliary"])}
            assets_file = staged.work / f"assets{setup.suffix}.json"
            assets_file.write_text(json.dumps(assets))
            prepare_pipeline(setup.profile, assets_file, setup.receipt)


def first_use(run: Run, setup: Setup, rec: dict) -> None:
    from vflash_core.weights.compiler import compile_receipt, prepare

    staged = setup.staged
    rec["page_cache_dropped"] = drop_page_cache()
    weights_receipt = staged.work / f"weights-receipt{setup.suffix}.json"
    io0, t0 = io_counters(), time.perf_counter()
    prepare(setup.profile, staged.source, weights_receipt, adapter=setup.adapter)
    io1, t1 = io_counters(), time.perf_counter()
    compile_receipt(weights_receipt, setup.compiled, setup.device)
    io2, t2 = io_counters(), time.perf_counter()
    source = folder_bytes(staged.source) + (setup.adapter.stat().st_size if setup.adapter else 0)
    artifact = folder_bytes(setup.compiled)
    rec.update({
        "prepare_seconds": round(t1 - t0, 3), "compile_seconds": round(t2 - t1, 3), "first_use_seconds": round(t2 - t0, 3),
        "source_bytes": source, "artifact_bytes": artifact, "source_place": "tmpfs (the disk cannot hold it beside its compile)",
        "prepare_io": {k: io1[k] - io0[k] for k in io0}, "compile_io": {k: io2[k] - io1[k] for k in io1},
    })
    disk = run.data.get("phases", {}).get("disk", {})
    if disk.get("disk"):
        read_s = source / (disk["disk"]["read_bandwidth_gbps"] * 1e9)
        rec["source_read_seconds_at_disk_bandwidth"] = round(read_s, 3)
        rec["first_use_over_one_read"] = round((t2 - t0) / read_s, 3)
        rec["artifact_write_seconds_at_disk_bandwidth"] = round(artifact / (disk["disk"]["write_bandwidth_gbps"] * 1e9), 3)
        rec["source_read_seconds_at_tmpfs_bandwidth"] = round(source / (disk["tmpfs"]["read_bandwidth_gbps"] * 1e9), 3)
    run.data["first_use_seconds"] = rec["first_use_seconds"]


def weight_io(setup: Setup, rec: dict) -> None:
    from vflash_core.engine import weight_io as wio
    from vflash_core.engine.artifact import CompiledArtifact

    artifact = CompiledArtifact(**{k: v for k, v in zip(("artifact", "schedule_overlay", "auxiliary"), setup.session_paths().values())})
    sample = min(5, artifact.config.num_layers)
    files = [artifact.artifact_dir / b["file"] for b in artifact.manifest["blocks"][:sample]]
    nbytes = sum(f.stat().st_size for f in files)
    rec["sample_blocks"], rec["sample_bytes"] = sample, nbytes
    drop_page_cache()
    t = time.perf_counter()
    for _ in zip(range(sample), artifact.iter_blocks()):
        pass
    rec["session_block_reader_gbps"] = round(nbytes / (time.perf_counter() - t) / 1e9, 3)
    sequential = {}
    for workers in (1, 2, 4, 8):
        drop_page_cache()
        t = time.perf_counter()
        for f in files:
            with wio.SequentialWeights(f, read_workers=workers) as w:
                w.read_all()
        sequential[workers] = round(nbytes / (time.perf_counter() - t) / 1e9, 3)
    rec["sequential_weights_gbps_by_workers"] = sequential


# -- Vflash --------------------------------------------------------------------------------------------------------


def vflash_requests(run: Run, pipe, config_name: str, canvases: list[str], count: int, host: HostPeak, out_dir: Path, **extra: object) -> list[dict]:
    """`count` requests per canvas through `H3Pipeline.generate`, each with its stages, per-stage device peaks, host
    memory and its MP4's sha256."""
    from vflash_core.pipeline.validation import VideoRequest

    device_peak = DevicePeak(pipe.session.devices if pipe.session is not None else [])
    records = []
    for canvas in canvases:
        width, height = (int(v) for v in canvas.split("x"))
        for k in range(count):
            peaks: dict[str, int] = {}
            hosts: list[dict[str, int]] = []

            def progress(stage: str, done: int, total: int) -> None:
                name = {"encode": "encode", "denoise": "denoise", "write": "mp4"}.get(stage)
                if stage == "decode":
                    name = "video_decode" if done == 1 else "audio_decode"
                if stage == "denoise" and done < total:
                    return
                if name is not None:
                    peaks[name] = device_peak.reset()  # noqa: B023 - called within the iteration
                    hosts.append(host.reset())  # noqa: B023 - called within the iteration

            device_peak.reset()
            host.reset()
            request = VideoRequest(PROMPT, seed=REQUEST_SEED, width=width, height=height)
            output = out_dir / f"{config_name}-{canvas}-{k}.mp4"
            result = pipe.generate(request, output, progress=progress)
            digest = sha256(output)
            output.unlink()
            s = result.stages
            stages = {
                "text_encode": s.get("encode.text", 0.0), "vae_encode": s.get("encode.vae", 0.0), "denoise": s["denoise"],
                "video_decode": s["decode.video"], "audio_decode": s["decode.audio"], "mp4": s["write"],
            }
            record = {
                "side": "vflash", "config": config_name, "canvas": canvas, "mode": result.mode, "seconds": round(result.num_frames / result.fps, 3),
                "index": k, "warm": k > 0, "elapsed_seconds": round(result.elapsed_seconds, 3), "stages": {k2: round(v, 3) for k2, v in stages.items()},
                "stages_raw": {k2: round(v, 3) for k2, v in s.items()},
                "peak_device_bytes": {"text_encode": peaks.get("encode"), "denoise": peaks.get("denoise"), "video_decode": peaks.get("video_decode"),
                                      "audio_decode": peaks.get("audio_decode"), "mp4": peaks.get("mp4")},
                **merge_host(hosts), "mp4_sha256": digest,
                "session": {"request_wall_seconds": round(result.timing.request_wall_seconds, 3)},
                "attention_backend": result.metadata.get("attention_backend"), "weight_residency": result.metadata.get("weight_residency"),
                "encoder_residency": result.metadata.get("encoder_residency"), "devices": result.metadata.get("devices"),
                "memory_plan": pipe.session.plan.summary() if pipe.session.plan is not None else None, **extra,
            }
            records.append(record)
            run.data["requests"].append(record)
            run.log(f"vflash {config_name} {canvas} #{k}: {result.elapsed_seconds:.2f} s (denoise {s['denoise']:.2f}, decode {s['decode']:.2f}, "
                    f"MP4 {s['write']:.2f}); host pinned {record['host_pinned_bytes'] / 2**30:.1f} GiB, in use {record['host_in_use_peak_bytes'] / 2**30:.1f} GiB")
            run.save()
    return records


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def stage_digests(pipe, canvas: str) -> dict[str, str]:
    """sha256 of each stage's output for the benchmark's request at `canvas`, run stage by stage through the
    pipeline (untimed): the bundle (prompt embeddings and packed rows with the noise), the final latents, the frames
    and the waveform. Where two placements' MP4s differ, the first differing digest names the stage."""
    from vflash_core.pipeline.validation import VideoRequest

    width, height = (int(v) for v in canvas.split("x"))
    bundle = pipe.encode(VideoRequest(PROMPT, seed=REQUEST_SEED, width=width, height=height)).consume()
    digests = {"prompt_embeds": tensor_sha256(bundle.prompt_embeds), "video_rows": tensor_sha256(bundle.video_rows), "audio_rows": tensor_sha256(bundle.audio_rows)}
    result = pipe.denoise(bundle)
    digests.update(video_latents=tensor_sha256(result.video_latents), audio_latents=tensor_sha256(result.audio_latents))
    media = pipe.decode(result.video_latents, result.audio_latents)
    digests.update(frames=tensor_sha256(media.frames), waveform=tensor_sha256(media.waveform))
    return digests


def denoise_overhead(pipe, canvas: str, blocks: int) -> dict[str, object]:
    """One warm request's denoise at `canvas` through the pipeline's session with per-stage device timings
    (`profile_denoise`): its wall time against evaluations x blocks x the request's own mean per-block device time,
    and where the rest went (the per-evaluation stages outside the blocks; the remainder is host time: the request's
    setup, waits and the copies back)."""
    from vflash_core.pipeline.validation import VideoRequest

    width, height = (int(v) for v in canvas.split("x"))
    bundle = pipe.encode(VideoRequest(PROMPT, seed=REQUEST_SEED, width=width, height=height)).consume()
    result = pipe.session.generate(bundle, profile_denoise=True)
    profile = result.denoise_profile
    totals, evaluations = profile["total_ms"], len(profile["evaluations"])
    wall = result.timing.request_wall_seconds
    per_block_ms = totals["blocks"] / (evaluations * blocks)
    outside = {name: round(ms, 1) for name, ms in totals.items() if name in ("pack_inputs", "final_layer", "latent_update")}
    return {
        "canvas": canvas, "evaluations": evaluations, "blocks": blocks, "wall_seconds": round(wall, 3),
        "per_block_ms": round(per_block_ms, 3), "blocks_seconds": round(totals["blocks"] / 1e3, 3),
        "evaluation_stages_outside_blocks_ms": outside,
        "unaccounted_seconds": round(wall - (totals["blocks"] + sum(outside.values())) / 1e3, 3),
        "overhead_over_blocks": round(wall / (totals["blocks"] / 1e3) - 1, 4),
        "per_block_ms_by_evaluation": [round(e["blocks"] / blocks, 3) for e in profile["evaluations"]],
    }


def load_pipeline(run: Run, receipt: Path, record: dict, host: HostPeak | None = None, text_encoder_loader=None, **options):
    from vflash_core.pipeline.h3_pipeline import H3Pipeline
    from vflash_core.pipeline.options import RunOptions

    pipe = H3Pipeline.from_prepared(receipt, RunOptions(**options), text_encoder_loader=text_encoder_loader)
    if host is not None:
        host.reset()
    start = time.perf_counter()
    pipe.load()
    record["initialization_seconds"] = round(pipe.initialization_seconds, 3)
    record["session_initialization_seconds"] = round(pipe.session.initialization_seconds, 3)
    record["load_wall_seconds"] = round(time.perf_counter() - start, 3)
    record["session_memory_plan"] = pipe.session.memory_plan()
    record["memory_plan"] = pipe.session.plan.summary() if pipe.session.plan is not None else None
    if host is not None:
        record["load_host"] = host.reset()
    run.log(f"pipeline {options} ready in {pipe.initialization_seconds:.1f} s (session {pipe.session.initialization_seconds:.1f} s): {record['memory_plan']}")
    return pipe


# -- diffusers -----------------------------------------------------------------------------------------------------


def diffusers_transformer(config: H3Config, device: str):
    """`MiniMaxH3Transformer3DModel` with the weights the family's transformer file holds, built in device memory."""
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel

    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(config.to_dict())
    weights = synthetic.RandomWeights(config, seed=SEED, device=device)
    state = {}
    for name in weights:
        tensor = weights[name]
        for out, rows in synthetic.diffusers_names(name, config):
            state[out] = tensor[rows].clone() if rows != slice(None) else tensor
        del tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


def qwen_processor(root: Path):
    """The family's `Qwen3VLProcessor`; without torchvision (a CPU dry run) the same class minus its video processor."""
    from transformers import AutoImageProcessor, Qwen2TokenizerFast, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(root / "processor")

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyQwen3VLProcessor(AutoImageProcessor.from_pretrained(root / "processor"), Qwen2TokenizerFast.from_pretrained(root / "tokenizer"))


def diffusers_pipeline(root: Path, lora: Path, config: H3Config, profile, device: str, largest_rows: int, record: dict):
    from diffusers import MiniMaxH3Scheduler, ModularPipeline

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    pipe = ModularPipeline.from_pretrained(str(root))
    pipe.load_components(names=["text_encoder", "vae", "audio_vae", "tokenizer"], torch_dtype=dtype)
    # The Turbo4 profile's schedule: its own video shift (the family's scheduler folders hold the base model's 12).
    pipe.update_components(
        processor=qwen_processor(root), transformer=diffusers_transformer(config, device),
        scheduler=MiniMaxH3Scheduler(profile.video_shift), audio_scheduler=MiniMaxH3Scheduler(profile.audio_shift),
    )
    pipe.load_lora_weights(str(lora))
    pipe.set_progress_bar_config(disable=True)
    sizes = {name: sum(p.numel() * p.element_size() for p in getattr(pipe, name).parameters()) for name in ("text_encoder", "transformer", "vae", "audio_vae")}
    record["component_bytes"] = sizes
    offload = None
    if device.startswith("cuda"):
        from vflash_core.engine.denoise import denoise_bytes

        free = torch.cuda.mem_get_info(0)[0] + sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
        need = sum(sizes.values()) + denoise_bytes(config, largest_rows) + (12 << 30)
        if need <= free:
            for name in ("text_encoder", "vae", "audio_vae"):
                getattr(pipe, name).to(device)
            record["placement"] = "all components on the GPU"
        else:
            from accelerate import cpu_offload_with_hook

            for name in ("vae", "audio_vae"):
                getattr(pipe, name).to(device)
            _, offload = cpu_offload_with_hook(pipe.text_encoder, execution_device=device)
            record["placement"] = (
                f"text encoder on the CPU, moved to the GPU for its stage by accelerate's offload hook (all components need "
                f"{need / 2**30:.1f} GiB with the largest request and 12 GiB spare; {free / 2**30:.1f} GiB available)"
            )
    return pipe, offload


def diffusers_request(run: Run, pipe, offload, canvas: str, index: int, host: HostPeak, out_dir: Path, nfe: int, config_name: str = "diffusers") -> dict[str, torch.Tensor]:
    """One request through the modular pipeline's blocks, one block at a time (each stage timed, its peak read);
    returns its final video and audio latents."""
    from diffusers.modular_pipelines import PipelineState

    from vflash_core.media.mp4 import write_mp4

    width, height = (int(v) for v in canvas.split("x"))
    kwargs = dict(prompt=PROMPT, num_inference_steps=nfe + 1, generator=torch.Generator().manual_seed(REQUEST_SEED), height=height, width=width, num_frames=124, output_type="pt")
    device = pipe._execution_device
    cuda = device.type == "cuda"
    peak = DevicePeak([device])
    state = PipelineState()
    blocks = pipe._blocks
    for param in blocks.inputs:
        if param.name in kwargs:
            state.set(param.name, kwargs[param.name], param.kwargs_type)
        elif param.name is not None and param.name not in state.values:
            state.set(param.name, param.default, param.kwargs_type)
    stages: dict[str, float] = {}
    peaks: dict[str, int] = {}
    hosts: list[dict[str, int]] = []
    peak.reset()
    host.reset()
    start = time.perf_counter()

    def timed(name: str, block) -> None:
        nonlocal state
        t = time.perf_counter()
        with torch.no_grad():
            _, state = block(pipe, state)
        if cuda:
            torch.cuda.synchronize(device)
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - t
        peaks[name] = max(peaks.get(name, 0), peak.reset())
        hosts.append(host.reset())

    names = {"before_encode": "vae_encode", "text_encoder": "text_encode", "vae_encoder": "vae_encode", "denoise": "denoise"}
    for block_name, block in blocks.sub_blocks.items():
        if block_name == "decode":
            for sub_name, sub in block.sub_blocks.items():
                timed("video_decode" if sub_name == "video" else "audio_decode", sub)
            continue
        timed(names[block_name], block)
        if block_name == "text_encoder" and offload is not None:
            t = time.perf_counter()
            offload.offload()
            stages["text_encode"] += time.perf_counter() - t
    latents = {"video": state.get("latents").cpu(), "audio": state.get("audio_latents").cpu()}
    t = time.perf_counter()
    videos, audio, rate = state.get("videos"), state.get("audio"), int(state.get("sampling_rate"))
    frames = videos[0].permute(0, 2, 3, 1).float().cpu()
    samples = round(frames.shape[0] / 24 * rate)
    output = out_dir / f"diffusers-{canvas}-{index}.mp4"
    write_mp4(output, frames, audio[0].float().cpu()[:, :samples], rate, 24)
    output.unlink()
    stages["mp4"] = time.perf_counter() - t
    peaks["mp4"] = peak.reset()
    hosts.append(host.reset())
    elapsed = time.perf_counter() - start
    record = {
        "side": "diffusers", "config": config_name, "canvas": canvas, "mode": "t2va", "index": index, "warm": index > 0,
        "elapsed_seconds": round(elapsed, 3), "stages": {k: round(stages.get(k, 0.0), 3) for k in STAGES},
        "peak_device_bytes": {k: peaks.get(k) for k in STAGES}, **merge_host(hosts),
    }
    run.data["requests"].append(record)
    run.log(f"diffusers {canvas} #{index}: {elapsed:.2f} s (denoise {stages['denoise']:.2f}, video decode {stages['video_decode']:.2f})")
    run.save()
    return latents


def encode_alone(setup: Setup):
    """The bitwise request's encoding without a pipeline (a run that skipped the resident phase)."""
    from vflash_core.engine.layout import Geometry
    from vflash_core.media.conditioning import TextConditioner
    from vflash_core.pipeline.steps import encode_request

    width, height = (int(v) for v in setup.canvases[1].split("x"))
    conditioner = TextConditioner.from_pretrained(setup.staged.model_root, setup.device)
    try:
        return encode_request(conditioner, None, PROMPT, "t2va", Geometry(height, width, 124))
    finally:
        conditioner.close()


def bitwise(run: Run, setup: Setup, encoded, rec: dict) -> None:
    """Vflash's final latents (cuDNN attention) against diffusers' core denoise step on the same prompt embeddings,
    canvas and seed; diffusers' transformer is rebuilt in device memory from the family's seed."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    from vflash_core.engine.session import NativeEngineSession

    profile = get_profile(setup.profile)
    width, height = (int(v) for v in setup.canvases[1].split("x"))
    t = time.perf_counter()
    session = NativeEngineSession(profile, CompiledPaths(**setup.session_paths()), EngineOptions(device=setup.device, attention_backend=BITWISE_ATTENTION if setup.cuda else "auto"))
    try:
        result = session.generate(encoded.bundle(setup.config, REQUEST_SEED))
        rec["vflash_attention_backend"] = result.metadata["attention_backend"]
    finally:
        session.close()
        gc.collect()
        if setup.cuda:
            torch.cuda.empty_cache()
    rec["vflash_seconds"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=diffusers_transformer(setup.config, setup.device), scheduler=MiniMaxH3Scheduler(profile.video_shift),
                           audio_scheduler=MiniMaxH3Scheduler(profile.audio_shift))
    # The step reads the latent geometry (channels, compression) from VAEs it does not take as components, with the
    # released VAEs' values as defaults: the family's configs on the meta device give it the same numbers at full size
    # and the demo family's in a dry run.
    with torch.device("meta"):
        pipe.vae = AutoencoderKLMiniMaxH3.from_config(AutoencoderKLMiniMaxH3.load_config(setup.staged.decoder_root / "vae"))
        pipe.audio_vae = AutoencoderKLMiniMaxH3Audio.from_config(AutoencoderKLMiniMaxH3Audio.load_config(setup.staged.decoder_root / "audio_vae"))
    pipe.load_lora_weights(str(setup.staged.lora))
    pipe.set_progress_bar_config(disable=True)
    rec["diffusers_build_seconds"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    try:
        out = pipe(
            prompt_embeds=encoded.prompt_embeds[None].to(setup.device), text_token_tags=encoded.token_tags, num_inference_steps=profile.nfe + 1,
            generator=torch.Generator().manual_seed(REQUEST_SEED), height=height, width=width, num_frames=encoded.geometry.num_frames,
            output=["latents", "audio_latents"],
        )
        video, audio = out["latents"].cpu(), out["audio_latents"].cpu()
    finally:
        del pipe
        gc.collect()
        if setup.cuda:
            torch.cuda.empty_cache()
    rec["diffusers_seconds"] = round(time.perf_counter() - t, 3)
    same = video.shape == result.video_latents.shape and torch.equal(result.video_latents, video.to(result.video_latents.dtype)) \
        and audio.shape == result.audio_latents.shape and torch.equal(result.audio_latents, audio.to(result.audio_latents.dtype))
    rec.update({
        "canvas": setup.canvases[1], "seconds": round(encoded.geometry.num_frames / 24, 3), "diffusers_attention": "SDPA" + (" (cuDNN on this GPU)" if setup.cuda else ""),
        "dtypes": [str(result.video_latents.dtype), str(video.dtype)], "bitwise_equal_to_diffusers": same,
        "video_max_abs_diff": float((result.video_latents.double() - video.double()).abs().max()) if video.shape == result.video_latents.shape else None,
        "audio_max_abs_diff": float((result.audio_latents.double() - audio.double()).abs().max()) if audio.shape == result.audio_latents.shape else None,
    })
    run.data["bitwise_equal_to_diffusers"] = same
    run.log(f"bitwise at {setup.canvases[1]}: {same} (max abs diff video {rec['video_max_abs_diff']}, audio {rec['audio_max_abs_diff']})")


# -- summary -------------------------------------------------------------------------------------------------------


def summarize(run: Run, diffusers_from: Path | None) -> None:
    """Warm medians per (side, config, canvas) and the diffusers / Vflash ratios of elapsed time and of each stage;
    the diffusers medians of this run, else those of `diffusers_from` (named in `diffusers_reference`)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in run.data["requests"]:
        if r["warm"]:
            groups.setdefault((r["side"], r["config"], r["canvas"]), []).append(r)
    reference_requests = [r for r in run.data["requests"] if r["side"] == "diffusers"]
    if not reference_requests and diffusers_from is not None and diffusers_from.exists():
        earlier = json.loads(diffusers_from.read_text())
        reference_requests = [r for r in earlier["requests"] if r["side"] == "diffusers" and r["warm"]]
        run.data["diffusers_reference"] = {
            "file": diffusers_from.name, "commit": earlier["commit"], "gpu": earlier["gpu"], "gpus": earlier.get("setup", {}).get("gpus"),
            "note": "diffusers' side of an earlier run on the same family, request and seed (its text encoder offloaded by accelerate, "
                    "needing a host copy this machine cannot hold beside the staged files)",
        }
        for r in reference_requests:
            groups.setdefault((r["side"], r["config"], r["canvas"]), []).append(r)
    medians = {}
    for (side, config, canvas), rs in groups.items():
        medians[(side, config, canvas)] = {
            "side": side, "config": config, "canvas": canvas, "warm_requests": len(rs),
            "elapsed_seconds": round(statistics.median(r["elapsed_seconds"] for r in rs), 3),
            "stages": {s: round(statistics.median(r["stages"][s] for r in rs), 3) for s in STAGES},
            "peak_device_bytes": {s: max((r["peak_device_bytes"].get(s) or 0) for r in rs) for s in STAGES},
            **{k: max(r.get(k) or 0 for r in rs) for k in ("host_rss_peak_bytes", "host_in_use_peak_bytes", "host_pinned_bytes")},
        }
    for key, m in medians.items():
        reference = medians.get(("diffusers", "diffusers", key[2]))
        if key[0] == "vflash" and reference:
            m["speedup_elapsed_vs_diffusers"] = round(reference["elapsed_seconds"] / m["elapsed_seconds"], 3)
            m["stage_speedup_vs_diffusers"] = {s: round(reference["stages"][s] / m["stages"][s], 3) for s in STAGES if m["stages"][s] > 0 and reference["stages"][s] > 0}
    run.data["summary"] = list(medians.values())


# -- main ----------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder on the disk (compiled weights, VAEs); kept for a resumed run")
    parser.add_argument("--shm", type=Path, required=True, help="folder on a tmpfs (transformer source, text encoder)")
    parser.add_argument("--deadline-minutes", type=float, default=20.0)
    parser.add_argument("--small", action="store_true", help="dry run: demo-sized family on the CPU")
    parser.add_argument("--profile", help=f"the profile staged (default {PROFILE}, {SMALL_PROFILE} with --small); another "
                        "one (e.g. i2va-base16-bf16-sm90, for fast_mode.py's e2e phase) is staged beside it and nothing else runs")
    parser.add_argument("--fresh", action="store_true", help="empty --work and --shm first (else staged parts are reused)")
    parser.add_argument("--warm-requests", type=int, default=WARM_REQUESTS, help="requests after the first, per canvas and pipeline")
    parser.add_argument("--skip", nargs="*", default=[], help="phases to leave out, e.g. weight_io vflash_block_ring")
    parser.add_argument("--carry-from", type=Path,
                        help="an earlier run's result file whose records of the --skip phases this run keeps (marked with their commit; "
                        "default: this GPU's committed end_to_end_<gpu>.json)")
    parser.add_argument("--diffusers-from", type=Path, default=ROOT / "benchmarks" / "results" / "end_to_end_2xh200.json",
                        help="an earlier run's result file whose diffusers requests the summary compares with when this run has none")
    args = parser.parse_args()
    if args.fresh:
        shutil.rmtree(args.work, ignore_errors=True)
        shutil.rmtree(args.shm, ignore_errors=True)
    setup = Setup(args)
    warm = args.warm_requests
    name = "end_to_end_small" if setup.small else f"end_to_end_{gpu_tag()}"
    run = Run(name, time.perf_counter() + args.deadline_minutes * 60, setup.small, tuple(args.skip))
    run.carry_skipped(args.carry_from or ROOT / "benchmarks" / "results" / f"{name}.json", "requests", lambda r: "diffusers" if r["side"] == "diffusers" else f"vflash_{r['config']}",
                      {"bitwise": ("bitwise_equal_to_diffusers",), "vflash_resident": ("stage_digests",)})
    host = HostPeak()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's default; both sides run in this process
    run.data["setup"] = {
        "family": "demo (dry run)" if setup.small else "full size: see benchmarks/full_family.py",
        "text_encoder": {"layers": setup.spec.text["num_hidden_layers"], "written": setup.spec.text_layers_written, "hidden_size": setup.spec.text["hidden_size"],
                         "read_by_h3": "hidden_states[50] (Vflash loads the embeddings, the vision tower and layers 0..49)"},
        "profile": setup.profile, "prompt": PROMPT, "seed": REQUEST_SEED, "gpus": setup.gpus, "warm_requests": warm,
        "cpu_count": os.cpu_count(), "host_memory_bytes": host_memory_bytes(),
    }
    stage(run, setup)
    if setup.staged_alone:
        run.log(f"staged {setup.profile}: {setup.receipt} (its requests are timed elsewhere, e.g. fast_mode.py --phases e2e)")
        run.save()
        return
    canvases, out_dir, receipt = setup.canvases, setup.out_dir, setup.receipt
    resident = dict(device=setup.device, encoder_residency="resident", weight_residency="resident" if setup.cuda else "auto")

    encoded = None
    with run.phase("vflash_resident", 300) as rec:
        if rec is not None:
            from vflash_core.engine.layout import Geometry
            from vflash_core.pipeline.steps import encode_request

            rec["page_cache_dropped"] = drop_page_cache()
            io0 = io_counters()
            pipe = load_pipeline(run, receipt, rec, host, **resident)
            rec["initialization_io"] = {k: io_counters()[k] - io0[k] for k in io0}
            try:
                vflash_requests(run, pipe, "resident", canvases, 1 + warm, host, out_dir)
                run.data["stage_digests"] = {canvases[0]: stage_digests(pipe, canvases[0])}  # memory_caps.py's uncapped twin
                rec["denoise_overhead"] = denoise_overhead(pipe, canvases[0], setup.config.num_layers)
                run.log(f"denoise overhead at {canvases[0]}: {rec['denoise_overhead']}")
                width, height = (int(v) for v in canvases[1].split("x"))
                encoded = encode_request(pipe.conditioner, pipe.vaes, PROMPT, "t2va", Geometry(height, width, 124))
            finally:
                pipe.close()
                gc.collect()

    with run.phase("bitwise", 180) as rec:
        if rec is not None:
            bitwise(run, setup, encoded or encode_alone(setup), rec)

    # (name, pipeline options, canvases, warm requests, seconds it needs), most wanted first: the deadline drops the rest.
    variants = [("encoder_offload", dict(resident, encoder_residency="offload"), canvases, warm, 200)]
    if setup.cuda:
        variants.append(("block_ring", dict(resident, weight_residency="block-ring"), canvases, warm, 200))
    if setup.gpus >= 2:
        variants.append(("two_gpu_sequence_head", dict(resident, peer_device="cuda:1", strategy="sequence-head"), canvases[:1], warm, 200))
    for name, options, shapes, count, needs in variants:
        with run.phase(f"vflash_{name}", needs) as rec:
            if rec is not None:
                pipe = load_pipeline(run, receipt, rec, host, **options)
                try:
                    vflash_requests(run, pipe, name, shapes, 1 + count, host, out_dir)
                finally:
                    pipe.close()
                    gc.collect()

    if setup.spec.text_layers_written is not None:
        run.skip_phase("diffusers", f"the staged text encoder holds only what H3 reads (layers 0..{setup.spec.text_layers_written - 1}); diffusers' "
                       "pipeline loads all 64 layers, and its offloaded text encoder needs a host copy of ~62 GiB that this machine's host memory "
                       "cannot hold beside the staged files")
    else:
        with run.phase("diffusers", 420) as rec:
            if rec is not None:
                from vflash_core.engine.layout import largest_request_rows

                profile = get_profile(setup.profile)
                root = setup.staged.model_root
                pipe, offload = diffusers_pipeline(root, setup.staged.lora, setup.config, profile, setup.device, largest_request_rows(profile, setup.config), rec)
                try:
                    for canvas in canvases:
                        for k in range(1 + max(1, warm - 1)):
                            diffusers_request(run, pipe, offload, canvas, k, host, out_dir, profile.nfe)
                finally:
                    del pipe
                    gc.collect()

    run.data["initialization_seconds"] = {
        "cold_page_cache" if phase == "vflash_resident" else f"warm_page_cache_{phase.removeprefix('vflash_')}": rec["initialization_seconds"]
        for phase, rec in run.data["phases"].items() if phase.startswith("vflash_") and "initialization_seconds" in rec
    }
    run.data["not_measured"] = {"i2va": "a keyframe request needs a keyframe profile's own compile (another ~39 GiB and ~2 minutes of the machine): "
                                        "--profile i2va-base16-bf16-sm90 stages one alone, for fast_mode.py's e2e phase"}
    staged = setup.staged
    run.data["loaded_bytes"] = {"artifact": folder_bytes(setup.compiled) if setup.compiled.exists() else 0,
                                "text_encoder_files": sum(p.stat().st_size for p in staged.text_encoder_files()),
                                "vaes": folder_bytes(staged.decoder_root / "vae") + folder_bytes(staged.decoder_root / "audio_vae") if (staged.decoder_root / "vae").exists() else 0}
    summarize(run, args.diffusers_from)
    run.save()
    run.log("done")


if __name__ == "__main__":
    main()
