"""Running ComfyUI API-format workflows without ComfyUI: the graph executor behind `vflash run-workflow`.

An API-format workflow (what ComfyUI's "Export (API)" writes and `POST /prompt` takes) is a dict
``{"<node id>": {"class_type": str, "inputs": {name: value | [source id, output index]}, "_meta": {...}}}``. This
module checks such a graph against a table of node types (`NodeType`: input and output types, whether it is an
output node, and a `run` callable), then runs the output nodes' ancestors in dependency order, once each, like
ComfyUI's executor: dotted input names become nested dicts (``"format.codec"`` of a dynamic combo, the
``"ref_images.ref_image_0"`` entries of an autogrow group), links are resolved to upstream outputs.

The graph logic is host-neutral. `headless_node_types()` gives the table `run-workflow` uses: every Vflash node
(the same `node_ops` the ComfyUI nodes call) plus stand-ins for the few core nodes the example workflows use
(`EmptyMiniMaxH3LatentAV`, `CreateVideo`, `SaveVideo`, `LoadImage`, `LoadAudio`); any other class type is refused
before anything runs, with the list of unsupported nodes.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vflash_core.errors import VflashError

logger = logging.getLogger(__name__)


class WorkflowError(VflashError):
    """A workflow file is malformed, uses unsupported nodes, or links incompatible types."""


@dataclass(frozen=True)
class NodeType:
    """What the executor needs to know about one class type.

    inputs: every accepted input name (dotted names for dynamic inputs) -> io type ("INT", "IMAGE", "VFLASH_MODEL",
    "*" for any, comma-separated for several); required: the names that must be given; outputs: output io types.
    run(**inputs) returns a tuple with one value per output. validate(**constant inputs), when given, is ComfyUI's
    `validate_inputs`: called for every node before anything runs, with the constant inputs its signature names;
    True, or the refusal as text.
    """

    class_type: str
    inputs: Mapping[str, str]
    required: frozenset[str]
    outputs: tuple[str, ...]
    run: Callable[..., tuple]
    output_node: bool = False
    validate: Callable[..., Any] | None = None


def types_compatible(output_type: str, input_type: str) -> bool:
    """ComfyUI's rule: "*" matches anything; otherwise one comma-separated type set must contain the other."""
    if output_type == "*" or input_type == "*":
        return True
    a, b = frozenset(output_type.split(",")), frozenset(input_type.split(","))
    return a <= b or b <= a


# Python types a widget value of each io type may have, checked before anything runs (an INT is never a bool).
_WIDGET_TYPES = {"INT": (int,), "FLOAT": (int, float), "BOOLEAN": (bool,), "STRING": (str,)}


def is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


# -- loading and editing -------------------------------------------------------------------------------------------


def load_api_workflow(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read an API-format workflow; a UI-format (graph) file is refused with the way to get the API form."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkflowError(f"{path}: no such workflow file") from None
    except json.JSONDecodeError as exc:
        raise WorkflowError(f"{path}: not JSON ({exc})") from None
    return check_api_workflow(data, str(path))


def check_api_workflow(data: Any, what: str = "workflow") -> dict[str, dict[str, Any]]:
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise WorkflowError(
            f"{what} is a UI-format (graph) workflow; run-workflow takes the API format "
            "(ComfyUI: Workflow > Export (API); Vflash ships them under workflows/api/)"
        )
    if isinstance(data, dict) and "prompt" in data and isinstance(data["prompt"], dict) and "class_type" not in data["prompt"]:
        data = data["prompt"]  # a saved `POST /prompt` body
    if not isinstance(data, dict) or not data:
        raise WorkflowError(f"{what}: an API workflow is a non-empty object of nodes")
    for node_id, node in data.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str) or not isinstance(node.get("inputs", {}), dict):
            raise WorkflowError(f"{what}: node {node_id!r} needs a 'class_type' string and an 'inputs' object")
    return data


