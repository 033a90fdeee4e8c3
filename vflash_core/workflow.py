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

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import VflashError

logger = logging.getLogger(__name__)


class WorkflowError(VflashError):
    """A workflow file is malformed, uses unsupported nodes, or links incompatible types."""


@dataclass(frozen=True)
class NodeType:
    """What the executor needs to know about one class type.

    inputs: every accepted input name (dotted names for dynamic inputs) -> io type ("INT", "IMAGE", "VFLASH_MODEL",
    "*" for any, comma-separated for several); required: the names that must be given; outputs: output io types.
    run(**inputs) returns a tuple with one value per output.
    """

    class_type: str
    inputs: Mapping[str, str]
    required: frozenset[str]
    outputs: tuple[str, ...]
    run: Callable[..., tuple]
    output_node: bool = False


def types_compatible(output_type: str, input_type: str) -> bool:
    """ComfyUI's rule: "*" matches anything; otherwise one comma-separated type set must contain the other."""
    if output_type == "*" or input_type == "*":
        return True
    a, b = frozenset(output_type.split(",")), frozenset(input_type.split(","))
    return a <= b or b <= a


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
    except json.JSONDecodeError:
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
    """Check, then run the workflow's output nodes and their ancestors; `on_node(id, class_type)` before each."""
    order = plan(workflow, node_types)
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
