"""Render benchmarks/README.md from the committed result files.

    python benchmarks/report.py

Each table is generated from `benchmarks/results/*.json`; the prose around them states how they were measured. Run
it after fetching new results so the README never disagrees with the JSON. docs/engine.md's "what fits where" table
(between its `what-fits-where` markers) is filled from `memory_caps_h200.json` too, its FP8 figures (between its
`fp8-figures` markers) from `fp8_h200.json`, its host-memory table (between its `host-memory` markers) from
`host_memory_h200.json`, and its fast-mode figures (between its `fast-mode-figures` markers) from the fast-mode results.
The core-vs-Vflash table (`vs-comfy-core` markers of README.md and docs/comfyui.md) comes from the newest measured
`vs_comfy_core_*.json`; a CPU dry run (`"tiny": true`) never renders.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OUT = Path(__file__).resolve().parent / "README.md"
ENGINE_DOC = Path(__file__).resolve().parent.parent / "docs" / "engine.md"  # holds the marked sections
FITS_START, FITS_END = "<!-- what-fits-where: filled by benchmarks/report.py -->", "<!-- /what-fits-where -->"
FP8_START, FP8_END = "<!-- fp8-figures: filled by benchmarks/report.py -->", "<!-- /fp8-figures -->"
HOST_START, HOST_END = "<!-- host-memory: filled by benchmarks/report.py -->", "<!-- /host-memory -->"
FAST_START, FAST_END = "<!-- fast-mode-figures: filled by benchmarks/report.py -->", "<!-- /fast-mode-figures -->"
LORA_START, LORA_END = "<!-- lora-figures: filled by benchmarks/report.py -->", "<!-- /lora-figures -->"
CORE_START, CORE_END = "<!-- vs-comfy-core: filled by benchmarks/report.py -->", "<!-- /vs-comfy-core -->"
README = ENGINE_DOC.parent.parent / "README.md"  # holds the core-vs-Vflash summary (`vs_core_brief`)
CORE_DOC = ENGINE_DOC.parent / "comfyui.md"  # holds the whole core-vs-Vflash table


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "|".join("---:" if i else "---" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(_fmt(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 0.01 and value else f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)


def _source(data: dict) -> str:
    return f"{data['gpu']}, torch {data['torch']}, commit `{data['commit'][:10]}`"


def _gb(value: object) -> str:
    return "" if not value else f"{value / 1e9:.1f} GB"


def _gib(value: object) -> str:
    return "" if not value else f"{value / 2**30:.1f} GiB"


def _size(n: int) -> str:
    """GiB, zero included (`_gib` leaves zero out)."""
    return f"{n / 2**30:.1f} GiB"


def _end_to_end(data: dict, title: str) -> list[str]:
    """A full-size run: staging, first use, loading, warm requests per configuration, stages against diffusers."""
    phases = data["phases"]
    first, disk, io = phases.get("first_use", {}), phases.get("disk", {}), phases.get("weight_io", {})
    disk_rates = disk.get("disk", disk)  # runs before the staging plan recorded the disk and the tmpfs apart
    # Requests a --skip carried from an earlier run of the same benchmark name the commit they were measured at.
    carried = {(r["side"], r["config"], r["canvas"]): r["measured_at_commit"] for r in data.get("requests", []) if r.get("measured_at_commit")}
    rows = []
    for m in data.get("summary", []):
        at = carried.get((m["side"], m["config"], m["canvas"]))
        rows.append({
            "config": (f"{m['side']} {m['config']}" if m["side"] == "vflash" else "diffusers") + (f" (at `{at[:7]}`)" if at else ""),
            "canvas": m["canvas"], "n": m["warm_requests"],
            "elapsed": m["elapsed_seconds"], **{k: m["stages"][k] for k in ("text_encode", "denoise", "video_decode", "audio_decode", "mp4")},
            "speedup": m.get("speedup_elapsed_vs_diffusers"), "denoise_speedup": (m.get("stage_speedup_vs_diffusers") or {}).get("denoise"),
            "peak": _gb(max(m["peak_device_bytes"].values())), "rss": _gb(m["host_rss_peak_bytes"]), "pinned": _gib(m.get("host_pinned_bytes")),
            "in_use": _gib(m.get("host_in_use_peak_bytes")),
        })
    skipped = {name: phase["skipped"] for name, phase in phases.items() if "skipped" in phase}
    gpus = data["setup"].get("gpus")
    bitwise = phases.get("bitwise", {})
    out = [
        f"## {title}",
        "",
        _source(data) + (f", {gpus} GPUs" if gpus and gpus > 1 else ", one GPU") + ". The released shapes with random weights "
        f"(`benchmarks/full_family.py`): a {_gb(first.get('source_bytes'))} transformer source with the Turbo4 LoRA, a Qwen3-VL-32B-shaped "
        f"text encoder ({_gb(phases.get('family_rest', {}).get('text', {}).get('bytes') or phases.get('family_rest', {}).get('bytes', {}).get('text_encoder'))}"
        f"{'; only the layers H3 reads are written' if data['setup'].get('text_encoder', {}).get('written') else ''}), both released VAEs. "
        f"Profile `{data['setup']['profile']}`, t2va, 5 s.",
        "",
    ]
    if data.get("staging"):
        st = data["staging"]
        out += [f"Staging (one machine: {_size(st['disk_free'])} of disk, a {_size(st['shm_free'])} tmpfs in {_size(st['host_bytes'])} of host memory): "
                + "; ".join(f"{step['step']} (disk {_size(step['disk_after'])}, tmpfs {_size(step['shm_after'])})" for step in st["steps"]) + ".", ""]
    out += [
        f"Disk: {disk_rates.get('write_bandwidth_gbps')} GB/s sequential write, {disk_rates.get('read_bandwidth_gbps')} GB/s read"
        + (f"; tmpfs {disk['tmpfs']['read_bandwidth_gbps']} GB/s read" if disk.get("tmpfs") else "")
        + f". First use of the {_gb(first.get('source_bytes'))} source: prepare {first.get('prepare_seconds')} s (hashes every byte), compile "
        f"{first.get('compile_seconds')} s (writes {_gb(first.get('artifact_bytes'))}), together {first.get('first_use_over_one_read')}x the time "
        f"to read the source once at the disk's bandwidth ({first.get('source_read_seconds_at_disk_bandwidth')} s)"
        + (f"; the source sat in the tmpfs ({first.get('source_read_seconds_at_tmpfs_bandwidth')} s to read there) and writing the compile "
           f"at the disk's bandwidth takes {first.get('artifact_write_seconds_at_disk_bandwidth')} s" if first.get("source_read_seconds_at_tmpfs_bandwidth") else "")
        + f". Pipeline load from a dropped page cache: {(data.get('initialization_seconds') or {}).get('cold_page_cache')} s.",
        "",
    ]
    if bitwise.get("bitwise_equal_to_diffusers") is not None:
        out += [(f"Bitwise: Vflash's final latents of the {bitwise['canvas']} request ({bitwise.get('vflash_attention_backend')} attention) against "
                 f"diffusers' core denoise step on the same prompt embeddings and seed ({bitwise.get('diffusers_attention')}): "
                 f"**{'equal' if bitwise['bitwise_equal_to_diffusers'] else 'different'}** (max abs difference video "
                 f"{bitwise.get('video_max_abs_diff')}, audio {bitwise.get('audio_max_abs_diff')})."), ""]
    reference = data.get("diffusers_reference")
    out += [
        "Warm requests, median seconds (`n` warm requests after a first one); `speedup` is diffusers / Vflash end to end"
        + (f" (diffusers from `{reference['file']}`, commit `{reference['commit'][:10]}`: {reference['note']})" if reference else "") + ":",
        "",
        _table(rows, [("config", "side, configuration"), ("canvas", "canvas"), ("n", "n"), ("elapsed", "elapsed s"), ("text_encode", "text encode"),
                      ("denoise", "denoise"), ("video_decode", "video decode"), ("audio_decode", "audio decode"), ("mp4", "MP4"), ("speedup", "speedup"),
                      ("denoise_speedup", "denoise speedup"), ("peak", "peak device"), ("rss", "host RSS peak"), ("pinned", "host pinned"),
                      ("in_use", "host in use (machine)")]),
        "",
        ("`vflash resident`: the text encoder, VAEs and all 50 blocks stay on the GPU; `encoder_offload` (the default): the text encoder "
         "and the VAEs come to the GPU for their stage only; `block_ring`: the blocks stream from pinned host memory through two device "
         "slots. Host in use counts the whole machine (the staged tmpfs files included)."),
        "",
    ]
    if io and "skipped" not in io:
        out += [
            f"Cold reads of compiled block files ({_gb(io.get('sample_bytes'))}): `SequentialWeights` with 1/2/4/8 threads "
            + " / ".join(str(v) for v in io.get("sequential_weights_gbps_by_workers", {}).values()) + " GB/s.",
            "",
        ]
    if skipped:
        out += ["Not measured in this run: " + "; ".join(f"`{name}` ({why})" for name, why in skipped.items()) + ".", ""]
    failed = {name: phase["error"] for name, phase in phases.items() if "error" in phase}
    if failed:
        out += ["Failed in this run: " + "; ".join(f"`{name}` ({why})" for name, why in failed.items()) + ".", ""]
    if data.get("code_note"):
        out += [f"How this file was measured: {data['code_note']}", ""]
    for name, why in (data.get("not_measured") or {}).items():
        out += [f"Not measured: {name}: {why}.", ""]
    return out


def _cell(record: dict | None) -> str:
    """One run: peak device memory and seconds, whether it equals the uncapped run, or why it did not complete."""
    if record is None:
        return "not run"
    if not record["completed"]:
        return "out of memory" if record["error"].startswith("OutOfMemoryError") else "refused by the plan"
    same = {True: ", bitwise", False: ", differs", None: ""}[record["bitwise_equal_to_uncapped"]]
    return f"{record['peak_device_bytes'] / 2**30:.1f} GiB, {record['elapsed_seconds']:.1f} s{same}"


def _uncapped_request(e2e: dict | None, canvas: str) -> dict | None:
    """end_to_end.py's warm resident request at `canvas` (the uncapped row of the what-fits table)."""
    if not e2e:
        return None
    return next((m for m in e2e.get("summary", []) if m["side"] == "vflash" and m["config"] == "resident" and m["canvas"] == canvas), None)


