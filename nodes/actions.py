"""What each Vflash node does, host-neutral: the ComfyUI nodes (`loaders`, `generation`) and `vflash run-workflow`
both call these functions, so a workflow behaves the same in ComfyUI and headless.

An action takes plain values (widget values, core tensors, the specs other nodes returned), makes the engine calls,
and returns plain values. A request is checked by the pipeline's validator (`validation.plan_inputs`, with the canvas
rules and prompt budget of the text encoder's model) and runs the pipeline's own steps (`pipeline.encode_request`,
`EncodedRequest.bundle`, `vae.decode_latents`) on the engines the loader nodes gave (`engines`). Everything
host-specific comes in through `interfaces.Host` and `interfaces.Folders`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import PIL.Image
import torch

from vflash_core.engine.fast_mode_run import describe_fast_mode
from vflash_core.engine.layout import FPS
from vflash_core.engine.session import GenerationResult
from vflash_core.errors import CallbackGuard, RequestError, VflashError
from vflash_core.fileio import size_text
from vflash_core.media.conditioning import TextConditioner
from vflash_core.media.vae import MediaVAEs, decode_latents
from vflash_core.memory_plan import room
from vflash_core.pipeline.compare import comparison_report, measure, side_by_side, summary_lines
from vflash_core.pipeline.demo import DEMO_LATENT_RGB_BIAS, DEMO_LATENT_RGB_FACTORS
from vflash_core.pipeline.steps import EncodedRequest, delivered_soundtrack, encode_request
from vflash_core.pipeline.validation import Geometry, check_seed, plan_inputs, request_mode
from vflash_core.profiles import Profile

from . import comfy_latent as cl
from .core_adapters import (
    CORE_TEXT_NOTE,
    CORE_VAE_NOTE,
    CoreTextConditioner,
    CoreVAEs,
    core_text_conditioner,
    text_conditioner,
    vae_pair,
)
from .engines import (
    ComponentSpec,
    EngineRegistry,
    LoraRef,
    TransformerSpec,
    load_component_engine,
    load_session,
    resolve_device,
    text_encoder_rules,
)
from .interfaces import Folders, Host, host_progress
from .model_files import COMPONENT_FOLDERS, DEMO, lora_path, model_identity, path_identity, recorded_profile, resolve
from .request_inputs import RenderInputs, connected_slots, request_geometry

__all__ = [
    "compare", "decode", "encode", "generate", "load_component", "load_model", "sample", "select_lora", "unload",
]


# -- loaders -----------------------------------------------------------------------------------------------------


def select_lora(
    folders: Folders, lora: str, strength: float, prev: tuple[LoraRef, ...] | None = None
) -> tuple[LoraRef, ...]:
    """VflashLoraSelect: one more LoRA file of the chain."""
    path = lora_path(folders, lora)
    return (*(prev or ()), LoraRef(str(path), float(strength), path_identity(path)))


def load_model(registry: EngineRegistry, host: Host, spec: TransformerSpec) -> TransformerSpec:
    """VflashModelLoader: load the engine of the loader's validated widgets (`engines.transformer_spec`) now
    (progress bar), so errors surface at the loader."""
    session = load_session(registry, host, spec)
    host.log(f"Vflash model {spec.files.source}: profile {session.profile.id}, {session.memory_plan()}")
    return spec


def load_component(
    registry: EngineRegistry, host: Host, folders: Folders, kind: str, source: str, device: str
) -> ComponentSpec:
    """VflashTextEncoderLoader (`kind` "te") and VflashVAELoader ("vae"): validate, then load the engine now."""
    path = "" if source == DEMO else str(resolve(folders, source))
    spec = ComponentSpec(
        kind, source, path, model_identity(folders, source, COMPONENT_FOLDERS[kind]), resolve_device(host, device)
    )
    load_component_engine(registry, host, spec)
    return spec


# -- encode, sample, decode (the pipeline's steps on the nodes' inputs) -------------------------------------------


def _to_pil(image: torch.Tensor, what: str) -> PIL.Image.Image:
    frame = cl.image_to_frame(image, what)
    return PIL.Image.fromarray((frame.clamp(0, 1).numpy() * 255.0).round().astype(np.uint8))


def _reference_clips(
    ref_videos: Mapping[str, Any] | None, ref_video_audios: Mapping[str, Any] | None
) -> tuple[list[Any], list[Any]]:
    """The connected reference clips and each one's soundtrack (None: none connected); `ref_video_audio_k` belongs to
    `ref_video_k`, and one whose clip is not connected is refused."""
    video_slots, soundtrack_slots = connected_slots(ref_videos), connected_slots(ref_video_audios)
    orphans = sorted(soundtrack_slots.keys() - video_slots.keys())
    if orphans:
        raise RequestError(
            f"ref_video_audio_{orphans[0]} is the soundtrack of ref_video_{orphans[0]}, which is not connected"
        )
    return list(video_slots.values()), [soundtrack_slots.get(slot) for slot in video_slots]


def _references(images: list[Any], videos: list[Any], soundtracks: list[Any], audios: list[Any]) -> list:
    """The node's reference inputs as diffusers' H3 references, in request order (pictures, clips, audio)."""
    # diffusers' reference types come with its modular H3 pipeline, a large import: on the first encode, not when
    # ComfyUI loads the pack.
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    references: list = [
        MiniMaxH3ImageReference(image=_to_pil(img, f"reference image {i + 1}")) for i, img in enumerate(images)
    ]
    for i, (clip, soundtrack) in enumerate(zip(videos, soundtracks)):
        audio, rate = (
            cl.audio_to_waveform(soundtrack, f"soundtrack of reference video {i + 1}")
            if soundtrack is not None
            else (None, None)
        )
        references.append(
            MiniMaxH3VideoReference(
                frames=cl.image_to_clip(clip, f"reference video {i + 1}").numpy(),
                fps=float(FPS),
                audio=audio,
                sample_rate=rate,
            )
        )
    for i, audio in enumerate(audios):
        waveform, rate = cl.audio_to_waveform(audio, f"reference audio {i + 1}")
        references.append(MiniMaxH3AudioReference(audio=waveform, sample_rate=rate))
    return references


def _core_notes(conditioner: Any, vaes: Any, encodes_pictures: bool) -> tuple[str, ...]:
    """How an encoding with core's text encoder, or core's VAEs encoding pictures, differs from the diffusers
    pipeline's."""
    core = (
        (isinstance(conditioner, CoreTextConditioner), CORE_TEXT_NOTE),
        (isinstance(vaes, CoreVAEs) and encodes_pictures, CORE_VAE_NOTE),
    )
    return tuple(note for used, note in core if used)


