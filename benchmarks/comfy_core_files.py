"""The Comfy-Org files of MiniMax-H3 that ComfyUI core's loaders read, with random weights at the released size,
written tensor by tensor (drawn on `--device`, written, dropped), so neither host memory nor the disk ever holds more
than the files themselves: what `benchmarks/vs_comfy_core.py` runs both sides on.

* `diffusion_models/minimax_h3_fl2va_fp8_scaled.safetensors`: the transformer as a Comfy-Org scaled-FP8 single file
  (`synthetic.write_comfy_fp8_scaled_streamed`: the block linears float8 with one scale each, the rest bf16/fp32);
* `text_encoders/qwen3vl_32b_minimax_h3_fp8_scaled.safetensors`: Qwen3-VL-32B as core's `CLIPLoader(type="minimax")`
  detects it (`model.*` with decoder layers 0..49, the 50 H3 reads, `visual.*`), scaled FP8 as Comfy-Org quantizes
  text encoders (the decoder layers' linears float8 with one scale each, the rest bf16);
* `vae/minimax_h3_video_vae_fp16.safetensors`, `vae/minimax_h3_audio_vae_fp32.safetensors`: core's own H3 VAE
  modules' state (core's `VAELoader` detects them by their keys), the video VAE built on the meta device and drawn,
  the audio VAE (150 M parameters) built for real so its anti-aliasing filters keep their constructed values.

Values come from `synthetic.random_like` (per-tensor seeds; latent statistics mean 0, std 1). Run with ComfyUI's
Python from the ComfyUI root (core's VAE classes define the VAE layouts):

    python /path/to/vflash/benchmarks/comfy_core_files.py DEST [--device cuda] [--only dit text vae]
    python /path/to/vflash/benchmarks/comfy_core_files.py DEST --small   # the small family (tests/comfy_core_probe)

`--small` writes the same layouts at the small family's dimensions under `TINY_FILES`' names (core's classes patched
by `small_core.patch()`), which the CPU dry run (`vs_comfy_core.py --tiny`) loads in both sides.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "comfy_core_probe")]

from vflash_core.engine.config import TEXT_ENCODER_LAYER, H3Config
from vflash_core.tensor_store import write_safetensors_streamed
from vflash_core.weights import synthetic

SEED = 0
# Qwen3-VL-32B as released (the H3 family's text encoder; benchmarks/full_family.py writes the same in diffusers' layout).
FULL_TEXT = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True})
FULL_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                   out_hidden_size=5120, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
# The small family's (tests/comfy_core_probe/small_core.py: core's classes patched to these dimensions).
SMALL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=TEXT_ENCODER_LAYER, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True})
SMALL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                    out_hidden_size=32, num_position_embeddings=256, deepstack_visual_indexes=[0, 1])

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def write(path: Path, layout: Layout, produce: Callable[[str], torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    size, _ = write_safetensors_streamed(path, layout, produce, metadata)
    print(f"{path}: {size:,} bytes", flush=True)
    return size


def text_encoder_names(name: str) -> str | None:
    """A transformers Qwen3-VL state name -> its name in the Comfy-Org H3 text encoder (None: not in the file):
    decoder layers 0..49 and the embeddings under `model.`, the vision tower under `visual.`; no final norm, no head."""
    if name.startswith("model.visual."):
        return "visual." + name.removeprefix("model.visual.")
    if not name.startswith("model.language_model.") or name == "model.language_model.norm.weight":
        return None
    layer = re.match(r"model\.language_model\.layers\.(\d+)\.", name)
    return None if layer and int(layer.group(1)) >= TEXT_ENCODER_LAYER else "model." + name.removeprefix("model.language_model.")


# The decoder layers' linears, which a scaled-FP8 text encoder file stores as float8 codes with one fp32 scale each.
FP8_TEXT_LINEARS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def write_text_encoder(path: Path, text: dict, vision: dict, device: str) -> int:
    """Qwen3-VL as core's loader reads it, scaled FP8 (`synthetic.write_fp8_scaled_streamed`): the decoder layers'
    linears float8 e4m3 with one fp32 scale each, the rest bf16. FP8 halves the file (at full size 48 GiB in bf16),
    so the four files leave the device machine's host memory room for the runs."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config={**text, "vocab_size": 151936}, vision_config=vision, tie_word_embeddings=False,
                           image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    shapes = {out: tuple(t.shape) for name, t in model.state_dict().items() if (out := text_encoder_names(name))}
    path.parent.mkdir(parents=True, exist_ok=True)
    size = synthetic.write_fp8_scaled_streamed(
        path, {name: (torch.bfloat16, shape) for name, shape in shapes.items()},
        lambda name: synthetic.random_like(name, shapes[name], SEED, device).to(torch.bfloat16),
        [name for name in shapes if FP8_TEXT_LINEARS.fullmatch(name)],
    )
    print(f"{path}: {size:,} bytes", flush=True)
    return size