def _planned_decoder(e2e: dict, canvas: str) -> str:
    """", <decoder> decode" as the resident requests' memory plan at `canvas` names it, or "" where none does."""
    plans = [r.get("memory_plan") or "" for r in e2e.get("requests", []) if r.get("config") == "resident" and r["canvas"] == canvas]
    found = next((m.group(1) for m in map(re.compile(r"video decode (\w+)").search, plans) if m), None)
    return f", {found} decode" if found else ""


def what_fits(data: dict, e2e: dict | None = None) -> str:
    """What a card of each size runs: the plan's choice, the host memory it needs, seconds per request; then each
    stage alone per cap (and the uncapped twin)."""
    caps = [None, *data["setup"]["caps_gib"]]
    canvas = data["setup"]["canvas"]
    fits = []
    uncapped = _uncapped_request(e2e, canvas)
    if uncapped:
        # the resident requests' own commit: a phase carried from an earlier run keeps the commit it was measured at
        measured = next((r["measured_at_commit"] for r in e2e.get("requests", []) if r.get("config") == "resident"
                         and r["canvas"] == canvas and r.get("measured_at_commit")), e2e.get("commit", ""))
        at = measured[:7] if not data.get("commit", "").startswith(measured[:7]) else ""
        fits.append({"card": "141 GB (H200, uncapped)" + (f", at `{at}`" if at else ""),
                     "plan": "core resident, text encoder resident, VAEs resident" + _planned_decoder(e2e, canvas), "host": _gib(uncapped.get("host_pinned_bytes")) or "0",
                     "rss": _gib(uncapped["host_rss_peak_bytes"]), "seconds": uncapped["elapsed_seconds"], "same": "(the reference)"})
    for r in data["records"]:
        if r["stage"] != "end_to_end" or r["cap_gib"] is None:
            continue
        p = r.get("placement") or {}
        fits.append({
            "card": f"{r['cap_gib']:g} GiB", "plan": f"core {p.get('core')}, text encoder {p.get('encoder')}, VAEs {p.get('vaes')}, {p.get('video_decoder')} decode" if p else "",
            "host": _gib(r.get("host_pinned_bytes")) or "0", "rss": _gib(r.get("host_rss_peak_bytes")),
            "seconds": r["elapsed_seconds"] if r["completed"] else _cell(r), "same": {True: "yes", False: "no", None: ""}[r["bitwise_equal_to_uncapped"]],
        })
    names = {"encode": "text encode", "denoise_evaluation": "one denoise evaluation (50 blocks)", "decode": "video + audio decode", "end_to_end": "t2va Turbo4 to MP4"}
    rows: dict[tuple, dict] = {}
    for r in data["records"]:
        key = (r["stage"], r.get("mode"), r["canvas"], r["seconds"])
        label = " ".join(str(v) for v in (names[r["stage"]], r.get("mode"), r["canvas"], r["seconds"] and f"{r['seconds']:g} s") if v)
        rows.setdefault(key, {"what": label})[str(r["cap_gib"])] = _cell(r)
    columns = [("what", "stage")] + [(str(c), "uncapped (H200)" if c is None else f"cap {c:g} GiB") for c in caps]
    differs = [f"{r['cap_gib']:g} GiB" for r in data["records"] if r["stage"] == "end_to_end" and r["bitwise_equal_to_uncapped"] is False]
    skipped = [name for name, phase in data["phases"].items() if "skipped" in phase]
    return "\n".join([
        (f"Measured at full size on one H200 ({_source(data)}) with random weights: the card's memory is a device memory cap the plan places "
         f"the parts under and PyTorch's allocator enforces (`max_device_memory`). One t2va Turbo4 request, {canvas}, 5 s, to an MP4; "
         "`host pinned` is the page-locked host memory the placement holds (the peak of PyTorch's host allocator, whose blocks are rounded "
         "up to powers of two), `host RSS` the process's peak resident memory (pinned memory and the memory-mapped weight files included). "
         "A machine needs its host memory to hold the pinned bytes, the process and the files' page cache; `same MP4` compares the bytes "
         "with the uncapped request's."),
        "",
        _table(fits, [("card", "device memory"), ("plan", "what the plan chooses"), ("host", "host pinned"), ("rss", "host RSS peak"),
                      ("seconds", "seconds per request"), ("same", "same MP4")]),
        "",
        *([f"**Not exact under a cap in this run**: the MP4 under {', '.join(differs)} differs from the uncapped one's (the capped ones "
           "equal each other)" + (f"; {data['finding']}." if data.get("finding") else
                                  "; the stage-by-stage digests of a run show which stage differs (`stage_bitwise_equal_to_uncapped`)."), ""]
          if differs else []),
        *([f"Not measured in this run: {', '.join(skipped)}.", ""] if skipped else []),
        *([f"How this file was measured: {data['code_note']}", ""] if data.get("code_note") else []),
        ("Each stage alone, peak device memory allocated with its weights and seconds, compared bit for bit with the uncapped run "
         "(`benchmarks/memory_caps.py`; the denoise evaluation's plan is sized for a 15 s request, the Base16 profile's longest):"),
        "",
        _table(list(rows.values()), columns),
        "",
    ])


