"""The released model's sizes as the memory plan sees them (no device needed), and the request and profile the plan
tests run on the CPU."""

from __future__ import annotations

from vflash_core import memory_plan as MP
from vflash_core.fileio import GIB
from vflash_core.pipeline.h3_pipeline import VideoRequest

# The released sizes: 50 blocks of 0.72 GiB, the text encoder with layers 0..49 (51.5 GB), both VAEs.
FULL = MP.PartSizes(
    core_blocks=50 * 770_725_376, core_block=770_725_376, core_auxiliary=int(1.5 * GIB),
    encoder=51_500_000_000, encoder_layers=48_800_000_000, encoder_layer=976_000_000, vaes=6_170_000_000,
)
LARGEST = {"encode": int(0.5 * GIB), "denoise": int(5.5 * GIB), "decode.diffusers": int(6.3 * GIB), "decode.native": int(3.2 * GIB)}
PROFILE = "t2va-base4-exact-cpu"
REQUEST = VideoRequest("A train crosses a snowy bridge, whistle echoing.", seed=4, width=96, height=64)


def placement_choice(plan: MP.MemoryPlan) -> tuple:
    """What the plan chose for each part, and whether the largest request fits."""
    p = plan.placement
    return p.core, p.encoder, p.vaes, p.video_decoder, plan.fits_largest
