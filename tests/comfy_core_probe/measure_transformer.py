"""Measure Vflash on Comfy-Org transformer files against ComfyUI core's own MiniMax-H3 model on the same files.

Run with ComfyUI's Python from a ComfyUI checkout (`cwd` = its root): `python measure_transformer.py WORK_DIR`.
Writes a small random transformer (the released channel counts on a tiny network) as three Comfy-Org single files:
bf16, pruned (`adaln_t_table` [1025, 8], reduced-rank AdaLN) and fp8_scaled; loads each with core's own loader
(`comfy.sd.load_diffusion_model`, bf16) and compiles each with Vflash for a CPU profile. Prints one JSON line per file:

* `dequantized`: fp8_scaled only: every float8 layer core dequantizes (`weight.dequantize()`) against the weight
  Vflash compiled from it (bitwise count, max abs difference);
* `tables`: per step, every block's AdaLN table and the final norm's shift/scale Vflash compiled, against core's own
  `adaln_proj` outputs in that forward (captured by forward hooks, cast as core casts them);
* `velocity`: one evaluation per step of the same latents, text and timesteps: Vflash's velocity against core's
  `MiniMaxH3Model.forward` (negated: core returns the other sign), bitwise and max abs difference, with the velocity's
  largest magnitude.

Core derives the audio timestep from the video sigma in closed form; Vflash's audio schedule is diffusers'. Where the
two differ in the last bit, core is given Vflash's audio sigma (`audio_timestep_injected`), so both models see the
same inputs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

STEPS = 4
PROFILES = {"bf16": "t2va-base4-exact-cpu", "pruned": "t2va-base4-pruned-cpu", "fp8_scaled": "t2va-base4-exact-cpu"}


def small_config():
    from vflash_core.engine.config import H3Config

    return replace(H3Config.preset("demo"), in_channels=24, audio_in_channels=32)


def write_files(work: Path, config) -> dict[str, Path]:
    import transformer_files

    from vflash_core.weights import synthetic

    weights = synthetic.random_internal_weights(config, seed=6)
    return {
        "bf16": synthetic.write_comfy_transformer(work / "h3_small_bf16.safetensors", config, weights),
        "pruned": synthetic.write_comfy_transformer(work / "h3_small_pruned.safetensors", config, transformer_files.prune_adaln(weights, config)),
        "fp8_scaled": synthetic.write_comfy_transformer(work / "h3_small_fp8_scaled.safetensors", config, weights, fp8="metadata"),
    }


def vflash_artifact(work: Path, name: str, path: Path, profile: str):
    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.weights.compiler import compile_receipt, prepare

    receipt = work / f"{name}.receipt.json"
    prepare(profile, path, receipt)
    out = compile_receipt(receipt, work / f"{name}.compiled")
    return CompiledArtifact(out / "artifact", out / "schedule", out / "auxiliary.safetensors")


def denoiser(artifact, ops):
    from vflash_core.engine.denoise import Denoiser
    from vflash_core.engine.residency import ResidentBlocks

    device = torch.device("cpu")
    return Denoiser(artifact, ResidentBlocks(artifact, device), device, ops)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    return {"bitwise": bool(torch.equal(a, b)), "max_abs_diff": (a.float() - b.float()).abs().max().item()}


def dequantized(core_model, path: Path, config) -> dict[str, object]:
    """Every float8 layer of the file: core's dequantized weight against Vflash's, by original name; and how many
    elements a product rounded from fp32 (`(code.float() * scale).to(bf16)`) would give differently."""
    from comfy.quant_ops import QuantizedTensor

    from vflash_core.weights import synthetic
    from vflash_core.weights.checkpoint import SourceWeights

    source = SourceWeights(path)
    ours = synthetic.to_original_names(source.read(list(source.shapes())), config)
    layers, equal, worst, elements, fp32_product_differs = 0, 0, 0.0, 0, 0
    for name, module in core_model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedTensor):
            core = weight.dequantize()
            mine = ours[f"{name}.weight"]
            layers += 1
            equal += int(core.dtype == mine.dtype and torch.equal(core, mine))
            worst = max(worst, (core.float() - mine.float()).abs().max().item())
            elements += mine.numel()
            fp32_product = (weight._qdata.float() * weight._params.scale.float()).to(mine.dtype)
            fp32_product_differs += int((fp32_product != mine).sum())
    return {"layers": layers, "bitwise_layers": equal, "core_dtype": str(core.dtype), "max_abs_diff": worst, "elements": elements,
            "fp32_product_differs": fp32_product_differs}


def core_ops(config):
    """`BlockOps` with ComfyUI core's two block operations that differ from Vflash's: its attention call
    (`optimized_attention`, on the CPU the sub-quadratic kernel) and its gate (`x.addcmul_(y, gate)`, one rounding
    where Vflash rounds the product, then the sum). Test-only: it shows every other op of the evaluation is core's."""
    from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention

    from vflash_core.engine import model as M

    def attention(q, k, v):  # (1, S, heads, D) each
        heads = [AttentionTensorContainer(t[0].transpose(0, 1).unsqueeze(0)) for t in (q, k, v)]
        return optimized_attention(*heads, q.shape[2], mask=None, skip_reshape=True).reshape(q.shape)

    class CoreOps(M.BlockOps):
        def gated_residual(self, x, y, table, row_index, which):
            return x.addcmul(M.modulation_rows(table, row_index, which, 2), y)

    return CoreOps(config, attention)


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve()
    sys.path[:0] = [".", str(here.parents[2]), str(here.parents[1])]  # ComfyUI, this repository, its tests
    from comfy.cli_args import args

    args.cpu = True
    import comfy.ldm.minimax.model as core_h3
    import comfy.model_management
    import comfy.sd

    from vflash_core import Geometry, build_keyframe_bundle
    from vflash_core.engine.layout import audio_rows_to_latents, unpatchify
    from vflash_core.engine.model import BlockOps, sdpa_attention

    # Core as it runs on a device with bf16 (on the CPU it computes a quantized model in fp32).
    comfy.model_management.should_use_bf16 = lambda *a, **k: True
    config = small_config()
    files = write_files(work, config)
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(9, config.text_dim, generator=g).to(torch.bfloat16)
    geometry = Geometry(64, 96, 124)
    bundle = build_keyframe_bundle(embeds, torch.ones(9, dtype=torch.long), geometry, config, g)

    def video(rows):
        return unpatchify(rows, config.in_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width, config.patch_size)

    def audio(rows):
        return audio_rows_to_latents(rows, geometry.num_audio_latents).permute(1, 0, 2).unsqueeze(0)

    for kind, path in files.items():
        artifact = vflash_artifact(work, kind, path, PROFILES[kind])
        core = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.bfloat16}).model.diffusion_model.eval()
        row = {"file": kind, "profile": PROFILES[kind], "base_weights": {k: v for k, v in artifact.manifest["base_weights"].items() if k != "files"}}
        if kind == "fp8_scaled":
            row["dequantized"] = dequantized(core, path, config)
        captured: list[torch.Tensor] = []

        def capture(module, args, out, captured=captured) -> None:  # a forward hook: each adaLN projection's table
            captured.append(torch.cat(out, dim=-1))

        hooks = [block.adaln_proj.register_forward_hook(capture) for block in core.blocks]
        hooks.append(core.final_layer.adaln_proj.register_forward_hook(capture))
        ours, with_core_ops = denoiser(artifact, BlockOps(artifact.config, sdpa_attention)), denoiser(artifact, core_ops(artifact.config))
        state, core_state = ours.start_request(bundle), with_core_ops.start_request(bundle)
        tables, velocities, injected = [], [], False
        for step in range(STEPS):
            plan = state.plans[step]
            mine = [video(v) if i == 0 else audio(v) for i, v in enumerate(ours.evaluate(state, step))]
            substituted = [video(v) if i == 0 else audio(v) for i, v in enumerate(with_core_ops.evaluate(core_state, step))]
            sigma_v, sigma_a = float(ours.video_sigmas[step]), ours.audio_sigmas[step]
            closed_form = core_h3.time_shift_sigma
            if not torch.equal(closed_form(torch.tensor(sigma_v, dtype=torch.float32), 12.0, 3.0), sigma_a):
                injected = True
                core_h3.time_shift_sigma = lambda sigma, a, b, value=sigma_a: value.clone()
            captured.clear()
            with torch.no_grad():  # the fp32 latents: core's model patchifies them in fp32, as Vflash's rows are
                out = core([video(state.video_rows), audio(state.audio_rows)], torch.tensor([sigma_v * 1000.0], dtype=torch.float64), embeds[None],
                           transformer_options={}, minimax_payload={})
            core_h3.time_shift_sigma = closed_form
            theirs = [-out[0].float(), -out[1].float()]  # core returns the negated velocity
            per_table = [compare(t, c.reshape(t.shape).to(t.dtype)) for t, c in zip(plan.tables.blocks, captured[:-1])]
            per_table.append(compare(plan.tables.norm_out, captured[-1].reshape(plan.tables.norm_out.shape).to(plan.tables.norm_out.dtype)))
            tables.append({"timesteps": plan.tables.timesteps.tolist(), "bitwise": all(t["bitwise"] for t in per_table), "max_abs_diff": max(t["max_abs_diff"] for t in per_table)})
            velocities.append({
                "vflash_ops": {"video": compare(mine[0], theirs[0]), "audio": compare(mine[1], theirs[1])},
                "core_attention_and_gate": {"video": compare(substituted[0], theirs[0]), "audio": compare(substituted[1], theirs[1])},
                "max_abs_value": max(t.abs().max().item() for t in theirs),
            })
        for hook in hooks:
            hook.remove()
        row.update(tables=tables, velocity=velocities, audio_timestep_injected=injected)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