def fp8_figures(data: dict) -> str:
    """Exact vs the approximate FP8 executions per canvas: ms per block, speedups, and the error of each."""
    rows = []
    for r in data["records"]:
        ms, error = r["ms_per_block"], r["error"]
        carried = f" (at `{r['measured_at_commit'][:7]}`)" if r.get("measured_at_commit") else ""
        row = {"canvas": r["canvas"] + carried, "N": r["N"], "exact": ms["exact"], "fp8_linear": ms["fp8_linear"], "speedup_linear": r["speedup_fp8_linear"],
               "fp8_both": ms.get("fp8_linear_attention"), "speedup_both": r["speedup_fp8_linear_attention"],
               "fp8_scaled": ms.get("fp8_scaled_linear"), "speedup_scaled": r.get("speedup_fp8_scaled_linear")}
        for name, key in (("fp8_linear", "linear"), ("fp8_linear_attention", "both"), ("fp8_scaled_linear", "scaled")):
            if name in error:
                row[f"rel_l2_{key}"] = max(e["video_velocity_rel_l2"] for e in error[name]["per_evaluation"])
                row[f"psnr_{key}"] = error[name]["latent_psnr_db"]
        rows.append(row)
    targets = "; ".join(f"{k} {t['bound']}{' at ' + t['canvas'] if t.get('canvas') else ''}: {t['value']} ({'met' if t['met'] else 'not met'})" for k, t in data["targets"].items())
    skipped = "".join(f" FP8 attention not measured: {reason}." for reason in data["attention"]["skipped"].values())
    return "\n".join([
        f"Measured by `benchmarks/fp8.py` ({_source(data)}) on the full-width random model, {data['evaluations']}-evaluation trajectories "
        f"(`{data['profiles']['exact']}` vs `{data['profiles']['fp8']}`, {data['fp8_execution']}). Velocity error: the largest relative L2 "
        "over the evaluations, each FP8 evaluation on the exact trajectory's inputs; PSNR: final video latents of each whole trajectory "
        f"against the exact one. Weights on the device: {data['fp8_block_fraction']:.1%} of BF16 per block, {data['fp8_weight_fraction']:.1%} for "
        f"the 50-block model with its BF16 auxiliary tensors.{skipped} Targets: {targets}."
        + (" From an fp8_scaled file: the FP8 artifact compiled from a Comfy-Org fp8_scaled single file of the same weights (its own "
           "E4M3 codes and per-tensor scales kept), the FP8 linear execution." if any(r.get("fp8_scaled") for r in rows) else ""),
        "",
        _table(rows, [("canvas", "canvas (5 s)"), ("N", "N"), ("exact", "exact ms/block"), ("fp8_linear", "FP8 linear ms/block"), ("speedup_linear", "speedup"),
                      ("rel_l2_linear", "velocity rel L2"), ("psnr_linear", "latent PSNR dB"), ("fp8_both", "FP8 linear + attention ms/block"),
                      ("speedup_both", "speedup"), ("rel_l2_both", "velocity rel L2"), ("psnr_both", "latent PSNR dB"),
                      *([("fp8_scaled", "from an fp8_scaled file ms/block"), ("speedup_scaled", "speedup"), ("rel_l2_scaled", "velocity rel L2"),
                         ("psnr_scaled", "latent PSNR dB")] if any(r.get("fp8_scaled") for r in rows) else [])]),
        "",
        *([f"How this file was measured: {data['code_note']}", ""] if data.get("code_note") else []),
    ])


