"""What a queued graph is refused for before any Vflash model work, read from ComfyUI's API prompt (the nodes' hidden
`prompt` input, or the workflow `vflash run-workflow` runs): the model loaders' widgets across each other
(`loader_refusals`) and each sampler's profile against the request its encode node makes (`graph_refusals`); and
what the nodes' `validate_inputs` return (`refusal`, `validate_device`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vflash_core.engine.layout import FPS
from vflash_core.errors import VflashError, listing
from vflash_core.media.references import CanvasRules
from vflash_core.pipeline.validation import check_canvas_size, request_mode

from .engines import check_loader, present_devices, resolve_device
from .interfaces import Folders, Host
from .model_files import DEMO, recorded_canvas, recorded_profile, resolve
from .request_inputs import ENCODE_DEFAULTS, request_geometry

__all__ = [
    "LOADER_OWN_INPUTS",
    "check_graph",
    "core_lora_refusals",
    "encode_mode",
    "graph_refusals",
    "loader_refusals",
    "refusal",
    "validate_device",
]

#: The model loader's inputs that are not the engine's options (`engines.check_loader` takes the others whole).
LOADER_OWN_INPUTS = ("model", "profile", "lora", "lora_mode")


def refusal(check: Callable[..., Any], *args: Any) -> bool | str:
    """What `validate_inputs` returns for a check: True, or its refusal as text (ComfyUI shows it before anything
    runs)."""
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


def loader_refusals(prompt: Mapping[str, Mapping[str, Any]] | None, host: Host, folders: Folders) -> list[str]:
    """`check_loader` for every VflashModelLoader of an API prompt whose widgets are constants: the checks across its
    widgets (the profile vs the file and the devices). They run here, not in the loader's `validate_inputs`, because
    ComfyUI files a refusal of `validate_inputs` once per argument it takes. Cheap: headers and manifests only."""
    out: list[str] = []
    for nid, node in (prompt or {}).items():
        if not isinstance(node, Mapping) or node.get("class_type") != "VflashModelLoader":
            continue
        widgets = node.get("inputs", {})
        engine_widgets = {name: value for name, value in widgets.items() if name not in LOADER_OWN_INPUTS}
        if not all(isinstance(widgets.get(name), str) for name in ("model", "profile")) or any(
            _linked(value) for value in engine_widgets.values()
        ):
            continue  # a linked widget: the loader checks its value when it runs
        reason = refusal(check_loader, host, folders, widgets["model"], widgets["profile"], engine_widgets)
        if reason is not True:
            out.append(f"node {nid} (VflashModelLoader): {reason}")
    return out


def _linked(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)


def encode_mode(inputs: Mapping[str, Any]) -> str:
    """The mode a VflashEncode node of an API prompt encodes, from which of its inputs are given (no values needed)."""
    given = {name for name, value in inputs.items() if value is not None}
    references = any(name.split(".")[0] in ("ref_images", "ref_videos", "ref_audios") for name in given)
    return request_mode("first_frame" in given, "last_frame" in given, references)


def _graph_canvas(prompt: Mapping[str, Mapping[str, Any]], te_link: Any, folders: Folders) -> CanvasRules | None:
    """The canvas rules of the text encoder an encode node's `te` input comes from, read from the graph and the files:
    a Vflash text encoder loader's model family (`recorded_canvas`), core CLIP's (the released rules: core's files
    record none); None where the graph does not say (the encode node checks its canvas when it runs)."""
    if not _linked(te_link):
        return None
    node = prompt.get(te_link[0], {})
    if node.get("class_type") == "CLIPLoader":
        return CanvasRules()
    encoder = node.get("inputs", {}).get("encoder")
    if node.get("class_type") != "VflashTextEncoderLoader" or not isinstance(encoder, str):
        return None
    try:
        return recorded_canvas(encoder, "" if encoder == DEMO else str(resolve(folders, encoder)))
    except VflashError:
        return None  # the loader refuses its option itself


def graph_refusals(prompt: Mapping[str, Mapping[str, Any]] | None, folders: Folders) -> list[str]:
    """Profile vs request for every VflashSampler of an API prompt, read from the graph alone (the loader's profile,
    which inputs of the encode node are connected, its length, its canvas against its text encoder's canvas rules):
    what must not reach any model work. Cheap: reads manifests only; a node whose own checks fail is left to them."""
    out: list[str] = []
    if prompt is None:
        return out
    for nid, node in prompt.items():
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
            out.append(
                f"node {nid} (VflashSampler): profile {profile.id} (node {model_link[0]}) accepts "
                f"{', '.join(profile.modes)}; "
                f"node {cond_link[0]} (VflashEncode) encodes a {mode} request"
            )
            continue
        if not any(_linked(e.get(k)) for k in ENCODE_DEFAULTS):
            canvas = _graph_canvas(prompt, e.get("te"), folders)
            width, height, length, seconds = (e.get(k, default) for k, default in ENCODE_DEFAULTS.items())
            try:
                if canvas is not None:
                    check_canvas_size(int(height), int(width), canvas)
                profile.check_duration(request_geometry(width, height, length, seconds).num_frames / FPS)
            except VflashError as exc:
                out.append(f"node {nid} (VflashSampler): {exc}")
    return out


#: ComfyUI core's nodes that apply a LoRA to a core MODEL (and CLIP): their LoRA never reaches a Vflash engine.
CORE_LORA_LOADERS = ("LoraLoader", "LoraLoaderModelOnly")


def core_lora_refusals(prompt: Mapping[str, Mapping[str, Any]] | None) -> list[str]:
    """One line per core LoRA loader whose output feeds a Vflash node: its LoRA would not apply to the Vflash engine,
    which compiles its LoRAs with the weights; the line names the node that does."""
    if prompt is None:
        return []
    feeding = {
        value[0]
        for node in prompt.values()
        if isinstance(node, Mapping) and str(node.get("class_type", "")).startswith("Vflash")
        for value in node.get("inputs", {}).values()
        if _linked(value)
    }
    return [
        f"node {nid} ({node['class_type']}) applies a LoRA to a core MODEL, which no Vflash node runs: chain the LoRA "
        "with MiniMax H3 Vflash LoRA Select into the Vflash Model Loader's lora input instead"
        for nid, node in prompt.items()
        if isinstance(node, Mapping) and node.get("class_type") in CORE_LORA_LOADERS and nid in feeding
    ]


def check_graph(prompt: Mapping[str, Mapping[str, Any]] | None, host: Host, folders: Folders) -> None:
    """Raise the graph's refusals (`core_lora_refusals`, `loader_refusals`, then `graph_refusals`); the Vflash nodes
    that do model work call it first, so whichever of them ComfyUI runs first refuses the graph before any Vflash
    model work."""
    refusals = core_lora_refusals(prompt) + loader_refusals(prompt, host, folders) + graph_refusals(prompt, folders)
    if refusals:
        raise VflashError(listing("this graph cannot run", refusals))