def write_vae(path: Path, module: torch.nn.Module, dtype: torch.dtype, device: str) -> int:
    """Core's VAE `module` (on the meta device, or built for real where its buffers hold constructed values): its
    parameters and meta buffers drawn, its other buffers as constructed, latent statistics mean 0 and std 1."""
    state, parameters = module.state_dict(), dict(module.named_parameters())

    def produce(name: str) -> torch.Tensor:
        tensor = state[name]
        if name.endswith("latents_mean"):
            value = torch.zeros(tensor.shape)
        elif name.endswith("latents_std"):
            value = torch.ones(tensor.shape)
        elif name in parameters or tensor.is_meta:
            value = synthetic.random_like(name, tuple(tensor.shape), SEED, device)
        else:
            value = tensor
        return value.to(dtype).cpu()

    return write(path, {name: (dtype, tuple(t.shape)) for name, t in state.items()}, produce)


def write_vaes(video_path: Path, audio_path: Path, device: str) -> int:
    import comfy.ldm.minimax.vae as video_vae
    import comfy.ops
    from comfy.ldm.minimax import audio_vae

    with torch.device("meta"):
        video = video_vae.MiniMaxH3VideoVAE(operations=comfy.ops.disable_weight_init)
    return write_vae(video_path, video, torch.float16, device) + write_vae(audio_path, audio_vae.MiniMaxH3AudioVAE(), torch.float32, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="the model folder (diffusion_models/, text_encoders/, vae/ are made in it)")
    parser.add_argument("--small", action="store_true", help="the small family's dimensions, under TINY_FILES' names")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where values are drawn")
    parser.add_argument("--only", nargs="*", choices=("dit", "text", "vae"), default=("dit", "text", "vae"))
    args = parser.parse_args()
    sys.path.insert(0, ".")  # the ComfyUI root
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = not torch.cuda.is_available()
    from vs_comfy_core import FULL_FILES, TINY_FILES

    files = TINY_FILES if args.small else FULL_FILES
    if args.small:
        import small_core

        small_core.patch()
        config = replace(H3Config.preset("demo"), in_channels=24, audio_in_channels=32)
    else:
        config = H3Config.preset("h3")
    total = 0
    if "dit" in args.only:
        path = args.dest / "diffusion_models" / files.dit
        path.parent.mkdir(parents=True, exist_ok=True)
        total += synthetic.write_comfy_fp8_scaled_streamed(path, config, synthetic.RandomWeights(config, seed=6, device=args.device))
        print(f"{path}: {path.stat().st_size:,} bytes", flush=True)
    if "text" in args.only:
        text, vision = (SMALL_TEXT, SMALL_VISION) if args.small else (FULL_TEXT, FULL_VISION)
        total += write_text_encoder(args.dest / "text_encoders" / files.text_encoder, text, vision, args.device)
    if "vae" in args.only:
        total += write_vaes(args.dest / "vae" / files.video_vae, args.dest / "vae" / files.audio_vae, args.device)
    print(f"total: {total:,} bytes", flush=True)


if __name__ == "__main__":
    main()
