"""The real model at its real size, prompt to MP4: Vflash's `H3Pipeline` against diffusers 0.42.1's modular pipeline.

    python benchmarks/end_to_end.py --work /data/e2e [--deadline-minutes 24] [--small]

One process, one machine with two H200s. The full-size random family of `full_family.py` (66.3 GB transformer,
Turbo4 LoRA, 66.7 GB Qwen3-VL-32B-shaped text encoder, both released VAEs) is written, then, phase by phase (each
records its numbers in the result file as soon as it ends, so a run stopped by its deadline keeps what it measured):

1. `disk`: sequential write and read bandwidth of the work folder's disk (dd with O_DIRECT, 8 GiB).
2. `first_use`: the transformer source and the LoRA are written, the page cache is dropped, then `prepare` (hashes
   every source byte) and `compile` for `t2va-turbo4-exact-sm90` run as a user's first use does; wall time, bytes the
   process read from and wrote to storage (/proc/self/io), against the time to read the source once at the measured
   bandwidth.
3. `weight_io`: cold reads of compiled block files through the session's block reader and with 1/2/4/8 read workers
   through `weight_io.SequentialWeights`, the Zstandard sidecar's size ratio and a cold read through it.
4. The transformer source is removed (the disk holds the source and its compiled copy, or the compiled copy and the
   text encoder, not all three); the text encoder, tokenizer, processor, VAEs and index are written.
5. `vflash`: pipelines over the prepared assets, each a warm pipeline serving one first request and then three more
   (the median of those is reported): 1344x768 and 960x544 5 s t2va with the text encoder and VAEs resident and
   resident weights (its first load from a dropped page cache: cold initialization); then, each loaded anew from a
   warm page cache, the text encoder and VAEs offloaded between stages (the default; 1344x768, two warm requests),
   two GPUs with sequence-head (1344x768), and block-ring weights (960x544).
6. `diffusers`: the modular pipeline with the same text encoder, VAEs, processor and schedulers loaded from the
   family's folders, the transformer rebuilt in GPU memory from the same seed (equal to the file that was compiled:
   the source is gone from the disk by then), the same LoRA file through `load_lora_weights`, default settings (SDPA
   attention, which picks cuDNN here), everything on the GPU when it fits beside the largest request with 12 GiB
   spare, else the text encoder on the CPU with accelerate's offload hook. Its blocks run one at a time so each stage
   is timed and its peak memory read; the MP4 is written with the same muxer. A first request and two more per canvas.
7. `bitwise`: a Vflash session on cuDNN attention denoises the 960x544 request's bundle; its final latents are compared
   with diffusers' bit for bit.

Every request record carries `canvas`, `mode`, `side`, `config`, `elapsed_seconds`, `stages` (text_encode,
vae_encode, denoise, video_decode, audio_decode, mp4), `peak_device_bytes` per stage and `host_rss_peak_bytes`.
`speedup_elapsed_vs_diffusers` and `stage_speedup_vs_diffusers` compare warm medians. `--small` runs the same phases
on the demo-sized family on the CPU (a dry run of the script; its numbers mean nothing).

Writes benchmarks/results/end_to_end_h200.json (end_to_end_small.json with --small).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, write_result  # noqa: E402
from full_family import FULL_FAMILY, SEED, TURBO4_LORA, write_turbo4_lora  # noqa: E402

from vflash_core.engine.config import H3Config  # noqa: E402
from vflash_core.weights import synthetic  # noqa: E402
from vflash_core.weights.family import DEMO_FAMILY, FamilySpec, build_model_family  # noqa: E402

PROMPT = "A robot dances in the rain on a neon street at night, drums and bass play, the camera slowly pans left."
REQUEST_SEED = 1234
WARM_REQUESTS = 3
STAGES = ("text_encode", "vae_encode", "denoise", "video_decode", "audio_decode", "mp4")


class Run:
    """The result file, written after every phase, and the deadline phases check before they start."""

    def __init__(self, name: str, deadline: float, small: bool, skip: tuple[str, ...] = ()):
        self.name, self.deadline, self.small, self.skip = name, deadline, small, skip
        self.data: dict[str, object] = {**environment(), "small": small, "phases": {}, "requests": [], "errors": []}
        self.start = time.perf_counter()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)

    def save(self) -> None:
        write_result(self.name, self.data)

    @contextmanager
    def phase(self, name: str, needs_seconds: float):
        """Run a phase if the deadline leaves `needs_seconds`; record its wall time or its error, then save."""
        if name in self.skip:
            self.data["phases"][name] = {"skipped": "--skip"}
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


# -- machine -----------------------------------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only); False where the machine does not allow it."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def io_counters() -> dict[str, int]:
    """Bytes this process read from and wrote to storage (page-cache hits not counted)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def disk_bandwidth(folder: Path, gib: int) -> dict[str, float]:
    """Sequential write then read of `gib` GiB of random bytes in 64 MiB blocks with O_DIRECT (dd), page cache bypassed."""
    path, seed = folder / "bandwidth.bin", folder / "seed.bin"
    subprocess.run(["dd", "if=/dev/urandom", f"of={seed}", "bs=64M", "count=16", "status=none"], check=True)  # 1 GiB
    start = time.perf_counter()
    for k in range(gib):
        subprocess.run(["dd", f"if={seed}", f"of={path}", "bs=64M", f"seek={16 * k}", "conv=notrunc", "oflag=direct", "status=none"], check=True)
    subprocess.run(["sync"], check=True)
    write = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct", "status=none"], check=True)
    read = time.perf_counter() - start
    path.unlink()
    seed.unlink()
    return {"write_bandwidth_gbps": round(gib * (1 << 30) / write / 1e9, 3), "read_bandwidth_gbps": round(gib * (1 << 30) / read / 1e9, 3)}


