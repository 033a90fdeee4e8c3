"""The Vflash nodes with ComfyUI core's own loaders (test-only stand-ins, over the headless host): core CLIP (CLIPLoader type minimax)
and core VAEs (VAELoader, video + audio) drive Vflash Encode / Sampler / Decode; refusals happen before any model
work; option lists hold what this machine runs; every socket has a tooltip and every node is found by
"MiniMax H3".

The stand-in CLIP and VAEs compute the family's own diffusers numerics (see `comfy_standins/core_loaders.py`), so these
tests check the node side: the presentation handed to core, the layouts taken from and given back to core's objects,
and that nothing is rounded on the way (bundles equal bitwise). Core's own numerics are measured against a real
ComfyUI in `tests/test_comfyui_server.py`.
"""

from __future__ import annotations

import importlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformer_files
from headless_nodes import API
from vflash_nodes import actions, core_adapters, engines, graph_checks, model_files
from vflash_nodes import comfy_latent as cl
from vflash_nodes.workflow import apply_overrides, execute, load_api_workflow

from vflash_core.errors import RequestError, VflashError

#: The model loader's engine widgets at their defaults, the device the CPU.
LOADER_DEFAULTS = {"weight_residency": "auto", "device": "cpu", "peer_device": "none", "strategy": "sequence-head", "attention_backend": "auto"}

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def core_files(pack) -> dict[str, str]:
    """The demo family's text encoder and VAEs named in text_encoders/ and vae/ for the stand-in core loaders."""
    from vflash_core.pipeline.h3_pipeline import PreparedAssets

    host = pack.package.host.HOST
    root = PreparedAssets.load(model_files.demo_receipt(host)).model_root
    models = Path(importlib.import_module("folder_paths").models_dir)
    names = {"text_encoder": "text_encoders/h3_demo_te.json", "video_vae": "vae/h3_demo_video_vae.json", "audio_vae": "vae/h3_demo_audio_vae.json"}
    for part, rel in names.items():
        (models / rel).parent.mkdir(parents=True, exist_ok=True)
        (models / rel).write_text(json.dumps({"family_root": str(root), "part": part}))
    return {part: rel.split("/", 1)[1] for part, rel in names.items()}


def _core(pack, core_files):
    clip = pack.core["CLIPLoader"].execute(clip_name=core_files["text_encoder"], type="minimax").args[0]
    video = pack.core["VAELoader"].execute(vae_name=core_files["video_vae"]).args[0]
    audio = pack.core["VAELoader"].execute(vae_name=core_files["audio_vae"]).args[0]
    return clip, video, audio


def _core_loaders_workflow(core_files) -> dict:
    workflow = load_api_workflow(API / "t2va_core_loaders.json")
    workflow["1"]["inputs"].update(model="embedded-demo", profile="auto")  # the demo transformer: text width of the demo family
    workflow["2"]["inputs"]["clip_name"] = core_files["text_encoder"]
    workflow["3"]["inputs"]["vae_name"] = core_files["video_vae"]
    workflow["12"]["inputs"]["vae_name"] = core_files["audio_vae"]
    return workflow


# -- core loaders in a graph -------------------------------------------------------------------------------------


def test_core_clip_and_vae_loaders_drive_the_sampler_to_mp4(pack, core_files):
    from mp4_probe import probe_mp4

    workflow = apply_overrides(_core_loaders_workflow(core_files), ["4.width=128", "4.height=128", "7.filename_prefix=video/core_loaders"])
    report = execute(workflow, pack.node_types(workflow))
    out = Path(importlib.import_module("folder_paths").get_output_directory()) / "video"
    info = probe_mp4(next(out.glob("core_loaders_*.mp4")))
    assert (info["frames"], info["width"], info["height"]) == (124, 128, 128)
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and abs(info["audio_seconds"] - 124 / 24) < 0.05
    # The result says how it differs from the diffusers pipeline: core's text encoder is not bitwise it.
    latent = report.outputs["5"][0]
    assert any("not bitwise" in note for note in latent["vflash_notes"])
    cond = report.outputs["4"][0]
    assert cond.notes == (core_adapters.CORE_TEXT_NOTE,)  # t2va: no VAE-encoded conditions, so no VAE note
    # core's VAEs decode the sampler's latent: frames and a 32 kHz soundtrack of the video's length
    images, audio, _ = report.outputs["6"]
    assert images.shape == (124, 128, 128, 3) and audio["sample_rate"] == 32000 and audio["waveform"].shape == (1, 2, round(124 / 24 * 32000))


