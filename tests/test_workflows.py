"""The example workflows: every file parses, uses only known node ids, type-checks its links against the node
schemas, and the UI (graph) and API versions of each workflow describe the same graph; `vflash run-workflow` runs
them headless (t2va unmodified, as a user would), and ref2va runs on a small ref2va family."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comfy_standins import harness
from vflash_core.workflow import (
    WorkflowError, apply_overrides, check_api_workflow, headless_node_types, load_api_workflow, nest_inputs, plan, run_headless, types_compatible,
)

REPO = Path(__file__).resolve().parent.parent
UI_DIR = REPO / "workflows"
API_DIR = UI_DIR / "api"
INPUTS = UI_DIR / "inputs"
NAMES = sorted(p.stem for p in UI_DIR.glob("*.json"))
UI_ONLY = {"MarkdownNote", "Note"}


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    with harness.installed(tmp_path_factory.mktemp("vflash-cache"), tmp_path_factory.mktemp("comfyui")) as loaded:
        yield loaded


def test_the_set_of_workflows():
    assert NAMES == ["fl2va", "i2va", "ref2va", "t2va", "t2va_core_save", "t2va_two_gpu_sequence_head"]
    assert sorted(p.stem for p in API_DIR.glob("*.json")) == NAMES


# -- API format ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_type_checks_against_the_node_schemas(pack, name):
    workflow = load_api_workflow(API_DIR / f"{name}.json")
    order = plan(workflow, pack.node_types(workflow))  # unknown ids, unknown inputs, missing inputs, link types, cycles
    assert set(order) == set(workflow), "every node is an ancestor of an output"


@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_runs_headless_without_unsupported_nodes(name):
    workflow = load_api_workflow(API_DIR / f"{name}.json")
    plan(workflow, headless_node_types())


def test_api_checks_name_the_problem(pack):
    workflow = load_api_workflow(API_DIR / "t2va.json")
    broken = json.loads(json.dumps(workflow))
    broken["6"]["inputs"]["latent"] = ["4", 0]  # VFLASH_COND into a LATENT input
    with pytest.raises(WorkflowError, match=r"node 6 \(VflashDecode\)\.latent takes LATENT, but node 4 \(VflashEncode\) output 0 is VFLASH_COND"):
        plan(broken, pack.node_types())
    broken = json.loads(json.dumps(workflow))
    del broken["5"]["inputs"]["seed"]
    with pytest.raises(WorkflowError, match="missing required input 'seed'"):
        plan(broken, pack.node_types())
    with pytest.raises(WorkflowError, match="UI-format"):
        check_api_workflow(json.loads((UI_DIR / "t2va.json").read_text()))
    with pytest.raises(WorkflowError, match="no node 'nope'"):
        apply_overrides(workflow, ["nope.seed=1"])
    assert apply_overrides(workflow, ["Vflash Sampler.seed=5"])["5"]["inputs"]["seed"] == 5


def test_nested_inputs_follow_comfyui():
    assert nest_inputs({"format": "mp4", "format.codec": "h264", "video": 1}) == {"format": {"format": "mp4", "codec": "h264"}, "video": 1}
    assert nest_inputs({"ref_images.ref_image_0": "a", "ref_images.ref_image_2": "c"}) == {"ref_images": {"ref_image_0": "a", "ref_image_2": "c"}}
    assert types_compatible("IMAGE", "IMAGE,MASK") and types_compatible("*", "LATENT") and not types_compatible("LATENT", "IMAGE")


# -- UI format -------------------------------------------------------------------------------------------------------


def _widget_slots(schema, io) -> list[str | None]:
    """The frontend's `widgets_values` order: required widgets, then optional ones, in schema order; a seed's
    control_after_generate value and an upload combo's button take one extra (unnamed) slot each."""
    slots: dict[bool, list[str | None]] = {False: [], True: []}
    for inp in schema.inputs:
        if isinstance(inp, io.DynamicCombo.Input):
            slots[inp.optional].append(inp.id)
            children = {c.id: c for option in inp.options for c in option.inputs}
            slots[inp.optional].extend(f"{inp.id}.{cid}" for cid in children)
        elif isinstance(inp, io.WidgetInput) and not inp.force_input:
            slots[inp.optional].append(inp.id)
            if getattr(inp, "control_after_generate", None) or getattr(inp, "upload", None) is not None:
                slots[inp.optional].append(None)
    return slots[False] + slots[True]