def encode(
    registry: EngineRegistry,
    host: Host,
    te: Any,
    vae: Any,
    prompt: str,
    width: int,
    height: int,
    length: int,
    seconds: float,
    first_frame: torch.Tensor | None = None,
    last_frame: torch.Tensor | None = None,
    ref_images: Mapping[str, Any] | None = None,
    ref_videos: Mapping[str, Any] | None = None,
    ref_audios: Mapping[str, Any] | None = None,
    force_offload: bool = True,
    ref_video_audios: Mapping[str, Any] | None = None,
    audio_vae: Any = None,
    profile: Profile | None = None,
) -> tuple[EncodedRequest, dict[str, Any], int]:
    """VflashEncode: the pipeline's validator (`validation.plan_inputs`, against the text encoder's model: its canvas
    rules and prompt budget; and `profile`'s modes and durations when given) and encode step
    (`pipeline.encode_request`) on the node's inputs, without the noise (the sampler draws it from its seed, so one
    encoding serves every seed). `ref_video_audios` holds the soundtracks of reference clips: `ref_video_audio_k`
    belongs to `ref_video_k` (a video file's own soundtrack in the pipeline).

    `te` is a Vflash text encoder spec or core's CLIP (`CLIPLoader(type="minimax")`); `vae` a Vflash VAE pair spec
    or core's H3 video VAE, with core's audio VAE in `audio_vae` (needed for soundtracks). With core's encoders the
    conditioning records how it differs from the diffusers pipeline's in `notes`. Returns the encoding (VFLASH_COND,
    a `pipeline.EncodedRequest`), the empty latent of its canvas and its frame count."""
    geometry = request_geometry(width, height, length, seconds)
    images, audios = list(connected_slots(ref_images).values()), list(connected_slots(ref_audios).values())
    videos, soundtracks = _reference_clips(ref_videos, ref_video_audios)
    frames = {anchor: f for anchor, f in (("first", first_frame), ("last", last_frame)) if f is not None}
    mode = request_mode("first" in frames, "last" in frames, bool(images or videos or audios))
    # The model's rules before any model work: a Vflash text encoder's from its files, core CLIP's from its adapter.
    core_text = None if isinstance(te, ComponentSpec) else core_text_conditioner(te)
    canvas, budget = (core_text.canvas, None) if core_text is not None else text_encoder_rules(host, te)
    kinds = ["image"] * len(images) + ["video"] * len(videos) + ["audio"] * len(audios)
    plan_inputs(
        prompt, mode, geometry, len(frames), kinds, sum(s is not None for s in soundtracks), canvas, profile, budget
    )

    steps = 2 + bool(frames or mode == "ref2va")
    bar = host_progress(host)
    conditioner = core_text or text_conditioner(registry, host, te)
    vaes = vae_pair(registry, host, vae, audio_vae)
    notes = _core_notes(conditioner, vaes, encodes_pictures=steps == 3)
    if isinstance(conditioner, TextConditioner):
        pictures = len(frames) + len(images) + 2 * len(videos)  # a reference clip shows the encoder two frames
        _room_for_encode(registry, host, conditioner, vaes if pictures else None, geometry, pictures)
    references = _references(images, videos, soundtracks, audios)
    keyframes = {anchor: _to_pil(f, f"{anchor} frame") for anchor, f in frames.items()}

    def after_stage(stage: str) -> None:
        if stage == "encode.text" and force_offload and isinstance(te, ComponentSpec):
            registry.release("te")
        done = ("encode.inputs", "encode.text", "encode.vae").index(stage) + 1
        if done <= steps:
            bar(done, steps)

    # The core adapters (CoreTextConditioner, CoreVAEs) provide what `encode_request` calls without deriving from the
    # Vflash classes its annotations name.
    encoded = replace(
        encode_request(
            conditioner,  # type: ignore[arg-type]
            vaes,  # type: ignore[arg-type]
            prompt, mode, geometry, keyframes, references, canvas, after_stage,
        ),
        notes=notes,
    )
    latents = cl.empty_latents(geometry, vaes.latent_channels, vaes.audio_latent_channels)
    for note in notes:
        host.log(f"Vflash encode: {note}")
    return encoded, cl.to_comfy_latent(latents.video, latents.audio, host.nested), geometry.num_frames