def vae_section(data: dict | None) -> list[str]:
    """diffusers vs Vflash video decode per canvas and duration, with the two-GPU split and the audio decode's share;
    "not measured yet" without a result file."""
    out = ["## Video and audio decode (`benchmarks/vae.py`)", ""]
    if data is None:
        return out + [("Not measured yet: `benchmarks/results/vae_h200.json` comes from `python benchmarks/vae.py` on an H200 (two for the "
                       "two-GPU column)."), ""]
    rows = [{**r, "diffusers_peak": _gb(r["peak_device_bytes"]["diffusers"]), "vflash_peak": _gb(r["peak_device_bytes"]["vflash"]),
             "fused_peak": _gb(r.get("native_fused_peak_device_bytes")), "fused_working": _gb(r.get("native_fused_working_bytes")),
             "estimate": _gb(r.get("native_decode_bytes_estimate")),
             "canvas": r["canvas"] + (f" (at `{r['measured_at_commit'][:7]}`)" if r.get("measured_at_commit") else ""),
             "audio_share": None if r.get("audio_share_of_decode") is None else f"{r['audio_share_of_decode']:.1%}"} for r in data["records"]]
    first = data["records"][0] if data["records"] else {}
    return out + [
        _source(data) + f", {data['dtype']}. "
        + ("The demo family's video VAE on the CPU (a dry run)" if data.get("small") else "The released video VAE with random weights")
        + "; both sides decode the same latents, wall seconds "
        f"around the whole decode (medians). Vflash: `NativeVideoDecoder`, {first.get('windows_per_call')} tile-windows per ViT call, "
        f"{first.get('attention_backend')} attention, its norms and elementwise work as torch ops (`decoder_execution=\"reference\"`) and "
        "fused in Triton (`\"fused\"`, the default on CUDA); bitwise: its pixels equal diffusers' `decode`. Peak device memory includes the resident "
        "VAEs (above the VAEs: the fused peak less what was allocated before the decodes; the plan's estimate: `vae.decode_bytes`, which "
        "the memory plan reserves for it). Roofline: the decoder's GEMM and attention FLOPs at this GPU's sustained rates. Two GPUs: the calls split in halves over two "
        "GPUs (replica of the weights included in the time), speedup over one GPU. Audio: the audio VAE's decode of the same duration and "
        "its share of the decode (audio / (audio + Vflash video)).",
        "",
        _table(rows, [("canvas", "canvas"), ("seconds", "clip s"), ("diffusers_seconds", "diffusers s"),
                      ("native_fused_seconds", "Vflash fused s"), ("native_fused_speedup_vs_diffusers", "fused speedup"),
                      ("native_fused_roofline_ratio", "fused / roofline"), ("native_fused_bitwise_equal_to_diffusers", "fused bitwise"),
                      ("native_fused_windows_per_call", "fused tile-windows per call"), ("fused_peak", "fused peak"),
                      ("fused_working", "fused above the VAEs"), ("estimate", "plan's estimate"), ("vflash_seconds", "Vflash reference s"),
                      ("speedup_vs_diffusers", "reference speedup"), ("diffusers_peak", "diffusers peak"), ("vflash_peak", "reference peak"),
                      ("bitwise_equal_to_diffusers", "reference bitwise"), ("roofline_ratio", "reference / roofline"), ("two_gpu_speedup", "two-GPU speedup"),
                      ("two_gpu_bitwise_equal", "two GPUs bitwise to one"), ("audio_decode_seconds", "audio s"), ("audio_share", "audio share")]),
        "",
    ]


def delivery_section(data: dict | None) -> list[str]:
    """Decode + MP4 after the last latent, serial against streamed, per canvas, duration and clip."""
    out = ["## Decode + MP4: serial vs streamed (`benchmarks/delivery.py`)", ""]
    if data is None:
        return out + ["Not measured yet: `benchmarks/results/delivery_h200.json` comes from `python benchmarks/delivery.py` on an H200.", ""]
    rows = []
    for r in data["records"]:
        rows.append({**r, **{f"{path}_{key}": r[path][key] for path in ("serial", "streaming") for key in r[path]}})
    return out + [
        _source(data) + f", {data['dtype']}, the `{data['video_decoder']}` video decoder. From the last latent to the MP4 published: "
        "`serial` decodes the video and the audio, then writes the MP4 (`media_video_input=\"file\"`); `streaming` hands each decoded part "
        "to the MP4 stream's encoder thread while the decoder goes on (`\"stream\"`). `noise` is what the random-weight decoder makes "
        "(x264's worst case); `natural` a pan over photographs in the decoded frames' place. Tail: last video frame decoded to the MP4 "
        "published. Same input: both paths handed the encoder the same frames and soundtrack.",
        "",
        _table(rows, [("canvas", "canvas"), ("seconds", "clip s"), ("source", "clip"), ("serial_delivery_seconds", "serial s"),
                      ("streaming_delivery_seconds", "streamed s"), ("delivery_speedup", "speedup"), ("serial_mp4_tail_seconds", "serial tail s"),
                      ("streaming_mp4_tail_seconds", "streamed tail s"), ("streaming_decode_seconds", "streamed decode s"),
                      ("same_encoder_input", "same input"), ("same_mp4_bytes", "same MP4 bytes"), ("bitwise_equal_to_diffusers", "decode bitwise")]),
        "",
        *([f"How this file was measured: {data['code_note']}", ""] if data.get("code_note") else []),
    ]


def host_memory_table(data: dict) -> str:
    """The core under host-memory budgets and device caps: placement, host peaks, request time, bitwise; the projection."""
    resident = data["resident"]
    rows = [{"budget": "none (resident)", "cap": "none", **resident, "rss": _gib(resident["host_rss_peak_bytes"]), "pinned": _size(resident["host_pinned_bytes"])}]
    for r in data["records"]:
        reads = r.get("block_read_seconds")
        rows.append({**r, "budget": f"{r['host_budget_gib']:g} GiB", "cap": f"{r['cap_gib']:g} GiB", "rss": _gib(r.get("host_rss_peak_bytes")),
                     "pinned": _size(r.get("host_pinned_bytes", 0)), "read": "" if not reads else f"{reads['median']:.2f} s ({r['block_read_gbps']:.2f} GB/s)"})
    card, here = data["projection"]["card"], data["projection"]["this_machine"]
    return "\n".join([
        (f"Measured at full size on one H200 ({_source(data)}) with random weights: the core alone (the Turbo4 artifact, "
         f"{data['block_bytes'] / 1e9:.2f} GB per block), one t2va request at {data['setup']['canvas']} 5 s (4 evaluations of 50 blocks) from a "
         "conditioning bundle, each run in its own process with the page cache dropped before it, its latents compared with the resident "
         "run's. `host RSS` is the process's peak resident memory (pinned memory included), `host pinned` the peak of PyTorch's "
         "page-locked allocator (rounded up to powers of two)."),
        "",
        _table(rows, [("budget", "host budget"), ("cap", "device cap"), ("placement", "placement"), ("rss", "host RSS"), ("pinned", "host pinned"),
                      ("load_seconds", "load s"), ("request_seconds", "request s"), ("read", "block read (median)"),
                      ("bitwise_equal_to_resident", "bitwise = resident")]),
        "",
        (f"A block computes in {data['block_compute_seconds']:.3f} s here and reads in {here['block_read_seconds']:.2f} s "
         f"({data['disk_read_gbps']:.2f} GB/s, cold reads in the same run): the disk ring is disk-bound on this machine (the model "
         f"max(compute, read) per block predicts {here['disk_ring_seconds']:.0f} s of block work; measured {here['measured_disk_ring_request_seconds']:.0f} s "
         f"for the request). Projected for a card that computes a block in {card['block_compute_seconds']} s beside a {card['drive_gbps']} GB/s drive: "
         f"reads of {card['block_read_seconds']:.2f} s per block hide behind the compute, {card['disk_ring_seconds']:.1f} s against "
         f"{card['pinned_seconds']:.1f} s of block work per request from pinned memory (+{card['overhead'] * 100:.1f} %)."),
    ])


