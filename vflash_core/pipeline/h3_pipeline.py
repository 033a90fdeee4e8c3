"""`H3Pipeline`: prompt (+ keyframes or references) -> conditioning bundle -> native core -> VAEs -> MP4.

Ownership: the pipeline owns three serial owners of one device — the `TextConditioner` (Qwen3-VL), the
`MediaVAEs` and the `NativeEngineSession` — and the temporary media of a request; it is reused across serial
requests. On a GPU, the encoder and the VAEs sit on the CPU until their stage, take the device, and give it back
(`torch.cuda.empty_cache()`), so the core's weights and activations have it in between; a GPU with room for all three
keeps them there (`encoder_residency="resident"`), which saves their copies on every request. Where each part lives
is decided once, when the pipeline loads, by one memory plan (`memory_plan`, whose module says how); the session
takes the same plan and enforces the cap, and every request is checked against it before it runs.

A request is checked completely before any model loads (`validate`, which runs `validation.plan_request`, the
validator the service shares; its module lists the limits); `generate` also checks the output path. Devices and the
attention backend are checked when the pipeline is created. The encoders hand their tensors to the core through a
validated one-shot `BundleHandoff` (no temporary file). The request's steps are functions of the parts they run on
(`encode_request`, then `EncodedRequest.bundle` for a seed, `vae.decode_latents`), so a front end whose text encoder
and VAEs come from separate loaders (or from another implementation) runs this code and no copy of it.

Threads: concurrent first calls load the models once, and requests on one pipeline run one at a time (after their
validation, so a bad request is refused without waiting). Model loading is serialised process-wide
(`model_loading.MODEL_LOAD_LOCK`).

Timing: `initialization_seconds` is the time `load()` took (the first `generate` loads when needed,
after its input checks, and that time is not part of the request); `VideoResult.elapsed_seconds` covers the request:
validation, encoding, denoising, decoding and writing. `VideoResult.stages` holds the top-level stages `validate`,
`encode`, `denoise`, `decode`, `write` (their sum is at most `elapsed_seconds`) and nested details whose names carry
their stage as a prefix (`encode.inputs`, `encode.text`, `encode.vae`, `encode.bundle`, `decode.video`,
`decode.audio`); nested entries are already inside their stage and must not be added to it.

A cancelled request (the `cancel` callable raised) closes the pipeline, as does any failure that is not a
`VflashError`; create a new pipeline to continue.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self, TypedDict

import numpy as np
import PIL.Image
import torch

from ..engine.artifact import CompiledArtifact, CompiledPaths
from ..engine.bundle import BundleHandoff, EncodedReference, build_keyframe_bundle, build_ref2va_bundle
from ..engine.config import H3Config
from ..engine.core_memory import CoreMemory
from ..engine.layout import (
    FPS,
    VAE_FRAMES_PER_CHUNK,
    VAE_LATENTS_PER_CHUNK,
    VAE_SPATIAL_RATIO,
    Geometry,
    align_num_frames_down,
    largest_clip_frames,
    request_rows,
    video_num_frames,
)
from ..engine.session import GenerationResult, NativeEngineSession, SessionTiming
from ..engine.session_hooks import BlockLoader, NativeDenoiserLoader, SessionHooks, check_loader_hooks
from ..errors import (
    CallbackGuard,
    IdentityMismatchError,
    RequestError,
    RunFailedError,
    SessionClosedError,
    VflashError,
    check_callback,
    describe_value,
)
from ..fileio import atomic_file, check_input_file, check_writable_destination, path_argument
from ..formats import PIPELINE_FORMAT, Field, check_fields, is_object, is_positive
from ..media.conditioning import TEXT_ENCODER_LAYER, TextConditioner, TextEncoderLoader
from ..media.mp4 import mp4_stream, write_mp4
from ..media.references import CanvasRules, fit_keyframes, load_image, load_reference, normalize_references
from ..media.vae import VIDEO_DECODERS, DecodedMedia, MediaVAEs, decode_latents
from ..memory_plan import PLANNED_PICTURES, cap_bytes, plan_memory
from ..profiles import Profile, check_identity, get_profile
from ..progress import PreviewFn, StageProgress
from ..tensor_store import file_sha256
from .model_loading import MODEL_LOAD_LOCK
from .options import RunOptions
from .validation import (
    PromptBudget,
    RequestPlan,
    VideoRequest,
    check_generate_arguments,
    plan_request,
)

__all__ = [
    "ASSET_FIELDS", "EncodedRequest", "H3Pipeline", "PreparedAssets", "RequestCancelled", "VideoRequest",
    "VideoResult", "build_request_bundle", "delivered_soundtrack", "encode_request", "largest_request",
    "plan_request", "prepare_pipeline",
]

logger = logging.getLogger(__name__)

# The six fields of an assets file: official model root (text encoder, tokenizer, processor), decoder
# directory (vae/, audio_vae/), adapter file or null, and the three outputs of one compile.
ASSET_FIELDS = ("model_root", "decoder_root", "adapter_path", "artifact", "schedule_overlay", "auxiliary_tensor")
_ASSET_KINDS = {k: "a path string or null" if k == "adapter_path" else "a path string" for k in ASSET_FIELDS}

# Progress stages (`StageProgress`): "load", "encode", "denoise", "decode", "write".


class RequestCancelled(RunFailedError):
    """Raised when a request is aborted through its `cancel` callable (the pipeline is closed)."""


# -- results -----------------------------------------------------------------------------------------------------------


@dataclass
class VideoResult:
    """One finished request. `path` is None when no output file was asked for (then `media` holds the decode)."""

    path: Path | None
    elapsed_seconds: float
    stages: dict[str, float]
    session: SessionTiming
    mode: str
    width: int
    height: int
    num_frames: int
    fps: int
    sample_rate: int
    metadata: dict[str, object] = field(default_factory=dict)
    media: DecodedMedia | None = None


# -- prepared assets -----------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    check_input_file(path, what)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise VflashError(f"{what} {path} cannot be read as JSON: {exc}") from None
    except RecursionError:
        raise VflashError(f"{what} {path} nests arrays or objects too deeply to be read") from None
    if not isinstance(data, dict):
        raise VflashError(f"{what} {path} must hold a JSON object")
    return data


def _require(path: Path, what: str) -> Path:
    """An asset that must exist: a folder, or a readable regular file (anything else is named precisely)."""
    return path if path.is_dir() else check_input_file(path, what)


def _model_facts(model_root: Path, decoder_root: Path) -> dict[str, object]:
    """Read and check the configs of the encoder and the VAEs (no weights are loaded)."""
    text = _read_json(model_root / "text_encoder" / "config.json", "text encoder config")
    _require(model_root / "tokenizer", "tokenizer folder")
    _require(model_root / "processor" / "preprocessor_config.json", "processor config")
    video = _read_json(decoder_root / "vae" / "config.json", "video VAE config")
    audio = _read_json(decoder_root / "audio_vae" / "config.json", "audio VAE config")
    try:
        text_config = text.get("text_config", {})
        layers, hidden = int(text_config.get("num_hidden_layers", 0)), int(text_config.get("hidden_size", 0))
        spatial = math.prod(video.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
        temporal = math.prod(video.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        clip, drop = int(video.get("clip_length", 17)), int(video.get("token_drop", 3))
        rate, hop = int(audio.get("sampling_rate", 32000)), math.prod(audio.get("encoder_rates", (2, 4, 4, 5, 5)))
        video_channels, audio_channels = int(video.get("latent_channels", 24)), int(audio.get("latent_channels", 32))
    except (AttributeError, TypeError, ValueError) as exc:  # a field of the wrong type
        raise VflashError(f"the model configs under {model_root} / {decoder_root} are malformed: {exc}") from None
    if layers <= TEXT_ENCODER_LAYER:
        raise VflashError(
            f"{model_root / 'text_encoder'}: {layers} text layers; "
            f"H3 conditions on hidden_states[{TEXT_ENCODER_LAYER}] and needs more"
        )
    if (
        spatial != 16 or clip != VAE_FRAMES_PER_CHUNK or math.ceil(clip / temporal) != VAE_LATENTS_PER_CHUNK
        or drop != 3
    ):
        raise VflashError(
            f"{decoder_root / 'vae'}: H3 needs x16 spatial and 17-frame / 5-latent chunks with token_drop 3; "
            f"this VAE has x{spatial}, {clip}/{math.ceil(clip / temporal)}, drop {drop}"
        )
    if rate != 40 * hop:
        raise VflashError(
            f"{decoder_root / 'audio_vae'}: H3 needs 40 audio latents per second; "
            f"this VAE gives {rate / hop:g} ({rate} Hz, hop {hop})"
        )
    return {
        "text_layers": layers, "text_hidden_size": hidden, "video_latent_channels": video_channels,
        "audio_latent_channels": audio_channels, "audio_sample_rate": rate,
    }


def _valid_asset(name: str, value: object) -> bool:
    """A path string; only the adapter may be null (`_ASSET_KINDS` says so to the user)."""
    return isinstance(value, str) and bool(value) and "\x00" not in value or value is None and name == "adapter_path"


# What `PreparedAssets.load` reads from a receipt, with what each must be.
_RECEIPT_FIELDS: tuple[Field, ...] = (
    ("profile", "a profile id", lambda v: isinstance(v, str)),
    ("profile_identity", "an object", is_object),
    ("compile_id", "a string", lambda v: isinstance(v, str)),
    *((f"assets.{k}", _ASSET_KINDS[k], lambda v, k=k: _valid_asset(k, v)) for k in ASSET_FIELDS),
    *((f"canvas.{k}", "a positive integer", is_positive) for k in CanvasRules().to_dict()),
    ("transformer.num_layers", "a positive integer", is_positive),
)


class SessionPaths(TypedDict):
    """The three outputs of one compile, by the names `CompiledArtifact` and `NativeEngineSession` take them."""

    artifact: Path
    schedule_overlay: Path
    auxiliary: Path


@dataclass(frozen=True)
class PreparedAssets:
    """A validated pipeline receipt: one profile bound to its six assets."""

    path: Path
    profile: Profile
    model_root: Path
    decoder_root: Path
    adapter_path: Path | None
    artifact: Path
    schedule_overlay: Path
    auxiliary_tensor: Path
    canvas: CanvasRules
    record: dict

    @classmethod
    def load(cls, receipt: str | Path) -> PreparedAssets:
        """Read a receipt written by `prepare_pipeline`; every field it needs must be present with its type, the
        profile's identity must still match and the assets exist."""
        path = path_argument(receipt, "the prepared-assets receipt")
        record = _read_json(path, "prepared-assets receipt")
        if record.get("format") != PIPELINE_FORMAT:
            raise VflashError(
                f"{path} is not a Vflash prepared-assets receipt (format {record.get('format')!r}, "
                f"expected {PIPELINE_FORMAT!r}); create one with `vflash prepare-pipeline`"
            )
        check_fields(
            record, _RECEIPT_FIELDS, f"prepared-assets receipt {path}", "recreate it with `vflash prepare-pipeline`"
        )
        profile = get_profile(record["profile"])
        check_identity(profile, record["profile_identity"], f"prepared assets {path}")
        # A Path for every field, None only for a null adapter_path (the receipt's fields were checked above).
        assets: dict[str, Any] = {
            k: None if (v := record["assets"][k]) is None else _require(Path(v), f"{k} of {path}:")
            for k in ASSET_FIELDS
        }
        canvas = CanvasRules(
            record["canvas"]["canvas_short_edge"], record["canvas"]["canvas_max_pixels"],
            record["canvas"]["reference_image_short_edge"],
        )
        return cls(path=path, profile=profile, canvas=canvas, record=record, **assets)

    def session_paths(self) -> SessionPaths:
        return {
            "artifact": self.artifact, "schedule_overlay": self.schedule_overlay, "auxiliary": self.auxiliary_tensor
        }


