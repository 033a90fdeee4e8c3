"""What each Vflash graph node does, host-neutral: the ComfyUI nodes (`nodes/`) and `vflash run-workflow` both call
these functions, so a workflow behaves the same in ComfyUI and headless.

A node operation takes plain values (widget values, core tensors, the specs other nodes returned), makes the engine
calls, and returns plain values. A request is checked by `vflash_core.pipeline.validation`'s checks and runs the pipeline's
own steps (`pipeline.encode_request`, `EncodedRequest.bundle`, `vae.decode_latents`) on the engines the loader nodes
gave. Everything host-specific comes in through two small interfaces:

* `Host`: progress bars, the interrupt check, freeing the host's own models, the default device, the host's
  `NestedTensor` class and VIDEO type;
* `Folders`: listing and resolving model files (ComfyUI's `folder_paths`, or the headless host's).

Loaded engines (transformer sessions, text encoders, VAE pairs) live in an `EngineRegistry` that the caller owns (the
node pack keeps one for the process, `run-workflow` one per run). Node outputs never hold an engine, only a frozen
spec; operations `acquire` the engine from the registry, which loads it on first use or after it was released (by
`VflashUnload`, `force_offload`, or a failure). That keeps ComfyUI's cached node outputs valid across unloads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from vflash_core.engine.layout import FPS, Geometry, align_num_frames, frames_for_duration
from vflash_core.errors import IdentityMismatchError, RequestError, VflashError, WeightFileError, check_choice
from vflash_core.formats import check_device, device_arch
from vflash_core.pipeline.options import STRATEGIES, WEIGHT_RESIDENCIES

from . import comfy_latent as cl

logger = logging.getLogger(__name__)

DEMO = "embedded-demo"
UNLOAD_TARGETS = ("all", "dit", "te", "vae")
COMPONENT_FOLDERS = {"te": "text_encoder", "vae": "vae"}  # the model root's folder that identifies a component
_KIND_LABEL = {"dit": "transformer", "te": "text encoder", "vae": "VAEs"}


# -- host interfaces ---------------------------------------------------------------------------------------------


class ProgressSink(Protocol):  # comfy.utils.ProgressBar
    def update_absolute(self, value: int, total: int | None = None) -> None: ...


class Host(Protocol):
    nested: type  # the host's NestedTensor class (constructor takes a tuple of tensors)

    def progress(self, total: int) -> ProgressSink: ...

    def check_interrupt(self) -> None: ...

    def preview(self, total: int, device: torch.device, channels: int) -> Callable[[int, int, torch.Tensor], None] | None: ...

    def free_memory(self) -> None: ...

    def default_device(self) -> str: ...

    def make_video(self, images: torch.Tensor, audio: dict[str, Any], fps: float) -> Any: ...

    def log(self, line: str) -> None: ...


class Folders(Protocol):
    def filenames(self, key: str) -> list[str]: ...

    def folders(self, key: str) -> list[str]: ...

    def full_path(self, key: str, name: str) -> str | None: ...


# -- model listing and identity ----------------------------------------------------------------------------------

_H3_MARKERS = ("transformer_blocks.0.attn.to_q.weight", "blocks.0.attn.qkv_proj.weight", "model.diffusion_model.blocks.0.attn.qkv_proj.weight", "diffusion_model.blocks.0.attn.qkv_proj.weight")
_h3_file_cache: dict[tuple, bool] = {}


def is_h3_transformer_file(path: str | Path) -> bool:
    """True when a .safetensors file's header names H3 transformer tensors (reads the header only, cached)."""
    from vflash_core.tensor_store import TensorStore

    path = Path(path)
    key = path_identity(path)
    if key not in _h3_file_cache:
        try:
            names = set(TensorStore(path).names)
        except WeightFileError as exc:
            logger.debug("not listing %s as an H3 transformer: %s", path, exc)
            names = set()
        _h3_file_cache[key] = any(marker in names for marker in _H3_MARKERS)
    return _h3_file_cache[key]


def _model_roots(folders: Folders, component: str | None) -> list[str]:
    """`diffusers/<name>` folders that hold an H3 model root (with `component/` when given)."""
    out = []
    for base in folders.folders("diffusers"):
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            root = Path(base, name)
            if (root / "transformer" / "config.json").is_file() and (component is None or (root / component).is_dir()):
                out.append(f"diffusers/{name}")
    return out


def _compiled_entries(folders: Folders) -> list[str]:
    """`vflash/<folder>` entries: compiled outputs (artifact/manifest.json inside) in the vflash folders."""
    return sorted({"vflash/" + rel[: -len("/artifact/manifest.json")] for rel in folders.filenames("vflash") if rel.endswith("/artifact/manifest.json")})


def _receipt_entries(folders: Folders) -> list[str]:
    """`vflash/<file>.json` entries: prepared-assets receipts (at most 1 MiB) in the vflash folders."""
    from vflash_core.formats import PIPELINE_FORMAT

    out = []
    for rel in folders.filenames("vflash"):
        if not rel.endswith(".json") or "/artifact/" in rel or "/schedule/" in rel:
            continue
        path = folders.full_path("vflash", rel)
        if path is None or not os.path.isfile(path) or os.path.getsize(path) > 1 << 20:  # a FIFO would block the read
            continue
        try:
            if json.loads(Path(path).read_text()).get("format") == PIPELINE_FORMAT:
                out.append("vflash/" + rel)
        except (OSError, ValueError) as exc:
            logger.debug("not listing %s as a receipt: %s", path, exc)
    return out


def model_options(folders: Folders) -> list[str]:
    singles = [
        f"diffusion_models/{rel}"
        for rel in folders.filenames("diffusion_models")
        if rel.endswith(".safetensors") and (path := folders.full_path("diffusion_models", rel)) and is_h3_transformer_file(path)
    ]
    return [DEMO, *_receipt_entries(folders), *_compiled_entries(folders), *_model_roots(folders, None), *singles]


def component_options(folders: Folders, kind: str) -> list[str]:
    """The options of a text encoder ("te") or VAE pair ("vae") loader."""
    return [DEMO, *_receipt_entries(folders), *_model_roots(folders, COMPONENT_FOLDERS[kind])]


def lora_options(folders: Folders) -> list[str]:
    return [rel for rel in folders.filenames("loras") if rel.endswith(".safetensors")]


