"""The ComfyUI node pack over its headless host: schemas, model folders, the t2va chain on the embedded demo model
to an MP4, core latent interop, interrupts, memory cooperation and engine lifetime.

ComfyUI is not installed here: `vflash_nodes.headless` provides `comfy_api.latest`, `comfy.utils`,
`comfy.model_management`, `comfy.nested_tensor` and `folder_paths` (ComfyUI 0.33.0 interfaces), as it does for
`vflash run-workflow` (`tests/comfy_standins/harness.py`). `tests/test_comfyui_server.py` runs the same workflows
against a real ComfyUI server when `COMFYUI_ROOT` is set.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformer_files
from headless_nodes import API, output_dir, run
from vflash_nodes import comfy_latent as cl
from vflash_nodes.workflow import WorkflowError, apply_overrides, load_api_workflow

from vflash_core.engine.config import H3Config
from vflash_core.errors import RequestError, VflashError

#: The model loader's engine widgets at their defaults, the device the CPU.
LOADER_DEFAULTS = {"weight_residency": "auto", "device": "cpu", "peer_device": "none", "strategy": "sequence-head", "attention_backend": "auto"}

REPO = Path(__file__).resolve().parent.parent
# A small canvas keeps the chain fast on two CPU cores; the workflow files use the demo family's 448x256.
SMALL = ["4.width=128", "4.height=128", "4.force_offload=false"]  # keep the text encoder loaded between runs


@pytest.fixture
def comfy(pack, monkeypatch):
    """The host's modules, with a progress hook that records every update like the server's hook would, and
    `mm.calls` counting the memory-cooperation calls."""
    from collections import Counter

    utils = importlib.import_module("comfy.utils")
    mm = importlib.import_module("comfy.model_management")
    updates: list[tuple[int, int]] = []
    monkeypatch.setattr(mm, "calls", Counter(), raising=False)

    def counted(name, function):
        def call(*args, **kwargs):
            mm.calls[name] += 1
            return function(*args, **kwargs)

        return call

    for name in ("get_torch_device", "unload_all_models", "soft_empty_cache"):
        monkeypatch.setattr(mm, name, counted(name, getattr(mm, name)))

    def hook(value, total, preview, node_id=None):
        mm.throw_exception_if_processing_interrupted()
        updates.append((value, total))

    utils.set_progress_bar_global_hook(hook)
    throttle, utils.PROGRESS_THROTTLE_MIN_INTERVAL = utils.PROGRESS_THROTTLE_MIN_INTERVAL, 0.0  # observe every update
    mm.interrupt_current_processing(False)
    yield mm, updates
    utils.PROGRESS_THROTTLE_MIN_INTERVAL = throttle
    utils.set_progress_bar_global_hook(None)
    mm.interrupt_current_processing(False)


# -- schemas -------------------------------------------------------------------------------------------------------


def test_every_node_schema(pack):
    io = importlib.import_module("comfy_api.latest").io
    assert set(pack.nodes) == {"VflashModelLoader", "VflashLoraSelect", "VflashTextEncoderLoader", "VflashVAELoader", "VflashEncode",
                               "VflashSampler", "VflashDecode", "VflashGenerate", "VflashCompare", "VflashUnload"}
    for node_id, cls in pack.nodes.items():
        schema = cls.GET_SCHEMA()
        assert node_id.startswith("Vflash") and schema.category.startswith("Vflash/"), node_id
        assert schema.display_name and schema.description, node_id
        for inp in schema.inputs:
            for child in inp.get_all():
                if isinstance(child, io.WidgetInput) or (isinstance(inp, io.Autogrow.Input) and child is not inp):
                    assert child.tooltip, f"{node_id}.{child.id} has no tooltip"
        for inp in schema.inputs:
            if isinstance(inp, io.Combo.Input) and (node_id, inp.id) != ("VflashLoraSelect", "lora"):  # no LoRA files here
                assert inp.options and (inp.default is None or inp.default in inp.options), f"{node_id}.{inp.id}"
        assert schema.outputs and schema.node_id == node_id


def test_schema_rules_in_tooltips(pack):
    encode = pack.schema("VflashEncode")
    by_id = {i.id: i for i in encode.inputs}
    assert "17 n + 5" in by_id["length"].tooltip and "multiple of 32" in by_id["width"].tooltip
    sampler = pack.schema("VflashSampler")
    assert "fixed schedule" in sampler.description and "EMPTY" in {i.id: i for i in sampler.inputs}["latent"].tooltip
    unload = pack.schema("VflashUnload")
    assert unload.is_output_node and unload.not_idempotent


def test_root_import_without_comfyui_registers_only_the_packages():
    """Outside ComfyUI the root package imports (no comfy_api), registers vflash_core, exposes no entry point, and
    initialises no CUDA."""
    code = (
        "import importlib.util, sys, torch\n"
        f"spec = importlib.util.spec_from_file_location('vflash_root', {str(REPO / '__init__.py')!r}, submodule_search_locations=[{str(REPO)!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['vflash_root'] = m; spec.loader.exec_module(m)\n"
        "import vflash_core\n"
        "assert not hasattr(m, 'comfy_entrypoint'), 'entry point without ComfyUI'\n"
        "assert 'comfy_api' not in sys.modules and 'nodes' not in sys.modules\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_second_copy_of_the_pack_exposes_no_node_and_warns_naming_both(pack, monkeypatch, caplog, tmp_path):
    """The root `__init__.py` imported from two custom-node folders (two links to this checkout), as ComfyUI imports
    them: the first exposes the entry point, the second no node, with one WARNING naming both folders."""
    import importlib.util
    import logging

    monkeypatch.setattr(importlib.import_module("vflash_nodes.extension"), "PACK_FOLDERS", [])
    copies = []
    for name in ("first", "second"):
        (tmp_path / name).symlink_to(REPO)
        spec = importlib.util.spec_from_file_location(f"vflash_copy_{name}", tmp_path / name / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        with caplog.at_level(logging.WARNING):
            spec.loader.exec_module(module)
        copies.append(module)
    assert hasattr(copies[0], "comfy_entrypoint") and not hasattr(copies[0], "NODE_CLASS_MAPPINGS")
    assert not hasattr(copies[1], "comfy_entrypoint") and copies[1].NODE_CLASS_MAPPINGS == {}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{tmp_path / 'first'} is loaded" in warning and f"the copy in {tmp_path / 'second'} is not" in warning


# -- model folders -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_files(pack) -> Path:
    """Official-layout tiny H3 weights in ComfyUI's model folders, plus files that are not H3 transformers."""
    from safetensors.torch import save_file

    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    models = Path(importlib.import_module("folder_paths").models_dir)
    tiny = H3Config.preset("tiny")
    weights = synthetic.random_internal_weights(tiny, seed=3)
    (models / "diffusion_models").mkdir(parents=True, exist_ok=True)
    transformer_files.write_original_transformer(models / "diffusion_models" / "h3_tiny.safetensors", tiny, weights)
    save_file({"x": torch.zeros(2)}, str(models / "diffusion_models" / "other_model.safetensors"))
    synthetic.write_diffusers_transformer(models / "diffusers" / "H3-tiny" / "transformer", tiny, weights)
    (models / "diffusers" / "not-h3").mkdir(parents=True)
    compiled = models / "vflash" / "my-compiled"
    (compiled / "artifact").mkdir(parents=True)
    (compiled / "artifact" / "manifest.json").write_text("{}")
    return models