def parse_value(text: str) -> Any:
    """A `--set` value: JSON if it parses (numbers, booleans, quoted strings, lists), else the raw string."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or a number beyond Python's digit limit: the raw string
        return text


def apply_overrides(workflow: dict[str, dict[str, Any]], assignments: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Return a copy with `node.input=value` assignments applied (node by id, or by its `_meta.title`)."""
    out = json.loads(json.dumps(workflow))
    for assignment in assignments:
        target, sep, raw = assignment.partition("=")
        node_ref, dot, name = target.partition(".")
        if not sep or not dot or not node_ref or not name:
            raise WorkflowError(f"--set {assignment!r}: expected NODE.INPUT=VALUE (NODE is a node id or title)")
        matches = [nid for nid, node in out.items() if nid == node_ref or node.get("_meta", {}).get("title") == node_ref]
        if len(matches) != 1:
            known = ", ".join(f"{nid} ({n['class_type']})" for nid, n in out.items())
            raise WorkflowError(f"--set {assignment!r}: {'no' if not matches else 'more than one'} node {node_ref!r}; nodes: {known}")
        inputs = out[matches[0]].setdefault("inputs", {})
        if is_link(inputs.get(name)):
            raise WorkflowError(f"--set {assignment!r}: input {name!r} of node {matches[0]} is a link, not a value")
        inputs[name] = parse_value(raw)
    return out


# -- checking and planning -----------------------------------------------------------------------------------------


def plan(workflow: Mapping[str, Mapping[str, Any]], node_types: Mapping[str, NodeType]) -> list[str]:
    """Check the whole graph, then return the node ids to run, in dependency order.

    Raises `WorkflowError` listing every problem: unsupported class types, unknown or missing inputs, links to
    missing nodes or outputs, type mismatches, cycles, no output node.
    """
    unsupported = sorted({f"{nid} ({n['class_type']})" for nid, n in workflow.items() if n["class_type"] not in node_types})
    if unsupported:
        raise WorkflowError(
            f"unsupported nodes: {', '.join(unsupported)}; this runner executes {', '.join(sorted(node_types))}"
        )
    problems: list[str] = []
    for nid, node in workflow.items():
        spec = node_types[node["class_type"]]
        inputs = node.get("inputs", {})
        for name, value in inputs.items():
            if name not in spec.inputs:
                problems.append(f"node {nid} ({spec.class_type}): unknown input {name!r}")
                continue
            if not is_link(value):
                expected = _WIDGET_TYPES.get(spec.inputs[name])
                if expected is not None and (not isinstance(value, expected) or isinstance(value, bool) != (bool in expected)):
                    problems.append(f"node {nid} ({spec.class_type}).{name} takes {spec.inputs[name]}, got {json.dumps(value)}")
                continue
            src_id, index = value
            if src_id not in workflow:
                problems.append(f"node {nid} ({spec.class_type}).{name}: links to missing node {src_id}")
                continue
            src = node_types[workflow[src_id]["class_type"]]
            if not 0 <= index < len(src.outputs):
                problems.append(f"node {nid}.{name}: node {src_id} ({src.class_type}) has no output {index}")
            elif not types_compatible(src.outputs[index], spec.inputs[name]):
                problems.append(
                    f"node {nid} ({spec.class_type}).{name} takes {spec.inputs[name]}, "
                    f"but node {src_id} ({src.class_type}) output {index} is {src.outputs[index]}"
                )
        for name in sorted(spec.required - set(inputs)):
            problems.append(f"node {nid} ({spec.class_type}): missing required input {name!r}")
    if problems:
        raise WorkflowError("invalid workflow:\n  " + "\n  ".join(problems))
    outputs = [nid for nid, n in workflow.items() if node_types[n["class_type"]].output_node]
    if not outputs:
        raise WorkflowError("the workflow has no output node (e.g. SaveVideo), so nothing would run")
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(nid: str, path: tuple[str, ...]) -> None:
        if state.get(nid) == 2:
            return
        if state.get(nid) == 1:
            raise WorkflowError(f"the workflow has a cycle: {' -> '.join((*path, nid))}")
        state[nid] = 1
        for value in workflow[nid].get("inputs", {}).values():
            if is_link(value):
                visit(value[0], (*path, nid))
        state[nid] = 2
        order.append(nid)

    for nid in sorted(outputs, key=_node_sort_key):
        visit(nid, ())
    return order