def resolve(folders: Folders, name: str) -> Path:
    """The file or folder behind a listed option; raises `VflashError` naming the models folder it belongs in and
    where ComfyUI looked."""
    key, _, rel = name.partition("/")
    if name == DEMO or not rel or key not in ("vflash", "diffusers", "diffusion_models", "loras"):
        raise VflashError(f"{name!r} is not a model file option (expected vflash/..., diffusers/..., diffusion_models/... or loras/...)")
    full = folders.full_path(key, rel)
    if full is None:
        if folders.folders(key):
            raise VflashError(f"{name} is missing: {rel} belongs in models/{key} (ComfyUI looks in {', '.join(folders.folders(key))})")
        raise VflashError(f"{name} is missing: {rel} belongs in models/{key}, and no {key} folder is registered "
                          "(vflash run-workflow registers them under --models-dir)")
    return Path(full)


_IDENTITY_FILES = ("artifact/manifest.json", "schedule/manifest.json", "auxiliary.safetensors", "transformer/config.json",
                   "transformer/diffusion_pytorch_model.safetensors.index.json", "transformer_ref/config.json",
                   "transformer_ref/diffusion_pytorch_model.safetensors.index.json", "text_encoder/config.json", "vae/config.json",
                   "audio_vae/config.json")


def path_identity(path: Path) -> tuple:
    """(path, size, mtime) of a file, or of every file directly identifying a folder model (manifests, configs)."""
    if path.is_file():
        stat = path.stat()
        return (str(path), stat.st_size, stat.st_mtime_ns)
    return (str(path), tuple((rel, *path_identity(path / rel)[1:]) for rel in _IDENTITY_FILES if (path / rel).is_file()))


def model_identity(folders: Folders, name: str, component: str = "") -> tuple:
    """What `fingerprint_inputs` compares: the option plus size and mtime of what it resolves to (of its `component`
    folder, e.g. "text_encoder", when the model root has one)."""
    if name == DEMO:
        return (DEMO,)
    path = resolve(folders, name)
    return path_identity(path / component if (path / component).exists() else path)


# -- specs: what node outputs carry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraRef:
    path: str
    strength: float
    identity: tuple


@dataclass(frozen=True)
class ModelSpec:
    """VFLASH_MODEL: everything that identifies one transformer engine (the registry key)."""

    source: str  # option name ("embedded-demo", "vflash/...", "diffusers/...", "diffusion_models/...")
    path: str  # resolved file or folder ("" for the demo)
    identity: tuple
    profile: str  # requested profile id, or "auto"
    device: str  # resolved when loading ("auto" -> the host's device)
    peer_device: str | None
    strategy: str | None
    weight_residency: str
    attention_backend: str
    loras: tuple[LoraRef, ...] = ()
    compile_dir: str = ""  # where official weights are compiled for the profile on first use

    def key(self) -> tuple:
        return ("dit", self.identity, self.profile, self.device, self.peer_device, self.strategy, self.weight_residency, self.attention_backend, self.loras)


@dataclass(frozen=True)
class ComponentSpec:
    """VFLASH_TE / VFLASH_VAE: a text encoder or VAE pair of one model root on one device."""

    kind: str  # "te" or "vae"
    source: str
    path: str
    identity: tuple
    device: str

    def key(self) -> tuple:
        return (self.kind, self.identity, self.device)


# -- the registry ------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    key: tuple
    engine: Any
    label: str


class EngineRegistry:
    """Loaded engines by kind ("dit", "te", "vae"); at most one per kind, keyed by its spec.

    Acquiring a spec whose key differs from the loaded engine of its kind closes that engine first (so two
    transformers never hold device memory at once), then loads the new one. Closed or failed engines are replaced.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def loaded(self) -> dict[str, str]:
        """kind -> the option name of the engine loaded for it."""
        return {kind: e.label for kind, e in self._entries.items()}

    def engine(self, kind: str) -> Any | None:
        """The loaded engine of `kind` ("dit": `NativeEngineSession`, "te": `TextConditioner`, "vae": `MediaVAEs`)."""
        entry = self._entries.get(kind)
        return None if entry is None else entry.engine

    def acquire(self, kind: str, key: tuple, label: str, factory: Callable[[], Any]) -> Any:
        entry = self._entries.get(kind)
        if entry is not None and entry.key == key and not getattr(entry.engine, "closed", False):
            return entry.engine
        self.release(kind)
        engine = factory()
        self._entries[kind] = _Entry(key, engine, label)
        return engine

    def release(self, kind: str = "all") -> list[str]:
        """Close the engines of `kind` ("all", "dit", "te" or "vae"); returns what was released."""
        check_choice("unload target", kind, UNLOAD_TARGETS)
        released = []
        for k in list(self._entries) if kind == "all" else [kind]:
            entry = self._entries.pop(k, None)
            if entry is not None:
                entry.engine.close()
                released.append(f"{_KIND_LABEL[k]} {entry.label}")
        if released and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return released


# -- small helpers -----------------------------------------------------------------------------------------------


def resolve_device(host: Host, device: str) -> str:
    """'auto' -> the host's compute device now; an explicit device must exist (`formats.check_device`)."""
    return str(check_device(host.default_device() if device == "auto" else device, None))


def request_geometry(width: int, height: int, length: int, seconds: float) -> Geometry:
    """Canvas and snapped frame count of the widget values (seconds > 0 overrides length)."""
    from vflash_core.media.references import CanvasRules
    from vflash_core.pipeline.validation import check_canvas_size

    check_canvas_size(int(height), int(width), CanvasRules())  # at most the released model's canvas, before any model loads
    if seconds and not math.isfinite(float(seconds) * FPS):  # before the frame count becomes an integer
        raise RequestError(f"seconds must be a finite number of seconds, got {seconds}")
    if seconds and seconds > 0:
        frames = frames_for_duration(float(seconds))
    else:
        if length < 1:
            raise RequestError(f"length must be at least 1 frame, got {length}")
        frames = align_num_frames(int(length))
    return Geometry(int(height), int(width), frames)


def _memory_line(metadata: Mapping[str, Any]) -> str:
    mem = metadata.get("memory", {})
    peak = mem.get("peak_allocated_bytes")
    peak_text = ", ".join(f"{b / 2**30:.2f} GiB" for b in peak) if peak else "n/a (cpu)"
    return (
        f"Vflash memory plan: residency {mem.get('weight_residency')}, {mem.get('blocks_on_device')} blocks on device, "
        f"{mem.get('pinned_host_bytes', 0) / 2**30:.2f} GiB pinned host, peak allocated {peak_text}"
    )


# -- what a model option resolves to -----------------------------------------------------------------------------


def _compiled_paths(folder: Path) -> tuple[Path, Path, Path]:
    """The artifact, schedule overlay and auxiliary tensors of a compiled output folder."""
    return folder / "artifact", folder / "schedule", folder / "auxiliary.safetensors"


def _demo_receipt(host: Host) -> Path:
    from vflash_core.pipeline.demo import ensure_demo_assets

    return ensure_demo_assets(progress=_StageProgress(host))