def test_model_folders_and_fingerprints(pack, model_files):
    folder_paths = importlib.import_module("folder_paths")
    assert os.path.join(folder_paths.models_dir, "vflash") in folder_paths.get_folder_paths("vflash")
    models = model_files

    options = pack.schema("VflashModelLoader").inputs[0].options
    assert options[0] == "embedded-demo"
    assert {"h3_tiny.safetensors", "diffusers/H3-tiny", "vflash/my-compiled"} <= set(options)
    assert "other_model.safetensors" not in options and "diffusers/not-h3" not in options

    loader = pack.nodes["VflashModelLoader"]
    widgets = dict(profile="t2va-base4-exact-cpu", weight_residency="auto", device="cpu", peer_device="none", strategy="sequence-head", attention_backend="auto")
    before = loader.fingerprint_inputs(model="h3_tiny.safetensors", **widgets)
    assert before == loader.fingerprint_inputs(model="h3_tiny.safetensors", **widgets)
    path = models / "diffusion_models" / "h3_tiny.safetensors"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert loader.fingerprint_inputs(model="h3_tiny.safetensors", **widgets) != before


def test_single_files_are_named_as_core_lists_them_and_the_old_spelling_is_refused(pack, model_files):
    """An option ending in .safetensors or .gguf is a single-file transformer named by its path inside
    diffusion_models, as core's Load Diffusion Model lists it (a subfolder named vflash included: it is no compiled
    output). A workflow saved when the loader spelled it `diffusion_models/<rel>` is refused when the graph is queued,
    in one line naming the option to pick; a file that really sits in diffusion_models/diffusion_models/ (where an
    older template's download landed) is that option and loads."""
    import shutil

    folder = model_files / "diffusion_models"
    for sub in ("vflash", "diffusion_models"):
        (folder / sub).mkdir(exist_ok=True)
        shutil.copy(folder / "h3_tiny.safetensors", folder / sub / "h3_nested.safetensors")
    (folder / "core_only.ckpt").write_bytes(b"")  # ComfyUI lists it; Vflash reads no .ckpt
    model_files_module = pack.package.model_files
    options = model_files_module.model_options(pack.package.host.FOLDERS)
    assert {"h3_tiny.safetensors", "vflash/h3_nested.safetensors", "diffusion_models/h3_nested.safetensors"} <= set(options)
    assert not [o for o in options if o.endswith(".ckpt")]
    assert [model_files_module.option_kind(o) for o in ("vflash/h3_nested.safetensors", "H3.GGUF", "vflash/my-compiled",
            "vflash/x.json", "diffusers/H3-tiny", "embedded-demo")] == ["file", "file", "compiled", "receipt", "root", "demo"]

    loader = pack.nodes["VflashModelLoader"]
    for option in ("h3_tiny.safetensors", "vflash/h3_nested.safetensors", "diffusion_models/h3_nested.safetensors"):
        assert loader.validate_inputs(model=option) is True, option
    assert loader.validate_inputs(model="diffusion_models/h3_tiny.safetensors") == (
        "'diffusion_models/h3_tiny.safetensors' is the old spelling of h3_tiny.safetensors; pick h3_tiny.safetensors in the loader")
    gone = loader.validate_inputs(model="diffusion_models/gone.safetensors")
    assert gone == ("'diffusion_models/gone.safetensors' is the old spelling of gone.safetensors; pick gone.safetensors in the loader "
                    f"once it is in models/diffusion_models (ComfyUI looks in {', '.join(pack.package.host.FOLDERS.folders('diffusion_models'))})")
    assert loader.validate_inputs(model="gone.safetensors").startswith(
        "gone.safetensors is missing: gone.safetensors belongs in models/diffusion_models (ComfyUI looks in ")
    for sub in ("vflash", "diffusion_models"):
        shutil.rmtree(folder / sub)
    (folder / "core_only.ckpt").unlink()