@pytest.mark.parametrize("keyframes", [(), ("first", "last")])
def test_core_encoders_give_the_vflash_bundle_bitwise(pack, core_files, keyframes):
    """Through core's CLIP and VAE interfaces the encode node builds the same bundle, bit for bit, as with Vflash's
    loaders when the core objects compute the same numbers: the adapters reorder nothing and round nothing."""
    registry = pack.package.registry.ENGINES
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS
    te = actions.load_component(registry, host, folders, "te", "embedded-demo", "cpu")
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    actions.load_model(registry, host, engines.transformer_spec(host, folders, "embedded-demo", "auto", LOADER_DEFAULTS))
    clip, video_vae, audio_vae = _core(pack, core_files)
    g = torch.Generator().manual_seed(3)
    frames = {name: torch.rand(1, 80, 144, 3, generator=g) for name in keyframes}
    prompt = "A red square <Picture 1> turns blue." if keyframes else "Waves crash on a rocky shore."
    mine, latent, _ = actions.encode(registry, host, te, vae, prompt, 128, 96, 124, 0.0, frames.get("first"), frames.get("last"), force_offload=False)
    core, core_latent, _ = actions.encode(registry, host, clip, video_vae, prompt, 128, 96, 124, 0.0, frames.get("first"), frames.get("last"), audio_vae=audio_vae)
    # core was handed Vflash's presentation: the canvas-fitted keyframes, in order, as IMAGE tensors
    call = clip.calls[-1]
    assert call["text"] == prompt and call["minimax_ref_items"] is None and len(call["images"]) == len(keyframes)
    assert all(img.shape == (1, 96, 128, 3) for img in call["images"])
    config = registry.engine("dit").compiled.config
    geometry = cl.from_comfy_latent(latent).geometry
    assert cl.from_comfy_latent(core_latent).geometry == geometry
    a = mine.bundle(config, 5, geometry).consume()
    b = core.bundle(config, 5, geometry).consume()
    assert a.mode == b.mode == ("fl2va" if keyframes else "t2va") and a.fingerprint() == b.fingerprint()
    assert core.notes == ((core_adapters.CORE_TEXT_NOTE, core_adapters.CORE_VAE_NOTE) if keyframes else (core_adapters.CORE_TEXT_NOTE,)) and mine.notes == ()


def test_core_vae_decode_equals_vflash_decode(pack, core_files):
    registry = pack.package.registry.ENGINES
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    _, video_vae, audio_vae = _core(pack, core_files)
    nested = importlib.import_module("comfy.nested_tensor").NestedTensor
    g = torch.Generator().manual_seed(1)
    latent = cl.to_comfy_latent(torch.randn(1, 8, 7, 4, 4, generator=g), torch.randn(2, 8, 37, generator=g), nested)
    images, audio, _ = actions.decode(registry, host, vae, latent)
    core_images, core_audio, video = actions.decode(registry, host, video_vae, latent, audio_vae)
    assert torch.equal(images, core_images) and torch.equal(audio["waveform"], core_audio["waveform"])
    assert video.get_components().images.shape[0] == images.shape[0]


def test_references_reach_core_clip_in_request_order(pack, core_files, monkeypatch):
    """ref2va through core CLIP: `minimax_ref_items` in request order, an `audio` item before each reference that
    carries sound (so core labels <Audio j> as Vflash does), videos as their 2 fps frames."""
    from vflash_core.media.references import CanvasRules

    registry = pack.package.registry.ENGINES
    host = pack.package.host.HOST
    _, video_vae, audio_vae = _core(pack, core_files)
    family = CanvasRules.from_model_root(json.loads(Path(importlib.import_module("folder_paths").get_full_path("vae", core_files["video_vae"])).read_text())["family_root"])
    base = core_adapters.CoreTextConditioner
    small = type("SmallCanvasCoreText", (base,), {"__init__": lambda self, clip: base.__init__(self, clip, family)})
    monkeypatch.setattr(core_adapters, "CoreTextConditioner", small)  # the demo family's reference sizes, not the released 2048 px

    class RecordingClip:
        def __init__(self):
            self.items = None

        def tokenize(self, text, images=(), minimax_ref_items=None, **kwargs):
            self.items = minimax_ref_items
            return {"qwen3vl_32b": [[(1, 1.0)]]}

        def encode_from_tokens_scheduled(self, tokens):
            return [[torch.zeros(1, 6, 32), {"pooled_output": None, "minimax_token_tags": torch.ones(6, dtype=torch.long)}]]

    clip = RecordingClip()
    g = torch.Generator().manual_seed(2)
    clip_frames = torch.rand(48, 64, 96, 3, generator=g)
    voice = {"waveform": torch.rand(1, 2, 96000, generator=g) - 0.5, "sample_rate": 48000}
    cond, _, _ = actions.encode(registry, host, clip, video_vae, "<Picture 1> sings over <Video 1> and <Audio 2>.", 128, 96, 124, 0.0,
                            ref_images={"ref_image_0": torch.rand(1, 64, 64, 3, generator=g)}, ref_videos={"ref_video_0": clip_frames},
                            ref_video_audios={"ref_video_audio_0": voice}, ref_audios={"ref_audio_0": voice}, audio_vae=audio_vae)
    assert [item["type"] for item in clip.items] == ["image", "audio", "video", "audio"]
    assert clip.items[0]["data"].ndim == 4 and clip.items[2]["data"].shape[0] == 4  # 2 s of 24 fps frames read at 2 fps
    assert cond.mode == "ref2va" and cond.notes == (core_adapters.CORE_TEXT_NOTE, core_adapters.CORE_VAE_NOTE)
    assert [ref.kind for ref in cond.references] == ["image", "video", "audio"]


