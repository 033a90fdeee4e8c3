"""The node pack checks a request on the pipeline's request path: the nodes accept a canvas exactly when `vflash
generate` accepts it for the same model, and refuse it with the same message.

The model is the embedded demo family with wider canvas rules in its `modular_model_index.json` (1024 short edge,
1536x1024 pixels), prepared as a receipt in ComfyUI's models/vflash folder: its rules allow canvases that the released
model's rules (`CanvasRules()`, 768x1344 pixels) refuse, and refuse some the released rules refuse too. The nodes run
as ComfyUI runs them (the V3 classes' `execute` with the graph as their hidden prompt, over the headless host); the
command line runs in-process.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from headless_nodes import API
from vflash_nodes.workflow import apply_overrides, execute, load_api_workflow

from vflash_core.cli.main import main
from vflash_core.errors import RequestError, VflashError
from vflash_core.media.references import CanvasRules
from vflash_core.pipeline.h3_pipeline import H3Pipeline, PreparedAssets, VideoRequest, prepare_pipeline
from vflash_core.pipeline.validation import check_canvas_size

WIDE = {"canvas_short_edge": 1024, "canvas_max_pixels": 1536 * 1024}
OPTION = "vflash/wide.json"  # the loaders' option for the receipt
PROMPT = "Waves crash on a rock."
# (width, height): beyond the released rules but within the wide ones, within both, beyond both.
CANVASES = [(1536, 768), (1024, 1024), (1344, 768), (2048, 1024), (1920, 1088)]


@pytest.fixture(scope="module")
def wide_receipt(pack, demo_receipt) -> Path:
    """The demo family with the wide canvas rules (its other parts linked from the demo build), bound to the demo's
    compile in a prepared-assets receipt in models/vflash."""
    built = demo_receipt.parent / "model"
    models = Path(importlib.import_module("folder_paths").models_dir)
    root = models / "wide-family"
    root.mkdir(parents=True)
    for part in built.iterdir():
        if part.name != "modular_model_index.json":
            (root / part.name).symlink_to(part, target_is_directory=part.is_dir())
    index = json.loads((built / "modular_model_index.json").read_text())
    (root / "modular_model_index.json").write_text(json.dumps({**index, **WIDE}))
    demo = PreparedAssets.load(demo_receipt)
    assets = {
        "model_root": str(root),
        "decoder_root": str(root),
        "adapter_path": None,
        "artifact": str(demo.artifact),
        "schedule_overlay": str(demo.schedule_overlay),
        "auxiliary_tensor": str(demo.auxiliary_tensor),
    }
    (models / "wide-assets.json").write_text(json.dumps(assets))
    receipt = models / "vflash" / "wide.json"
    receipt.parent.mkdir(exist_ok=True)
    prepare_pipeline(demo.profile.id, models / "wide-assets.json", receipt)
    return receipt


def cli_verdict(capsys, receipt: Path, tmp_path: Path, width: int, height: int) -> str | None:
    """What `vflash generate` says of the canvas before any model loads: None when its validator accepts the request
    (`H3Pipeline.validate`, what `generate` runs first), else its one error line."""
    try:
        H3Pipeline.from_prepared(receipt).validate(VideoRequest(PROMPT, width=width, height=height))
    except RequestError:
        code = main(
            [
                "generate",
                "--prepared-assets",
                str(receipt),
                "--prompt",
                PROMPT,
                "--width",
                str(width),
                "--height",
                str(height),
                "--output",
                str(tmp_path / "clip.mp4"),
            ]
        )
        lines = capsys.readouterr().err.strip().splitlines()
        assert code != 0 and len(lines) == 1 and lines[0].startswith("vflash: error: "), lines
        assert not (tmp_path / "clip.mp4").exists()
        return lines[0].removeprefix("vflash: error: ")
    return None


def graph(width: int, height: int) -> dict:
    """The t2va workflow on the wide receipt, its encode node on the canvas."""
    workflow = load_api_workflow(API / "t2va.json")
    changes = [
        f"1.model={OPTION}",
        f"2.encoder={OPTION}",
        f"3.vae={OPTION}",
        f"4.width={width}",
        f"4.height={height}",
        f"4.prompt={PROMPT}",
    ]
    return apply_overrides(workflow, changes)


def node_verdict(pack, width: int, height: int) -> str | None:
    """What VflashEncode says of the canvas when it runs in the graph: None when it encodes the request (its latent is
    then of the canvas), else its refusal."""
    workflow = graph(width, height)
    inputs = workflow["2"]["inputs"]
    te = pack.nodes["VflashTextEncoderLoader"].execute(**inputs).args[0]
    vae = pack.nodes["VflashVAELoader"].execute(**workflow["3"]["inputs"]).args[0]
    encode = pack.nodes["VflashEncode"]
    try:
        cond, latent, frames = encode.execute(**{**workflow["4"]["inputs"], "te": te, "vae": vae}).args
    except RequestError as exc:
        return str(exc)
    assert (cond.geometry.width, cond.geometry.height, frames) == (width, height, 124)
    assert latent["samples"].tensors[0].shape[-2:] == (height // 16, width // 16)
    return None


@pytest.mark.parametrize("width,height", CANVASES)
def test_the_nodes_accept_a_canvas_exactly_when_the_cli_does(pack, wide_receipt, capsys, tmp_path, width, height):
    cli = cli_verdict(capsys, wide_receipt, tmp_path, width, height)
    assert node_verdict(pack, width, height) == cli
    if (width, height) == (1536, 768):  # the released model's rules refuse it: the nodes checked the loaded model's
        assert cli is None
        with pytest.raises(RequestError, match="this model generates at most 1,032,192"):
            check_canvas_size(height, width, CanvasRules())
    if (width, height) == (2048, 1024):
        assert cli == (
            "canvas 2048x1024 is 2,097,152 pixels; this model generates at most 1,572,864 (canvas_max_pixels, "
            "within rounding to multiples of 32; e.g. 1664x928 at 16:9)"
        )


def test_a_canvas_the_model_refuses_is_refused_before_any_model_work(pack, wide_receipt, capsys, tmp_path):
    """Read from the graph (the first Vflash node to run, and `vflash run-workflow`, check it before any model loads)
    and by the all-in-one node before its text encoder runs: the CLI's message, for the sampler of the graph."""
    refusal = cli_verdict(capsys, wide_receipt, tmp_path, 2048, 1024)
    registry = pack.package.registry.ENGINES
    registry.release("all")
    ran = []
    with pytest.raises(VflashError) as refused:
        execute(
            graph(2048, 1024),
            pack.node_types(graph(2048, 1024)),
            on_node=lambda nid, class_type: ran.append(class_type),
        )
    assert str(refused.value) == f"this graph cannot run: node 5 (VflashSampler): {refusal}"
    assert len(ran) == 1 and registry.loaded() == {}  # the first node refused; nothing loaded
    assert pack.package.graph_checks.graph_refusals(graph(1536, 768), pack.package.host.FOLDERS) == []

    workflow = graph(2048, 1024)
    model = pack.nodes["VflashModelLoader"].execute(**workflow["1"]["inputs"]).args[0]
    te = pack.nodes["VflashTextEncoderLoader"].execute(**workflow["2"]["inputs"]).args[0]
    vae = pack.nodes["VflashVAELoader"].execute(**workflow["3"]["inputs"]).args[0]
    registry.release("te")
    generate = {k: workflow["4"]["inputs"][k] for k in ("prompt", "width", "height", "length", "seconds")}
    with pytest.raises(RequestError) as refused:
        pack.nodes["VflashGenerate"].execute(model=model, te=te, vae=vae, seed=0, **generate)
    assert str(refused.value) == refusal and "te" not in registry.loaded()  # refused before the text encoder loaded


