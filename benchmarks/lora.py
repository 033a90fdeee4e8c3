"""LoRA stacks at full width: the per-evaluation time of no LoRA, one and a stack of three, residual and merged, and
bitwise equality with diffusers 0.42.1 + peft running the same adapters, one process, one GPU.

    python benchmarks/lora.py --out benchmarks/results/ [--blocks 4] [--shape 960x544] [--cache /dev/shm/vflash-lora]
    python benchmarks/lora.py --small --out /tmp/lora-dry-run     # dry run on the CPU: the tiny family

The model is `_common.compiled_model`'s full-width random one with `--blocks` blocks, compiled for the Base16 profile
(no adapter of its own) once per stack. The stack, real-layout files of random factors: a Turbo-like LoRA (rank 128,
AdaLN rank 16, LightX2V layout, alpha 128) at 1.0; a style LoRA (rank 32) at 0.6; a full-rank delta (FastH3 `diff`
on every block linear) at 0.8. "One LoRA" is the first alone. Records: no LoRA; 1 and 3 LoRAs, each residual and
merged. `evaluation_ms`: one evaluation (step 1) on resident blocks with the default attention, CUDA events around
`Denoiser.evaluate`, median of 5 after 2 warm-ups, on a packed t2va 5 s request of `--shape` with 512 text rows; the
median over `--rounds` rounds (`rounds_ms`), each of which times every case in turn (all are resident at once);
`overhead_vs_no_lora` = evaluation_ms / no LoRA's - 1; `overhead_per_lora` (residual) that over the LoRA count.
`bitwise_equal_to_diffusers`: the same evaluation with torch-cudnn attention (diffusers' pick) against diffusers with
the same adapters active (`set_adapters`, residual) or fused (`fuse_lora`, merged); diffusers holds the full-rank delta
as a LoRA with A = diff, B = identity (`synthetic.write_delta_as_peft`). The whole run takes about 3 minutes on an
H100 (most of it writing and compiling the five artifacts, in /dev/shm where it exists).

Writes <out>/lora_<gpu>.json (lora_small_cpu.json with --small). Needs diffusers 0.42.1 and peft.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from _common import compiled_model, environment, full_width, median_ms, request, write_result

from vflash_core import Geometry, build_keyframe_bundle
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.attention import resolve_attention
from vflash_core.engine.config import H3Config
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.model import BlockOps
from vflash_core.engine.residency import ResidentBlocks
from vflash_core.weights import synthetic
from vflash_core.weights.compiler import compile_receipt, prepare
from vflash_core.weights.lora import LoraStack, StackedLora

STEP = 1
STRENGTHS = (1.0, 0.6, 0.8)
SMALL_PROFILE = "t2va-base4-exact-cpu"
# (loras, mode): the records, in the order they are measured
CASES = ((0, "none"), (1, "residual"), (1, "merged"), (3, "residual"), (3, "merged"))


def lora_files(folder: Path, config: H3Config, small: bool, device: str) -> tuple[list[Path], Path]:
    """The stack's three files (Turbo-like, style, full-rank delta) and the delta as diffusers holds it (written
    once)."""
    folder.mkdir(parents=True, exist_ok=True)
    turbo, style, delta, delta_peft = (folder / f"{n}.safetensors" for n in ("turbo", "style", "delta", "delta_peft"))
    ranks = (8, 4, 2) if small else (128, 32, 16)
    if not turbo.exists():
        synthetic.write_random_lora(turbo, config, ranks[0], ranks[0], seed=1, adaln_rank=ranks[2], device=device)
    if not style.exists():
        synthetic.write_random_lora(style, config, ranks[1], ranks[1], seed=2, device=device)
    if not delta.exists():
        synthetic.write_random_delta(delta, config, seed=3, device=device)
    if not delta_peft.exists():
        synthetic.write_delta_as_peft(delta, delta_peft, config)
    return [turbo, style, delta], delta_peft


def compiled_stack(
    root: Path, source: Path, profile: str, files: list[Path], mode: str, device: str
) -> dict[str, Path]:
    """The weights compiled with the first `len(files)` LoRAs of the stack in `mode` (once per cache folder)."""
    out = root / f"compiled-{len(files)}-{mode}"
    if not out.exists():
        receipt = root / f"receipt-{len(files)}-{mode}.json"
        stack = LoraStack(tuple(StackedLora(str(f), s) for f, s in zip(files, STRENGTHS)), mode)
        prepare(profile, source, receipt, loras=stack)
        compile_receipt(receipt, out, device)
    return {
        "artifact": out / "artifact", "schedule_overlay": out / "schedule", "auxiliary": out / "auxiliary.safetensors"
    }


def evaluation_ms(fn, device: torch.device) -> float:
    """Median of 5 after 2 warm-ups: CUDA events on a GPU, the wall clock on the CPU (a dry run)."""
    if device.type == "cuda":
        return median_ms(fn, 2, 5)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def diffusers_outputs(folder: Path, files: list[Path], delta_peft: Path, inputs: tuple, device: torch.device) -> dict:
    """(loras, mode) -> diffusers' output of the evaluation: the base model, then with the adapters active, then a
    fresh copy with them fused (`fuse_lora`, then unloaded: the base modules with the stack merged in)."""
    from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    names = ["turbo", "style", "delta"]
    sources = [files[0], files[1], delta_peft]

    def with_adapters(count: int, fused: bool):
        model = MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device).eval()
        if count:
            pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
            pipe.update_components(
                transformer=model, scheduler=MiniMaxH3Scheduler(12.0), audio_scheduler=MiniMaxH3Scheduler(3.0)
            )
            for name, path in zip(names[:count], sources[:count]):
                pipe.load_lora_weights(str(path), adapter_name=name)
            pipe.set_adapters(names[:count], list(STRENGTHS[:count]))
            if fused:
                pipe.fuse_lora(components=["transformer"])
                pipe.unload_lora_weights()
        return model

    out = {}
    with torch.no_grad():
        for count, mode in CASES:
            model = with_adapters(count, mode == "merged")
            out[(count, mode)] = tuple(t[0].cpu() for t in model(*inputs, return_dict=False))
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def run(blocks: int, cache: Path, shape: str, rounds: int, small: bool) -> dict[str, object]:
    device = torch.device("cpu" if small else "cuda:0")
    if small:
        config, profile = replace(H3Config.preset("tiny"), num_layers=2), SMALL_PROFILE
    else:
        config, profile = full_width(blocks), _common.PROFILE
    folder, base_paths = compiled_model(cache, config.num_layers, str(device), profile, config)
    root = folder.parent
    files, delta_peft = lora_files(root / "loras", config, small, str(device))
    default_attention = resolve_attention("auto", device)[1]
    cudnn_attention = resolve_attention("torch-sdpa" if small else "torch-cudnn", device)[1]
    ops_class = BlockOps
    if not small:
        from vflash_core.engine.fused import FusedOps

        ops_class = FusedOps

    def bundle():
        if small:
            g = torch.Generator().manual_seed(0)
            embeds = torch.randn(16, config.text_dim, generator=g).to(torch.bfloat16)
            return build_keyframe_bundle(embeds, torch.ones(16, dtype=torch.long), Geometry(64, 96, 124), config, g)
        return request(config, shape)

    # Every case resident at once (about 20 GB at 4 full-width blocks), so the timing rounds interleave the cases:
    # a clock that drifts as the GPU warms shifts them all alike.
    timed, outputs, inputs = {}, {}, None
    for count, mode in CASES:
        paths = compiled_stack(root, folder, profile, files[:count], mode, str(device)) if count else base_paths
        artifact = CompiledArtifact(**paths)
        blocks_on_device = ResidentBlocks(artifact, device)
        denoiser = Denoiser(artifact, blocks_on_device, device, ops_class(config, default_attention))
        compared = Denoiser(artifact, blocks_on_device, device, ops_class(config, cudnn_attention))
        with torch.no_grad():
            timed[(count, mode)] = (denoiser, denoiser.start_request(bundle()))
            request_bundle = bundle()
            compared_state = compared.start_request(request_bundle)
            outputs[(count, mode)] = tuple(t.cpu() for t in compared.evaluate(compared_state, STEP))
            if inputs is None:
                plan, lay = compared_state.plans[STEP], request_bundle.layout
                inputs = (
                    compared_state.video_rows[None], compared_state.audio_rows[None],
                    request_bundle.prompt_embeds[None].to(device), plan.tables.timesteps, plan.timestep_indices,
                    *(t.to(device) for t in (lay.token_tags, lay.position_ids, lay.video_indices, lay.audio_indices,
                                             lay.text_indices)),
                )
        del compared, compared_state
    rounds_ms: dict[tuple[int, str], list[float]] = {case: [] for case in CASES}
    with torch.no_grad():
        for _ in range(rounds):
            for case, (denoiser, state) in timed.items():
                rounds_ms[case].append(evaluation_ms(lambda d=denoiser, s=state: d.evaluate(s, STEP), device))
    records = [
        {"loras": count, "mode": mode, "evaluation_ms": round(statistics.median(rounds_ms[(count, mode)]), 3),
         "rounds_ms": [round(ms, 3) for ms in rounds_ms[(count, mode)]]}
        for count, mode in CASES
    ]
    del timed
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    expected = diffusers_outputs(folder, files, delta_peft, inputs, device)
    base_ms = records[0]["evaluation_ms"]
    for record in records:
        key = (record["loras"], record["mode"])
        mine, theirs = outputs[key], expected[key]
        record["overhead_vs_no_lora"] = round(record["evaluation_ms"] / base_ms - 1, 4)
        if record["mode"] == "residual":
            record["overhead_per_lora"] = round(record["overhead_vs_no_lora"] / record["loras"], 4)
        record["bitwise_equal_to_diffusers"] = all(torch.equal(a, b) for a, b in zip(mine, theirs))
        record["max_abs_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(mine, theirs))
        print(record, flush=True)
    return {
        **environment(),
        "profile": profile,
        "blocks": config.num_layers,
        "hidden_size": config.hidden_size,
        "shape": "64x96 (tiny)" if small else shape,
        "N": bundle().layout.sequence_length,
        "stack": [
            {"file": f.name, "strength": s, "kind": k}
            for f, s, k in zip(files, STRENGTHS, ("rank 128 (AdaLN 16) Turbo-like", "rank 32 style", "full-rank delta"))
        ],
        "bitwise_compared_with": "torch-cudnn attention on both sides" if not small else "torch-sdpa on both sides",
        "records": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder of the result file")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--shape", default="960x544")
    default_cache = Path("/dev/shm/vflash-lora") if Path("/dev/shm").is_dir() else Path("/tmp/vflash-lora")
    parser.add_argument("--cache", type=Path, default=default_cache)
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, each every case in turn (median of 5)")
    parser.add_argument("--small", action="store_true", help="dry run on the CPU: the tiny family (2 blocks)")
    args = parser.parse_args()
    if not args.small and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --small)")
    data = run(args.blocks, args.cache / ("small" if args.small else "full"), args.shape, args.rounds, args.small)
    data["small"] = args.small
    _common.RESULTS = args.out
    gpu = "small_cpu" if args.small else next(
        (tag for tag in ("h100", "h200", "b200") if tag in str(data["gpu"]).lower()), "gpu"
    )
    write_result(f"lora_{gpu}", data)


if __name__ == "__main__":
    main()
