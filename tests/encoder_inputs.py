"""The text encoder's outputs the streaming tests compare: hidden_states[50] of a prompt alone and with a picture."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vflash_core.media.conditioning import TextConditioner

PROMPT = "A robot dances in the rain."


def keyframe_image() -> Image.Image:
    return Image.fromarray((np.random.default_rng(0).random((256, 448, 3)) * 255).astype(np.uint8))


def encodings(conditioner: TextConditioner) -> list[torch.Tensor]:
    """hidden_states[50] of a text-only presentation and of one with a picture (the vision tower's deepstack)."""
    outputs = []
    for keyframes in ([], [keyframe_image()]):
        ids, _, vision = conditioner.keyframe_presentation(PROMPT, keyframes)
        outputs.append(conditioner.encode_tokens(ids, vision))
    return outputs