def _by_date(prefix: str) -> list[dict]:
    """Every `<prefix>_<gpu>.json` result file (one per GPU kind), oldest first by its recorded date."""
    files = [json.loads(p.read_text()) for p in RESULTS.glob(f"{prefix}_*.json")]
    return sorted(files, key=lambda data: data.get("date", ""))


def _newest(prefix: str) -> dict | None:
    """The newest `<prefix>_<gpu>.json` result file by its recorded date."""
    files = _by_date(prefix)
    return files[-1] if files else None


def every_fast_mode_figures(files: list[dict]) -> str:
    """The fast-mode figures of each GPU kind measured, one after another: the targets hold on either."""
    return "\n".join(fast_mode_figures(data) for data in files)


def _e2e_run_by(record: dict) -> str:
    """Who timed an e2e record and what its fast side carried: records from before sessions prepared their sparse
    backend during the load paid its first-use compile inside the fast side's time."""
    if "command" not in record:
        return "`pipeline.compare` after one fast warm-up request"
    if "first-use compile" in record["warm_up"]:
        return "`vflash compare` (fast side first, with its first-use compile)"
    return "`vflash compare` (fast side first, its backend prepared during the load)"


def fast_mode_figures(data: dict) -> str:
    """The kernel, a whole evaluation and the step cache, each fast mode against exact."""
    records = [{**r, "measured_at": r.get("measured_at_commit", data["commit"])[:7]} for r in data["records"]]
    before_backends = {"backend": "vflash-block-sparse-triton"}  # records from before it was recorded: Triton
    kernel = [{**before_backends, **r} for r in records if r["phase"] == "kernel"]
    evaluation = sorted(({**before_backends, **r} for r in records if r["phase"] == "evaluation"),
                        key=lambda r: (r["seconds"], -r["density_cap"]))
    cache = [r for r in records if r["phase"] == "step_cache"]
    e2e = [{**r, **{f"{k}_{'exact' if side == 'exact' else 'fast'}": v for k in ("e2e_seconds", "denoise_seconds")
                    for side, v in r[k].items()},
            "path": _e2e_run_by(r)}
           for r in records if r["phase"] == "e2e"]
    parts = [(f"Measured by `benchmarks/fast_mode.py` ({data['gpu']}, torch {data['torch']}; the commit of each row in its "
              "last column) on full-width random weights (speed and mechanism only: random weights say nothing about quality).")]
    if kernel:
        prefix = ("each request's prefix rows (text and audio) dense" if all("prefix_rows" in r for r in kernel)
                  else "512 dense prefix rows")
        parts += ["", (f"Block-sparse attention alone against FlashAttention-3 dense, (1, N, 56, 128) bf16, {prefix}; "
                   "density: the share of the attention map computed:"), "",
                  _table(kernel, [("rows", "N"), ("prefix_rows", "prefix rows"), ("density_cap", "density asked"), ("density", "density"), ("backend", "kept blocks by"), ("fa3_dense_ms", "FA3 dense ms"),
                                  ("sparse_ms", "sparse ms"), ("triton_sparse_ms", "Triton kernel ms"), ("kernel_speedup_vs_fa3_dense", "speedup"), ("selection_ms", "selection ms"),
                                  ("kernel_speedup_with_selection", "speedup with selection"), ("kept_block_tflops", "TFLOP/s of kept blocks"),
                                  ("fa3_tflops", "FA3 TFLOP/s"), ("measured_at", "commit")])]
    if evaluation:
        parts += ["", "One whole evaluation (50 full-width layers, 44 of them sparse), exact vs `sparse-attention`:", "",
                  _table(evaluation, [("seconds", "clip s (1344x768)"), ("rows", "N"), ("density_cap", "density asked"), ("density", "density"), ("backend", "kept blocks by"), ("exact_ms", "exact ms"),
                                      ("fast_ms", "sparse ms"), ("evaluation_speedup_vs_exact", "speedup"),
                                      ("velocity_rel_l2_vs_exact", "velocity rel L2 (mechanism)"), ("measured_at", "commit")])]
    if cache:
        parts += ["", "`step-cache` on a 16-evaluation Base16 request (1344x768 5 s):", "",
                  _table(cache, [("layers", "layers"), ("threshold", "threshold"), ("evaluations_cached", "evaluations cached"),
                                 ("block_evaluation_reduction", "block evaluations, exact / cached"), ("exact_request_ms", "exact ms"),
                                 ("fast_request_ms", "step-cache ms"), ("request_speedup_vs_exact", "speedup"),
                                 ("latent_rel_l2_vs_exact", "latent rel L2 (mechanism)"), ("measured_at", "commit")])]
    if e2e:
        parts += ["", ("Prompt to decoded frames at full size on one pipeline, the MP4 encode untimed, "
                   "exact vs a fast mode; PSNR / SSIM of the decoded frames against exact (mechanism only):"), "",
                  _table(e2e, [("path", "run by"), ("profile", "profile"), ("canvas", "canvas"), ("seconds", "clip s"), ("mode", "fast mode"),
                               ("density", "density"), ("evaluations_cached", "evaluations cached"),
                               ("e2e_seconds_exact", "exact s"), ("e2e_seconds_fast", "fast s"),
                               ("e2e_speedup_vs_exact", "speedup"), ("denoise_seconds_exact", "exact denoise s"),
                               ("denoise_seconds_fast", "fast denoise s"),
                               ("frames_psnr_vs_exact_db", "frames PSNR dB"), ("frames_ssim_vs_exact", "SSIM"),
                               ("audio_log_spectral_distance_db", "audio LSD dB"), ("measured_at", "commit")])]
    targets = [line for line in (_fast_mode_target(records, *target) for target in FAST_MODE_TARGETS) if line]
    if targets:
        parts += ["", "Against the speed targets (what bounds an evaluation's speed-up under this mode: [docs/engine.md](../docs/engine.md#fast-modes-approximate-default-off)):", "",
                  *targets]
    return "\n".join(parts + [""])


