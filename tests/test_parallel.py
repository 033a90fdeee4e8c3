"""Sequence-head over several ranks: bookkeeping for 2, 4 and 8 ranks, relayouts, and whole trajectories on CPU ranks
(Gloo in threads stands in for NCCL on GPUs) that must equal the single-device result bit for bit; plus stop and
fault handling. The same code runs on GPUs under `pytest -m multigpu` (see test_gpu.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from bundles import keyframe_bundle
from conftest import TINY, assert_bitwise, compile_tiny

from vflash_core import Geometry, NativeEngineSession, build_keyframe_bundle
from vflash_core.engine import parallel as P
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.errors import SessionClosedError, VflashError
from vflash_core.weights import synthetic

PROFILE = "t2va-base4-exact-cpu"
# Eight heads so 2, 4 and 8 ranks divide them; keeps inner (128) != hidden (24) and partial rotary.
WIDE = replace(TINY, num_attention_heads=8)


@pytest.mark.parametrize("total,ranks", [(10, 2), (11, 2), (37_811, 2), (9, 4), (73_898, 8), (3, 4)])
def test_split_rows_is_contiguous_and_balanced(total, ranks):
    bounds = P.split_rows(total, ranks)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_head_groups():
    assert P.head_groups(56, 2) == [(0, 28), (28, 56)]
    assert P.head_groups(56, 8)[-1] == (49, 56) and len(P.head_groups(56, 4)) == 4
    with pytest.raises(VflashError, match=r"56 attention heads cannot be split over 3 GPUs; use a GPU count in \[1, 2, 4, 7, 8, 14, 28, 56\]"):
        P.head_groups(56, 3)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_relayout_round_trip(ranks):
    heads, s_r, d = 56, 13, 8
    x = torch.randn(s_r, 3 * heads, d)[:, heads : 2 * heads]  # a strided view, as q/k/v are inside the fused QKV
    send = P.pack_heads_reference(x, torch.empty(ranks, s_r, heads // ranks, d))
    for j in range(ranks):
        assert_bitwise(send[j], x[:, j * heads // ranks : (j + 1) * heads // ranks], f"destination {j}")
    assert_bitwise(P.merge_heads_reference(send, torch.empty(s_r, heads, d)), x, "merge(pack(x))")


@pytest.fixture(scope="module")
def wide_compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wide")
    folder = synthetic.write_diffusers_transformer(tmp / "t", WIDE, synthetic.random_internal_weights(WIDE, seed=5))
    return compile_tiny(tmp, folder, PROFILE)


def _wide_bundle(seed: int, frames: int = 124):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(7, WIDE.text_dim, generator=g).to(torch.bfloat16)
    keyframe = torch.randn(1, WIDE.in_channels, 1, 4, 6, generator=g)
    return build_keyframe_bundle(embeds, torch.ones(7, dtype=torch.long), Geometry(64, 96, frames), WIDE, g, (keyframe,), ("first",))


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_sequence_head_equals_single_device(wide_compiled, ranks):
    bundle = _wide_bundle(1)
    assert bundle.layout.sequence_length % ranks  # uneven split on purpose
    with NativeEngineSession(PROFILE, CompiledPaths(**wide_compiled)) as single:
        expected = single.generate(bundle)
    with NativeEngineSession(PROFILE, CompiledPaths(**wide_compiled), EngineOptions(peer_device=["cpu"] * (ranks - 1), strategy="sequence-head")) as group:
        got = group.generate(bundle)
        assert got.metadata["strategy"] == "sequence-head" and len(got.metadata["devices"]) == ranks
    assert_bitwise(got.video_latents, expected.video_latents, "video latents")
    assert_bitwise(got.audio_latents, expected.audio_latents, "audio latents")


def test_rank_count_must_divide_heads(tiny_compiled):
    with pytest.raises(VflashError, match="cannot be split over 3 GPUs"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device=["cpu", "cpu"], strategy="sequence-head"))
    with pytest.raises(VflashError, match="need strategy"):
        NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu"))


class Abort(BaseException):
    pass


def test_stop_at_evaluation_boundary_keeps_group_usable(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head")) as session:
        seen = []

        def stop_at_two(done, total):
            seen.append(done)
            if done == 2:
                raise Abort()

        with pytest.raises(Abort):
            session.generate(keyframe_bundle(4), progress=stop_at_two)
        assert seen == [1, 2]
        polls = []

        def interrupt():
            polls.append(1)
            if len(polls) == 3:  # mid-evaluation on rank 0: honoured at the end of that evaluation
                raise Abort()

        with pytest.raises(Abort):
            session.generate(keyframe_bundle(4), between_blocks=interrupt)
        after = session.generate(keyframe_bundle(4))
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as single:
        assert_bitwise(after.video_latents, single.generate(keyframe_bundle(4)).video_latents, "after a stop")


def test_fault_on_rank_one_aborts_both_and_fails_the_session(tiny_compiled, monkeypatch):
    session = NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled), EngineOptions(peer_device="cpu", strategy="sequence-head", collective_timeout_seconds=5))
    original = P.SequenceHeadAttention.__call__
    calls = []

    def faulty(self, q, k, v):
        if self.group.rank() == 1:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected fault on rank 1")
        return original(self, q, k, v)

    monkeypatch.setattr(P.SequenceHeadAttention, "__call__", faulty)
    start = time.perf_counter()
    with pytest.raises(P.RankFailure, match="rank 1 on cpu failed: RuntimeError: injected fault on rank 1"):
        session.generate(keyframe_bundle(2))
    assert time.perf_counter() - start < 30
    assert not [t for t in threading.enumerate() if t.name.startswith("vflash-rank")]
    with pytest.raises(SessionClosedError, match="failed earlier"):
        session.generate(keyframe_bundle(2))
    session.close()


# -- tensor ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_fp32(tmp_path_factory):
    """fp32 weights: tensor parallelism's partial sums then differ from one device only by fp32 reduction order."""
    tmp = tmp_path_factory.mktemp("wide32")
    folder = synthetic.write_diffusers_transformer(tmp / "t", WIDE, synthetic.random_internal_weights(WIDE, seed=6, dtype=torch.float32))
    return folder, compile_tiny(tmp, folder, PROFILE)


