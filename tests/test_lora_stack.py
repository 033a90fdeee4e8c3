"""LoRA stacks against diffusers 0.42.1 + peft running the same adapters.

The acceptance stack on the tiny family: the profile's Turbo LoRA (kohya file with alpha tensors), a style LoRA at 0.6
(ai-toolkit file, another rank) and a full-rank delta at 0.8 (FastH3 `diff` / `diff_b` file). Residual mode must equal
diffusers with the three peft adapters active (`set_adapters`), merged mode diffusers after `fuse_lora`, bit for bit:
the AdaLN tables and a whole evaluation. Diffusers' H3 loader takes no `diff` keys; it holds such a delta (as its Wan
converter does) as a LoRA with A = diff, B = identity and `lora_B.bias` = diff_b, which is the reference file written
here (two peft adapters at the same strength, on disjoint modules: peft's `lora_bias` is per adapter and cannot be
merged where the base linear has no bias, as H3's block linears have not). Also: the stack is the compile's identity (a changed file, strength, order or mode is seen), the file layouts
users have (ComfyUI's saved LoRAs, full-rank deltas, LoKr / LoHa refused by name)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from conftest import TINY, assert_bitwise, compile_tiny, cpu_profile, diffusers_transformer
from lora_files import ORIGINAL_MODULES, assert_same_factors_as_peft, original_lora, peft_loaded
from safetensors.torch import load_file, save_file

from vflash_core import Geometry, build_keyframe_bundle
from vflash_core.engine.artifact import CompiledArtifact
from vflash_core.engine.denoise import Denoiser
from vflash_core.engine.model import BlockOps, sdpa_attention
from vflash_core.engine.residency import ResidentBlocks
from vflash_core.errors import WeightFileError
from vflash_core.profiles import AdapterSpec
from vflash_core.weights.compiler import compiled_from, prepare, receipt_describes
from vflash_core.weights.lora import LoraStack, StackedLora, load_adapter

H, INNER, F, TEMB = TINY.hidden_size, TINY.inner_dim, TINY.ffn_dim, TINY.time_embed_dim
STYLE, DELTA = 0.6, 0.8
# Auxiliary linears the delta adapts (bf16 in the tiny family): original name -> (diffusers name, out, in).
DELTA_AUX = {"final_layer.adaln_proj.linear": ("norm_out.linear", 2 * H, TEMB), "condition_proj": ("context_embedder", H, TINY.text_dim)}


def full_rank_delta(seed: int) -> dict[str, torch.Tensor]:
    """A FastH3-layout full-rank delta: `<module>.diff` [out, in] on every block and refiner linear and two auxiliary
    ones, `<module>.diff_b` [out] where the linear has a bias (the AdaLN projections, the auxiliary linears)."""
    g = torch.Generator().manual_seed(seed)
    modules = {f"blocks.{i}.{m}": s for i in range(TINY.num_layers) for m, s in ORIGINAL_MODULES.items()}
    modules.update({f"token_refiner.blocks.0.{m}": s for m, s in ORIGINAL_MODULES.items() if m != "adaln_proj.linear"})
    modules.update({name: (out_f, in_f) for name, (_, out_f, in_f) in DELTA_AUX.items()})
    state = {}
    for name, (out_f, in_f) in modules.items():
        state[f"diffusion_model.{name}.diff"] = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16)
        if "adaln_proj" in name or name in DELTA_AUX:
            state[f"diffusion_model.{name}.diff_b"] = (torch.randn(out_f, generator=g) * 0.02).to(torch.bfloat16)
    return state


def delta_as_peft(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The delta as diffusers holds one: a LoRA per diffusers module with A = its rows of diff, B = identity and
    lora_B.bias = diff_b (fused QKV split in thirds, fc1's [gate; value] halves as [value; gate]); the modules without
    a bias delta, then those with one."""
    plain: dict[str, torch.Tensor] = {}
    biased: dict[str, torch.Tensor] = {}

    def put(module: str, diff: torch.Tensor, bias: torch.Tensor | None) -> None:
        out = plain if bias is None else biased
        out[f"transformer.{module}.lora_A.weight"] = diff.contiguous()
        out[f"transformer.{module}.lora_B.weight"] = torch.eye(diff.shape[0], dtype=diff.dtype)
        if bias is not None:
            out[f"transformer.{module}.lora_B.bias"] = bias.contiguous()

    state = {k.removeprefix("diffusion_model."): v for k, v in state.items()}
    for key, diff in state.items():
        if not key.endswith(".diff"):
            continue
        module = key.removesuffix(".diff")
        bias = state.get(f"{module}.diff_b")
        if module in DELTA_AUX:
            put(DELTA_AUX[module][0], diff, bias)
            continue
        prefix, local = (module.split(".", 2)[:2], module.split(".", 2)[2]) if module.startswith("blocks.") else (module.split(".", 3)[:3], module.split(".", 3)[3])
        target = f"transformer_blocks.{prefix[1]}" if prefix[0] == "blocks" else f"token_refiner.refiner_blocks.{prefix[2]}"
        if local == "attn.qkv_proj":
            for proj, rows in zip(("to_q", "to_k", "to_v"), diff.chunk(3)):
                put(f"{target}.attn.{proj}", rows, None)
        elif local == "mlp.fc1":
            gate, value = diff.chunk(2)
            put(f"{target}.ff.net.0.proj", torch.cat([value, gate]), None)
        else:
            put(f"{target}.{ {'attn.out_proj': 'attn.to_out.0', 'mlp.fc2': 'ff.net.2', 'adaln_proj.linear': 'adaln_proj.linear'}[local]}", diff, bias)
    return plain, biased