def _node_sort_key(node_id: str) -> tuple[int, str]:
    return (int(node_id), "") if node_id.isdigit() else (1 << 62, node_id)


def nest_inputs(values: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted names -> nested dicts, as ComfyUI passes dynamic inputs to `execute`.

    ``{"format": "mp4", "format.codec": "h264"}`` -> ``{"format": {"format": "mp4", "codec": "h264"}}``;
    ``{"ref_images.ref_image_0": img}`` -> ``{"ref_images": {"ref_image_0": img}}``.
    """
    out: dict[str, Any] = {}
    dotted = sorted((k for k in values if "." in k), key=lambda k: k.count("."))
    for key, value in values.items():
        if "." not in key:
            out[key] = value
    for key in dotted:
        parts = key.split(".")
        current = out
        for depth, part in enumerate(parts[:-1]):
            existing = current.get(part)
            if not isinstance(existing, dict):
                current[part] = {} if existing is None else {part: existing}
            current = current[part]
        current[parts[-1]] = values[key]
    return out


@dataclass
class RunReport:
    """What one execution produced: every node's outputs, and per-node wall seconds."""

    outputs: dict[str, tuple] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def execute(
    workflow: Mapping[str, Mapping[str, Any]],
    node_types: Mapping[str, NodeType],
    on_node: Callable[[str, str], None] | None = None,
) -> RunReport:
    """Check, then run the workflow's output nodes and their ancestors; `on_node(id, class_type)` before each.
    Every node's `validate` runs first (as ComfyUI validates a prompt when it is queued): a refusal stops the run
    before any node executes."""
    order = plan(workflow, node_types)
    refusals = []
    for nid in order:
        node = workflow[nid]
        check = node_types[node["class_type"]].validate
        if check is None:
            continue
        accepted = inspect.signature(check).parameters
        constants = {k: v for k, v in node.get("inputs", {}).items() if not is_link(v) and k in accepted}
        verdict = check(**constants)
        if verdict is not True:
            refusals.append(f"node {nid} ({node['class_type']}): {verdict}")
    if refusals:
        raise WorkflowError("the workflow was refused before running: " + "; ".join(refusals))
    report = RunReport()
    for nid in order:
        node = workflow[nid]
        spec = node_types[node["class_type"]]
        values = {}
        for name, value in node.get("inputs", {}).items():
            values[name] = report.outputs[value[0]][value[1]] if is_link(value) else value
        if on_node is not None:
            on_node(nid, spec.class_type)
        start = time.perf_counter()
        result = spec.run(**nest_inputs(values))
        if not isinstance(result, tuple) or len(result) != len(spec.outputs):
            raise TypeError(f"{spec.class_type}.run returned {type(result).__name__} of length {len(result) if isinstance(result, tuple) else '?'}, expected {len(spec.outputs)} outputs")
        report.outputs[nid] = result
        report.seconds[nid] = time.perf_counter() - start
    return report


# -- headless: the host, the node table, the run -------------------------------------------------------------------


class NestedPair:
    """The headless stand-in of ComfyUI's `NestedTensor` for H3 AV latents: `.tensors` (video, audio), `.is_nested`."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    @property
    def shape(self):
        return self.tensors[0].shape


@dataclass
class HeadlessVideo:
    """VIDEO headless: frames (F, H, W, 3) in [0, 1], AUDIO dict or None, frames per second."""

    images: Any
    audio: dict | None
    fps: float

    def get_dimensions(self) -> tuple[int, int]:
        return int(self.images.shape[2]), int(self.images.shape[1])


class _Bar:
    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, leave=False)

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None and total != self.bar.total:
            self.bar.total = total
        self.bar.n = done
        self.bar.refresh()
        if done >= self.bar.total:
            self.bar.close()


class HeadlessHost:
    """`node_ops.Host` without ComfyUI: tqdm bars, Ctrl-C as the interrupt, the first CUDA device if any."""

    nested = NestedPair

    def progress(self, total: int) -> _Bar:
        return _Bar(total)

    def check_interrupt(self) -> None:
        """Nothing to poll: Ctrl-C raises KeyboardInterrupt, which the session treats as an abort."""

    def free_memory(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def default_device(self) -> str:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"

    def make_video(self, images, audio, fps: float) -> HeadlessVideo:
        return HeadlessVideo(images, audio, fps)

    def log(self, line: str) -> None:
        logger.info(line)


class HeadlessFolders:
    """`node_ops.Folders` over a ComfyUI-style models folder (or none)."""

    _KEYS = {"vflash": ("vflash",), "diffusers": ("diffusers",), "diffusion_models": ("diffusion_models", "unet"), "loras": ("loras",)}

    def __init__(self, models_dir: str | Path | None):
        self.root = None if models_dir is None else Path(models_dir)

    def folders(self, key: str) -> list[str]:
        if self.root is None or key not in self._KEYS:
            return []
        return [str(self.root / sub) for sub in self._KEYS[key]]

    def filenames(self, key: str) -> list[str]:
        out = set()
        for base in map(Path, self.folders(key)):
            if base.is_dir():
                out.update(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
        return sorted(out)

    def full_path(self, key: str, name: str) -> str | None:
        for base in map(Path, self.folders(key)):
            candidate = base / name
            if candidate.exists() and base.resolve() in candidate.resolve().parents:
                return str(candidate)
        return None


def _save_path(output_dir: Path, prefix: str) -> Path:
    """ComfyUI's naming: `<output>/<prefix>_00001_.mp4`, counting up, never leaving the output folder."""
    target = (output_dir / prefix).resolve()
    if output_dir.resolve() not in target.parents:
        raise WorkflowError(f"filename_prefix {prefix!r} points outside the output folder {output_dir}")
    target.parent.mkdir(parents=True, exist_ok=True)
    counter = 1
    for existing in target.parent.glob(f"{target.name}_*_.mp4"):
        digits = existing.name[len(target.name) + 1 :].split("_")[0]
        if digits.isdigit():
            counter = max(counter, int(digits) + 1)
    return target.parent / f"{target.name}_{counter:05}_.mp4"


def _core_node_types(host: HeadlessHost, output_dir: Path, input_dir: Path) -> dict[str, NodeType]:
    """Stand-ins for the core nodes the example workflows use, with core's input names and outputs."""
    from . import comfy_latent as cl

    def empty_latent(width: int, height: int, length: int) -> tuple:
        latents = cl.empty_latents(cl.core_length_geometry(width, height, length))
        return (cl.to_comfy_latent(latents.video, latents.audio, host.nested),)

    def create_video(images, fps: float, audio=None, bit_depth: int = 8) -> tuple:
        if bit_depth != 8:
            raise WorkflowError(f"CreateVideo: the headless runner writes 8-bit video, got bit_depth {bit_depth}")
        return (HeadlessVideo(images, audio, float(fps)),)

    def save_video(video, filename_prefix: str, format: Any = "auto", codec: Any = None) -> tuple:
        from vflash_core.media import write_mp4

        container = format.get("format", "auto") if isinstance(format, dict) else format
        chosen = (format.get("codec") if isinstance(format, dict) else None) or codec or "auto"
        name = chosen.get("codec", "auto") if isinstance(chosen, dict) else chosen
        encoding = chosen.get("encoding", "auto") if isinstance(chosen, dict) else "auto"
        encoding = encoding.get("encoding", "auto") if isinstance(encoding, dict) else encoding
        if container not in ("auto", "mp4") or name not in ("auto", "h264") or encoding != "auto":
            raise WorkflowError(f"SaveVideo: the headless runner writes mp4/h264 with its own encoding (got format {container!r}, codec {name!r}, encoding {encoding!r})")
        if not isinstance(video, HeadlessVideo):
            raise WorkflowError(f"SaveVideo: expected a VIDEO, got {type(video).__name__}")
        if video.audio is None:
            raise WorkflowError("SaveVideo: the headless runner writes video with its soundtrack; the VIDEO has no audio")
        if float(video.fps) != int(video.fps):
            raise WorkflowError(f"SaveVideo: the headless runner writes whole frame rates, got {video.fps}")
        path = _save_path(output_dir, filename_prefix)
        waveform = video.audio["waveform"][0]
        write_mp4(path, video.images, waveform, int(video.audio["sample_rate"]), int(video.fps))
        return (video,)

    def check_save(filename_prefix: Any = None, format: Any = "auto") -> bool | str:
        """Before anything runs: a prefix inside the output folder and a container this runner writes (None: linked)."""
        if filename_prefix is None:
            return True
        if not isinstance(filename_prefix, str) or not filename_prefix.strip():
            return f"filename_prefix must be a non-empty string, got {json.dumps(filename_prefix)}"
        if output_dir.resolve() not in (output_dir / filename_prefix).resolve().parents:
            return f"filename_prefix {filename_prefix!r} points outside the output folder {output_dir}"
        if isinstance(format, str) and format not in ("auto", "mp4"):
            return f"the headless runner writes mp4, got format {format!r}"
        return True

    def check_input(name: Any = None) -> bool | str:
        if name is None:  # linked: checked when it runs
            return True
        if not isinstance(name, str) or not (input_dir / name).is_file():
            return f"{input_dir / str(name)} does not exist (set --input-dir)"
        return True

    def load_image(image: str, upload: str | None = None) -> tuple:
        import numpy as np
        import torch
        from PIL import Image, ImageOps

        path = input_dir / image
        if not path.is_file():
            raise WorkflowError(f"LoadImage: {path} does not exist (set --input-dir)")
        with Image.open(path) as img:
            rgb = np.asarray(ImageOps.exif_transpose(img).convert("RGB"), dtype=np.float32) / 255.0
        tensor = torch.from_numpy(rgb)[None]
        return tensor, torch.zeros(tensor.shape[:3])

    def load_audio(audio: str, upload: str | None = None) -> tuple:
        import av
        import numpy as np
        import torch

        path = input_dir / audio
        if not path.is_file():
            raise WorkflowError(f"LoadAudio: {path} does not exist (set --input-dir)")
        with av.open(str(path)) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout="stereo" if stream.channels > 1 else "mono", rate=stream.rate)
            chunks = [f.to_ndarray() for frame in container.decode(stream) for f in resampler.resample(frame)]
            rate = stream.rate
        return ({"waveform": torch.from_numpy(np.concatenate(chunks, axis=1).astype(np.float32))[None], "sample_rate": int(rate)},)

    return {
        "EmptyMiniMaxH3LatentAV": NodeType("EmptyMiniMaxH3LatentAV", {"width": "INT", "height": "INT", "length": "INT"}, frozenset({"width", "height", "length"}), ("LATENT",), empty_latent),
        "CreateVideo": NodeType("CreateVideo", {"images": "IMAGE", "fps": "FLOAT", "audio": "AUDIO", "bit_depth": "INT"}, frozenset({"images", "fps"}), ("VIDEO",), create_video),
        "SaveVideo": NodeType("SaveVideo", {"video": "VIDEO", "filename_prefix": "STRING", "format": "COMBO", "format.codec": "COMBO", "format.codec.encoding": "COMBO", "codec": "COMBO"}, frozenset({"video", "filename_prefix", "format"}), ("VIDEO",), save_video, output_node=True, validate=check_save),
        "LoadImage": NodeType("LoadImage", {"image": "COMBO", "upload": "COMBO"}, frozenset({"image"}), ("IMAGE", "MASK"), load_image, validate=lambda image=None: check_input(image)),
        "LoadAudio": NodeType("LoadAudio", {"audio": "COMBO", "upload": "COMBO"}, frozenset({"audio"}), ("AUDIO",), load_audio, validate=lambda audio=None: check_input(audio)),
    }


