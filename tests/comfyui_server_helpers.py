"""The real ComfyUI server the `tests/test_comfyui_server*.py` and browser tests drive (skipped unless
`COMFYUI_ROOT` is set): `server` (registered in conftest.py) starts it once per module through
`benchmarks/comfy_server.py`, shared with the core-vs-Vflash benchmark; the probes read its memory and build the small
core-loaders workflow."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from comfy_server import (
    API,
    PROBE,
    REPO,
    SMALL_DIT,
    Server,
    installed_pack_copies,
    write_small_family,
)

__all__ = ["API", "PROBE", "REPO", "SMALL_DIT", "Server", "installed_pack_copies", "write_small_family"]

COMFYUI_ROOT = os.environ.get("COMFYUI_ROOT")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(Path(COMFYUI_ROOT), tmp_path_factory.mktemp("comfyui-server"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def small_core_workflow(seed: int, generate: bool = False) -> dict:
    """The core-loaders template on the small 24-channel family (core's H3 latent format's channels) at 128x128: the
    Vflash sampler and decode, or with `generate` VflashGenerate (encode, sample, decode in one node, id 5)."""
    workflow = json.loads((API / "t2va_core_loaders.json").read_text())
    workflow["1"]["inputs"].update(model=SMALL_DIT, profile="t2va-base4-exact-cpu")
    workflow["2"]["inputs"]["clip_name"] = "h3_small_te.safetensors"
    workflow["3"]["inputs"]["vae_name"] = "h3_small_video_vae.safetensors"
    workflow["12"]["inputs"]["vae_name"] = "h3_small_audio_vae.safetensors"
    workflow["4"]["inputs"].update(width=128, height=128)
    workflow["5"]["inputs"]["seed"] = seed
    workflow["7"]["inputs"]["filename_prefix"] = "video/previews"
    if generate:
        request = {k: workflow["4"]["inputs"][k] for k in ("prompt", "width", "height", "length", "seconds", "te", "vae", "audio_vae")}
        workflow["5"] = {"class_type": "VflashGenerate", "inputs": {"model": ["1", 0], **request, "seed": seed, "force_offload": False}}
        workflow["7"]["inputs"]["video"] = ["5", 0]
        del workflow["4"], workflow["6"]
    return workflow


def server_memory(server) -> dict:
    """The probe's reading (`comfy_standins/server_memory_probe`): core's entries now, the snapshots taken during runs,
    the pack's registry and every engine it has seen."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/vflash_test/memory") as r:
        return json.loads(r.read())


def vflash_entries(entries: list[dict]) -> dict[str, dict]:
    """The pack's engines among core's loaded-model entries, by kind."""
    return {e["vflash_kind"]: e for e in entries if e["patcher"] == "EnginePatcher"}