def _resolve_profile(profile: object) -> Profile:
    profile = get_profile(profile) if isinstance(profile, str) else profile
    if not isinstance(profile, Profile):
        raise VflashError(f"profile must be a profile id or a Profile, got {describe_value(profile)}")
    return profile


def prepare_pipeline(profile: Profile | str, assets: str | Path, receipt: str | Path) -> PreparedAssets:
    """Validate a six-field assets file against `profile` and write the pipeline receipt (atomically, never over an
    existing file). Reads configs and manifests only; the adapter file is hashed once to bind it to the compile."""
    profile = _resolve_profile(profile)
    path_argument(receipt, "the receipt path")
    receipt = check_writable_destination(receipt)
    assets = path_argument(assets, "the assets file")
    data = _read_json(assets, "assets file")
    missing, extra = [k for k in ASSET_FIELDS if k not in data], sorted(set(data) - set(ASSET_FIELDS))
    if missing or extra:
        raise VflashError(
            f"assets file {assets} must have exactly the fields {', '.join(ASSET_FIELDS)}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {', '.join(extra)}" if extra else "")
        )
    for name in ASSET_FIELDS:
        if not _valid_asset(name, data[name]):
            got = describe_value(data[name])
            raise VflashError(f"assets file {assets}: {name} must be {_ASSET_KINDS[name]}, got {got}")
    base = assets.resolve().parent
    # A Path for every field, None only for a null adapter_path (`_valid_asset` above).
    paths: dict[str, Any] = {
        k: None if data[k] is None else _require((base / Path(data[k]).expanduser()).resolve(), k)
        for k in ASSET_FIELDS
    }
    facts = _model_facts(paths["model_root"], paths["decoder_root"])

    compiled = CompiledArtifact(paths["artifact"], paths["schedule_overlay"], paths["auxiliary_tensor"])
    compiled.check_profile(profile)
    config = compiled.config
    widths = [
        ("video latent channels", config.in_channels, facts["video_latent_channels"]),
        ("audio latent channels", config.audio_in_channels, facts["audio_latent_channels"]),
        ("text width", config.text_dim, facts["text_hidden_size"]),
    ]
    for what, transformer, other in widths:
        if transformer != other:
            raise IdentityMismatchError(
                f"the compiled transformer's {what} is {transformer}, the model root / decoders give {other}"
            )
    recorded = compiled.adapter
    adapter = paths["adapter_path"]
    if profile.adapter is None and adapter is not None:
        raise IdentityMismatchError(f"profile {profile.id} uses no adapter; adapter_path must be null, got {adapter}")
    if profile.adapter is not None:
        if adapter is None:
            raise IdentityMismatchError(
                f"profile {profile.id} needs adapter {profile.adapter.file_name}; adapter_path is null"
            )
        if recorded is None or adapter.stat().st_size != recorded["size"] or file_sha256(adapter) != recorded["sha256"]:
            raise IdentityMismatchError(
                f"adapter {adapter} is not the one artifact {paths['artifact']} was compiled with"
            )
    canvas = CanvasRules.from_model_root(paths["model_root"])
    record = {
        "format": PIPELINE_FORMAT,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "profile": profile.id,
        "profile_identity": profile.identity(),
        "assets": {k: None if v is None else str(v) for k, v in paths.items()},
        "compile_id": compiled.compile_id,
        "arch": compiled.arch,
        "transformer": config.to_dict(),
        "model": facts,
        "canvas": canvas.to_dict(),
    }
    with atomic_file(receipt) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    logger.info("prepared %s for %s (compile %s)", receipt, profile.id, compiled.compile_id)
    return PreparedAssets.load(receipt)