#: (what, record phase, the record's fields that pick it, result key, target): the speed targets set for the fast modes.
FAST_MODE_TARGETS = (
    ("the kernel at N 38,222, density 0.25", "kernel", {"rows": 38222, "density_cap": 0.25}, "kernel_speedup_vs_fa3_dense", 3.0),
    ("the kernel at N 38,222, density 0.15", "kernel", {"rows": 38222, "density_cap": 0.15}, "kernel_speedup_vs_fa3_dense", 4.5),
    ("one evaluation at 1344x768 5 s", "evaluation", {"seconds": 5, "density_cap": 0.25}, "evaluation_speedup_vs_exact", 1.5),
    ("one evaluation at 1344x768 15 s", "evaluation", {"seconds": 15, "density_cap": 0.25}, "evaluation_speedup_vs_exact", 2.2),
    ("block evaluations of a 16-evaluation Base16 request", "step_cache", {}, "block_evaluation_reduction", 1.4),
)


def _fast_mode_target(records: list[dict], what: str, phase: str, fields: dict, key: str, target: float) -> str | None:
    """One line: the measured value of `key` against its target, met or missed by how much (None: not measured)."""
    record = next((r for r in records if r["phase"] == phase and all(r.get(k) == v for k, v in fields.items())), None)
    if record is None:
        return None
    value = record[key]
    verdict = "met" if value >= target else f"missed by {100 * (1 - value / target):.1f} %"
    return f"- {what}: {value}x against {target}x, {verdict} ({record['measured_at']})"


def service_throughput_section(data: dict) -> list[str]:
    """Requests per hour through `vflash serve`: serial against pipelined workers, one worker against two."""
    machine = data["gpu"] or data.get("machine", "CPU")
    request = data["request"]
    summary = (f"pipelined / serial {data['pipelined_speedup']}x, same MP4 bytes: {_fmt(data['same_mp4_bytes'])}"
               + (f", two workers / one {data['two_worker_speedup']}x" if data.get("two_worker_speedup") else ""))
    return [f"## Service throughput (`benchmarks/service_throughput.py`, {machine})", "",
            f"{machine}, torch {data['torch']}, commit `{data['commit'][:10]}`; {request['width']}x{request['height']} "
            f"{request['duration_seconds']} s requests"
            + (f", {data['threads_per_worker']} thread(s) per worker (torch's and the H.264 encoder's)"
               if data.get("threads_per_worker") else ", one worker on one GPU")
            + f": {summary}.", "",
            _table(data["requests_per_hour"], [("mode", "mode"), ("workers", "workers"), ("requests", "requests"),
                                               ("wall_seconds", "wall s"), ("requests_per_hour", "requests per hour"),
                                               ("gpu_busy_fraction", "GPU busy")]), ""]


def lora_figures(data: dict) -> str:
    """No LoRA, one and the stack of three, residual and merged: time per evaluation and bits against diffusers."""
    stack = ", ".join(f"{s['kind']} at {s['strength']}" for s in data["stack"])
    return "\n".join([
        (f"Measured by `benchmarks/lora.py` ({_source(data)}): {data['blocks']} full-width blocks at {data['shape']} 5 s "
         f"(N {data['N']:,}), random weights; the stack: {stack}. Bits compared with diffusers' peft adapters (residual) "
         f"and `fuse_lora` (merged), {data['bitwise_compared_with']}."), "",
        _table(data["records"], [("loras", "LoRAs"), ("mode", "mode"), ("evaluation_ms", "evaluation ms"),
                                 ("overhead_vs_no_lora", "overhead vs no LoRA"), ("overhead_per_lora", "overhead per LoRA"),
                                 ("bitwise_equal_to_diffusers", "bitwise = diffusers")]), ""])


def _vs_core_data() -> dict | None:
    """The newest measured core-vs-Vflash result (a CPU dry run, `"tiny": true`, is not a measurement)."""
    files = sorted(RESULTS.glob("vs_comfy_core_*.json"), key=lambda p: p.stat().st_mtime)
    measured = [data for data in (json.loads(p.read_text()) for p in files) if not data.get("tiny")]
    return measured[-1] if measured else None


SAMPLERS = {"SamplerCustomAdvanced", "VflashSampler"}  # each side's sampling node (`node_classes`)


def _sampling_seconds(record: dict) -> float | None:
    """The warm run's seconds in the side's sampling node (`node_seconds` by `node_classes`)."""
    nodes = [n for n, kind in record.get("node_classes", {}).items() if kind in SAMPLERS]
    seconds = (record.get("node_seconds") or {}).get(nodes[0]) if nodes else None
    return round(seconds, 1) if seconds is not None else None


def _pair(data: dict, summary: dict) -> dict[str, dict]:
    """Side ("core", "vflash") -> the record of `summary`'s pair (its cap, approximate or not)."""
    return {r["side"]: r for r in data["records"]
            if r["device_cap_gib"] == summary["device_cap_gib"] and r["approximate"] == summary["approximate"]}


def _failure(record: dict) -> str:
    error = (record.get("first_run") or {}).get("error") or {}
    return f"failed: {error.get('exception_type', '?')} in {error.get('node_type', '?')}" if error else "failed"


def vs_core_table(data: dict) -> str:
    """The same workflow, core's nodes against Vflash's, per device cap: first and warm seconds, the sampling node's
    seconds, peaks, speedup, PSNR; what the peaks count and which records came from earlier runs."""
    request = data["request"]
    rows = []
    for summary in data["summaries"]:
        pair = _pair(data, summary)
        cap = "resident" if summary["device_cap_gib"] is None else f"{summary['device_cap_gib']} GiB cap"
        for side in ("core", "vflash"):
            r = pair.get(side) or {}
            ok = r.get("status") == "success"
            rows.append({"row": f"{cap}{', ' + r.get('mode', '') if summary['approximate'] else ''}", "side": side,
                         "first": (r.get("first_run") or {}).get("workflow_seconds"), "warm": r.get("workflow_seconds"),
                         "sampling": _sampling_seconds(r) if ok else None,
                         "device": _gib(r.get("peak_device_bytes")) + (" †" if r.get("within_device_cap") is False else ""),
                         "rss": _gib(r.get("host_rss_peak_bytes")),
                         "pinned": _size(r.get("host_pinned_bytes") or 0) if ok else "",
                         "status": "ok" if ok else _failure(r) if r else "not run",
                         "speedup": summary["speedup_vflash_vs_core"] if side == "vflash" else None,
                         "psnr": summary["frames_psnr_core_vs_vflash_db"] if side == "vflash" else None})
    notes = []
    over = sorted({f"{r['device_cap_gib']} GiB" for r in data["records"] if r.get("within_device_cap") is False})
    if over:
        notes.append(f"† above the cap ({', '.join(over)}): the driver's count of the server's device memory includes "
                     "its CUDA context and the libraries' workspaces, which neither PyTorch's allocator limit nor "
                     "core's `--reserve-vram` accounting covers.")
    notes.append("Host pinned: the larger of core's registered host memory and PyTorch's page-locked allocator, "
                 "each a peak of its own; host RSS is all of the server process's resident memory.")
    if any(r["side"] == "vflash" and r.get("compiled_before_first_run") is False for r in data["records"]):
        notes.append("Vflash's first run in the first Vflash server includes compiling the transformer file for the "
                     "profile (once per file and profile; later servers load the compile).")
    commits = {str(r.get("commit", data["commit"]))[:10] for r in data["records"]}
    if len(commits) > 1:
        notes.append(f"Rows kept from earlier runs on the same files: the records were measured at {', '.join(sorted(commits))}.")
    return "\n".join([
        (f"The same workflow, core vs Vflash, on this card ({data['date']}; ComfyUI {data['comfyui_version']}; "
         f"{_source(data)}): t2va {request['width']}x{request['height']}, {request['length']} frames, "
         f"{request['evaluations']} evaluations, the same Comfy-Org files ({', '.join(data['files'].values())}), "
         f"measured by `benchmarks/vs_comfy_core.py`. Seconds: prompt to MP4 from the server's websocket (first run, "
         "then the best warm run, and its sampling node); peaks of the server process. The frames differ by design "
         "(other noise generators and kernels), hence PSNR."), "",
        _table(rows, [("row", "memory"), ("side", "side"), ("first", "first run s"), ("warm", "warm s"),
                      ("sampling", "sampling s"), ("device", "peak device"), ("rss", "host RSS peak"),
                      ("pinned", "host pinned"), ("status", "status"), ("speedup", "Vflash speedup"),
                      ("psnr", "PSNR core vs Vflash dB")]), "", *(f"{note}\n" for note in notes)])


