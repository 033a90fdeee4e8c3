"""Prepared assets: a pipeline receipt binding one profile to its six assets (`prepare_pipeline`, `PreparedAssets`),
and the loading of a prepared pipeline's parts, the text encoder, the VAEs and the native session, under one memory
plan sized for the profile's largest request (`PartLoader`, what `H3Pipeline.from_prepared` defers to the first load;
`largest_request`, each part's estimate its own)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine.artifact import CompiledArtifact, CompiledPaths
from ..engine.core_memory import CoreMemory
from ..engine.layout import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK, largest_clip_frames
from ..engine.session import NativeEngineSession
from ..engine.session_hooks import BlockLoader, NativeDenoiserLoader, SessionHooks
from ..errors import IdentityMismatchError, VflashError, describe_value
from ..fileio import atomic_file, check_input_file, check_writable_destination, path_argument
from ..formats import PIPELINE_FORMAT, Field, check_fields, is_object, is_positive
from ..media.conditioning import TEXT_ENCODER_LAYER, TextConditioner, TextEncoderLoader
from ..media.references import CanvasRules
from ..media.vae import VIDEO_DECODERS, MediaVAEs
from ..memory_plan import PLANNED_PICTURES, MemoryPlan, PartSizes, cap_bytes, plan_memory
from ..profiles import Profile, check_identity, get_profile
from ..progress import StageProgress
from ..tensor_store import file_sha256
from .options import RunOptions

__all__ = [
    "ASSET_FIELDS", "PartLoader", "PreparedAssets", "largest_request", "prepare_pipeline",
    "resolve_profile",
]

logger = logging.getLogger(__name__)

# The six fields of an assets file: official model root (text encoder, tokenizer, processor), decoder
# directory (vae/, audio_vae/), adapter file or null, and the three outputs of one compile.
ASSET_FIELDS = ("model_root", "decoder_root", "adapter_path", "artifact", "schedule_overlay", "auxiliary_tensor")
_ASSET_KINDS = {k: "a path string or null" if k == "adapter_path" else "a path string" for k in ASSET_FIELDS}


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

    def compiled_paths(self) -> CompiledPaths:
        return CompiledPaths(self.artifact, self.schedule_overlay, self.auxiliary_tensor)


def resolve_profile(profile: object) -> Profile:
    """A profile id or `Profile` as a `Profile`; anything else is refused in one line."""
    profile = get_profile(profile) if isinstance(profile, str) else profile
    if not isinstance(profile, Profile):
        raise VflashError(f"profile must be a profile id or a Profile, got {describe_value(profile)}")
    return profile


def prepare_pipeline(profile: Profile | str, assets: str | Path, receipt: str | Path) -> PreparedAssets:
    """Validate a six-field assets file against `profile` and write the pipeline receipt (atomically, never over an
    existing file). Reads configs and manifests only; the adapter file is hashed once to bind it to the compile."""
    profile = resolve_profile(profile)
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



# -- loading the parts ---------------------------------------------------------------------------------------------


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


# What a loader returns: the three parts of a pipeline, loaded and placed.
LoadedParts = tuple[TextConditioner, MediaVAEs, NativeEngineSession]


@dataclass(frozen=True)
class PartLoader:
    """Loads a prepared pipeline's parts under one memory plan, each time it is called (a failed load keeps nothing,
    and the next call loads again). `devices`: the primary device (the encoder, the VAEs), then the peer if any;
    `weight_residency`: the core's placement asked for (the run options', or resident for the core's loader hooks);
    the hooks as `H3Pipeline.from_prepared` takes them."""

    assets: PreparedAssets
    options: RunOptions
    devices: tuple[torch.device, ...]
    weight_residency: str
    text_encoder_loader: TextEncoderLoader | None = None
    native_denoiser_loader: NativeDenoiserLoader | None = None
    block_loader: BlockLoader | None = None

    def __call__(self, progress: StageProgress | None) -> LoadedParts:
        """Load the parts, reporting `load` progress (the encoder, the VAEs, then each block of the core)."""
        total = 2 + int(self.assets.record["transformer"]["num_layers"])
        report = progress or (lambda stage, done, total: None)
        report("load", 0, total)
        compiled = CompiledArtifact.at(self.assets.compiled_paths())
        if self.options.verify_weights:  # before anything loads: a corrupt compile costs no encoder load
            compiled.verify()
        core = CoreMemory(compiled, self.assets.profile, self.options.fast_mode)
        limits = cap_bytes(self.options.max_device_memory), cap_bytes(self.options.max_host_memory, "max_host_memory")
        planned = self.devices[0].type == "cuda" or limits[0] is not None
        if planned:  # a budget no placement fits is refused before the encoder and the VAEs load
            self._plan_before_loading(core, limits)
        loaded: list[TextConditioner | MediaVAEs] = []
        try:
            conditioner = TextConditioner.from_pretrained(
                self.assets.model_root, self.devices[0], text_encoder_loader=self.text_encoder_loader
            )
            loaded.append(conditioner)
            report("load", 1, total)
            peer = self.devices[1] if len(self.devices) > 1 else None
            vaes = MediaVAEs.from_pretrained(self.assets.decoder_root, self.devices[0], peer_device=peer)
            loaded.append(vaes)
            report("load", 2, total)
            plan = self._place(core, conditioner, vaes, limits) if planned else None
            if plan is None:  # nothing to plan on the CPU without a cap: everything stays in host memory
                conditioner.keep_on_device = vaes.keep_on_device = self.options.encoder_residency == "resident"
            session = self._session(plan, progress, total)
        except BaseException:
            for part in loaded:  # a failed load (a loader hook's exception included) keeps nothing
                part.close()
            raise
        conditioner.materialize()  # read the (memory-mapped) weights now, not inside the first request
        vaes.materialize()
        return conditioner, vaes, session

    def _plan(
        self, sizes: PartSizes, largest: dict[str, int], limits: tuple[int | None, int | None], log: bool = True
    ) -> MemoryPlan:
        """The memory plan of parts of these sizes for this largest request, within `limits`: the device cap and the
        host budget in bytes (RunOptions refuses a host budget on the CPU without a cap)."""
        cap, host_budget = limits
        return plan_memory(
            sizes, largest, self.devices, cap, self.weight_residency, self.options.encoder_residency,
            host_budget=host_budget, log=log,
        )

    def _plan_before_loading(self, core: CoreMemory, limits: tuple[int | None, int | None]) -> None:
        """Plan every part from its files (`on_meta_device`: no weight read), as `_place` will once they loaded, so a
        budget no placement fits is refused with the same numbers before anything loads. A text encoder from the
        `text_encoder_loader` hook is whatever the hook returns, which its files do not tell: then the core alone is
        planned here (a budget it exceeds, the others would too), and the encoder and the VAEs when they loaded."""
        if self.text_encoder_loader is not None:
            self._plan(core.compiled.part_sizes(), largest_request(self.assets.profile, core), limits, log=False)
            return
        peer = self.devices[1] if len(self.devices) > 1 else None
        conditioner = TextConditioner.on_meta_device(self.assets.model_root, self.devices[0])
        vaes = MediaVAEs.on_meta_device(self.assets.decoder_root, self.devices[0], peer_device=peer)
        largest = largest_request(self.assets.profile, core, conditioner, vaes, self.assets.canvas)
        sizes = core.compiled.part_sizes() + conditioner.part_sizes() + vaes.part_sizes()
        self._plan(sizes, largest, limits, log=False)

    def _place(
        self, core: CoreMemory, conditioner: TextConditioner, vaes: MediaVAEs, limits: tuple[int | None, int | None]
    ) -> MemoryPlan:
        """Plan every part and place the encoder and the VAEs (the session takes the plan when it loads)."""
        largest = largest_request(self.assets.profile, core, conditioner, vaes, self.assets.canvas)
        plan = self._plan(core.compiled.part_sizes() + conditioner.part_sizes() + vaes.part_sizes(), largest, limits)
        conditioner.place(plan)
        vaes.place(plan)
        return plan

    def _session(self, plan: MemoryPlan | None, progress: StageProgress | None, total: int) -> NativeEngineSession:
        """The native session on the plan (its blocks' loading reported after the encoder's and the VAEs')."""
        on_load: Callable[[int, int], None] | None = (
            None if progress is None else (lambda done, n: progress("load", 2 + done, total))
        )
        return NativeEngineSession(
            self.assets.profile, self.assets.compiled_paths(), self.options.engine, plan,
            SessionHooks(on_load, self.native_denoiser_loader, self.block_loader),
        )