def test_core_objects_are_refused_by_name(pack, core_files):
    registry = pack.package.registry.ENGINES
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS
    _, video_vae, audio_vae = _core(pack, core_files)
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    nested = importlib.import_module("comfy.nested_tensor").NestedTensor
    latent = cl.to_comfy_latent(torch.zeros(1, 8, 7, 4, 4), torch.zeros(2, 8, 37), nested)
    with pytest.raises(RequestError, match="connect MiniMax-H3's audio VAE"):
        actions.decode(registry, host, video_vae, latent)
    with pytest.raises(RequestError, match="takes MiniMax-H3's video VAE"):
        actions.decode(registry, host, audio_vae, latent, audio_vae)
    with pytest.raises(RequestError, match="already holds both VAEs"):
        actions.decode(registry, host, vae, latent, audio_vae)
    with pytest.raises(RequestError, match="te takes a Vflash text encoder"):
        actions.encode(registry, host, object(), vae, "a prompt", 128, 96, 124, 0.0)

    class OtherClip:  # a CLIP of another model: its conditioning carries no H3 token tags
        def tokenize(self, text, **kwargs):
            return {}

        def encode_from_tokens_scheduled(self, tokens):
            return [[torch.zeros(1, 4, 32), {"pooled_output": None}]]

    with pytest.raises(RequestError, match="type 'minimax'"):
        actions.encode(registry, host, OtherClip(), vae, "a prompt", 128, 96, 124, 0.0)


# -- early refusal ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def official_weights(pack) -> str:
    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    models = Path(importlib.import_module("folder_paths").models_dir)
    tiny = H3Config.preset("tiny")
    (models / "diffusion_models").mkdir(parents=True, exist_ok=True)
    transformer_files.write_original_transformer(models / "diffusion_models" / "h3_early.safetensors", tiny, synthetic.random_internal_weights(tiny, seed=4))
    return "h3_early.safetensors"


