"""The fast modes against exact, on one GPU, in one process, on the same full-width random inputs.

    python benchmarks/fast_mode.py [--phases kernel evaluation step_cache e2e] [--cache /tmp/vflash-bench]
                                   [--seconds 5 10 15] [--evaluation-densities 0.25 ...]
                                   [--prepared-assets RECEIPT --output-dir DIR [--e2e-seconds S]
                                    [--e2e-fast-mode MODE] [--first-frame IMAGE]]

Phases (each writes its records into benchmarks/results/fast_mode_<gpu>.json; a phase not run keeps the committed
file's records):

* `kernel`: block-sparse attention alone against FlashAttention-3 dense (the exact default on Hopper) on
  (1, N, 56, 128) bf16 at N = 19,796 / 38,222 / 73,898 / 104,478 (1344x768 and 960x544 5 s, 1344x768 10 and 15 s),
  at block densities 0.15 / 0.25 / 0.5 of the whole attention map (the request's prefix rows dense: 512 text rows and
  the audio rows; the selection the mode runs: `select_key_blocks` with mass 1.0, so the density decides). The density
  recorded is the one reached, counted over the same map (at most the one asked for, unless the local blocks alone
  take more). The kept blocks run in the backend the mode picks on this device (`backend`: FlashAttention-4's
  block-sparse forward on Hopper where flash-attn-4 is installed, else Vflash's Triton kernel), the query blocks
  holding prefix rows in FlashAttention-3, as the mode runs them; where the backend is not the Triton kernel, the
  Triton kernel is timed beside it (`triton_sparse_ms`). FA3 and each density are timed in turn, three rounds
  (medians of each; each round's time is recorded), so that a clock drifting as the card warms falls on all sides.
  Also: the selection's own time, each launch setting of the Triton kernel tried (its settings are the fastest of
  these), and the backend's max abs difference from the masked dense reference over the same blocks.
* `evaluation`: one whole evaluation (50 full-width blocks, the text stream, the output heads) exact and with
  `sparse-attention`, at 1344x768 5, 10 and 15 s, at the mode's default density cap or at each of
  `--evaluation-densities` (the caps a user can pass as `--sparse-density`; the exact side is timed once per clip
  length, in the same process). Four random blocks are compiled and the denoiser's 50 layers cycle through them (the
  same weights every fourth layer; the work and the memory traffic of 50 distinct blocks), so layer indices, dense
  edge layers and the selection are the mode's own. Evaluation 1 of the Turbo4 schedule (sparse).
* `step_cache`: a whole 16-evaluation Base16 request (50 full-width layers, cycled like the evaluation phase's) exact
  and with `step-cache` at its default threshold, 1344x768 5 s: block evaluations run, the request's denoise time, the
  latents' relative L2 distance. On random weights the first block's residual decides what is cached: the record says
  how much it moved per evaluation.
* `e2e` (with `--prepared-assets`, a full-size receipt such as `end_to_end.py` stages): prompt to decoded frames by
  running `vflash compare` itself at 1344x768, exact against a fast mode on one pipeline (the fast side first, carrying
  what is left of the sparse backend's first use): the receipt's profile, `--e2e-seconds` long, with
  `--e2e-fast-mode` (default `sparse-attention`) and, for a keyframe profile, `--first-frame`. Measured: Turbo4 5 s
  with `sparse-attention`, and a Base16 keyframe profile (`end_to_end.py --profile i2va-base16-bf16-sm90` stages it)
  10 s with `sparse-attention+step-cache`. Each side's request and denoise seconds, the block evaluations run, and the decoded
  frames' PSNR / SSIM and the soundtrack's log-spectral distance against exact, from its `comparison.json`. Its MP4s
  (exact, fast, side by side) and `comparison.json` go to `--output-dir`.

Random weights prove speed and mechanism, never quality: `latent_rel_l2_vs_exact` is a mechanism check.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    PROFILE,
    RESULTS,
    ROOT,
    compiled_model,
    environment,
    full_width,
    gpu_tag,
    median_ms,
    request,
    write_result,
)

from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.fast_mode import FastMode
from vflash_core.engine.fast_mode_run import FastModeRun
from vflash_core.engine.fused import FusedOps
from vflash_core.engine.profiler import StageTimer
from vflash_core.engine.residency import BlockSource, ResidentBlocks
from vflash_core.engine.sparse_attention import (
    TRITON_BACKEND,
    attend_selected,
    masked_attention,
    select_key_blocks,
    sparse_backend,
)

HEADS, HEAD_DIM = 56, 128
KERNEL_ROWS = {"960x544 5 s": 19_796, "1344x768 5 s": 38_222, "1344x768 10 s": 73_898, "1344x768 15 s": 104_478}
DENSITIES = (0.15, 0.25, 0.5)
KERNEL_ROUNDS = 3
LAUNCH_SETTINGS = [(w, s) for w in (4, 8) for s in (2, 3, 4)]
DEVICE = "cuda:0"


def _fa3():
    from fa3_fwd_interface import flash_attn_func

    return flash_attn_func


def _launch(q, k, v, selection, num_warps: int, num_stages: int, use_tma: bool):
    """The kernel alone (its dense query blocks too) with explicit launch settings (the sweep); the product's launcher
    fixes the fastest."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor
    from vflash_kernels import block_sparse_attention as bsa

    rows, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    views = [t[0].view(rows, heads * head_dim) for t in (q, k, v)]
    out = torch.empty_like(q)
    sources = [TensorDescriptor(t, list(t.shape), list(t.stride()), [bsa.BLOCK_ROWS, head_dim]) for t in views] \
        if use_tma else views
    blocks = triton.cdiv(rows, bsa.BLOCK_ROWS)
    bsa._block_sparse_attention_kernel[(blocks, heads)](
        *sources, out[0].view(rows, -1), selection.kv_blocks, selection.kv_counts,
        rows, blocks, selection.dense_query_blocks, 0, selection.kv_blocks.shape[2], bsa._LOG2E / math.sqrt(head_dim),
        views[0].stride(0), views[1].stride(0), views[2].stride(0), heads * head_dim,
        BLOCK=bsa.BLOCK_ROWS, HEAD_DIM=head_dim, USE_TMA=use_tma, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def kernel_phase(records: list[dict], sweep: bool) -> None:
    fa3 = _fa3()
    for canvas, rows in KERNEL_ROWS.items():
        shape, seconds = canvas.split()[0], float(canvas.split()[1])
        layout = request(full_width(1), shape, seconds).layout  # the real prefix: 512 text rows and the audio rows
        assert layout.sequence_length == rows
        prefix_rows = int(layout.video_indices[layout.num_condition_video_rows])
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        selections = {d: select_key_blocks(q, k, prefix_rows, d, 1.0, 1) for d in DENSITIES}
        backend = sparse_backend(q)
        backends = [backend] if backend == TRITON_BACKEND else [backend, TRITON_BACKEND]
        # the dense query blocks in FA3, as the mode runs them
        runs = {(d, b): partial(attend_selected, q, k, v, s, fa3, b) for d, s in selections.items() for b in backends}
        # FA3 and each density in turn, KERNEL_ROUNDS times: the clock drifts as the card warms (FA3 alone moved
        # 58-63 ms within one run), and every side sees the same drift
        dense_rounds: list[float] = []
        sparse_rounds: dict[tuple[float, str], list[float]] = {key: [] for key in runs}
        for _ in range(KERNEL_ROUNDS):
            dense_rounds.append(median_ms(partial(fa3, q, k, v), 2, 7))
            for key, run in runs.items():
                sparse_rounds[key].append(median_ms(run, 2, 7))
        dense_ms = statistics.median(dense_rounds)
        for density in DENSITIES:
            selection = selections[density]
            select_ms = median_ms(partial(select_key_blocks, q, k, prefix_rows, density, 1.0, 1), 1, 5)
            reached = selection.kept_pairs / selection.total_pairs
            sparse_ms = statistics.median(sparse_rounds[density, backend])
            settings = {}
            if sweep and rows == KERNEL_ROWS["1344x768 5 s"] and density == 0.25:
                for tma in (True, False):
                    for warps, stages in LAUNCH_SETTINGS:
                        try:
                            ms = median_ms(partial(_launch, q, k, v, selection, warps, stages, tma), 1, 5)
                        except Exception as exc:  # noqa: BLE001 - a setting that does not compile is recorded
                            ms = f"{type(exc).__name__}: {str(exc)[:120]}"
                        settings[f"warps{warps}_stages{stages}_{'tma' if tma else 'pointers'}"] = ms
            check = {}
            if rows <= KERNEL_ROWS["960x544 5 s"]:  # the dense reference's mask is (heads, N, N)
                sub = slice(0, 6 * 1024)  # a 6,144-row prefix of the same tensors keeps the mask small
                qs, ks, vs = (t[:, sub].contiguous() for t in (q, k, v))
                sel = select_key_blocks(qs, ks, prefix_rows, density, 1.0, 1)
                out = attend_selected(qs, ks, vs, sel, fa3, backend)
                ref = masked_attention(qs.float(), ks.float(), vs.float(), sel)
                check = {"max_abs_diff_vs_masked_reference": float((out.float() - ref).abs().max()),
                         "reference_rows": 6 * 1024}
            record = {
                "phase": "kernel", "canvas": canvas, "rows": rows, "seconds": int(seconds), "prefix_rows": prefix_rows,
                "mode": "sparse-attention", "density_cap": density, "density": round(reached, 4), "backend": backend,
                "fa3_dense_ms": round(dense_ms, 3), "sparse_ms": round(sparse_ms, 3), "dense_query_blocks_by": "fa3",
                "fa3_dense_ms_rounds": [round(t, 3) for t in dense_rounds],
                "sparse_ms_rounds": [round(t, 3) for t in sparse_rounds[density, backend]],
                "selection_ms": round(select_ms, 3),
                "kernel_speedup_vs_fa3_dense": round(dense_ms / sparse_ms, 3),
                "kernel_speedup_with_selection": round(dense_ms / (sparse_ms + select_ms), 3),
                "kept_block_tflops": round(4.0 * reached * rows * rows * HEADS * HEAD_DIM / sparse_ms / 1e9, 1),
                "fa3_tflops": round(4.0 * rows * rows * HEADS * HEAD_DIM / dense_ms / 1e9, 1),
                **check,
            }
            if backend != TRITON_BACKEND:
                triton_rounds = sparse_rounds[density, TRITON_BACKEND]
                record["triton_sparse_ms"] = round(statistics.median(triton_rounds), 3)
                record["triton_sparse_ms_rounds"] = [round(t, 3) for t in triton_rounds]
            if settings:
                record["launch_settings_ms"] = settings
            print(json.dumps(record), flush=True)
            records.append(record)
        q = k = v = runs = selections = selection = None  # frees the inputs before the next size's
        torch.cuda.empty_cache()


class CycledBlocks(BlockSource):
    """`layers` blocks made of a few resident ones, in turn (the work of a deeper stack on the weights that fit)."""

    def __init__(self, blocks: ResidentBlocks, layers: int):
        self.blocks, self.layers = blocks.blocks, layers
        self.device_weight_bytes = blocks.device_weight_bytes

    def __iter__(self):
        return (self.blocks[i % len(self.blocks)] for i in range(self.layers))


def _denoiser(paths: dict[str, Path], mode: FastMode, layers: int | None = None) -> Denoiser:
    """A fused FA3 denoiser over the compiled blocks (cycled to `layers`), under `mode`."""
    artifact = CompiledArtifact(**paths)
    device = torch.device(DEVICE)
    resident = ResidentBlocks(artifact, device)
    fast, attention = FastModeRun.wrap(mode, _fa3())
    den = Denoiser(artifact, CycledBlocks(resident, layers) if layers else resident, device,
                   FusedOps(artifact.config, attention))
    den.fast = None if mode.exact else fast
    return den


def _start(den: Denoiser, bundle, layers: int | None):
    state = den.start_request(bundle)
    if layers:
        for plan in state.plans:
            tables = plan.tables.blocks
            plan.tables = replace(plan.tables, blocks=[tables[i % len(tables)] for i in range(layers)])
        if den.fast is not None:
            den.fast.start_request(den.nfe, layers)
    return state


SPARSE = FastMode(("sparse-attention",))
STEP_CACHE = FastMode(("step-cache",))


def evaluation_phase(records: list[dict], cache: Path, seconds_list: list[int], modes: list[FastMode]) -> None:
    """One whole 50-layer evaluation (step 1: sparse under the default dense evaluations), exact and with each of the
    sparse-attention `modes` (one per density cap)."""
    _, paths = compiled_model(cache, 4)
    config = full_width(50)
    for seconds in seconds_list:
        bundle = request(config, "1344x768", float(seconds))
        rows = bundle.layout.sequence_length
        times, outputs, densities, backends = {}, {}, {}, {}
        for mode in (FastMode(), *modes):
            den = _denoiser(paths, mode, config.num_layers)
            state = _start(den, bundle, config.num_layers)
            repeat = 3 if seconds == 5 else 1  # a 10 or 15 s evaluation runs 11-29 s: one is a long sample
            last: list[torch.Tensor] = []
            evaluate = lambda: last.append(den.evaluate(state, 1)[0])  # noqa: B023 - called within the iteration
            times[mode] = median_ms(evaluate, 1, repeat)
            outputs[mode] = last[-1].float()
            if den.fast is not None and den.fast.attention is not None:
                densities[mode] = den.fast.attention.density_reached()
                backends[mode] = den.fast.attention.backend
            den.close()
            den = state = None  # frees the request's tensors before the next side's
            torch.cuda.empty_cache()
        exact = outputs[FastMode()]
        for mode in modes:
            record = {
                "phase": "evaluation", "canvas": "1344x768", "seconds": seconds, "rows": rows, "mode": mode.name,
                "layers": config.num_layers, "sparse_layers": config.num_layers - 2 * mode.sparse_dense_edge_layers,
                "density_cap": mode.sparse_density, "density": round(densities[mode], 4), "backend": backends[mode],
                "exact_ms": round(times[FastMode()], 1), "fast_ms": round(times[mode], 1),
                "evaluation_speedup_vs_exact": round(times[FastMode()] / times[mode], 3),
                "velocity_rel_l2_vs_exact": round(float((outputs[mode] - exact).norm() / exact.norm()), 4),
            }
            print(json.dumps(record), flush=True)
            records.append(record)


def _request(den: Denoiser, bundle, layers: int):
    """A whole request's denoise on `layers` cycled layers (the latents on the host)."""
    state = _start(den, bundle, layers)
    timer = StageTimer(den.device, False)
    for step in range(den.nfe):
        den.step(state, step, bundle, timer)
    return den.finish(bundle, state.video_rows, state.audio_rows)


def step_cache_phase(records: list[dict], cache: Path, layers: int) -> None:
    """A whole 16-evaluation Base16 request on `layers` full-width layers, exact and with the step cache."""
    _, paths = compiled_model(cache, 4)
    bundle = request(full_width(layers), "1344x768", 5.0)
    results, times, reports = {}, {}, {}
    for name, mode in (("exact", FastMode()), ("step-cache", STEP_CACHE)):
        den = _denoiser(paths, mode, layers)
        den.evaluate(_start(den, bundle, layers), 0)  # warm-up: every kernel of an evaluation compiles here
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = _request(den, bundle, layers)
        end.record()
        end.synchronize()
        times[name], results[name] = start.elapsed_time(end), out
        if den.fast is not None:
            reports[name] = den.fast.report(den.nfe, "fa3")
        den.close()
        den = None  # frees the blocks before the next side's
        torch.cuda.empty_cache()
    report = reports["step-cache"]
    exact = results["exact"].video_latents
    record = {
        "phase": "step_cache", "canvas": "1344x768", "seconds": 5, "rows": bundle.layout.sequence_length,
        "mode": "step-cache", "profile": PROFILE, "evaluations": 16, "layers": layers,
        "threshold": STEP_CACHE.step_cache_threshold, "evaluations_cached": report["step_cache"]["evaluations_cached"],
        "first_block_change": [None if c is None else round(c, 4) for c in report["step_cache"]["first_block_change"]],
        "block_evaluations": report["block_evaluations"], "block_evaluations_exact": report["block_evaluations_exact"],
        "block_evaluation_reduction": round(report["block_evaluations_exact"] / report["block_evaluations"], 3),
        "exact_request_ms": round(times["exact"], 1), "fast_request_ms": round(times["step-cache"], 1),
        "request_speedup_vs_exact": round(times["exact"] / times["step-cache"], 3),
        "latent_rel_l2_vs_exact": round(float((results["step-cache"].video_latents - exact).norm() / exact.norm()), 4),
    }
    print(json.dumps(record), flush=True)
    records.append(record)


E2E_COVERS = "validate, encode, denoise and decode to frames in memory; the MP4 encode (the same on both sides) is outside"


def e2e_phase(records: list[dict], assets: Path, output_dir: Path, mode: FastMode, seconds: int,
              first_frame: Path | None, width: int = 1344, height: int = 768) -> None:
    """Prompt (and a first frame, for a keyframe profile) to decoded frames at full size, exact against `mode`, through
    `vflash compare` itself (the command users run, in its own process: one pipeline, the fast side first, carrying
    what is left of the sparse backend's first use). The profile is the receipt's."""
    import subprocess

    from end_to_end import PROMPT, REQUEST_SEED  # the request the full-size benchmarks time

    command = [sys.executable, "-m", "vflash_core.cli.main", "compare", "--prepared-assets", str(assets),
               "--prompt", PROMPT, "--seed", str(REQUEST_SEED), "--width", str(width), "--height", str(height),
               "--duration", str(seconds), "--gpu", "0", "--fast-mode", mode.name, "--output-dir", str(output_dir),
               "--overwrite"] + (["--first-frame", str(first_frame)] if first_frame else [])
    print("$ vflash", shlex.join(command[3:]), flush=True)
    subprocess.run(command, check=True)
    report = json.loads((output_dir / "comparison.json").read_text())
    exact, fast = report["exact"], report["fast"]
    video, done = report["metrics"]["video"], fast["metadata"]["fast_mode"]
    record = {
        "phase": "e2e", "canvas": f"{width}x{height}", "seconds": seconds, "mode": mode.name,
        "profile": report["request"]["profile"], "keyframe": first_frame.name if first_frame else None,
        "block_evaluations": done["block_evaluations"], "block_evaluations_exact": done["block_evaluations_exact"],
    }
    if mode.sparse_attention:
        sparse = done["sparse_attention"]
        record.update({"density_cap": mode.sparse_density,
                       "density": sparse["density_reached"] and round(sparse["density_reached"], 4),
                       "sparse_calls": sparse["sparse_calls"], "dense_calls": sparse["dense_calls"]})
    if mode.step_cache:
        record.update({"step_cache_threshold": mode.step_cache_threshold,
                       "evaluations_cached": done["step_cache"]["evaluations_cached"]})
    record.update({
        "e2e_seconds": {"exact": round(exact["seconds"], 2), mode.name: round(fast["seconds"], 2)},
        "e2e_speedup_vs_exact": round(exact["seconds"] / fast["seconds"], 3),
        "denoise_seconds": {"exact": round(exact["denoise_seconds"], 2), mode.name: round(fast["denoise_seconds"], 2)},
        "denoise_speedup_vs_exact": report["denoise_speedup"],
        "frames_psnr_vs_exact_db": video["psnr_db"]["clip"], "frames_psnr_min_db": video["psnr_db"]["min"],
        "frames_ssim_vs_exact": video["ssim"]["mean"],
        "audio_log_spectral_distance_db": report["metrics"]["audio"]["log_spectral_distance_db"],
        "e2e_covers": E2E_COVERS,
        "warm_up": "none: `vflash compare` renders the fast side first, so it carries what is left of the sparse "
                   "backend's first use (the session prepares it while the pipeline loads; the exact side's attention, "
                   "FA3, compiles nothing)",
        "command": "vflash " + shlex.join(command[3:]),
    })
    print(json.dumps(record), flush=True)
    # the earlier record of this profile and clip length, if any, is replaced (the profile is known only now)
    records[:] = [r for r in records if not (r["phase"] == "e2e" and (r["profile"], r["seconds"]) ==
                                             (record["profile"], seconds))]
    records.append(record)


def kept_records(path: Path, phases: list[str], seconds: list[int], densities: list[float]) -> list[dict]:
    """The earlier file's records this run does not measure again, each marked with the commit it was measured at.

    An evaluation run replaces only its own clip lengths at its own density caps, so 5 s and 15 s measured earlier
    survive a run at 10 s, and the default cap's records a run at another cap; an e2e run only its own profile's
    record at its clip length (`e2e_phase` replaces it once the receipt names the profile), so Turbo4 5 s and Base16
    keyframe 10 s survive each other.
    With `VFLASH_RESULTS` set (a device run writing outside the tree) the earlier file is the committed one.
    """
    if not path.exists():
        path = ROOT / "benchmarks" / "results" / path.name
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())

    def measured_again(record: dict) -> bool:
        if record["phase"] == "evaluation":
            return "evaluation" in phases and record["seconds"] in seconds and record["density_cap"] in densities
        return record["phase"] in phases and record["phase"] != "e2e"

    return [{**r, "measured_at_commit": r.get("measured_at_commit", earlier["commit"])}
            for r in earlier["records"] if not measured_again(r)]