class HostPeak:
    """Peak resident set size of this process between `reset()` calls, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = 0
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

    def reset(self) -> int:
        """Return the peak since the last reset and start a new window."""
        peak, self.peak = max(self.peak, self.rss()), self.rss()
        return peak


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


# -- Vflash --------------------------------------------------------------------------------------------------------


def vflash_requests(run: Run, pipe, config_name: str, canvases: list[str], count: int, host: HostPeak, out_dir: Path) -> list[dict]:
    """`count` requests per canvas through `H3Pipeline.generate`, each with its stages and per-stage peaks."""
    from vflash_core.pipeline.h3_pipeline import VideoRequest

    device_peak = DevicePeak(pipe.session.devices if pipe.session is not None else [])
    records = []
    for canvas in canvases:
        width, height = (int(v) for v in canvas.split("x"))
        for k in range(count):
            peaks: dict[str, int] = {}
            hosts: dict[str, int] = {}

            def progress(stage: str, done: int, total: int) -> None:
                name = {"encode": "encode", "denoise": "denoise", "write": "mp4"}.get(stage)
                if stage == "decode":
                    name = "video_decode" if done == 1 else "audio_decode"
                if stage == "denoise" and done < total:
                    return
                if name is not None:
                    peaks[name] = device_peak.reset()
                    hosts[name] = host.reset()

            device_peak.reset()
            host.reset()
            request = VideoRequest(PROMPT, seed=REQUEST_SEED, width=width, height=height)
            output = out_dir / f"{config_name}-{canvas}-{k}.mp4"
            result = pipe.generate(request, output, progress=progress)
            output.unlink()
            s = result.stages
            stages = {
                "text_encode": s.get("encode.text", 0.0), "vae_encode": s.get("encode.vae", 0.0), "denoise": s["denoise"],
                "video_decode": s["decode.video"], "audio_decode": s["decode.audio"], "mp4": s["write"],
            }
            record = {
                "side": "vflash", "config": config_name, "canvas": canvas, "mode": result.mode, "index": k, "warm": k > 0,
                "elapsed_seconds": round(result.elapsed_seconds, 3), "stages": {k2: round(v, 3) for k2, v in stages.items()},
                "stages_raw": {k2: round(v, 3) for k2, v in s.items()},
                "peak_device_bytes": {"text_encode": peaks.get("encode"), "denoise": peaks.get("denoise"), "video_decode": peaks.get("video_decode"),
                                      "audio_decode": peaks.get("audio_decode"), "mp4": peaks.get("mp4")},
                "host_rss_peak_bytes": max(hosts.values(), default=0),
                "session": {"request_wall_seconds": round(result.session.request_wall_seconds, 3)},
                "attention_backend": result.metadata.get("attention_backend"), "weight_residency": result.metadata.get("weight_residency"),
                "encoder_residency": result.metadata.get("encoder_residency"), "devices": result.metadata.get("devices"),
            }
            records.append(record)
            run.data["requests"].append(record)
            run.log(f"vflash {config_name} {canvas} #{k}: {result.elapsed_seconds:.2f} s (denoise {s['denoise']:.2f}, decode {s['decode']:.2f})")
            run.save()
    return records


def load_pipeline(run: Run, receipt: Path, record: dict, **options):
    from vflash_core.pipeline.h3_pipeline import H3Pipeline
    from vflash_core.pipeline.options import RunOptions

    pipe = H3Pipeline.from_prepared(receipt, RunOptions(**options))
    start = time.perf_counter()
    pipe.load()
    record["initialization_seconds"] = round(pipe.initialization_seconds, 3)
    record["session_initialization_seconds"] = round(pipe.session.initialization_seconds, 3)
    record["load_wall_seconds"] = round(time.perf_counter() - start, 3)
    record["memory_plan"] = pipe.session.memory_plan()
    run.log(f"pipeline {options} ready in {pipe.initialization_seconds:.1f} s (session {pipe.session.initialization_seconds:.1f} s)")
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
        from vflash_core.pipeline.memory_plan import denoise_bytes

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
    hosts: dict[str, int] = {}
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
        hosts[name] = max(hosts.get(name, 0), host.reset())

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
    hosts["mp4"] = host.reset()
    elapsed = time.perf_counter() - start
    record = {
        "side": "diffusers", "config": config_name, "canvas": canvas, "mode": "t2va", "index": index, "warm": index > 0,
        "elapsed_seconds": round(elapsed, 3), "stages": {k: round(stages.get(k, 0.0), 3) for k in STAGES},
        "peak_device_bytes": {k: peaks.get(k) for k in STAGES}, "host_rss_peak_bytes": max(hosts.values()),
    }
    run.data["requests"].append(record)
    run.log(f"diffusers {canvas} #{index}: {elapsed:.2f} s (denoise {stages['denoise']:.2f}, video decode {stages['video_decode']:.2f})")
    run.save()
    return latents


# -- summary -------------------------------------------------------------------------------------------------------


def summarize(run: Run) -> None:
    """Warm medians per (side, config, canvas) and the diffusers / Vflash ratios of elapsed time and of each stage."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in run.data["requests"]:
        if r["warm"]:
            groups.setdefault((r["side"], r["config"], r["canvas"]), []).append(r)
    medians = {}
    for (side, config, canvas), rs in groups.items():
        medians[(side, config, canvas)] = {
            "side": side, "config": config, "canvas": canvas, "warm_requests": len(rs),
            "elapsed_seconds": round(statistics.median(r["elapsed_seconds"] for r in rs), 3),
            "stages": {s: round(statistics.median(r["stages"][s] for r in rs), 3) for s in STAGES},
            "peak_device_bytes": {s: max((r["peak_device_bytes"].get(s) or 0) for r in rs) for s in STAGES},
            "host_rss_peak_bytes": max(r["host_rss_peak_bytes"] for r in rs),
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
    parser.add_argument("--work", type=Path, required=True, help="folder on the disk being measured (emptied first)")
    parser.add_argument("--deadline-minutes", type=float, default=24.0)
    parser.add_argument("--small", action="store_true", help="dry run: demo-sized family on the CPU")
    parser.add_argument("--disk-gib", type=int, default=8)
    parser.add_argument("--warm-requests", type=int, default=WARM_REQUESTS, help="requests after the first, per canvas and pipeline")
    parser.add_argument("--skip", nargs="*", default=[], help="phases to leave out, e.g. weight_io diffusers vflash_block_ring")
    args = parser.parse_args()
    warm = args.warm_requests

    small = args.small
    run = Run("end_to_end_small" if small else "end_to_end_h200", time.perf_counter() + args.deadline_minutes * 60, small, tuple(args.skip))
    cuda = torch.cuda.is_available() and not small
    device = "cuda:0" if cuda else "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    spec: FamilySpec = replace(DEMO_FAMILY, text_vocab_size=None) if small else FULL_FAMILY
    profile = "t2va-turbo4-exact-cpu" if small else "t2va-turbo4-exact-sm90"
    canvases = ["448x256", "256x256"] if small else ["1344x768", "960x544"]
    config = H3Config.preset(spec.transformer)
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root, out_dir = work / "model", work / "out"
    out_dir.mkdir()
    host = HostPeak()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's default; both sides run in this process
    run.data["setup"] = {
        "family": "demo (dry run)" if small else "full size: see benchmarks/full_family.py",
        "text_encoder": {"layers": spec.text["num_hidden_layers"], "hidden_size": spec.text["hidden_size"], "read_by_h3": "hidden_states[50] (Vflash loads layers 0..50)"},
        "profile": profile, "prompt": PROMPT, "seed": REQUEST_SEED, "gpus": gpus, "warm_requests": warm,
        "disk": shutil.disk_usage(work)._asdict(), "cpu_count": os.cpu_count(),
        "nvidia_smi_topo": subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout if cuda else None,
    }
    run.save()

    with run.phase("disk", 60) as rec:
        if rec is not None and not small:
            rec.update(disk_bandwidth(work, args.disk_gib))
            run.data["read_bandwidth_gbps"] = rec["read_bandwidth_gbps"]
            run.data["write_bandwidth_gbps"] = rec["write_bandwidth_gbps"]
    read_bw = float(run.data.get("read_bandwidth_gbps") or 0)

    transformer, lora = root / "transformer", work / TURBO4_LORA
    compiled = work / "compiled"
    with run.phase("family_transformer", 120) as rec:
        if rec is not None:
            t = time.perf_counter()
            build_model_family(root, spec, SEED, with_ref=False, parts=("transformer",), device=device, write_workers=8)
            rec["transformer_seconds"] = round(time.perf_counter() - t, 3)
            t = time.perf_counter()
            if small:
                synthetic.write_random_lora(lora, config, 128, 128.0, SEED + 10, 16, device)
            else:
                write_turbo4_lora(lora, device)
            rec["lora_seconds"] = round(time.perf_counter() - t, 3)
            rec["transformer_bytes"], rec["lora_bytes"] = folder_bytes(transformer), lora.stat().st_size

    with run.phase("first_use", 240) as rec:
        if rec is not None:
            from vflash_core.weights.compiler import compile_receipt, prepare

            rec["page_cache_dropped"] = drop_page_cache()
            io0, t0 = io_counters(), time.perf_counter()
            prepare(profile, transformer, work / "weights-receipt.json", adapter=lora)
            io1, t1 = io_counters(), time.perf_counter()
            compile_receipt(work / "weights-receipt.json", compiled, device)
            io2, t2 = io_counters(), time.perf_counter()
            source = folder_bytes(transformer) + lora.stat().st_size
            rec.update({
                "prepare_seconds": round(t1 - t0, 3), "compile_seconds": round(t2 - t1, 3), "first_use_seconds": round(t2 - t0, 3),
                "source_bytes": source, "artifact_bytes": folder_bytes(compiled),
                "prepare_io": {k: io1[k] - io0[k] for k in io0}, "compile_io": {k: io2[k] - io1[k] for k in io1},
            })
            if read_bw:
                rec["source_read_seconds_at_disk_bandwidth"] = round(source / (read_bw * 1e9), 3)
                rec["first_use_over_one_read"] = round((t2 - t0) / rec["source_read_seconds_at_disk_bandwidth"], 3)
            run.data["first_use_seconds"] = rec["first_use_seconds"]

    with run.phase("weight_io", 120) as rec:
        if rec is not None:
            from vflash_core.weights import weight_io
            from vflash_core.weights.artifact import CompiledArtifact

            artifact = CompiledArtifact(compiled / "artifact", compiled / "schedule", compiled / "auxiliary.safetensors")
            sample = min(5, artifact.config.num_layers)
            files = [artifact.artifact_dir / b["file"] for b in artifact.manifest["blocks"][:sample]]
            nbytes = sum(f.stat().st_size for f in files)
            rec["sample_blocks"], rec["sample_bytes"] = sample, nbytes
            sequential = {}
            drop_page_cache()
            t = time.perf_counter()
            for i, _ in zip(range(sample), artifact.iter_blocks()):
                pass
            rec["session_block_reader_gbps"] = round(nbytes / (time.perf_counter() - t) / 1e9, 3)
            for workers in (1, 2, 4, 8):
                drop_page_cache()
                t = time.perf_counter()
                for f in files:
                    with weight_io.SequentialWeights(f, read_workers=workers) as w:
                        w.read_all()
                sequential[workers] = round(nbytes / (time.perf_counter() - t) / 1e9, 3)
            rec["sequential_weights_gbps_by_workers"] = sequential
            try:
                sidecars = work / "sidecars"
                sidecars.mkdir()
                t = time.perf_counter()
                for f in files:
                    weight_io.prepare_sidecar(f, sidecars / f.stem, workers=8)
                rec["sidecar_prepare_seconds"] = round(time.perf_counter() - t, 3)
                rec["sidecar_size_ratio"] = round(folder_bytes(sidecars) / nbytes, 4)
                drop_page_cache()
                t = time.perf_counter()
                for f in files:
                    with weight_io.SequentialWeights(f, read_workers=8, compressed_directory=sidecars / f.stem) as w:
                        w.read_all()
                rec["sidecar_read_gbps"] = round(nbytes / (time.perf_counter() - t) / 1e9, 3)
                shutil.rmtree(sidecars)
            except Exception as exc:  # noqa: BLE001 - zstandard may be missing on the machine
                rec["sidecar_error"] = f"{type(exc).__name__}: {exc}"

    # The disk holds the source and its compiled copy, or the compiled copy and the text encoder: not all three.
    shutil.rmtree(transformer, ignore_errors=True)
    with run.phase("family_rest", 240) as rec:
        if rec is not None:
            t = time.perf_counter()
            build_model_family(root, spec, SEED, with_ref=False, parts=("text", "vaes", "index"), device=device, write_workers=8)
            rec["seconds"] = round(time.perf_counter() - t, 3)
            rec["bytes"] = {p: folder_bytes(root / p) for p in ("text_encoder", "vae", "audio_vae")}
            run.data["setup"]["disk_after_family"] = shutil.disk_usage(work)._asdict()

    receipt = work / "pipeline.json"
    with run.phase("prepare_pipeline", 60) as rec:
        if rec is not None:
            from vflash_core.pipeline.h3_pipeline import prepare_pipeline

            assets = {"model_root": str(root), "decoder_root": str(root), "adapter_path": str(lora), "artifact": str(compiled / "artifact"),
                      "schedule_overlay": str(compiled / "schedule"), "auxiliary_tensor": str(compiled / "auxiliary.safetensors")}
            (work / "assets.json").write_text(json.dumps(assets))
            prepare_pipeline(profile, work / "assets.json", receipt)

    loaded_bytes = {"artifact": folder_bytes(compiled) if compiled.exists() else 0}
    resident = dict(device=device, encoder_residency="resident", weight_residency="resident" if cuda else "auto")
    with run.phase("vflash_resident", 420) as rec:
        if rec is not None:
            rec["page_cache_dropped"] = drop_page_cache()
            io0 = io_counters()
            pipe = load_pipeline(run, receipt, rec, **resident)
            rec["initialization_io"] = {k: io_counters()[k] - io0[k] for k in io0}
            run.data["initialization_seconds"] = {"cold_page_cache": rec["initialization_seconds"]}
            try:
                vflash_requests(run, pipe, "resident", canvases, 1 + warm, host, out_dir)
            finally:
                pipe.close()
                gc.collect()

    reference_latents = None
    with run.phase("diffusers", 420) as rec:
        if rec is not None:
            from vflash_core import get_profile
            from vflash_core.pipeline.memory_plan import largest_request_rows

            nfe = get_profile(profile).nfe
            pipe, offload = diffusers_pipeline(root, lora, config, get_profile(profile), device, largest_request_rows(get_profile(profile), config), rec)
            run.log(f"diffusers ready: {rec.get('placement')}")
            try:
                for canvas in canvases:
                    for k in range(1 + max(1, warm - 1)):
                        latents = diffusers_request(run, pipe, offload, canvas, k, host, out_dir, nfe)
                        if canvas == canvases[1]:
                            reference_latents = latents
            finally:
                del pipe
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()

    with run.phase("bitwise", 300) as rec:
        if rec is not None:
            from vflash_core import get_profile
            from vflash_core.pipeline.h3_pipeline import VideoRequest

            if reference_latents is None:  # the timed diffusers phase was skipped: one request of its own
                from vflash_core.pipeline.memory_plan import largest_request_rows

                pipe, offload = diffusers_pipeline(root, lora, config, get_profile(profile), device, largest_request_rows(get_profile(profile), config), rec)
                try:
                    reference_latents = diffusers_request(run, pipe, offload, canvases[1], 0, host, out_dir, get_profile(profile).nfe, "diffusers_bitwise")
                finally:
                    del pipe, offload
                    gc.collect()
                    if cuda:
                        torch.cuda.empty_cache()
            pipe = load_pipeline(run, receipt, {}, **dict(resident, attention_backend="cudnn" if cuda else "auto"))
            try:
                width, height = (int(v) for v in canvases[1].split("x"))
                result = pipe.denoise(pipe.encode(VideoRequest(PROMPT, seed=REQUEST_SEED, width=width, height=height)))
            finally:
                pipe.close()
                gc.collect()
            same = torch.equal(result.video_latents, reference_latents["video"]) and torch.equal(result.audio_latents, reference_latents["audio"])
            rec.update({
                "canvas": canvases[1], "attention_backend": result.metadata["attention_backend"], "bitwise_equal_to_diffusers": same,
                "video_max_abs_diff": float((result.video_latents.double() - reference_latents["video"].double()).abs().max()),
                "audio_max_abs_diff": float((result.audio_latents.double() - reference_latents["audio"].double()).abs().max()),
            })
            run.data["bitwise_equal_to_diffusers"] = same

    # (name, pipeline options, canvases, warm requests, seconds it needs), most wanted first: the deadline drops the rest.
    variants = [("encoder_offload", dict(resident, encoder_residency="offload"), canvases[:1], max(1, warm - 1), 200)]
    if gpus >= 2:
        variants.append(("two_gpu_sequence_head", dict(resident, peer_device="cuda:1", strategy="sequence-head"), canvases[:1], warm, 200))
    if cuda:
        variants.append(("block_ring", dict(resident, weight_residency="block-ring"), canvases[1:], warm, 130))
    for name, options, shapes, count, needs in variants:
        with run.phase(f"vflash_{name}", needs) as rec:
            if rec is not None:
                pipe = load_pipeline(run, receipt, rec, **options)
                run.data.setdefault("initialization_seconds", {})[f"warm_page_cache_{name}"] = rec["initialization_seconds"]
                try:
                    vflash_requests(run, pipe, name, shapes, 1 + count, host, out_dir)
                finally:
                    pipe.close()
                    gc.collect()

    text_bytes = sum(p.stat().st_size for p in (root / "text_encoder").glob("*.safetensors")) if (root / "text_encoder").exists() else 0
    loaded_bytes.update({"text_encoder_files": text_bytes, "vaes": folder_bytes(root / "vae") + folder_bytes(root / "audio_vae") if (root / "vae").exists() else 0})
    run.data["loaded_bytes"] = loaded_bytes
    if read_bw:
        run.data["artifact_read_seconds_at_disk_bandwidth"] = round(loaded_bytes["artifact"] / (read_bw * 1e9), 3)
    summarize(run)
    run.save()
    run.log("done")


if __name__ == "__main__":
    main()
