"""Measure Vflash on an int8_convrot transformer file against ComfyUI core's own reading of the same file.

Run with ComfyUI's Python from a ComfyUI checkout (`cwd` = its root): `python measure_int8_convrot.py WORK_DIR`.
Writes the small random transformer of `measure_transformer.py` as an int8_convrot single file (every linear ComfyUI
quantizes, ConvRot groups of 16, `<layer>.comfy_quant` markers), loads it with core's loader
(`comfy.sd.load_diffusion_model`, bf16 compute) and compiles it with Vflash for a CPU profile. Prints one JSON line:

* `dequantized`: every int8 layer core holds, its `weight.dequantize()` (comfy_kitchen; on the CPU its eager fp32
  rotation) against the weight Vflash read: layers, bitwise layers, differing elements, and the largest difference
  in BF16 steps of the larger of the two values (with the fp32 summation error allowed where the value cancels);
* `velocity`: one evaluation at the first step of the same latents, text and timestep: Vflash's velocity (BF16 GEMMs
  on the dequantized weights) against core's forward (int8 GEMMs on per-row-quantized activations), max abs
  difference and the velocity's largest magnitude.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

GROUP = 16


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [".", str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]  # ComfyUI, this repository
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management
    import comfy.sd
    from comfy.quant_ops import QuantizedTensor
    from measure_transformer import denoiser, small_config, vflash_artifact

    from vflash_core import Geometry, build_keyframe_bundle
    from vflash_core.engine.layout import audio_rows_to_latents, unpatchify
    from vflash_core.engine.model import BlockOps, sdpa_attention
    from vflash_core.weights import synthetic
    from vflash_core.weights.checkpoint import SourceWeights

    comfy.model_management.should_use_bf16 = lambda *a, **k: True
    config = small_config()
    path = synthetic.write_comfy_transformer(work / "h3_small_int8_convrot.safetensors", config, synthetic.random_internal_weights(config, seed=6), int8_convrot=GROUP)
    core = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.bfloat16}).model.diffusion_model.eval()

    source = SourceWeights(path)
    ours = synthetic.to_original_names(source.read(list(source.shapes())), config)
    layers = bitwise = elements = differing = 0
    worst_steps = 0.0
    for name, module in core.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, QuantizedTensor):
            continue
        theirs, mine = weight.dequantize(), ours[f"{name}.weight"]
        layers += 1
        bitwise += int(theirs.dtype == mine.dtype and torch.equal(theirs, mine))
        elements += mine.numel()
        differing += int((theirs != mine).sum())
        scale = weight._params.scale.float().reshape(-1, 1)
        allowed = torch.finfo(torch.bfloat16).eps * torch.maximum(theirs.float().abs(), mine.float().abs()) + GROUP * 128 * scale * 2.0 ** -24
        worst_steps = max(worst_steps, float(((theirs.float() - mine.float()).abs() / allowed).max()))
    row = {"file": "int8_convrot", "base_weights": {}, "dequantized": {
        "layers": layers, "bitwise_layers": bitwise, "elements": elements, "differing": differing,
        "worst_in_allowed_steps": worst_steps, "core_dtype": str(theirs.dtype)}}

    artifact = vflash_artifact(work, "int8_convrot", path, "t2va-base4-exact-cpu")
    row["base_weights"] = {k: v for k, v in artifact.manifest["base_weights"].items() if k != "files"}
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(9, config.text_dim, generator=g).to(torch.bfloat16)
    geometry = Geometry(64, 96, 124)
    bundle = build_keyframe_bundle(embeds, torch.ones(9, dtype=torch.long), geometry, config, g)
    vflash = denoiser(artifact, BlockOps(artifact.config, sdpa_attention))
    state = vflash.start_request(bundle)
    velocity = vflash.evaluate(state, 0)
    mine = [unpatchify(velocity[0], config.in_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width, config.patch_size),
            audio_rows_to_latents(velocity[1], geometry.num_audio_latents).permute(1, 0, 2).unsqueeze(0)]
    video = unpatchify(state.video_rows, config.in_channels, geometry.num_latent_frames, geometry.latent_height, geometry.latent_width, config.patch_size)
    audio = audio_rows_to_latents(state.audio_rows, geometry.num_audio_latents).permute(1, 0, 2).unsqueeze(0)
    with torch.no_grad():
        out = core([video, audio], torch.tensor([float(vflash.video_sigmas[0]) * 1000.0], dtype=torch.float64), embeds[None],
                   transformer_options={}, minimax_payload={})
    theirs = [-out[0].float(), -out[1].float()]  # core returns the negated velocity
    row["velocity"] = {
        stream: {"max_abs_diff": (a.float() - b).abs().max().item(), "max_abs_value": b.abs().max().item()}
        for stream, a, b in zip(("video", "audio"), mine, theirs)
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
