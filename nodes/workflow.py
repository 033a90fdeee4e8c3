"""Running ComfyUI API-format workflows without ComfyUI: the graph executor behind `vflash run-workflow`.

An API-format workflow (what ComfyUI's "Export (API)" writes and `POST /prompt` takes) is a dict
``{"<node id>": {"class_type": str, "inputs": {name: value | [source id, output index]}, "_meta": {...}}}``. This
module checks such a graph against a table of node types (`NodeType`: input and output types, whether it is an
output node, and a `run` callable), then runs the output nodes' ancestors in dependency order, once each, like
ComfyUI's executor: dotted input names become nested dicts (``"format.codec"`` of a dynamic combo, the
``"ref_images.ref_image_0"`` entries of an autogrow group), links are resolved to upstream outputs.

The graph logic is host-neutral; `node_types()` reads the table from V3 node classes' own schemas. `run_headless()`
and `headless_node_types()` load the real node classes over the headless host (`vflash_nodes.headless`): every
Vflash node plus the core nodes the example workflows use (`EmptyMiniMaxH3LatentAV`, `CreateVideo`, `SaveVideo`,
`LoadImage`, `LoadAudio`); any other class type is refused before anything runs, with the list of unsupported nodes.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from vflash_core.errors import Number, VflashError, is_int, listing

from .graph_checks import core_lora_refusals, graph_refusals
from .headless import comfy_io as io

logger = logging.getLogger(__name__)


class WorkflowError(VflashError):
    """A workflow file is malformed, uses unsupported nodes, or links incompatible types."""


@dataclass(frozen=True)
class NodeType:
    """What the executor needs to know about one class type.

    inputs: every accepted input name (dotted names for dynamic inputs) -> io type ("INT", "IMAGE", "VFLASH_MODEL",
    "*" for any, comma-separated for several); required: the names that must be given; outputs: output io types.
    run(**inputs) returns a tuple with one value per output. validate(**constant inputs), when given, is called for
    every node before anything runs (as ComfyUI validates a queued prompt): True, or the refusal as text. numbers:
    the INT and FLOAT inputs' widget ranges, checked as ComfyUI checks a queued prompt's values against min and max;
    choices: the options of the combos the node's own `validate_inputs` does not take (ComfyUI's rule), checked with
    `validate`.
    """

    class_type: str
    inputs: Mapping[str, str]
    required: frozenset[str]
    outputs: tuple[str, ...]
    run: Callable[..., tuple]
    output_node: bool = False
    validate: Callable[..., Any] | None = None
    numbers: Mapping[str, Number] = field(default_factory=dict)
    choices: Mapping[str, tuple] = field(default_factory=dict)


def types_compatible(output_type: str, input_type: str) -> bool:
    """ComfyUI's rule: "*" matches anything; otherwise one comma-separated type set must contain the other."""
    if output_type == "*" or input_type == "*":
        return True
    a, b = frozenset(output_type.split(",")), frozenset(input_type.split(","))
    return a <= b or b <= a


# Python types a BOOLEAN or STRING widget value may have, checked before anything runs (INT and FLOAT values are
# `NodeType.numbers`').
_WIDGET_TYPES = {"BOOLEAN": bool, "STRING": str}