def test_the_model_loader_caps_the_engine_at_what_comfyui_keeps_free(pack, monkeypatch):
    """ComfyUI's --reserve-vram reaches the engine as its device cap (`Host.device_cap_gib`, planned against and
    enforced): on an 80 GiB card with 56 GiB reserved the engine plans within 24 GiB, not within what the driver
    reports free (a resident plan there took 36 GiB and failed mid-load). No cap on the CPU, or where the host
    reserves nothing."""
    from types import SimpleNamespace

    import torch
    from vflash_nodes import engines
    from vflash_nodes import host as comfy_host
    from vflash_nodes.host import FOLDERS, HOST

    widgets = {"weight_residency": "auto", "device": "cpu", "peer_device": "none", "strategy": "sequence-head", "attention_backend": "auto"}
    assert engines.check_loader(HOST, FOLDERS, "embedded-demo", "auto", widgets)[1].max_device_memory is None
    monkeypatch.setattr(comfy_host.mm, "extra_reserved_memory", lambda: 56 << 30, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30))
    assert HOST.device_cap_gib("cuda:0") == 24.0 and HOST.device_cap_gib("cpu") is None
    # The loader on that card (this machine has none: the device check and the architecture check stand aside).
    monkeypatch.setattr(engines, "resolve_device", lambda host, device: "cuda:0")
    monkeypatch.setattr(engines, "_check_run_devices", lambda options, profile: None)
    options = engines.check_loader(HOST, FOLDERS, "embedded-demo", "auto", {**widgets, "device": "cuda:0"})[1]
    assert options.max_device_memory == 24.0
    monkeypatch.setattr(comfy_host.mm, "extra_reserved_memory", lambda: 90 << 30)
    with pytest.raises(VflashError, match=r"90\.0 GiB of cuda:0 is reserved for other software, all of its 80\.0 GiB: nothing is left"):
        engines.check_loader(HOST, FOLDERS, "embedded-demo", "auto", {**widgets, "device": "cuda:0"})
    monkeypatch.delattr(comfy_host.mm, "extra_reserved_memory")
    assert HOST.device_cap_gib("cuda:0") is None


def test_the_model_loader_takes_a_host_budget(pack):
    """The loader's optional max_host_memory reaches the run options (`engines.check_loader`): 0 is no budget; on the
    CPU, where every weight is host memory, a budget is refused before anything loads, from the graph check."""
    from vflash_nodes import engines
    from vflash_nodes.host import FOLDERS, HOST

    widgets = {"weight_residency": "auto", "device": "cpu", "peer_device": "none", "strategy": "sequence-head", "attention_backend": "auto"}
    assert engines.check_loader(HOST, FOLDERS, "embedded-demo", "auto", widgets)[1].max_host_memory is None
    assert engines.check_loader(HOST, FOLDERS, "embedded-demo", "auto", {**widgets, "max_host_memory": 0.0})[1].max_host_memory is None
    with pytest.raises(VflashError, match="on the CPU every weight is host memory: set it to 0"):
        engines.check_loader(HOST, FOLDERS, "embedded-demo", "auto", {**widgets, "max_host_memory": 32.0})
    workflow = apply_overrides(load_api_workflow(API / "t2va.json"), ["1.max_host_memory=32"])
    with pytest.raises(VflashError, match=r"node 1 \(VflashModelLoader\): max_host_memory budgets what a GPU's weights"):
        execute(workflow, pack.node_types(workflow))