def _room_for_encode(
    registry: EngineRegistry, host: Host, conditioner: TextConditioner, vaes: Any, geometry: Geometry, pictures: int
) -> None:
    """Ask the host for what the encode stage needs on the text encoder's device: the encoder's own need
    (`TextConditioner.encode_need`), and the VAEs' when they encode keyframes or references there (`vaes`)."""
    needs = [conditioner.encode_need(geometry.height, geometry.width, pictures)]
    if isinstance(vaes, MediaVAEs) and vaes.device == conditioner.device:
        needs.append(vaes.encode_need())
    host.make_room(room(needs), registry.held("te", "vae"))


def _memory_line(metadata: Mapping[str, Any]) -> str:
    mem = metadata.get("memory", {})
    peak = mem.get("peak_allocated_bytes")
    peak_text = ", ".join(size_text(b) for b in peak) if peak else "n/a (cpu)"
    return (
        f"Vflash memory plan: residency {mem.get('weight_residency')}, {mem.get('blocks_on_device')} blocks on device, "
        f"{size_text(mem.get('pinned_host_bytes', 0))} pinned host, peak allocated {peak_text}"
    )


def _log_sampled(host: Host, what: str, result: GenerationResult, notes: list[str], profile_denoise: bool) -> None:
    """The sampler's log: what it sampled and what a fast mode did, the memory plan, how the result differs from the
    diffusers pipeline on the release, the denoise profile when asked for."""
    fast_mode = result.metadata.get("fast_mode")
    host.log(f"Vflash sampled {what}" + (f", {describe_fast_mode(fast_mode)}" if isinstance(fast_mode, dict) else ""))
    host.log(_memory_line(result.metadata))
    for note in notes:
        host.log(f"Vflash sampled with {note}")
    if profile_denoise and result.denoise_profile is not None:
        host.log("Vflash denoise profile: " + json.dumps(result.denoise_profile, default=str))


