"""Comfy-Org transformer files as Vflash sources: fp8_scaled (exact for its dequantized weights), pruned (approximate,
its own profiles), other quantized formats refused. Small files in these layouts are written here
(`synthetic.write_comfy_transformer`); `tests/test_comfyui_server.py` checks the same files against ComfyUI core."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformer_files
from conftest import TINY, assert_bitwise, compile_tiny, cpu_profile
from headless_nodes import API
from safetensors.torch import load_file, save_file

from vflash_core import Geometry, NativeEngineSession, build_keyframe_bundle
from vflash_core.engine import model as M
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.errors import IdentityMismatchError, WeightFileError
from vflash_core.profiles import AdapterSpec
from vflash_core.weights import synthetic
from vflash_core.weights.checkpoint import SourceWeights

HEIGHT, WIDTH, FRAMES = 64, 96, 124


@pytest.fixture(scope="module")
def base_weights():
    return synthetic.random_internal_weights(TINY, seed=12)


@pytest.fixture(scope="module")
def pruned_file(tmp_path_factory, base_weights):
    return synthetic.write_comfy_transformer(tmp_path_factory.mktemp("pruned") / "h3_pruned.safetensors", TINY, transformer_files.prune_adaln(base_weights, TINY))


@pytest.fixture(scope="module")
def full_file(tmp_path_factory, base_weights):
    return synthetic.write_comfy_transformer(tmp_path_factory.mktemp("full") / "h3_bf16.safetensors", TINY, base_weights)


def _bundle(seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(6, TINY.text_dim, generator=g).to(torch.bfloat16)
    return build_keyframe_bundle(embeds, torch.ones(6, dtype=torch.long), Geometry(HEIGHT, WIDTH, FRAMES), TINY, torch.Generator().manual_seed(seed), seed=seed)


def _compile(folder, transformer, profile, adapter=None):
    folder.mkdir(parents=True)
    return compile_tiny(folder, transformer, profile, adapter=adapter)


def _generate(profile, paths, seed: int = 7):
    with NativeEngineSession(profile, CompiledPaths(**paths)) as session:
        return session.generate(_bundle(seed))


# -- reading ------------------------------------------------------------------------------------------------------


def test_pruned_file_reads_its_curve_and_reduced_rank_adaln(pruned_file):
    raw = load_file(pruned_file)
    assert "adaln_t_table" in raw and "rope.inv_freq" in raw and not any(k.startswith("time_embedder.") for k in raw)
    source = SourceWeights(pruned_file)
    assert source.pruned and source.curve == (1025, 8) and source.format == "bf16"
    assert source.describe() == {"format": "bf16", "quantized_layers": 0, "pruned": {"grid": 1025, "rank": 8}}
    shapes = source.shapes()
    assert shapes["blocks.1.adaln.weight"] == (18 * TINY.hidden_size, 8) and shapes["norm_out.linear.weight"] == (2 * TINY.hidden_size, 8)
    assert not any(n.startswith("time_embedder.") for n in shapes)
    table = source.read_aux(lambda n: n == "adaln_t_table")["adaln_t_table"]
    assert_bitwise(table, raw["adaln_t_table"], "adaln_t_table")


def test_config_of_a_comfy_file_without_one_is_inferred(tmp_path, base_weights):
    """Without a config in the metadata: shapes give the config, `rope.inv_freq` the rotary width; a pruned file
    has no time embedder, so its widths stay the release's."""
    config = replace(TINY, rope_freq_dim=1)
    path = synthetic.write_comfy_transformer(tmp_path / "h3.safetensors", config, base_weights, embed_config=False)
    assert SourceWeights(path).config == config
    pruned = synthetic.write_comfy_transformer(tmp_path / "h3_pruned.safetensors", config, transformer_files.prune_adaln(base_weights, config), embed_config=False)
    release = type(TINY)()
    time = dict(freq_dim=release.freq_dim, time_embed_hidden_dim=release.time_embed_hidden_dim, time_embed_dim=release.time_embed_dim)
    assert SourceWeights(pruned).config == replace(config, **time)