def test_official_single_file_compiles_on_first_use(pack, comfy, model_files):
    """A single-file H3 transformer in diffusion_models is prepared and compiled for the profile once, with progress."""
    mm, updates = comfy
    loader = pack.nodes["VflashModelLoader"]
    kwargs = dict(model="h3_tiny.safetensors", profile="t2va-base4-exact-cpu", weight_residency="auto", device="cpu",
                  peer_device="none", strategy="sequence-head", attention_backend="auto")
    spec = loader.execute(**kwargs).args[0]
    assert Path(spec.files.compile_dir, "artifact", "manifest.json").is_file()
    layers = H3Config.preset("tiny").num_layers
    assert all((block, layers) in updates for block in range(1, layers + 1))  # a step per block
    # Room is asked of the host in bytes (the headless host has no models: only its cache is emptied); never everything
    assert mm.calls["soft_empty_cache"] >= 1 and mm.calls["unload_all_models"] == 0
    registry = pack.package.registry.ENGINES
    assert registry.loaded()["dit"] == "h3_tiny.safetensors"
    with pytest.raises(VflashError, match="choose the profile"):
        loader.execute(**{**kwargs, "profile": "auto"})
    registry.release("dit")


def test_a_model_root_compiles_the_partition_of_its_profile(pack, model_files, monkeypatch):
    """A diffusers model root holds both partitions (`transformer/` for t2va ... fl2va, `transformer_ref/` for ref2va,
    as MiniMaxAI/MiniMax-H3 does): a ref2va profile prepares `transformer_ref/`, a t2va profile `transformer/`; a
    root without the profile's partition is refused naming it, before anything is hashed."""
    from vflash_core.engine.config import H3Config
    from vflash_core.weights import compiler, synthetic

    tiny = H3Config.preset("tiny")
    root = model_files / "diffusers" / "H3-tiny-both"
    synthetic.write_diffusers_transformer(root / "transformer", tiny, synthetic.random_internal_weights(tiny, seed=5))
    synthetic.write_diffusers_transformer(root / "transformer_ref", tiny, synthetic.random_internal_weights(tiny, seed=6))
    prepared = []

    def stop(profile, transformer, *args, **kwargs):
        prepared.append((profile.id, Path(transformer)))
        raise VflashError("stopped after choosing the weights")

    monkeypatch.setattr(compiler, "prepare", stop)
    loader = pack.nodes["VflashModelLoader"]
    widgets = dict(weight_residency="auto", device="cpu", peer_device="none", strategy="sequence-head", attention_backend="auto")
    for profile in ("ref2va-base4-exact-cpu", "t2va-base4-exact-cpu"):
        with pytest.raises(VflashError, match="stopped after choosing the weights"):
            loader.execute(model="diffusers/H3-tiny-both", profile=profile, **widgets)
    assert prepared == [("ref2va-base4-exact-cpu", root / "transformer_ref"), ("t2va-base4-exact-cpu", root / "transformer")]
    with pytest.raises(VflashError, match="diffusers/H3-tiny has no transformer_ref/: profile ref2va-base4-exact-cpu compiles"):
        loader.execute(model="diffusers/H3-tiny", profile="ref2va-base4-exact-cpu", **widgets)
    assert len(prepared) == 2


