"""What a live preview costs per evaluation at the released canvases, on one H200, against the evaluation it follows.

    python benchmarks/preview.py [--repeat 50]
    python benchmarks/preview.py --small      # dry run on the CPU

A preview after an evaluation (`NativeEngineSession.generate(preview=...)`, as the ComfyUI nodes draw it) does, on the
denoiser's device: the x0 prediction of the video rows (`schedule.flow_denoised`, fp32), their unpatchify into
(1, C, F, h, w) latents (`layout.unpatchify`, as `Denoiser.video_latents` calls it), the strip of 4 latent frames
(`progress.preview_strip`), then the image: with ComfyUI's latent2rgb method a 24 -> 3 linear map per latent pixel with
its bias, mapped from [-1, 1] to 8 bits (computed here the same way, with random factors of core's shapes; the values do
not change the time), copied to the host and encoded as a JPEG (PIL), which the server sends. All of it is timed from a
synchronised device to the JPEG's bytes, on the rows of a real 5 s t2va request of each canvas (`_common.request`), and
compared with the evaluation it follows: `evaluation_ms` is 50 blocks at the per-block device time a warm 1344x768
request measured inside its own denoise (`end_to_end_h200.json`, `denoise_overhead.per_block_ms`), and for 960x544 the
forward benchmark's per-block time times the same in-request slowdown. `overhead` = preview / evaluation. The host
already waits for each evaluation to end when a front end reports progress, so a preview adds no synchronisation.

Writes benchmarks/results/preview_h200.json (--small: preview_small_cpu.json).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, environment, request, write_result

from vflash_core.engine.config import H3Config
from vflash_core.engine.layout import unpatchify
from vflash_core.progress import preview_strip
from vflash_core.schedule import flow_denoised

CANVASES = ("1344x768", "960x544")
RESULTS = ROOT / "benchmarks" / "results"


def preview_jpeg(rows: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor, config: H3Config, geometry,
                 factors: torch.Tensor, bias: torch.Tensor) -> bytes:
    """One preview, from an evaluation's velocity of the generated video rows to the JPEG's bytes."""
    x0 = flow_denoised(velocity.float(), timestep, rows)
    video = unpatchify(x0, config.in_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width,
                       config.patch_size)
    strip = preview_strip(video)[0, :, 0]  # (C, h, k w)
    rgb = torch.nn.functional.linear(strip.movedim(0, -1), factors, bias)
    pixels = ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).to(torch.uint8).cpu().numpy()
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


def evaluation_ms(canvas: str, blocks: int) -> tuple[float | None, str]:
    """The evaluation a preview follows, in ms, and where the figure comes from (module docstring)."""
    e2e = json.loads((RESULTS / "end_to_end_h200.json").read_text())
    measured = e2e["phases"].get("vflash_resident", {}).get("denoise_overhead")
    forward = {s["name"]: s for s in json.loads((RESULTS / "forward_h200.json").read_text())["shapes"]}
    if measured is None:
        return None, "no in-request per-block time in end_to_end_h200.json"
    if canvas == measured["canvas"]:
        return blocks * measured["per_block_ms"], f"end_to_end_h200.json at {e2e['commit'][:7]}: in-request per-block time"
    slowdown = measured["per_block_ms"] / forward[measured["canvas"]]["vflash_ms_per_block"]
    return (blocks * forward[canvas]["vflash_ms_per_block"] * slowdown,
            f"forward_h200.json's per-block time x the in-request slowdown at {measured['canvas']} ({slowdown:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--small", action="store_true", help="dry run on the CPU (a few repeats; no comparison)")
    args = parser.parse_args()
    if not args.small and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --small)")
    device = torch.device("cpu" if args.small else "cuda:0")
    config = H3Config.preset("h3")
    g = torch.Generator().manual_seed(0)
    factors, bias = torch.randn(3, config.in_channels, generator=g).to(device), torch.randn(3, generator=g).to(device)
    records = []
    for canvas in CANVASES:
        bundle = request(config, canvas)
        generated = bundle.video_rows[bundle.layout.num_condition_video_rows :]
        rows = generated.to(device, torch.float32)
        velocity = torch.randn(rows.shape, generator=g).to(device, torch.bfloat16)
        timestep = torch.tensor(0.6, device=device)
        times = []
        for attempt in range(3 + (2 if args.small else args.repeat)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            jpeg = preview_jpeg(rows, velocity, timestep, config, bundle.geometry, factors, bias)
            if attempt >= 3:  # after warm-ups
                times.append((time.perf_counter() - start) * 1e3)
        preview_ms = statistics.median(times)
        record: dict[str, object] = {"canvas": canvas, "video_rows": int(rows.shape[0]), "latent_shape": [1, config.in_channels,
                                     bundle.geometry.num_latent_frames, bundle.geometry.latent_height, bundle.geometry.latent_width],
                                     "jpeg_bytes": len(jpeg), "preview_ms": round(preview_ms, 3), "preview_ms_max": round(max(times), 3)}
        if not args.small:
            ms, source = evaluation_ms(canvas, config.num_layers)
            record.update(evaluation_ms=None if ms is None else round(ms, 1), evaluation_source=source,
                          overhead=None if ms is None else round(preview_ms / ms, 5))
        print(record, flush=True)
        records.append(record)
    write_result("preview_small_cpu" if args.small else "preview_h200", {**environment(), "records": records, "small": args.small})


if __name__ == "__main__":
    main()