def _evaluation_label(record: dict) -> str:
    """An evaluation's result label: its clip length, and its density cap where that is not the mode's default."""
    cap = record["density_cap"]
    return f"1344x768 {record['seconds']} s" + ("" if cap == SPARSE.sparse_density else f", density {cap}")


def summarize(records: list[dict]) -> dict[str, dict[str, object]]:
    """The result keys, each {what was measured: value}, from the records."""
    summary: dict[str, dict[str, object]] = {}
    for phase, key, label in (
        ("kernel", "kernel_speedup_vs_fa3_dense", lambda r: f"N {r['rows']}, density {r['density_cap']}"),
        ("evaluation", "evaluation_speedup_vs_exact", _evaluation_label),
        ("step_cache", "block_evaluation_reduction", lambda r: f"1344x768 {r['seconds']} s, 16 evaluations"),
        ("step_cache", "latent_rel_l2_vs_exact", lambda r: f"1344x768 {r['seconds']} s, 16 evaluations"),
        ("e2e", "e2e_seconds", lambda r: f"{r['profile']} {r['canvas']} {r['seconds']} s"),
        ("e2e", "frames_psnr_vs_exact_db", lambda r: f"{r['profile']} {r['canvas']} {r['seconds']} s"),
    ):
        summary[key] = {label(r): r[key] for r in records if r["phase"] == phase}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", nargs="+", default=["kernel", "evaluation", "step_cache"],
                        choices=["kernel", "evaluation", "step_cache", "e2e"])
    parser.add_argument("--sweep", action="store_true", help="also time every launch setting (kernel phase)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--seconds", type=int, nargs="+", default=[5, 10, 15], choices=[5, 10, 15],
                        help="clip lengths of the evaluation phase")
    parser.add_argument("--evaluation-densities", type=float, nargs="+", default=[SPARSE.sparse_density],
                        metavar="FRACTION", help="the evaluation phase's sparse-attention density caps "
                                                 f"(default the mode's, {SPARSE.sparse_density})")
    parser.add_argument("--step-cache-layers", type=int, default=50,
                        help="layers of the step-cache phase's request (cycled over 4 compiled blocks)")
    parser.add_argument("--prepared-assets", type=Path, help="a full-size receipt (the e2e phase)")
    parser.add_argument("--output-dir", type=Path, default=Path("/tmp/vflash-compare"),
                        help="where the e2e phase writes its MP4s and comparison.json")
    parser.add_argument("--e2e-seconds", type=int, default=5, help="the e2e phase's clip length")
    parser.add_argument("--e2e-fast-mode", type=FastMode.parse, default=SPARSE,
                        help="the fast mode the e2e phase compares with exact (default sparse-attention)")
    parser.add_argument("--first-frame", type=Path, help="the e2e phase's first frame, for a keyframe profile's receipt")
    args = parser.parse_args()
    if "e2e" in args.phases and args.prepared_assets is None:
        parser.error("the e2e phase needs --prepared-assets")
    name = f"fast_mode_{gpu_tag()}"
    path = RESULTS / f"{name}.json"
    densities = list(dict.fromkeys(args.evaluation_densities))
    sparse_modes = [replace(SPARSE, sparse_density=d) for d in densities]  # a cap outside (0, 1] stops here, early
    records = kept_records(path, args.phases, args.seconds, densities)
    if "kernel" in args.phases:
        kernel_phase(records, args.sweep)
    if "evaluation" in args.phases:
        evaluation_phase(records, args.cache, args.seconds, sparse_modes)
    if "step_cache" in args.phases:
        step_cache_phase(records, args.cache, args.step_cache_layers)
    if "e2e" in args.phases:
        e2e_phase(records, args.prepared_assets, args.output_dir, args.e2e_fast_mode, args.e2e_seconds,
                  args.first_frame)
    write_result(name, {**environment(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "results": summarize(records), "records": records})


if __name__ == "__main__":
    main()
