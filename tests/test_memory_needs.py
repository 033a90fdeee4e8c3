"""The parts answer for their own memory: the core (`CoreMemory`, `NativeEngineSession.denoise_needs` and
`resident_bytes`), the text encoder (`TextConditioner.encode_need`) and the VAEs (`MediaVAEs.decode_need`,
`encode_need`), put together by `memory_plan.room`. Their answers equal, for representative requests on the demo's
real parts, the byte arithmetic the node pack and the pipeline did themselves before (written out here as it was); and
the node pack does none of its own (an AST check of `nodes/`, shown to catch that arithmetic)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from vflash_core.engine.bundle import EncodedReference
from vflash_core.engine.core_memory import CoreMemory
from vflash_core.engine.denoise import denoise_bytes
from vflash_core.engine.device_owner import module_tensors
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.fast_mode import FastMode
from vflash_core.engine.layout import Geometry, largest_clip_frames, largest_request_rows, request_rows
from vflash_core.engine.session import NativeEngineSession
from vflash_core.fileio import GIB
from vflash_core.media.conditioning import TextConditioner
from vflash_core.media.references import CanvasRules
from vflash_core.media.vae import MediaVAEs, decode_bytes
from vflash_core.media.vae_decode import DEFAULT_WINDOWS_PER_CALL
from vflash_core.memory_plan import MARGIN_BYTES, PLANNED_PICTURES, PLANNED_TEXT_ROWS, cap_bytes, room
from vflash_core.pipeline.h3_pipeline import EncodedRequest, PreparedAssets, largest_request

GPU = torch.device("cuda:0")  # a device the parts are told they run on: the answers are numbers, nothing runs there
NODES = Path(__file__).resolve().parents[1] / "nodes"


@pytest.fixture(scope="module")
def parts(demo_receipt):
    """The demo's text encoder, VAEs and session, loaded on the CPU."""
    assets = PreparedAssets.load(demo_receipt)
    conditioner = TextConditioner.from_pretrained(assets.model_root, "cpu")
    vaes = MediaVAEs.from_pretrained(assets.decoder_root, "cpu")
    session = NativeEngineSession(assets.profile, assets.compiled_paths(), EngineOptions(device="cpu"))
    yield assets, conditioner, vaes, session
    for part in (session, conditioner, vaes):
        part.close()


# -- the arithmetic as the node pack and the pipeline did it --------------------------------------------------------


def _old_brought(kind: str, engine) -> int:
    if engine.device.type == "cpu":
        return 0
    sizes = engine.part_sizes()
    return sizes.encoder if kind == "te" else sizes.vaes


