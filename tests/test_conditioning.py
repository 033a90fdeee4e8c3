"""The conditioner loads only what `hidden_states[50]` needs, and gives exactly the full Qwen3-VL's `hidden_states[50]`."""

from __future__ import annotations

import numpy as np
import torch
from conftest import assert_bitwise
from PIL import Image

from vflash_core.media.conditioning import TEXT_ENCODER_LAYER, TextConditioner


def test_pruned_encoder_equals_the_full_encoder_bit_for_bit(h3_family):
    from transformers import Qwen3VLForConditionalGeneration

    conditioner = TextConditioner.from_pretrained(h3_family, "cpu")
    names = set(conditioner.text_encoder.state_dict())
    layers = {int(n.split(".")[2]) for n in names if n.startswith("language_model.layers.")}
    assert layers == set(range(TEXT_ENCODER_LAYER))  # no later layer, no LM head, no final norm ever loaded
    assert not any(n.startswith("lm_head") or n == "language_model.norm.weight" for n in names)

    full = Qwen3VLForConditionalGeneration.from_pretrained(h3_family / "text_encoder", dtype=torch.float32).eval()
    assert full.config.text_config.num_hidden_layers > TEXT_ENCODER_LAYER + 1
    image = Image.fromarray((np.random.default_rng(0).random((256, 448, 3)) * 255).astype(np.uint8))
    for keyframes in ([], [image]):  # text only, and a vision block with Qwen's deepstack features
        ids, _, vision = conditioner.keyframe_presentation("A robot dances in the rain.", keyframes)
        input_ids = torch.tensor([ids])
        types = torch.zeros_like(input_ids)
        types[input_ids == conditioner._ids["image"]] = 1
        with torch.no_grad():
            expected = full.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                                  use_cache=False, output_hidden_states=True, **vision).hidden_states[TEXT_ENCODER_LAYER][0]
        assert_bitwise(conditioner.encode_tokens(ids, vision), expected, f"hidden_states[50] with {len(keyframes)} keyframes")


def test_a_family_written_with_only_the_read_text_layers_encodes_as_the_whole_one(h3_family, tmp_path):
    """`FamilySpec.text_layers_written` (the full-size benchmarks' staging) leaves out what H3 never reads, nothing else."""
    from dataclasses import replace

    from safetensors import safe_open

    from vflash_core.weights.family import DEMO_FAMILY, build_model_family

    root = build_model_family(tmp_path / "model", replace(DEMO_FAMILY, text_layers_written=TEXT_ENCODER_LAYER), seed=0, with_ref=False, parts=("text", "index"))
    names = set()
    for path in (root / "text_encoder").glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    assert "lm_head.weight" not in names and f"model.language_model.layers.{TEXT_ENCODER_LAYER - 1}.mlp.up_proj.weight" in names
    assert not any(n.startswith(f"model.language_model.layers.{TEXT_ENCODER_LAYER}.") for n in names)
    trimmed, whole = TextConditioner.from_pretrained(root, "cpu"), TextConditioner.from_pretrained(h3_family, "cpu")
    prompt = "A robot dances in the rain."
    assert_bitwise(trimmed.encode(prompt).prompt_embeds, whole.encode(prompt).prompt_embeds, "hidden_states[50]")


def test_a_family_cannot_leave_out_text_layers_h3_reads(tmp_path):
    from dataclasses import replace

    import pytest

    from vflash_core.weights.family import DEMO_FAMILY, build_model_family

    with pytest.raises(ValueError, match="text_layers_written must be 50..52"):
        build_model_family(tmp_path / "model", replace(DEMO_FAMILY, text_layers_written=49), parts=("text",))