def test_tensor_shards_reassemble_the_block(wide_compiled):
    from vflash_core.engine.artifact import CompiledArtifact

    artifact = CompiledArtifact(**wide_compiled)
    block = artifact.read_block(1).tensors
    for ranks in (2, 4, 8):
        shards = [P.TensorShard(WIDE, r, ranks).tensors(block) for r in range(ranks)]
        for name in ("attn.out.weight", "ffn.out.weight"):
            assert_bitwise(torch.cat([s[name] for s in shards], dim=1), block[name], f"{name} over {ranks}")
        qkv = torch.stack([s["attn.qkv.weight"].unflatten(0, (3, -1)) for s in shards], dim=1).flatten(1, 2).flatten(0, 1)
        assert_bitwise(qkv, block["attn.qkv.weight"], f"qkv over {ranks}")
        value = torch.cat([s["ffn.in.weight"].chunk(2)[0] for s in shards])
        assert_bitwise(value, block["ffn.in.weight"].chunk(2)[0], f"ffn value over {ranks}")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("residency", ["resident", "block-ring"])
def test_tensor_strategy_matches_single_device(wide_fp32, ranks, residency):
    _, paths = wide_fp32
    bundle = _wide_bundle(2)
    bundle.prompt_embeds = bundle.prompt_embeds.float()
    with NativeEngineSession(PROFILE, CompiledPaths(**paths)) as single:
        expected = single.generate(bundle)
    with NativeEngineSession(PROFILE, CompiledPaths(**paths), EngineOptions(peer_device=["cpu"] * (ranks - 1), strategy="tensor", weight_residency=residency)) as group:
        got = group.generate(bundle)
    torch.testing.assert_close(got.video_latents, expected.video_latents, rtol=0, atol=2e-5)  # fp32 reduction order
    torch.testing.assert_close(got.audio_latents, expected.audio_latents, rtol=0, atol=2e-5)