def _old_encode_room(conditioner, vaes, height: int, width: int, pictures: int) -> dict:
    processor = conditioner.image_processor
    patches = pictures * (height // processor.patch_size) * (width // processor.patch_size)
    need = _old_brought("te", conditioner) + conditioner.encode_bytes(
        PLANNED_TEXT_ROWS + patches // processor.merge_size**2, patches
    )
    if vaes is not None and vaes.device == conditioner.device:
        need += _old_brought("vae", vaes)
    return {conditioner.device: need + MARGIN_BYTES}


def _old_packed_rows(config, cond: EncodedRequest, geometry: Geometry) -> int:
    _, ph, pw = config.patch_size
    rows = request_rows(config, geometry, int(cond.prompt_embeds.shape[0]))
    latents = [*cond.keyframe_latents, *(r.video_latents for r in cond.references if r.video_latents is not None)]
    rows += sum(int(t.shape[2]) * (int(t.shape[3]) // ph) * (int(t.shape[4]) // pw) for t in latents)
    return rows + sum(int(r.audio_rows.shape[0]) for r in cond.references if r.audio_rows is not None)


def _old_core_device_bytes(sizes, residency: str) -> int:
    blocks = sizes.core_blocks if residency == "resident" else 2 * sizes.core_block
    return blocks + sizes.core_auxiliary


def _old_session_load_need(compiled, profile, weight_residency, fast_mode, max_device_memory) -> int:
    residency = weight_residency if weight_residency in ("block-ring", "disk-ring") else "resident"
    largest = denoise_bytes(compiled.config, largest_request_rows(profile, compiled.config), fast_mode)
    need = _old_core_device_bytes(compiled.part_sizes(), residency) + largest + MARGIN_BYTES
    cap = cap_bytes(max_device_memory)
    return need if cap is None else min(need, cap)


def _old_largest_request(profile, config, conditioner, vaes, canvas, fast_mode) -> dict:
    height, width = (canvas or CanvasRules()).default_canvas()
    frames = largest_clip_frames(profile)
    processor = conditioner.image_processor
    pictures = PLANNED_PICTURES if set(profile.modes) - {"t2va"} else 0
    patches = pictures * (height // processor.patch_size) * (width // processor.patch_size)
    needs = {
        "denoise": denoise_bytes(config, largest_request_rows(profile, config, (height, width)), fast_mode),
        "encode": conditioner.encode_bytes(PLANNED_TEXT_ROWS + patches // processor.merge_size**2, patches),
    }
    for decoder in ("diffusers", "native"):
        needs[f"decode.{decoder}"] = decode_bytes(
            vaes.video_vae, frames, height, width, decoder, DEFAULT_WINDOWS_PER_CALL
        )
    return needs


# -- the parts' answers equal it ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [torch.device("cpu"), GPU])
@pytest.mark.parametrize("pictures", [0, 3])
def test_encode_need_is_the_old_arithmetic(parts, monkeypatch, device, pictures):
    _, conditioner, vaes, _ = parts
    for part in (conditioner, vaes):
        monkeypatch.setattr(part, "device", device)
    mine = room([conditioner.encode_need(96, 160, pictures), vaes.encode_need()])
    assert mine == _old_encode_room(conditioner, vaes, 96, 160, pictures)
    assert mine[device] > MARGIN_BYTES + (conditioner.part_sizes().encoder if device == GPU else 0)
    assert room([conditioner.encode_need(96, 160, pictures)]) == _old_encode_room(conditioner, None, 96, 160, pictures)


@pytest.mark.parametrize("device", [torch.device("cpu"), GPU])
@pytest.mark.parametrize("decoder", ["diffusers", "native"])
def test_decode_need_is_the_old_arithmetic(parts, monkeypatch, device, decoder):
    _, _, vaes, _ = parts
    monkeypatch.setattr(vaes, "device", device)
    monkeypatch.setattr(vaes, "video_decoder", decoder)
    for frames, height, width in ((22, 96, 160), (124, 256, 448)):
        old = decode_bytes(vaes.video_vae, frames, height, width, decoder, DEFAULT_WINDOWS_PER_CALL)
        old += _old_brought("vae", vaes) + MARGIN_BYTES
        assert room([vaes.decode_need(frames, height, width)]) == {device: old}


def _requests(config) -> list[tuple[EncodedRequest, Geometry]]:
    """A t2va request, an fl2va one (two keyframe latents) and a ref2va one (a picture, and a clip with a
    soundtrack), with tensors of the shapes the encoders give."""
    geometry = Geometry(96, 160, 22)
    h, w, c = geometry.latent_height, geometry.latent_width, config.in_channels
    text = (torch.zeros(37, config.text_dim), torch.ones(37, dtype=torch.int64))
    keyframe = torch.zeros(1, c, 1, h, w)
    references = (
        EncodedReference("image", torch.zeros(1, c, 1, h, w)),
        EncodedReference("video", torch.zeros(1, c, 3, h, w), torch.zeros(2 * 20, config.audio_in_channels)),
    )
    return [
        (EncodedRequest("t2va", geometry, *text), geometry),
        (EncodedRequest("fl2va", geometry, *text, (keyframe, keyframe), ("first", "last")), geometry),
        (EncodedRequest("ref2va", geometry, *text, references=references), geometry),
    ]


def test_denoise_needs_are_the_old_arithmetic(parts):
    """The session's need for a request (the rows of its bundle) equals the node pack's count of the request's rows,
    on every device; with a fast mode too."""
    _, _, _, session = parts
    config = session.compiled.config
    for cond, geometry in _requests(config):
        handoff = cond.bundle(config, 7, geometry)
        rows = _old_packed_rows(config, cond, geometry)
        assert handoff.sequence_length == rows
        old = denoise_bytes(config, rows, session.fast_mode) + MARGIN_BYTES
        assert room(session.denoise_needs(handoff.sequence_length)) == {torch.device("cpu"): old}
        fast = FastMode.parse("sparse-attention,step-cache")
        core = CoreMemory(session.compiled, session.profile, fast)
        assert room(core.request_needs([GPU, torch.device("cuda:1")], rows)) == dict.fromkeys(
            (GPU, torch.device("cuda:1")), denoise_bytes(config, rows, fast) + MARGIN_BYTES
        )


def test_resident_bytes_are_the_old_arithmetic(parts, monkeypatch):
    _, conditioner, vaes, session = parts
    assert session.resident_bytes() == _old_core_device_bytes(session.compiled.part_sizes(), session.weight_residency)
    for residency in ("resident", "block-ring", "disk-ring"):
        assert session.memory.weights(residency) == _old_core_device_bytes(session.compiled.part_sizes(), residency)
    assert conditioner.resident_bytes() == conditioner.part_sizes().encoder > 0  # on the CPU it stays there
    assert vaes.resident_bytes() == vaes.part_sizes().vaes > 0
    for part in (conditioner, vaes):
        monkeypatch.setattr(part, "device", GPU)
    assert conditioner.resident_bytes() == vaes.resident_bytes() == 0  # waiting in host memory


@pytest.mark.parametrize("weight_residency", ["auto", "resident", "block-ring", "disk-ring"])
@pytest.mark.parametrize("max_device_memory", [None, 0.01, 64.0])
def test_load_room_is_the_old_arithmetic(parts, weight_residency, max_device_memory):
    assets, _, _, session = parts
    # a disk ring feeds one device; the others are asked for on the peer too
    peer = {} if weight_residency == "disk-ring" else {"peer_device": "cuda:1", "strategy": "sequence-head"}
    for fast_mode in (FastMode(), FastMode.parse("sparse-attention")):
        options = EngineOptions(
            device="cuda:0", weight_residency=weight_residency, max_device_memory=max_device_memory,
            fast_mode=fast_mode, **peer,
        )
        core = CoreMemory(session.compiled, assets.profile, fast_mode)
        old = _old_session_load_need(session.compiled, assets.profile, weight_residency, fast_mode, max_device_memory)
        devices = [GPU] + ([torch.device("cuda:1")] if peer else [])
        assert core.load_room(options) == dict.fromkeys(devices, old)
    if max_device_memory == 0.01:
        assert old == int(0.01 * GIB)  # within the cap


def test_largest_request_is_the_old_arithmetic(parts):
    assets, conditioner, vaes, session = parts
    profile = assets.profile  # keyframe modes: the planned pictures count
    for canvas, fast_mode in ((None, None), (assets.canvas, FastMode.parse("step-cache"))):
        core = CoreMemory(session.compiled, profile, fast_mode)
        mine = largest_request(profile, core, conditioner, vaes, canvas)
        assert mine == _old_largest_request(profile, session.compiled.config, conditioner, vaes, canvas, fast_mode)



@pytest.mark.parametrize("dtype", [None, torch.bfloat16])  # bf16: the files' dtype, so the layers can stream from them
def test_the_parts_on_the_meta_device_answer_as_the_loaded_ones(parts, dtype):
    """What the pipeline plans with before anything loads equals what it plans with once the parts loaded."""
    assets, loaded_conditioner, loaded_vaes, _ = parts
    conditioner = TextConditioner.on_meta_device(assets.model_root, "cpu", dtype)
    vaes = MediaVAEs.on_meta_device(assets.decoder_root, "cpu", dtype)
    assert all(t.is_meta for part in (conditioner.text_encoder, vaes.video_vae, vaes.audio_vae) for t in part.parameters())
    if dtype is not None:
        loaded_conditioner = TextConditioner.from_pretrained(assets.model_root, "cpu", dtype)
        loaded_vaes = MediaVAEs.from_pretrained(assets.decoder_root, "cpu", dtype)
    for meta, loaded in ((conditioner.text_encoder, loaded_conditioner.text_encoder), (vaes.video_vae, loaded_vaes.video_vae), (vaes.audio_vae, loaded_vaes.audio_vae)):
        expected = {name: (t.dtype, t.shape) for name, t in module_tensors(loaded).items()}
        assert {name: (t.dtype, t.shape) for name, t in module_tensors(meta).items()} == expected
    assert conditioner.part_sizes() == loaded_conditioner.part_sizes()
    assert (conditioner.part_sizes().encoder_layers_on_disk > 0) == (dtype == torch.bfloat16)
    assert vaes.part_sizes() == loaded_vaes.part_sizes()
    for pictures in (0, PLANNED_PICTURES):
        assert conditioner.encode_need(768, 1344, pictures) == loaded_conditioner.encode_need(768, 1344, pictures)
    for decoder in ("diffusers", "native"):
        assert vaes.decode_need(362, 768, 1344, decoder) == loaded_vaes.decode_need(362, 768, 1344, decoder)
    assert largest_request(assets.profile, None, conditioner, vaes, assets.canvas) == largest_request(assets.profile, None, loaded_conditioner, loaded_vaes, assets.canvas)
    if dtype is not None:
        loaded_conditioner.close()
        loaded_vaes.close()


# -- the node pack computes no bytes ---------------------------------------------------------------------------------

# What states device bytes or their ingredients: a node that imports or names one re-derives what a part answers.
BYTE_NAMES = {
    "denoise_bytes", "decode_bytes", "encode_bytes", "MARGIN_BYTES", "PartSizes", "cap_bytes", "part_sizes",
    "largest_request_rows", "request_rows", "PLANNED_TEXT_ROWS", "DEFAULT_WINDOWS_PER_CALL",
}
# Identifiers that name byte counts or what they are computed from (rows, patches, sizes).
BYTEISH = re.compile(r"bytes|need|transient|brought|margin|size|rows|patches", re.IGNORECASE)
# ComfyUI's glue: it hands the parts' answers to core (adding core's own reserve), which is its job.
GLUE = {"comfy_memory.py", "host.py"}


def _identifiers(node: ast.AST) -> set[str]:
    names = (n for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute))
    return {n.id if isinstance(n, ast.Name) else n.attr for n in names}


def byte_arithmetic(source: str, arithmetic: bool = True) -> list[str]:
    """Where `source` imports or names a byte estimate, or adds, subtracts or multiplies byte-like values."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"line {node.lineno}: imports {alias.name}" for alias in node.names if alias.name in BYTE_NAMES]
        elif isinstance(node, ast.Name | ast.Attribute) and (named := _identifiers(node) & BYTE_NAMES):
            found += [f"line {node.lineno}: names {name}" for name in sorted(named)]
        elif arithmetic and isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(
            node.op, ast.Add | ast.Sub | ast.Mult | ast.FloorDiv
        ):
            operands = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            terms = sorted({i for o in operands for i in _identifiers(o) if BYTEISH.search(i)})
            if terms:
                found.append(f"line {node.lineno}: arithmetic on {', '.join(terms)}")
    return found


def test_the_node_pack_does_no_byte_arithmetic():
    files = sorted(NODES.rglob("*.py"))
    assert len(files) > 10 and NODES / "actions.py" in files
    found = {
        str(path.relative_to(NODES)): hits
        for path in files
        if (hits := byte_arithmetic(path.read_text(encoding="utf-8"), path.name not in GLUE))
    }
    listed = "\n".join(f"{name}: {hit}" for name, hits in found.items() for hit in hits)
    assert found == {}, f"the node pack computes device bytes; ask the parts (*_need, resident_bytes):\n{listed}"


@pytest.mark.parametrize("code", [
    # the node pack's own arithmetic before the parts answered for themselves, line by line
    "from vflash_core.memory_plan import MARGIN_BYTES, PLANNED_TEXT_ROWS",
    "from vflash_core.engine.denoise import denoise_bytes",
    "sizes = engine.part_sizes()",
    "need += _brought_bytes('vae', vaes)",
    "patches = pictures * (geometry.height // processor.patch_size) * (geometry.width // processor.patch_size)",
    "rows += sum(int(t.shape[2]) * (int(t.shape[3]) // ph) for t in latents)",
    "host.make_room({vaes.device: _brought_bytes('vae', vaes) + transient + MARGIN}, registry.held('vae'))",
    "blocks = sizes.core_blocks if residency == 'resident' else 2 * sizes.core_block",
    "need = weights + largest + margin",
])
def test_the_check_finds_byte_arithmetic(code):
    assert byte_arithmetic(code)


def test_the_check_leaves_other_arithmetic_alone():
    assert byte_arithmetic("done = ('a', 'b').index(stage) + 1\nsteps = 2 + bool(frames)\nx = y * 3") == []
    assert byte_arithmetic("host.make_room(room([vaes.decode_need(f, h, w)]), registry.held('vae'))") == []
