"""The model files the node pack offers and what identifies them: the options of the loaders (compiled outputs and
prepared-assets receipts in the vflash folders, diffusers model roots, single-file H3 transformers in
models/diffusion_models and models/unet (.safetensors and .gguf), LoRAs), the path an option resolves to, the
identity ComfyUI's cache compares (paths, sizes, modification times; nothing is hashed), and the profile an option
runs (read from its manifests).

What an option names is decided in one place, `option_kind` (its docstring states the rule); every other module asks
it rather than reading an option's prefix."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.errors import VflashError, WeightFileError
from vflash_core.formats import PIPELINE_FORMAT
from vflash_core.media.references import CanvasRules
from vflash_core.pipeline.assets import PreparedAssets
from vflash_core.pipeline.demo import DEMO_PROFILE, ensure_demo_assets
from vflash_core.profiles import Profile, get_profile
from vflash_core.tensor_store import TensorStore
from vflash_core.weights.checkpoint import SourceWeights
from vflash_core.weights.family import DEMO_FAMILY
from vflash_core.weights.gguf_file import GGUFStore

from .interfaces import Folders, Host, HostStageProgress

__all__ = [
    "COMPONENT_FOLDERS",
    "DEMO",
    "DOWNLOADS",
    "OFFICIAL_KINDS",
    "check_model_option",
    "compiled_paths",
    "component_options",
    "demo_receipt",
    "is_h3_transformer_file",
    "lora_options",
    "lora_path",
    "model_identity",
    "model_options",
    "official_transformer",
    "option_kind",
    "path_identity",
    "recorded_canvas",
    "recorded_profile",
    "resolve",
]

logger = logging.getLogger(__name__)

DEMO = "embedded-demo"
COMPONENT_FOLDERS = {"te": "text_encoder", "vae": "vae"}  # the model root's folder that identifies a component

_H3_MARKERS = (
    "transformer_blocks.0.attn.to_q.weight",
    "blocks.0.attn.qkv_proj.weight",
    "model.diffusion_model.blocks.0.attn.qkv_proj.weight",
    "diffusion_model.blocks.0.attn.qkv_proj.weight",
)
_h3_file_cache: dict[tuple, bool] = {}

SINGLE_FILE_SUFFIXES = (".safetensors", ".gguf")
OFFICIAL_KINDS = ("file", "root")  # official weights: prepared and compiled for a profile on first use
_OLD_FILE_PREFIX = "diffusion_models/"  # how the loader spelled a single file before it named it as core's UNETLoader
# Where the model options of the shipped templates are downloaded from, named in the refusal when one is missing: a
# folder model cannot be offered by the frontend's Missing Models (it lists files), and the refusal is what a user of
# those templates sees.
_COMFY_ORG_FILES = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/diffusion_models"
DOWNLOADS = {
    "diffusers/MiniMax-H3": "download the repository https://huggingface.co/MiniMaxAI/MiniMax-H3 as that folder",
    "minimax_h3_fl2va_bf16.safetensors": f"download {_COMFY_ORG_FILES}/minimax_h3_fl2va_bf16.safetensors",
    "minimax_h3_ref2va_bf16.safetensors": f"download {_COMFY_ORG_FILES}/minimax_h3_ref2va_bf16.safetensors",
}


# -- what an option names ----------------------------------------------------------------------------------------


def option_kind(option: str) -> str:
    """What a model option names, by its form alone (nothing is read); the one rule of the options' spelling:

    - "demo": `embedded-demo`;
    - "file": an option ending in .safetensors or .gguf (any case) is a single-file H3 transformer, named as core's
      UNETLoader names it, by its path relative to a diffusion_models folder (models/diffusion_models or models/unet,
      any subfolder: `x.safetensors`, `h3/x.gguf`). This is checked first, so `vflash/x.safetensors` is the file
      models/diffusion_models/vflash/x.safetensors, and no compiled output or model root is listed under a name of
      that form (it would read as a file);
    - "receipt": `vflash/<x>.json`, a prepared-assets receipt in the vflash folders;
    - "compiled": `vflash/<folder>`, a compiled output in the vflash folders;
    - "root": `diffusers/<name>`, a diffusers-layout model root.

    Anything else raises `VflashError`. LoRAs are not model options: the LoRA loader lists the files of models/loras
    by their relative paths (`lora_path`)."""
    if option == DEMO:
        return "demo"
    if _names_a_file(option):
        return "file"
    key, _, rel = option.partition("/")
    if key == "vflash" and rel:
        return "receipt" if option.endswith(".json") else "compiled"
    if key == "diffusers" and rel:
        return "root"
    raise VflashError(
        f"{option!r} is not a model option (expected embedded-demo, vflash/..., diffusers/..., or a .safetensors or "
        ".gguf file in models/diffusion_models)"
    )


def _names_a_file(name: str) -> bool:
    return name.lower().endswith(SINGLE_FILE_SUFFIXES)


def _listable(option: str) -> bool:
    """A compiled output or model root whose name ends like a file is not listed (`option_kind` reads it as one)."""
    if _names_a_file(option):
        logger.debug("not listing %s: a name ending in .safetensors or .gguf is a diffusion_models file", option)
        return False
    return True


# -- listing -----------------------------------------------------------------------------------------------------


def is_h3_transformer_file(path: str | Path) -> bool:
    """True when a .safetensors or .gguf file's header names H3 transformer tensors (reads the header only, cached).
    Without the gguf package every .gguf file is listed: choosing one then says how to install it."""
    path = Path(path)
    key = path_identity(path)
    if key not in _h3_file_cache:
        try:
            names = set(GGUFStore(path).names if path.suffix.lower() == ".gguf" else TensorStore(path).names)
        except WeightFileError as exc:
            if path.suffix.lower() == ".gguf" and "needs the gguf package" in str(exc):
                return True
            logger.debug("not listing %s as an H3 transformer: %s", path, exc)
            names = set()
        _h3_file_cache[key] = any(marker in names for marker in _H3_MARKERS)
    return _h3_file_cache[key]


def _gguf_files(folders: Folders) -> list[str]:
    """The .gguf files under the diffusion_models folders (ComfyUI's models/unet and models/diffusion_models), as
    relative paths: ComfyUI lists only its own extensions there (ComfyUI-GGUF adds a `unet_gguf` key for them)."""
    found: set[str] = set()
    for base in folders.folders("diffusion_models"):
        for root, _, files in os.walk(base, followlinks=True):
            ggufs = [os.path.join(root, f) for f in files if f.lower().endswith(".gguf")]
            found.update(os.path.relpath(path, base).replace(os.sep, "/") for path in ggufs)
    return sorted(found)


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
    return [option for option in out if _listable(option)]


def _compiled_entries(folders: Folders) -> list[str]:
    """`vflash/<folder>` entries: compiled outputs (artifact/manifest.json inside) in the vflash folders."""
    marker = "/artifact/manifest.json"
    entries = {"vflash/" + rel[: -len(marker)] for rel in folders.filenames("vflash") if rel.endswith(marker)}
    return sorted(option for option in entries if _listable(option))


def _receipt_entries(folders: Folders) -> list[str]:
    """`vflash/<file>.json` entries: prepared-assets receipts (at most 1 MiB) in the vflash folders."""
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
    """The model loader's options (`option_kind` names their forms); single files by their path in diffusion_models,
    as core's UNETLoader lists them."""
    files = [*(r for r in folders.filenames("diffusion_models") if _names_a_file(r)), *_gguf_files(folders)]
    singles = [
        rel for rel in dict.fromkeys(files)
        if (path := folders.full_path("diffusion_models", rel)) and is_h3_transformer_file(path)
    ]
    return [DEMO, *_receipt_entries(folders), *_compiled_entries(folders), *_model_roots(folders, None), *singles]


def component_options(folders: Folders, kind: str) -> list[str]:
    """The options of a text encoder ("te") or VAE pair ("vae") loader."""
    return [DEMO, *_receipt_entries(folders), *_model_roots(folders, COMPONENT_FOLDERS[kind])]


def lora_options(folders: Folders) -> list[str]:
    return [rel for rel in folders.filenames("loras") if rel.endswith(".safetensors")]


# -- resolving and identity --------------------------------------------------------------------------------------


def _where(folders: Folders, key: str) -> str:
    """What follows "belongs in models/<key>" in a refusal: where ComfyUI looks, or that it looks nowhere."""
    if folders.folders(key):
        return f" (ComfyUI looks in {', '.join(folders.folders(key))})"
    return f", and no {key} folder is registered (vflash run-workflow registers them under --models-dir)"


def _find(folders: Folders, key: str, rel: str, name: str) -> Path:
    full = folders.full_path(key, rel)
    if full is None:
        download = f": {DOWNLOADS[name]}" if name in DOWNLOADS else ""  # first: the list of folders can be long
        raise VflashError(f"{name} is missing: {rel} belongs in models/{key}{download}{_where(folders, key)}")
    return Path(full)


def resolve(folders: Folders, name: str) -> Path:
    """The file or folder behind a model option (`option_kind`; not the demo); raises `VflashError` naming the models
    folder it belongs in and where ComfyUI looked. An option of the old spelling `diffusion_models/<rel>` that names
    no file (the loader listed single files so before it named them as core does) is refused in one line naming the
    option to pick, `<rel>`."""
    kind = option_kind(name)
    if kind == "demo":
        raise VflashError(f"{name!r} is built on first use, not a model file")
    if kind != "file":
        key, _, rel = name.partition("/")
        return _find(folders, key, rel, name)
    full = folders.full_path("diffusion_models", name)
    if full is None and name.startswith(_OLD_FILE_PREFIX):
        new = name[len(_OLD_FILE_PREFIX) :]
        there = folders.full_path("diffusion_models", new)
        once = "" if there else f" once it is in models/diffusion_models{_where(folders, 'diffusion_models')}"
        raise VflashError(f"{name!r} is the old spelling of {new}; pick {new} in the loader{once}")
    return _find(folders, "diffusion_models", name, name)


def lora_path(folders: Folders, lora: str) -> Path:
    """The file behind a LoRA loader option (its path relative to models/loras)."""
    return _find(folders, "loras", lora, lora)


_IDENTITY_FILES = (
    "artifact/manifest.json",
    "schedule/manifest.json",
    "auxiliary.safetensors",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "transformer_ref/config.json",
    "transformer_ref/diffusion_pytorch_model.safetensors.index.json",
    "text_encoder/config.json",
    "vae/config.json",
    "audio_vae/config.json",
)


def path_identity(path: Path) -> tuple:
    """(path, size, mtime) of a file, or of every file directly identifying a folder model (manifests, configs)."""
    if path.is_file():
        stat = path.stat()
        return (str(path), stat.st_size, stat.st_mtime_ns)
    return (
        str(path),
        tuple((rel, *path_identity(path / rel)[1:]) for rel in _IDENTITY_FILES if (path / rel).is_file()),
    )


def model_identity(folders: Folders, name: str, component: str = "") -> tuple:
    """What `fingerprint_inputs` compares: the option plus size and mtime of what it resolves to (of its `component`
    folder, e.g. "text_encoder", when the model root has one)."""
    if name == DEMO:
        return (DEMO,)
    path = resolve(folders, name)
    return path_identity(path / component if (path / component).exists() else path)


def check_model_option(folders: Folders, model: str) -> str:
    """The model option alone, as the loader's `validate_inputs` checks it when the graph is queued: it resolves (else
    one refusal naming the models folder it belongs in), and a single-file transformer is in a form Vflash reads (its
    header only: bf16, fp8_scaled, int8_convrot and GGUF files are read; other quantized formats are refused, and a
    GGUF without the gguf package). Returns the resolved path."""
    if model == DEMO:
        return ""
    path = resolve(folders, model)
    if option_kind(model) == "file":
        SourceWeights(path)
    return str(path)


# -- what an option holds ----------------------------------------------------------------------------------------


def compiled_paths(folder: Path) -> tuple[Path, Path, Path]:
    """The artifact, schedule overlay and auxiliary tensors of a compiled output folder."""
    return folder / "artifact", folder / "schedule", folder / "auxiliary.safetensors"


def official_transformer(path: Path, profile: Profile) -> Path:
    """The transformer weights official weights compile from for a profile: a single file as it is; in a diffusers
    model root, the profile's partition folder (`transformer/`, or `transformer_ref/` for the ref2va profiles)."""
    return path if path.is_file() else path / profile.variant


def demo_receipt(host: Host) -> Path:
    """The embedded demo family's prepared-assets receipt, built on first use (a progress bar per stage)."""
    return ensure_demo_assets(progress=HostStageProgress(host))


def recorded_profile(model: str, path: str, profile: str) -> Profile | None:
    """The profile an option runs: the explicit one, or the one recorded in its manifests ("auto"); None for
    official weights with "auto" (they need an explicit profile). Reads manifests only."""
    if profile != "auto":
        return get_profile(profile)
    kind = option_kind(model)
    if kind == "demo":
        return get_profile(DEMO_PROFILE)
    if kind == "receipt":
        return PreparedAssets.load(path).profile
    if kind == "compiled":
        return get_profile(CompiledArtifact(*compiled_paths(Path(path))).profile_id)
    return None


def recorded_canvas(model: str, path: str) -> CanvasRules:
    """The canvas rules of an option's model family, read from its files (nothing is built): the embedded demo
    family's, a prepared-assets receipt's recorded canvas (what `vflash generate` checks a request against), or a
    diffusers model root's `modular_model_index.json`. Raises `VflashError` for an option without a model root."""
    kind = option_kind(model)
    if kind == "demo":
        rules = DEMO_FAMILY.canvas  # what the demo build records in its modular_model_index.json
        return CanvasRules(rules["canvas_short_edge"], rules["canvas_max_pixels"], rules["reference_image_short_edge"])
    if kind == "receipt":
        return PreparedAssets.load(path).canvas
    if kind == "root":
        return CanvasRules.from_model_root(path)
    raise VflashError(f"{model} has no model root: choose a model folder or prepared-assets receipt")
