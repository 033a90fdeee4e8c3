"""The trusted Python loader hooks: `native_denoiser_loader` and `block_loader` (session, pipeline) and
`text_encoder_loader` (pipeline).

A hook is a Python callable given by the caller (never a name resolved to code). What it returns is checked before use;
what it raises propagates unchanged, releases whatever was loaded before it, and leaves the pipeline usable: the next
`prepare` calls the loaders again.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise
from test_schedule_layout_bundle import _bundle

from vflash_core.artifact import CompiledArtifact
from vflash_core.denoise import Denoiser
from vflash_core.errors import VflashError
from vflash_core.model import LayerWeights
from vflash_core.residency import ResidentBlocks
from vflash_core.session import DenoiserLoad, NativeEngineSession

PROFILE = "t2va-base4-exact-cpu"


@pytest.fixture(scope="module")
def expected(tiny_compiled):
    with NativeEngineSession(PROFILE, **tiny_compiled) as session:
        return session.generate(_bundle(6))


def read_blocks(artifact: CompiledArtifact, device: torch.device) -> list[LayerWeights]:
    return [LayerWeights({k: v.to(device) for k, v in w.tensors.items()}, w.loras) for w in artifact.iter_blocks()]


# -- block_loader ----------------------------------------------------------------------------------------------------


def test_block_loader_supplies_the_resident_stack(tiny_compiled, expected):
    calls = []

    def loader(artifact, device):
        calls.append((artifact.compile_id, device))
        return read_blocks(artifact, device)

    with NativeEngineSession(PROFILE, **tiny_compiled, block_loader=loader) as session:
        got = session.generate(_bundle(6))
        assert session.weight_residency == "resident"
    assert calls == [(CompiledArtifact(**tiny_compiled).compile_id, torch.device("cpu"))]
    assert_bitwise(got.video_latents, expected.video_latents, "block_loader")
    with NativeEngineSession(PROFILE, **tiny_compiled, block_loader=loader, peer_device="cpu", strategy="sequence-head") as group:
        assert_bitwise(group.generate(_bundle(6)).video_latents, expected.video_latents, "block_loader, sequence-head")


def test_block_loader_results_are_checked(tiny_compiled):
    def short(artifact, device):
        return read_blocks(artifact, device)[:-1]

    def wrong_dtype(artifact, device):
        blocks = read_blocks(artifact, device)
        blocks[1].tensors["ffn.in.weight"] = blocks[1].tensors["ffn.in.weight"].float()
        return blocks

    def missing(artifact, device):
        blocks = read_blocks(artifact, device)
        del blocks[0].tensors["norm2.weight"]
        return blocks

    def extra_lora(artifact, device):
        blocks = read_blocks(artifact, device)
        w = blocks[0].tensors["attn.out.weight"]
        from vflash_core.model import LoraResidual

        blocks[0] = LayerWeights(blocks[0].tensors, {"attn.out": (LoraResidual(torch.zeros(1, w.shape[1], dtype=w.dtype), torch.zeros(w.shape[0], 1, dtype=w.dtype), 1.0),)})
        return blocks

    for loader, message in ((short, "returned 1 blocks; the artifact has 2"), (wrong_dtype, "block 1 ffn.in.weight is torch.float32"),
                            (missing, "block 0 holds"), (extra_lora, "LoRA residuals on .'attn.out'.")):
        with pytest.raises(VflashError, match=message):
            NativeEngineSession(PROFILE, **tiny_compiled, block_loader=loader)


def test_hooks_are_refused_where_they_cannot_apply(tiny_compiled):
    def loader(artifact, device):
        return read_blocks(artifact, device)

    def denoiser_loader(artifact, load):
        return Denoiser(artifact, ResidentBlocks(artifact, load.device), load.device, load.ops)

    with pytest.raises(VflashError, match="must be a Python callable, got str"):
        NativeEngineSession(PROFILE, **tiny_compiled, block_loader="my_module.load_blocks")
    with pytest.raises(VflashError, match="not both"):
        NativeEngineSession(PROFILE, **tiny_compiled, block_loader=loader, native_denoiser_loader=denoiser_loader)
    with pytest.raises(VflashError, match="tensor strategy shards them"):
        NativeEngineSession(PROFILE, **tiny_compiled, block_loader=loader, peer_device="cpu", strategy="tensor")
    with pytest.raises(VflashError, match="single-device only"):
        NativeEngineSession(PROFILE, **tiny_compiled, native_denoiser_loader=denoiser_loader, peer_device="cpu", strategy="sequence-head")
    with pytest.raises(VflashError, match="loads the resident block stack; this session's blocks are block-ring"):
        NativeEngineSession(PROFILE, **tiny_compiled, block_loader=loader, weight_residency="block-ring")


# -- native_denoiser_loader ------------------------------------------------------------------------------------------


def test_native_denoiser_loader_builds_the_denoiser(tiny_compiled, expected):
    handed: list[DenoiserLoad] = []
    progress: list[tuple[int, int]] = []

    def loader(artifact, load):
        handed.append(load)
        return Denoiser(artifact, ResidentBlocks(artifact, load.device, load.on_block), load.device, load.ops)

    with NativeEngineSession(PROFILE, **tiny_compiled, native_denoiser_loader=loader, on_load_progress=lambda done, total: progress.append((done, total))) as session:
        got = session.generate(_bundle(6))
    (load,) = handed
    assert load.device == torch.device("cpu") and type(load.ops).__name__ == "BlockOps"
    assert progress == [(1, 2), (2, 2)]
    assert_bitwise(got.video_latents, expected.video_latents, "native_denoiser_loader")


def test_native_denoiser_loader_results_are_checked(tiny_compiled):
    with pytest.raises(VflashError, match="must return a vflash_core.denoise.Denoiser, got dict"):
        NativeEngineSession(PROFILE, **tiny_compiled, native_denoiser_loader=lambda artifact, load: {})
    other = CompiledArtifact(**tiny_compiled)
    with pytest.raises(VflashError, match="another artifact or device"):
        NativeEngineSession(PROFILE, **tiny_compiled, native_denoiser_loader=lambda artifact, load: Denoiser(other, ResidentBlocks(other, load.device), load.device, load.ops))


def test_a_failing_loader_releases_the_session_and_raises_its_own_error(tiny_compiled, expected):
    class Broken(RuntimeError):
        pass

    loaded = []

    def block_loader(artifact, device):
        if device == torch.device("cpu") and loaded:
            raise Broken("disk unplugged")
        loaded.append(device)
        return read_blocks(artifact, device)

    with pytest.raises(Broken, match="disk unplugged"):  # rank 0 loaded, rank 1's loader fails
        NativeEngineSession(PROFILE, **tiny_compiled, block_loader=block_loader, peer_device="cpu", strategy="sequence-head")
    with NativeEngineSession(PROFILE, **tiny_compiled) as session:  # nothing held on to: a new session works
        assert_bitwise(session.generate(_bundle(6)).video_latents, expected.video_latents, "after a failed load")