def test_the_loader_checks_its_model_option_when_queued_and_its_widgets_before_model_work(pack, official_weights, monkeypatch):
    """When the graph is queued the loader checks its model option alone (ComfyUI files a refusal of validate_inputs
    once per argument it takes): a missing file is one refusal naming the folder it belongs in. The checks across its
    widgets (an sm90 profile on this CPU machine) run in the first Vflash node, naming what runs here, before anything
    is prepared or loaded."""
    from vflash_core.weights import compiler

    pack.package.registry.ENGINES.release("all")
    loader = pack.nodes["VflashModelLoader"]
    assert loader.validate_inputs(model=official_weights) is True and loader.validate_inputs(model="embedded-demo") is True
    missing = loader.validate_inputs(model="minimax_h3_fl2va_bf16.safetensors")
    assert missing.startswith("minimax_h3_fl2va_bf16.safetensors is missing: minimax_h3_fl2va_bf16.safetensors belongs in models/diffusion_models: "
                              "download https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/diffusion_models/minimax_h3_fl2va_bf16.safetensors (ComfyUI looks in ")
    # The templates' official folder names where to get it; an option no template ships has no download to name.
    assert loader.validate_inputs(model="diffusers/MiniMax-H3").startswith(
        "diffusers/MiniMax-H3 is missing: MiniMax-H3 belongs in models/diffusers: download the repository https://huggingface.co/MiniMaxAI/MiniMax-H3 as that folder (ComfyUI looks in ")
    assert loader.validate_inputs(model="diffusers/absent").startswith("diffusers/absent is missing: absent belongs in models/diffusers (ComfyUI looks in ")

    widgets = dict(model=official_weights, profile="t2va-base16-bf16-sm90", weight_residency="auto", device="auto", peer_device="none",
                   strategy="sequence-head", attention_backend="auto")
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS

    def refusals(**changes) -> list[str]:
        return graph_checks.loader_refusals({"1": {"class_type": "VflashModelLoader", "inputs": {**widgets, **changes}}}, host, folders)

    (refusal,) = refusals()
    assert "t2va-base16-bf16-sm90 runs on sm90 GPUs" in refusal and "cpu" in refusal and "t2va-base4-exact-cpu" in refusal  # names what runs here
    touched = []
    monkeypatch.setattr(compiler, "prepare", lambda *a, **k: touched.append("prepare"))
    with pytest.raises(VflashError, match="runs on sm90 GPUs"):
        loader.execute(**widgets)
    compiled = Path(importlib.import_module("folder_paths").models_dir) / "vflash" / "compiled"
    assert touched == [] and not list(compiled.glob("h3_early*")) and "dit" not in pack.package.registry.ENGINES.loaded()
    # cpu profiles, explicit devices that exist, and the demo pass
    assert refusals(profile="t2va-base4-exact-cpu") == [] and refusals(model="embedded-demo", profile="auto") == []
    assert "cuda:3 does not exist" in refusals(model="embedded-demo", profile="auto", device="cuda:3")[0]
    assert "unknown profile" in refusals(profile="t2va-nope")[0]
    assert refusals(model=["7", 0]) == []  # a linked widget is checked when the loader runs
    assert "does not exist" in pack.nodes["VflashTextEncoderLoader"].validate_inputs(device="cuda:1")
    assert pack.nodes["VflashVAELoader"].validate_inputs(device="cpu") is True


def test_a_graph_with_an_sm90_profile_is_refused_before_it_runs_on_cpu(pack, official_weights):
    """The whole t2va graph as run-workflow runs it: the profile list holds only what this machine runs, so the
    headless host refuses the value before any node runs, as ComfyUI does when the graph is queued; nothing loads."""
    registry = pack.package.registry.ENGINES
    registry.release("all")
    workflow = apply_overrides(load_api_workflow(API / "t2va.json"), [f"1.model={official_weights}", "1.profile=t2va-base16-bf16-sm90"])
    ran = []
    with pytest.raises(VflashError, match=r"refused before running: node 1 \(VflashModelLoader\): profile must be one of auto, .*got \"t2va-base16-bf16-sm90\""):
        execute(workflow, pack.node_types(workflow), on_node=lambda nid, class_type: ran.append(nid))
    assert ran == [] and registry.loaded() == {}


@pytest.mark.parametrize("change,refusal", [
    ({"1.model": "embedded-demo", "1.profile": "auto", "2.encoder": "embedded-demo", "3.vae": "embedded-demo"},
     r"profile t2va-base4-exact-cpu \(node 1\) accepts t2va, i2va, l2va, fl2va; node 4 \(VflashEncode\) encodes a ref2va request"),
])
def test_profile_vs_the_graphs_request_is_refused_before_any_model_work(pack, change, refusal):
    """A ref2va graph on a t2va-only profile: the first Vflash node to run reads the graph (ComfyUI's hidden prompt)
    and refuses before any model loads, whichever node ComfyUI runs first; headless refuses before running."""
    from vflash_nodes.workflow import WorkflowError, run_headless

    registry = pack.package.registry.ENGINES
    registry.release("all")
    workflow = apply_overrides(load_api_workflow(API / "ref2va.json"), [f"{k}={v}" for k, v in change.items()])
    shutil.copy(REPO / "workflows" / "inputs" / "vflash_reference.png", importlib.import_module("folder_paths").get_input_directory())  # LoadImage checks it
    ran = []
    with pytest.raises(VflashError, match=refusal):
        execute(workflow, pack.node_types(workflow), on_node=lambda nid, class_type: ran.append(class_type))
    assert len(ran) == 1 and registry.loaded() == {}  # the first node refused; nothing loaded
    with pytest.raises(WorkflowError, match=refusal):
        run_headless(workflow, output_dir=Path(importlib.import_module("folder_paths").get_output_directory()) / "refused")
    # the clip length is the profile's too
    long = apply_overrides(load_api_workflow(API / "t2va.json"), ["4.length=400"])
    with pytest.raises(VflashError, match="generates 5-15 s clips"):
        execute(long, pack.node_types(long))
    assert registry.loaded() == {}


