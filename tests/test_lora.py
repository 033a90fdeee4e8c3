"""LoRA as a separate residual, against diffusers 0.42.1 + peft loading the same file.

Formats (original/kohya with per-module alpha, musubi, DiffSynth, diffusers/peft, peft dumps) must parse into the
same factors peft ends up with; scale semantics (tensor alpha folded, metadata network alpha per module rank, none)
must give peft's scaling; AdaLN tables compiled with a LoRA on `adaln_proj` / `norm_out` must equal diffusers running
`adaln_proj` with the LoRA, bit for bit; whole evaluations with LoRA must match."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, assert_bitwise, compile_tiny, cpu_profile
from lora_files import (
    DIFFUSERS_OF,
    INNER,
    TEMB,
    F,
    H,
    assert_same_factors_as_peft,
    original_lora,
    peft_loaded,
)
from safetensors.torch import save_file

from vflash_core import Geometry, build_keyframe_bundle
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.model import BlockOps, sdpa_attention
from vflash_core.engine.residency import ResidentBlocks
from vflash_core.errors import IdentityMismatchError, WeightFileError
from vflash_core.profiles import AdapterSpec
from vflash_core.weights.lora import load_adapter


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.mark.parametrize(
    "case",
    ["kohya-alpha-tensors", "metadata-alpha-mixed-rank", "no-alpha", "musubi", "diffusers-peft", "peft-dump"],
)
def test_formats_and_scales_match_peft(case, lora_dir, tiny_transformer):
    ranks = {"default": 4, "adaln": 2}
    metadata = None
    if case == "kohya-alpha-tensors":
        state = original_lora(1, ranks, alpha_tensors={"blocks.0.attn.qkv_proj": 3.0, "blocks.1.mlp.fc1": 16.0})
    elif case == "metadata-alpha-mixed-rank":
        state = original_lora(2, ranks, down_name="lora_A", up_name="lora_B", prefix="")
        metadata = {"alpha": "8"}
    elif case == "no-alpha":
        state = original_lora(3, ranks, down_name="lora_A", up_name="lora_B", prefix="")
    elif case == "musubi":
        state = {}
        for key, value in original_lora(4, ranks, prefix="", alpha_tensors={}).items():
            if key.endswith(".alpha"):
                module, suffix = key[: -len(".alpha")], "alpha"
            else:
                module, down_or_up, weight = key.rsplit(".", 2)
                suffix = f"{down_or_up}.{weight}"
            state[f"lora_unet_{module.replace('.', '_')}.{suffix}"] = value
    else:
        # diffusers module names (the state-dict names peft reads).
        g = torch.Generator().manual_seed(6)
        state = {}
        for i in range(TINY.num_layers):
            for modules in DIFFUSERS_OF.values():
                for m in modules:
                    out_f = {"attn.to_q": INNER, "attn.to_k": INNER, "attn.to_v": INNER, "attn.to_out.0": H, "ff.net.0.proj": 2 * F, "ff.net.2": H, "adaln_proj.linear": 18 * H}[m]
                    in_f = {"attn.to_out.0": INNER, "ff.net.2": F, "adaln_proj.linear": TEMB}.get(m, H)
                    key = f"transformer.transformer_blocks.{i}.{m}" if case == "diffusers-peft" else f"transformer_blocks.{i}.{m}"
                    mid = ".lora_A.weight" if case == "diffusers-peft" else ".lora_A.default.weight"
                    state[key + mid] = (torch.randn(3, in_f, generator=g) * 0.4).to(torch.bfloat16)
                    state[key + mid.replace("lora_A", "lora_B")] = (torch.randn(out_f, 3, generator=g) * 0.4).to(torch.bfloat16)
    path = lora_dir / f"{case}.safetensors"
    save_file(state, str(path), metadata=metadata)

    adapter = load_adapter(path, TINY)
    transformer = peft_loaded(tiny_transformer, path)
    assert_same_factors_as_peft(adapter, transformer)
    if case == "metadata-alpha-mixed-rank":
        assert adapter.alpha_source == "metadata"
        assert adapter.residuals["blocks.0.attn.qkv"][0].scale == 8 / 4 and adapter.residuals["blocks.0.adaln"][0].scale == 8 / 2
    if case == "kohya-alpha-tensors":
        assert adapter.alpha_source == "tensor" and all(r.scale == 1.0 for rs in adapter.residuals.values() for r in rs)


def test_diffsynth_interleaved_qkv_and_fp32_factors(lora_dir):
    """DiffSynth trains on the raw per-head-interleaved QKV and ships fp32 factors. (diffusers' own converter assumes
    128-wide heads, so it cannot load a tiny-config file; the expectation is the stacked factor instead.)"""
    state = original_lora(5, {"default": 4, "adaln": 2}, down_name="lora_A.default", up_name="lora_B.default", prefix="", dtype=torch.float32, final_layer=False)
    stacked = state["blocks.1.attn.qkv_proj.lora_B.default.weight"]
    heads, d = TINY.num_attention_heads, TINY.attention_head_dim
    state["blocks.1.attn.qkv_proj.lora_B.default.weight"] = stacked.reshape(3, heads, d, -1).transpose(0, 1).reshape(3 * heads * d, -1).contiguous()
    save_file(state, str(lora_dir / "diffsynth.safetensors"))
    adapter = load_adapter(lora_dir / "diffsynth.safetensors", TINY)
    assert adapter.format == "diffsynth"
    residuals = adapter.residuals["blocks.1.attn.qkv"]
    for k, residual in enumerate(residuals):
        assert residual.down.dtype == torch.float32 and residual.row_start == k * INNER
        assert_bitwise(residual.up, stacked[k * INNER : (k + 1) * INNER], f"qkv part {k}")
    gate, value = state["blocks.0.mlp.fc1.lora_B.default.weight"].chunk(2)
    assert_bitwise(adapter.residuals["blocks.0.ffn.in"][0].up, torch.cat([value, gate]), "fc1 halves swapped")


def test_unknown_keys_are_listed(lora_dir):
    state = original_lora(7, {"default": 2})
    state["diffusion_model.blocks.0.attn.rotary.lora_down.weight"] = torch.zeros(2, 4)
    state["something_else"] = torch.zeros(1)
    save_file(state, str(lora_dir / "bad.safetensors"))
    with pytest.raises(WeightFileError) as info:
        load_adapter(lora_dir / "bad.safetensors", TINY)
    assert "blocks.0.attn.rotary" in str(info.value) and "something_else" in str(info.value)


def test_factors_that_do_not_fit_are_rejected(lora_dir):
    state = original_lora(8, {"default": 2})
    state["diffusion_model.blocks.0.mlp.fc2.lora_down.weight"] = torch.zeros(2, 99, dtype=torch.bfloat16)
    save_file(state, str(lora_dir / "misfit.safetensors"))
    with pytest.raises(WeightFileError, match="do not fit"):
        load_adapter(lora_dir / "misfit.safetensors", TINY)


BAD_VALUES = {
    "nan-factor": (lambda s: s["diffusion_model.blocks.0.mlp.fc1.lora_up.weight"].__setitem__((0, 0), float("nan")), None,
                   r"blocks.0.mlp.fc1.lora_up.weight holds NaN or infinite values"),
    "inf-factor": (lambda s: s["diffusion_model.blocks.1.attn.out_proj.lora_down.weight"].__setitem__((1, 2), float("inf")), None,
                   r"blocks.1.attn.out_proj.lora_down.weight holds NaN or infinite values"),
    "0-d-factor": (lambda s: s.__setitem__("diffusion_model.blocks.0.mlp.fc2.lora_down.weight", torch.tensor(1.0)), None,
                   r"blocks.0.mlp.fc2.lora_down.weight must be a non-empty matrix, got shape \[\]"),
    "rank-0-factor": (lambda s: s.__setitem__("diffusion_model.blocks.0.mlp.fc2.lora_down.weight", torch.zeros(0, F)), None,
                      r"must be a non-empty matrix, got shape \[0, \d+\]"),
    "zero-alpha": (lambda s: s.__setitem__("diffusion_model.blocks.0.mlp.fc2.alpha", torch.tensor(0.0)), None,
                   r"blocks.0.mlp.fc2.alpha must be one positive finite number, got 0"),
    "nan-alpha": (lambda s: s.__setitem__("diffusion_model.blocks.0.mlp.fc2.alpha", torch.tensor(float("nan"))), None,
                  r"alpha must be one positive finite number, got nan"),
    "vector-alpha": (lambda s: s.__setitem__("diffusion_model.blocks.0.mlp.fc2.alpha", torch.ones(3)), None,
                     r"alpha must be one positive finite number, got shape \[3\]"),
    "inf-metadata-alpha": (lambda s: None, {"alpha": "inf"}, r"`__metadata__` alpha must be a positive finite number, got 'inf'"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_factor_and_alpha_values_are_refused_with_the_key(case, lora_dir):
    """NaN / Inf factors would poison every output; a 0-d factor has no rank (it crashed with IndexError); alpha <= 0
    never finished folding into the factors. Each is refused, naming the key, before any factor is used."""
    edit, metadata, message = BAD_VALUES[case]
    state = {k: v.float() for k, v in original_lora(9, {"default": 2}, alpha_tensors=None if metadata else {}).items()}
    edit(state)
    path = lora_dir / f"bad-{case}.safetensors"
    save_file(state, str(path), metadata=metadata)
    with pytest.raises(WeightFileError, match=message) as info:
        load_adapter(path, TINY)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_compiled_lora_matches_diffusers_peft(tmp_path, tiny_transformer, strength):
    """AdaLN / norm_out tables with LoRA bitwise; whole evaluations with the separate residual equal too."""
    path = tmp_path / "turbo_test.safetensors"
    save_file(original_lora(9, {"default": 4, "adaln": 2}, down_name="lora_A", up_name="lora_B", prefix=""), str(path), metadata={"alpha": "4"})
    (tmp_path / "x").mkdir()
    with pytest.raises(IdentityMismatchError, match=r"attention/FFN ranks \[4\] \(profile expects 8\)"):
        compile_tiny(tmp_path / "x", tiny_transformer, cpu_profile(id="t2va-lora-cpu", adapter=AdapterSpec("test turbo", path.name, 4.0, 8, strength)), adapter=path)
    profile = cpu_profile(id="t2va-lora-cpu", adapter=AdapterSpec("test turbo", path.name, 4.0, 4, strength))
    paths = compile_tiny(tmp_path, tiny_transformer, profile, adapter=path)
    artifact = CompiledArtifact(**paths)
    reference = peft_loaded(tiny_transformer, path, strength)

    overlay = artifact.overlay
    with torch.no_grad():
        for step in range(overlay.nfe):
            for variant, timesteps in enumerate(overlay.variants[step]):
                tables = overlay.read_step(step, variant)
                temb = reference.time_embedder(reference.time_proj(timesteps))
                for i, block in enumerate(reference.transformer_blocks):
                    expected = torch.cat(block.adaln_proj(temb), dim=-1)
                    assert_bitwise(tables.blocks[i], expected, f"adaln table step {step} variant {variant} block {i}")
                shift_scale = reference.norm_out.linear(torch.nn.functional.silu(temb).to(torch.bfloat16))
                assert_bitwise(tables.norm_out, shift_scale, f"norm_out table step {step}")

    denoiser = Denoiser(artifact, ResidentBlocks(artifact, torch.device("cpu")), torch.device("cpu"), BlockOps(artifact.config, sdpa_attention))
    g = torch.Generator().manual_seed(2)
    bundle = build_keyframe_bundle(torch.randn(6, TINY.text_dim, generator=g).to(torch.bfloat16), torch.ones(6, dtype=torch.long), Geometry(64, 96, 124), TINY, g)
    state = denoiser.start_request(bundle)
    video, audio = denoiser.evaluate(state, 1)
    lay, plan = bundle.layout, state.plans[1]
    with torch.no_grad():
        expected_video, expected_audio = reference(
            state.video_rows[None], state.audio_rows[None], bundle.prompt_embeds[None], plan.tables.timesteps, plan.timestep_indices,
            lay.token_tags, lay.position_ids, lay.video_indices, lay.audio_indices, lay.text_indices, return_dict=False,
        )
    assert_bitwise(video, expected_video[0], "video velocity with LoRA")
    assert_bitwise(audio, expected_audio[0], "audio velocity with LoRA")
