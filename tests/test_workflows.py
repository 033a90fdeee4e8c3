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
import transformer_files
from conftest import CARD_TITLE_CHARS, TEMPLATES
from vflash_nodes.workflow import (
    WorkflowError,
    _dynamic_combo_inputs,
    apply_overrides,
    check_api_workflow,
    headless_node_types,
    load_api_workflow,
    nest_inputs,
    plan,
    run_headless,
    types_compatible,
)

REPO = Path(__file__).resolve().parent.parent
UI_DIR = REPO / "workflows"
API_DIR = UI_DIR / "api"
INPUTS = UI_DIR / "inputs"
NAMES = sorted(TEMPLATES)


def ui_file(name: str) -> Path:
    """The UI template of the API twin `name`."""
    return UI_DIR / f"{TEMPLATES[name]}.json"
UI_ONLY = {"MarkdownNote", "Note"}


CORE_LOADERS = {"t2va_core_loaders"}  # core CLIPLoader / VAELoader: ComfyUI only, not headless


def test_the_set_of_workflows():
    assert NAMES == ["fl2va", "i2va", "ref2va", "t2va", "t2va_core_loaders", "t2va_core_save", "t2va_two_gpu_sequence_head"]
    assert sorted(p.stem for p in API_DIR.glob("*.json")) == NAMES
    assert sorted(p.stem for p in UI_DIR.glob("*.json")) == sorted(TEMPLATES.values())
    for title in TEMPLATES.values():
        assert {"minimax", "h3", "vflash"} <= set(title.lower().replace("-", " ").split()), title  # what the template search matches
    # a template card shows its title on one line, cut at about 30 characters (the browser test measures the cut)
    assert len({title[:CARD_TITLE_CHARS] for title in TEMPLATES.values()}) == len(TEMPLATES), sorted(TEMPLATES.values())


COMFY_ORG = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/"
MODEL_FOLDERS = {"VflashModelLoader": "diffusion_models", "CLIPLoader": "text_encoders", "VAELoader": "vae"}


@pytest.mark.parametrize("name", NAMES)
def test_templates_name_their_model_files_as_core_templates_do(name):
    """A node whose widget names a model file carries that file's name, download URL and folder in its
    `properties.models`, as core's own templates do: the frontend's Missing Models lists a missing file with them,
    matched by the widget's value, and a download is saved under the entry's name in its folder, so the name is the
    file's path inside that folder, as core's loaders list it (no folder prefix). The files are Comfy-Org's MiniMax-H3
    repack; a diffusers folder (the official-weight templates) is not a file the frontend can list, and the demo
    templates name no file."""
    for node in json.loads(ui_file(name).read_text())["nodes"]:
        files = [v for v in node.get("widgets_values") or [] if isinstance(v, str) and v.endswith(".safetensors")]
        models = node.get("properties", {}).get("models", [])
        assert [m["name"] for m in models] == files, f"{name} node {node['id']}"
        for model in models:
            folder = MODEL_FOLDERS[node["type"]]
            assert "/" not in model["name"] and not model["name"].startswith(folder), model
            assert model == {"name": model["name"], "directory": folder, "url": f"{COMFY_ORG}{folder}/{model['name']}"}, model
    assert thumbnail(name).read_bytes()[:3] == b"\xff\xd8\xff"  # the template browser shows <template>.jpg


def thumbnail(name: str) -> Path:
    return ui_file(name).with_suffix(".jpg")


def test_the_comfy_org_template_names_four_files():
    files = [m["name"] for n in json.loads(ui_file("t2va_core_loaders").read_text())["nodes"] for m in n.get("properties", {}).get("models", [])]
    assert sorted(files) == ["minimax_h3_audio_vae_fp32.safetensors", "minimax_h3_fl2va_bf16.safetensors",
                             "minimax_h3_video_vae_fp16.safetensors", "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"]


# -- API format ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_type_checks_against_the_node_schemas(pack, name):
    workflow = load_api_workflow(API_DIR / f"{name}.json")
    order = plan(workflow, pack.node_types(workflow))  # unknown ids, unknown inputs, missing inputs, link types, cycles
    assert set(order) == set(workflow), "every node is an ancestor of an output"