@pytest.mark.parametrize("marking", ["metadata", "comfy_quant", "legacy"])
def test_fp8_scaled_file_reads_as_core_dequantizes(tmp_path, base_weights, marking):
    """Every float8 layer reads as BF16 `bf16(code) * bf16(scale)` (one rounding of the product), whichever of
    ComfyUI's three markings the file uses; every other tensor reads as stored."""
    path = synthetic.write_comfy_transformer(tmp_path / "h3_fp8.safetensors", TINY, base_weights, fp8=marking)
    raw = load_file(path)
    source = SourceWeights(path)
    assert source.format == "fp8_scaled" and source.describe()["quantized_layers"] == TINY.num_layers * 5 + TINY.num_refiner_layers * 4 + 1
    ours = synthetic.to_original_names(source.read(list(source.shapes())), TINY)
    scale_key = "scale_weight" if marking == "legacy" else "weight_scale"
    quantized = [k.removesuffix(f".{scale_key}") for k in raw if k.endswith(f".{scale_key}")]
    assert "blocks.0.attn.qkv_proj" in quantized and "condition_proj" in quantized
    differs_from_fp32_product = 0
    for layer in quantized:
        code, scale = raw[f"{layer}.weight"], raw[f"{layer}.{scale_key}"]
        assert code.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert_bitwise(ours[f"{layer}.weight"], code.to(torch.bfloat16) * scale.to(torch.bfloat16), layer)
        differs_from_fp32_product += int((ours[f"{layer}.weight"] != (code.float() * scale).to(torch.bfloat16)).sum())
    assert differs_from_fp32_product > 0  # the rounding order matters: the scale rounds to bf16 first
    for name, tensor in raw.items():
        if name in ours and not any(name == f"{layer}.weight" for layer in quantized):
            assert_bitwise(ours[name], tensor, name)


