"""Measure ComfyUI core's MiniMax-H3 text conditioning against diffusers' `hidden_states[50]` on the same weights.

Run with ComfyUI's Python from a ComfyUI checkout (`cwd` = its root): builds a small random Qwen3-VL (the real
151,936-token vocabulary and the Qwen special tokens, 51 text layers of width 32) with transformers, writes it as a
Comfy-Org text-encoder file (`model.layers.*` / `visual.*`, truncated to 50 layers, as core's `CLIPLoader(type=
"minimax")` detects it), loads that with core's own loader and tokenizer, encodes prompts, and runs the transformers
model on core's token ids. Core's Qwen3-VL-32B dimensions are set to this family's before the load (core hard-codes
them); nothing else of core is changed. Prints one JSON line per dtype: rows, bitwise equality, max abs difference.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import ClassVar

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = ["A robot dances in the rain on a neon street at night, while drums and bass play.", "Waves crash on a rocky shore."]


def small_core_dimensions():
    from comfy.text_encoders import llama, qwen3vl

    @dataclasses.dataclass
    class Small(llama.Qwen3VL_32BConfig):
        hidden_size: int = 32
        intermediate_size: int = 64
        num_attention_heads: int = 2
        num_key_value_heads: int = 1
        head_dim = 16
        rope_dims: ClassVar[list[int]] = [2, 3, 3]  # a class attribute, as in core's config, not a field

    qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"] = Small
    qwen3vl.QWEN3VL_VISION["qwen3vl_32b"] = dict(hidden_size=32, intermediate_size=64, depth=2, deepstack_visual_indexes=[0, 1])
    qwen3vl.QWEN3VL_VISION_COMMON.update(num_heads=2, num_position_embeddings=256)


def hf_model(dtype):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=51, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                           out_hidden_size=32, num_position_embeddings=256, deepstack_visual_indexes=[0, 1]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.to(dtype)


def comfy_file(model) -> dict[str, torch.Tensor]:
    """HF Qwen3-VL -> Comfy-Org's MiniMax-H3 text-encoder layout: 50 layers, no final norm, no LM head."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model."):
            key = "model." + name[len("model.language_model."):]
            if key.startswith("model.layers.") and int(key.split(".")[2]) >= 50 or key == "model.norm.weight":
                continue
            out[key] = tensor.contiguous()
        elif name.startswith("model.visual."):
            out["visual." + name[len("model.visual."):]] = tensor.contiguous()
    return out


def main() -> None:
    sys.path.insert(0, ".")
    from comfy.cli_args import args

    args.cpu = True
    import comfy.sd

    small_core_dimensions()
    for label, dtype in DTYPES.items():
        model = hf_model(dtype)
        clip = comfy.sd.load_text_encoder_state_dicts([comfy_file(model)], clip_type=comfy.sd.CLIPType.MINIMAX)
        worst, equal, rows = 0.0, True, 0
        for prompt in PROMPTS:
            tokens = clip.tokenize(prompt)
            ids = [t[0] for t in tokens["qwen3vl_32b"][0]]
            cond = clip.encode_from_tokens_scheduled(tokens)[0]
            core = cond[0][0].float()
            with torch.no_grad():
                ref = model.model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), use_cache=False,
                                  output_hidden_states=True).hidden_states[50][0].float()
            assert core.shape == ref.shape, (core.shape, ref.shape)
            assert torch.equal(cond[1]["minimax_token_tags"].reshape(-1), torch.ones(len(ids), dtype=torch.long))
            equal &= torch.equal(core, ref)
            worst = max(worst, (core - ref).abs().max().item())
            rows += len(ids)
        scale = ref.abs().max().item()
        print(json.dumps({"dtype": label, "core_dtype": str(cond[0].dtype), "rows": rows, "bitwise_equal": bool(equal), "max_abs_diff": worst, "max_abs_value": scale}))


if __name__ == "__main__":
    main()