def vs_core_brief(data: dict) -> str:
    """The README's summary of the core-vs-Vflash result: warm seconds and both sides' device and host RSS peaks per
    row, the whole table linked."""
    request = data["request"]
    rows = []
    for summary in data["summaries"]:
        pair = _pair(data, summary)
        core, vflash = pair.get("core") or {}, pair.get("vflash") or {}
        rows.append({
            "row": ("resident" if summary["device_cap_gib"] is None else f"{summary['device_cap_gib']} GiB card")
            + (f" ({core.get('mode')} / {vflash.get('mode')})" if summary["approximate"] else ""),
            "core": core.get("workflow_seconds") if core.get("status") == "success" else core.get("status", "not run"),
            "vflash": vflash.get("workflow_seconds") if vflash.get("status") == "success" else vflash.get("status", "not run"),
            "speedup": summary["speedup_vflash_vs_core"],
            "device": " / ".join(_gib(r.get("peak_device_bytes")).removesuffix(" GiB") for r in (core, vflash)),
            "rss": " / ".join(_gib(r.get("host_rss_peak_bytes")).removesuffix(" GiB") for r in (core, vflash))})
    gpu = str(data["gpu"]).replace("NVIDIA ", "")
    return "\n".join([
        (f"**The same ComfyUI workflow, core's H3 nodes vs Vflash's** ({gpu}, ComfyUI {data['comfyui_version']}, "
        f"{data['date']}): t2va {request['width']}x{request['height']}, {request['length']} frames, "
        f"{request['evaluations']} evaluations, the same Comfy-Org files, warm seconds prompt to MP4, peaks of the "
        "server process. First runs, pinned memory"
        + (", what failed" if any(r.get("status") != "success" for r in data["records"]) else "")
        + " and why: [docs/comfyui.md](docs/comfyui.md)."), "",
        _table(rows, [("row", "memory"), ("core", "core s"), ("vflash", "Vflash s"), ("speedup", "Vflash speedup"),
                      ("device", "peak device GiB, core / Vflash"), ("rss", "host RSS GiB, core / Vflash")]), ""])


def fill_engine_doc(data: dict | list[dict], start_marker: str = FITS_START, end_marker: str = FITS_END, render_table=what_fits,
                    doc: Path = ENGINE_DOC) -> None:
    """Replace the text between a pair of `doc`'s markers (docs/engine.md's by default) with `render_table(data)`."""
    text = doc.read_text()
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    doc.write_text(text[:start] + "\n" + render_table(data) + "\n" + text[end:])


def _forward_reruns(other_runs: dict | None) -> list[str]:
    """The re-runs of forward.py kept beside its table: per commit and canvas, diffusers and Vflash ms/block, speedup,
    Vflash / roofline (values stored as [vflash, diffusers, speedup, roofline ratio, worst round, burst rates])."""
    if not other_runs:
        return []
    rows = [f"| `{run['commit']}` | {canvas} | {values[1]} | {values[0]} | {values[2]} | {values[3]} | {run.get('note', '')} |"
            for run in other_runs["runs"] for canvas, values in run.items() if isinstance(values, list)]
    return ["Re-runs at other commits (same method, another H200 machine):", "",
            "| commit | canvas | diffusers ms/block | Vflash ms/block | speedup | Vflash / roofline | note |",
            "|---|---|---:|---:|---:|---:|---|", *rows, ""]