def sample(
    registry: EngineRegistry,
    host: Host,
    model: TransformerSpec,
    cond: EncodedRequest,
    latent: dict[str, Any],
    seed: int,
    force_offload: bool = False,
    profile_denoise: bool = False,
    exact: bool = False,
) -> tuple[dict[str, Any], GenerationResult]:
    """VflashSampler: the profile's fixed schedule from the seed's noise on VflashEncode's `pipeline.EncodedRequest`;
    returns core's H3 AV latent and the session's result. `exact` renders exactly on an engine loaded with a fast
    mode."""
    check_seed(seed)
    target = cl.from_comfy_latent(latent)
    if not cl.is_empty(target):
        raise RequestError(
            "VflashSampler starts from noise: its latent input must be empty (VflashEncode's or "
            "EmptyMiniMaxH3LatentAV's); it only sets the canvas and length"
        )
    geometry = target.geometry
    if cond.mode != "t2va" and geometry != cond.geometry:  # keyframes and references are encoded for their canvas
        raise RequestError(
            f"the {cond.mode} conditioning was encoded for {cond.geometry.width}x{cond.geometry.height}, "
            f"{cond.geometry.num_frames} frames; "
            f"the latent is {geometry.width}x{geometry.height}, {geometry.num_frames} frames (use VflashEncode's "
            "latent or match them)"
        )
    # Profile vs request before the transformer is touched (loading or compiling it is model work).
    profile = recorded_profile(model.files.source, model.files.path, model.files.profile)
    if profile is not None:
        profile.check_mode(cond.mode)
        profile.check_duration(geometry.num_frames / FPS)
    session = load_session(registry, host, model)
    handoff = cond.bundle(session.compiled.config, seed, geometry)
    # This request's evaluation on every device of the session (its weights stay: the session is kept), so the host
    # releases only what the sampling needs, never the session itself.
    host.make_room(room(session.denoise_needs(handoff.sequence_length)), registry.held("dit"))
    stopping = CallbackGuard()  # what the progress, interrupt or preview callbacks raised to stop the trajectory

    # With a previewer the preview callback draws each step's progress bar update (core's one per step, image and
    # value together), so the plain progress callback is left out.
    # The demo's 8-channel latents are not core's H3 format: its previews take the demo VAE's own colours.
    latent_rgb = (DEMO_LATENT_RGB_FACTORS, DEMO_LATENT_RGB_BIAS) if model.files.source == DEMO else None
    preview = host.preview(session.profile.nfe, session.device, session.compiled.config.in_channels, latent_rgb)
    progress = None if preview is not None else stopping(host_progress(host))
    start = time.perf_counter()
    try:
        with host.running(registry.held("dit")):  # a preview's decoder loading meanwhile cannot evict the session
            result = session.generate(
                handoff,
                progress=progress,
                between_blocks=stopping(host.check_interrupt),
                profile_denoise=profile_denoise,
                preview=stopping(preview),
                exact=exact,
            )
    except BaseException as exc:
        if stopping.raised is None and not isinstance(exc, VflashError):
            # A failed trajectory leaves the session refusing work: close it now, the next run loads a fresh one.
            registry.release("dit")
        raise
    notes = [*cond.notes, *session.compiled.base_weight_notes()]
    _log_sampled(host, f"{cond.mode} {geometry.width}x{geometry.height} {geometry.num_frames} frames, seed {seed}, "
                 f"{session.profile.id} ({session.profile.nfe} evaluations) in {time.perf_counter() - start:.2f} s",
                 result, notes, profile_denoise)
    if force_offload:
        registry.release("dit")
    out = cl.to_comfy_latent(result.video_latents, result.audio_latents, host.nested)
    if notes:
        out["vflash_notes"] = notes  # result metadata: how this differs from the diffusers pipeline on the release
    return out, result


def decode(
    registry: EngineRegistry, host: Host, vae: Any, latent: dict[str, Any], audio_vae: Any = None
) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """VflashDecode: frames (IMAGE batch), stereo AUDIO trimmed to the video's length, and a VIDEO at 24 fps.
    `vae` is a Vflash VAE pair spec, or core's H3 video VAE with core's audio VAE in `audio_vae`."""
    av = cl.from_comfy_latent(latent)
    vaes = vae_pair(registry, host, vae, audio_vae)
    if isinstance(vaes, CoreVAEs):
        vaes.require_audio()  # refuse a missing audio VAE before decoding anything
    if av.video.shape[1] != vaes.latent_channels or av.audio.shape[1] != vaes.audio_latent_channels:
        raise RequestError(
            f"the latent has {av.video.shape[1]} video / {av.audio.shape[1]} audio channels; these VAEs take "
            f"{vaes.latent_channels} / {vaes.audio_latent_channels} (a latent of another model family?)"
        )
    if isinstance(vaes, MediaVAEs):
        geometry = av.geometry
        host.make_room(
            room([vaes.decode_need(geometry.num_frames, geometry.height, geometry.width)]), registry.held("vae")
        )
    bar = host_progress(host)
    # ComfyUI's interrupt is polled before every block of the video decoder, so Cancel stops a long decode at once.
    media = decode_latents(
        vaes,
        av.video,
        av.audio,
        lambda stage: bar(("decode.video", "decode.audio").index(stage) + 1, 2),
        host.check_interrupt,
    )
    assert media.frames is not None  # decoded without a frame sink
    images = cl.frames_to_image(media.frames)
    audio = cl.waveform_to_audio(delivered_soundtrack(media), media.sample_rate)
    return images, audio, host.make_video(images, audio, float(FPS))