def test_first_use_compile_can_be_interrupted_and_publishes_nothing(pack, comfy, model_files):
    utils = importlib.import_module("comfy.utils")
    mm, _ = comfy
    layers = H3Config.preset("tiny").num_layers
    hook = utils.PROGRESS_BAR_HOOK

    def cancel_after_first_block(value, total, preview, node_id=None):  # the user presses Cancel once block 1 is done
        hook(value, total, preview, node_id)
        if (value, total) == (1, layers) and not getattr(cancel_after_first_block, "pressed", False):
            cancel_after_first_block.pressed = True
            mm.interrupt_current_processing(True)

    utils.set_progress_bar_global_hook(cancel_after_first_block)
    loader = pack.nodes["VflashModelLoader"]
    kwargs = dict(model="h3_tiny.safetensors", profile="t2va-base16-exact-cpu", weight_residency="auto", device="cpu",
                  peer_device="none", strategy="sequence-head", attention_backend="auto")
    compiled = model_files / "vflash" / "compiled"
    with pytest.raises(mm.InterruptProcessingException):
        loader.execute(**kwargs)
    assert [p.name for p in compiled.iterdir() if "base16" in p.name] == ["h3_tiny-t2va-base16-exact-cpu.weights-receipt.json"]
    utils.set_progress_bar_global_hook(hook)
    spec = loader.execute(**kwargs).args[0]  # the next run compiles from the start, reusing the finished receipt
    assert Path(spec.files.compile_dir, "artifact", "manifest.json").is_file()
    pack.package.registry.ENGINES.release("dit")


# -- the t2va chain -----------------------------------------------------------------------------------------------


def test_t2va_chain_to_mp4(pack, comfy):
    from mp4_probe import probe_mp4

    mm, updates = comfy
    workflow = apply_overrides(load_api_workflow(API / "t2va.json"), [*SMALL, "7.filename_prefix=video/chain"])
    report = run(pack, workflow)
    files = sorted((output_dir() / "video").glob("chain_*.mp4"))
    assert len(files) == 1
    info = probe_mp4(files[0])
    assert (info["frames"], info["width"], info["height"], info["fps"]) == (124, 128, 128, 24.0)
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and abs(info["audio_seconds"] - 124 / 24) < 0.05
    # core types: IMAGE [F, H, W, 3] in 0..1, AUDIO {"waveform": [1, 2, T], "sample_rate"}, VIDEO from components
    images, audio, video = report.outputs["6"]
    assert images.shape == (124, 128, 128, 3) and images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    assert audio["waveform"].shape == (1, 2, round(124 / 24 * audio["sample_rate"])) and audio["sample_rate"] == 32000
    assert video.get_dimensions() == (128, 128) and video.get_components().images.shape[0] == 124
    # the sampler's LATENT is core's nested H3 AV layout
    latent = report.outputs["5"][0]["samples"]
    assert latent.is_nested and latent.tensors[0].shape[:3] == (1, 8, 37) and latent.tensors[1].shape == (1, 8, 2, 207)
    # progress every evaluation (4 for the demo profile); room asked of the host before loading, encoding, sampling
    # and decoding (the headless host has no models of its own: its cache is emptied), never an unload of everything
    assert [u for u in updates if u[1] == 4] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert mm.calls["unload_all_models"] == 0 and mm.calls["soft_empty_cache"] >= 4 and mm.calls["get_torch_device"] >= 1