def test_profile_vs_mode_is_refused_before_the_transformer_is_touched(pack, monkeypatch):
    registry = pack.package.registry.ENGINES
    host, folders = pack.package.host.HOST, pack.package.host.FOLDERS
    te = actions.load_component(registry, host, folders, "te", "embedded-demo", "cpu")
    vae = actions.load_component(registry, host, folders, "vae", "embedded-demo", "cpu")
    cond, latent, _ = actions.encode(registry, host, te, vae, "Waves crash.", 128, 96, 124, 0.0, force_offload=False)
    ref_profile = engines.transformer_spec(host, folders, "embedded-demo", "auto", LOADER_DEFAULTS)
    wrong = replace(ref_profile, files=replace(ref_profile.files, profile="ref2va-base4-exact-cpu"))
    registry.release("dit")
    monkeypatch.setattr(actions, "load_session", lambda *a, **k: pytest.fail("the transformer was loaded"))
    with pytest.raises(VflashError, match="accepts ref2va; a t2va request"):
        actions.sample(registry, host, wrong, cond, latent, 0)
    long = actions.encode(registry, host, te, vae, "Waves crash.", 128, 96, 400, 0.0, force_offload=False)  # 413 frames, 17.2 s
    with pytest.raises(VflashError, match="5-15 s clips"):
        actions.sample(registry, host, ref_profile, long[0], long[1], 0)


def test_option_lists_hold_only_what_runs_here(pack, monkeypatch):
    from vflash_core.engine.attention_backends import BACKENDS
    from vflash_core.profiles import PROFILES

    loader = pack.schema("VflashModelLoader")
    by_id = {i.id: i for i in loader.inputs}
    assert by_id["profile"].options == ["auto", *sorted(p for p in PROFILES if p.endswith("-cpu"))]
    assert by_id["device"].options == ["auto", "cpu"] and by_id["peer_device"].options == ["none"]
    # Without a GPU only the CPU's attention backends (every backend was offered, the GPU's refused when run).
    assert by_id["attention_backend"].options == ["auto", "torch-sdpa", "torch-math"]
    # On a machine with two sm90 GPUs: their profiles, then the CPU's; no profile of another architecture.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    runnable = engines.runnable_profiles()
    sm90 = sorted(p for p in PROFILES if p.endswith("-sm90"))
    assert runnable == ["auto", *sm90, *sorted(p for p in PROFILES if p.endswith("-cpu"))]
    assert engines.present_devices() == ["auto", "cpu", "cuda:0", "cuda:1"]
    assert engines.runnable_backends() == list(BACKENDS)


# -- found where users look ------------------------------------------------------------------------------------------


def test_names_aliases_and_tooltips_on_every_socket(pack):
    """Every socket has a tooltip. The frontend looks a socket's tooltip up by its name, and an Autogrow slot's name
    (`ref_images.ref_image_0`) is not an input of the node definition, so the slots' tooltips reach it through the
    pack's locale file (`locales/en/nodeDefs.json`, key `ref_images_ref_image_0`), which holds exactly them."""
    io = importlib.import_module("comfy_api.latest").io
    slots = {}
    for node_id, cls in pack.nodes.items():
        schema = cls.GET_SCHEMA()
        assert schema.display_name.startswith("MiniMax H3 Vflash "), node_id
        assert {"minimax", "h3", "video audio", "vflash"} <= set(schema.search_aliases), node_id
        for inp in schema.inputs:
            children = inp.template.get_all() if isinstance(inp, io.Autogrow.Input) else [inp]
            for child in children:
                assert child.tooltip, f"{node_id} input {child.id} has no tooltip"
                if isinstance(inp, io.Autogrow.Input):
                    slots.setdefault(node_id, {"inputs": {}})["inputs"][f"{inp.id}_{child.id}"] = {"tooltip": child.tooltip}
        for out in schema.outputs:
            assert out.tooltip, f"{node_id} output {out.id} has no tooltip"
    assert json.loads((REPO / "locales" / "en" / "nodeDefs.json").read_text()) == slots
    assert len(slots["VflashEncode"]["inputs"]) == 9 + 3 + 3 + 3
    encode = {i.id: i for i in pack.schema("VflashEncode").inputs}
    assert encode["te"].get_io_type() == "VFLASH_TE,CLIP" and encode["vae"].get_io_type() == "VFLASH_VAE,VAE" and encode["audio_vae"].optional
    assert "not bitwise" in pack.schema("VflashEncode").description