class _StageProgress:
    """A `(stage, done, total)` callback (demo build, pipeline load, compile) on a host progress bar, a fresh bar for
    each new stage; every update checks for an interrupt."""

    def __init__(self, host: Host):
        self.host = host
        self.bar: ProgressSink | None = None
        self.stage: str | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.host.check_interrupt()
        if self.bar is None or stage != self.stage:
            self.bar, self.stage = self.host.progress(max(1, total)), stage
        self.bar.update_absolute(done, total)


def _progress(host: Host) -> Callable[[int, int], None]:
    """A `(done, total)` callback of one long call on a host progress bar, checking for an interrupt on every update."""
    stages = _StageProgress(host)
    return lambda done, total: stages("", done, total)


def resolve_model(host: Host, spec: ModelSpec) -> tuple[Any, Path, Path, Path]:
    """The compiled transformer a spec runs, as `NativeEngineSession` takes it: (profile, artifact, schedule overlay,
    auxiliary tensors); on first use official weights are prepared and compiled. Raises `VflashError`."""
    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.pipeline.h3_pipeline import PreparedAssets
    from vflash_core.profiles import get_profile

    def pick(recorded: str):
        if spec.profile not in ("auto", recorded):
            raise VflashError(f"{spec.source} is compiled for profile {recorded}; the loader asks for {spec.profile} (choose 'auto' or {recorded})")
        return get_profile(recorded)

    if spec.loras and (spec.source == DEMO or spec.source.startswith("vflash/")):
        raise VflashError(f"{spec.source} is already compiled (LoRAs are compiled into the weights); connect a LoRA only when loading official weights (diffusers/... or diffusion_models/...)")
    if spec.source == DEMO or spec.source.endswith(".json"):
        assets = PreparedAssets.load(_demo_receipt(host) if spec.source == DEMO else Path(spec.path))
        return pick(assets.profile.id), assets.artifact, assets.schedule_overlay, assets.auxiliary_tensor
    if spec.source.startswith("vflash/"):
        paths = _compiled_paths(Path(spec.path))
        return pick(CompiledArtifact(*paths).profile_id), *paths
    # Official weights (`model_spec` refused "auto" for them): prepare + compile once for the profile, next to the
    # other compiled models.
    profile = get_profile(spec.profile)
    if len(spec.loras) > 1:
        raise VflashError(f"a profile binds at most one LoRA; the chain has {len(spec.loras)}")
    if spec.loras and profile.adapter is not None and abs(spec.loras[0].strength - profile.adapter.strength) > 1e-9:
        raise VflashError(f"profile {profile.id} binds its LoRA at strength {profile.adapter.strength:g}; the chain asks {spec.loras[0].strength:g}")
    return profile, *_compiled_paths(compile_on_first_use(host, spec, profile))


def compile_on_first_use(host: Host, spec: ModelSpec, profile: Any) -> Path:
    """The compile of official weights for `profile`, made on first use beside the other compiled models, keyed by
    the files' identity: the receipt next to it must describe the files as they are now (paths, sizes, modification
    times) and the compile must be the one made from the weights that receipt hashed. A file replaced since, or a
    receipt left by a first use that was interrupted after its prepare, is prepared (hashed) again; a compile of other
    weights is removed and compiled again, never used stale. One bar per step (hash, verify, compile), advanced per
    file or block; an interrupt between two of them abandons the step and publishes nothing (the receipt and the
    compiled folder are written atomically)."""
    from vflash_core.fileio import remove_folder
    from vflash_core.weights.compiler import compile_receipt, compiled_from, prepare, receipt_describes

    out = Path(spec.compile_dir)
    receipt = out.with_name(out.name + ".weights-receipt.json")
    root = official_transformer(Path(spec.path), profile)
    adapter = spec.loras[0].path if spec.loras else None
    out.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(receipt) and not receipt_describes(receipt, root, adapter):
        host.log(f"Vflash: {spec.source} is not the file it was prepared from (its size or modification time changed, or it moved); preparing it again")
        receipt.unlink()
    if not receipt.is_file():
        host.log(f"Vflash: preparing {spec.source} for {profile.id} (hashing the weights) ...")
        prepare(profile, root, receipt, adapter, progress=_StageProgress(host))
    if out.exists() and not compiled_from(out, receipt):
        host.log(f"Vflash: {out} was compiled from other weights than {spec.source} holds now; compiling it again")
        remove_folder(out)
    if not out.exists():
        host.check_interrupt()
        host.log(f"Vflash: compiling {spec.source} for {profile.id} into {out} (once) ...")
        compile_receipt(receipt, out, "cpu" if profile.arch == "cpu" else spec.device, progress=_StageProgress(host))
    return out


def component_root(host: Host, spec: ComponentSpec) -> Path:
    """The model root a text encoder ("te") or VAE pair ("vae") spec loads from."""
    from vflash_core.pipeline.h3_pipeline import PreparedAssets

    if spec.source == DEMO:
        assets = PreparedAssets.load(_demo_receipt(host))
    elif spec.source.startswith("vflash/") and spec.source.endswith(".json"):
        assets = PreparedAssets.load(spec.path)
    elif spec.source.startswith("diffusers/"):
        return Path(spec.path)
    else:
        raise VflashError(f"{spec.source} has no {_KIND_LABEL[spec.kind]}: choose a model folder or prepared-assets receipt")
    return assets.model_root if spec.kind == "te" else assets.decoder_root


# -- node operations: loaders ------------------------------------------------------------------------------------


def select_lora(folders: Folders, lora: str, strength: float, prev: tuple[LoraRef, ...] | None = None) -> tuple[LoraRef, ...]:
    path = resolve(folders, "loras/" + lora)
    return (*(prev or ()), LoraRef(str(path), float(strength), path_identity(path)))


def recorded_profile(model: str, path: str, profile: str):
    """The profile an option runs: the explicit one, or the one recorded in its manifests ("auto"); None for
    official weights with "auto" (they need an explicit profile). Reads manifests only."""
    from vflash_core.profiles import get_profile

    if profile != "auto":
        return get_profile(profile)
    if model == DEMO:
        from vflash_core.pipeline.demo import DEMO_PROFILE

        return get_profile(DEMO_PROFILE)
    if model.endswith(".json"):
        from vflash_core.pipeline.h3_pipeline import PreparedAssets

        return PreparedAssets.load(path).profile
    if model.startswith("vflash/"):
        from vflash_core.engine.artifact import CompiledArtifact

        return get_profile(CompiledArtifact(*_compiled_paths(Path(path))).profile_id)
    return None