@pytest.fixture(scope="module")
def stack_files(tmp_path_factory):
    """(turbo, style, delta for Vflash, the delta's two files for diffusers) of the acceptance stack."""
    folder = tmp_path_factory.mktemp("stack")
    turbo, style, delta, plain, biased = (folder / f"{n}.safetensors" for n in ("turbo", "style", "delta", "delta_plain", "delta_biased"))
    save_file(original_lora(21, {"default": 8, "adaln": 4}, alpha_tensors={"blocks.0.attn.qkv_proj": 4.0}), str(turbo))
    save_file(original_lora(22, {"default": 4, "adaln": 2}, down_name="lora_A", up_name="lora_B"), str(style))
    delta_state = full_rank_delta(23)
    save_file(delta_state, str(delta))
    for path, part in zip((plain, biased), delta_as_peft(delta_state)):
        save_file(part, str(path))
    return turbo, style, delta, (plain, biased)


def turbo_profile(turbo, arch: str = "cpu"):
    return cpu_profile(id=f"t2va-stack-{arch}", arch=arch, adapter=AdapterSpec("test turbo", turbo.name, 4.0, 8))


def stack(style, delta, mode: str) -> LoraStack:
    return LoraStack((StackedLora(str(style), STYLE), StackedLora(str(delta), DELTA)), mode)