def _socket_types(schema, io) -> dict[str, str]:
    types = {}
    for inp in schema.inputs:
        if isinstance(inp, io.Autogrow.Input):
            types.update({f"{inp.id}.{c.id}": c.get_io_type() for c in inp.template.get_all()})
        elif isinstance(inp, io.DynamicCombo.Input):
            types[inp.id] = "COMBO"
            types.update({f"{inp.id}.{c.id}": c.get_io_type() for o in inp.options for c in o.inputs})
        else:
            types[inp.id] = inp.get_io_type()
            if getattr(inp, "upload", None) is not None:  # the frontend's "choose file to upload" button widget
                types["upload"] = inp.upload.name.upper() + "UPLOAD"
    return types


def ui_to_api(ui: dict, pack) -> dict:
    """Convert a UI workflow to the API format with the node schemas (what the frontend's graphToPrompt does for
    these graphs: no subgraphs, no muted or bypassed nodes)."""
    io = importlib.import_module("comfy_api.latest").io
    links = {link[0]: link for link in ui["links"]}
    out = {}
    for node in ui["nodes"]:
        if node["type"] in UI_ONLY:
            continue
        assert node.get("mode", 0) == 0, f"node {node['id']} is muted or bypassed"
        schema = pack.schema(node["type"])
        slots = _widget_slots(schema, io)
        values = node.get("widgets_values", [])
        assert len(values) == len(slots), f"node {node['id']} ({node['type']}): {len(values)} widget values for {len(slots)} slots {slots}"
        linked = {i["name"] for i in node["inputs"] if i.get("link") is not None}
        inputs = {name: value for name, value in zip(slots, values) if name is not None and name not in linked}
        for i in node["inputs"]:
            if i.get("link") is not None:
                link = links[i["link"]]
                inputs[i["name"]] = [str(link[1]), link[2]]
        out[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return out


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_links_type_check(pack, name):
    io = importlib.import_module("comfy_api.latest").io
    ui = json.loads((UI_DIR / f"{name}.json").read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] >= max(nodes) and ui["last_link_id"] >= max(l[0] for l in ui["links"])
    known = set(pack.nodes) | set(pack.core) | UI_ONLY
    assert {n["type"] for n in ui["nodes"]} <= known
    for node in ui["nodes"]:
        if node["type"] in UI_ONLY:
            continue
        schema = pack.schema(node["type"])
        sockets = _socket_types(schema, io)
        assert [o["type"] for o in node["outputs"]] == [o.get_io_type() for o in schema.outputs], node["type"]
        for i in node["inputs"]:
            assert i["name"] in sockets, f"{node['type']} has no input {i['name']}"
        assert node["properties"]["cnr_id"] == ("comfy-core" if node["type"] in pack.core else "vflash")
    for link_id, src, src_slot, dst, dst_slot, link_type in ui["links"]:
        source, target = nodes[src], nodes[dst]
        out_type = pack.schema(source["type"]).outputs[src_slot].get_io_type()
        target_input = target["inputs"][dst_slot]
        in_type = _socket_types(pack.schema(target["type"]), io)[target_input["name"]]
        assert link_type == out_type and types_compatible(out_type, in_type), f"link {link_id}: {out_type} -> {target['type']}.{target_input['name']} ({in_type})"
        assert link_id in source["outputs"][src_slot]["links"] and target_input["link"] == link_id


@pytest.mark.parametrize("name", NAMES)
def test_ui_and_api_describe_the_same_graph(pack, name):
    ui = json.loads((UI_DIR / f"{name}.json").read_text())
    api = load_api_workflow(API_DIR / f"{name}.json")
    converted = ui_to_api(ui, pack)
    assert {k: v["class_type"] for k, v in converted.items()} == {k: v["class_type"] for k, v in api.items()}
    for node_id, node in api.items():
        assert converted[node_id]["inputs"] == node["inputs"], f"{name} node {node_id} ({node['class_type']})"


# -- headless runs ---------------------------------------------------------------------------------------------------


def test_run_workflow_cli_t2va_plays_with_audio(tmp_path):
    """The acceptance run: `vflash run-workflow workflows/api/t2va.json` on a fresh cache writes a playable MP4."""
    from vflash_core.media import probe_mp4

    env = {**os.environ, "VFLASH_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "vflash_core.cli", "run-workflow", str(API_DIR / "t2va.json"), "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    files = list((tmp_path / "out" / "video").glob("vflash_t2va_*.mp4"))
    assert len(files) == 1 and json.loads(out.stdout.strip().splitlines()[-1])["outputs"] == [str(files[0])]
    info = probe_mp4(files[0])
    assert (info["frames"], info["width"], info["height"], info["video_codec"]) == (124, 448, 256, "h264")
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and info["sample_rate"] == 32000 and abs(info["audio_seconds"] - 124 / 24) < 0.05


def test_run_workflow_cli_refuses_unsupported_nodes(tmp_path):
    workflow = load_api_workflow(API_DIR / "t2va.json")
    workflow["8"] = {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["5", 0], "vae": ["3", 0]}}
    (tmp_path / "w.json").write_text(json.dumps(workflow))
    out = subprocess.run([sys.executable, "-m", "vflash_core.cli", "run-workflow", str(tmp_path / "w.json")], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "unsupported nodes: 8 (VAEDecodeAudio)" in out.stderr and not (tmp_path / "output").exists()


def test_fl2va_headless_with_the_example_inputs(tmp_path, monkeypatch):
    from vflash_core.media import probe_mp4

    monkeypatch.setenv("VFLASH_CACHE", str(tmp_path / "cache"))
    workflow = apply_overrides(load_api_workflow(API_DIR / "fl2va.json"), ["4.width=128", "4.height=128"])
    files = run_headless(workflow, output_dir=tmp_path / "out", input_dir=INPUTS)
    assert len(files) == 1 and probe_mp4(files[0])["frames"] == 124


def test_ref2va_headless_on_a_small_ref2va_family(tmp_path):
    """The ref2va graph (Autogrow reference inputs) on a random-weight family with a ref2va partition."""
    from vflash_core.compiler import compile_receipt, prepare
    from vflash_core.family import DEMO_FAMILY, build_model_family
    from vflash_core.media import probe_mp4
    from vflash_core.pipeline import prepare_pipeline

    models = tmp_path / "models"
    root = models / "diffusers" / "H3-ref-demo"
    build_model_family(root, DEMO_FAMILY, seed=0, with_ref=True)
    prepare("ref2va-base4-exact-cpu", root / "transformer_ref", tmp_path / "weights.json")
    compile_receipt(tmp_path / "weights.json", tmp_path / "compiled")
    assets = {"model_root": str(root), "decoder_root": str(root), "adapter_path": None, "artifact": str(tmp_path / "compiled" / "artifact"),
              "schedule_overlay": str(tmp_path / "compiled" / "schedule"), "auxiliary_tensor": str(tmp_path / "compiled" / "auxiliary.safetensors")}
    (tmp_path / "assets.json").write_text(json.dumps(assets))
    (models / "vflash").mkdir(parents=True)
    prepare_pipeline("ref2va-base4-exact-cpu", tmp_path / "assets.json", models / "vflash" / "ref-demo.json")
    workflow = apply_overrides(load_api_workflow(API_DIR / "ref2va.json"), [
        "1.model=vflash/ref-demo.json", "1.profile=auto", "2.encoder=vflash/ref-demo.json", "3.vae=diffusers/H3-ref-demo",
        "4.width=128", "4.height=128",
    ])
    files = run_headless(workflow, output_dir=tmp_path / "out", input_dir=INPUTS, models_dir=models)
    info = probe_mp4(files[0])
    assert info["frames"] == 124 and info["audio_codec"] == "aac"
