"""The model loader's `fast_mode` widget and the Vflash Compare node, over the headless host on the embedded demo."""

from __future__ import annotations

import importlib
import json
import logging
import math
from pathlib import Path

import pytest
from headless_nodes import API
from mp4_probe import probe_mp4
from vflash_nodes.workflow import execute, load_api_workflow

from vflash_core.engine.fast_mode import FastMode
from vflash_core.errors import VflashError

LOADER = dict(model="embedded-demo", profile="auto", weight_residency="auto", device="auto", peer_device="none",
              strategy="sequence-head", attention_backend="auto")


def test_fast_mode_widget_reaches_the_session_and_keys_the_engine(pack):
    from vflash_nodes.registry import ENGINES

    widget = {i.id: i for i in pack.schema("VflashModelLoader").inputs}["fast_mode"]
    assert widget.optional and widget.default == "exact"
    assert widget.options == ["exact", "sparse-attention", "step-cache", "sparse-attention+step-cache"]
    loader = pack.nodes["VflashModelLoader"]
    exact = loader.execute(**LOADER).args[0]
    assert exact.options.fast_mode.exact and ENGINES.engine("dit").fast_mode.exact
    fast = loader.execute(**LOADER, fast_mode="sparse-attention+step-cache").args[0]
    assert fast.options.fast_mode == FastMode(("sparse-attention", "step-cache"))
    assert fast.key() != exact.key(), "an exact and a fast engine are different engines"
    assert ENGINES.engine("dit").fast_mode == fast.options.fast_mode  # the loaded session runs the mode
    with pytest.raises(VflashError, match="unknown fast mode 'teacache'"):
        loader.execute(**LOADER, fast_mode="teacache")


def _compare_workflow(fast_mode: str) -> dict:
    base = load_api_workflow(API / "t2va.json")
    workflow = {nid: base[nid] for nid in ("1", "2", "3")}
    workflow["1"]["inputs"]["fast_mode"] = fast_mode
    workflow["4"] = {"class_type": "VflashCompare", "inputs": {
        "model": ["1", 0], "te": ["2", 0], "vae": ["3", 0], "prompt": "Waves crash on a rocky shore.", "width": 32,
        "height": 32, "length": 124, "seconds": 0.0, "seed": 3}}
    workflow["7"] = {"class_type": "SaveVideo",
                     "inputs": {"video": ["4", 0], "filename_prefix": "video/compare", "format": "auto"}}
    return workflow


def _step_cache_the_demo_reaches(monkeypatch) -> None:
    """The demo's defaults change nothing (its 2 layers are sparse-attention's dense edges; its first block moves more
    than the step cache's 0.1): a threshold it reaches makes step-cache reuse evaluation 2."""
    parse = FastMode.parse.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(FastMode, "parse", classmethod(
        lambda cls, value, **settings: parse(cls, value, **({"step_cache_threshold": 10.0} if value == "step-cache"
                                                            else settings))
    ))


def test_sampler_logs_what_its_fast_mode_did(pack, monkeypatch, caplog):
    _step_cache_the_demo_reaches(monkeypatch)
    workflow = load_api_workflow(API / "t2va.json")
    workflow["1"]["inputs"]["fast_mode"] = "step-cache"
    workflow["4"]["inputs"].update(width=32, height=32)
    with caplog.at_level(logging.INFO):
        execute(workflow, pack.node_types(workflow))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Vflash sampled t2va")]
    # the demo's main blocks; an evaluation that reuses runs the first one only
    layers = pack.package.registry.ENGINES.engine("dit").compiled.config.num_layers
    assert line.endswith(f", approximate fast mode step-cache: reused 1 of 4 evaluations, {3 * layers + 1} of "
                         f"{4 * layers} block evaluations"), line


def test_compare_node_renders_both_sides_and_reports(pack, monkeypatch):
    _step_cache_the_demo_reaches(monkeypatch)
    workflow = _compare_workflow("step-cache")
    report = execute(workflow, pack.node_types(workflow))
    video, text = report.outputs["4"]
    assert video.get_dimensions() == (64, 32) and video.get_components().images.shape[0] == 124
    summary, _, body = text.partition("\n{")
    assert summary.startswith("exact vs step-cache: 124 frames") and "SSIM mean / min" in summary
    data = json.loads("{" + body)
    assert data["exact"]["metadata"]["exact"] is True and data["fast"]["metadata"]["exact"] is False
    assert data["fast"]["metadata"]["fast_mode"]["step_cache"]["evaluations_cached"] == [2]
    video_metrics = data["metrics"]["video"]
    assert all(math.isfinite(p) for p in video_metrics["psnr_db"]["per_frame"]) and video_metrics["ssim"]["mean"] < 1
    assert data["metrics"]["audio"]["log_spectral_distance_db"] > 0
    saved = next((Path(importlib.import_module("folder_paths").get_output_directory()) / "video").glob("compare_*.mp4"))
    info = probe_mp4(saved)
    assert (info["width"], info["height"], info["frames"], info["audio_codec"]) == (64, 32, 124, "aac")


def test_compare_node_refuses_an_exact_model(pack):
    workflow = _compare_workflow("exact")
    with pytest.raises(VflashError, match="choose the model loader.s fast_mode"):
        execute(workflow, pack.node_types(workflow))


def test_graph_check_refuses_a_loaders_fast_mode_before_anything_runs(pack):
    from vflash_nodes.graph_checks import loader_refusals
    from vflash_nodes.host import FOLDERS, HOST

    assert loader_refusals(_compare_workflow("step-cache"), HOST, FOLDERS) == []
    assert loader_refusals(_compare_workflow("teacache"), HOST, FOLDERS) == [
        "node 1 (VflashModelLoader): unknown fast mode 'teacache'; choose from sparse-attention, step-cache (or exact)"
    ]