# -- the request path's steps, on components passed in (other front ends compose them too) -----------------------------

# after_stage(name): called when a nested stage ends (encode.inputs, encode.text, encode.vae, decode.video,
# decode.audio)
StageCallback = Callable[[str], None]


def stage_timer(timings: dict[str, float] | None, then: StageCallback | None = None) -> StageCallback:
    """A stage callback that records in `timings` each stage's seconds since the previous one (or since it was made),
    then calls `then`."""
    last = [time.perf_counter()]

    def after_stage(name: str) -> None:
        now = time.perf_counter()
        if timings is not None:
            timings[name] = now - last[0]
        last[0] = now
        if then is not None:
            then(name)

    return after_stage


@dataclass(frozen=True)
class EncodedRequest:
    """The seed-independent half of a request's bundle (CPU tensors): the encoded prompt and keyframe / reference
    latents, with the mode and the canvas they were encoded for. One encoding serves every seed (`bundle`)."""

    mode: str
    geometry: Geometry
    prompt_embeds: torch.Tensor  # (L, text_dim)
    token_tags: torch.Tensor  # (L,) int64
    keyframe_latents: tuple[torch.Tensor, ...] = ()  # one (1, C, 1, h, w) per keyframe, packed order
    anchors: tuple[str, ...] = ()  # "first" / "last" per keyframe
    references: tuple[EncodedReference, ...] = ()  # request order
    notes: tuple[str, ...] = ()  # how this encoding differs from the diffusers pipeline's (other encoders passed in)

    def bundle(self, config: H3Config, seed: int, geometry: Geometry | None = None) -> BundleHandoff:
        """The conditioning bundle of one seed (its noise drawn by the bundle contract), handed over one-shot;
        `geometry` replaces the encoded canvas (a t2va encoding is bound to none)."""
        geometry = geometry or self.geometry
        generator = torch.Generator().manual_seed(seed)
        if self.mode == "ref2va":
            bundle = build_ref2va_bundle(
                self.prompt_embeds, self.token_tags, geometry, config, generator, self.references, seed=seed
            )
        else:
            bundle = build_keyframe_bundle(
                self.prompt_embeds, self.token_tags, geometry, config, generator, self.keyframe_latents, self.anchors,
                seed=seed,
            )
        return BundleHandoff(bundle)