def test_tensor_strategy_shards_lora_branches(tmp_path, wide_fp32):
    """A LoRA on every block linear (and AdaLN), fp32: the sharded branches sum to the single-device residual."""
    from conftest import cpu_profile
    from safetensors.torch import save_file

    from vflash_core.profiles import AdapterSpec

    folder, _ = wide_fp32
    g = torch.Generator().manual_seed(3)
    h, inner, f = WIDE.hidden_size, WIDE.inner_dim, WIDE.ffn_dim
    state = {}
    for i in range(WIDE.num_layers):
        for module, (out_f, in_f) in {"attn.qkv_proj": (3 * inner, h), "attn.out_proj": (h, inner), "mlp.fc1": (2 * f, h), "mlp.fc2": (h, f)}.items():
            state[f"blocks.{i}.{module}.lora_A.weight"] = torch.randn(4, in_f, generator=g) * 0.3
            state[f"blocks.{i}.{module}.lora_B.weight"] = torch.randn(out_f, 4, generator=g) * 0.3
    save_file(state, str(tmp_path / "lora.safetensors"), metadata={"alpha": "2"})
    profile = cpu_profile(id="t2va-lora-cpu", adapter=AdapterSpec("test", "lora.safetensors", 2.0, 4))
    paths = compile_tiny(tmp_path, folder, profile, adapter=tmp_path / "lora.safetensors")
    bundle = _wide_bundle(3)
    bundle.prompt_embeds = bundle.prompt_embeds.float()
    with NativeEngineSession(profile, CompiledPaths(**paths)) as single:
        expected = single.generate(bundle)
    with NativeEngineSession(profile, CompiledPaths(**paths), EngineOptions(peer_device="cpu", strategy="tensor")) as group:
        got = group.generate(bundle)
    torch.testing.assert_close(got.video_latents, expected.video_latents, rtol=0, atol=2e-5)


def test_tensor_strategy_shards_full_rank_delta_residuals(tmp_path, wide_fp32):
    """A full-rank `diff` delta stacked as a residual (its rows are the delta itself, no up factor), fp32: the
    sharded residuals sum to the single-device one."""
    from conftest import cpu_profile
    from safetensors.torch import save_file

    from vflash_core.weights.compiler import compile_receipt, prepare
    from vflash_core.weights.lora import LoraStack, StackedLora

    folder, _ = wide_fp32
    g = torch.Generator().manual_seed(4)
    h, inner, f = WIDE.hidden_size, WIDE.inner_dim, WIDE.ffn_dim
    shapes = {"attn.qkv_proj": (3 * inner, h), "attn.out_proj": (h, inner), "mlp.fc1": (2 * f, h), "mlp.fc2": (h, f)}
    state = {f"diffusion_model.blocks.{i}.{m}.diff": torch.randn(*s, generator=g) * 0.02 for i in range(WIDE.num_layers) for m, s in shapes.items()}
    save_file(state, str(tmp_path / "delta.safetensors"))
    profile = cpu_profile()
    prepare(profile, folder, tmp_path / "receipt.json", loras=LoraStack((StackedLora(str(tmp_path / "delta.safetensors"), 0.8),)))
    out = compile_receipt(tmp_path / "receipt.json", tmp_path / "compiled")
    paths = {"artifact": out / "artifact", "schedule_overlay": out / "schedule", "auxiliary": out / "auxiliary.safetensors"}
    bundle = _wide_bundle(4)
    bundle.prompt_embeds = bundle.prompt_embeds.float()
    with NativeEngineSession(profile, CompiledPaths(**paths)) as single:
        expected = single.generate(bundle)
    with NativeEngineSession(profile, CompiledPaths(**paths), EngineOptions(peer_device="cpu", strategy="tensor")) as group:
        got = group.generate(bundle)
    torch.testing.assert_close(got.video_latents, expected.video_latents, rtol=0, atol=2e-5)
    torch.testing.assert_close(got.audio_latents, expected.audio_latents, rtol=0, atol=2e-5)
