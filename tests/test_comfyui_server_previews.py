"""Live previews with core's tiny MiniMax-H3 decoder (the "taesd" preview method and a taeh3 file) on a real server.

The taeh3 file is a random-weight one in core's layout, written at test time by core's own `TAEHV` class in the
server's Python (`comfy_core_probe/taeh3.py`) into the server's `vae_approx` folder, where core's previewer looks for
it each time a sampler starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from comfyui_server_helpers import COMFYUI_ROOT, PROBE, server_memory, small_core_workflow, vflash_entries
from PIL import Image

pytestmark = pytest.mark.skipif(
    not COMFYUI_ROOT, reason="set COMFYUI_ROOT to a ComfyUI checkout to run the real-server tests"
)

LATENT_STRIP = (32, 8)  # (width, height) of the 4-frame strip at the 128x128 canvas: 8x8 latents, 16x downscale
MISSING = "could not find models/vae_approx/taeh3"  # core's warning when the taesd method finds no taeh3 file
TAEHV_LOADED = "Requested to load TAEHV"  # core's line when the previewer's tiny decoder is loaded


def _write_taeh3(models: Path) -> Path:
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run(
        [python, str(PROBE / "taeh3.py"), str(models)],
        cwd=COMFYUI_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.split()[-1])


def _detail(image: Image.Image) -> float:
    """Mean absolute difference (0..255) between the image and the image the server would send for one colour per
    latent pixel of the strip: the preview sampled at each latent pixel's centre (the mean of the 2x2 pixels there),
    scaled back up as the server scales a preview (bilinear). Latent2rgb draws one colour per latent pixel, so it
    comes back but for the JPEG's error; the tiny decoder draws 16x16 pixels of its own per latent pixel."""
    grey = np.asarray(image.convert("L"), dtype=np.float64)
    step = image.width // LATENT_STRIP[0]
    mid = step // 2
    centres = sum(grey[mid - dy::step, mid - dx::step] for dy in (0, 1) for dx in (0, 1))
    coarse = Image.fromarray((centres / 4).round().astype(np.uint8)).resize(image.size, Image.Resampling.BILINEAR)
    return float(np.abs(grey - np.asarray(coarse, dtype=np.float64)).mean())


def _run(srv, method: str, tmp_path: Path) -> tuple[list[Image.Image], bytes, str]:
    """(the previews, the MP4's bytes, the server's log lines of this run) of the small core-loaders workflow."""
    log = srv.work / "server.log"
    srv.log.flush()
    start = log.stat().st_size
    result = asyncio.run(srv.run_prompt(small_core_workflow(31), extra_data={"preview_method": method}))
    assert result["status"] == "success", f"{result}\n{srv.tail()}"
    progress = [e["data"] for e in result["events"] if e["type"] == "progress"]
    steps = [p["value"] for p in progress if p.get("node") == "5" and p["max"] == 4]
    assert steps == [1, 2, 3, 4]
    assert all(kind == 1 and image_type == 1 for kind, image_type, _ in result["previews"])
    images = [Image.open(BytesIO(jpeg)) for _, _, jpeg in result["previews"]]
    assert all(image.format == "JPEG" for image in images)
    dest = tmp_path / method
    dest.mkdir(parents=True, exist_ok=True)
    (mp4,) = srv.history_files(result["prompt_id"], dest)
    srv.log.flush()
    with open(log, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace")
    return images, mp4.read_bytes(), lines


def test_taeh3_previews_one_per_evaluation_and_the_same_video(server, tmp_path):
    """With a taeh3 file in vae_approx and the prompt's preview method "taesd", the Vflash sampler's four evaluations
    send four JPEG previews drawn by core's tiny decoder (`TAEHVPreviewerImpl`): core loads the TAEHV model, and each
    preview holds detail finer than the latent grid, where latent2rgb's previews of the same run have none. The server
    scales every preview to fit 512x512, so both methods' previews are 512x128 (the 4:1 strip); the decoder's own
    image is 16x the strip (512x128 at this canvas), latent2rgb's the strip itself (32x8). The MP4 is byte for byte
    the latent2rgb run's: a preview leaves the latents alone. Without the file, "taesd" falls back to latent2rgb
    (core says it found no taeh3 file)."""
    path = _write_taeh3(server.work / "models")
    assert path.parent == server.work / "models" / "vae_approx" and path.stat().st_size < 100e6
    try:
        plain, plain_mp4, plain_log = _run(server, "latent2rgb", tmp_path)
        tiny, tiny_mp4, tiny_log = _run(server, "taesd", tmp_path)
    finally:
        path.unlink()
    assert len(plain) == len(tiny) == 4
    assert {image.size for image in plain} == {image.size for image in tiny} == {(512, 128)}
    assert TAEHV_LOADED not in plain_log and TAEHV_LOADED in tiny_log and MISSING not in tiny_log, tiny_log
    plain_detail, tiny_detail = [_detail(i) for i in plain], [_detail(i) for i in tiny]
    assert max(plain_detail) < 5.0 and min(tiny_detail) > 15.0, (plain_detail, tiny_detail)
    assert tiny_mp4 == plain_mp4

    fallback, fallback_mp4, fallback_log = _run(server, "taesd", tmp_path)
    assert MISSING in fallback_log and TAEHV_LOADED not in fallback_log
    assert len(fallback) == 4 and max(_detail(i) for i in fallback) < 5.0
    assert fallback_mp4 == plain_mp4


def _post(srv, route: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(srv.url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        return json.loads(r.read())


def test_a_preview_decoder_that_evicts_everything_leaves_the_sampling_engine_alone(server, tmp_path):
    """Core loads the tiny preview decoder with `load_models_gpu`, whose `free_memory` protects only that decoder: on a
    GPU with no room left it evicts every other model. Forced here (the probe makes each such load evict everything
    first): the running transformer session is off core's list for the sampling, so the four previews arrive, the run
    succeeds with the MP4 of a run without the evictions, and the session is the same one after it, listed again."""
    path = _write_taeh3(server.work / "models")
    try:
        _, plain_mp4, _ = _run(server, "taesd", tmp_path)
        before = server_memory(server)
        session = next(e["id"] for e in before["engines"] if e["kind"] == "dit" and not e["closed"])
        _post(server, "/vflash_test/evict_on_preview_load", {"on": True})
        try:
            tiny, tiny_mp4, _ = _run(server, "taesd", tmp_path / "evicting")
        finally:
            _post(server, "/vflash_test/evict_on_preview_load", {"on": False})
    finally:
        path.unlink()
    after = server_memory(server)
    assert after["forced_evictions"] - before["forced_evictions"] == 4 and len(tiny) == 4
    assert tiny_mp4 == plain_mp4
    assert [e["id"] for e in after["engines"] if e["kind"] == "dit" and not e["closed"]] == [session]
    assert "dit" in after["vflash"] and "dit" in vflash_entries(after["now"])

