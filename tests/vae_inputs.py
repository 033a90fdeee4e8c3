"""Inputs and probes of the video decoder tests: seeded latents, the small tile geometry, and the sizes of the
allocations a decode makes."""

from __future__ import annotations

import torch

# 64 px tiles with 32 px overlaps: 9 x 10 latents are 4 x 4 tiles; 13 frames end with repeated latents.
SMALL_TILES = (64, 64, 32, 32)


def latents(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def allocation_sizes(fn) -> list[int]:
    """The size of every CPU allocation `fn` makes, from the profiler's record."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