def diffusers_with_stack(tiny_transformer, files, fused: bool, device: str = "cpu"):
    """The tiny transformer in diffusers on `device` with the three adapters active at their strengths (fused:
    `fuse_lora`, on that device: peft merges in fp32 on the CPU, in the factors' dtype on a GPU)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    turbo, style, _, (plain, biased) = files
    transformer = diffusers_transformer(tiny_transformer).to(device)
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(12.0), audio_scheduler=MiniMaxH3Scheduler(3.0))
    for name, path in (("turbo", turbo), ("style", style), ("delta", plain), ("delta_b", biased)):
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(["turbo", "style", "delta", "delta_b"], [1.0, STYLE, DELTA, DELTA])
    if fused:
        pipe.fuse_lora(components=["transformer"])
        pipe.unload_lora_weights()  # what is left is the base modules with the stack merged into their weights
    return transformer


def assert_tables_and_evaluation_match(paths, reference, device: str = "cpu") -> None:
    """The compiled AdaLN / norm_out tables and one whole evaluation equal the reference, bit for bit (on a GPU both
    sides on cuDNN attention, diffusers' own pick there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vflash_core.engine.attention import resolve_attention

    dev = torch.device(device)
    attention = sdpa_attention if dev.type == "cpu" else resolve_attention("torch-cudnn", dev)[1]
    pinned = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if dev.type == "cuda" else contextlib.nullcontext()
    artifact = CompiledArtifact(**paths)
    overlay = artifact.overlay
    with torch.no_grad():
        for step in range(overlay.nfe):
            for variant, timesteps in enumerate(overlay.variants[step]):
                tables = overlay.read_step(step, variant)
                temb = reference.time_embedder(reference.time_proj(timesteps.to(dev)))
                for i, block in enumerate(reference.transformer_blocks):
                    assert_bitwise(tables.blocks[i].to(dev), torch.cat(block.adaln_proj(temb), dim=-1), f"adaln table step {step} block {i}")
                shift_scale = reference.norm_out.linear(torch.nn.functional.silu(temb).to(torch.bfloat16))
                assert_bitwise(tables.norm_out.to(dev), shift_scale, f"norm_out table step {step}")
    denoiser = Denoiser(artifact, ResidentBlocks(artifact, dev), dev, BlockOps(artifact.config, attention))
    g = torch.Generator().manual_seed(2)
    bundle = build_keyframe_bundle(torch.randn(6, TINY.text_dim, generator=g).to(torch.bfloat16), torch.ones(6, dtype=torch.long), Geometry(64, 96, 124), TINY, g)
    state = denoiser.start_request(bundle)
    video, audio = denoiser.evaluate(state, 1)
    lay, plan = bundle.layout, state.plans[1]
    with torch.no_grad(), pinned:
        expected_video, expected_audio = reference(
            state.video_rows[None], state.audio_rows[None], bundle.prompt_embeds[None].to(dev), plan.tables.timesteps, plan.timestep_indices,
            *(t.to(dev) for t in (lay.token_tags, lay.position_ids, lay.video_indices, lay.audio_indices, lay.text_indices)), return_dict=False,
        )
    assert_bitwise(video, expected_video[0], "video velocity")
    assert_bitwise(audio, expected_audio[0], "audio velocity")


def test_stack_of_three_as_residuals_matches_peft_adapters(tmp_path, tiny_transformer, stack_files):
    turbo, style, delta, _ = stack_files
    paths = compile_tiny_stack(tmp_path, tiny_transformer, turbo, stack(style, delta, "residual"))
    artifact = CompiledArtifact(**paths)
    assert [f["strength"] for f in artifact.loras["files"]] == [STYLE, DELTA] and artifact.loras["mode"] == "residual"
    # each block linear runs the three adapters' residuals (q, k, v apart): 3 * 3 on the QKV, 3 on the others
    loras = artifact.read_block_loras(0)
    assert {name: len(rs) for name, rs in loras.items()} == {"attn.qkv": 9, "attn.out": 3, "ffn.in": 3, "ffn.out": 3}
    assert [r.up is None for r in loras["attn.out"]] == [False, False, True]
    assert_tables_and_evaluation_match(paths, diffusers_with_stack(tiny_transformer, stack_files, fused=False))


def test_stack_of_three_merged_matches_fuse_lora(tmp_path, tiny_transformer, stack_files):
    turbo, style, delta, _ = stack_files
    paths = compile_tiny_stack(tmp_path, tiny_transformer, turbo, stack(style, delta, "merged"))
    artifact = CompiledArtifact(**paths)
    # nothing runs per evaluation: no residual in any block or in the auxiliary file
    assert all(not artifact.read_block_loras(i) for i in range(TINY.num_layers))
    assert not [k for k in load_file(str(paths["auxiliary"])) if k.startswith("lora.")]
    assert_tables_and_evaluation_match(paths, diffusers_with_stack(tiny_transformer, stack_files, fused=True))


def compile_tiny_stack(tmp_path, tiny_transformer, turbo, loras: LoraStack, device: str = "cpu"):
    from vflash_core.weights.compiler import compile_receipt

    receipt = tmp_path / "receipt.json"
    prepare(turbo_profile(turbo, "cpu" if device == "cpu" else "sm90"), tiny_transformer, receipt, turbo, loras=loras)
    out = compile_receipt(receipt, tmp_path / "compiled", device)
    return {"artifact": out / "artifact", "schedule_overlay": out / "schedule", "auxiliary": out / "auxiliary.safetensors"}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["residual", "merged"])
