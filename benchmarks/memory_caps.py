"""Each stage of the pipeline at real size under device memory caps, against the same stage uncapped.

    python benchmarks/memory_caps.py --work /data/caps [--deadline-minutes 22] [--caps 48 20] [--skip PHASE ...] [--small]

One process on cuda:0 of a two-GPU machine. The full-size random family of `full_family.py` is written the way
`end_to_end.py` writes it (the transformer source first; once compiled, the text encoder and the VAEs). Under a cap
every part is placed by the memory plan (`vflash_core.pipeline.memory_plan`): planned against the cap and enforced through
PyTorch's per-process memory fraction on the device (`DeviceCap`); the uncapped twin is planned against the GPU's
free memory. Each stage runs on its own (only its parts on the device) and is compared bit for bit with its twin.
Phases, each recorded as soon as it ends (a run stopped by its deadline keeps what it measured):

1. `family_transformer`: the transformer source and the Turbo4 LoRA.
2. `compile_base16`: prepare + compile for `t2va-base16-bf16-sm90` (5-15 s clips).
3. `denoise_evaluation`: per cap (uncapped first) a session of that profile (its plan: resident or block-ring
   blocks), then at 1344x768 for 5, 10 and 15 s one evaluation of all 50 blocks (a t2va request with 512 text rows,
   the first step); the velocities are compared with the uncapped session's.
4. `compile_turbo4`: the base16 artifact is removed (the disk holds the source and one compiled copy), prepare +
   compile for `t2va-turbo4-exact-sm90`, then the source is removed.
5. `family_rest`: text encoder, tokenizer, processor, VAEs, index, and the pipeline receipt.
6. `end_to_end`: per cap a pipeline (`RunOptions(max_device_memory=...)`), t2va Turbo4 5 s at 960x544 and 1344x768
   to an MP4 (the MP4 bytes compared; its writer is deterministic).
7. `encode`: the text conditioner planned alone per cap (for the base16 profile: keyframe modes), a t2va prompt and
   an i2va prompt with a 1344x768 first frame; `hidden_states[50]` compared.
8. `decode`: the VAEs planned alone per cap (base16: up to 15 s), video + audio decode of seeded 5, 10 and 15 s
   latents at 1344x768; frames and waveform compared.

One record per run: `cap_gib` (null for the uncapped twin), `canvas`, `seconds` (null for an encode), `stage` ("encode",
"denoise_evaluation", "decode", "end_to_end"), `completed`, `elapsed_seconds`, `peak_device_bytes` (allocated, the
stage's peak with its parts' weights), `host_rss_peak_bytes`, `bitwise_equal_to_uncapped` (null for the twin or
when either run did not complete), and `placement` (the plan's choice), `error` where a run was refused or ran out
of memory. `--small` runs the same phases on the demo-sized family on the CPU (a dry run: caps are planned against,
nothing is enforced, the numbers mean nothing).

Writes benchmarks/results/memory_caps_h200.json (memory_caps_small.json with --small).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import request as bundle_request  # noqa: E402
from end_to_end import PROMPT, REQUEST_SEED, DevicePeak, HostPeak, Run, folder_bytes, load_pipeline  # noqa: E402
from full_family import FULL_FAMILY, SEED, TURBO4_LORA, write_turbo4_lora  # noqa: E402

from vflash_core.engine.config import H3Config  # noqa: E402
from vflash_core.errors import RequestError, RunFailedError  # noqa: E402
from vflash_core.weights import synthetic  # noqa: E402
from vflash_core.weights.family import DEMO_FAMILY, FamilySpec, build_model_family  # noqa: E402

SECONDS = {5: 124, 10: 243, 15: 345}  # frames of the 5, 10 and 15 s clips (17 n + 5, at most 15 s)
I2VA_PROMPT = "The robot from the first frame turns to the camera and waves, rain falling, drums and bass play."
# What a capped run may fail with: refused by the plan, or out of memory under the enforced cap.
REFUSALS = (RequestError, RunFailedError, torch.OutOfMemoryError)


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
        record["host_rss_peak_bytes"] = self.host.reset()
        if cap is None:
            self.twins[key] = output
            record["bitwise_equal_to_uncapped"] = None
        else:
            twin = self.twins.get(key)
            record["bitwise_equal_to_uncapped"] = same(output, twin) if output is not None and twin is not None else None
        self.run.data["records"].append(record)
        what = " ".join(str(v) for v in (stage, extra.get("mode"), canvas, seconds and f"{seconds} s") if v)
        self.run.log(f"{what} cap {cap}: {'ok' if record['completed'] else record['error']} in {record['elapsed_seconds']} s, "
                     f"peak {record['peak_device_bytes'] / 2**30:.2f} GiB, bitwise {record['bitwise_equal_to_uncapped']}")
        self.run.save()
        return record


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _placement(plan) -> dict[str, object] | None:
    return None if plan is None else {**asdict(plan.placement), "summary": plan.summary()}


def _canvas(name: str) -> tuple[int, int]:
    """(height, width) of "WxH"."""
    width, height = (int(v) for v in name.split("x"))
    return height, width


def _plan(parts: dict, profile, canvas_rules, device: torch.device, cap: float | None):
    """The memory plan of some parts alone (None on the CPU without a cap, as the pipeline does)."""
    from vflash_core.pipeline.memory_plan import PartSizes, cap_bytes, largest_request, plan_memory

    if device.type != "cuda" and cap is None:
        return None
    return plan_memory(PartSizes.of(**parts), largest_request(profile, **parts, canvas=canvas_rules), [device], cap_bytes(cap))


def _cap(device: torch.device, cap: float | None):
    """The cap enforced on the device for a stage run without a session (released by the caller)."""
    from vflash_core.pipeline.memory_plan import DeviceCap, cap_bytes

    return DeviceCap(cap_bytes(cap), [device]) if cap is not None and device.type == "cuda" else None


# -- stages ----------------------------------------------------------------------------------------------------------


def denoise_phase(stages: Stages, caps: list[float | None], profile: str, paths: dict[str, Path], config: H3Config, canvas: str, rec: dict) -> None:
    from vflash_core.engine.session import NativeEngineSession

    for cap in caps:
        start = time.perf_counter()
        try:
            session = NativeEngineSession(profile, **paths, device=stages.device, max_device_memory=cap)
        except RunFailedError as exc:
            for seconds in SECONDS:
                stages.measure("denoise_evaluation", cap, canvas, seconds, ("denoise", seconds), lambda exc=exc: _raise(exc), _equal)
            continue
        rec.setdefault("sessions", []).append({"cap_gib": cap, "load_seconds": round(time.perf_counter() - start, 3), "memory_plan": session.memory_plan()})
        try:
            for seconds in SECONDS:
                bundle = bundle_request(config, canvas, float(seconds))

                def evaluate(bundle=bundle) -> tuple[torch.Tensor, torch.Tensor]:
                    session.validate(bundle)  # the plan's check of this request's activations
                    denoiser = session._denoisers[0]
                    with torch.no_grad():
                        state = denoiser.start_request(bundle)
                        velocity, audio = denoiser.evaluate(state, 0)
                    return velocity.cpu(), audio.cpu()

                stages.measure("denoise_evaluation", cap, canvas, seconds, ("denoise", seconds), evaluate, _equal,
                               rows=bundle.layout.sequence_length, placement=_placement(session.plan))
        finally:
            session.close()


def _raise(exc: BaseException) -> None:
    raise exc


def encode_phase(stages: Stages, caps: list[float | None], root: Path, profile, canvas: str) -> None:
    from vflash_core.media.conditioning import TextConditioner
    from vflash_core.media.references import CanvasRules

    rules = CanvasRules.from_model_root(root)
    conditioner = TextConditioner.from_pretrained(root, stages.device)
    height, width = _canvas(canvas)
    frame = PIL.Image.fromarray(np.random.default_rng(SEED).integers(0, 256, (height, width, 3), dtype=np.uint8))
    try:
        for index, cap in enumerate(caps):
            plan = _plan({"conditioner": conditioner}, profile, rules, stages.device, cap)
            if plan is not None:
                plan.place(conditioner)
            if index == 0:
                conditioner.materialize()
            enforced = _cap(stages.device, cap)
            try:
                for mode, prompt, keyframes in (("t2va", PROMPT, []), ("i2va", I2VA_PROMPT, [frame])):
                    stages.measure("encode", cap, canvas, None, ("encode", mode), lambda p=prompt, k=keyframes: (conditioner.encode(p, k).prompt_embeds,),
                                   _equal, mode=mode, placement=_placement(plan))
            finally:
                if enforced is not None:
                    enforced.release()
    finally:
        conditioner.close()


def decode_phase(stages: Stages, caps: list[float | None], root: Path, profile, canvas: str) -> None:
    from vflash_core.engine.layout import Geometry, audio_latent_count
    from vflash_core.media.references import CanvasRules
    from vflash_core.media.vae import MediaVAEs
    from vflash_core.media.vae_decode import DEFAULT_WINDOWS_PER_CALL
    from vflash_core.pipeline.memory_plan import decode_bytes

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
                plan.place(vaes=vaes)
            if index == 0:
                vaes.materialize()
            enforced = _cap(stages.device, cap)
            try:
                for seconds, (video, audio) in latents.items():
                    def decode(video=video, audio=audio, seconds=seconds) -> tuple[torch.Tensor, torch.Tensor]:
                        if plan is not None:
                            need = decode_bytes(vaes.video_vae, SECONDS[seconds], height, width, vaes.video_decoder, DEFAULT_WINDOWS_PER_CALL)
                            plan.check({"decode": need}, f"the decode of {seconds} s at {canvas}")
                        media = vaes.decode(video, audio)
                        return media.frames, media.waveform

                    stages.measure("decode", cap, canvas, seconds, ("decode", seconds), decode, _equal, placement=_placement(plan))
            finally:
                if enforced is not None:
                    enforced.release()
    finally:
        vaes.close()


def end_to_end_phase(stages: Stages, caps: list[float | None], receipt: Path, canvases: list[str], out_dir: Path) -> None:
    from vflash_core.pipeline.h3_pipeline import VideoRequest

    def same(a: str, b: str) -> bool:
        return a == b

    # Canvases smallest first: a run that fails closes its pipeline, and a larger one would fail too.
    for cap in caps:
        rec: dict = {}
        try:
            pipe = load_pipeline(stages.run, receipt, rec, device=str(stages.device), max_device_memory=cap)
        except RunFailedError as exc:
            for canvas in canvases:
                stages.measure("end_to_end", cap, canvas, 5, ("end_to_end", canvas), lambda exc=exc: _raise(exc), same)
            continue
        try:
            for canvas in canvases:
                height, width = _canvas(canvas)
                output = out_dir / f"cap-{cap}-{canvas}.mp4"

                def generate(output=output, height=height, width=width) -> str:
                    pipe.generate(VideoRequest(PROMPT, seed=REQUEST_SEED, width=width, height=height), output)
                    digest = hashlib.sha256(output.read_bytes()).hexdigest()
                    output.unlink()
                    return digest

                stages.measure("end_to_end", cap, canvas, 5, ("end_to_end", canvas), generate, same,
                               placement=_placement(pipe.session.plan), initialization_seconds=rec["initialization_seconds"])
        finally:
            pipe.close()


# -- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the family and the compiled weights (emptied first)")
    parser.add_argument("--deadline-minutes", type=float, default=22.0)
    parser.add_argument("--caps", type=float, nargs="+", default=[48.0, 20.0], help="device memory caps in GiB")
    parser.add_argument("--small", action="store_true", help="dry run: demo-sized family on the CPU")
    parser.add_argument("--skip", nargs="*", default=[], help="phases to leave out, e.g. encode decode")
    args = parser.parse_args()

    small = args.small
    run = Run("memory_caps_small" if small else "memory_caps_h200", time.perf_counter() + args.deadline_minutes * 60, small, tuple(args.skip))
    cuda = torch.cuda.is_available() and not small
    device = torch.device("cuda:0" if cuda else "cpu")
    spec: FamilySpec = replace(DEMO_FAMILY, text_vocab_size=None) if small else FULL_FAMILY
    base16, turbo4 = ("t2va-base4-exact-cpu", "t2va-turbo4-exact-cpu") if small else ("t2va-base16-bf16-sm90", "t2va-turbo4-exact-sm90")
    canvas = "640x352" if small else "1344x768"  # the denoise, encode and decode canvas
    e2e_canvases = ["256x256", "448x256"] if small else ["960x544", "1344x768"]
    caps: list[float | None] = [None, *args.caps]
    config = H3Config.preset(spec.transformer)
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root, out_dir = work / "model", work / "out"
    out_dir.mkdir()
    transformer, lora = root / "transformer", work / TURBO4_LORA
    host = HostPeak()
    stages = Stages(run, device, host)
    torch.backends.cuda.matmul.allow_tf32 = False
    run.data["setup"] = {
        "family": "demo (dry run)" if small else "full size: see benchmarks/full_family.py", "device": str(device),
        "caps_gib": args.caps, "profiles": {"denoise_encode_decode": base16, "end_to_end": turbo4}, "canvas": canvas,
        "end_to_end_canvases": e2e_canvases, "seconds": {str(k): v for k, v in SECONDS.items()},
        "total_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
    }
    run.save()

    def compile_for(profile: str, out: Path, adapter: Path | None) -> dict[str, Path]:
        from vflash_core.weights.compiler import compile_receipt, prepare

        receipt = work / f"{profile}-receipt.json"
        prepare(profile, transformer, receipt, adapter=adapter)
        compiled = compile_receipt(receipt, out, str(device))
        return {"artifact": compiled / "artifact", "schedule_overlay": compiled / "schedule", "auxiliary": compiled / "auxiliary.safetensors"}

    with run.phase("family_transformer", 120) as rec:
        if rec is not None:
            build_model_family(root, spec, SEED, with_ref=False, parts=("transformer",), device=str(device), write_workers=8)
            if small:
                synthetic.write_random_lora(lora, config, 128, 128.0, SEED + 10, 16, str(device))
            else:
                write_turbo4_lora(lora, str(device))
            rec["transformer_bytes"] = folder_bytes(transformer)

    base16_paths: dict[str, Path] = {}
    with run.phase("compile_base16", 180) as rec:
        if rec is not None:
            base16_paths = compile_for(base16, work / "compiled-base16", None)

    with run.phase("denoise_evaluation", 300) as rec:
        if rec is not None and base16_paths:
            denoise_phase(stages, caps, base16, base16_paths, config, canvas, rec)

    # The disk holds the source and one compiled copy, or the compiled copy and the text encoder: not more.
    shutil.rmtree(work / "compiled-base16", ignore_errors=True)
    turbo4_paths: dict[str, Path] = {}
    with run.phase("compile_turbo4", 180) as rec:
        if rec is not None:
            turbo4_paths = compile_for(turbo4, work / "compiled", lora)
    shutil.rmtree(transformer, ignore_errors=True)

    receipt = work / "pipeline.json"
    with run.phase("family_rest", 150) as rec:
        if rec is not None:
            import json

            from vflash_core.pipeline.h3_pipeline import prepare_pipeline

            build_model_family(root, spec, SEED, with_ref=False, parts=("text", "vaes", "index"), device=str(device), write_workers=8)
            rec["bytes"] = {p: folder_bytes(root / p) for p in ("text_encoder", "vae", "audio_vae")}
            if turbo4_paths:
                assets = {"model_root": str(root), "decoder_root": str(root), "adapter_path": str(lora), "artifact": str(turbo4_paths["artifact"]),
                          "schedule_overlay": str(turbo4_paths["schedule_overlay"]), "auxiliary_tensor": str(turbo4_paths["auxiliary"])}
                (work / "assets.json").write_text(json.dumps(assets))
                prepare_pipeline(turbo4, work / "assets.json", receipt)

    from vflash_core.profiles import get_profile

    with run.phase("end_to_end", 420) as rec:
        if rec is not None and receipt.exists():
            end_to_end_phase(stages, caps, receipt, e2e_canvases, out_dir)

    with run.phase("encode", 150) as rec:
        if rec is not None and (root / "text_encoder").exists():
            encode_phase(stages, caps, root, get_profile(base16), canvas)

    with run.phase("decode", 150) as rec:
        if rec is not None and (root / "vae").exists():
            decode_phase(stages, caps, root, get_profile(base16), canvas)

    run.log("done")


if __name__ == "__main__":
    main()
