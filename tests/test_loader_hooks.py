"""The trusted Python loader hooks: `native_denoiser_loader` and `block_loader` (session, pipeline) and
`text_encoder_loader` (pipeline).

A hook is a Python callable given by the caller (never a name resolved to code). What it returns is checked before use;
what it raises propagates unchanged, releases whatever was loaded before it, and leaves the pipeline usable: the next
`load` calls the loaders again.
"""

from __future__ import annotations

import pytest
import torch
from bundles import keyframe_bundle
from conftest import assert_bitwise

from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.model import LayerWeights
from vflash_core.engine.residency import ResidentBlocks
from vflash_core.engine.session import NativeEngineSession
from vflash_core.engine.session_hooks import DenoiserLoad, SessionHooks
from vflash_core.errors import VflashError

PROFILE = "t2va-base4-exact-cpu"


@pytest.fixture(scope="module")
def expected(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        return session.generate(keyframe_bundle(6))


def read_blocks(artifact: CompiledArtifact, device: torch.device) -> list[LayerWeights]:
    return [LayerWeights({k: v.to(device) for k, v in w.tensors.items()}, w.loras) for w in artifact.iter_blocks()]


# -- block_loader ----------------------------------------------------------------------------------------------------


def test_block_loader_supplies_the_resident_stack(tiny_compiled, expected):
    calls = []

    def loader(artifact, device):
        calls.append((artifact.compile_id, device))
        return read_blocks(artifact, device)

    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(block_loader=loader)) as session:
        got = session.generate(keyframe_bundle(6))
        assert session.weight_residency == "resident"
    assert calls == [(CompiledArtifact(**tiny_compiled).compile_id, torch.device("cpu"))]
    assert_bitwise(got.video_latents, expected.video_latents, "block_loader")
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head"), hooks=SessionHooks(block_loader=loader)) as group:
        assert_bitwise(group.generate(keyframe_bundle(6)).video_latents, expected.video_latents, "block_loader, sequence-head")


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
        from vflash_core.engine.model import LoraResidual

        blocks[0] = LayerWeights(blocks[0].tensors, {"attn.out": (LoraResidual(torch.zeros(1, w.shape[1], dtype=w.dtype), torch.zeros(w.shape[0], 1, dtype=w.dtype), 1.0),)})
        return blocks

    for loader, message in ((short, "returned 1 blocks; the artifact has 2"), (wrong_dtype, "block 1 ffn.in.weight is torch.float32"),
                            (missing, "block 0 holds"), (extra_lora, "LoRA residuals on .'attn.out'.")):
        with pytest.raises(VflashError, match=message):
            NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(block_loader=loader))


def test_hooks_are_refused_where_they_cannot_apply(tiny_compiled):
    def loader(artifact, device):
        return read_blocks(artifact, device)

    def denoiser_loader(artifact, load):
        return Denoiser(artifact, ResidentBlocks(artifact, load.device), load.device, load.ops)

    with pytest.raises(VflashError, match="must be a Python callable, got str"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(block_loader="my_module.load_blocks"))
    with pytest.raises(VflashError, match="not both"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(block_loader=loader, native_denoiser_loader=denoiser_loader))
    with pytest.raises(VflashError, match="tensor strategy shards them"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="tensor"), hooks=SessionHooks(block_loader=loader))
    with pytest.raises(VflashError, match="single-device only"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head"), hooks=SessionHooks(native_denoiser_loader=denoiser_loader))
    with pytest.raises(VflashError, match="loads the resident block stack; this session's blocks are block-ring"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(weight_residency="block-ring"), hooks=SessionHooks(block_loader=loader))


# -- native_denoiser_loader ------------------------------------------------------------------------------------------


def test_native_denoiser_loader_builds_the_denoiser(tiny_compiled, expected):
    handed: list[DenoiserLoad] = []
    progress: list[tuple[int, int]] = []

    def loader(artifact, load):
        handed.append(load)
        return Denoiser(artifact, ResidentBlocks(artifact, load.device, load.on_block), load.device, load.ops)

    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(native_denoiser_loader=loader, on_load_progress=lambda done, total: progress.append((done, total)))) as session:
        got = session.generate(keyframe_bundle(6))
    (load,) = handed
    assert load.device == torch.device("cpu") and type(load.ops).__name__ == "BlockOps"
    assert progress == [(1, 2), (2, 2)]
    assert_bitwise(got.video_latents, expected.video_latents, "native_denoiser_loader")