def render() -> str:
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`. Every benchmark runs both sides in one",
        "process on the same inputs and full-width random weights (5376 hidden, 56 x 128 heads, 14336 FFN, a few blocks);",
        "per-block times come from CUDA events around the block loop, medians of repeated evaluations. See each script's",
        "docstring for its exact method.",
        "",
    ]
    forward = _load("forward_h200")
    if forward:
        parts += [
            "## diffusers vs Vflash resident (`benchmarks/forward.py`)",
            "",
            _source(forward) + ". Roofline: linear FLOPs at the measured 8192^3 BF16 GEMM rate plus attention FLOPs at the measured",
            "rate of Vflash's attention kernel alone on the same shape, both measured right after each Vflash timing in the GPU's",
            "sustained state: the H200 holds its 700 W cap by lowering the SM clock (~1500 MHz under this load, 1890-1980 MHz cool),",
            "so a rate from a few calls on a cool GPU is ~15 % above what the block loop can get. \"worst round\" is the highest",
            "ratio of the rounds (Vflash timing, GEMM rate, attention rate); \"burst rates\" uses a GEMM timed on the cool GPU before",
            "anything else ran and the attention kernel over 5 calls. Bitwise: both sides on cuDNN attention.",
            "",
            _table(forward["shapes"], [("name", "canvas (5 s)"), ("N", "N"), ("diffusers_ms_per_block", "diffusers ms/block"), ("vflash_ms_per_block", "Vflash ms/block"),
                                        ("speedup", "speedup"), ("roofline_ms_per_block", "roofline ms"), ("roofline_ratio", "Vflash / roofline"),
                                        ("roofline_ratio_max_over_rounds", "worst round"), ("roofline_ratio_burst_rates", "with burst rates"),
                                        ("attention_backend", "attention"), ("bitwise_equal_to_diffusers", "bitwise (cuDNN)"), ("max_abs_diff", "max abs diff (FA3)")]),
            "",
            *_forward_reruns(forward.get("other_runs")),
        ]
    e2e = _load("end_to_end_h200")
    if e2e:
        parts += _end_to_end(e2e, "The full-size model, prompt to MP4, on one H200 (`benchmarks/end_to_end.py`)")
    earlier = _load("end_to_end_2xh200")
    if earlier:
        parts += _end_to_end(earlier, "The same on a two-GPU machine, diffusers' side included (`benchmarks/end_to_end.py`, an earlier run; its requests use one GPU)")
    kernels = _load("kernels_h200")
    if kernels:
        parts += ["## Triton kernels vs their torch references (`benchmarks/kernel_ops.py`)", "", _source(kernels) + ". All outputs bitwise equal to the references.", "",
                  _table(kernels["ops"], [("name", "op"), ("N", "N"), ("torch_ms", "torch ms"), ("triton_ms", "Triton ms"), ("speedup", "speedup"), ("gbps", "Triton GB/s")]), ""]
    ring = _load("block_ring_h200")
    if ring:
        parts += [
            "## Resident vs block-ring weights (`benchmarks/block_ring.py`)",
            "",
            _source(ring) + f". Pinned host-to-device copies: {ring['h2d_GBps']} GB/s.",
            "",
            _table(ring["shapes"], [("name", "canvas (5 s)"), ("N", "N"), ("resident_ms_per_block", "resident ms/block"), ("block_ring_ms_per_block", "block ring ms/block"),
                                     ("ratio", "ratio"), ("device_weight_bytes_peak", "device weight bytes"), ("bitwise_equal_to_resident", "bitwise")]),
            "",
            "Capacity under a device memory cap, block-ring weights (largest request that ran one evaluation):",
            "",
            _table([{"cap": f"{c['cap_gib']} GiB", **(c["largest_fitting"] or {})} for c in ring["capacity"]],
                   [("cap", "cap"), ("canvas", "canvas"), ("seconds", "seconds"), ("N", "N"), ("peak_allocated_bytes", "peak allocated bytes")]),
            "",
        ]
    caps = _load("memory_caps_h200")
    if caps:
        parts += ["## What fits where: the pipeline under device memory caps (`benchmarks/memory_caps.py`)", "", what_fits(caps, e2e)]
    fp8 = _load("fp8_h200")
    if fp8:
        parts += ["## Approximate FP8 execution vs exact (`benchmarks/fp8.py`)", "", fp8_figures(fp8)]
    host = _load("host_memory_h200")
    if host:
        parts += ["## The core under a host-memory budget (`benchmarks/host_memory.py`)", "", host_memory_table(host), "",
                  *([f"How this file was measured: {host['code_note']}", ""] if host.get("code_note") else [])]
    parts += vae_section(_load("vae_h200"))
    parts += delivery_section(_load("delivery_h200"))
    preview = _load("preview_h200")
    if preview:
        parts += ["## A live preview's cost per evaluation (`benchmarks/preview.py`)", "",
                  _source(preview) + ". From the evaluation's velocity to the JPEG's bytes (x0, unpatchify, the 4-frame strip, latent2rgb, "
                  "the copy to the host, PIL's JPEG), against the 50-block evaluation it follows.", "",
                  _table(preview["records"], [("canvas", "canvas (5 s)"), ("latent_shape", "latents"), ("preview_ms", "preview ms"),
                                              ("preview_ms_max", "slowest ms"), ("evaluation_ms", "evaluation ms"), ("overhead", "overhead"),
                                              ("evaluation_source", "evaluation time from")]), ""]
    fast = _by_date("fast_mode")
    if fast:
        parts += ["## Fast modes vs exact (`benchmarks/fast_mode.py`)", "", every_fast_mode_figures(fast)]
    for throughput in sorted(RESULTS.glob("service_throughput_*.json")):
        parts += service_throughput_section(json.loads(throughput.read_text()))
    lora = _newest("lora")
    if lora:
        parts += ["## LoRA stacks (`benchmarks/lora.py`)", "", lora_figures(lora)]
    two = _load("two_gpu_2xh200")
    if two:
        parts += [
            "## One GPU vs two (`benchmarks/two_gpu.py`)",
            "",
            _source(two) + ".",
            "",
            _table(two["shapes"], [("name", "canvas (5 s)"), ("N", "N"), ("single_ms_per_block", "1 GPU ms/block"), ("sequence_head_ms_per_block", "sequence-head ms/block"),
                                    ("speedup", "speedup"), ("tensor_ms_per_block", "tensor ms/block"), ("tensor_speedup", "tensor speedup"),
                                    ("max_abs_diff_vs_single", "max abs diff"), ("two_workers_throughput_ratio", "latency-mode fleet cost")]),
            "",
            "GPU link (`nvidia-smi topo -m`):",
            "",
            "```",
            two["link"],
            "```",
            "",
        ]
    core = _vs_core_data()
    if core:
        parts += ["## ComfyUI core's nodes vs Vflash's (`vs_comfy_core.py`)", "", vs_core_table(core)]
    return "\n".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
    caps_data = _load("memory_caps_h200")
    if caps_data:
        e2e_data = _load("end_to_end_h200")
        fill_engine_doc(caps_data, render_table=lambda data: what_fits(data, e2e_data))
        print(f"filled the what-fits-where table of {ENGINE_DOC}")
    fp8_data = _load("fp8_h200")
    if fp8_data:
        fill_engine_doc(fp8_data, FP8_START, FP8_END, fp8_figures)
        print(f"filled the FP8 figures of {ENGINE_DOC}")
    host_data = _load("host_memory_h200")
    if host_data:
        fill_engine_doc(host_data, HOST_START, HOST_END, host_memory_table)
        print(f"filled the host-memory table of {ENGINE_DOC}")
    fast_data = _by_date("fast_mode")
    if fast_data:
        fill_engine_doc(fast_data, FAST_START, FAST_END, every_fast_mode_figures)
        print(f"filled the fast-mode figures of {ENGINE_DOC}")
    lora_data = _newest("lora")
    if lora_data:
        fill_engine_doc(lora_data, LORA_START, LORA_END, lora_figures)
        print(f"filled the LoRA figures of {ENGINE_DOC}")
    core_data = _vs_core_data()
    if core_data:
        fill_engine_doc(core_data, CORE_START, CORE_END, vs_core_table, CORE_DOC)
        fill_engine_doc(core_data, CORE_START, CORE_END, vs_core_brief, README)
        print(f"filled the core-vs-Vflash tables of {CORE_DOC} and {README}")