def is_link(value: Any) -> bool:
    """A link of a checked workflow (`check_api_workflow` writes every link so): [source node id, output index]."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


# Node ids as ComfyUI writes them: ASCII digits, a subgraph's or group node's inner nodes "12:3" (":"-joined).
_NODE_ID = re.compile(r"[0-9]+(?::[0-9]+)*")


def _node_id(value: Any) -> str | None:
    """A node id in a form ComfyUI writes (an int, or a string of `_NODE_ID`), as the string it is keyed by; None
    for anything else (a unicode digit such as "²", a float, a bool)."""
    if is_int(value) and value >= 0:
        return str(value)
    return value if isinstance(value, str) and _NODE_ID.fullmatch(value) else None


def _link(value: list) -> list | None:
    """[source id, output index] with either written as a string or an int, as [str, int]; None if it is not one."""
    if len(value) != 2:
        return None
    source, index = _node_id(value[0]), value[1]
    if isinstance(index, str) and index.isascii() and index.isdigit():
        index = int(index)
    if source is None or not is_int(index) or index < 0:
        return None
    return [source, index]


# -- loading and editing -------------------------------------------------------------------------------------------


MAX_WORKFLOW_BYTES = 16 << 20  # an API workflow is a few kilobytes; this bounds what is read and parsed


def load_api_workflow(path: str | Path) -> dict[str, dict[str, Any]]:
    """An API-format workflow from a UTF-8 JSON file; a folder, FIFO, binary or malformed file is one line, a UI-format
    (graph) file is refused with the way to get the API form."""
    from vflash_core.fileio import read_text_file

    text = read_text_file(path, "workflow", MAX_WORKFLOW_BYTES, WorkflowError)
    try:
        data = json.loads(text)
    except RecursionError:
        raise WorkflowError(f"workflow {path} nests arrays or objects too deeply") from None
    except ValueError as exc:
        raise WorkflowError(f"workflow {path} is not JSON ({exc})") from None
    workflow = check_api_workflow(data, f"workflow {path}")
    for node_id, node in workflow.items():
        if not isinstance(node.get("_meta", {}), dict):
            raise WorkflowError(f"workflow {path}: node {node_id!r} has a '_meta' that is not an object")
    return workflow


def check_api_workflow(data: Any, what: str = "workflow") -> dict[str, dict[str, Any]]:
    """The workflow in one form: node ids as strings, every link as [source id (str), output index (int)], whichever
    of the forms ComfyUI writes it came in (int or numeric-string ids, `[id, index]` with either as a string). As in
    ComfyUI, a list input value is a link; anything else is refused naming the node. Returns a new dict (`data` is
    left as it is), so checking twice is harmless."""
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise WorkflowError(
            f"{what} is a UI-format (graph) workflow; run-workflow takes the API format "
            "(ComfyUI: Workflow > Export (API); Vflash ships them under workflows/api/)"
        )
    if (
        isinstance(data, dict) and "prompt" in data and isinstance(data["prompt"], dict)
        and "class_type" not in data["prompt"]
    ):
        data = data["prompt"]  # a saved `POST /prompt` body
    if not isinstance(data, dict) or not data:
        raise WorkflowError(f"{what}: an API workflow is a non-empty object of nodes")
    out: dict[str, dict[str, Any]] = {}
    for key, node in data.items():
        node_id = _node_id(key)
        if node_id is None:
            raise WorkflowError(
                f"{what}: node id {key!r} is not one ComfyUI writes "
                "(ASCII digits, e.g. \"12\", or \"12:3\" inside a subgraph)"
            )
        if node_id in out:
            raise WorkflowError(f"{what}: node {node_id} appears twice (as {key!r} too)")
        if (
            not isinstance(node, dict) or not isinstance(node.get("class_type"), str)
            or not isinstance(node.get("inputs", {}), dict)
        ):
            raise WorkflowError(f"{what}: node {key!r} needs a 'class_type' string and an 'inputs' object")
        inputs = {}
        for name, value in node.get("inputs", {}).items():
            if isinstance(value, list):
                link = _link(value)
                if link is None:
                    raise WorkflowError(f"{what}: node {node_id} ({node['class_type']}).{name}: a list is a link, "
                                        f"[source node id, output index], got {json.dumps(value)[:80]}")
                value = link
            inputs[name] = value
        out[node_id] = {**node, "inputs": inputs}
    return out


def apply_overrides(workflow: dict[str, dict[str, Any]], assignments: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Return a copy with `node.input=value` assignments applied (node by id, or by its `_meta.title`)."""
    out = json.loads(json.dumps(workflow))
    for assignment in assignments:
        target, sep, raw = assignment.partition("=")
        node_ref, dot, name = target.partition(".")
        if not sep or not dot or not node_ref or not name:
            raise WorkflowError(f"--set {assignment!r}: expected NODE.INPUT=VALUE (NODE is a node id or title)")
        matches = [
            nid for nid, node in out.items() if nid == node_ref or node.get("_meta", {}).get("title") == node_ref
        ]
        if len(matches) != 1:
            known = ", ".join(f"{nid} ({n['class_type']})" for nid, n in out.items())
            raise WorkflowError(
                f"--set {assignment!r}: {'no' if not matches else 'more than one'} node {node_ref!r}; nodes: {known}"
            )
        inputs = out[matches[0]].setdefault("inputs", {})
        if is_link(inputs.get(name)):
            raise WorkflowError(f"--set {assignment!r}: input {name!r} of node {matches[0]} is a link, not a value")
        try:  # a value is JSON if it parses (numbers, booleans, quoted strings)
            value = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or a number beyond Python's digit limit: the raw string
            value = raw
        if isinstance(value, (list, dict)):  # a list would be read as a link
            raise WorkflowError(f"--set {assignment!r}: a widget value is a number, a boolean or a string")
        inputs[name] = value
    return out