def check_profile_device(profile: Any, device: str, what: str = "device") -> None:
    """Refuse a resolved device whose architecture is not the one the profile's tables were computed on, naming the
    profiles that run on it instead."""
    try:
        check_device(device, profile.arch, what, profile.id)
    except IdentityMismatchError as exc:
        arch = device_arch(device)
        runnable = [p for p in runnable_profiles() if p != "auto" and p.endswith(f"-{arch}")]
        hint = f"; profiles for {arch} here: {', '.join(runnable[:4])}{' ...' if len(runnable) > 4 else ''}" if runnable else ""
        raise IdentityMismatchError(f"{exc}{hint}") from None


def runnable_profiles() -> list[str]:
    """'auto', then the profiles this machine can run: its GPUs' architectures in device order, then the CPU's. A
    saved workflow's other profile is not in the list, so ComfyUI refuses it when the graph is queued."""
    from vflash_core.profiles import PROFILES

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = [*dict.fromkeys(device_arch(f"cuda:{index}") for index in range(count)), "cpu"]
    runnable = sorted((p for p in PROFILES.values() if p.arch in here), key=lambda p: (here.index(p.arch), p.id))
    return ["auto", *(p.id for p in runnable)]


def present_devices() -> list[str]:
    """'auto', 'cpu' and the CUDA devices this machine has."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["auto", "cpu", *(f"cuda:{i}" for i in range(count))]


def official_transformer(path: Path, profile: Any) -> Path:
    """The transformer weights official weights compile from for a profile: a single file as it is; in a diffusers
    model root, the profile's partition folder (`transformer/`, or `transformer_ref/` for the ref2va profiles)."""
    return path if path.is_file() else path / profile.variant


def check_model_option(folders: Folders, model: str) -> str:
    """The model option alone, as the loader's `validate_inputs` checks it when the graph is queued: it resolves (else
    one refusal naming the models folder it belongs in), and a single-file transformer is in a form Vflash reads (its
    header only: quantized formats without an exact dequantization are refused). Returns the resolved path."""
    if model == DEMO:
        return ""
    path = resolve(folders, model)
    if model.startswith("diffusion_models/"):
        from vflash_core.weights.checkpoint import SourceWeights

        SourceWeights(path)
    return str(path)


def check_loader(host: Host, folders: Folders, model: str, profile: str, weight_residency: str, device: str,
                 peer_device: str, strategy: str, attention_backend: str) -> tuple[str, str, str | None]:
    """Every check of the model loader that needs no model work: option values, the model option, the profile,
    the devices' existence and architecture vs the profile. Returns (resolved path, device, peer device)."""
    from vflash_core.engine.attention import BACKENDS
    from vflash_core.profiles import get_profile

    check_choice("weight_residency", weight_residency, WEIGHT_RESIDENCIES)
    check_choice("strategy", strategy, STRATEGIES)
    check_choice("attention_backend", attention_backend, tuple(BACKENDS))
    if profile != "auto":
        get_profile(profile)  # an unknown profile is refused before the model option is resolved
    path = check_model_option(folders, model)
    chosen = recorded_profile(model, path, profile)
    if model.startswith(("diffusers/", "diffusion_models/")):
        from vflash_core.weights.checkpoint import SourceWeights

        if chosen is None:
            raise VflashError(f"{model} holds official weights; choose the profile to compile them for (e.g. {runnable_profiles()[1]})")
        transformer = official_transformer(Path(path), chosen)
        if not transformer.exists():
            raise VflashError(f"{model} has no {transformer.name}/: profile {chosen.id} compiles the {transformer.name} partition of a model root")
        # The file's form (header and scales only): quantized formats without an exact dequantization are refused, and
        # a pruned file pairs only with a -pruned profile.
        SourceWeights(transformer).check_profile(chosen)
    if device == "auto" and chosen is not None and chosen.arch == "cpu":
        device = "cpu"  # a CPU-compiled profile (the embedded demo's) runs on the CPU whatever the host's device
    resolved = resolve_device(host, device)
    peer = None if peer_device in (None, "", "none") else resolve_device(host, peer_device)
    if peer is not None and peer == resolved:
        raise VflashError(f"peer_device {peer} is the loader's device; choose another GPU or 'none'")
    if chosen is not None:
        check_profile_device(chosen, resolved)
        if peer is not None:
            check_profile_device(chosen, peer, "peer device")
    return path, resolved, peer


LOADER_WIDGETS = ("model", "profile", "weight_residency", "device", "peer_device", "strategy", "attention_backend")


def loader_refusals(prompt: Mapping[str, Mapping[str, Any]] | None, host: Host, folders: Folders) -> list[str]:
    """`check_loader` for every VflashModelLoader of an API prompt whose widgets are constants: the checks across its
    widgets (the profile vs the file and the devices). They run here, not in the loader's `validate_inputs`, because
    ComfyUI files a refusal of `validate_inputs` once per argument it takes. Cheap: headers and manifests only."""
    out: list[str] = []
    for nid, node in (prompt or {}).items():
        if not isinstance(node, Mapping) or node.get("class_type") != "VflashModelLoader":
            continue
        widgets = node.get("inputs", {})
        if not all(isinstance(widgets.get(name), str) for name in LOADER_WIDGETS):
            continue  # a linked widget: the loader checks its value when it runs
        reason = refusal(check_loader, host, folders, *(widgets[name] for name in LOADER_WIDGETS))
        if reason is not True:
            out.append(f"node {nid} (VflashModelLoader): {reason}")
    return out


def _linked(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)


def encode_mode(inputs: Mapping[str, Any]) -> str:
    """The mode a VflashEncode node of an API prompt encodes, from which of its inputs are given (no values needed)."""
    from vflash_core.pipeline.validation import request_mode

    given = {name for name, value in inputs.items() if value is not None}
    references = any(name.split(".")[0] in ("ref_images", "ref_videos", "ref_audios") for name in given)
    return request_mode("first_frame" in given, "last_frame" in given, references)


