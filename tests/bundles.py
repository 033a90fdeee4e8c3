"""A small conditioning bundle of the tiny model: the input of the tests that drive the engine below the pipeline.

Light on purpose (torch and `vflash_core` only): the child processes of the fused-path and FP8 tests import it."""

from __future__ import annotations

import torch

from vflash_core import ConditioningBundle, Geometry, build_keyframe_bundle
from vflash_core.engine.config import H3Config

TINY = H3Config.preset("tiny")


def keyframe_bundle(seed: int = 0, num_frames: int = 124, height: int = 64, width: int = 96) -> ConditioningBundle:
    """An l2va bundle of the tiny model (on a 64x96 canvas unless told): 5 text rows, the last frame's keyframe latent."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(5, TINY.text_dim, generator=g).to(torch.bfloat16)
    keyframe = torch.randn(1, 24, 1, height // 16, width // 16, generator=g)
    return build_keyframe_bundle(embeds, torch.ones(5, dtype=torch.long), Geometry(height, width, num_frames), TINY, g, (keyframe,), ("last",), seed=seed)