@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_runs_headless_without_unsupported_nodes(name):
    workflow = load_api_workflow(API_DIR / f"{name}.json")
    with headless_node_types() as types:
        if name in CORE_LOADERS:
            with pytest.raises(WorkflowError, match=r"unsupported nodes: .*CLIPLoader.*; run this workflow in ComfyUI, which has them: vflash run-workflow runs only "):
                plan(workflow, types)
            return
        plan(workflow, types)


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
        check_api_workflow(json.loads((ui_file("t2va")).read_text()))
    with pytest.raises(WorkflowError, match="no node 'nope'"):
        apply_overrides(workflow, ["nope.seed=1"])
    assert apply_overrides(workflow, ["MiniMax H3 Vflash Sampler.seed=5"])["5"]["inputs"]["seed"] == 5


def test_nested_inputs_follow_comfyui():
    assert nest_inputs({"format": "mp4", "format.codec": "h264", "video": 1}) == {"format": {"format": "mp4", "codec": "h264"}, "video": 1}
    assert nest_inputs({"ref_images.ref_image_0": "a", "ref_images.ref_image_2": "c"}) == {"ref_images": {"ref_image_0": "a", "ref_image_2": "c"}}
    assert types_compatible("IMAGE", "IMAGE,MASK") and types_compatible("*", "LATENT") and not types_compatible("LATENT", "IMAGE")


# -- UI format -------------------------------------------------------------------------------------------------------


def _name_widgets(schema, io, values: list) -> list[tuple[str | None, object]]:
    """Pair `widgets_values` with API names in the frontend's order: required widgets, then optional ones, in schema
    order; a DynamicCombo's value is followed by the widgets of the option it selects (dotted names, recursively); a
    seed's control_after_generate value and an upload combo's button take one extra (unnamed) slot each. Fails when
    the values do not fill the slots exactly."""
    values = list(values)
    out: list[tuple[str | None, object]] = []

    def take(inp, key: str) -> None:
        assert values, f"{schema.node_id}: no widget value left for {key}"
        value = values.pop(0)
        out.append((key, value))
        if isinstance(inp, io.DynamicCombo.Input):
            option = next((o for o in inp.options if o.key == value), None)
            assert option is not None, f"{schema.node_id}.{key}: {value!r} is not an option"
            for child in option.inputs:
                if isinstance(child, (io.DynamicCombo.Input, io.WidgetInput)):
                    take(child, f"{key}.{child.id}")
        elif getattr(inp, "control_after_generate", None) or getattr(inp, "upload", None) is not None:
            out.append((None, values.pop(0)))

    for optional in (False, True):
        for inp in schema.inputs:
            if inp.optional == optional and (isinstance(inp, io.DynamicCombo.Input) or (isinstance(inp, io.WidgetInput) and not inp.force_input)):
                take(inp, inp.id)
    assert not values, f"{schema.node_id}: {len(values)} widget values left over: {values}"
    return out