def graph_refusals(prompt: Mapping[str, Mapping[str, Any]] | None, folders: Folders) -> list[str]:
    """Profile vs request for every VflashSampler of an API prompt, read from the graph alone (the loader's profile,
    which inputs of the encode node are connected, its length): what must not reach any model work. Cheap: reads
    manifests only; a node whose own checks fail is left to them."""
    out: list[str] = []
    for nid, node in (prompt or {}).items():
        if not isinstance(node, Mapping) or node.get("class_type") != "VflashSampler":
            continue
        inputs = node.get("inputs", {})
        model_link, cond_link = inputs.get("model"), inputs.get("cond")
        if not (_linked(model_link) and _linked(cond_link)):
            continue
        loader, encode = prompt.get(model_link[0], {}), prompt.get(cond_link[0], {})
        if loader.get("class_type") != "VflashModelLoader" or encode.get("class_type") != "VflashEncode":
            continue
        widgets, e = loader.get("inputs", {}), encode.get("inputs", {})
        model, profile_id = widgets.get("model"), widgets.get("profile", "auto")
        if not isinstance(model, str) or not isinstance(profile_id, str):
            continue
        try:
            profile = recorded_profile(model, "" if model == DEMO else str(resolve(folders, model)), profile_id)
        except VflashError:
            continue
        if profile is None:
            continue
        try:
            mode = encode_mode(e)
        except VflashError as exc:  # keyframes and references together: no mode
            out.append(f"node {cond_link[0]} (VflashEncode): {exc}")
            continue
        if mode not in profile.modes:
            out.append(f"node {nid} (VflashSampler): profile {profile.id} (node {model_link[0]}) accepts {', '.join(profile.modes)}; "
                       f"node {cond_link[0]} (VflashEncode) encodes a {mode} request")
            continue
        if not any(_linked(e.get(k)) for k in ("width", "height", "length", "seconds")):
            try:
                geometry = request_geometry(e.get("width", 1344), e.get("height", 768), e.get("length", 124), e.get("seconds", 0.0))
                profile.check_duration(geometry.num_frames / FPS)
            except VflashError as exc:
                out.append(f"node {nid} (VflashSampler): {exc}")
    return out


def check_graph(prompt: Mapping[str, Mapping[str, Any]] | None, host: Host, folders: Folders) -> None:
    """Raise the graph's refusals (`loader_refusals`, then `graph_refusals`); the Vflash nodes that do model work call
    it first, so whichever of them ComfyUI runs first refuses the graph before any Vflash model work."""
    refusals = loader_refusals(prompt, host, folders) + graph_refusals(prompt, folders)
    if refusals:
        raise VflashError("this graph cannot run: " + "; ".join(refusals))


def refusal(check: Callable[..., Any], *args: Any) -> bool | str:
    """What `validate_inputs` returns for a check: True, or its refusal as text (ComfyUI shows it before anything runs)."""
    try:
        check(*args)
    except VflashError as exc:
        return str(exc)
    return True


def validate_device(host: Host, device: str) -> bool | str:
    """`validate_inputs` of a device widget: True, or why the device cannot be used here (a saved workflow's cuda:N
    that this machine lacks is named as such before the list is)."""
    reason = refusal(resolve_device, host, device)
    if reason is True and device not in present_devices():
        return f"device must be one of {', '.join(present_devices())}, got {device!r}"
    return reason


def model_spec(host: Host, folders: Folders, model: str, profile: str, weight_residency: str, device: str, peer_device: str,
               strategy: str, attention_backend: str, lora: tuple[LoraRef, ...] | None = None) -> ModelSpec:
    """Validate the loader's widgets into a spec (cheap; loads nothing, writes nothing)."""
    path, resolved, peer = check_loader(host, folders, model, profile, weight_residency, device, peer_device, strategy, attention_backend)
    loras = tuple(lora or ())
    compile_dir = ""
    if model.startswith(("diffusers/", "diffusion_models/")):  # official weights (check_loader refused "auto" for them)
        from vflash_core.pipeline.demo import default_cache_dir

        # Compiled for the profile on first use: models/vflash/compiled/<name>-<profile>[-<LoRA>].
        root, bases = Path(path), folders.folders("vflash")
        name = f"{root.stem if root.is_file() else root.name}-{profile}"
        compiled = (Path(bases[0]) if bases else default_cache_dir()) / "compiled"
        compile_dir = str(compiled / (f"{name}-{Path(loras[0].path).stem}" if loras else name))
    return ModelSpec(model, path, model_identity(folders, model), profile, resolved, peer, strategy if peer else None,
                     weight_residency, attention_backend, loras, compile_dir)


def _load_session(registry: EngineRegistry, host: Host, spec: ModelSpec):
    from vflash_core.engine.session import NativeEngineSession

    def factory():
        host.free_memory()
        return NativeEngineSession(
            *resolve_model(host, spec), device=spec.device, peer_device=spec.peer_device, strategy=spec.strategy,
            weight_residency=spec.weight_residency, attention_backend=spec.attention_backend, on_load_progress=_progress(host),
        )

    return registry.acquire("dit", spec.key(), spec.source, factory)


def load_model(registry: EngineRegistry, host: Host, folders: Folders, model: str, profile: str, weight_residency: str,
               device: str, peer_device: str, strategy: str, attention_backend: str, lora: tuple[LoraRef, ...] | None = None) -> ModelSpec:
    """VflashModelLoader: validate, then load the engine now (progress bar) so errors surface at the loader."""
    spec = model_spec(host, folders, model, profile, weight_residency, device, peer_device, strategy, attention_backend, lora)
    session = _load_session(registry, host, spec)
    host.log(f"Vflash model {spec.source}: profile {session.profile.id}, {session.memory_plan()}")
    return spec


def _load_component(registry: EngineRegistry, host: Host, spec: ComponentSpec):
    from vflash_core.media.conditioning import TextConditioner
    from vflash_core.media.vae import MediaVAEs

    def factory():
        host.free_memory()
        return (TextConditioner if spec.kind == "te" else MediaVAEs).from_pretrained(component_root(host, spec), spec.device)

    return registry.acquire(spec.kind, spec.key(), spec.source, factory)


def load_component(registry: EngineRegistry, host: Host, folders: Folders, kind: str, source: str, device: str) -> ComponentSpec:
    """VflashTextEncoderLoader (`kind` "te") and VflashVAELoader ("vae"): validate, then load the engine now."""
    path = "" if source == DEMO else str(resolve(folders, source))
    spec = ComponentSpec(kind, source, path, model_identity(folders, source, COMPONENT_FOLDERS[kind]), resolve_device(host, device))
    _load_component(registry, host, spec)
    return spec


# -- ComfyUI core's own text encoder and VAEs ---------------------------------------------------------------------

# What Vflash measured of core's text conditioning (ComfyUI 0.33.0 `comfy/text_encoders/minimax.py` on the same
# Qwen3-VL weights as the diffusers conditioner): the README's ComfyUI section has the numbers and the test.
CORE_TEXT_NOTE = (
    "text conditioning from ComfyUI core's CLIP (its own Qwen3-VL code): the same presentation (labels, vision "
    "blocks, row tags) as diffusers' hidden_states[50], but not bitwise equal to it (measured on ComfyUI 0.33.0 with a "
    "small Qwen3-VL: up to 2e-6 apart with fp32 weights, up to 0.17 with bf16 weights, for values up to 5), so "
    "results are not bitwise those of the diffusers pipeline"
)
CORE_VAE_NOTE = (
    "keyframe / reference latents from ComfyUI core's VAE (its own H3 VAE code, posterior mean); the diffusers "
    "pipeline samples the posterior with seed 42, so conditioning latents differ from it"
)