def encode_request(
    conditioner: TextConditioner, vaes: MediaVAEs, prompt: str, mode: str, geometry: Geometry,
    keyframes: dict[str, PIL.Image.Image] | None = None, references: list | None = None,
    canvas: CanvasRules | None = None, after_stage: StageCallback | None = None,
) -> EncodedRequest:
    """Put a validated request's media on H3's rates and resolutions, then encode the prompt, and the keyframes and
    each reference's frames and soundtrack with the VAEs.

    `keyframes`: anchor ("first", "last") -> image, in packed order; `references`: the decoded diffusers
    `MiniMaxH3*Reference`s in request order; `canvas`: the model's canvas rules (default: the conditioner's). The
    conditioner and the VAEs may be any objects with their interfaces (e.g. another implementation's).
    `after_stage` is called after encode.inputs, encode.text and encode.vae.
    """
    after_stage = after_stage or (lambda name: None)
    fitted: list[PIL.Image.Image] = []
    normalized: list = []
    if mode == "ref2va":
        normalized = normalize_references(
            list(references or ()), geometry.num_frames, canvas or conditioner.canvas, vaes.sample_rate
        )
    elif keyframes:
        fitted = fit_keyframes(list(keyframes.values()), geometry.height, geometry.width)
    after_stage("encode.inputs")
    text = conditioner.encode(prompt, fitted, normalized)
    after_stage("encode.text")
    conditions: list[torch.Tensor] = []
    encoded: list[EncodedReference] = []
    if fitted or normalized:
        with vaes.on_device():  # the VAEs hold their device only for their stage
            conditions = [vaes.encode_pixels(np.array(k)[None]) for k in fitted]
            for ref in normalized:
                latents = rows = None
                if ref.kind == "image":
                    latents = vaes.encode_pixels(np.array(ref.image)[None])
                elif ref.kind == "video":
                    # Snapped down to 17 n + 5 frames so the VAE encodes without padding (the reference's arithmetic).
                    latents = vaes.encode_pixels(ref.frames[: align_num_frames_down(ref.frames.shape[0])])
                if ref.has_audio:
                    rows = vaes.encode_soundtrack(ref.audio)
                encoded.append(EncodedReference(ref.kind, latents, rows))
    after_stage("encode.vae")
    return EncodedRequest(
        mode, geometry, text.prompt_embeds, text.token_tags, tuple(conditions), tuple(keyframes or ()), tuple(encoded)
    )


def build_request_bundle(
    conditioner: TextConditioner, vaes: MediaVAEs, request: VideoRequest, plan: RequestPlan, config: H3Config,
    canvas: CanvasRules | None = None, timings: dict[str, float] | None = None,
) -> BundleHandoff:
    """Read the request's media files, encode them and the prompt (`encode_request`), draw the noise, and hand the
    bundle over one-shot. `plan` is the request's `plan_request` result; `timings` (optional) receives
    `encode.inputs` (reading included), `encode.text`, `encode.vae`, `encode.bundle`."""
    after_stage = stage_timer(timings)
    keyframes = {anchor: load_image(k) for anchor, k in request.keyframes.items()}
    references = [load_reference(r) for r in request.references]
    encoded = encode_request(
        conditioner, vaes, request.prompt, plan.mode, plan.geometry, keyframes, references, canvas, after_stage
    )
    handoff = encoded.bundle(config, request.seed)
    after_stage("encode.bundle")
    return handoff


