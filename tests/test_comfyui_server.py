"""The example API workflows against a real ComfyUI server (skipped unless `COMFYUI_ROOT` is set).

Setup (docs/development.md): `COMFYUI_ROOT` is a ComfyUI checkout at the pinned commit,
`COMFYUI_PYTHON` (default: this interpreter) a Python with ComfyUI's requirements and this repository's
requirements.txt installed. The fixture starts `main.py --cpu --cache-none` (`benchmarks/comfy_server.py`, shared with
the core-vs-Vflash benchmark) with the pack and the test-only probes; it submits workflows with `POST /prompt`, follows
the websocket until the prompt finishes, and fetches the MP4 through `/history` and `/view`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformer_files
from comfyui_server_helpers import (
    API,
    COMFYUI_ROOT,
    PROBE,
    REPO,
    SMALL_DIT,
    Server,
    server_memory,
    small_core_workflow,
    vflash_entries,
)
from conftest import TEMPLATES

pytestmark = pytest.mark.skipif(not COMFYUI_ROOT, reason="set COMFYUI_ROOT to a ComfyUI checkout to run the real-server tests")

SMALL = {"4": {"width": 128, "height": 128}}  # the chain on a small canvas; t2va runs unmodified


CORE_VIDEO_VAE = "SmallVideoVAE"  # core's H3 video VAE class at the small family's dimensions (comfy_core_probe/small_core.py)


def _workflow(name: str, changes: dict | None = None, seed: int = 0) -> dict:
    workflow = json.loads((API / f"{name}.json").read_text())
    for node_id, inputs in (changes or {}).items():
        workflow[node_id]["inputs"].update(inputs)
    workflow["5"]["inputs"]["seed"] = seed
    return workflow


def test_pack_loaded_and_published(server):
    import urllib.request

    assert "IMPORT FAILED" not in server.tail(400)
    with urllib.request.urlopen(server.url + "/object_info/VflashSampler") as r:
        info = json.loads(r.read())["VflashSampler"]
    assert info["category"] == "Vflash/sampling" and info["output"] == ["LATENT"]
    assert set(info["input"]["required"]) == {"model", "cond", "latent", "seed", "force_offload", "profile_denoise"}
    with urllib.request.urlopen(server.url + "/object_info/VflashModelLoader") as r:
        assert "embedded-demo" in json.loads(r.read())["VflashModelLoader"]["input"]["required"]["model"][1]["options"]


def test_a_second_copy_of_the_pack_registers_nothing_and_logs_one_warning(tmp_path):
    """Two custom-node folders holding the pack (two links to this checkout, as when the documented install meets a
    linked copy): ComfyUI loads the nodes of the first only, and the log has one WARNING naming both folders."""
    import urllib.request

    srv = Server(Path(COMFYUI_ROOT), tmp_path, copies=("vflash_copy_a", "vflash_copy_b"))
    try:
        srv.wait_ready()
        with urllib.request.urlopen(srv.url + "/object_info/VflashSampler") as r:
            module = json.loads(r.read())["VflashSampler"]["python_module"]
        log = srv.tail(400)
    finally:
        srv.stop()
    warnings = [line for line in log.splitlines() if "the node pack is installed twice" in line]
    assert len(warnings) == 1, log
    first = module.removeprefix("custom_nodes.")
    second = ({"vflash_copy_a", "vflash_copy_b"} - {first}).pop()
    assert f"{tmp_path / 'nodes' / first} is loaded" in warnings[0], warnings
    assert f"the copy in {tmp_path / 'nodes' / second} is not" in warnings[0], warnings
    assert "IMPORT FAILED" not in log and "Skip " not in log


def test_templates_are_listed_and_load_with_their_model_files_and_thumbnails(server):
    """ComfyUI serves workflows/*.json as this pack's templates (not workflows/api/), each by its title, with its
    <title>.jpg thumbnail; a template loads with the model metadata the frontend's Missing Models uses (each file's
    name, URL and folder, in the properties of the node that reads it), as served to the browser."""
    import urllib.parse
    import urllib.request

    with urllib.request.urlopen(server.url + "/workflow_templates") as r:
        templates = json.loads(r.read())
    assert sorted(templates[server.pack_name]) == sorted(TEMPLATES.values())
    served = f"{server.url}/api/workflow_templates/{server.pack_name}"
    for title in TEMPLATES.values():
        quoted = urllib.parse.quote(title)
        with urllib.request.urlopen(f"{served}/{quoted}.json") as r:
            assert json.loads(r.read()) == json.loads((REPO / "workflows" / f"{title}.json").read_text())
        with urllib.request.urlopen(f"{served}/{quoted}.jpg") as r:
            assert r.headers["Content-Type"] == "image/jpeg" and r.read()[:3] == b"\xff\xd8\xff"
    with urllib.request.urlopen(f"{served}/{urllib.parse.quote(TEMPLATES['t2va_core_loaders'])}.json") as r:
        nodes = {n["id"]: n for n in json.loads(r.read())["nodes"]}
    hub = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"
    assert nodes[1]["properties"]["models"] == [{"name": "minimax_h3_fl2va_bf16.safetensors", "directory": "diffusion_models",
                                                  "url": f"{hub}/diffusion_models/minimax_h3_fl2va_bf16.safetensors"}]
    assert nodes[2]["properties"]["models"] == [{"name": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "directory": "text_encoders",
                                                  "url": f"{hub}/text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"}]
    assert [nodes[i]["properties"]["models"][0]["url"] for i in (3, 12)] == [f"{hub}/vae/minimax_h3_video_vae_fp16.safetensors",
                                                                           f"{hub}/vae/minimax_h3_audio_vae_fp32.safetensors"]


@pytest.mark.parametrize("name,changes", [
    ("t2va", None),
    ("i2va", SMALL),
    ("fl2va", SMALL),
    ("t2va_core_save", {**SMALL, "10": {"width": 128, "height": 128}}),
])
def test_workflow_on_the_server(server, tmp_path, name, changes):
    from mp4_probe import probe_mp4

    result = asyncio.run(server.run_prompt(_workflow(name, changes)))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    files = server.history_files(result["prompt_id"], tmp_path)
    assert len(files) == 1 and files[0].suffix == ".mp4"
    info = probe_mp4(files[0])
    size = (448, 256) if changes is None else (128, 128)
    assert (info["frames"], info["width"], info["height"]) == (124, *size)
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and abs(info["audio_seconds"] - 124 / 24) < 0.05
    progress = [e["data"]["value"] for e in result["events"] if e["type"] == "progress" and e["data"].get("max") == 4]
    assert progress and progress[-1] == 4


@pytest.mark.parametrize("name", ["ref2va", "t2va_two_gpu_sequence_head"])
def test_official_weight_workflows_are_validated(server, name):
    """Without the official weights in models/diffusers, ComfyUI rejects these graphs at validation, naming the model."""
    result = asyncio.run(server.run_prompt(_workflow(name)))
    assert result["status"] == "rejected" and result["http_status"] == 400
    assert "1" in result["body"]["node_errors"]


def test_interrupt_then_next_run_succeeds(server, tmp_path):
    # Full canvas: one evaluation takes long enough for the interrupt to land inside sampling.
    result = asyncio.run(server.run_prompt(_workflow("t2va", seed=11), interrupt_at=1))
    assert result["status"] == "execution_interrupted", result
    done = [e["data"]["value"] for e in result["events"] if e["type"] == "progress" and e["data"].get("max") == 4]
    assert max(done) <= 2
    again = asyncio.run(server.run_prompt(_workflow("t2va", SMALL, seed=12)))
    assert again["status"] == "success"
    assert len(server.history_files(again["prompt_id"], tmp_path)) == 1


# -- early refusal and core's text conditioning ------------------------------------------------------------------------


def test_sm90_profile_on_cpu_is_refused_when_queued_before_any_model_loads(server):
    """Official weights with an sm90 profile on this CPU-only server: the profile list holds only what this machine
    runs, so ComfyUI rejects the graph when it is queued (HTTP 400, one error on the loader's profile, naming what is
    here), nothing executes, and no receipt or compiled folder is written."""
    from safetensors.torch import save_file

    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    models = server.work / "models"
    (models / "diffusion_models").mkdir(parents=True, exist_ok=True)
    tiny = H3Config.preset("tiny")
    transformer_files.write_original_transformer(models / "diffusion_models" / "h3_sm90.safetensors", tiny, synthetic.random_internal_weights(tiny, seed=2))
    save_file({"x": __import__("torch").zeros(1)}, str(models / "diffusion_models" / "unrelated.safetensors"))
    workflow = _workflow("t2va", {"1": {"model": "h3_sm90.safetensors", "profile": "t2va-base16-bf16-sm90"}})
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "rejected" and result["http_status"] == 400, result
    (error,) = result["body"]["node_errors"]["1"]["errors"]
    assert error["type"] == "value_not_in_list" and error["extra_info"]["input_name"] == "profile", error
    assert "t2va-base16-bf16-sm90" in error["details"] and "t2va-base4-exact-cpu" in error["details"], error
    assert "Vflash: preparing" not in server.tail(400) and not list((server.work / "models" / "vflash").rglob("*receipt*"))


@pytest.mark.parametrize("name,option,folder,file,cpu_profile,download", [
    ("ref2va", "diffusers/MiniMax-H3", "diffusers", "MiniMax-H3", "ref2va-base4-exact-cpu",
     "download the repository https://huggingface.co/MiniMaxAI/MiniMax-H3 as that folder"),
])
def test_a_missing_model_is_one_error_naming_its_folder(server, name, option, folder, file, cpu_profile, download):
    """A template's transformer is not here: ComfyUI rejects the graph when it is queued with one error on the Vflash
    loader, on its model option, naming the folder the file belongs in and, first, where to download it (the
    frontend's Missing Models lists no folder; ComfyUI files a refusal of `validate_inputs`
    once per argument it takes; the loader's takes the model option alone). As shipped, the template's sm90 profile is
    one more error on this CPU machine, on the profile widget: one error per problem, none repeated."""
    workflow = json.loads((API / f"{name}.json").read_text())
    workflow["1"]["inputs"]["profile"] = cpu_profile
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "rejected" and result["http_status"] == 400, result
    (error,) = result["body"]["node_errors"]["1"]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == "model", error
    assert f"model - {option} is missing: {file} belongs in models/{folder}: {download} (ComfyUI looks in " in error["details"], error
    shipped = asyncio.run(server.run_prompt(json.loads((API / f"{name}.json").read_text())))
    errors = shipped["body"]["node_errors"]["1"]["errors"]
    assert sorted(e["extra_info"]["input_name"] for e in errors) == ["model", "profile"], errors
    assert all(len(node["errors"]) == 1 for nid, node in shipped["body"]["node_errors"].items() if nid != "1"), shipped


def test_the_comfy_org_template_without_its_files_is_one_error_per_file(server):
    """The Comfy-Org template queued where none of its four files is, on a profile this CPU machine runs: ComfyUI
    rejects it with exactly four errors, one per missing file, each on the node whose `properties.models` names that
    file with its folder and download URL (what the frontend's Missing Models shows when the template opens). The
    Vflash loader's own refusal names all three. Core's Load CLIP and Load VAE name the file only ("Value not in
    list": `execution.validate_inputs` checks a core loader's combo against its folder's files, a check a node pack
    cannot replace without patching ComfyUI), so for those files the folder and URL reach the user through Missing
    Models alone. The frontend (1.49.6) adds these errors to the Missing Models entries it found on load, without
    matching the two, so after Run each missing file is counted twice (tests/test_comfyui_browser.py). With the
    shipped sm90 profile there is one more error, on the loader's profile: this machine cannot run that profile."""
    ui = json.loads((REPO / "workflows" / f"{TEMPLATES['t2va_core_loaders']}.json").read_text())
    files = {str(node["id"]): node["properties"]["models"] for node in ui["nodes"] if node["properties"].get("models")}
    assert len(files) == 4 and all(len(models) == 1 for models in files.values()), files
    workflow = json.loads((API / "t2va_core_loaders.json").read_text())
    workflow["1"]["inputs"]["profile"] = "t2va-base4-exact-cpu"
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "rejected" and result["http_status"] == 400, result
    node_errors = result["body"]["node_errors"]
    assert sorted(node_errors) == sorted(files) and all(len(node["errors"]) == 1 for node in node_errors.values()), node_errors
    for node_id, ((model,), (error,)) in {nid: (files[nid], node_errors[nid]["errors"]) for nid in files}.items():
        widget = error["extra_info"]["input_name"]
        assert workflow[node_id]["inputs"][widget] == model["name"], (model, error)
        if node_id == "1":
            assert error["type"] == "custom_validation_failed", error
            assert f"{model['name']} belongs in models/{model['directory']}: download {model['url']} (" in error["details"], error
        else:
            assert error["type"] == "value_not_in_list" and error["extra_info"]["received_value"] == model["name"], error
    shipped = asyncio.run(server.run_prompt(json.loads((API / "t2va_core_loaders.json").read_text())))
    loader_errors = shipped["body"]["node_errors"]["1"]["errors"]
    assert sorted(e["extra_info"]["input_name"] for e in loader_errors) == ["model", "profile"], loader_errors
    assert sum(len(node["errors"]) for node in shipped["body"]["node_errors"].values()) == 5, shipped["body"]


def test_a_workflow_saved_with_the_old_single_file_spelling_is_refused_when_queued(server):
    """The loader listed single files as `diffusion_models/<rel>` before it named them as core's Load Diffusion Model
    does (`<rel>`): a workflow saved with the old spelling is rejected when it is queued (HTTP 400, one error on the
    loader's model option naming the option to pick): nothing runs."""
    old = f"diffusion_models/{SMALL_DIT}"
    result = asyncio.run(server.run_prompt(_workflow("t2va", {"1": {"model": old, "profile": "t2va-base4-exact-cpu"}})))
    assert result["status"] == "rejected" and result["http_status"] == 400, result
    assert list(result["body"]["node_errors"]) == ["1"], result["body"]
    (error,) = result["body"]["node_errors"]["1"]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == "model", error
    assert error["details"] == f"model - {old!r} is the old spelling of {SMALL_DIT}; pick {SMALL_DIT} in the loader", error


def test_profile_vs_request_is_refused_before_any_model_loads(server):
    """A ref2va graph on the demo's t2va profile: the first Vflash node ComfyUI runs reads the graph and stops the
    prompt before a text encoder, VAE or transformer loads."""
    demo = {"model": "embedded-demo", "profile": "auto"}
    workflow = _workflow("ref2va", {"1": demo, "2": {"encoder": "embedded-demo"}, "3": {"vae": "embedded-demo"}}, seed=31)
    log = server.work / "server.log"
    server.log.flush()
    before = log.read_text(errors="replace").count("Vflash model ")
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "execution_error", result
    assert "accepts t2va, i2va, l2va, fl2va" in result["body"]["exception_message"] and "encodes a ref2va request" in result["body"]["exception_message"]
    server.log.flush()
    assert log.read_text(errors="replace").count("Vflash model ") == before


def test_core_text_conditioning_vs_diffusers_hidden_state_50(server):
    """Core's own MiniMax-H3 text encoder (`CLIPLoader(type="minimax")` code: detection, loader, tokenizer, Qwen3-VL)
    on a small random Qwen3-VL written as a Comfy-Org file, against transformers' hidden_states[50] on the same
    weights and token ids. Measured (ComfyUI 0.33.0): not bitwise; fp32 differs by ~2e-6 (values up to ~5), and a
    bf16 file by up to ~0.17 (core returns fp32 from its own casting order). The node description and the sampler's
    vflash_notes say so."""
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    probe = REPO / "tests" / "comfy_core_probe" / "measure_text.py"
    out = subprocess.run([python, str(probe)], cwd=COMFYUI_ROOT, check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["dtype"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"fp32", "bf16"}
    assert not rows["fp32"]["bitwise_equal"] and rows["fp32"]["max_abs_diff"] < 1e-4
    assert not rows["bf16"]["bitwise_equal"] and rows["bf16"]["max_abs_diff"] < 0.5


@pytest.mark.parametrize("mode", ["t2va", "i2va"])
def test_core_clip_and_vae_loaders_drive_the_vflash_sampler_to_mp4(server, tmp_path, mode):
    """The new template's graph: core CLIPLoader (type minimax) reads the Qwen3-VL file from text_encoders/, two core
    VAELoaders read the video and audio VAE files from vae/, Vflash compiles and runs the single-file transformer; with
    a first frame, core's vision tower and core's video VAE encode it. The MP4 has the clip's frames and soundtrack."""
    from mp4_probe import probe_mp4

    workflow = small_core_workflow(21)
    workflow["7"]["inputs"]["filename_prefix"] = f"video/core_loaders_{mode}"
    if mode == "i2va":
        workflow["8"] = {"class_type": "LoadImage", "inputs": {"image": "vflash_first_frame.png"}}
        workflow["4"]["inputs"]["first_frame"] = ["8", 0]
        workflow["4"]["inputs"]["prompt"] = "<Picture 1> comes alive: the square spins, a bell rings."
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    files = server.history_files(result["prompt_id"], tmp_path)
    assert len(files) == 1
    info = probe_mp4(files[0])
    assert (info["frames"], info["width"], info["height"]) == (124, 128, 128)
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and abs(info["audio_seconds"] - 124 / 24) < 0.05
    log = server.tail(400)
    assert "Vflash sampled with text conditioning from ComfyUI core's CLIP" in log
    assert ("keyframe / reference latents from ComfyUI core's VAE" in log) == (mode == "i2va")


# -- Comfy-Org transformer files -----------------------------------------------------------------------------------


def test_comfy_org_transformer_files_against_core_model(tmp_path):
    """Core's own MiniMax-H3 model (`comfy.sd.load_diffusion_model`, bf16) and Vflash on the same small files in
    Comfy-Org's formats, the same latents, text and timesteps (`comfy_core_probe/measure_transformer.py`). Measured
    (ComfyUI 0.33.0, CPU):

    * pruned: every compiled AdaLN table (each block's, and the final norm's) equals core's `adaln_proj` output
      bitwise at every step; Vflash's velocity is not core's bitwise (max abs diff ~0.03 at values ~5, one bf16 ulp
      there) because core's blocks differ in two ops only: its attention kernel (on the CPU the sub-quadratic one)
      and its gate (`addcmul_`, one rounding where diffusers rounds twice). With those two ops swapped in (test-only),
      the velocity equals core's bit for bit.
    * fp8_scaled: every float8 layer Vflash dequantizes equals core's `weight.dequantize()` (bf16 compute) bitwise.
    * bf16 (for contrast): core's AdaLN itself differs from diffusers' (its time embedding is cast to bf16 before
      SiLU), so the tables differ by up to one bf16 ulp and Vflash (diffusers-exact) is not core-exact there.
    """
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run([python, str(PROBE / "measure_transformer.py"), str(tmp_path)], cwd=COMFYUI_ROOT, check=False, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["file"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"bf16", "pruned", "fp8_scaled"}
    pruned = rows["pruned"]
    assert pruned["base_weights"]["pruned"] == {"grid": 1025, "rank": 8}
    assert len(pruned["tables"]) == 4 and all(t["bitwise"] for t in pruned["tables"]), pruned["tables"]
    for step in pruned["velocity"]:
        assert step["core_attention_and_gate"]["video"]["bitwise"] and step["core_attention_and_gate"]["audio"]["bitwise"], step
        for stream in ("video", "audio"):
            assert not step["vflash_ops"][stream]["bitwise"] and step["vflash_ops"][stream]["max_abs_diff"] < 0.1, step
    fp8 = rows["fp8_scaled"]
    assert fp8["base_weights"]["format"] == "fp8_scaled"
    assert fp8["dequantized"]["layers"] == fp8["dequantized"]["bitwise_layers"] > 0 and fp8["dequantized"]["core_dtype"] == "torch.bfloat16"
    assert not any(t["bitwise"] for t in rows["bf16"]["tables"])


@pytest.mark.parametrize("form,profile,note", [
    ("pruned", "t2va-base4-pruned-cpu", "a pruned transformer: approximate AdaLN"),
    ("fp8_scaled", "t2va-base4-exact-cpu", "transformer weights from an fp8_scaled file"),
])
def test_comfy_org_transformer_file_through_the_model_loader(server, tmp_path, form, profile, note):
    """The small family's transformer as a pruned or fp8_scaled Comfy-Org file in diffusion_models/, with core's text
    encoder and VAEs: the Vflash loader compiles it on first use and the graph runs to an MP4."""
    from dataclasses import replace

    from mp4_probe import probe_mp4

    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    config = replace(H3Config.preset("demo"), in_channels=24, audio_in_channels=32)
    weights = synthetic.random_internal_weights(config, seed=6)
    name = f"h3_small_{form}.safetensors"
    if form == "pruned":
        synthetic.write_comfy_transformer(server.work / "models" / "diffusion_models" / name, config, transformer_files.prune_adaln(weights, config))
    else:
        synthetic.write_comfy_transformer(server.work / "models" / "diffusion_models" / name, config, weights, fp8="metadata")
    workflow = json.loads((API / "t2va_core_loaders.json").read_text())
    workflow["1"]["inputs"].update(model=name, profile=profile)
    workflow["2"]["inputs"]["clip_name"] = "h3_small_te.safetensors"
    workflow["3"]["inputs"]["vae_name"] = "h3_small_video_vae.safetensors"
    workflow["12"]["inputs"]["vae_name"] = "h3_small_audio_vae.safetensors"
    workflow["4"]["inputs"].update(width=128, height=128)
    workflow["5"]["inputs"]["seed"] = 23
    workflow["7"]["inputs"]["filename_prefix"] = f"video/comfy_org_{form}"
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    files = server.history_files(result["prompt_id"], tmp_path)
    assert len(files) == 1 and probe_mp4(files[0])["frames"] == 124
    assert f"Vflash sampled with {note}" in server.tail(400)


def test_int8_convrot_file_is_refused_when_queued(server):
    """An int8_convrot transformer whose rotation cannot be undone (its 24-column linears are not a multiple of its
    256-column ConvRot groups): HTTP 400 on the loader, in one line, before anything is prepared. (A well-formed one
    generates: tests/test_comfyui_server_files.py.)"""
    import torch
    from safetensors.torch import save_file

    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    tiny = H3Config.preset("tiny")
    state = synthetic.to_original_names(synthetic.random_internal_weights(tiny, seed=2), tiny)
    layers = {}
    for key in [k for k in state if k.startswith("blocks.") and k.endswith("qkv_proj.weight")]:
        state[key] = torch.zeros(state[key].shape, dtype=torch.int8)
        state[key.replace(".weight", ".weight_scale")] = torch.tensor(0.01)
        layers[key.removesuffix(".weight")] = {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 256}}
    save_file(state, str(server.work / "models" / "diffusion_models" / "h3_int8_convrot.safetensors"),
              metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    workflow = _workflow("t2va", {"1": {"model": "h3_int8_convrot.safetensors", "profile": "t2va-base4-exact-cpu"}})
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "rejected" and result["http_status"] == 400, result
    (error,) = result["body"]["node_errors"]["1"]["errors"]
    details = error["details"]
    assert "not a multiple of its convrot_groupsize 256" in details, details
    assert not list((server.work / "models" / "vflash").rglob("h3_int8_convrot*"))


# -- live previews and cancel during decode -------------------------------------------------------------------------
# Last in the file: they compile the small family, and the refusal tests above check that nothing was ever prepared.


def _node_seconds(result: dict, node: str) -> float:
    """Seconds from `node` starting to execute until the next node started (or the prompt ended)."""
    times = [(e["data"].get("node"), e["received"]) for e in result["events"] if e["type"] in ("executing", "execution_interrupted")]
    start = next(i for i, (n, _) in enumerate(times) if n == node)
    return times[start + 1][1] - times[start][1]


@pytest.mark.parametrize("graph", ["VflashSampler", "VflashGenerate"])
def test_live_previews_over_the_websocket_one_per_evaluation(server, graph):
    """With the prompt's preview method latent2rgb, the Vflash sampler (alone, or inside VflashGenerate) sends one JPEG
    preview per evaluation through core's previewer and progress bar, each a strip of 4 latent frames side by side
    (4:1 at a square canvas, where core's one-frame preview is 1:1); with "none", none."""
    from io import BytesIO

    from PIL import Image

    def workflow() -> dict:
        return small_core_workflow(31, generate=graph == "VflashGenerate")

    result = asyncio.run(server.run_prompt(workflow(), extra_data={"preview_method": "latent2rgb"}))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    steps = [e["data"]["value"] for e in result["events"] if e["type"] == "progress" and e["data"].get("node") == "5" and e["data"]["max"] == 4]
    assert steps == [1, 2, 3, 4]
    assert len(result["previews"]) == 4 and all(kind == 1 and image_type == 1 for kind, image_type, _ in result["previews"])
    for _, _, jpeg in result["previews"]:
        image = Image.open(BytesIO(jpeg))
        assert image.format == "JPEG" and image.width == 4 * image.height
    off = asyncio.run(server.run_prompt(workflow(), extra_data={"preview_method": "none"}))
    assert off["status"] == "success" and off["previews"] == []
    assert [e["data"]["value"] for e in off["events"] if e["type"] == "progress" and e["data"].get("node") == "5" and e["data"]["max"] == 4][-1] == 4


@pytest.mark.parametrize("method", ["latent2rgb", "auto"])
def test_the_demo_t2va_template_shows_live_previews(server, method):
    """A newcomer's first run: the demo t2va template (the embedded demo's 8-channel latents, not core's 24-channel
    H3 format) with a preview method set sends one preview per evaluation, drawn by core's latent-to-RGB previewer
    with the demo VAE's colours."""
    from io import BytesIO

    from PIL import Image

    result = asyncio.run(server.run_prompt(_workflow("t2va", SMALL, seed=3), extra_data={"preview_method": method}))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    assert len(result["previews"]) == 4, server.tail()
    for _, _, jpeg in result["previews"]:
        image = Image.open(BytesIO(jpeg))
        assert image.format == "JPEG" and image.width == 4 * image.height
    assert "no live previews" not in server.tail(2000)


# -- ComfyUI's memory management ------------------------------------------------------------------------------------


def _free(server, flags: dict, timeout: float = 60.0) -> dict:
    """`POST /free` with `flags`; the reading once the pack's registry is empty. The prompt worker applies the flags
    when it wakes between prompts; a request that lands after a prompt's last message but before the worker waits
    again only sets them (its wake-up is lost), so the request is repeated every 2 s until they are applied."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(server.url + "/free", data=json.dumps(flags).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as r:
            assert r.status == 200
        for _ in range(10):
            memory = server_memory(server)
            if not memory["vflash"]:
                return memory
            time.sleep(0.2)
    raise TimeoutError(f"/free {flags} left {memory['vflash']} loaded:\n{server.tail()}")


def test_free_releases_the_vflash_engines_and_the_next_run_loads_them_again(server, tmp_path):
    """The demo chain's engines (Vflash's transformer, VAEs and, until its force_offload, text encoder) are entries of
    ComfyUI's model management: after a run core lists exactly the engines the pack's registry holds, on the server's
    device with their bytes. `POST /free` with `unload_models`, then with `free_memory` alone, closes every one of them
    and empties the registry, leaving no Vflash entry in core's list; each time the next run loads them again (new
    engines) and succeeds."""
    result = asyncio.run(server.run_prompt(_workflow("t2va", SMALL, seed=61)))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    memory = server_memory(server)
    entries = vflash_entries(memory["now"])
    assert {"dit", "vae"} <= set(memory["vflash"]) and set(entries) == set(memory["vflash"]), memory
    assert entries["dit"]["model"] == "VflashTransformer" and entries["vae"]["model"] == "VflashVAEs"
    assert all(e["device"] == "cpu" and e["loaded_bytes"] > 0 for e in entries.values()), entries
    held = {e["id"] for e in memory["engines"] if not e["closed"]}
    for seed, flags in ((62, {"unload_models": True}), (63, {"free_memory": True})):
        memory = _free(server, flags)
        assert not vflash_entries(memory["now"]), memory["now"]
        assert all(e["closed"] for e in memory["engines"] if e["id"] in held), memory["engines"]
        again = asyncio.run(server.run_prompt(_workflow("t2va", SMALL, seed=seed)))
        assert again["status"] == "success", f"{again}\n{server.tail()}"
        assert len(server.history_files(again["prompt_id"], tmp_path)) == 1
        memory = server_memory(server)
        reloaded = {e["id"] for e in memory["engines"] if not e["closed"]}
        assert "dit" in memory["vflash"] and reloaded and not reloaded & held, memory
        assert set(vflash_entries(memory["now"])) == set(memory["vflash"])
        held = reloaded


def test_a_core_vae_stays_loaded_through_the_vflash_sampler(server, tmp_path):
    """i2va with core's CLIP and VAEs: core's video VAE encodes the first frame, which makes it an entry of core's
    model management; the Vflash sampler then loads its transformer and samples, asking core only for the bytes it
    needs (there is room on this machine). Read between the sampler and the decode, core still holds its VAE beside the
    Vflash transformer (the pack used to unload every model before loading and before sampling), and the run ends in
    an MP4."""
    workflow = small_core_workflow(71)
    workflow["8"] = {"class_type": "LoadImage", "inputs": {"image": "vflash_first_frame.png"}}
    workflow["4"]["inputs"].update(first_frame=["8", 0], prompt="<Picture 1> comes alive: the square spins, a bell rings.")
    workflow["13"] = {"class_type": "VflashTestMemorySnapshot", "inputs": {"latent": ["5", 0]}}
    workflow["6"]["inputs"]["latent"] = ["13", 0]
    workflow["7"]["inputs"]["filename_prefix"] = "video/core_vae_kept"
    taken = len(server_memory(server)["snapshots"])
    result = asyncio.run(server.run_prompt(workflow))
    assert result["status"] == "success", f"{result}\n{server.tail()}"
    assert len(server.history_files(result["prompt_id"], tmp_path)) == 1
    (snapshot,) = server_memory(server)["snapshots"][taken:]
    core = [e for e in snapshot if e["patcher"] != "EnginePatcher"]
    assert any(e["model"] == CORE_VIDEO_VAE and e["loaded_bytes"] > 0 for e in core), json.dumps(snapshot)
    assert "dit" in vflash_entries(snapshot), snapshot


def test_cancel_during_decode_within_1_5_s_then_next_run_succeeds(server, tmp_path):
    """The full canvas's decode takes a second or more on the CPU (1.5 s on an idle 2-core machine); Cancel 0.3 s into
    it ends the prompt within 1.5 s (the decoder polls ComfyUI's interrupt before every ViT block), and the next run,
    on the same loaded VAEs, succeeds."""
    decode = "6"
    full = asyncio.run(server.run_prompt(_workflow("t2va", seed=41)))
    assert full["status"] == "success", f"{full}\n{server.tail()}"
    assert _node_seconds(full, decode) > 0.9  # three times the cancel's delay: the cancel below lands inside the decode
    result = asyncio.run(server.run_prompt(_workflow("t2va", seed=41), interrupt_in_node=(decode, 0.3)))
    assert result["status"] == "execution_interrupted", result
    assert result["body"]["node_id"] == decode
    stopped = next(e["received"] for e in result["events"] if e["type"] == "execution_interrupted")
    assert stopped - result["interrupted_at"] <= 1.5, f"{stopped - result['interrupted_at']:.2f} s from the interrupt to the stop"
    again = asyncio.run(server.run_prompt(_workflow("t2va", SMALL, seed=42)))
    assert again["status"] == "success", f"{again}\n{server.tail()}"
    assert len(server.history_files(again["prompt_id"], tmp_path)) == 1