def _pil_to_image(picture) -> torch.Tensor:
    """PIL RGB -> core IMAGE (1, H, W, 3) fp32 0..1."""
    import numpy as np

    return torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32) / 255.0)[None]


class CoreTextConditioner:
    """Vflash's text-conditioner interface over core's CLIP loaded with `CLIPLoader(type="minimax")`.

    The presentation is core's `MiniMaxH3Tokenizer` (labels and vision blocks in Vflash's order: keyframes as
    `images`, references as `minimax_ref_items`); the conditioning is core's CONDITIONING tensor and its
    `minimax_token_tags`. ComfyUI owns the model's memory (core loads and offloads it as for its own nodes).
    """

    def __init__(self, clip: Any, canvas: Any = None):
        from vflash_core.media.references import CanvasRules

        self.clip = clip
        self.canvas = canvas or CanvasRules()

    def _ref_items(self, references: list) -> list[dict[str, Any]]:
        import numpy as np

        from vflash_core.media.conditioning import sample_video_frames

        items: list[dict[str, Any]] = []
        for ref in references:
            if ref.has_audio:
                items.append({"type": "audio"})
            if ref.kind == "image":
                items.append({"type": "image", "data": _pil_to_image(ref.image)})
            elif ref.kind == "video":
                frames, _ = sample_video_frames(np.asarray(ref.frames), 2)
                items.append({"type": "video", "data": torch.from_numpy(np.stack(frames).astype(np.float32) / 255.0)})
        return items

    @torch.no_grad()
    def encode(self, prompt: str, keyframes: list | None = None, references: list | None = None):
        from vflash_core.media.conditioning import TextConditioning

        if references:
            tokens = self.clip.tokenize(prompt, minimax_ref_items=self._ref_items(references))
        else:
            tokens = self.clip.tokenize(prompt, images=[_pil_to_image(k) for k in keyframes or []])
        conditioning = self.clip.encode_from_tokens_scheduled(tokens)
        if not conditioning:
            raise VflashError("core CLIP returned no conditioning")
        embeds, extra = conditioning[0][0], conditioning[0][1]
        tags = extra.get("minimax_token_tags") if isinstance(extra, dict) else None
        if tags is None or embeds.ndim != 3 or embeds.shape[0] != 1:
            raise RequestError(
                "this CLIP is not MiniMax-H3's text encoder: load the Qwen3-VL file from text_encoders/ with core "
                "CLIPLoader, type 'minimax' (its conditioning carries minimax_token_tags)"
            )
        tags = tags.reshape(-1).long().cpu()
        if tags.shape[0] != embeds.shape[1]:
            raise VflashError(f"core CLIP returned {embeds.shape[1]} conditioning rows and {tags.shape[0]} token tags")
        return TextConditioning(embeds[0].detach().cpu(), tags, [])


class CoreVAEs:
    """Vflash's VAE-pair interface (`MediaVAEs`) over core's H3 video VAE and, optionally, its audio VAE.

    Core's VAEs take and return the normalised latents the transformer works on (the same as Vflash's), pixels in
    0..1, and manage their own device memory; the audio VAE is needed to decode and for soundtracks.
    """

    def __init__(self, video_vae: Any, audio_vae: Any = None):
        if getattr(video_vae, "latent_dim", 3) != 3:
            raise RequestError("the vae input takes MiniMax-H3's video VAE (VAELoader of the video VAE file); connect the audio VAE to audio_vae")
        if audio_vae is not None and getattr(audio_vae, "latent_dim", 2) != 2:
            raise RequestError("the audio_vae input takes MiniMax-H3's audio VAE (VAELoader of the audio VAE file)")
        self.video_vae = video_vae
        self.audio_vae = audio_vae

    def _audio(self) -> Any:
        if self.audio_vae is None:
            raise RequestError("a core video VAE is connected without its audio VAE: connect MiniMax-H3's audio VAE (VAELoader) to audio_vae")
        return self.audio_vae

    @property
    def latent_channels(self) -> int:
        """The video latent's channels: the model's own (its post-quant conv), else what core records (24)."""
        conv = getattr(getattr(self.video_vae, "first_stage_model", None), "post_quant_conv", None)
        return int(getattr(conv, "in_channels", None) or getattr(self.video_vae, "latent_channels", 24))

    @property
    def audio_latent_channels(self) -> int:
        mean = getattr(getattr(self.audio_vae, "first_stage_model", None), "latents_mean", None)
        return int(mean.shape[0]) if mean is not None else int(getattr(self.audio_vae, "latent_channels", 32))

    @property
    def sample_rate(self) -> int:
        """The audio VAE's rate (H3's 32 kHz when no audio VAE is connected: references are resampled to it)."""
        return int(getattr(self.audio_vae, "audio_sample_rate", 32000))

    @contextlib.contextmanager
    def on_device(self):
        yield self  # ComfyUI moves core's VAEs itself

    @torch.no_grad()
    def encode_pixels(self, frames) -> torch.Tensor:
        """(F, H, W, 3) uint8 -> (1, C, f, H/16, W/16) fp32 normalised, CPU."""
        pixels = torch.from_numpy(frames.astype("float32") / 255.0) if not isinstance(frames, torch.Tensor) else frames.float() / 255.0
        return self.video_vae.encode(pixels).float().cpu()

    @torch.no_grad()
    def encode_soundtrack(self, waveform: torch.Tensor) -> torch.Tensor:
        """(2, S) at the VAE's rate -> (2 A, C) normalised channel-major rows, CPU."""
        latents = self._audio().encode(waveform.float()[None].movedim(1, -1)).float().cpu()  # (1, C, 2, A)
        return latents[0].permute(1, 2, 0).reshape(-1, latents.shape[1])

    @torch.no_grad()
    def decode_video(self, video_latents: torch.Tensor, between_blocks: Callable[[], None] | None = None) -> torch.Tensor:
        """(1, C, F, h, w) normalised -> (F', 16 h, 16 w, 3) fp32 in [0, 1], CPU; `between_blocks()` before each block
        of core's ViT decoder (`first_stage_model.decoder.transformer_blocks`; a model without them is not polled)."""
        from vflash_core.media.vae import calling_between_blocks

        decoder = getattr(getattr(self.video_vae, "first_stage_model", None), "decoder", None)
        with calling_between_blocks(decoder, between_blocks if hasattr(decoder, "transformer_blocks") else None):
            images = self.video_vae.decode(video_latents)
        return images.reshape(-1, *images.shape[-3:]).float().clamp(0, 1).cpu()

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> torch.Tensor:
        """(2, C, A) normalised -> (2, A * hop) fp32 waveform, CPU (core's decode, without VAEDecodeAudio's loudness
        normalisation)."""
        waveform = self._audio().decode(cl.audio_to_comfy(audio_latents))  # (1, T, 2)
        return waveform[0].movedim(-1, 0).float().cpu()


