"""Weight residency on the CPU: the segmented pinned arena (unpinned here), its scoped memory maps and the block ring's
slot rotation (synchronous copies on the CPU, events on CUDA). GPU behaviour is in test_gpu.py; the memory plan and
the fit checks in test_memory_plan.py."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from bundles import keyframe_bundle
from conftest import assert_bitwise

from vflash_core import NativeEngineSession
from vflash_core.engine import residency as R
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.engine.engine_options import EngineOptions

PROFILE = "t2va-base4-exact-cpu"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("segment_blocks", [1, 2])
def test_arena_holds_every_block_exactly_and_closes_its_maps(tiny_compiled, monkeypatch, segment_blocks):
    artifact = CompiledArtifact(**tiny_compiled)
    _, block_bytes = R.block_layout(artifact)
    monkeypatch.setattr(R, "_SEGMENT_BYTES", segment_blocks * block_bytes)
    before = _fds()
    arena = R.BlockArena(artifact, pin=False)
    assert _fds() == before, "memory maps and files must be closed after the scoped load"
    assert len(arena.segments) == -(-artifact.config.num_layers // segment_blocks)
    assert arena.nbytes == artifact.config.num_layers * block_bytes  # no per-block padding beyond alignment
    ring = R.BlockRing(arena, torch.device("cpu"))
    for i, weights in enumerate(ring):
        expected = artifact.read_block(i)
        for name, tensor in expected.tensors.items():
            assert_bitwise(weights[name], tensor, f"block {i} {name}")
    assert ring.device_weight_bytes == 2 * block_bytes


def test_a_closed_arena_lets_its_segments_go_while_something_still_holds_it(tiny_compiled):
    """A closed session's arena must free its (pinned) segments before the session empties the host allocator's
    cache, even where a ring or a reference cycle keeps the arena object alive."""
    arena = R.BlockArena(CompiledArtifact(**tiny_compiled), pin=False)
    ring = R.BlockRing(arena, torch.device("cpu"))
    segments = [weakref.ref(s) for s in arena.segments]
    arena.close()
    ring.close()
    assert ring.source is arena and all(ref() is None for ref in segments), "the arena's segments outlive its close"


def test_block_ring_equals_resident_and_reuses_its_buffers(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as resident:
        expected = resident.generate(keyframe_bundle(6))
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(weight_residency="block-ring")) as ring_session:
        ring = ring_session._denoisers[0].blocks
        pointers = [slot.data_ptr() for slot in ring.slots] + [seg.data_ptr() for seg in ring.source.segments]
        gc.collect()
        live_before = len(gc.get_objects())
        for _ in range(20):
            got = ring_session.generate(keyframe_bundle(6))
        gc.collect()
        assert len(gc.get_objects()) - live_before < 200, "objects accumulate across requests"
        assert [slot.data_ptr() for slot in ring.slots] + [seg.data_ptr() for seg in ring.source.segments] == pointers
        assert got.metadata["weight_residency"] == "block-ring" and got.metadata["memory"]["blocks_on_device"] == 2
    assert_bitwise(got.video_latents, expected.video_latents, "block-ring vs resident")
    assert_bitwise(got.audio_latents, expected.audio_latents, "block-ring vs resident audio")
    assert ring.slots == [] and ring_session.closed  # released by close()


def test_failed_request_closes_nothing_it_should_not(tiny_compiled):
    class Interrupt(BaseException):
        pass

    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(weight_residency="block-ring")) as session:
        def interrupt(done, total):
            raise Interrupt()

        with pytest.raises(Interrupt):
            session.generate(keyframe_bundle(6), progress=interrupt)
        again = session.generate(keyframe_bundle(6))  # the ring is reusable after an interrupt
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as resident:
        assert_bitwise(again.video_latents, resident.generate(keyframe_bundle(6)).video_latents, "after an interrupt")
