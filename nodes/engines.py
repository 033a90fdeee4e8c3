"""The engines the nodes load, what their outputs carry instead, and where they come from.

Node outputs never hold an engine, only a frozen spec: a transformer's is its files (`TransformerFiles`, an
identity record) and how it runs (the pipeline's `RunOptions`); a text encoder's or VAE pair's is its model root and
device (`ComponentSpec`). Operations `acquire` the engine of a spec from an `EngineRegistry` that the caller owns (the
node pack keeps one for the process, `run-workflow` one per run), which loads it on first use or after it was
released (by `VflashUnload`, `force_offload`, a failure, or the host: in ComfyUI each engine is an entry of core's
model management, which may release it for `/free` or another model). That keeps ComfyUI's cached node outputs valid
across unloads. Official weights are prepared and compiled for the profile on first use, checked against the files on
every use (`compile_on_first_use`).

Before a load the host is asked for the bytes the engine's memory plan needs on its device (`make_room`), so it
releases its own models only as far as needed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.engine.attention_backends import BACKENDS, CPU_BACKENDS
from vflash_core.engine.core_memory import CoreMemory
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.session import NativeEngineSession
from vflash_core.engine.session_hooks import SessionHooks
from vflash_core.errors import IdentityMismatchError, VflashError, check_choice
from vflash_core.fileio import remove_folder
from vflash_core.formats import check_device, device_arch
from vflash_core.media.conditioning import TextConditioner
from vflash_core.media.references import CanvasRules
from vflash_core.media.vae import MediaVAEs
from vflash_core.pipeline.assets import PreparedAssets
from vflash_core.pipeline.demo import default_cache_dir
from vflash_core.pipeline.options import RunOptions
from vflash_core.pipeline.validation import PromptBudget
from vflash_core.profiles import PROFILES, Profile, get_profile
from vflash_core.weights import compiler
from vflash_core.weights.checkpoint import SourceWeights
from vflash_core.weights.lora import LORA_MODES, LoraStack, StackedLora

from .interfaces import Folders, HeldEngine, Host, HostStageProgress, host_progress
from .model_files import (
    OFFICIAL_KINDS,
    check_model_option,
    compiled_paths,
    demo_receipt,
    model_identity,
    official_transformer,
    option_kind,
    recorded_canvas,
    recorded_profile,
)

__all__ = [
    "KIND_LABEL",
    "UNLOAD_TARGETS",
    "ComponentSpec",
    "EngineRegistry",
    "LoraRef",
    "TransformerFiles",
    "TransformerSpec",
    "check_loader",
    "compile_on_first_use",
    "component_root",
    "load_component_engine",
    "load_session",
    "present_devices",
    "resolve_device",
    "resolve_model",
    "runnable_backends",
    "runnable_profiles",
    "text_encoder_rules",
    "transformer_spec",
]

UNLOAD_TARGETS = ("all", "dit", "te", "vae")
KIND_LABEL = {"dit": "transformer", "te": "text encoder", "vae": "VAEs"}


# -- specs: what node outputs carry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraRef:
    path: str
    strength: float
    identity: tuple


@dataclass(frozen=True)
class TransformerFiles:
    """The weights a VFLASH_MODEL runs, as an identity record (no run options): the option, the file or folder it
    resolves to and its identity (`model_files.model_identity`), the profile asked for ("auto": the recorded one),
    the LoRA chain and how it runs (`lora.LORA_MODES`), and where official weights are compiled for the profile on
    first use ("" otherwise)."""

    source: str  # the option (`model_files.option_kind`: embedded-demo, vflash/..., diffusers/..., x.safetensors)
    path: str  # resolved file or folder ("" for the demo)
    identity: tuple
    profile: str
    loras: tuple[LoraRef, ...] = ()
    compile_dir: str = ""
    lora_mode: str = "residual"


@dataclass(frozen=True)
class TransformerSpec:
    """VFLASH_MODEL: the transformer's files and how it runs (devices resolved), the registry's key."""

    files: TransformerFiles
    options: RunOptions

    def key(self) -> tuple:
        return ("dit", self.files, self.options)


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
    held: HeldEngine  # the host's record of it


class EngineRegistry:
    """Loaded engines by kind ("dit", "te", "vae"); at most one per kind, keyed by its spec, each held in the host's
    memory management (`Host.hold`).

    Acquiring a spec whose key differs from the loaded engine of its kind closes that engine first (so two
    transformers never hold device memory at once), then loads the new one. Closed or failed engines are replaced; an
    engine the host released (ComfyUI's `/free` or eviction) is forgotten, and loaded again when next acquired.
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

    def held(self, *kinds: str) -> list[HeldEngine]:
        """The host's records of the loaded engines of `kinds` (what a stage keeps when it asks for room)."""
        return [self._entries[k].held for k in kinds if k in self._entries]

    def acquire(self, host: Host, kind: str, key: tuple, label: str, factory: Callable[[], Any], device: str) -> Any:
        """The engine of `key`, loaded by `factory` (which asks the host for its room) if it is not, then held by the
        host with the bytes it holds on `device` between requests (its `resident_bytes()`: the transformer's weights
        as its memory plan placed them; the text encoder's and the VAEs' only where their device is the CPU, elsewhere
        they wait in host memory and each stage asks for its room then)."""
        entry = self._entries.get(kind)
        if entry is not None and entry.key == key and not getattr(entry.engine, "closed", False):
            return entry.engine
        self.release(kind)
        engine = factory()
        try:
            held = host.hold(
                kind, label, engine, engine.resident_bytes(), torch.device(device),
                lambda: self._forget(kind, engine),
            )
        except BaseException:
            engine.close()
            raise
        self._entries[kind] = _Entry(key, engine, label, held)
        return engine

    def _forget(self, kind: str, engine: Any) -> None:
        """The host released `engine` (or the registry did): drop its entry if it is still this engine's."""
        entry = self._entries.get(kind)
        if entry is not None and entry.engine is engine:
            del self._entries[kind]

    def release(self, kind: str = "all") -> list[str]:
        """Close the engines of `kind` ("all", "dit", "te" or "vae") through the host; returns what was released."""
        check_choice("unload target", kind, UNLOAD_TARGETS)
        released = []
        for k in list(self._entries) if kind == "all" else [kind]:
            entry = self._entries.pop(k, None)
            if entry is not None:
                entry.held.release()
                released.append(f"{KIND_LABEL[k]} {entry.label}")
        if released and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return released


# -- devices and profiles ----------------------------------------------------------------------------------------


def present_devices() -> list[str]:
    """'auto', 'cpu' and the CUDA devices this machine has."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["auto", "cpu", *(f"cuda:{i}" for i in range(count))]


def runnable_backends() -> list[str]:
    """The attention backends this machine can run: every one with a CUDA device, else the CPU's."""
    return list(BACKENDS if torch.cuda.is_available() and torch.cuda.device_count() else CPU_BACKENDS)


def runnable_profiles() -> list[str]:
    """'auto', then the profiles this machine can run: its GPUs' architectures in device order, then the CPU's. A
    saved workflow's other profile is not in the list, so ComfyUI refuses it when the graph is queued."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = [*dict.fromkeys(device_arch(f"cuda:{index}") for index in range(count)), "cpu"]
    runnable = sorted((p for p in PROFILES.values() if p.arch in here), key=lambda p: (here.index(p.arch), p.id))
    return ["auto", *(p.id for p in runnable)]


def resolve_device(host: Host, device: str) -> str:
    """'auto' -> the host's compute device now; an explicit device must exist (`formats.check_device`)."""
    return str(check_device(host.default_device() if device == "auto" else device, None))


def _check_run_devices(options: RunOptions, profile: Profile) -> None:
    """`RunOptions.check_devices`; a device of another architecture than the profile's is refused naming the
    profiles that run on it instead."""
    try:
        options.check_devices(profile)
    except IdentityMismatchError as exc:
        primary = device_arch(torch.device(options.device))
        peer = options.peer_device
        arch = primary if primary != profile.arch or peer is None else device_arch(torch.device(peer))
        runnable = [p for p in runnable_profiles() if p != "auto" and p.endswith(f"-{arch}")]
        hint = (
            f"; profiles for {arch} here: {', '.join(runnable[:4])}{' ...' if len(runnable) > 4 else ''}"
            if runnable
            else ""
        )
        raise IdentityMismatchError(f"{exc}{hint}") from None


# -- the model loader's widgets ----------------------------------------------------------------------------------


def check_loader(
    host: Host, folders: Folders, model: str, profile: str, engine_widgets: Mapping[str, Any]
) -> tuple[str, RunOptions]:
    """Every check of the model loader that needs no model work: the profile, the model option, the engine's options
    from the loader's other widgets (`engine_widgets`, by `EngineOptions`' field names: residency, devices, strategy,
    attention, the host budget, 0 for none, the fast mode and where it can run; any other field goes through as
    given), the host's device cap (`Host.device_cap_gib`) and the devices' existence and architecture vs the profile.
    `strategy` counts only with a peer device.
    Returns (resolved path, run options with the devices resolved)."""
    if profile != "auto":
        get_profile(profile)  # an unknown profile is refused before the model option is resolved
    path = check_model_option(folders, model)
    chosen = recorded_profile(model, path, profile)
    if chosen is None:
        raise VflashError(
            f"{model} holds official weights; choose the profile to compile them for (e.g. {runnable_profiles()[1]})"
        )
    if option_kind(model) in OFFICIAL_KINDS:
        transformer = official_transformer(Path(path), chosen)
        if not transformer.exists():
            raise VflashError(
                f"{model} has no {transformer.name}/: profile {chosen.id} compiles the {transformer.name} partition "
                "of a model root"
            )
        # The file's form (header and scales only): quantized formats without an exact dequantization are refused, and
        # a pruned file pairs only with a -pruned profile.
        SourceWeights(transformer).check_profile(chosen)
    device = engine_widgets.get("device", "auto")
    if device == "auto" and chosen.arch == "cpu":
        device = "cpu"  # a CPU-compiled profile (the embedded demo's) runs on the CPU whatever the host's device
    resolved = resolve_device(host, device)
    max_host_memory = engine_widgets.get("max_host_memory") or None  # the widget's 0: no budget
    if max_host_memory and resolved == "cpu":
        raise VflashError(
            "max_host_memory budgets what a GPU's weights keep in host memory; on the CPU every weight is host "
            "memory: set it to 0"
        )
    peer_device = engine_widgets.get("peer_device")
    peer = None if peer_device in (None, "", "none") else resolve_device(host, peer_device)
    if peer is not None and peer == resolved:
        raise VflashError(f"peer_device {peer} is the loader's device; choose another GPU or 'none'")
    # The host's limit on each device (ComfyUI's --reserve-vram) is the engine's device cap: planned against and
    # enforced, so the engine never takes what core keeps free.
    host_caps = (host.device_cap_gib(d) for d in (resolved, peer) if d is not None)
    caps = [c for c in (engine_widgets.get("max_device_memory"), *host_caps) if c is not None]
    options = RunOptions(EngineOptions(**{
        **engine_widgets, "device": resolved, "peer_device": peer,
        "strategy": engine_widgets.get("strategy") if peer else None, "max_host_memory": max_host_memory,
        "max_device_memory": min(caps) if caps else None,
    }))
    _check_run_devices(options, chosen)
    return path, options


def transformer_spec(
    host: Host,
    folders: Folders,
    model: str,
    profile: str,
    engine_widgets: Mapping[str, Any],
    lora: tuple[LoraRef, ...] | None = None,
    lora_mode: str = "residual",
) -> TransformerSpec:
    """Validate the loader's widgets into a spec (cheap; loads nothing, writes nothing). The fast mode is one of the
    spec's run options, so an exact and a fast engine are different engines of the registry."""
    path, options = check_loader(host, folders, model, profile, engine_widgets)
    check_choice("lora_mode", lora_mode, LORA_MODES)
    loras = tuple(lora or ())
    compile_dir = ""
    if option_kind(model) in OFFICIAL_KINDS:  # official weights (check_loader refused "auto" for them)
        # Compiled for the profile on first use: models/vflash/compiled/<name>-<profile>[-<LoRA>[-<stack digest>]]
        # (one folder per stack: files, order, strengths, mode; the receipt beside it is what proves it current).
        root, bases = Path(path), folders.folders("vflash")
        name = f"{root.stem if root.is_file() else root.name}-{profile}"
        compiled = (Path(bases[0]) if bases else default_cache_dir()) / "compiled"
        if loras:
            name += f"-{Path(loras[0].path).stem}"
        if len(loras) > 1 or loras and lora_mode != "residual":
            stack = json.dumps([[ref.path, ref.strength] for ref in loras] + [lora_mode])
            name += "-" + hashlib.sha256(stack.encode()).hexdigest()[:12]
        compile_dir = str(compiled / name)
    return TransformerSpec(
        TransformerFiles(model, path, model_identity(folders, model), profile, loras, compile_dir, lora_mode), options
    )


# -- what a spec loads -------------------------------------------------------------------------------------------


def resolve_model(host: Host, spec: TransformerSpec) -> tuple[Profile, Path, Path, Path]:
    """The compiled transformer a spec runs, as `NativeEngineSession` takes it: (profile, artifact, schedule overlay,
    auxiliary tensors); on first use official weights are prepared and compiled. Raises `VflashError`."""
    files = spec.files

    def pick(recorded: str) -> Profile:
        if files.profile not in ("auto", recorded):
            raise VflashError(
                f"{files.source} is compiled for profile {recorded}; the loader asks for {files.profile} (choose "
                f"'auto' or {recorded})"
            )
        return get_profile(recorded)

    kind = option_kind(files.source)
    if files.loras and kind not in OFFICIAL_KINDS:
        raise VflashError(
            f"{files.source} is already compiled (LoRAs are compiled into the weights); connect a LoRA only when "
            "loading official weights (a diffusers/... model root or a .safetensors / .gguf transformer file)"
        )
    if kind in ("demo", "receipt"):
        assets = PreparedAssets.load(demo_receipt(host) if kind == "demo" else Path(files.path))
        return pick(assets.profile.id), assets.artifact, assets.schedule_overlay, assets.auxiliary_tensor
    if kind == "compiled":
        paths = compiled_paths(Path(files.path))
        return pick(CompiledArtifact(*paths).profile_id), *paths
    # Official weights (`check_loader` refused "auto" for them): prepare + compile once for the profile, next to the
    # other compiled models.
    profile = get_profile(files.profile)
    if files.loras and profile.adapter is not None and abs(files.loras[0].strength - profile.adapter.strength) > 1e-9:
        raise VflashError(
            f"profile {profile.id} binds its LoRA at strength {profile.adapter.strength:g}; the chain asks "
            f"{files.loras[0].strength:g}"
        )
    device = "cpu" if profile.arch == "cpu" else str(spec.options.device)
    return profile, *compiled_paths(compile_on_first_use(host, files, profile, device))


def compile_on_first_use(host: Host, files: TransformerFiles, profile: Profile, device: str) -> Path:
    """The compile of official weights for `profile` (on `device`), made on first use beside the other compiled
    models, keyed by the files' identity: the receipt next to it must describe the files as they are now (paths,
    sizes, modification times) and the compile must be the one made from the weights that receipt hashed. A file
    replaced since, or a receipt left by a first use that was interrupted after its prepare, is prepared (hashed)
    again; a compile of other weights is removed and compiled again, never used stale. One bar per step (hash, verify,
    compile), advanced per file or block; an interrupt between two of them abandons the step and publishes nothing
    (the receipt and the compiled folder are written atomically)."""
    out = Path(files.compile_dir)
    receipt = out.with_name(out.name + ".weights-receipt.json")
    root = official_transformer(Path(files.path), profile)
    # A profile defined by its adapter (Turbo) takes it as the chain's first LoRA; the rest is the stack after it.
    own = 1 if profile.adapter is not None and files.loras else 0
    adapter = files.loras[0].path if own else None
    stack = LoraStack(tuple(StackedLora(ref.path, ref.strength) for ref in files.loras[own:]), files.lora_mode)
    out.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(receipt) and not compiler.receipt_describes(receipt, root, adapter, stack):
        host.log(
            f"Vflash: {files.source} is not the file it was prepared from (its size or modification time changed, or "
            "it moved), or a LoRA of the chain changed; preparing it again"
        )
        receipt.unlink()
    if not receipt.is_file():
        host.log(f"Vflash: preparing {files.source} for {profile.id} (hashing the weights) ...")
        compiler.prepare(profile, root, receipt, adapter, progress=HostStageProgress(host), loras=stack)
    if out.exists() and not compiler.compiled_from(out, receipt):
        host.log(f"Vflash: {out} was compiled from other weights than {files.source} holds now; compiling it again")
        remove_folder(out)
    if not out.exists():
        host.check_interrupt()
        host.log(f"Vflash: compiling {files.source} for {profile.id} into {out} (once) ...")
        compiler.compile_receipt(receipt, out, device, progress=HostStageProgress(host))
    return out


def load_session(registry: EngineRegistry, host: Host, spec: TransformerSpec) -> NativeEngineSession:
    """The spec's session from the registry, loaded now if it is not (after the host made the room its memory plan
    needs on each device, `CoreMemory.load_room`). The session makes the pipeline's memory plan for the core on a GPU
    (`memory_plan.plan_memory`) from the run options and the memory free then."""
    options = spec.options

    def factory() -> NativeEngineSession:
        profile, artifact, schedule_overlay, auxiliary = resolve_model(host, spec)
        core = CoreMemory(CompiledArtifact(artifact, schedule_overlay, auxiliary), profile, options.fast_mode)
        host.make_room(core.load_room(options.engine))
        return NativeEngineSession(
            profile, CompiledPaths(artifact, schedule_overlay, auxiliary), options.engine,
            hooks=SessionHooks(on_load_progress=host_progress(host)),
        )

    return registry.acquire(host, "dit", spec.key(), spec.files.source, factory, str(options.device))


def component_root(host: Host, spec: ComponentSpec) -> Path:
    """The model root a text encoder ("te") or VAE pair ("vae") spec loads from."""
    kind = option_kind(spec.source)
    if kind == "demo":
        assets = PreparedAssets.load(demo_receipt(host))
    elif kind == "receipt":
        assets = PreparedAssets.load(spec.path)
    elif kind == "root":
        return Path(spec.path)
    else:
        raise VflashError(
            f"{spec.source} has no {KIND_LABEL[spec.kind]}: choose a model folder or prepared-assets receipt"
        )
    return assets.model_root if spec.kind == "te" else assets.decoder_root


def text_encoder_rules(host: Host, spec: ComponentSpec) -> tuple[CanvasRules, PromptBudget]:
    """A text encoder spec's canvas rules (`model_files.recorded_canvas`) and prompt budget, from its files."""
    return recorded_canvas(spec.source, spec.path), PromptBudget.from_model_root(component_root(host, spec))


def load_component_engine(registry: EngineRegistry, host: Host, spec: ComponentSpec) -> TextConditioner | MediaVAEs:
    """The spec's text conditioner or VAE pair from the registry, loaded now if it is not."""

    def factory() -> TextConditioner | MediaVAEs:
        # Loaded into host memory (the device's when it is the CPU): the stage that moves it to the device asks for
        # its room then (`actions`).
        return (TextConditioner if spec.kind == "te" else MediaVAEs).from_pretrained(
            component_root(host, spec), spec.device
        )

    return registry.acquire(host, spec.kind, spec.key(), spec.source, factory, spec.device)