def _text_conditioner(registry: EngineRegistry, host: Host, te: Any):
    if isinstance(te, ComponentSpec):
        return _load_component(registry, host, te)
    if callable(getattr(te, "tokenize", None)) and callable(getattr(te, "encode_from_tokens_scheduled", None)):  # core CLIP
        return CoreTextConditioner(te)
    raise RequestError(f"te takes a Vflash text encoder (VflashTextEncoderLoader) or core CLIP (CLIPLoader, type minimax), got {type(te).__name__}")


def _vae_pair(registry: EngineRegistry, host: Host, vae: Any, audio_vae: Any = None):
    if isinstance(vae, ComponentSpec):
        if audio_vae is not None:
            raise RequestError("audio_vae goes with a core video VAE; a Vflash VAE loader already holds both VAEs")
        return _load_component(registry, host, vae)
    if callable(getattr(vae, "decode", None)) and callable(getattr(vae, "encode", None)):  # core VAE
        return CoreVAEs(vae, audio_vae)
    raise RequestError(f"vae takes a Vflash VAE pair (VflashVAELoader) or core's H3 video VAE (VAELoader), got {type(vae).__name__}")


# -- node operations: encode, sample, decode (the pipeline's steps on the nodes' inputs) ---------------------------


def _to_pil(image: torch.Tensor, what: str):
    import numpy as np
    from PIL import Image

    frame = cl.image_to_frame(image, what)
    return Image.fromarray((frame.clamp(0, 1).numpy() * 255.0).round().astype(np.uint8))


def _slots(group: Mapping[str, Any] | None) -> dict[int, Any]:
    """Autogrow values (`ref_image_0`, `ref_image_1`, ...) by slot index, in index order, unconnected slots skipped."""
    items = sorted((int(name.rsplit("_", 1)[-1]), value) for name, value in (group or {}).items() if value is not None)
    return dict(items)


def encode(registry: EngineRegistry, host: Host, te: Any, vae: Any, prompt: str, width: int, height: int,
           length: int, seconds: float, first_frame: torch.Tensor | None = None, last_frame: torch.Tensor | None = None,
           ref_images: Mapping[str, Any] | None = None, ref_videos: Mapping[str, Any] | None = None,
           ref_audios: Mapping[str, Any] | None = None, force_offload: bool = True,
           ref_video_audios: Mapping[str, Any] | None = None, audio_vae: Any = None) -> tuple[Any, dict[str, Any], int]:
    """VflashEncode: the pipeline's validators and encode step (`pipeline.encode_request`) on the node's inputs,
    without the noise (the sampler draws it from its seed, so one encoding serves every seed). `ref_video_audios`
    holds the soundtracks of reference clips: `ref_video_audio_k` belongs to `ref_video_k` (a video file's own
    soundtrack in the pipeline).

    `te` is a Vflash text encoder spec or core's CLIP (`CLIPLoader(type="minimax")`); `vae` a Vflash VAE pair spec
    or core's H3 video VAE, with core's audio VAE in `audio_vae` (needed for soundtracks). With core's encoders the
    conditioning records how it differs from the diffusers pipeline's in `notes`. Returns the encoding (VFLASH_COND,
    a `pipeline.EncodedRequest`), the empty latent of its canvas and its frame count."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    from vflash_core.pipeline.h3_pipeline import encode_request
    from vflash_core.pipeline.validation import check_labels, check_prompt, check_reference_counts, request_mode

    check_prompt(prompt)
    geometry = request_geometry(width, height, length, seconds)
    images, audios = list(_slots(ref_images).values()), list(_slots(ref_audios).values())
    video_slots, soundtrack_slots = _slots(ref_videos), _slots(ref_video_audios)
    orphans = sorted(soundtrack_slots.keys() - video_slots.keys())
    if orphans:
        raise RequestError(f"ref_video_audio_{orphans[0]} is the soundtrack of ref_video_{orphans[0]}, which is not connected")
    videos = list(video_slots.values())
    soundtracks = [soundtrack_slots.get(slot) for slot in video_slots]
    frames = {anchor: f for anchor, f in (("first", first_frame), ("last", last_frame)) if f is not None}
    mode = request_mode("first" in frames, "last" in frames, bool(images or videos or audios))
    check_reference_counts(["image"] * len(images) + ["video"] * len(videos) + ["audio"] * len(audios))
    # <Audio j> counts audio references and reference clips' soundtracks alike (the pipeline's numbering).
    check_labels(prompt, mode, len(images) if mode == "ref2va" else len(frames), len(videos), len(audios) + sum(s is not None for s in soundtracks))

    steps = 2 + bool(frames or mode == "ref2va")
    bar = _progress(host)
    conditioner = _text_conditioner(registry, host, te)
    vaes = _vae_pair(registry, host, vae, audio_vae)
    notes = tuple(note for core, note in ((isinstance(conditioner, CoreTextConditioner), CORE_TEXT_NOTE),
                                          (isinstance(vaes, CoreVAEs) and steps == 3, CORE_VAE_NOTE)) if core)
    references = [MiniMaxH3ImageReference(image=_to_pil(img, f"reference image {i + 1}")) for i, img in enumerate(images)]
    for i, (clip, soundtrack) in enumerate(zip(videos, soundtracks)):
        audio, rate = cl.audio_to_waveform(soundtrack, f"soundtrack of reference video {i + 1}") if soundtrack is not None else (None, None)
        references.append(MiniMaxH3VideoReference(frames=cl.image_to_clip(clip, f"reference video {i + 1}").numpy(), fps=float(FPS), audio=audio, sample_rate=rate))
    for i, audio in enumerate(audios):
        waveform, rate = cl.audio_to_waveform(audio, f"reference audio {i + 1}")
        references.append(MiniMaxH3AudioReference(audio=waveform, sample_rate=rate))
    keyframes = {anchor: _to_pil(f, f"{anchor} frame") for anchor, f in frames.items()}

    def after_stage(stage: str) -> None:
        if stage == "encode.text" and force_offload and isinstance(te, ComponentSpec):
            registry.release("te")
        done = ("encode.inputs", "encode.text", "encode.vae").index(stage) + 1
        if done <= steps:
            bar(done, steps)

    encoded = replace(encode_request(conditioner, vaes, prompt, mode, geometry, keyframes, references, after_stage=after_stage), notes=notes)
    latents = cl.empty_latents(geometry, vaes.latent_channels, vaes.audio_latent_channels)
    for note in notes:
        host.log(f"Vflash encode: {note}")
    return encoded, cl.to_comfy_latent(latents.video, latents.audio, host.nested), geometry.num_frames


def sample(registry: EngineRegistry, host: Host, model: ModelSpec, cond: Any, latent: dict[str, Any], seed: int,
           force_offload: bool = False, profile_denoise: bool = False) -> dict[str, Any]:
    """VflashSampler: the profile's fixed schedule from the seed's noise on VflashEncode's `pipeline.EncodedRequest`;
    returns core's H3 AV latent."""
    from vflash_core.pipeline.validation import check_seed

    check_seed(seed)
    target = cl.from_comfy_latent(latent)
    if not cl.is_empty(target):
        raise RequestError("VflashSampler starts from noise: its latent input must be empty (VflashEncode's or EmptyMiniMaxH3LatentAV's); it only sets the canvas and length")
    geometry = target.geometry
    if cond.mode != "t2va" and geometry != cond.geometry:  # keyframes and references are encoded for their canvas
        raise RequestError(
            f"the {cond.mode} conditioning was encoded for {cond.geometry.width}x{cond.geometry.height}, {cond.geometry.num_frames} frames; "
            f"the latent is {geometry.width}x{geometry.height}, {geometry.num_frames} frames (use VflashEncode's latent or match them)"
        )
    # Profile vs request before the transformer is touched (loading or compiling it is model work).
    profile = recorded_profile(model.source, model.path, model.profile)
    if profile is not None:
        profile.check_mode(cond.mode)
        profile.check_duration(geometry.num_frames / FPS)
    host.free_memory()
    session = _load_session(registry, host, model)
    handoff = cond.bundle(session.compiled.config, seed, geometry)
    stopped: list[BaseException] = []  # what the progress or interrupt callbacks raised to stop the trajectory

    def stopping(callback: Callable[..., None]) -> Callable[..., None]:
        def call(*args: int) -> None:
            try:
                callback(*args)
            except BaseException as exc:
                stopped.append(exc)
                raise

        return call

    # With a previewer the preview callback draws each step's progress bar update (core's one per step, image and
    # value together), so the plain progress callback is left out.
    preview = host.preview(session.profile.nfe, session.device, session.compiled.config.in_channels)
    progress = None if preview is not None else stopping(_progress(host))
    start = time.perf_counter()
    try:
        result = session.generate(handoff, progress=progress, between_blocks=stopping(host.check_interrupt), profile_denoise=profile_denoise,
                                  preview=None if preview is None else stopping(preview))
    except BaseException as exc:
        if not stopped and not isinstance(exc, VflashError):
            # A failed trajectory leaves the session refusing work: close it now, the next run loads a fresh one.
            registry.release("dit")
        raise
    host.log(
        f"Vflash sampled {cond.mode} {geometry.width}x{geometry.height} {geometry.num_frames} frames, seed {seed}, "
        f"{session.profile.id} ({session.profile.nfe} evaluations) in {time.perf_counter() - start:.2f} s"
    )
    host.log(_memory_line(result.metadata))
    notes = [*cond.notes, *session.compiled.base_weight_notes()]
    for note in notes:
        host.log(f"Vflash sampled with {note}")
    if profile_denoise and result.denoise_profile is not None:
        host.log("Vflash denoise profile: " + json.dumps(result.denoise_profile, default=str))
    if force_offload:
        registry.release("dit")
    out = cl.to_comfy_latent(result.video_latents, result.audio_latents, host.nested)
    if notes:
        out["vflash_notes"] = notes  # result metadata: how this differs from the diffusers pipeline on the release
    return out