def test_core_empty_latent_and_create_video(pack, comfy):
    """Core EmptyMiniMaxH3LatentAV (24/32 channels) sets the sampler's canvas; core CreateVideo + SaveVideo save it."""
    from mp4_probe import probe_mp4

    workflow = apply_overrides(load_api_workflow(API / "t2va_core_save.json"), [*SMALL, "10.width=128", "10.height=128", "7.filename_prefix=video/core"])
    report = run(pack, workflow)
    video, audio = report.outputs["5"][0]["samples"].tensors
    assert video.shape == (1, 8, 37, 8, 8) and audio.shape == (1, 8, 2, 207)
    info = probe_mp4(next((output_dir() / "video").glob("core_*.mp4")))
    assert info["frames"] == 124 and info["audio_codec"] == "aac"


def test_sampler_output_decodes_like_core_layout(pack, comfy):
    """The sampler's latent round-trips through core's layout exactly, and VflashDecode accepts core-layout latents."""
    report = run(pack, apply_overrides(load_api_workflow(API / "t2va.json"), [*SMALL, "7.filename_prefix=video/rt"]))
    latent = report.outputs["5"][0]
    av = cl.from_comfy_latent(latent)
    again = cl.to_comfy_latent(av.video, av.audio, type(latent["samples"]))
    assert all(torch.equal(a, b) for a, b in zip(again["samples"].tensors, latent["samples"].tensors))
    assert torch.equal(av.audio[1], latent["samples"].tensors[1][0, :, 1])


def test_sampler_refuses_bad_latents(pack, comfy):
    nested = importlib.import_module("comfy.nested_tensor").NestedTensor
    base = load_api_workflow(API / "t2va.json")
    model = pack.nodes["VflashModelLoader"].execute(**base["1"]["inputs"]).args[0]
    te = pack.nodes["VflashTextEncoderLoader"].execute(**base["2"]["inputs"]).args[0]
    vae = pack.nodes["VflashVAELoader"].execute(**base["3"]["inputs"]).args[0]
    encode_inputs = {**base["4"]["inputs"], "te": te, "vae": vae, "width": 128, "height": 128}
    cond = pack.nodes["VflashEncode"].execute(**encode_inputs).args[0]
    sampler = pack.nodes["VflashSampler"]
    full = {"samples": nested((torch.ones(1, 8, 37, 8, 8), torch.zeros(1, 8, 2, 207)))}
    with pytest.raises(RequestError, match="must be empty"):
        sampler.execute(model=model, cond=cond, latent=full, seed=0)
    with pytest.raises(RequestError, match="nested video"):
        sampler.execute(model=model, cond=cond, latent={"samples": torch.zeros(1, 4, 16, 16)}, seed=0)
    wrong = {"samples": nested((torch.zeros(1, 8, 37, 8, 8), torch.zeros(1, 8, 2, 100)))}
    with pytest.raises(RequestError, match="audio latent has 100 frames"):
        sampler.execute(model=model, cond=cond, latent=wrong, seed=0)


def test_keyframe_conditioning_must_match_the_canvas(pack, comfy):
    from PIL import Image

    Image.new("RGB", (128, 128), (200, 30, 30)).save(Path(importlib.import_module("folder_paths").get_input_directory()) / "vflash_first_frame.png")
    workflow = apply_overrides(load_api_workflow(API / "i2va.json"), [*SMALL, "7.filename_prefix=video/i2va"])
    run(pack, workflow)
    assert list((output_dir() / "video").glob("i2va_*.mp4"))
    mismatched = json.loads(json.dumps(workflow))
    mismatched["10"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 160, "height": 128, "length": 124}}
    mismatched["5"]["inputs"]["latent"] = ["10", 0]
    with pytest.raises(RequestError, match="encoded for 128x128"):
        run(pack, mismatched)


# -- interrupts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_interrupt_at_evaluation_k_stops_within_one_and_next_run_succeeds(pack, comfy, k):
    mm, _ = comfy
    workflow = apply_overrides(load_api_workflow(API / "t2va.json"), [*SMALL, f"7.filename_prefix=video/interrupt{k}", f"5.seed={k}"])
    registry = pack.package.registry.ENGINES
    run(pack, {nid: n for nid, n in workflow.items() if nid == "1"} | {"9": {"class_type": "VflashUnload", "inputs": {"anything": ["1", 0], "what": "te"}}})
    session = registry.engine("dit")
    hook = importlib.import_module("comfy.utils").PROGRESS_BAR_HOOK
    seen: list[int] = []

    def interrupting(value, total, preview, node_id=None):
        hook(value, total, preview, node_id)
        if total == 4:
            seen.append(value)
            if value == k:
                mm.interrupt_current_processing(True)  # the user presses Cancel right after evaluation k

    importlib.import_module("comfy.utils").set_progress_bar_global_hook(interrupting)
    with pytest.raises(mm.InterruptProcessingException):
        run(pack, workflow)
    # Stopped between the blocks of evaluation k + 1: no further evaluation completed.
    assert seen == list(range(1, k + 1))
    assert not list((output_dir() / "video").glob(f"interrupt{k}_*.mp4"))
    # The engine stayed loaded and usable: the next run reuses it and succeeds.
    importlib.import_module("comfy.utils").set_progress_bar_global_hook(hook)
    run(pack, workflow)
    assert registry.engine("dit") is session and not session.closed
    assert list((output_dir() / "video").glob(f"interrupt{k}_*.mp4"))