# Input and output types of the Vflash nodes; `tests/test_nodes.py` checks them against the nodes' V3 schemas.
_GEOMETRY = {"width": "INT", "height": "INT", "length": "INT", "seconds": "FLOAT"}
_REFS = {
    **{f"ref_images.ref_image_{i}": "IMAGE" for i in range(9)},
    **{f"ref_videos.ref_video_{i}": "IMAGE" for i in range(3)},
    **{f"ref_video_audios.ref_video_audio_{i}": "AUDIO" for i in range(3)},
    **{f"ref_audios.ref_audio_{i}": "AUDIO" for i in range(3)},
}
# Sockets that take a Vflash handle or core's own object (ComfyUI's comma-joined multi-type form).
_TE = "VFLASH_TE,CLIP"
_VAE = "VFLASH_VAE,VAE"

VFLASH_SIGNATURES: dict[str, tuple[dict[str, str], frozenset[str], tuple[str, ...], bool]] = {
    # class_type: (inputs, optional inputs, outputs, output node)
    "VflashModelLoader": (
        {"model": "COMBO", "profile": "COMBO", "weight_residency": "COMBO", "device": "COMBO", "peer_device": "COMBO", "strategy": "COMBO", "attention_backend": "COMBO", "lora": "VFLASH_LORA"},
        frozenset({"lora"}), ("VFLASH_MODEL",), False,
    ),
    "VflashLoraSelect": ({"lora": "COMBO", "strength": "FLOAT", "prev": "VFLASH_LORA"}, frozenset({"prev"}), ("VFLASH_LORA",), False),
    "VflashTextEncoderLoader": ({"encoder": "COMBO", "device": "COMBO"}, frozenset(), ("VFLASH_TE",), False),
    "VflashVAELoader": ({"vae": "COMBO", "device": "COMBO"}, frozenset(), ("VFLASH_VAE",), False),
    "VflashEncode": (
        {"te": _TE, "vae": _VAE, "audio_vae": "VAE", "prompt": "STRING", **_GEOMETRY, "first_frame": "IMAGE", "last_frame": "IMAGE", **_REFS, "force_offload": "BOOLEAN"},
        frozenset({"audio_vae", "first_frame", "last_frame", *_REFS}), ("VFLASH_COND", "LATENT", "INT"), False,
    ),
    "VflashSampler": (
        {"model": "VFLASH_MODEL", "cond": "VFLASH_COND", "latent": "LATENT", "seed": "INT", "force_offload": "BOOLEAN", "profile_denoise": "BOOLEAN"},
        frozenset(), ("LATENT",), False,
    ),
    "VflashDecode": ({"vae": _VAE, "audio_vae": "VAE", "latent": "LATENT"}, frozenset({"audio_vae"}), ("IMAGE", "AUDIO", "VIDEO"), False),
    "VflashGenerate": (
        {"model": "VFLASH_MODEL", "te": _TE, "vae": _VAE, "audio_vae": "VAE", "prompt": "STRING", **_GEOMETRY, "seed": "INT", "first_frame": "IMAGE", "last_frame": "IMAGE", "force_offload": "BOOLEAN"},
        frozenset({"audio_vae", "first_frame", "last_frame"}), ("VIDEO", "IMAGE", "AUDIO"), False,
    ),
    "VflashUnload": ({"anything": "*", "what": "COMBO"}, frozenset(), ("*",), True),
}