def decode(registry: EngineRegistry, host: Host, vae: Any, latent: dict[str, Any], audio_vae: Any = None) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """VflashDecode: frames (IMAGE batch), stereo AUDIO trimmed to the video's length, and a VIDEO at 24 fps.
    `vae` is a Vflash VAE pair spec, or core's H3 video VAE with core's audio VAE in `audio_vae`."""
    from vflash_core.media.vae import decode_latents
    from vflash_core.pipeline.h3_pipeline import delivered_soundtrack

    av = cl.from_comfy_latent(latent)
    vaes = _vae_pair(registry, host, vae, audio_vae)
    if isinstance(vaes, CoreVAEs):
        vaes._audio()  # refuse a missing audio VAE before decoding anything
    if av.video.shape[1] != vaes.latent_channels or av.audio.shape[1] != vaes.audio_latent_channels:
        raise RequestError(
            f"the latent has {av.video.shape[1]} video / {av.audio.shape[1]} audio channels; these VAEs take "
            f"{vaes.latent_channels} / {vaes.audio_latent_channels} (a latent of another model family?)"
        )
    bar = _progress(host)
    # ComfyUI's interrupt is polled before every block of the video decoder, so Cancel stops a long decode at once.
    media = decode_latents(vaes, av.video, av.audio, lambda stage: bar(("decode.video", "decode.audio").index(stage) + 1, 2), host.check_interrupt)
    images = cl.frames_to_image(media.frames)
    audio = cl.waveform_to_audio(delivered_soundtrack(media), media.sample_rate)
    return images, audio, host.make_video(images, audio, float(FPS))


def generate(registry: EngineRegistry, host: Host, model: ModelSpec, te: Any, vae: Any, prompt: str,
             width: int, height: int, length: int, seconds: float, seed: int, first_frame: torch.Tensor | None = None,
             last_frame: torch.Tensor | None = None, force_offload: bool = False, audio_vae: Any = None) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """VflashGenerate: encode, sample, decode in one node (Vflash or core text encoder / VAEs, as `encode`)."""
    profile = recorded_profile(model.source, model.path, model.profile)
    if profile is not None:  # before the text encoder runs
        profile.check_mode(encode_mode({"first_frame": first_frame, "last_frame": last_frame}))
    cond, latent, _ = encode(registry, host, te, vae, prompt, width, height, length, seconds, first_frame, last_frame, force_offload=True, audio_vae=audio_vae)
    latent = sample(registry, host, model, cond, latent, seed, force_offload)
    images, audio, video = decode(registry, host, vae, latent, audio_vae)
    return video, images, audio


def unload(registry: EngineRegistry, host: Host, anything: Any, what: str) -> Any:
    """VflashUnload: release engines, empty the host's caches, pass the input through."""
    released = registry.release(what)
    host.free_memory()
    host.log("Vflash unload: " + (", ".join(released) if released else f"nothing of '{what}' was loaded"))
    return anything