def test_interrupt_during_load_leaves_nothing_half_loaded(pack, comfy):
    mm, _ = comfy
    registry = pack.package.registry.ENGINES
    registry.release("all")
    loader = pack.nodes["VflashModelLoader"]
    kwargs = dict(model="embedded-demo", profile="auto", weight_residency="auto", device="auto", peer_device="none", strategy="sequence-head", attention_backend="auto")
    mm.interrupt_current_processing(True)
    with pytest.raises(mm.InterruptProcessingException):
        loader.execute(**kwargs)
    assert "dit" not in registry.loaded()
    spec = loader.execute(**kwargs).args[0]
    assert registry.loaded()["dit"] == "embedded-demo" and spec.options.device == "cpu"


# -- memory cooperation ---------------------------------------------------------------------------------------------


def test_force_offload_and_unload_release_and_next_run_reloads(pack, comfy):
    registry = pack.package.registry.ENGINES
    workflow = apply_overrides(load_api_workflow(API / "t2va.json"), [*SMALL, "5.force_offload=true", "4.force_offload=true", "7.filename_prefix=video/offload"])
    run(pack, workflow)
    assert "dit" not in registry.loaded() and "te" not in registry.loaded() and "vae" in registry.loaded()
    unload = {**workflow, "9": {"class_type": "VflashUnload", "inputs": {"anything": ["7", 0], "what": "all"}}}
    run(pack, apply_overrides(unload, ["7.filename_prefix=video/offload2"]))
    assert registry.loaded() == {}
    run(pack, apply_overrides(workflow, ["7.filename_prefix=video/offload3", "5.force_offload=false"]))
    assert set(registry.loaded()) == {"dit", "vae"}
    assert len(list((output_dir() / "video").glob("offload*.mp4"))) == 3


def test_memory_plan_line_per_run(pack, comfy, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="vflash"):
        run(pack, apply_overrides(load_api_workflow(API / "t2va.json"), [*SMALL, "7.filename_prefix=video/plan"]))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Vflash memory plan:")]
    assert len(lines) == 1 and "residency resident" in lines[0] and "blocks on device" in lines[0] and "pinned host" in lines[0] and "peak allocated" in lines[0]


# -- the encode split equals the pipeline's bundle ------------------------------------------------------------------


def test_reference_clip_soundtracks_travel_with_their_clip(pack, comfy, monkeypatch):
    """`ref_video_audio_k` becomes the soundtrack of `ref_video_k`'s reference, as a video file's own audio does in the
    pipeline; what follows (normalisation, encoders) is the pipeline's shared code."""
    from vflash_nodes import actions

    from vflash_core.pipeline import steps

    registry = pack.package.registry.ENGINES
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS
    te = actions.load_component(registry, host, folders, "te", "embedded-demo", "cpu")
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    seen = []

    class Stop(Exception):
        pass

    def spy(raw, *args):
        seen.extend(raw)
        raise Stop

    monkeypatch.setattr(steps, "normalize_references", spy)
    clip = torch.rand(22, 32, 48, 3)
    voice = {"waveform": torch.rand(1, 1, 48000) - 0.5, "sample_rate": 48000}
    picture = torch.rand(1, 32, 32, 3)
    with pytest.raises(Stop):
        actions.encode(registry, host, te, vae, "<Picture 1> in <Video 1>, then <Video 2>", 128, 96, 124, 0.0, ref_images={"ref_image_0": picture},
                   ref_videos={"ref_video_0": clip, "ref_video_1": None, "ref_video_2": clip}, ref_video_audios={"ref_video_audio_2": voice})
    kinds = [(ref.kind, ref.has_audio) for ref in seen]
    assert kinds == [("image", False), ("video", False), ("video", True)]
    assert torch.equal(torch.as_tensor(seen[2].audio), voice["waveform"][0]) and seen[2].sample_rate == 48000
    with pytest.raises(RequestError, match="ref_video_audio_1 is the soundtrack of ref_video_1, which is not connected"):
        actions.encode(registry, host, te, vae, "<Video 1>", 128, 96, 124, 0.0, ref_videos={"ref_video_0": clip}, ref_video_audios={"ref_video_audio_1": voice})