def _vflash_node_types(registry, host, folders) -> dict[str, NodeType]:
    from . import ops

    runs: dict[str, Callable[..., tuple]] = {
        "VflashModelLoader": lambda **kw: (ops.load_model(registry, host, folders, **kw),),
        "VflashLoraSelect": lambda **kw: (ops.select_lora(folders, **kw),),
        "VflashTextEncoderLoader": lambda encoder, device: (ops.load_component(registry, host, folders, "te", encoder, device),),
        "VflashVAELoader": lambda vae, device: (ops.load_component(registry, host, folders, "vae", vae, device),),
        "VflashEncode": lambda **kw: ops.encode(registry, host, **kw),
        "VflashSampler": lambda **kw: (ops.sample(registry, host, **kw),),
        "VflashDecode": lambda **kw: ops.decode(registry, host, **kw),
        "VflashGenerate": lambda **kw: ops.generate(registry, host, **kw),
        "VflashUnload": lambda **kw: (ops.unload(registry, host, **kw),),
    }

    def loader(model, profile, weight_residency, device, peer_device, strategy, attention_backend):
        return ops.validate_loader(host, folders, model=model, profile=profile, weight_residency=weight_residency, device=device,
                                   peer_device=peer_device, strategy=strategy, attention_backend=attention_backend)

    def device_only(device):
        return ops.validate_device(host, device)

    def prompt_only(prompt=None):
        from vflash_core.validation import check_prompt

        if prompt is None:  # linked: checked when it runs
            return True
        try:
            check_prompt(prompt)
        except VflashError as exc:
            return str(exc)
        return True

    def seed_only(seed=None):
        from vflash_core.validation import check_seed

        if not isinstance(seed, int):  # linked, or of another type, which the type check reports
            return True
        try:
            check_seed(seed)
        except VflashError as exc:
            return str(exc)
        return True

    def prompt_and_seed(prompt=None, seed=None):
        verdict = prompt_only(prompt)
        return seed_only(seed) if verdict is True else verdict

    validations = {"VflashModelLoader": loader, "VflashTextEncoderLoader": device_only, "VflashVAELoader": device_only,
                   "VflashEncode": prompt_only, "VflashSampler": seed_only, "VflashGenerate": prompt_and_seed}
    return {
        name: NodeType(name, inputs, frozenset(inputs) - optional, outputs, runs[name], output_node, validations.get(name))
        for name, (inputs, optional, outputs, output_node) in VFLASH_SIGNATURES.items()
    }