def test_stack_of_three_matches_diffusers_on_the_gpu(tmp_path, tiny_transformer, stack_files, mode):
    """The same stack compiled on an SM90 GPU (tables and merges computed there) against diffusers on that GPU."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("needs an SM90 GPU for an sm90 profile")
    turbo, style, delta, _ = stack_files
    paths = compile_tiny_stack(tmp_path, tiny_transformer, turbo, stack(style, delta, mode), device="cuda:0")
    reference = diffusers_with_stack(tiny_transformer, stack_files, fused=mode == "merged", device="cuda:0")
    assert_tables_and_evaluation_match(paths, reference, "cuda:0")


def test_the_stack_is_the_compile_identity(tmp_path, tiny_transformer, stack_files):
    """A receipt describes its stack only: another strength, order, mode or a rewritten file is not it; a compile
    made before a file changed is not the compile of the receipt prepared after."""
    turbo, style, delta, _ = stack_files
    style_copy = tmp_path / "style.safetensors"
    style_copy.write_bytes(style.read_bytes())
    loras = stack(style_copy, delta, "residual")
    paths = compile_tiny_stack(tmp_path, tiny_transformer, turbo, loras)
    receipt = tmp_path / "receipt.json"
    assert receipt_describes(receipt, tiny_transformer, turbo, loras)
    swapped = LoraStack(tuple(reversed(loras.loras)), "residual")
    other_strength = LoraStack((StackedLora(str(style_copy), 0.5), loras.loras[1]), "residual")
    for other in (swapped, other_strength, LoraStack(loras.loras, "merged"), LoraStack(), None):
        assert not receipt_describes(receipt, tiny_transformer, turbo, other), other
    # the same bytes rewritten (a new modification time) must be hashed again; other bytes are another compile
    state = load_file(str(style_copy))
    key = "diffusion_model.blocks.0.mlp.fc2.lora_B.weight"
    state[key] = state[key] * 2
    save_file(state, str(style_copy))
    os.utime(style_copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert not receipt_describes(receipt, tiny_transformer, turbo, loras)
    again = tmp_path / "again.json"
    prepare(turbo_profile(turbo), tiny_transformer, again, turbo, loras=loras)
    compiled = paths["artifact"].parent
    assert compiled_from(compiled, receipt) and not compiled_from(compiled, again)


def test_a_receipt_with_a_broken_stack_record_is_refused_in_one_line(tmp_path, tiny_transformer, stack_files):
    import json

    from vflash_core.errors import VflashError
    from vflash_core.weights.compiler import compile_receipt

    turbo, style, delta, _ = stack_files
    receipt = tmp_path / "receipt.json"
    prepare(turbo_profile(turbo), tiny_transformer, receipt, turbo, loras=stack(style, delta, "merged"))
    record = json.loads(receipt.read_text())
    record["loras"]["mode"] = "fused"
    receipt.write_text(json.dumps(record))
    with pytest.raises(VflashError, match=r"loras\.mode") as info:
        compile_receipt(receipt, tmp_path / "compiled")
    assert "\n" not in str(info.value) and not (tmp_path / "compiled").exists()


def test_no_stack_leaves_receipt_and_compile_as_they_were(tmp_path, tiny_transformer, stack_files):
    """A default stack (no file, residual) and merged mode with no LoRA at all record nothing: the default path's
    receipts, identities and compiles are those of before stacks existed."""
    turbo = stack_files[0]
    for name, profile, adapter, loras in (
        ("default", turbo_profile(turbo), turbo, LoraStack()),
        ("nothing-to-merge", cpu_profile(), None, LoraStack((), "merged")),
    ):
        receipt = tmp_path / f"{name}.json"
        record = prepare(profile, tiny_transformer, receipt, adapter, loras=loras)
        assert "loras" not in record and receipt_describes(receipt, tiny_transformer, adapter, None)


# -- the files users have ------------------------------------------------------------------------------------------


def test_full_rank_delta_parses_to_its_rows(stack_files):
    """Each `diff` becomes a residual whose down is the delta's rows in the weight's order, at the strength."""
    delta = stack_files[2]
    state = {k.removeprefix("diffusion_model."): v for k, v in load_file(str(delta)).items()}
    adapter = load_adapter(delta, TINY, DELTA)
    assert adapter.ranks == {} and adapter.format == "original"
    qkv = adapter.residuals["blocks.1.attn.qkv"]
    for k, residual in enumerate(qkv):
        assert residual.up is None and residual.row_start == k * INNER
        assert_bitwise(residual.down, state["blocks.1.attn.qkv_proj.diff"][k * INNER : (k + 1) * INNER], f"qkv third {k}")
    gate, value = state["blocks.0.mlp.fc1.diff"].chunk(2)
    assert_bitwise(adapter.residuals["blocks.0.ffn.in"][0].down, torch.cat([value, gate]), "fc1 halves swapped")
    adaln = adapter.residuals["blocks.0.adaln"][0]
    assert_bitwise(adaln.bias, state["blocks.0.adaln_proj.linear.diff_b"], "adaln diff_b")
    assert adaln.scale == DELTA * float(18 * H) / (18 * H)


def comfy_saved_lora(seed: int, norm_delta: float = 0.0) -> dict[str, torch.Tensor]:
    """What ComfyUI's LoraSave writes for a model difference: `diffusion_model.` names, lora_up / lora_down without
    alpha, a `diff_b` for each bias and a `diff` for each norm weight (zero where the norms were not trained)."""
    state = original_lora(seed, {"default": 4})
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(TINY.num_layers):
        state[f"diffusion_model.blocks.{i}.adaln_proj.linear.diff_b"] = (torch.randn(18 * H, generator=g) * 0.1).to(torch.bfloat16)
        for norm in ("norm1", "norm2", "attn.q_norm", "attn.k_norm"):
            width = TINY.attention_head_dim if "_norm" in norm else H
            state[f"diffusion_model.blocks.{i}.{norm}.diff"] = torch.full((width,), norm_delta, dtype=torch.bfloat16)
    state["diffusion_model.final_layer.adaln_proj.linear.diff_b"] = torch.zeros(2 * H, dtype=torch.bfloat16)
    return state


def test_comfyui_saved_lora(tmp_path):
    path = tmp_path / "ComfyUI_extracted_lora_00001_.safetensors"
    save_file(comfy_saved_lora(31), str(path))
    adapter = load_adapter(path, TINY, 0.7)
    state = load_file(str(path))
    assert adapter.format == "original" and set(adapter.ranks.values()) == {4}
    adaln = adapter.residuals["blocks.1.adaln"][0]
    assert_bitwise(adaln.up, state["diffusion_model.blocks.1.adaln_proj.linear.lora_up.weight"], "adaln up")
    assert_bitwise(adaln.bias, state["diffusion_model.blocks.1.adaln_proj.linear.diff_b"], "adaln diff_b")
    assert adaln.scale == 0.7
    # a trained norm is not applied: refused, naming the norms, in one line
    save_file(comfy_saved_lora(31, norm_delta=0.01), str(path))
    with pytest.raises(WeightFileError, match=r"non-zero norm delta\(s\) that Vflash does not apply: blocks\.0\.attn\.k_norm\.diff") as info:
        load_adapter(path, TINY)
    assert "\n" not in str(info.value)


def test_bias_delta_on_a_linear_without_bias_is_refused(tmp_path):
    state = original_lora(32, {"default": 2})
    state["diffusion_model.blocks.0.mlp.fc2.diff_b"] = torch.zeros(H, dtype=torch.bfloat16)
    save_file(state, str(tmp_path / "bias.safetensors"))
    with pytest.raises(WeightFileError, match=r"blocks\.0\.ffn\.out: bias delta \[\d+\] does not fit \(the linear has no bias\)"):
        load_adapter(tmp_path / "bias.safetensors", TINY)


@pytest.mark.parametrize("kind, keys", [
    ("LoKr", ("lokr_w1", "lokr_w2_a", "lokr_w2_b")),
    ("LoHa", ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")),
])
def test_lycoris_files_are_refused_naming_the_format(tmp_path, kind, keys):
    """LyCORIS files in their real layout (kohya-flattened names, per-module alpha) are refused as what they are."""
    state = {}
    for i in range(TINY.num_layers):
        for key in keys:
            state[f"lora_unet_blocks_{i}_attn_qkv_proj.{key}"] = torch.randn(4, 4, dtype=torch.bfloat16)
        state[f"lora_unet_blocks_{i}_attn_qkv_proj.alpha"] = torch.tensor(4.0)
    path = tmp_path / f"{kind}.safetensors"
    save_file(state, str(path))
    with pytest.raises(WeightFileError, match=rf"a {kind} \(LyCORIS\) file .*: Vflash takes LoRA"):
        load_adapter(path, TINY)


def test_unknown_keys_of_a_delta_are_listed_in_one_error(tmp_path):
    state = full_rank_delta(33)
    state["diffusion_model.blocks.0.attn.rotary.diff"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    state["lora_te_text_model.diff"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(state, str(tmp_path / "unknown.safetensors"))
    with pytest.raises(WeightFileError, match=r"2 LoRA key\(s\) do not name an H3 module: .*blocks\.0\.attn\.rotary\.diff.*lora_te_text_model\.diff"):
        load_adapter(tmp_path / "unknown.safetensors", TINY)


def test_compile_tiny_helper_still_takes_one_adapter(tmp_path, tiny_transformer, stack_files):
    """The one-adapter path (`adapter` alone) compiles as before: no stack recorded."""
    turbo = stack_files[0]
    artifact = CompiledArtifact(**compile_tiny(tmp_path, tiny_transformer, turbo_profile(turbo), adapter=turbo))
    assert artifact.loras is None and artifact.adapter["name"] == turbo.name


def test_diffusers_files_with_lora_b_bias_match_peft(stack_files, tiny_transformer):
    """A diffusers/peft file whose modules carry `lora_B.bias` (how diffusers holds a `diff_b`): the same factors,
    bias and scale as peft loads, on the AdaLN projections and two auxiliary linears."""

    biased = stack_files[3][1]
    adapter = load_adapter(biased, TINY)
    assert adapter.format == "diffusers" and all(r.bias is not None for rs in adapter.residuals.values() for r in rs)
    transformer = peft_loaded(tiny_transformer, biased)
    assert_same_factors_as_peft(adapter, transformer)
    assert_bitwise(adapter.residuals["blocks.1.adaln"][0].bias, transformer.transformer_blocks[1].adaln_proj.linear.lora_B["a"].bias.data, "adaln bias")
    assert_bitwise(adapter.residuals["norm_out.linear"][0].bias, transformer.norm_out.linear.lora_B["a"].bias.data, "norm_out bias")