def test_native_denoiser_loader_results_are_checked(tiny_compiled):
    with pytest.raises(VflashError, match="must return a vflash_core.engine.denoise.Denoiser, got dict"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(native_denoiser_loader=lambda artifact, load: {}))
    other = CompiledArtifact(**tiny_compiled)
    with pytest.raises(VflashError, match="another artifact or device"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), hooks=SessionHooks(native_denoiser_loader=lambda artifact, load: Denoiser(other, ResidentBlocks(other, load.device), load.device, load.ops)))


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
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head"), hooks=SessionHooks(block_loader=block_loader))
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:  # nothing held on to: a new session works
        assert_bitwise(session.generate(keyframe_bundle(6)).video_latents, expected.video_latents, "after a failed load")


# -- the pipeline ------------------------------------------------------------------------------------------------------


def _request():
    from vflash_core.pipeline.h3_pipeline import VideoRequest

    return VideoRequest("A lighthouse beam sweeps the fog.", seed=9, width=96, height=64)


def full_text_encoder(root):
    """What a user's loader might do: the whole released `Qwen3VLForConditionalGeneration` (all layers, LM head)."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=torch.bfloat16, local_files_only=True)


def test_text_encoder_loader_is_trimmed_and_encodes_as_the_default(h3_family):
    from vflash_core.media.conditioning import TEXT_ENCODER_LAYER, TextConditioner

    roots = []

    def loader(root):
        roots.append(root)
        return full_text_encoder(root)

    loaded = TextConditioner.from_pretrained(h3_family, text_encoder_loader=loader)
    default = TextConditioner.from_pretrained(h3_family)
    assert roots == [h3_family.resolve()]
    base = loaded.text_encoder
    assert type(base).__name__ == "Qwen3VLModel" and len(base.language_model.layers) == TEXT_ENCODER_LAYER  # no LM head, 50 layers
    assert isinstance(base.language_model.norm, torch.nn.Identity) and base.dtype == default.text_encoder.dtype
    prompt = "A lighthouse beam sweeps the fog."
    assert_bitwise(loaded.encode(prompt).prompt_embeds, default.encode(prompt).prompt_embeds, "hidden_states[50]")


def test_a_loaded_text_encoder_in_bf16_keeps_its_fp32_rotary_frequencies(h3_family):
    """The GPU dtype: the conditioner casts a loader's model to bf16 without rounding its rotary frequencies, which
    `from_pretrained(dtype=bf16)` computes in fp32 (an H200 run found the capped pipelines' MP4s differing)."""
    from vflash_core.media.conditioning import TextConditioner

    loaded = TextConditioner.from_pretrained(h3_family, dtype=torch.bfloat16, text_encoder_loader=full_text_encoder)
    default = TextConditioner.from_pretrained(h3_family, dtype=torch.bfloat16)
    assert {n: b.dtype for n, b in loaded.text_encoder.named_buffers()} == {n: b.dtype for n, b in default.text_encoder.named_buffers()}
    prompt = "A lighthouse beam sweeps the fog."
    assert_bitwise(loaded.encode(prompt).prompt_embeds, default.encode(prompt).prompt_embeds, "hidden_states[50] in bf16")
    with pytest.raises(VflashError, match=r"rotary frequencies in torch.bfloat16 \(.*inv_freq\); load the model with from_pretrained"):
        TextConditioner.from_pretrained(h3_family, dtype=torch.bfloat16, text_encoder_loader=lambda root: full_text_encoder(root).to(torch.bfloat16))


def test_text_encoder_loader_results_are_checked(h3_family):
    from transformers import AutoConfig, Qwen3VLModel

    from vflash_core.media.conditioning import TextConditioner

    with pytest.raises(VflashError, match="must return a Qwen3VLModel or Qwen3VLForConditionalGeneration, got Linear"):
        TextConditioner.from_pretrained(h3_family, text_encoder_loader=lambda root: torch.nn.Linear(2, 2))
    config = AutoConfig.from_pretrained(h3_family / "text_encoder", local_files_only=True)
    config.text_config.intermediate_size *= 2
    with pytest.raises(VflashError, match=r"another architecture .*text_config.intermediate_size 128 \(config.json: 64\)"):
        TextConditioner.from_pretrained(h3_family, text_encoder_loader=lambda root: Qwen3VLModel(config))
    config.text_config.intermediate_size //= 2
    config.text_config.num_hidden_layers = 49
    with pytest.raises(VflashError, match="returned 49 text layers"):
        TextConditioner.from_pretrained(h3_family, text_encoder_loader=lambda root: Qwen3VLModel(config))


def test_pipeline_with_every_hook_generates_the_default_clip(h3_prepared):
    from vflash_core.pipeline.h3_pipeline import H3Pipeline

    def denoiser_loader(artifact, load):
        return Denoiser(artifact, ResidentBlocks(artifact, load.device, load.on_block), load.device, load.ops)

    with H3Pipeline.from_prepared(h3_prepared) as default:
        expected = default.generate(_request(), None).media
    for hooks in ({"text_encoder_loader": full_text_encoder, "block_loader": read_blocks}, {"native_denoiser_loader": denoiser_loader}):
        with H3Pipeline.from_prepared(h3_prepared, **hooks) as pipeline:
            got = pipeline.generate(_request(), None).media
        assert_bitwise(got.frames, expected.frames, f"frames with {sorted(hooks)}")
        assert_bitwise(got.waveform, expected.waveform, f"waveform with {sorted(hooks)}")


def test_pipeline_hooks_are_code_not_names(h3_prepared):
    from vflash_core.pipeline.h3_pipeline import H3Pipeline

    for name in ("text_encoder_loader", "native_denoiser_loader", "block_loader"):
        with pytest.raises(VflashError, match=f"{name} must be a Python callable, got str"):
            H3Pipeline.from_prepared(h3_prepared, **{name: "package.module:function"})


@pytest.mark.parametrize("failing", ["text_encoder_loader", "block_loader", "native_denoiser_loader"])
def test_a_loader_exception_leaves_the_pipeline_usable(h3_prepared, monkeypatch, failing):
    """The hook's own exception reaches the caller from `load`; what loaded before it is released; the pipeline stays
    open, and the next `load` (the hook succeeds this time) gives a working pipeline."""
    from vflash_core.media.conditioning import TextConditioner
    from vflash_core.media.vae import MediaVAEs
    from vflash_core.pipeline.h3_pipeline import H3Pipeline

    class Flaky(OSError):
        pass

    calls = []
    regular = {
        "text_encoder_loader": full_text_encoder,
        "block_loader": read_blocks,
        "native_denoiser_loader": lambda artifact, load: Denoiser(artifact, ResidentBlocks(artifact, load.device), load.device, load.ops),
    }

    def hook(*args):
        calls.append(args)
        if len(calls) == 1:
            raise Flaky("network share unavailable")
        return regular[failing](*args)

    closed = []
    for part in (TextConditioner, MediaVAEs):
        monkeypatch.setattr(part, "close", lambda self, original=part.close: (closed.append(type(self).__name__), original(self))[1])
    pipeline = H3Pipeline.from_prepared(h3_prepared, **{failing: hook})
    with pytest.raises(Flaky, match="network share unavailable"):
        pipeline.load()
    assert not pipeline.loaded and pipeline.session is None
    assert closed == ([] if failing == "text_encoder_loader" else ["TextConditioner", "MediaVAEs"])
    pipeline.validate(_request())  # still open
    result = pipeline.generate(_request(), None)  # loads again: the hook succeeds
    assert len(calls) == 2 and result.num_frames == 124
    pipeline.close()