def headless_node_types(registry=None, host: HeadlessHost | None = None, folders: HeadlessFolders | None = None,
                        output_dir: str | Path = "output", input_dir: str | Path = "input") -> dict[str, NodeType]:
    """The node table of `vflash run-workflow`: every Vflash node plus the core stand-ins."""
    from .ops import EngineRegistry

    registry = registry if registry is not None else EngineRegistry()
    host = host or HeadlessHost()
    folders = folders or HeadlessFolders(None)
    return {**_core_node_types(host, Path(output_dir), Path(input_dir)), **_vflash_node_types(registry, host, folders)}


def run_headless(workflow: Mapping[str, Mapping[str, Any]], output_dir: str | Path = "output", input_dir: str | Path = "input",
                 models_dir: str | Path | None = None) -> list[Path]:
    """Run an API workflow without ComfyUI; returns the files its SaveVideo nodes wrote. Engines are closed after."""
    from . import ops
    from .ops import EngineRegistry

    output_dir = Path(output_dir)
    registry = EngineRegistry()
    folders = HeadlessFolders(models_dir)
    types = headless_node_types(registry, HeadlessHost(), folders, output_dir, input_dir)
    plan(workflow, types)
    refusals = ops.graph_refusals(workflow, folders)  # profile vs the graph's requests, as the Vflash nodes check in ComfyUI
    if refusals:
        raise WorkflowError("the workflow was refused before running: " + "; ".join(refusals))
    before = set(output_dir.rglob("*.mp4")) if output_dir.is_dir() else set()
    try:
        execute(workflow, types, on_node=lambda nid, class_type: logger.info("node %s %s", nid, class_type))
    finally:
        registry.close()
    return sorted(set(output_dir.rglob("*.mp4")) - before)