@pytest.mark.parametrize("keyframes", [(), ("first", "last")])
def test_encode_then_sample_bundle_equals_pipeline_bundle(pack, comfy, keyframes, tmp_path):
    """VflashEncode + the sampler's noise draw build exactly the bundle `pipeline.build_request_bundle` builds."""
    import numpy as np
    from PIL import Image
    from vflash_nodes import actions, engines

    from vflash_core.pipeline.h3_pipeline import VideoRequest, build_request_bundle, plan_request

    registry = pack.package.registry.ENGINES
    host = pack.package.host.HOST
    folders = pack.package.host.FOLDERS
    te = actions.load_component(registry, host, folders, "te", "embedded-demo", "cpu")
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    actions.load_model(registry, host, engines.transformer_spec(host, folders, "embedded-demo", "auto", LOADER_DEFAULTS))
    images = {}
    for name, color in zip(keyframes, ((250, 20, 20), (20, 20, 250))):
        pixels = np.zeros((96, 160, 3), np.uint8)
        pixels[..., :] = color
        pixels[10:40, 30:90] = 255
        Image.fromarray(pixels).save(tmp_path / f"{name}.png")
        images[name] = torch.from_numpy(pixels.astype(np.float32) / 255.0)[None]
    prompt = "A red square <Picture 1> turns blue." if keyframes else "Waves crash on a rocky shore."
    cond, latent, _ = actions.encode(registry, host, te, vae, prompt, 128, 96, 124, 0.0, images.get("first"), images.get("last"), force_offload=False)
    session = registry.engine("dit")
    mine = cond.bundle(session.compiled.config, 7, cl.from_comfy_latent(latent).geometry).consume()
    request = VideoRequest(prompt, first_frame=tmp_path / "first.png" if keyframes else None, last_frame=tmp_path / "last.png" if keyframes else None,
                           duration_seconds=5.0, seed=7, width=128, height=96)
    te, vaes = registry.engine("te"), registry.engine("vae")
    plan = plan_request(request, session.profile, te.canvas)
    theirs = build_request_bundle(te, vaes, request, plan, session.compiled.config).consume()
    assert mine.mode == theirs.mode == ("fl2va" if keyframes else "t2va")
    assert mine.fingerprint() == theirs.fingerprint()


def test_reference_clip_with_soundtrack_bundle_equals_pipeline_bundle(pack, comfy, tmp_path):
    """ref2va with a picture and a clip carrying its own 48 kHz soundtrack: the node's IMAGE + AUDIO inputs, decoded
    from the MP4 the pipeline reads, give the pipeline's bundle."""
    import numpy as np
    from PIL import Image
    from vflash_nodes import actions, engines

    from vflash_core.media.mp4 import write_mp4
    from vflash_core.media.references import frames_to_uint8, load_reference
    from vflash_core.pipeline.h3_pipeline import VideoRequest, build_request_bundle, plan_request
    from vflash_core.profiles import get_profile

    registry = pack.package.registry.ENGINES
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS
    te = actions.load_component(registry, host, folders, "te", "embedded-demo", "cpu")
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    actions.load_model(registry, host, engines.transformer_spec(host, folders, "embedded-demo", "auto", LOADER_DEFAULTS))
    g = torch.Generator().manual_seed(5)
    picture = np.random.default_rng(5).integers(0, 255, (60, 90, 3), dtype=np.uint8)
    Image.fromarray(picture).save(tmp_path / "picture.png")
    clip_path = write_mp4(tmp_path / "clip.mp4", torch.rand(16, 64, 96, 3, generator=g), torch.rand(2, 32000, generator=g) - 0.5, 48000)
    decoded = load_reference(clip_path)
    assert decoded.fps == 24 and decoded.sample_rate == 48000
    frames = torch.from_numpy(frames_to_uint8(decoded.frames).astype(np.float32) / 255.0)
    soundtrack = {"waveform": torch.as_tensor(decoded.audio, dtype=torch.float32)[None], "sample_rate": decoded.sample_rate}
    prompt = "<Picture 1> dances to <Video 1>."
    cond, latent, _ = actions.encode(registry, host, te, vae, prompt, 96, 64, 124, 0.0, ref_images={"ref_image_0": torch.from_numpy(picture.astype(np.float32) / 255.0)[None]},
                                 ref_videos={"ref_video_0": frames}, ref_video_audios={"ref_video_audio_0": soundtrack}, force_offload=False)
    config = registry.engine("dit").compiled.config
    mine = cond.bundle(config, 7, cl.from_comfy_latent(latent).geometry).consume()
    request = VideoRequest(prompt, references=(str(tmp_path / "picture.png"), str(clip_path)), duration_seconds=5.0, seed=7, width=96, height=64)
    te, vaes = registry.engine("te"), registry.engine("vae")
    plan = plan_request(request, get_profile("ref2va-base4-exact-cpu"), te.canvas)
    theirs = build_request_bundle(te, vaes, request, plan, config).consume()
    assert mine.mode == theirs.mode == "ref2va"
    assert mine.fingerprint() == theirs.fingerprint()