def delivered_soundtrack(media: DecodedMedia) -> torch.Tensor:
    """The waveform cut to the video's exact length: the audio latents cover round(F / 24 * 40) / 40 s."""
    return media.waveform[:, : round(media.num_frames / FPS * media.sample_rate)]


def largest_request(
    profile: Profile, core: CoreMemory | None = None, conditioner: TextConditioner | None = None,
    vaes: MediaVAEs | None = None, canvas: CanvasRules | None = None,
) -> dict[str, int]:
    """Transient bytes of each stage of the largest request a memory plan is sized for (the profile's longest clip on
    the model's 16:9 canvas, the released one by default, see `memory_plan.PLANNED_TEXT_ROWS`), for the parts given:
    stage -> bytes, with the decode as `decode.diffusers` and `decode.native`; each part answers for itself."""
    height, width = (canvas or CanvasRules()).default_canvas()
    needs: dict[str, int] = {}
    if core is not None:
        needs["denoise"] = core.largest_evaluation_bytes((height, width))
    if conditioner is not None:
        pictures = PLANNED_PICTURES if set(profile.modes) - {"t2va"} else 0
        needs["encode"] = conditioner.encode_need(height, width, pictures).transient
    if vaes is not None:
        frames = largest_clip_frames(profile)
        for decoder in VIDEO_DECODERS:
            needs[f"decode.{decoder}"] = vaes.decode_need(frames, height, width, decoder).transient
    return needs


# -- the pipeline --------------------------------------------------------------------------------------------------


