"""The pipeline's stages and the whole pipeline at real size under device memory caps (48, 24 and 20 GiB: the cards
the product targets), each run compared bit for bit with the same work uncapped, on one H200.

    python benchmarks/memory_caps.py --work /root/e2e --shm /dev/shm/vflash [--caps 48 24 20] [--deadline-minutes 12] [--skip PHASE ...] [--small]

One process on cuda:0, over the family `end_to_end.py` staged (the same `--work` and `--shm`; a step it has not done
is staged the same way first). Under a cap every part is placed by the memory plan (`vflash_core.memory_plan`),
planned against the cap and enforced through PyTorch's per-process memory fraction (`DeviceCap`); the uncapped twin is
planned against the GPU's free memory. Phases, each recorded as soon as it ends, in the order 2, 4, 1, 3 (the encode
while the text encoder's files are staged, then the whole pipeline, which may unlink them, then the rest):

1. `denoise_evaluation`: per cap (uncapped first) a session over the compiled Turbo4 weights with the plan sized for
   the longest request of `t2va-base16-bf16-sm90` (15 s: the Turbo4 profile itself generates 5 s clips, and the
   blocks are the same but for Turbo4's LoRA residuals, which only add to the bytes), then at 1344x768 one
   evaluation of all 50 blocks (the first step of a t2va request with 512 text rows) for 5 and 10 s, and 15 s
   uncapped and under caps of at least 48 GiB; velocities compared with the uncapped session's. The session's own
   request check runs (the plan's), not the Turbo4 profile's duration check.
2. `encode`: the text conditioner alone, planned per cap (offloaded, or its decoder layers streamed through two
   device slots), a t2va prompt and an i2va prompt with a 1344x768 first frame; `hidden_states[50]` compared.
3. `decode`: the VAEs alone, planned per cap (the diffusers decode, or the native one with a window's working
   memory), video + audio decode of seeded 5 and 10 s latents at 1344x768 (15 s uncapped and under >= 48 GiB);
   frames and waveform compared.
4. `end_to_end`: per cap a pipeline (`RunOptions(max_device_memory=...)`), t2va Turbo4 5 s at 1344x768 to an MP4
   (the whole pipeline; the MP4's bytes compared, its writer is deterministic) with each stage's device peak; then
   the same request stage by stage (untimed), each stage's output hashed (`stage_digests`) and compared with the
   uncapped run's (`stage_bitwise_equal_to_uncapped`), so a difference is pinned to its stage. The uncapped twin is
   `end_to_end.py`'s resident request of the same commit (its `mp4_sha256` and `stage_digests`), or one run here.
   A capped placement holds the text encoder's streamed layers in pinned host memory (~50 GiB; below 48 GiB the
   blocks' arena too, ~40 GiB more); that and the staged text encoder's tmpfs files (~48 GiB) come too close to or
   exceed this machine's ~125 GiB, where a user's files are on a disk whose page cache gives way. So for those caps
   the text encoder is loaded through the pipeline's `text_encoder_loader` hook, which reads it as
   `TextConditioner.from_pretrained` does and then unlinks its tmpfs files (their pages go once the arena holds the
   layers); they are staged again before the next such run (`text_encoder_files_unlinked_below_gib`).

One record per run: `cap_gib` (null for the uncapped twin), `canvas`, `seconds` (null for an encode), `stage` ("encode",
"denoise_evaluation", "decode", "end_to_end"), `completed`, `elapsed_seconds`, `peak_device_bytes` (allocated, the
stage's peak with its parts' weights), `host_rss_peak_bytes`, `host_pinned_bytes`, `host_in_use_peak_bytes`,
`bitwise_equal_to_uncapped` (null for the twin or when either run did not complete), `placement` and `memory_plan`
(the plan's choice and its line), `error` where a run was refused up front (the plan's numbers) or ran out of
memory. `--small` runs the same phases on the demo-sized family on the CPU (a dry run: caps are planned against,
nothing is enforced, the numbers mean nothing).

Writes benchmarks/results/memory_caps_h200.json (memory_caps_small.json with --small).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS
from _common import request as bundle_request
from end_to_end import PROMPT, DevicePeak, HostPeak, Run, Setup, load_pipeline, stage, stage_digests, vflash_requests
from full_family import SEED

from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.errors import RequestError, RunFailedError

SECONDS = {5: 124, 10: 243, 15: 345}  # frames of the 5, 10 and 15 s clips (17 n + 5)
LONGEST_UNDER = 48.0  # caps below this run 5 and 10 s clips only
I2VA_PROMPT = "The robot from the first frame turns to the camera and waves, rain falling, drums and bass play."
# What a capped run may fail with: refused by the plan, or out of memory under the enforced cap.
REFUSALS = (RequestError, RunFailedError, torch.OutOfMemoryError)
SIZED_FOR, SMALL_SIZED_FOR = "t2va-base16-bf16-sm90", "t2va-base4-exact-cpu"


def seconds_under(cap: float | None) -> list[int]:
    return [s for s in SECONDS if s <= 10 or cap is None or cap >= LONGEST_UNDER]


class Stages:
    """The records, the peaks and the uncapped twins' outputs."""

    def __init__(self, run: Run, device: torch.device, host: HostPeak):
        self.run, self.device, self.host = run, device, host
        self.peak = DevicePeak([device])
        self.twins: dict[tuple, object] = {}
        run.data["records"] = []

    def measure(self, stage: str, cap: float | None, canvas: str, seconds: int | None, key: tuple, work: Callable[[], object],
                same: Callable[[object, object], bool], **extra: object) -> dict:
        """Run `work` (its output compared with the uncapped twin's under `key`) and record it."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.peak.reset()
        self.host.reset()
        record: dict[str, object] = {"cap_gib": cap, "canvas": canvas, "seconds": seconds, "stage": stage, **extra}
        start = time.perf_counter()
        try:
            output = work()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            record["completed"] = True
        except REFUSALS as exc:
            output = None
            record.update(completed=False, error=f"{type(exc).__name__}: {exc}")
        record["elapsed_seconds"] = round(time.perf_counter() - start, 3)
        record["peak_device_bytes"] = self.peak.reset()
        record.update(self.host.reset())
        self.compare(record, key, output, same)
        return record

    def compare(self, record: dict, key: tuple, output: object, same: Callable[[object, object], bool]) -> None:
        """Keep an uncapped output as the twin, or compare a capped one with it; record and log."""
        if record["cap_gib"] is None:
            self.twins[key] = output
            record["bitwise_equal_to_uncapped"] = None
        else:
            twin = self.twins.get(key)
            record["bitwise_equal_to_uncapped"] = same(output, twin) if output is not None and twin is not None else None
        self.run.data["records"].append(record)
        what = " ".join(str(v) for v in (record["stage"], record.get("mode"), record["canvas"], record["seconds"] and f"{record['seconds']} s") if v)
        self.run.log(f"{what} cap {record['cap_gib']}: {'ok' if record['completed'] else record['error']} in {record['elapsed_seconds']} s, "
                     f"peak {record['peak_device_bytes'] / 2**30:.2f} GiB, host pinned {record['host_pinned_bytes'] / 2**30:.1f} GiB, "
                     f"bitwise {record['bitwise_equal_to_uncapped']}")
        self.run.save()


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _placement(plan) -> dict[str, object]:
    return {} if plan is None else {"placement": asdict(plan.placement), "memory_plan": plan.summary()}


def _canvas(name: str) -> tuple[int, int]:
    """(height, width) of "WxH"."""
    width, height = (int(v) for v in name.split("x"))
    return height, width


def _plan(parts: dict, profile, canvas_rules, device: torch.device, cap: float | None):
    """The memory plan of some parts alone (None on the CPU without a cap, as the pipeline does)."""
    from vflash_core.memory_plan import PartSizes, cap_bytes, plan_memory
    from vflash_core.pipeline.assets import largest_request

    if device.type != "cuda" and cap is None:
        return None
    sizes = sum((part.part_sizes() for part in parts.values()), PartSizes())
    return plan_memory(sizes, largest_request(profile, **parts, canvas=canvas_rules), [device], cap_bytes(cap))


def _cap(device: torch.device, cap: float | None):
    """The cap enforced on the device for a stage run without a session (released by the caller)."""
    from vflash_core.memory_plan import DeviceCap, cap_bytes

    return DeviceCap(cap_bytes(cap), [device]) if cap is not None and device.type == "cuda" else None


def _refused(stages: Stages, stage: str, cap: float | None, canvas: str, seconds: int | None, key: tuple, exc: BaseException, **extra: object) -> None:
    record = {"cap_gib": cap, "canvas": canvas, "seconds": seconds, "stage": stage, **extra, "completed": False, "error": f"{type(exc).__name__}: {exc}",
              "elapsed_seconds": 0.0, "peak_device_bytes": stages.peak.reset(), **stages.host.reset()}
    stages.compare(record, key, None, _equal)


# -- stages ----------------------------------------------------------------------------------------------------------


def denoise_phase(stages: Stages, caps: list[float | None], setup: Setup, sized_for: str, canvas: str, rec: dict) -> None:
    from vflash_core import get_profile
    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.engine.core_memory import CoreMemory
    from vflash_core.engine.session import NativeEngineSession
    from vflash_core.memory_plan import cap_bytes, plan_memory
    from vflash_core.pipeline.assets import largest_request

    paths = setup.session_paths()
    artifact = CompiledArtifact(**paths)
    longest = get_profile(sized_for)
    for cap in caps:
        start = time.perf_counter()
        try:
            plan = None
            if stages.device.type == "cuda" or cap is not None:
                plan = plan_memory(artifact.part_sizes(), largest_request(longest, CoreMemory(artifact, longest)), [stages.device], cap_bytes(cap))
            session = NativeEngineSession(setup.profile, CompiledPaths(**paths), EngineOptions(device=stages.device), plan=plan)
        except REFUSALS as exc:
            for seconds in seconds_under(cap):
                _refused(stages, "denoise_evaluation", cap, canvas, seconds, ("denoise", seconds), exc)
            continue
        rec.setdefault("sessions", []).append({"cap_gib": cap, "load_seconds": round(time.perf_counter() - start, 3), "memory_plan": session.memory_plan()})
        try:
            for seconds in seconds_under(cap):
                bundle = bundle_request(artifact.config, canvas, float(seconds))

                def evaluate(bundle=bundle, session=session) -> tuple[torch.Tensor, torch.Tensor]:
                    session._check_request_fits(bundle)  # the plan's check of this request's activations
                    denoiser = session._denoisers[0]
                    with torch.no_grad():
                        state = denoiser.start_request(bundle)
                        velocity, audio = denoiser.evaluate(state, 0)
                    return velocity.cpu(), audio.cpu()

                stages.measure("denoise_evaluation", cap, canvas, seconds, ("denoise", seconds), evaluate, _equal,
                               rows=bundle.layout.sequence_length, **_placement(session.plan))
        finally:
            session.close()


def encode_phase(stages: Stages, caps: list[float | None], root: Path, profile, canvas: str) -> None:
    from vflash_core.media.conditioning import TextConditioner
    from vflash_core.media.references import CanvasRules

    rules = CanvasRules.from_model_root(root)
    # Left memory-mapped (not materialized): an owned host copy beside the staged tmpfs files and a streamed arena
    # would not fit this machine; the values and so the bits are the same.
    conditioner = TextConditioner.from_pretrained(root, stages.device)
    height, width = _canvas(canvas)
    frame = PIL.Image.fromarray(np.random.default_rng(SEED).integers(0, 256, (height, width, 3), dtype=np.uint8))
    try:
        for cap in caps:
            plan = _plan({"conditioner": conditioner}, profile, rules, stages.device, cap)
            if plan is not None:
                conditioner.place(plan)
            enforced = _cap(stages.device, cap)
            try:
                for mode, prompt, keyframes in (("t2va", PROMPT, []), ("i2va", I2VA_PROMPT, [frame])):
                    stages.measure("encode", cap, canvas, None, ("encode", mode), lambda p=prompt, k=keyframes: (conditioner.encode(p, k).prompt_embeds,),
                                   _equal, mode=mode, **_placement(plan))
            finally:
                if enforced is not None:
                    enforced.release()
    finally:
        conditioner.close()


def decode_phase(stages: Stages, caps: list[float | None], root: Path, profile, canvas: str) -> None:
    from vflash_core.engine.layout import Geometry, audio_latent_count
    from vflash_core.media.references import CanvasRules
    from vflash_core.media.vae import MediaVAEs, decode_bytes
    from vflash_core.media.vae_decode import DEFAULT_WINDOWS_PER_CALL

    rules = CanvasRules.from_model_root(root)
    vaes = MediaVAEs.from_pretrained(root, stages.device)
    height, width = _canvas(canvas)
    latents = {}
    for seconds, frames in SECONDS.items():
        g = torch.Generator().manual_seed(SEED + seconds)
        geometry = Geometry(height, width, frames)
        video = torch.randn(1, vaes.latent_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width, generator=g)
        latents[seconds] = (video, torch.randn(2, vaes.audio_latent_channels, audio_latent_count(frames), generator=g))
    try:
        for index, cap in enumerate(caps):
            plan = _plan({"vaes": vaes}, profile, rules, stages.device, cap)
            if plan is not None:
                vaes.place(plan)
            if index == 0:
                vaes.materialize()
            enforced = _cap(stages.device, cap)
            try:
                for seconds in seconds_under(cap):
                    video, audio = latents[seconds]

                    def decode(video=video, audio=audio, seconds=seconds, plan=plan) -> tuple[torch.Tensor, torch.Tensor]:
                        if plan is not None:
                            need = decode_bytes(vaes.video_vae, SECONDS[seconds], height, width, vaes.video_decoder, DEFAULT_WINDOWS_PER_CALL)
                            plan.check({"decode": need}, f"the decode of {seconds} s at {canvas}")
                        media = vaes.decode(video, audio)
                        return media.frames, media.waveform

                    stages.measure("decode", cap, canvas, seconds, ("decode", seconds), decode, _equal, **_placement(plan))
            finally:
                if enforced is not None:
                    enforced.release()
    finally:
        vaes.close()


def _unlinking_text_encoder_loader(setup: Setup):
    """A `text_encoder_loader` that loads the text encoder as `TextConditioner.from_pretrained` does (layers 0..49,
    memory-mapped from its files) and then unlinks its tmpfs files (see the module docstring)."""

    def load(root: Path) -> torch.nn.Module:
        from transformers import AutoConfig, Qwen3VLModel

        from vflash_core.engine.config import TEXT_ENCODER_LAYER
        from vflash_core.media.conditioning import default_dtype

        config = AutoConfig.from_pretrained(root / "text_encoder", local_files_only=True)
        config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER
        model = Qwen3VLModel.from_pretrained(root / "text_encoder", config=config, dtype=default_dtype(torch.device(setup.device)), local_files_only=True)
        setup.staged.remove_text_encoder_files()
        return model

    return load


def _unlink_below(setup: Setup) -> float:
    """The caps under which a capped pipeline loads its text encoder through the unlinking loader: those whose
    placement (the staging plan's estimate, with 16 GiB to spare) holds more host memory beside the staged tmpfs files
    than the machine has. At 48 GiB the encoder streams (its arena) and the VAEs are offloaded (their host copies);
    below, the blocks stream too. A dry run takes the path below 48 GiB, as the full size does."""
    plan = setup.staged.plan()
    needs, spare = plan.host_needs(), plan.host_bytes - (16 << 30) - plan.shm_resident
    if setup.small:
        return LONGEST_UNDER
    if needs["streamed text encoder"] + plan.sizes.vaes > spare:
        return float("inf")
    return LONGEST_UNDER if needs["block-ring + streamed text encoder (20 / 24 GiB)"] > spare else 0.0


def end_to_end_phase(stages: Stages, caps: list[float], setup: Setup, canvas: str, rec: dict) -> None:
    """The whole pipeline per cap; the uncapped twin from `end_to_end.py`'s resident request of the same commit."""
    twin_file = RESULTS / f"{'end_to_end_small' if setup.small else 'end_to_end_h200'}.json"
    twin = None
    if twin_file.exists():
        earlier = json.loads(twin_file.read_text())
        if earlier["commit"] == stages.run.data["commit"]:
            twin = next((r for r in earlier["requests"] if r["config"] == "resident" and r["canvas"] == canvas and r.get("mp4_sha256")), None)
    key = ("end_to_end", canvas)
    twin_digests = earlier.get("stage_digests", {}).get(canvas) if twin is not None else None
    if twin is not None and twin_digests:
        rec["uncapped_twin"] = f"{twin_file.name}: resident request #{twin['index']} at {canvas} (commit {earlier['commit'][:10]})"
        stages.twins[key] = twin["mp4_sha256"]
        stages.twins[("stage_digests", canvas)] = twin_digests
    else:
        caps = [None, *caps]
    unlink_below = _unlink_below(setup)
    rec["text_encoder_files_unlinked_below_gib"] = "every cap" if unlink_below == float("inf") else unlink_below
    for cap in caps:
        loader = None
        if cap is not None and cap < unlink_below:
            if not setup.staged.text_encoder_files():
                setup.staged.write_rest()
            loader = _unlinking_text_encoder_loader(setup)
        load: dict = {}
        stages.peak.reset()
        try:
            pipe = load_pipeline(stages.run, setup.receipt, load, stages.host, text_encoder_loader=loader, device=str(stages.device), max_device_memory=cap)
        except REFUSALS as exc:
            _refused(stages, "end_to_end", cap, canvas, 5, key, exc, load=load)
            continue
        try:
            gc.collect()
            try:
                (request,) = vflash_requests(stages.run, pipe, f"cap-{cap}", [canvas], 1, stages.host, setup.out_dir, cap_gib=cap)
            except REFUSALS as exc:
                _refused(stages, "end_to_end", cap, canvas, 5, key, exc, load=load)
                continue
            record = {
                "cap_gib": cap, "canvas": canvas, "seconds": request["seconds"], "stage": "end_to_end", "completed": True,
                "elapsed_seconds": request["elapsed_seconds"], "stages": request["stages"], "peak_device_bytes": max(v or 0 for v in request["peak_device_bytes"].values()),
                "stage_peak_device_bytes": request["peak_device_bytes"],
                **{k: max(request[k], load["load_host"][k]) for k in ("host_rss_peak_bytes", "host_pinned_bytes", "host_in_use_peak_bytes")},
                "load": load, "placement": asdict(pipe.session.plan.placement) if pipe.session.plan else None, "memory_plan": request["memory_plan"],
                "mp4_sha256": request["mp4_sha256"], "text_encoder_files_unlinked_after_reading": loader is not None,
            }
            # Each stage's output again, stage by stage (untimed): the first that differs from the uncapped run's.
            digests = stage_digests(pipe, canvas)
            record["stage_digests"] = digests
            if cap is None:
                stages.twins[("stage_digests", canvas)] = digests
            uncapped = stages.twins.get(("stage_digests", canvas))
            if cap is not None and uncapped:
                record["stage_bitwise_equal_to_uncapped"] = {name: digests[name] == uncapped.get(name) for name in digests}
            stages.compare(record, key, request["mp4_sha256"], lambda a, b: a == b)
        finally:
            pipe.close()
            gc.collect()


# -- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the folder end_to_end.py staged the family in (disk)")
    parser.add_argument("--shm", type=Path, required=True, help="its tmpfs folder")
    parser.add_argument("--deadline-minutes", type=float, default=12.0)
    parser.add_argument("--caps", type=float, nargs="+", default=[48.0, 24.0, 20.0], help="device memory caps in GiB")
    parser.add_argument("--small", action="store_true", help="dry run: demo-sized family on the CPU")
    parser.add_argument("--skip", nargs="*", default=[], help="phases to leave out, e.g. encode decode")
    parser.add_argument("--carry-from", type=Path, default=Path(__file__).resolve().parent / "results" / "memory_caps_h200.json",
                        help="an earlier run's result file whose records of the --skip phases this run keeps (marked with their commit)")
    args = parser.parse_args()
    setup = Setup(args)
    run = Run("memory_caps_small" if setup.small else "memory_caps_h200", time.perf_counter() + args.deadline_minutes * 60, setup.small, tuple(args.skip))
    device = torch.device(setup.device)
    sized_for = SMALL_SIZED_FOR if setup.small else SIZED_FOR
    canvas = "640x352" if setup.small else "1344x768"
    caps: list[float | None] = [None, *args.caps]
    host = HostPeak()
    stages = Stages(run, device, host)
    run.carry_skipped(args.carry_from, "records", lambda r: r["stage"])
    torch.backends.cuda.matmul.allow_tf32 = False
    run.data["setup"] = {
        "family": "demo (dry run)" if setup.small else "full size: see benchmarks/full_family.py", "device": str(device),
        "caps_gib": args.caps, "profile": setup.profile, "denoise_plan_sized_for": sized_for, "canvas": canvas,
        "seconds": {str(k): v for k, v in SECONDS.items()}, "longest_clip_under_caps_below_gib": LONGEST_UNDER,
        "total_memory_bytes": torch.cuda.get_device_properties(device).total_memory if setup.cuda else None,
    }
    stage(run, setup, measure_storage=False)
    from vflash_core.profiles import get_profile

    # The whole pipeline first (what a user runs); the encode before it, while the text encoder's files are staged
    # (the capped runs below 48 GiB unlink them); then the stages that need only the core or the VAEs.
    with run.phase("encode", 90) as rec:
        if rec is not None:
            encode_phase(stages, caps, setup.staged.model_root, get_profile(sized_for), canvas)
    with run.phase("end_to_end", 240) as rec:
        if rec is not None:
            end_to_end_phase(stages, args.caps, setup, canvas if not setup.small else "448x256", rec)
    with run.phase("denoise_evaluation", 200) as rec:
        if rec is not None:
            denoise_phase(stages, caps, setup, sized_for, canvas, rec)
    with run.phase("decode", 120) as rec:
        if rec is not None:
            decode_phase(stages, caps, setup.staged.decoder_root, get_profile(sized_for), canvas)
    run.log("done")


if __name__ == "__main__":
    main()