def _int8_file(path, fmt: dict[str, object], marking: str = "metadata"):
    """A file whose block linears carry int8 codes marked with a ComfyUI quantization format `fmt`."""
    state = synthetic.to_original_names(synthetic.random_internal_weights(TINY, seed=1), TINY)
    metadata = {"config": json.dumps(TINY.to_dict())}
    layers = {}
    for name in [n for n in state if n.startswith("blocks.") and n.endswith(("qkv_proj.weight", "fc1.weight"))]:
        layer = name.removesuffix(".weight")
        state[name] = torch.zeros(state[name].shape, dtype=torch.int8)
        state[f"{layer}.weight_scale"] = torch.tensor(0.01)
        layers[layer] = fmt
        if marking == "comfy_quant":
            state[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(fmt).encode()), dtype=torch.uint8)
    if marking == "metadata":
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    save_file(state, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("fmt,marking,named", [
    ({"format": "nvfp4"}, "comfy_quant", "nvfp4"),
    ({"format": "convrot_w4a4", "convrot_groupsize": 4}, "metadata", "convrot_w4a4"),
    (None, "none", "int8 without ComfyUI quantization metadata"),
])
def test_quantized_formats_vflash_does_not_read_are_refused(tmp_path, fmt, marking, named):
    path = _int8_file(tmp_path / "h3_q.safetensors", fmt or {}, marking)
    with pytest.raises(WeightFileError) as info:
        SourceWeights(path)
    message = str(info.value)
    assert "\n" not in message and named.split()[0] in message and "int8_convrot" in message and "GGUF" in message and "pruned" in message


@pytest.mark.parametrize("params,problem", [
    ({"convrot": True, "convrot_groupsize": 256}, "24 columns, not a multiple of its convrot_groupsize 256"),
    ({"params": {"convrot": True, "convrot_groupsize": 8}}, "convrot_groupsize 8; a ConvRot group is a power of 4"),
])
def test_int8_convrot_layers_whose_groups_do_not_fit_are_refused(tmp_path, params, problem):
    path = _int8_file(tmp_path / "h3_q.safetensors", {"format": "int8_tensorwise", **params})
    with pytest.raises(WeightFileError, match=problem):
        SourceWeights(path)


# -- the pruned representation --------------------------------------------------------------------------------------


def test_curve_time_embedding_reads_the_table_by_linear_interpolation():
    table = torch.randn(5, 3)
    rows = M.curve_time_embedding(torch.tensor([0.0, 0.25, 1.0, -0.5, 2.0]), table)
    assert_bitwise(rows[0], table[0], "t = 0: first row")
    assert_bitwise(rows[1], table[1], "t on a grid point: that row")
    assert_bitwise(rows[2], table[4], "t = 1: last row (end of the last interval)")
    assert_bitwise(rows[3], table[0], "t < 0 clamps")
    assert_bitwise(rows[4], table[4], "t > 1 clamps")
    middle = M.curve_time_embedding(torch.tensor([0.375]), table)[0]
    assert_bitwise(middle, torch.lerp(table[1], table[2], torch.tensor(0.5)), "half-way between rows 1 and 2")


def _curve_embedding_float64(timesteps, table):
    """ComfyUI core's read of a pruned file's curve table, in float64 (numpy): t clamped to [0, 1] at position
    t (grid - 1), between rows floor(position) (at most grid - 2) and the next, linearly."""
    position = np.clip(timesteps, 0.0, 1.0) * (table.shape[0] - 1)
    lower = np.minimum(np.floor(position).astype(np.int64), table.shape[0] - 2)
    fraction = (position - lower)[:, None]
    return table[lower] * (1.0 - fraction) + table[lower + 1] * fraction


def _assert_within(actual, expected, relative: float, what: str) -> None:
    """|actual - expected| <= relative * max(|expected|, the tensor's largest |value| / 16) elementwise."""
    floor = np.abs(expected).max() / 16
    error = np.abs(actual - expected) / np.maximum(np.abs(expected), floor)
    assert error.max() <= relative, f"{what}: relative error {error.max():.3g} > {relative:.3g}"


def test_pruned_file_compiles_loads_and_denoises(tmp_path, pruned_file, full_file):
    """The overlay holds the tables of the pruned representation (curve read at each step's timesteps, fp32 projections
    without SiLU, block rows cast to bf16, final-norm rows kept fp32); they approximate the full model's tables, and
    a t2va request runs to latents near the full model's."""
    paths = _compile(tmp_path / "pruned", pruned_file, "t2va-base4-pruned-cpu")
    artifact = CompiledArtifact(**paths)
    assert artifact.base_weights["pruned"] == {"grid": 1025, "rank": 8} and artifact.profile_id == "t2va-base4-pruned-cpu"
    assert "approximate AdaLN (rank-8 time embedding" in " ".join(artifact.base_weight_notes())
    raw = {name: tensor.double().numpy() for name, tensor in load_file(pruned_file).items() if tensor.is_floating_point()}
    exact = CompiledArtifact(**_compile(tmp_path / "full", full_file, "t2va-base4-exact-cpu"))
    for step in range(4):
        tables, reference = artifact.overlay.read_step(step, 0), exact.overlay.read_step(step, 0)
        temb = _curve_embedding_float64(tables.timesteps.double().numpy(), raw["adaln_t_table"])
        for i, (table, full) in enumerate(zip(tables.blocks, reference.blocks)):
            expected = (temb @ raw[f"blocks.{i}.adaln_proj.linear.weight"].T + raw[f"blocks.{i}.adaln_proj.linear.bias"]).reshape(-1, 6 * TINY.hidden_size)
            # fp32 products and sums, then one cast to bf16: within one bf16 step of the float64 value
            assert table.dtype == torch.bfloat16
            _assert_within(table.double().numpy(), expected, 2.0 ** -7, f"step {step} block {i}")
            assert (table.float() - full.float()).abs().max() <= 0.02 * full.float().abs().max()
        assert tables.norm_out.dtype == torch.float32
        norm_out = temb @ raw["final_layer.adaln_proj.linear.weight"].T + raw["final_layer.adaln_proj.linear.bias"]
        _assert_within(tables.norm_out.double().numpy(), norm_out, 2.0 ** -18, f"step {step} norm_out")
    pruned, full = _generate("t2va-base4-pruned-cpu", paths), _generate("t2va-base4-exact-cpu", {"artifact": exact.artifact_dir, "schedule_overlay": exact.overlay.path, "auxiliary": exact.aux_path})
    assert torch.isfinite(pruned.video_latents).all() and pruned.metadata["profile"] == "t2va-base4-pruned-cpu"
    assert pruned.metadata["base_weights"]["pruned"] == {"grid": 1025, "rank": 8}
    assert not torch.equal(pruned.video_latents, full.video_latents)
    assert (pruned.video_latents - full.video_latents).abs().max() < 0.05 * full.video_latents.abs().max()
    assert (pruned.audio_latents - full.audio_latents).abs().max() < 0.05 * full.audio_latents.abs().max()


def test_fp8_scaled_file_is_exact_for_its_weights(tmp_path, base_weights):
    """Compiled from an fp8_scaled file, a request gives the latents of the BF16 file that holds exactly its
    dequantized weights, bit for bit; the artifact and the notes say the base was fp8_scaled."""
    fp8 = synthetic.write_comfy_transformer(tmp_path / "h3_fp8_scaled.safetensors", TINY, base_weights, fp8="metadata")
    source = SourceWeights(fp8)
    dequantized = transformer_files.write_original_transformer(tmp_path / "h3_dequantized.safetensors", TINY, source.read(list(source.shapes())))
    paths = _compile(tmp_path / "fp8", fp8, "t2va-base4-exact-cpu")
    artifact = CompiledArtifact(**paths)
    assert artifact.base_weights["format"] == "fp8_scaled" and artifact.base_weights["quantized_layers"] == TINY.num_layers * 5 + TINY.num_refiner_layers * 4 + 1
    assert "fp8_scaled file, dequantized to BF16" in artifact.base_weight_notes()[0]
    block = artifact.read_block(0).tensors
    assert block["attn.qkv.weight"].dtype == torch.bfloat16
    assert_bitwise(block["attn.qkv.weight"], source.read(["blocks.0.attn.qkv.weight"])["blocks.0.attn.qkv.weight"], "compiled qkv")
    reference = _compile(tmp_path / "bf16", dequantized, "t2va-base4-exact-cpu")
    assert CompiledArtifact(**reference).base_weights["format"] == "bf16"
    ours, theirs = _generate("t2va-base4-exact-cpu", paths), _generate("t2va-base4-exact-cpu", reference)
    assert_bitwise(ours.video_latents, theirs.video_latents, "video latents")
    assert_bitwise(ours.audio_latents, theirs.audio_latents, "audio latents")
    assert ours.metadata["base_weights"]["format"] == "fp8_scaled" and theirs.metadata["base_weights"]["format"] == "bf16"


def test_pruned_files_and_pruned_profiles_pair_only_with_each_other(tmp_path, pruned_file, full_file):
    from vflash_core.weights.compiler import prepare

    with pytest.raises(IdentityMismatchError, match=r"pruned file .* only for a -pruned profile .* t2va-base4-pruned-cpu"):
        prepare("t2va-base4-exact-cpu", pruned_file, tmp_path / "a.json")
    with pytest.raises(IdentityMismatchError, match="holds the full AdaLN weights"):
        prepare("t2va-base4-pruned-cpu", full_file, tmp_path / "b.json")
    assert not list(tmp_path.iterdir())


def test_pruned_profiles_are_their_own_named_profiles():
    from vflash_core.profiles import PROFILES

    pruned = sorted(p for p, v in PROFILES.items() if v.pruned)
    assert pruned == ["t2va-base16-pruned-bf16-sm100", "t2va-base16-pruned-bf16-sm90", "t2va-base4-pruned-cpu", *(f"t2va-turbo4-pruned-{a}" for a in ("sm100", "sm120", "sm80", "sm86", "sm89", "sm90"))]
    assert all("-pruned" in p for p in pruned) and not any(v.pruned for p, v in PROFILES.items() if "-pruned" not in p)
    # The profile identity of the exact profiles is unchanged (their compiled artifacts still load).
    assert "pruned" not in PROFILES["t2va-base4-exact-cpu"].identity() and PROFILES["t2va-base4-pruned-cpu"].identity()["pruned"] is True


def test_lora_modules_feeding_the_tables_are_left_out_on_a_pruned_file(tmp_path, pruned_file):
    """A LoRA's AdaLN modules do not fit the reduced-rank projections: they are left out (as core skips them) and
    recorded; its block modules stay. The tables equal those of the same file without the LoRA."""
    lora = synthetic.write_random_lora(tmp_path / "turbo.safetensors", TINY, rank=4, alpha=4.0, seed=2, adaln_rank=2)
    profile = cpu_profile(id="t2va-lora-pruned-cpu", pruned=True, adapter=AdapterSpec("test", "turbo.safetensors", 4.0, 4))
    paths = _compile(tmp_path / "with", pruned_file, profile, adapter=lora)
    artifact = CompiledArtifact(**paths)
    assert artifact.manifest["adapter_not_applied"] == [f"blocks.{i}.adaln" for i in range(TINY.num_layers)]
    assert "LoRA module(s) feeding the AdaLN tables not applied" in artifact.base_weight_notes()[-1]
    assert artifact.read_block(0).loras["attn.qkv"]
    plain = CompiledArtifact(**_compile(tmp_path / "without", pruned_file, replace(profile, adapter=None)))
    for step in range(4):
        for a, b in zip(artifact.overlay.read_step(step, 0).blocks, plain.overlay.read_step(step, 0).blocks):
            assert_bitwise(a, b, f"step {step}")


# -- the ComfyUI model loader (stand-ins) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    from comfy_standins import harness

    with harness.installed(tmp_path_factory.mktemp("vflash-cache"), tmp_path_factory.mktemp("comfyui")) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def comfy_files(pack):
    """The embedded demo's transformer as a user's Comfy-Org files in models/diffusion_models."""
    import importlib
    from pathlib import Path

    from vflash_core.engine.config import H3Config

    folder = Path(importlib.import_module("folder_paths").models_dir) / "diffusion_models"
    folder.mkdir(parents=True, exist_ok=True)
    demo = H3Config.preset("demo")
    weights = synthetic.random_internal_weights(demo, seed=4)
    synthetic.write_comfy_transformer(folder / "h3_demo_pruned.safetensors", demo, transformer_files.prune_adaln(weights, demo))
    synthetic.write_comfy_transformer(folder / "h3_demo_fp8_scaled.safetensors", demo, weights, fp8="metadata")
    synthetic.write_comfy_transformer(folder / "h3_demo_int8_convrot.safetensors", demo, weights, int8_convrot=16)
    unet = folder.parent / "unet"  # ComfyUI's other diffusion-model folder, where GGUF users often put theirs
    unet.mkdir(exist_ok=True)
    transformer_files.write_gguf_transformer(unet / "h3_demo-Q8_0.gguf", demo, weights, lambda name, shape: "Q8_0" if len(shape) == 2 and shape[1] % 32 == 0 else "F32" if len(shape) == 1 else "BF16")
    _int8_file(folder / "h3_nvfp4.safetensors", {"format": "nvfp4"})
    (folder / "not_h3.gguf").write_bytes(b"GGUF" + bytes(20))
    return folder


def test_model_loader_takes_comfy_files_and_refuses_mismatches_before_model_work(pack, comfy_files):
    """When queued the loader checks the file alone (an nvfp4 file is refused); the file vs the profile is refused by
    the first Vflash node that runs (`graph_checks.check_graph` reads the loader's widgets from the prompt). GGUF files
    in models/unet or models/diffusion_models are listed (not a .gguf that is no H3 transformer)."""
    loader = pack.nodes["VflashModelLoader"]
    options = pack.schema("VflashModelLoader").inputs[0].options
    files = ("h3_demo_pruned.safetensors", "h3_demo_fp8_scaled.safetensors", "h3_demo_int8_convrot.safetensors", "h3_demo-Q8_0.gguf", "h3_nvfp4.safetensors")
    assert set(files) <= set(options) and not [o for o in options if o.startswith("diffusion_models/")]  # as core lists them
    assert "not_h3.gguf" not in options
    for name in files[:4]:
        assert loader.validate_inputs(model=name) is True, name
    refusal = loader.validate_inputs(model="h3_nvfp4.safetensors")
    assert "nvfp4" in refusal and "does not read" in refusal and "int8_convrot" in refusal and "GGUF" in refusal

    graph_checks = pack.package.graph_checks
    widgets = dict(weight_residency="auto", device="cpu", peer_device="none", strategy="sequence-head", attention_backend="auto")

    def refusals(model: str, profile: str) -> list[str]:
        prompt = {"1": {"class_type": "VflashModelLoader", "inputs": dict(model=model, profile=profile, **widgets)}}
        return graph_checks.loader_refusals(prompt, pack.package.host.HOST, pack.package.host.FOLDERS)

    assert refusals("h3_demo_pruned.safetensors", "t2va-base4-pruned-cpu") == []
    assert refusals("h3_demo_fp8_scaled.safetensors", "t2va-base4-exact-cpu") == []
    (refusal,) = refusals("h3_demo_pruned.safetensors", "t2va-base4-exact-cpu")
    assert refusal.startswith("node 1 (VflashModelLoader): ") and "compiles only for a -pruned profile" in refusal and "t2va-base4-pruned-cpu" in refusal
    (refusal,) = refusals("h3_demo_fp8_scaled.safetensors", "t2va-base4-pruned-cpu")
    assert "holds the full AdaLN weights" in refusal
    assert not list(comfy_files.parent.glob("vflash/compiled/*"))  # refusals write nothing


@pytest.mark.parametrize("model,profile,note", [
    ("h3_demo_pruned.safetensors", "t2va-base4-pruned-cpu", "a pruned transformer: approximate AdaLN (rank-8"),
    ("h3_demo_fp8_scaled.safetensors", "t2va-base4-exact-cpu", "transformer weights from an fp8_scaled file, dequantized to BF16"),
    ("h3_demo_int8_convrot.safetensors", "t2va-base4-exact-cpu", "transformer weights: int8_convrot file dequantized"),
    ("h3_demo-Q8_0.gguf", "t2va-base4-exact-cpu", "transformer weights: GGUF file dequantized"),
])
def test_comfy_file_drives_the_t2va_chain(pack, comfy_files, model, profile, note):
    """The demo's t2va graph with the transformer from a Comfy-Org file: compiled on first use, sampled, and the
    sampler's latent says how the weights differ from the release (`vflash_notes`)."""

    from vflash_nodes.workflow import apply_overrides, execute, load_api_workflow

    api = API / "t2va.json"
    workflow = apply_overrides(load_api_workflow(api), [f"1.model={model}", f"1.profile={profile}", "4.width=128", "4.height=128"])
    report = execute(workflow, pack.node_types(workflow))
    latent = report.outputs["5"][0]
    assert any(n.startswith(note) for n in latent["vflash_notes"]), latent["vflash_notes"]
    assert torch.isfinite(latent["samples"].tensors[0]).all()
    pack.package.registry.ENGINES.release("all")


def test_the_streamed_fp8_scaled_writer_writes_the_file_the_in_memory_writer_writes(tmp_path):
    """The full-size benchmark's writer (tensor by tensor, never the whole model in host memory) against
    `write_comfy_transformer(fp8="metadata")` on the same random weights: the same tensors bit for bit, the same
    metadata, and Vflash's reader takes it as an fp8_scaled source."""
    from safetensors import safe_open

    config = replace(TINY, in_channels=24, audio_in_channels=32)
    whole = synthetic.write_comfy_transformer(tmp_path / "whole.safetensors", config, synthetic.random_internal_weights(config, seed=6), fp8="metadata")
    streamed = tmp_path / "streamed.safetensors"
    size = synthetic.write_comfy_fp8_scaled_streamed(streamed, config, synthetic.RandomWeights(config, seed=6))
    assert size == streamed.stat().st_size
    expected, written = load_file(whole), load_file(streamed)
    assert written.keys() == expected.keys()
    assert sum(t.dtype == torch.float8_e4m3fn for t in written.values()) > 0
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    with safe_open(str(whole), "pt") as a, safe_open(str(streamed), "pt") as b:
        assert {k: json.loads(v) for k, v in a.metadata().items()} == {k: json.loads(v) for k, v in b.metadata().items()}
    assert SourceWeights(streamed).format == "fp8_scaled"