def generate(
    registry: EngineRegistry, host: Host, render: RenderInputs, force_offload: bool = False
) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """VflashGenerate: encode, sample, decode in one node (Vflash or core text encoder / VAEs, as `encode`)."""
    _, cond, latent = _encode_for_model(registry, host, render)
    latent, _ = sample(registry, host, render.model, cond, latent, render.seed, force_offload)
    images, audio, video = decode(registry, host, render.vae, latent, render.audio_vae)
    return video, images, audio


def _encode_for_model(
    registry: EngineRegistry, host: Host, render: RenderInputs
) -> tuple[Profile | None, EncodedRequest, dict[str, Any]]:
    """Generate's and Compare's encode: the request checked against the transformer's profile before the text encoder
    runs, which is released after it."""
    files, request = render.model.files, render.request
    profile = recorded_profile(files.source, files.path, files.profile)
    cond, latent, _ = encode(
        registry, host, render.te, render.vae, request.prompt, request.width, request.height, request.length,
        request.seconds, request.first_frame, request.last_frame, force_offload=True, audio_vae=render.audio_vae,
        profile=profile,
    )
    return profile, cond, latent


def compare(registry: EngineRegistry, host: Host, render: RenderInputs) -> tuple[Any, str]:
    """VflashCompare: one request (encoded once) sampled with the model's fast mode, then exactly, on the one engine
    (the fast side carries any first-run warm-up), both decoded, measured by the core (`pipeline.compare`: per-frame
    PSNR / SSIM, the soundtracks' log-spectral distance, each side's times); returns the side-by-side VIDEO (exact
    left, fast right, the exact soundtrack) and the report (a summary, then the report's JSON)."""
    model = render.model
    if model.options.fast_mode.exact:
        raise VflashError(
            "Vflash Compare compares exact with a fast mode: choose the model loader's fast_mode "
            "(sparse-attention, step-cache or both)"
        )
    profile, cond, latent = _encode_for_model(registry, host, render)
    clips, sides = {}, {}
    for side, exact in (("fast", False), ("exact", True)):
        start = time.perf_counter()
        sampled, result = sample(registry, host, model, cond, latent, render.seed, exact=exact)
        images, audio, _ = decode(registry, host, render.vae, sampled, render.audio_vae)
        clips[side] = (images, audio)
        sides[side] = {
            "seconds": time.perf_counter() - start, "denoise_seconds": result.timing.request_wall_seconds,
            "metadata": result.metadata,
        }
    (exact_images, exact_audio), (fast_images, fast_audio) = clips["exact"], clips["fast"]
    metrics = measure(exact_images, fast_images, exact_audio["waveform"][0], fast_audio["waveform"][0])
    rendered = {
        "prompt": render.request.prompt, "seed": render.seed, "mode": cond.mode, "width": int(exact_images.shape[2]),
        "height": int(exact_images.shape[1]), "num_frames": int(exact_images.shape[0]), "fps": FPS,
        "profile": None if profile is None else profile.id,
    }
    report = comparison_report(model.options.fast_mode.name, metrics, sides, rendered)
    summary = summary_lines(report)
    for line in summary:
        host.log(f"Vflash compare: {line}")
    video = host.make_video(side_by_side(exact_images, fast_images), exact_audio, float(FPS))
    return video, "\n".join(summary) + "\n" + json.dumps(report, indent=2)


def unload(registry: EngineRegistry, host: Host, anything: Any, what: str) -> Any:
    """VflashUnload: release engines (through the host's memory management), pass the input through."""
    released = registry.release(what)
    host.log("Vflash unload: " + (", ".join(released) if released else f"nothing of '{what}' was loaded"))
    return anything