def _socket_types(schema, io) -> dict[str, str]:
    types = {}
    for inp in schema.inputs:
        if isinstance(inp, io.Autogrow.Input):
            types.update({f"{inp.id}.{c.id}": c.get_io_type() for c in inp.template.get_all()})
        elif isinstance(inp, io.DynamicCombo.Input):
            types.update(_dynamic_combo_inputs(inp, inp.id))
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
        named = _name_widgets(schema, io, node.get("widgets_values") or [])
        linked = {i["name"] for i in node["inputs"] if i.get("link") is not None}
        inputs = {name: value for name, value in named if name is not None and name not in linked}
        for i in node["inputs"]:
            if i.get("link") is not None:
                link = links[i["link"]]
                inputs[i["name"]] = [str(link[1]), link[2]]
        out[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return out


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_links_type_check(pack, name):
    io = importlib.import_module("comfy_api.latest").io
    ui = json.loads((ui_file(name)).read_text())
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
    ui = json.loads((ui_file(name)).read_text())
    api = load_api_workflow(API_DIR / f"{name}.json")
    converted = ui_to_api(ui, pack)
    assert {k: v["class_type"] for k, v in converted.items()} == {k: v["class_type"] for k, v in api.items()}
    for node_id, node in api.items():
        assert converted[node_id]["inputs"] == node["inputs"], f"{name} node {node_id} ({node['class_type']})"


# -- headless runs ---------------------------------------------------------------------------------------------------


def test_run_workflow_cli_t2va_plays_with_audio(tmp_path, demo_cache):
    """The headless run a user makes: `vflash run-workflow workflows/api/t2va.json` writes a playable MP4 (the cache
    holds the run's demo build; `vflash demo`'s test builds one from nothing and renders the 448x256 canvas). The
    wiring is what is checked here, so the canvas is set to the smallest H3 takes, as `--set` lets a user do."""
    import av
    from mp4_probe import probe_mp4

    overrides = ["4.width=32", "4.height=32"]
    env = {**os.environ, "VFLASH_CACHE": str(demo_cache)}
    out = subprocess.run(
        [sys.executable, "-m", "vflash_core.cli.main", "run-workflow", str(API_DIR / "t2va.json"), "--output-dir", str(tmp_path / "out"),
         *[arg for override in overrides for arg in ("--set", override)]],
        check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    files = list((tmp_path / "out" / "video").glob("vflash_t2va_*.mp4"))
    assert len(files) == 1 and json.loads(out.stdout.strip().splitlines()[-1])["outputs"] == [str(files[0])]
    info = probe_mp4(files[0])
    assert (info["frames"], info["width"], info["height"], info["video_codec"]) == (124, 32, 32, "h264")
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and info["sample_rate"] == 32000 and abs(info["audio_seconds"] - 124 / 24) < 0.05
    with av.open(str(files[0])) as container:  # SaveVideo stores the prompt it ran in the file as core's SaveVideo does
        assert json.loads(container.metadata["prompt"]) == apply_overrides(load_api_workflow(API_DIR / "t2va.json"), overrides)


def test_run_workflow_cli_refuses_unsupported_nodes(tmp_path):
    workflow = load_api_workflow(API_DIR / "t2va.json")
    workflow["8"] = {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["5", 0], "vae": ["3", 0]}}
    (tmp_path / "w.json").write_text(json.dumps(workflow))
    out = subprocess.run([sys.executable, "-m", "vflash_core.cli.main", "run-workflow", str(tmp_path / "w.json")], check=False, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "unsupported nodes: 8 (VAEDecodeAudio)" in out.stderr and not (tmp_path / "output").exists()


def test_run_workflow_refuses_an_sm90_profile_on_cpu_before_anything_runs(tmp_path):
    """Headless like ComfyUI: the profile list holds only what this machine runs, and the value is refused before any
    node runs, so nothing is built, hashed or written."""
    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    models = tmp_path / "models"
    (models / "diffusion_models").mkdir(parents=True)
    tiny = H3Config.preset("tiny")
    transformer_files.write_original_transformer(models / "diffusion_models" / "h3.safetensors", tiny, synthetic.random_internal_weights(tiny, seed=1))
    env = {**os.environ, "VFLASH_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "vflash_core.cli.main", "run-workflow", str(API_DIR / "t2va.json"), "--models-dir", str(models), "--output-dir", str(tmp_path / "out"),
         "--set", "1.model=h3.safetensors", "--set", "1.profile=t2va-base16-bf16-sm90"],
        check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert out.returncode == 2 and 'node 1 (VflashModelLoader): profile must be one of auto, ' in out.stderr, out.stderr[-2000:]
    assert 'got "t2va-base16-bf16-sm90"' in out.stderr and "-cpu" in out.stderr and "-sm90," not in out.stderr
    assert not (tmp_path / "cache").exists() and not (models / "vflash").exists() and not (tmp_path / "out").exists()


def test_fl2va_headless_with_the_example_inputs(tmp_path, monkeypatch, demo_cache):
    from mp4_probe import probe_mp4

    monkeypatch.setenv("VFLASH_CACHE", str(demo_cache))
    workflow = apply_overrides(load_api_workflow(API_DIR / "fl2va.json"), ["4.width=128", "4.height=128"])
    files = run_headless(workflow, output_dir=tmp_path / "out", input_dir=INPUTS)
    assert len(files) == 1 and probe_mp4(files[0])["frames"] == 124


def test_ref2va_headless_on_a_small_ref2va_family(tmp_path, h3_family, h3_prepared_ref):
    """The ref2va graph (Autogrow reference inputs) on a random-weight family with a ref2va partition (the run's
    shared family, linked into the models folder, and its ref2va receipt)."""
    from mp4_probe import probe_mp4

    models = tmp_path / "models"
    (models / "diffusers").mkdir(parents=True)
    (models / "diffusers" / "H3-ref-demo").symlink_to(h3_family, target_is_directory=True)
    (models / "vflash").mkdir()
    (models / "vflash" / "ref-demo.json").write_bytes(h3_prepared_ref.read_bytes())  # its paths are absolute
    workflow = apply_overrides(load_api_workflow(API_DIR / "ref2va.json"), [
        "1.model=vflash/ref-demo.json", "1.profile=auto", "2.encoder=vflash/ref-demo.json", "3.vae=diffusers/H3-ref-demo",
        "4.width=128", "4.height=128",
    ])
    files = run_headless(workflow, output_dir=tmp_path / "out", input_dir=INPUTS, models_dir=models)
    info = probe_mp4(files[0])
    assert info["frames"] == 124 and info["audio_codec"] == "aac"


# -- what a user sees: readable notes, nothing hidden, the saved view shows the whole graph ---------------------------

TITLE_HEIGHT = 30  # LiteGraph draws a node's title bar above its `pos`
VIEW = (1440, 780)  # a 1600 x 900 window less ComfyUI's side bar and top bar


def _boxes(ui: dict) -> dict[int, tuple[float, float, float, float]]:
    """Every node's box on the canvas, title bar included: (x0, y0, x1, y1)."""
    return {n["id"]: (n["pos"][0], n["pos"][1] - TITLE_HEIGHT, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1]) for n in ui["nodes"]}


@pytest.mark.parametrize("name", NAMES)
def test_no_node_covers_another(name):
    boxes = _boxes(json.loads((ui_file(name)).read_text()))
    ids = sorted(boxes)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            ax0, ay0, ax1, ay1 = boxes[a]
            bx0, by0, bx1, by1 = boxes[b]
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"{name}: node {a} {boxes[a]} overlaps node {b} {boxes[b]}"


@pytest.mark.parametrize("name", NAMES)
def test_nodes_are_at_least_as_large_as_the_frontend_draws_them(pack, name):
    """Heights leave room for every socket row and widget row (the frontend's rows are 20 px plus a little)."""
    io = importlib.import_module("comfy_api.latest").io
    for node in json.loads((ui_file(name)).read_text())["nodes"]:
        if node["type"] in UI_ONLY:
            continue
        schema = pack.schema(node["type"])
        rows = max(len(node["outputs"]), len([i for i in node["inputs"] if "widget" not in i])) + len(node.get("widgets_values") or [])
        rows += 3 * any(isinstance(i, io.String.Input) and i.multiline for i in schema.inputs)  # a prompt box
        assert node["size"][1] >= 20 * rows, f"{name}: node {node['id']} ({node['type']}) is {node['size'][1]} px for {rows} rows"


@pytest.mark.parametrize("name", NAMES)
def test_the_saved_view_shows_the_whole_graph(name):
    ui = json.loads((ui_file(name)).read_text())
    ds = ui["extra"]["ds"]
    scale, (ox, oy) = ds["scale"], ds["offset"]
    for node_id, (x0, y0, x1, y1) in _boxes(ui).items():
        sx0, sy0, sx1, sy1 = (x0 + ox) * scale, (y0 + oy) * scale, (x1 + ox) * scale, (y1 + oy) * scale
        assert 0 <= sx0 and 0 <= sy0 and sx1 <= VIEW[0] + 80 and sy1 <= VIEW[1] + 70, f"{name}: node {node_id} is off-screen at {(sx0, sy0, sx1, sy1)}"
    assert scale >= 0.5, f"{name}: the saved view is zoomed out to {scale}"


@pytest.mark.parametrize("name", NAMES)
def test_note_text_renders_as_written(name):
    """MarkdownNote renders HTML: a bare <Picture i> would be eaten as a tag, so prompt labels sit in code spans."""
    import re

    for node in json.loads((ui_file(name)).read_text())["nodes"]:
        if node["type"] == "MarkdownNote":
            text = node["widgets_values"][0]
            outside_code = re.sub(r"`[^`]*`", "", text)
            assert not re.search(r"<[A-Za-z/!]", outside_code), f"{name}: raw markup in the note outside code spans: {outside_code!r}"


def test_save_video_fields_match_the_frontend_export():
    """The API files carry every SaveVideo field the frontend exports (format, format.codec, format.codec.encoding,
    and the top-level codec), so UI and API are equivalent field for field."""
    for name in NAMES:
        for node in load_api_workflow(API_DIR / f"{name}.json").values():
            if node["class_type"] == "SaveVideo":
                assert {"format", "format.codec", "format.codec.encoding", "codec"} <= set(node["inputs"]), name