# -- workflows with unsupported nodes -----------------------------------------------------------------------------------


def test_unsupported_core_node_is_named_before_anything_runs(pack):
    workflow = load_api_workflow(API / "t2va.json")
    workflow["20"] = {"class_type": "KSampler", "inputs": {}}
    from vflash_nodes.workflow import headless_node_types, plan

    with headless_node_types() as types, pytest.raises(WorkflowError, match=r"unsupported nodes: 20 \(KSampler\)"):
        plan(workflow, types)


def test_generate_node_all_in_one(pack, comfy):
    from mp4_probe import probe_mp4

    base = load_api_workflow(API / "t2va.json")
    workflow = {nid: base[nid] for nid in ("1", "2", "3")}
    workflow["4"] = {"class_type": "VflashGenerate", "inputs": {
        "model": ["1", 0], "te": ["2", 0], "vae": ["3", 0], "prompt": "Waves crash on a rocky shore.", "width": 128, "height": 128,
        "length": 100, "seconds": 5.0, "seed": 3, "force_offload": False}}
    workflow["7"] = {"class_type": "SaveVideo", "inputs": {"video": ["4", 0], "filename_prefix": "video/generate", "format": "auto"}}
    report = run(pack, workflow)
    _, images, audio = report.outputs["4"]
    assert images.shape[0] == 124 and audio["waveform"].shape[1] == 2  # seconds=5.0 overrides length, snapped to 17 n + 5
    assert probe_mp4(next((output_dir() / "video").glob("generate_*.mp4")))["frames"] == 124


def test_lora_select_chains_and_loader_refuses_chains_it_cannot_apply(pack, model_files):
    from safetensors.torch import save_file

    loras = model_files / "loras"
    loras.mkdir(exist_ok=True)
    save_file({"x": torch.zeros(1)}, str(loras / "style.safetensors"))
    assert "style.safetensors" in pack.schema("VflashLoraSelect").inputs[0].options
    select = pack.nodes["VflashLoraSelect"]
    chain = select.execute(lora="style.safetensors", strength=0.5).args[0]
    chain = select.execute(lora="style.safetensors", strength=1.0, prev=chain).args[0]
    assert [round(ref.strength, 2) for ref in chain] == [0.5, 1.0] and chain[0].path.endswith("style.safetensors")
    loader = pack.nodes["VflashModelLoader"]
    with pytest.raises(VflashError, match="already compiled"):
        loader.execute(model="embedded-demo", profile="auto", weight_residency="auto", device="auto", peer_device="none",
                       strategy="sequence-head", attention_backend="auto", lora=chain)
    with pytest.raises(VflashError, match=r"style.safetensors: 1 LoRA key\(s\) do not name an H3 module: x"):  # chains any number
        loader.execute(model="diffusers/H3-tiny", profile="t2va-base4-exact-cpu", weight_residency="auto", device="cpu", peer_device="none",
                       strategy="sequence-head", attention_backend="auto", lora=chain)


def test_model_loader_refuses_missing_devices_and_unknown_options(pack):
    loader = pack.nodes["VflashModelLoader"]
    with pytest.raises(VflashError, match="cuda:3 does not exist"):
        loader.execute(model="embedded-demo", profile="auto", weight_residency="auto", device="cuda:3", peer_device="none",
                       strategy="sequence-head", attention_backend="auto")
    with pytest.raises(VflashError, match="residency"):
        loader.execute(model="embedded-demo", profile="auto", weight_residency="everywhere", device="auto", peer_device="none",
                       strategy="sequence-head", attention_backend="auto")