# -- checking and planning -----------------------------------------------------------------------------------------


def plan(workflow: Mapping[str, Mapping[str, Any]], node_types: Mapping[str, NodeType]) -> list[str]:
    """Check the whole graph, then return the node ids to run, in dependency order.

    Raises `WorkflowError` listing every problem: unsupported class types, unknown or missing inputs, links to
    missing nodes or outputs, type mismatches, numbers outside their widgets' ranges, cycles, no output node.
    """
    workflow = check_api_workflow(workflow)
    core_loras = core_lora_refusals(workflow)  # before "unsupported": the line names the node to use instead
    if core_loras:
        raise WorkflowError("; ".join(core_loras))
    unsupported = sorted(
        {f"{nid} ({n['class_type']})" for nid, n in workflow.items() if n["class_type"] not in node_types}
    )
    if unsupported:
        raise WorkflowError(
            f"unsupported nodes: {', '.join(unsupported)}; run this workflow in ComfyUI, which has them: "
            f"vflash run-workflow runs only {', '.join(sorted(node_types))}"
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
                if name in spec.numbers:
                    try:
                        spec.numbers[name].check(f"node {nid} ({spec.class_type}).{name}", value)
                    except VflashError as exc:
                        problems.append(str(exc))
                elif expected is not None and (
                    not isinstance(value, expected) or isinstance(value, bool) != (expected is bool)
                ):
                    problems.append(
                        f"node {nid} ({spec.class_type}).{name} takes {spec.inputs[name]}, "
                        f"got {json.dumps(value)[:80]}"
                    )
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
        raise WorkflowError(listing("invalid workflow", problems))
    outputs = [nid for nid, n in workflow.items() if node_types[n["class_type"]].output_node]
    if not outputs:
        raise WorkflowError("the workflow has no output node (e.g. SaveVideo), so nothing would run")
    return _dependency_order(workflow, sorted(outputs, key=_node_sort_key))


def _dependency_order(workflow: Mapping[str, Mapping[str, Any]], outputs: list[str]) -> list[str]:
    """The output nodes' ancestors, each after its sources, once each: a depth-first walk kept on an explicit stack
    (a chain of 10,000 nodes is as deep as a graph gets, far beyond Python's recursion limit)."""
    order: list[str] = []
    done: set[str] = set()
    for output in outputs:
        if output in done:
            continue
        path: list[str] = [output]  # the nodes being visited, each waiting for its sources
        on_path = {output}
        pending = [iter(_sources(workflow, output))]
        while pending:
            source = next(pending[-1], None)
            if source is None:
                pending.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                order.append(finished)
            elif source in on_path:
                cycle = [*path[path.index(source):], source]
                # one line, however long the cycle
                shown = cycle if len(cycle) <= 12 else [*cycle[:6], "...", *cycle[-5:]]
                raise WorkflowError(f"the workflow has a cycle of {len(cycle) - 1} node(s): {' -> '.join(shown)}")
            elif source not in done:
                path.append(source)
                on_path.add(source)
                pending.append(iter(_sources(workflow, source)))
    return order


def _sources(workflow: Mapping[str, Mapping[str, Any]], node_id: str) -> list[str]:
    return [value[0] for value in workflow[node_id].get("inputs", {}).values() if is_link(value)]


def _node_sort_key(node_id: str) -> tuple[int, ...]:
    return tuple(int(part) for part in node_id.split(":"))


def nest_inputs(values: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted names -> nested dicts, as ComfyUI passes dynamic inputs to `execute`.

    ``{"format": "mp4", "format.codec": "h264"}`` -> ``{"format": {"format": "mp4", "codec": "h264"}}``;
    ``{"ref_images.ref_image_0": img}`` -> ``{"ref_images": {"ref_image_0": img}}``.
    """
    out = {key: value for key, value in values.items() if "." not in key}
    for key in sorted((k for k in values if "." in k), key=lambda k: k.count(".")):
        parts = key.split(".")
        current = out
        for part in parts[:-1]:
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
    workflow = check_api_workflow(workflow)
    order = plan(workflow, node_types)
    refusals = []
    for nid in order:
        node = workflow[nid]
        spec = node_types[node["class_type"]]
        constants = {k: v for k, v in node.get("inputs", {}).items() if not is_link(v)}
        for name, value in constants.items():  # combo values, as ComfyUI checks them against the options it lists
            if name in spec.choices and value not in spec.choices[name]:
                shown = ", ".join(map(str, spec.choices[name][:12])) + (" ..." if len(spec.choices[name]) > 12 else "")
                refusals.append(
                    f"node {nid} ({node['class_type']}): {name} must be one of {shown or '(none listed)'}, "
                    f"got {json.dumps(value)[:80]}"
                )
        verdict = True if spec.validate is None else spec.validate(**constants)
        if verdict is not True:
            refusals.append(f"node {nid} ({node['class_type']}): {verdict}")
    if refusals:
        raise WorkflowError(listing("the workflow was refused before running", refusals))
    report = RunReport()
    for nid in order:
        node = workflow[nid]
        spec = node_types[node["class_type"]]
        values = {
            name: report.outputs[value[0]][value[1]] if is_link(value) else value
            for name, value in node.get("inputs", {}).items()
        }
        if on_node is not None:
            on_node(nid, spec.class_type)
        start = time.perf_counter()
        result = spec.run(**nest_inputs(values))
        if not isinstance(result, tuple) or len(result) != len(spec.outputs):
            raise TypeError(
                f"{spec.class_type}.run returned {type(result).__name__} of length "
                f"{len(result) if isinstance(result, tuple) else '?'}, expected {len(spec.outputs)} outputs"
            )
        report.outputs[nid] = result
        report.seconds[nid] = time.perf_counter() - start
    return report


# -- node types from V3 node classes, and the headless run --------------------------------------------------------


def node_types(
    classes: Mapping[str, type[io.ComfyNode]], prompt: Mapping[str, Any] | None = None
) -> dict[str, NodeType]:
    """The `NodeType`s of V3 node classes, read from their schemas: inputs (an autogrow group as its slots
    ``group.slot``, a dynamic combo as its own key plus its options' inputs, dotted), required inputs, outputs,
    output node, INT and FLOAT widget ranges; `run` calls `execute` with `prompt` as the hidden prompt; `validate` is
    `validate_inputs` when the class overrides it (as ComfyUI calls it), after the prompt check the Vflash nodes make
    when they run."""
    out = {}
    for node_id, cls in classes.items():
        schema = cls.GET_SCHEMA()
        widgets: dict[str, io.Input] = {}
        required: set[str] = set()
        for inp in schema.inputs:
            if isinstance(inp, io.Autogrow.Input):
                slots = inp.template.get_all()
                widgets.update({f"{inp.id}.{slot.id}": slot for slot in slots})
                required.update(f"{inp.id}.{slot.id}" for slot in slots[: 0 if inp.optional else inp.template.min])
                continue
            widgets.update(
                _dynamic_combo_inputs(inp, inp.id) if isinstance(inp, io.DynamicCombo.Input) else {inp.id: inp}
            )
            if not inp.optional:
                required.add(inp.id)
        inputs = {
            key: "COMBO" if isinstance(inp, io.DynamicCombo.Input) else inp.get_io_type()
            for key, inp in widgets.items()
        }
        # the frontend's upload button: some exports carry its value
        if any(getattr(inp, "upload", None) is not None for inp in schema.inputs):
            inputs["upload"] = "COMBO"
        numbers = {key: Number(_NUMBER_KINDS[inputs[key]], getattr(inp, "min", None), getattr(inp, "max", None))
                   for key, inp in widgets.items() if inputs[key] in _NUMBER_KINDS}
        overridden = inspect.getattr_static(cls, "validate_inputs") is not vars(io.ComfyNode)["validate_inputs"]
        own = cls.validate_inputs if overridden else None
        validated = set(inspect.signature(own).parameters) if own is not None else set()
        choices = {key: tuple(options) for key, inp in widgets.items() if key.split(".")[0] not in validated
                   and (options := _options(inp)) is not None}
        out[node_id] = NodeType(node_id, inputs, frozenset(required), tuple(o.get_io_type() for o in schema.outputs),
                                _runner(cls, schema, prompt), schema.is_output_node, _validator(own), numbers, choices)
    return out


_NUMBER_KINDS = {"INT": int, "FLOAT": float}


def _options(inp: io.Input) -> list | None:
    """The values a combo takes (a dynamic combo: its options' keys); None for any other input, or a combo whose
    options are not a list."""
    if isinstance(inp, io.DynamicCombo.Input):
        return [option.key for option in inp.options]
    options = getattr(inp, "options", None) if isinstance(inp, io.Combo.Input) else None
    return options if isinstance(options, list) else None


def _dynamic_combo_inputs(combo: io.DynamicCombo.Input, key: str) -> dict[str, io.Input]:
    """A dynamic combo's API keys and their inputs: its own ("format") and its options' inputs, nested ones dotted
    further ("format.codec", "format.codec.encoding", ...)."""
    out: dict[str, io.Input] = {key: combo}
    for option in combo.options:
        for child in option.inputs:
            is_combo = isinstance(child, io.DynamicCombo.Input)
            out.update(_dynamic_combo_inputs(child, f"{key}.{child.id}") if is_combo else {f"{key}.{child.id}": child})
    return out


def _runner(cls: type[io.ComfyNode], schema: io.Schema, prompt: Mapping[str, Any] | None) -> Callable[..., tuple]:
    autogrow = [i.id for i in schema.inputs if isinstance(i, io.Autogrow.Input)]
    # A subclass holding the hidden inputs, as ComfyUI gives each run its own.
    node = cast("type[io.ComfyNode]", type(cls.__name__, (cls,), {"hidden": io.HiddenHolder(prompt=prompt)}))

    def run(**inputs: Any) -> tuple:
        inputs.pop("upload", None)
        for group in autogrow:  # ComfyUI passes an empty dict for an autogrow group with no connected inputs
            inputs.setdefault(group, {})
        return tuple(node.execute(**inputs).args)

    return run


def _validator(own: Callable[..., Any] | None) -> Callable[..., Any]:
    """Constant inputs checked before anything runs: a prompt as the Vflash nodes check it when they run, then the
    node's own `validate_inputs` with the inputs its signature names (numbers are checked against their widgets'
    ranges by `plan`)."""
    from vflash_core.pipeline.validation import check_prompt

    accepted = inspect.signature(own).parameters if own is not None else {}

    def validate(**constants: Any) -> bool | str:
        try:
            if "prompt" in constants:
                check_prompt(constants["prompt"])
        except VflashError as exc:
            return str(exc)
        nested = nest_inputs(constants)  # as `execute` gets them: a dynamic combo's values as one dict
        return own(**{k: v for k, v in nested.items() if k in accepted}) if own is not None else True

    return validate


@contextlib.contextmanager
def headless_node_types(
    output_dir: str | Path = "output",
    input_dir: str | Path = "input",
    models_dir: str | Path | None = None,
    prompt: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, NodeType]]:
    """The node table of `vflash run-workflow`, valid inside the block: every Vflash node and the core stand-ins, the
    real V3 classes over the headless host (`vflash_nodes.headless`)."""
    from .headless import installed

    with installed(output_dir, input_dir, models_dir) as loaded:
        yield node_types({**loaded.core, **loaded.nodes}, prompt)


class _TqdmProgress:
    """The progress hook headless: one tqdm bar per progress run, closed when it completes."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, value: int, total: int, preview: Any = None, node_id: str | None = None) -> None:
        from tqdm.auto import tqdm

        if self.bar is None or value < self.bar.n:
            self.bar = tqdm(total=total, leave=False)
        self.bar.total, self.bar.n = total, value
        self.bar.refresh()
        if value >= total:
            self.bar.close()
            self.bar = None


def run_headless(
    workflow: Mapping[str, Mapping[str, Any]],
    output_dir: str | Path = "output",
    input_dir: str | Path = "input",
    models_dir: str | Path | None = None,
) -> list[Path]:
    """Run an API workflow without ComfyUI; returns the files its SaveVideo nodes wrote. Engines are closed after."""
    output_dir = Path(output_dir)
    workflow = check_api_workflow(workflow)  # the nodes read it as their hidden prompt: links in one form
    with headless_node_types(output_dir, input_dir, models_dir, workflow) as types:
        plan(workflow, types)
        folders = importlib.import_module(f"{__package__}.host").FOLDERS  # the install's, like comfy.utils below
        # profile vs the graph's requests, as the Vflash nodes check in ComfyUI
        refusals = graph_refusals(workflow, folders)
        if refusals:
            raise WorkflowError(listing("the workflow was refused before running", refusals))
        importlib.import_module("comfy.utils").set_progress_bar_global_hook(_TqdmProgress())
        before = set(output_dir.rglob("*.mp4")) if output_dir.is_dir() else set()
        execute(workflow, types, on_node=lambda nid, class_type: logger.info("node %s %s", nid, class_type))
    return sorted(set(output_dir.rglob("*.mp4")) - before)