class H3Pipeline:
    """The complete pipeline around one native session. Compose it from loaded parts, or `from_prepared` (lazy).
    Thread-safe (see the module's doc).

    Args:
        profile: the profile the session runs (id or `Profile`).
        conditioner, vaes, session: the three loaded parts (a front end may load them separately); all None only when
            a `loader` is given (what `from_prepared` does).
        canvas: the model's canvas rules (default: the conditioner's).
        prompt_budget: the text encoder's context and tokenizer (default: the conditioner's).
        options: the run options this pipeline was made with; of them a composed pipeline uses the MP4 delivery
            (`media_video_input`, `media_video_threads`, `media_video_crf`, `media_video_preset`) and `profile_denoise`
            (per-evaluation device timings in `metadata["denoise_profile"]`, a diagnostic).
    """

    def __init__(
        self,
        profile: Profile | str,
        conditioner: TextConditioner | None,
        vaes: MediaVAEs | None,
        session: NativeEngineSession | None,
        *,
        canvas: CanvasRules | None = None,
        prompt_budget: PromptBudget | None = None,
        options: RunOptions | None = None,
        loader: Callable[[StageProgress | None], tuple[TextConditioner, MediaVAEs, NativeEngineSession]] | None = None,
    ):
        self.profile = _resolve_profile(profile)
        parts = (conditioner, vaes, session)
        if loader is None and any(p is None for p in parts):
            raise VflashError("H3Pipeline needs a conditioner, VAEs and a session (or a loader, see from_prepared)")
        if session is not None and not isinstance(getattr(session, "profile", None), Profile):
            raise VflashError(f"session must be a loaded NativeEngineSession, got {describe_value(session)}")
        if session is not None and session.profile.id != self.profile.id:
            raise IdentityMismatchError(
                f"the session runs profile {session.profile.id}, the pipeline was given {self.profile.id}"
            )
        self.conditioner, self.vaes, self.session = parts
        self.canvas = canvas or (conditioner.canvas if conditioner is not None else CanvasRules())
        # A closed conditioner (text_encoder None) has no tokenizer to count with.
        if prompt_budget is None and conditioner is not None and conditioner.text_encoder is not None:
            context = conditioner.text_encoder.config.text_config.max_position_embeddings
            prompt_budget = PromptBudget.of_tokenizer(conditioner.tokenizer, context)
        self.prompt_budget = prompt_budget
        self.options = options or RunOptions()
        self._loader = loader
        self._closed = False
        # Guards loading and running: one request at a time, and the parts never change under a running request.
        self._lock = threading.RLock()
        self.initialization_seconds = 0.0  # set by load(); a pipeline composed from loaded parts has none

    @classmethod
    def from_prepared(
        cls,
        prepared_assets: str | Path | PreparedAssets,
        options: RunOptions | None = None,
        *,
        text_encoder_loader: TextEncoderLoader | None = None,
        native_denoiser_loader: NativeDenoiserLoader | None = None,
        block_loader: BlockLoader | None = None,
    ) -> H3Pipeline:
        """A pipeline over prepared assets that loads nothing until `load()` or the first request. The devices
        (present on this machine, of the profile's architecture) and the attention backend are checked now.

        Trusted loader hooks (Python callables, code rather than options, so never read from a file, a command line
        or a request): `text_encoder_loader(model_root)` returns the CPU Qwen3-VL model the conditioner then trims,
        offloads and releases (`conditioning.TextConditioner.from_pretrained`); `native_denoiser_loader` and
        `block_loader` load the core's resident weights (`session.NativeEngineSession`). What a hook raises
        propagates from `load()` (or the first request) after the parts loaded before it are released; the
        pipeline stays open, and the next `load()` calls the loaders again.

        `options`: see `RunOptions`; the placement it asks for and its memory cap are planned when the pipeline
        loads.
        """
        options = options or RunOptions()
        if not isinstance(options, RunOptions):
            raise VflashError(
                f"options must be a RunOptions, got {describe_value(options)}; e.g. RunOptions(device=0)"
            )
        assets = (
            prepared_assets if isinstance(prepared_assets, PreparedAssets) else PreparedAssets.load(prepared_assets)
        )
        primary, peer = options.check_devices(assets.profile)
        if text_encoder_loader is not None and not callable(text_encoder_loader):
            raise VflashError(
                f"text_encoder_loader must be a Python callable, got {type(text_encoder_loader).__name__}"
            )
        core_hooks = check_loader_hooks(native_denoiser_loader, block_loader, options.strategy, 1 + (peer is not None))
        # The core's loader hooks load resident blocks: the plan places them so unless told otherwise (then refused).
        weight_residency = "resident" if core_hooks and options.weight_residency == "auto" else options.weight_residency

        def load(progress: StageProgress | None) -> tuple[TextConditioner, MediaVAEs, NativeEngineSession]:
            total = 2 + int(assets.record["transformer"]["num_layers"])
            report = progress or (lambda stage, done, total: None)
            loaded: list[TextConditioner | MediaVAEs] = []
            report("load", 0, total)
            compiled = CompiledArtifact(**assets.session_paths())
            if options.verify_weights:  # before anything loads: a corrupt compile costs no encoder load
                compiled.verify()
            cap = cap_bytes(options.max_device_memory)
            host_budget = cap_bytes(options.max_host_memory, "max_host_memory")
            devices = [primary] + ([peer] if peer is not None else [])
            planned = primary.type == "cuda" or cap is not None
            core = CoreMemory(compiled, assets.profile, options.fast_mode)
            if planned:  # the core's sizes are known from its compile: a budget it alone exceeds costs no encoder load
                plan_memory(
                    compiled.part_sizes(), largest_request(assets.profile, core), devices, cap,
                    weight_residency, options.encoder_residency, host_budget=host_budget, log=False,
                )
            try:
                conditioner = TextConditioner.from_pretrained(
                    assets.model_root, primary, text_encoder_loader=text_encoder_loader
                )
                loaded.append(conditioner)
                report("load", 1, total)
                vaes = MediaVAEs.from_pretrained(assets.decoder_root, primary, peer_device=peer)
                loaded.append(vaes)
                report("load", 2, total)
                # Nothing to plan on the CPU without a cap: everything stays in host memory (RunOptions refuses a
                # host budget there).
                if not planned:
                    plan = None
                    conditioner.keep_on_device = vaes.keep_on_device = options.encoder_residency == "resident"
                else:
                    largest = largest_request(assets.profile, core, conditioner, vaes, assets.canvas)
                    sizes = compiled.part_sizes() + conditioner.part_sizes() + vaes.part_sizes()
                    plan = plan_memory(
                        sizes, largest, devices, cap, weight_residency, options.encoder_residency,
                        host_budget=host_budget,
                    )
                    conditioner.place(plan)
                    vaes.place(plan)
                on_load = None if progress is None else (lambda done, n: progress("load", 2 + done, total))
                session = NativeEngineSession(
                    assets.profile, CompiledPaths(**assets.session_paths()), options.engine, plan,
                    SessionHooks(on_load, native_denoiser_loader, block_loader),
                )
            except BaseException:
                for part in loaded:  # a failed load (a loader hook's exception included) keeps nothing
                    part.close()
                raise
            conditioner.materialize()  # read the (memory-mapped) weights now, not inside the first request
            vaes.materialize()
            return conditioner, vaes, session

        return cls(
            assets.profile, None, None, None, canvas=assets.canvas,
            prompt_budget=PromptBudget.from_model_root(assets.model_root), options=options, loader=load,
        )

    # -- lifecycle ----------------------------------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.session is not None

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this pipeline is closed (closed, cancelled or failed); create a new H3Pipeline")

    def load(self, progress: StageProgress | None = None) -> None:
        """Load the text encoder, the VAEs and the native session now (once, whichever thread asks first); sets
        `initialization_seconds`."""
        self._check_open()
        check_callback(progress, "progress")
        with self._lock:
            self._check_open()  # closed while this thread waited
            if self.loaded:
                return
            start = time.perf_counter()
            assert self._loader is not None
            with MODEL_LOAD_LOCK:
                self.conditioner, self.vaes, self.session = self._loader(progress)
            self.initialization_seconds = time.perf_counter() - start
            logger.info("pipeline %s ready in %.2f s", self.profile.id, self.initialization_seconds)

    def close(self) -> None:
        """Release the session (waits for its devices and for a running request), the encoder and the VAEs.
        Idempotent."""
        self._closed = True
        with self._lock:
            for part in (self.session, self.conditioner, self.vaes):
                if part is not None:
                    part.close()
            self.session = self.conditioner = self.vaes = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stages -------------------------------------------------------------------------------------------------------

    def validate(self, request: VideoRequest) -> RequestPlan:
        """Everything about `request` that can be checked before any model loads; raises `VflashError`."""
        self._check_open()
        if not isinstance(request, VideoRequest):
            hint = ""
            if isinstance(request, str):
                hint = f"; wrap the prompt: VideoRequest(prompt={request[:20]!r}{'...' if len(request) > 20 else ''})"
            raise RequestError(f"H3Pipeline.validate takes a VideoRequest, got {type(request).__name__}{hint}")
        return plan_request(request, self.profile, self.canvas, self.prompt_budget)

    @property
    def config(self) -> H3Config:
        self.load()
        assert self.session is not None  # load() sets every part or raises
        return self.session.compiled.config

    def encode(self, request: VideoRequest, timings: dict[str, float] | None = None) -> BundleHandoff:
        """Prompt and media -> a one-shot conditioning handoff for `denoise`."""
        plan = self.validate(request)
        with self._lock:
            self.load()
            assert self.conditioner is not None and self.vaes is not None  # load() sets every part or raises
            return build_request_bundle(self.conditioner, self.vaes, request, plan, self.config, self.canvas, timings)

    def denoise(
        self, bundle_or_handoff, progress: Callable[[int, int], None] | None = None, preview: PreviewFn | None = None
    ) -> GenerationResult:
        """Run the native core; `progress(done, total)` and `preview(done, total, video x0)` after every evaluation
        (either may raise to abort; `progress.PreviewFn`)."""
        self._check_open()
        with self._lock:
            self.load()
            assert self.session is not None  # load() sets every part or raises
            return self.session.generate(
                bundle_or_handoff, progress=progress, profile_denoise=self.options.profile_denoise, preview=preview
            )

    def decode(self, video_latents: torch.Tensor, audio_latents: torch.Tensor) -> DecodedMedia:
        """(1, C, F, h, w) and (2, C_a, A) normalised latents -> frames and stereo waveform."""
        self._check_open()
        with self._lock:
            self.load()
            _, _, latent_frames, latent_height, latent_width = video_latents.shape
            frames = video_num_frames(latent_frames)
            geometry = Geometry(latent_height * VAE_SPATIAL_RATIO, latent_width * VAE_SPATIAL_RATIO, frames)
            self._check_memory(geometry, denoise=False)
            assert self.vaes is not None  # load() sets every part or raises
            return self.vaes.decode(video_latents, audio_latents)

    def _check_memory(self, geometry: Geometry, denoise: bool = True) -> None:
        """Refuse, before anything runs, a request whose denoise or decode does not fit the memory plan (a pipeline
        loaded with `from_prepared` on a GPU or under a cap). The denoise is checked here without the text rows, which
        only the encode knows (the session checks it again, exactly, before it runs); the encode is checked exactly by
        the conditioner before it moves anything."""
        assert self.session is not None and self.vaes is not None  # its callers load the parts first
        plan = self.session.plan
        if plan is None or plan.placement.vaes is None:
            return
        # The VAEs took this plan (`from_prepared`), and a plan that places them chooses their video decoder.
        needs = {"decode": self.vaes.decode_need(geometry.num_frames, geometry.height, geometry.width).transient}
        if denoise:
            needs["denoise"] = self.session.memory.evaluation_bytes(request_rows(self.config, geometry, 0))
        plan.check(needs, f"a {geometry.width}x{geometry.height} clip of {geometry.num_frames} frames")

    # -- one request --------------------------------------------------------------------------------------------------

    def generate(
        self,
        request: VideoRequest,
        output: str | Path | None,
        overwrite: bool = False,
        progress: StageProgress | None = None,
        cancel: Callable[[], None] | None = None,
        preview: PreviewFn | None = None,
        exact: bool = False,
    ) -> VideoResult:
        """Generate one clip and write it to `output` (MP4; None keeps the decoded media in the result).

        With `exact`, a pipeline run with a fast mode (`RunOptions.fast_mode`) renders this request exactly.

        `cancel()` is polled between stages, between the denoiser's evaluations and the video decoder's blocks; what
        it raises ends the request as `RequestCancelled` and closes the pipeline. `preview(done, total, video x0)` runs
        after every evaluation (`progress.PreviewFn`). What `progress` or `preview` raises aborts the request, re-raised
        unchanged, and leaves the pipeline usable."""
        start = time.perf_counter()
        plan = self.validate(request)
        check_generate_arguments(request, output, overwrite, progress, cancel, preview)
        validated = time.perf_counter() - start
        with self._lock:
            write = self._run(request, plan, output, overwrite, progress, cancel, preview, validated, exact)
        return write()  # holds no lock: another thread's request may encode and denoise meanwhile

    def _run(
        self, request: VideoRequest, plan: RequestPlan, output: str | Path | None, overwrite: bool,
        progress: StageProgress | None, cancel: Callable[[], None] | None, preview: PreviewFn | None, validated: float,
        exact: bool = False,
    ) -> Callable[[], VideoResult]:
        """One validated request up to its decode, under the pipeline's lock (the clock starts after any wait for
        it); returns the rest, the MP4's write, which runs on the CPU once the lock is released."""
        start = time.perf_counter() - validated
        stages: dict[str, float] = {"validate": validated}
        initialization = 0.0
        if not self.loaded:
            load_start = time.perf_counter()
            self.load(progress)
            initialization = time.perf_counter() - load_start
        self._check_open()  # closed while this request waited
        assert self.conditioner is not None and self.vaes is not None and self.session is not None  # loaded above

        def poll() -> None:
            if cancel is not None:
                try:
                    cancel()
                except BaseException as exc:
                    raise RequestCancelled(f"request cancelled: {exc}") from exc

        # What the caller's progress or preview callback raises aborts this request and leaves the pipeline usable.
        guarded = CallbackGuard()
        report = guarded(progress) or (lambda stage, done, total: None)
        preview = guarded(preview)

        self._check_memory(plan.geometry)
        # Each stage reports (stage, 0, total) as it starts, so that a progress bar times the whole stage.
        try:
            # An MP4 stream opened here outlives the lock: `write` takes its context over once the decode is done.
            with contextlib.ExitStack() as stack:
                poll()
                report("encode", 0, 1)
                t = time.perf_counter()
                handoff = build_request_bundle(
                    self.conditioner, self.vaes, request, plan, self.config, self.canvas, stages
                )
                stages["encode"] = time.perf_counter() - t
                report("encode", 1, 1)
                poll()

                def on_evaluation(done: int, total: int) -> None:
                    report("denoise", done, total)
                    poll()

                report("denoise", 0, self.profile.nfe)
                t = time.perf_counter()
                generation = self.session.generate(
                    handoff, progress=on_evaluation, profile_denoise=self.options.profile_denoise, preview=preview,
                    exact=exact,
                )
                stages["denoise"] = time.perf_counter() - t
                poll()
                report("decode", 0, 2)
                t = time.perf_counter()
                after_stage = stage_timer(
                    stages, lambda stage: report("decode", ("decode.video", "decode.audio").index(stage) + 1, 2)
                )
                latents = (generation.video_latents, generation.audio_latents)
                between_blocks = poll if cancel is not None else None
                stream = None
                if output is not None and self.options.media_video_input == "stream":
                    # The MP4 is encoded while the video decodes; `write` is what is left of it after the decode.
                    stream = stack.enter_context(mp4_stream(
                        output, plan.geometry.width, plan.geometry.height, self.vaes.sample_rate, FPS,
                        video_threads=self.options.media_video_threads, overwrite=overwrite,
                        video_crf=self.options.media_video_crf, video_preset=self.options.media_video_preset,
                    ))
                media = decode_latents(
                    self.vaes, *latents, after_stage, between_blocks, video_sink=None if stream is None else stream.add
                )
                stages["decode"] = time.perf_counter() - t
                del latents
                if output is not None:
                    poll()
                    report("write", 0, 1)
                t = time.perf_counter()
                soundtrack = delivered_soundtrack(media)
                open_stream = stack.pop_all()
        except BaseException as exc:
            self._end_on_failure(exc, guarded)
            raise
        metadata, session_timing = self._metadata(request, media, soundtrack, generation), generation.session
        del generation  # the write keeps no device tensor

        def write() -> VideoResult:
            path = None
            try:
                with open_stream:
                    if stream is not None:
                        stream.finish(soundtrack)
                        assert output is not None  # a stream is opened for an output only
                        path = Path(output)
                    elif output is not None:
                        assert media.frames is not None  # decoded without a video sink
                        path = write_mp4(output, media.frames, soundtrack, media.sample_rate, FPS,
                                         self.options.media_video_input, self.options.media_video_threads, overwrite,
                                         video_crf=self.options.media_video_crf,
                                         video_preset=self.options.media_video_preset)
                if path is not None:
                    stages["write"] = time.perf_counter() - t
                    report("write", 1, 1)
            except BaseException as exc:
                self._end_on_failure(exc, guarded)
                raise
            return VideoResult(
                path=path, elapsed_seconds=time.perf_counter() - start - initialization, stages=stages,
                session=session_timing, mode=plan.mode, width=plan.geometry.width, height=plan.geometry.height,
                num_frames=media.num_frames, fps=FPS, sample_rate=media.sample_rate, metadata=metadata,
                media=None if output is not None else media,
            )

        return write

    def _end_on_failure(self, exc: BaseException, guarded: CallbackGuard) -> None:
        """A cancel, or a failure that is not the user's, ends the pipeline (what a caller's callback raised does
        not)."""
        caller_stopped = guarded.raised is not None
        if not caller_stopped and (isinstance(exc, RequestCancelled) or not isinstance(exc, VflashError)):
            self.close()

    def _metadata(
        self, request: VideoRequest, media: DecodedMedia, soundtrack: torch.Tensor, generation: Any
    ) -> dict[str, object]:
        """What a result reports of how it was made; read under the lock, while the parts are open."""
        assert self.conditioner is not None and self.session is not None  # a request ran on them
        metadata = {
            **generation.metadata,
            "seed": request.seed,
            "duration_seconds": media.num_frames / FPS,
            "audio_samples": soundtrack.shape[1],
            "media_video_input": self.options.media_video_input,
            "media_video_threads": self.options.media_video_threads,
            "media_video_crf": self.options.media_video_crf,
            "media_video_preset": self.options.media_video_preset,
            "encoder_residency": "resident" if self.conditioner.keep_on_device else "offload",
        }
        if self.session.plan is not None and self.session.plan.placement.vaes is not None:
            metadata["memory_plan"] = asdict(self.session.plan.placement)
        if generation.denoise_profile is not None:
            metadata["denoise_profile"] = generation.denoise_profile
        return metadata
