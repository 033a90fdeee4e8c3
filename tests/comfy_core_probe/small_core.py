"""A small random MiniMax-H3 text encoder and VAE pair in Comfy-Org's file formats, for ComfyUI core's own loaders.

Core's H3 classes hard-code the released dimensions (Qwen3-VL-32B, the 2048-wide ViT video decoder, the BigVGAN audio
decoder), so a small family needs them set to its own: `patch()` does that, and nothing else, in a ComfyUI process
(the test server imports `small_core_node/`, which calls it; `measure_text.py` calls it directly). Channel counts
stay the released ones (24 video, 32 audio latent channels, 151,936-token vocabulary), so core's detection, tokenizer,
latent bookkeeping and normalisation buffers are the real ones.

`python small_core.py DEST` (ComfyUI's Python, cwd = the ComfyUI root) writes
`DEST/text_encoders/h3_small_te.safetensors`, `DEST/vae/h3_small_video_vae.safetensors` and
`DEST/vae/h3_small_audio_vae.safetensors`: the text encoder from a seeded transformers Qwen3-VL (written as core's
`CLIPLoader(type="minimax")` detects it: `model.layers.*` truncated to 50 layers, `visual.*`), the VAEs from core's own
modules at the small dimensions with seeded random weights.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import ClassVar

import torch

TEXT_WIDTH = 32  # the small transformer's text_dim


def patch() -> None:
    import comfy.ldm.minimax.vae as video_vae
    from comfy.ldm.minimax import audio_vae
    from comfy.text_encoders import llama, qwen3vl

    if getattr(video_vae, "_vflash_small", False):
        return

    @dataclasses.dataclass
    class SmallQwen3VL(llama.Qwen3VL_32BConfig):
        hidden_size: int = TEXT_WIDTH
        intermediate_size: int = 64
        num_attention_heads: int = 2
        num_key_value_heads: int = 1
        head_dim = 16
        rope_dims: ClassVar[list[int]] = [2, 3, 3]  # a class attribute, as in core's config, not a field

    qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"] = SmallQwen3VL
    qwen3vl.QWEN3VL_VISION["qwen3vl_32b"] = dict(hidden_size=32, intermediate_size=64, depth=2, deepstack_visual_indexes=[0, 1])
    qwen3vl.QWEN3VL_VISION_COMMON.update(num_heads=2, num_position_embeddings=256)

    decoder = video_vae.ViT3DDecoder

    class SmallDecoder(decoder):
        def __init__(self, patch_size=16, patch_size_t=4, in_channels=24, out_channels=3, num_layers=2, heads=2, dim_head=16, **kwargs):
            super().__init__(patch_size, patch_size_t, in_channels, out_channels, num_layers, heads, dim_head, **kwargs)

    video = video_vae.MiniMaxH3VideoVAE

    class SmallVideoVAE(video):
        def __init__(self, **kwargs):
            kwargs.setdefault("ch", 32)
            kwargs.setdefault("ch_mult", (1, 1, 1, 1, 1, 1))
            kwargs.setdefault("num_res_blocks", 1)
            super().__init__(**kwargs)

    audio = audio_vae.MiniMaxH3AudioVAE

    class SmallAudioVAE(audio):
        def __init__(self, encoder_dim=4, encoder_rates=(2, 4, 4, 5, 5), latent_dim=64, decoder_dim=128, vae_latent_channels=32):
            super().__init__(encoder_dim, encoder_rates, latent_dim, decoder_dim, vae_latent_channels)

    video_vae.ViT3DDecoder = SmallDecoder
    video_vae.MiniMaxH3VideoVAE = SmallVideoVAE
    audio_vae.MiniMaxH3AudioVAE = SmallAudioVAE
    video_vae._vflash_small = True


def _seeded(module: torch.nn.Module, seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in module.state_dict().items():
        if name.endswith(("latents_mean",)):
            out[name] = torch.zeros(tensor.shape)
        elif name.endswith(("latents_std", "norm.weight", "scale1", "scale2")) or ".norm" in name and name.endswith("weight"):
            out[name] = torch.ones(tensor.shape)
        else:
            out[name] = (torch.randn(tensor.shape, generator=g) * std).to(tensor.dtype if tensor.is_floating_point() else torch.float32)
    return out


def text_encoder_state(dtype: torch.dtype = torch.float32):
    """(transformers Qwen3-VL, its weights in Comfy-Org's MiniMax-H3 text-encoder layout)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=51, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                           out_hidden_size=TEXT_WIDTH, num_position_embeddings=256, deepstack_visual_indexes=[0, 1]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(dtype)
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model."):
            key = "model." + name[len("model.language_model."):]
            if key == "model.norm.weight" or key.startswith("model.layers.") and int(key.split(".")[2]) >= 50:
                continue
            out[key] = tensor.contiguous()
        elif name.startswith("model.visual."):
            out["visual." + name[len("model.visual."):]] = tensor.contiguous()
    return model, out


def write_files(dest: Path) -> None:
    from safetensors.torch import save_file

    sys.path.insert(0, ".")
    from comfy.cli_args import args

    args.cpu = True
    patch()
    import comfy.ldm.minimax.vae as video_vae
    import comfy.ops
    from comfy.ldm.minimax import audio_vae

    (dest / "text_encoders").mkdir(parents=True, exist_ok=True)
    (dest / "vae").mkdir(parents=True, exist_ok=True)
    _, te = text_encoder_state()
    save_file(te, str(dest / "text_encoders" / "h3_small_te.safetensors"))
    video = video_vae.MiniMaxH3VideoVAE(operations=comfy.ops.manual_cast)
    save_file(_seeded(video, 1, 0.05), str(dest / "vae" / "h3_small_video_vae.safetensors"))
    audio = audio_vae.MiniMaxH3AudioVAE()
    save_file(_seeded(audio, 2, 0.05), str(dest / "vae" / "h3_small_audio_vae.safetensors"))


if __name__ == "__main__":
    write_files(Path(sys.argv[1]))
