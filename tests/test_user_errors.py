"""Every bad input is refused early with one clear line, through the CLI, the Python API and run-workflow.

Each case asserts the message, the exit status (2: bad request, option or file; 1: a valid request that could not
complete), that no traceback reached the user, that no model was loaded and that nothing was written. The HTTP
service's cases live in test_service.py, LoRA files in test_lora.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from headless_nodes import API
from PIL import Image
from refusals import files_in, refused

from vflash_core.cli.main import main
from vflash_core.errors import RequestError, RunFailedError, VflashError
from vflash_core.fileio import check_input_file, check_writable_destination
from vflash_core.media.references import CanvasRules
from vflash_core.pipeline import h3_pipeline as pipeline_module
from vflash_core.pipeline.h3_pipeline import H3Pipeline, PreparedAssets, VideoRequest, prepare_pipeline
from vflash_core.pipeline.options import RunOptions
from vflash_core.pipeline.validation import check_canvas_size
from vflash_core.profiles import get_profile

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Files that are not what they claim to be, outside the folders the tests write to."""
    folder = tmp_path_factory.mktemp("odd-inputs")
    (folder / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (folder / "huge.txt").write_bytes(b"a" * ((1 << 20) + 1))
    (folder / "long.txt").write_text("a " * 139_999 + "a")  # 140,000 tokens of the demo tokenizer; its context is 128,000
    (folder / "a-folder.png").mkdir()
    os.symlink("loop.png", folder / "loop.png")
    os.symlink("nowhere.png", folder / "broken.png")
    os.mkfifo(folder / "fifo.png")
    os.mkfifo(folder / "fifo.txt")
    Image.new("RGB", (64, 64)).save(folder / "frame.png")
    return folder


# -- the command line ------------------------------------------------------------------------------------------------


GENERATE_CASES = {
    "prompt-file-not-utf8": (["--prompt-file", "{in}/latin1.txt"], r"^--prompt-file .*latin1.txt is not UTF-8 text \(byte 3 is 0xe9\)$"),
    "prompt-file-folder": (["--prompt-file", "{in}/a-folder.png"], r"^--prompt-file .*a-folder.png is a folder, not a file$"),
    "prompt-file-link-loop": (["--prompt-file", "{in}/loop.png"], r"^--prompt-file .*loop.png is a symbolic link loop$"),
    "prompt-file-fifo": (["--prompt-file", "{in}/fifo.txt"], r"^--prompt-file .*fifo.txt is a FIFO, not a file$"),
    "prompt-file-missing": (["--prompt-file", "{in}/none.txt"], r"^--prompt-file .*none.txt does not exist$"),
    "prompt-file-too-big": (["--prompt-file", "{in}/huge.txt"], r"^--prompt-file .*huge.txt is 1,048,577 bytes; at most 1,048,576 are accepted$"),
    "prompt-too-many-tokens": (["--prompt-file", "{in}/long.txt"], r"^the prompt is 140,000 tokens long; the text encoder reads at most 128,000 \(its context"),
    "first-frame-folder": (["--prompt", "x", "--first-frame", "{in}/a-folder.png"], r"^first frame .*a-folder.png is a folder, not a file$"),
    "first-frame-fifo": (["--prompt", "x", "--first-frame", "{in}/fifo.png"], r"^first frame .*fifo.png is a FIFO, not a file$"),
    "first-frame-link-loop": (["--prompt", "x", "--first-frame", "{in}/loop.png"], r"^first frame .*loop.png is a symbolic link loop$"),
    "first-frame-broken-link": (["--prompt", "x", "--first-frame", "{in}/broken.png"], r"^first frame .*broken.png is a broken symbolic link \(to nowhere.png\)$"),
    "canvas-beyond-the-model": (["--prompt", "x", "--width", "100000", "--height", "100000"],
                                r"^canvas 100000x100000 is 10,000,000,000 pixels; this model generates at most 114,688 \(canvas_max_pixels, within rounding to multiples of 32; e\.g\. 448x256 at 16:9\)$"),
    "overwrite-onto-a-folder": (["--prompt", "x", "--overwrite", "--output", "{out}"], r"^output .* is a folder; give a file name inside it$"),
    "output-names-a-folder": (["--prompt", "x", "--output", "{out}/new/"], r"^output .*new/ names a folder; give a file name inside it$"),
    "fast-mode-setting-without-its-mode": (["--prompt", "x", "--sparse-density", "0.2"],
                                           r"^--sparse-density sets the sparse-attention fast mode, which --fast-mode does not name \(exact\): add --fast-mode sparse-attention, or leave --sparse-density out$"),
    "fast-mode-setting-of-the-other-mode": (["--prompt", "x", "--fast-mode", "sparse-attention", "--step-cache-threshold", "0.2"],
                                            r"^--step-cache-threshold sets the step-cache fast mode, which --fast-mode does not name \(sparse-attention\)"),
    "exact-with-a-fast-mode": (["--prompt", "x", "--fast-mode", "exact,step-cache"],
                               r"^exact runs no fast mode, so it does not combine with one: got 'exact,step-cache'$"),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_refuses_bad_input_before_loading(case, h3_prepared, inputs, tmp_path, capsys, no_model_loads):
    argv, message = GENERATE_CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.format(**{"in": inputs, "out": out}) for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(out / "clip.mp4")]
    line = refused(capsys, ["generate", "--prepared-assets", str(h3_prepared), *argv])
    assert re.search(message, line), line
    assert files_in(out) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_request_without_cuda_is_refused_before_loading(h3_prepared, tmp_path, capsys, no_model_loads):
    line = refused(capsys, ["generate", "--prepared-assets", str(h3_prepared), "--prompt", "x", "--gpu", "0", "--output", str(tmp_path / "o.mp4")])
    assert line.startswith("device cuda:0 does not exist: CUDA is not available on this machine")
    with pytest.raises(VflashError, match=r"peer device cuda:1 does not exist: CUDA is not available"):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(peer_device=1, strategy="sequence-head"))
    denoise = ["denoise", "t2va-base4-exact-cpu", "--artifact", "a", "--schedule-overlay", "s", "--auxiliary-tensor", "x",
               "--bundle", "b", "--output-latents", str(tmp_path / "latents.safetensors"), "--gpu", "0"]
    assert refused(capsys, denoise).startswith("device cuda:0 does not exist: CUDA is not available on this machine")
    assert files_in(tmp_path) == []


def test_the_installed_command_prints_one_line_without_traceback(h3_prepared, inputs, tmp_path):
    """The real entry point, in its own process: a user error is one line on stderr, exit status 2, nothing written."""
    done = subprocess.run(
        [sys.executable, "-m", "vflash_core.cli.main", "generate", "--prepared-assets", str(h3_prepared),
         "--prompt-file", str(inputs / "latin1.txt"), "--output", str(tmp_path / "o.mp4")],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"vflash: error: --prompt-file {inputs / 'latin1.txt'} is not UTF-8 text (byte 3 is 0xe9)"]
    assert files_in(tmp_path) == []


def _receipt_variants(receipt: Path) -> dict[str, tuple[object, str]]:
    record = json.loads(receipt.read_text())
    without_canvas = {k: v for k, v in record.items() if k != "canvas"}
    return {
        "mistyped-asset": ({**record, "assets": {**record["assets"], "model_root": 5}}, r"assets.model_root must be a path string, got int 5; recreate it"),
        "missing-field": (without_canvas, r"has no canvas.canvas_short_edge; recreate it with `vflash prepare-pipeline`"),
        "mistyped-canvas": ({**record, "canvas": {**record["canvas"], "canvas_max_pixels": "big"}}, r"canvas.canvas_max_pixels must be a positive integer, got str 'big'"),
        "assets-not-an-object": ({**record, "assets": [1, 2]}, r"assets must be an object, got list \[1, 2\]; recreate it"),
        "identity-not-an-object": ({**record, "profile_identity": "x"}, r"profile_identity must be an object, got str 'x'"),
        "not-utf8": (b"\xff\xfe{", r"cannot be read as JSON: 'utf-8' codec can't decode byte 0xff"),
        "not-an-object": ([record], r"must hold a JSON object"),
    }


@pytest.mark.parametrize("case", ["mistyped-asset", "missing-field", "mistyped-canvas", "assets-not-an-object", "identity-not-an-object", "not-utf8", "not-an-object"])
def test_malformed_receipts_are_one_line(case, h3_prepared, tmp_path, capsys, no_model_loads):
    content, message = _receipt_variants(h3_prepared)[case]
    receipt = tmp_path / "receipt.json"
    receipt.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    line = refused(capsys, ["generate", "--prepared-assets", str(receipt), "--prompt", "x", "--output", str(tmp_path / "o.mp4")])
    assert re.search(message, line), line
    assert files_in(tmp_path) == [receipt]


def test_receipt_folder_and_mistyped_assets_file(h3_prepared, tmp_path, capsys):
    line = refused(capsys, ["generate", "--prepared-assets", str(tmp_path), "--prompt", "x", "--output", str(tmp_path / "o.mp4")])
    assert line == f"prepared-assets receipt {tmp_path} is a folder, not a file"
    record = PreparedAssets.load(h3_prepared).record
    assets = {k: record["assets"][k] for k in pipeline_module.ASSET_FIELDS}
    bad = tmp_path / "assets.json"
    for value, shown in ((5, "int 5"), (["models"], "list ['models']"), ("", "str ''")):
        bad.write_text(json.dumps({**assets, "artifact": value}))
        line = refused(capsys, ["prepare-pipeline", "--profile", "t2va-base4-exact-cpu", "--assets", str(bad), "--receipt", str(tmp_path / "r.json")])
        assert line == f"assets file {bad}: artifact must be a path string, got {shown}"
    bad.write_text(json.dumps({**assets, "adapter_path": 3}))
    with pytest.raises(VflashError, match=r"adapter_path must be a path string or null, got int 3"):
        prepare_pipeline("t2va-base4-exact-cpu", bad, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_workflow_value_of_the_wrong_type_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from vflash_nodes import actions as node_actions

    def refuse(*args, **kwargs):
        raise AssertionError("a loader node ran for a workflow that must be refused when it is checked")

    for loader in ("load_model", "load_component"):
        monkeypatch.setattr(node_actions, loader, refuse)
    workflow = API / "t2va.json"
    # One line a problem (they were joined on one line with "; ")
    assert main(["run-workflow", str(workflow), "--set", "4.width=wide", "--set", "4.force_offload=1", "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "vflash: error: invalid workflow: node 4 (VflashEncode).width must be an integer from 32 to 4,096, got str 'wide'",
        "vflash: error: invalid workflow: node 4 (VflashEncode).force_offload takes BOOLEAN, got 1",
    ]
    assert files_in(tmp_path) == []


def test_runtime_failures_exit_1_and_bugs_keep_their_traceback(monkeypatch, capsys):
    from vflash_core.cli import denoise as cli_denoise

    def cancelled(args):
        raise pipeline_module.RequestCancelled("request cancelled: stop")

    monkeypatch.setattr(cli_denoise, "_denoise", cancelled)
    argv = ["denoise", "p", "--artifact", "a", "--schedule-overlay", "s", "--auxiliary-tensor", "x", "--bundle", "b", "--output-latents", "o"]
    assert refused(capsys, argv, status=1) == "request cancelled: stop"
    assert issubclass(pipeline_module.RequestCancelled, RunFailedError)

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli_denoise, "_denoise", bug)
    with pytest.raises(KeyError):
        main(argv)


# -- the Python API --------------------------------------------------------------------------------------------------


TYPE_CASES = {
    "prompt-not-a-string": (dict(prompt=5), r"^prompt must be a string, got int$"),
    "fractional-width": (dict(prompt="x", width=448.7, height=256), r"^width must be an integer number of pixels, got float 448\.7$"),
    "bool-height": (dict(prompt="x", width=448, height=True), r"^height must be an integer number of pixels, got bool True$"),
    "string-seed": (dict(prompt="x", seed="1"), r"^seed must be an integer, got str '1'$"),
    "string-duration": (dict(prompt="x", duration_seconds="5"), r"^duration_seconds must be a number of seconds, got str '5'$"),
    "number-as-frame": (dict(prompt="x", first_frame=3), r"^first_frame must be a file path \(str or Path\) or a PIL image, got int 3$"),
    "empty-path": (dict(prompt="x", last_frame=""), r"^last_frame must be a non-empty file path, got str ''$"),
    "nul-in-path": (dict(prompt="x", first_frame="a\x00.png"), r"^first_frame must not contain a NUL character$"),
    "number-as-references": (dict(prompt="x", references=5), r"^references must be a file path, a PIL image or a list of them, got int 5$"),
    "number-among-references": (dict(prompt="x", references=["a.png", 5]), r"^references\[1\] must be a file path \(str or Path\) or a PIL image, got int 5$"),
    "dict-as-references": (dict(prompt="x", references={"a.png": 1}), r"^references must be a file path, a PIL image or a list of them, got dict"),
}


@pytest.mark.parametrize("case", TYPE_CASES)
def test_video_request_refuses_wrong_types_naming_the_field(case):
    kwargs, message = TYPE_CASES[case]
    with pytest.raises(RequestError, match=message):
        VideoRequest(**kwargs)


def test_paths_are_one_path_never_characters(inputs):
    kite = str(inputs / "frame.png")
    assert VideoRequest("x", references=kite).references == (kite,)
    assert VideoRequest("x", references=Path(kite)).references == (Path(kite),)
    assert VideoRequest("x", references=[kite, kite]).references == (kite, kite)
    assert VideoRequest("x", references=None).references == () and VideoRequest("x").mode == "t2va"
    request = VideoRequest("x", seed=True and 3, width=448, height=256)
    assert (request.seed, request.width, request.height, request.duration_seconds) == (3, 448, 256, 5.0)


def test_generate_needs_a_request_not_a_prompt(h3_prepared, tmp_path, no_model_loads):
    pipeline = H3Pipeline.from_prepared(h3_prepared)
    for call in (lambda: pipeline.generate("a prompt", tmp_path / "o.mp4"), lambda: pipeline.validate("a prompt")):
        with pytest.raises(RequestError, match=r"takes a VideoRequest, got str; wrap the prompt: VideoRequest\(prompt='a prompt'\)"):
            call()
    assert not pipeline.loaded and files_in(tmp_path) == []


def test_limits_from_the_model_are_checked_before_loading(h3_prepared, h3_prepared_ref, inputs, tmp_path, monkeypatch, no_model_loads):
    import wave

    from vflash_core.media import references
    from vflash_core.media.mp4 import write_mp4

    pipeline = H3Pipeline.from_prepared(h3_prepared)
    with pytest.raises(RequestError, match=r"^canvas 100000x100000 is 10,000,000,000 pixels; this model generates at most 114,688"):
        pipeline.validate(VideoRequest("x", width=100_000, height=100_000))
    with pytest.raises(RequestError, match=r"^the prompt is 140,000 tokens long; the text encoder reads at most 128,000"):
        pipeline.generate(VideoRequest((inputs / "long.txt").read_text()), tmp_path / "o.mp4")
    with pytest.raises(RequestError, match=r"^the prompt is 1,048,577 bytes long; prompts of at most 1,048,576 bytes are accepted$"):
        pipeline.validate(VideoRequest("a" * ((1 << 20) + 1)))
    with pytest.raises(RequestError, match=r"^the prompt is not valid Unicode text \(a lone surrogate at character 1\)$"):
        pipeline.validate(VideoRequest("a\ud800"))
    with pytest.raises(RequestError, match=r"^prompt label <Picture 99999999999999999999> is not bound to an input"):
        pipeline.validate(VideoRequest("<Picture 99999999999999999999>"))
    with pytest.raises(RequestError, match=r"^duration 1e\+308 s cannot be generated; H3 generates 5-15 s$"):
        pipeline.validate(VideoRequest("x", duration_seconds=1e308))
    with pytest.raises(RequestError, match=r"^canvas 10{400}x32 is"):
        pipeline.validate(VideoRequest("x", width=10**400, height=32))
    with pytest.raises(VflashError, match=r"^the output path must not contain a NUL character$"):
        pipeline.generate(VideoRequest("x"), str(tmp_path / "a\x00.mp4"))
    with pytest.raises(RequestError, match=r"^H3 takes at most 9 image references, got 1000$"):  # counted before any file is opened
        H3Pipeline.from_prepared(h3_prepared_ref).validate(VideoRequest("x", references=[str(tmp_path / f"{i}.png") for i in range(1000)]))

    # An image whose header promises more pixels than any input may have (the pixels are never decoded).
    big = inputs.parent / f"{tmp_path.name}-huge.png"
    _png_header(big, 9000, 8000)
    with pytest.raises(RequestError, match=r"^first frame .*huge.png is 9000x8000 pixels; images of at most 67 megapixels are accepted$"):
        pipeline.validate(VideoRequest("x", first_frame=big))

    ref = H3Pipeline.from_prepared(h3_prepared_ref)
    long_audio = inputs.parent / f"{tmp_path.name}-long.wav"
    with wave.open(str(long_audio), "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(8000)
        audio.writeframes(b"\0\0" * 8000 * 301)
    with pytest.raises(RequestError, match=r"^reference 2 .*long.wav lasts more than 300 s; trim it"):
        ref.validate(VideoRequest("x", references=(str(inputs / "frame.png"), str(long_audio))))
    clip = write_mp4(inputs.parent / f"{tmp_path.name}-clip.mp4", torch.rand(30, 64, 64, 3), torch.zeros(2, 40000), 32000)
    monkeypatch.setattr(references, "MAX_INPUT_VIDEO_BYTES", 20 * 64 * 64 * 3)
    with pytest.raises(RequestError, match=r"^reference 1 .*clip.mp4 decodes to more than .* GiB of frames \(64x64\); trim it"):
        ref.validate(VideoRequest("x", references=str(clip)))
    assert not pipeline.loaded and not ref.loaded and files_in(tmp_path) == []


def _png_header(path: Path, width: int, height: int) -> None:
    """A PNG whose header says width x height (its one row of pixel data is never read by validation)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b""))


def test_canvas_budget_admits_every_canvas_the_rules_pick():
    """Rounding to multiples of 32 can put the rules' own canvas a few percent above canvas_max_pixels (480x256 for
    a 1.88:1 keyframe on the demo's 256 / 448x256 rules): every such canvas is accepted, a larger one is not."""
    import numpy as np

    for rules in (CanvasRules(256, 256 * 448, 128), CanvasRules()):
        picked = {rules.default_canvas(aspect, 1) for aspect in np.linspace(0.25, 4.0, 2001)}
        picked = {(h, w) for h, w in picked if 0.25 <= w / h <= 4.0}  # rounding can also leave H3's aspect range
        assert max(h * w for h, w in picked) > rules.max_pixels
        for height, width in picked:
            check_canvas_size(height, width, rules)
    demo = CanvasRules(256, 256 * 448, 128)
    with pytest.raises(RequestError, match=r"^canvas 512x256 is 131,072 pixels; this model generates at most 114,688 \(canvas_max_pixels, within rounding"):
        check_canvas_size(256, 512, demo)
    with pytest.raises(RequestError, match=r"canvas 1920x1088 .* at most 1,032,192 .*e\.g\. 1344x768 at 16:9\)$"):
        check_canvas_size(1088, 1920, CanvasRules())


def test_device_requests_are_checked_before_loading(h3_prepared, no_model_loads):
    with pytest.raises(VflashError, match=r"^device 'gpu0' is not a device; use 'cpu', a GPU index or 'cuda:N'$"):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(device="gpu0"))
    with pytest.raises(VflashError, match=r"^device -1 is not a device"):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(device=-1))
    with pytest.raises(VflashError, match=r"^unknown attention backend 'bogus'; choose one of auto, "):
        H3Pipeline.from_prepared(h3_prepared, RunOptions(attention_backend="bogus"))
    sm90 = get_profile("t2va-base16-bf16-sm90")
    from vflash_core.formats import check_device

    with pytest.raises(VflashError, match=r"^the profile runs on sm90 GPUs \(H100 / H200\); the device cpu is cpu$"):
        check_device("cpu", sm90.arch)
    with pytest.raises(VflashError, match=r"^profile t2va-base16-bf16-sm90 runs on sm90 GPUs \(H100 / H200\); the peer device cpu is cpu$"):
        check_device("cpu", sm90.arch, "peer device", sm90.id)


def test_input_file_problems_are_named(inputs, tmp_path):
    check_input_file(inputs / "frame.png", "x")
    for name, what in (("a-folder.png", "is a folder, not a file"), ("fifo.png", "is a FIFO, not a file"), ("loop.png", "is a symbolic link loop"),
                       ("none.png", "does not exist"), ("frame.png/inner", r"does not exist \(a part of its folder path is a file\)")):
        with pytest.raises(VflashError, match=rf"^input {re.escape(str(inputs / name))} {what}$"):
            check_input_file(inputs / name, "input")
    taken = tmp_path / "taken.mp4"
    taken.write_bytes(b"keep")
    with pytest.raises(VflashError, match="already exists; refusing to overwrite it"):
        check_writable_destination(taken)
    assert check_writable_destination(taken, overwrite=True) == taken
    with pytest.raises(VflashError, match=r"is a FIFO; refusing to replace it"):
        check_writable_destination(inputs / "fifo.png", overwrite=True)
    with pytest.raises(VflashError, match=r"output folder .*frame.png is not a folder"):
        check_writable_destination(inputs / "frame.png" / "o.mp4")
    assert taken.read_bytes() == b"keep"


# -- thread safety ---------------------------------------------------------------------------------------------------


def _process_wide_state() -> dict[str, object]:
    """What transformers' and diffusers' loaders patch while they run and must leave as they found it."""
    from torch.nn import init

    state = {"register_parameter": torch.nn.Module.register_parameter, "register_buffer": torch.nn.Module.register_buffer}
    state.update({f"init.{name}": getattr(init, name) for name in ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")})
    return state


def test_concurrent_first_use_loads_once_and_leaves_nothing_patched(h3_prepared, tmp_path):
    before = _process_wide_state()
    shared = H3Pipeline.from_prepared(h3_prepared)
    loads = []
    loader = shared._loader

    def counting(progress):
        loads.append(threading.get_ident())
        return loader(progress)

    shared._loader = counting
    others = [H3Pipeline.from_prepared(h3_prepared) for _ in range(2)]
    errors: list[BaseException] = []

    def run(call) -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's exception
            errors.append(exc)

    request = VideoRequest("A lighthouse at dusk.", seed=1, width=32, height=32)
    calls = [shared.load, shared.load, lambda: shared.generate(request, None), *(p.load for p in others)]
    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(loads) == 1
    assert all(p.loaded for p in (shared, *others))
    assert _process_wide_state() == before
    # A pipeline created afterwards still builds real (not meta-device) models and generates.
    with H3Pipeline.from_prepared(h3_prepared) as fresh:
        result = fresh.generate(request, None)
    assert result.num_frames == 124 and torch.isfinite(result.media.frames).all()
    # A pipeline composed from loaded parts counts prompts with (a copy of) its conditioner's tokenizer.
    composed = H3Pipeline(shared.profile, shared.conditioner, shared.vaes, shared.session)
    with pytest.raises(RequestError, match=r"^the prompt is 140,000 tokens long; the text encoder reads at most 128,000"):
        composed.validate(VideoRequest("a " * 139_999 + "a"))
    for p in (shared, *others):
        p.close()


# -- found by the adversarial corpus: arguments of the wrong type, outputs onto inputs ---------------------------------


def test_api_arguments_of_the_wrong_type_are_refused_naming_them(h3_prepared, tmp_path, no_model_loads):
    """Each was a TypeError / AttributeError traceback, or (overwrite="no", a progress or cancel that is no callable)
    a refusal only after the models had loaded; overwrite="no" even replaced the existing file."""
    keep = tmp_path / "keep.mp4"
    keep.write_bytes(b"keep")
    pipeline = H3Pipeline.from_prepared(h3_prepared)
    request = VideoRequest("x")
    cases = [
        (lambda: H3Pipeline.from_prepared(5), r"^the prepared-assets receipt must be a file path \(str or Path\), got int 5$"),
        (lambda: H3Pipeline.from_prepared(None), r"^the prepared-assets receipt must be a file path \(str or Path\), got NoneType None$"),
        (lambda: H3Pipeline.from_prepared(str(h3_prepared).encode()), r"^the prepared-assets receipt must be a file path \(str or Path\), got bytes b'"),
        (lambda: H3Pipeline.from_prepared(h3_prepared, "cpu"), r"^options must be a RunOptions, got str 'cpu'; e\.g\. RunOptions\(device=0\)$"),
        (lambda: PreparedAssets.load(5), r"^the prepared-assets receipt must be a file path"),
        (lambda: prepare_pipeline(5, tmp_path / "a.json", tmp_path / "r.json"), r"^profile must be a profile id or a Profile, got int 5$"),
        (lambda: prepare_pipeline("t2va-base4-exact-cpu", None, tmp_path / "r.json"), r"^the assets file must be a file path \(str or Path\), got NoneType None$"),
        (lambda: prepare_pipeline("t2va-base4-exact-cpu", tmp_path / "a.json", None), r"^the receipt path must be a file path \(str or Path\), got NoneType None$"),
        (lambda: H3Pipeline("t2va-base4-exact-cpu", "c", "v", "s"), r"^session must be a loaded NativeEngineSession, got str 's'$"),
        (lambda: pipeline.generate(request, 5), r"^the output path must be a file path \(str or Path\), got int 5$"),
        (lambda: pipeline.generate(request, keep, overwrite="no"), r"^overwrite must be True or False, got str 'no'$"),
        (lambda: pipeline.generate(request, tmp_path / "o.mp4", progress="bar"), r"^progress must be a callable or None, got str 'bar'$"),
        (lambda: pipeline.generate(request, tmp_path / "o.mp4", cancel=5), r"^cancel must be a callable or None, got int 5$"),
        (lambda: pipeline.load(progress=5), r"^progress must be a callable or None, got int 5$"),
        (lambda: VideoRequest("x", references=["a.png", None]), r"^references\[1\] is None; give a file path or a PIL image, or leave it out$"),
    ]
    for call, message in cases:
        with pytest.raises(VflashError, match=message):
            call()
    assert not pipeline.loaded and keep.read_bytes() == b"keep" and files_in(tmp_path) == [keep]


def test_output_onto_an_input_or_a_model_file_is_refused_before_loading(h3_prepared, inputs, tmp_path, capsys, no_model_loads):
    """With --overwrite the clip replaced the first frame, the prompt file or the receipt it was made from."""
    frame, prompt, receipt = tmp_path / "frame.png", tmp_path / "prompt.txt", tmp_path / "pipeline.json"
    frame.write_bytes((inputs / "frame.png").read_bytes())
    prompt.write_text("a kite")
    receipt.write_text(h3_prepared.read_text())
    before = {path: path.read_bytes() for path in (frame, prompt, receipt)}
    artifact = PreparedAssets.load(h3_prepared).artifact
    cases = [
        (["--prompt", "<Picture 1> flies", "--first-frame", str(frame), "--output", str(frame)], f"output {frame} is the first frame; write the clip to another file"),
        (["--prompt-file", str(prompt), "--output", str(prompt)], f"output {prompt} is the --prompt-file; write the clip to another file"),
        (["--prompt", "x", "--output", str(receipt)], f"output {receipt} is the prepared-assets receipt; write the clip to another file"),
        (["--prompt", "x", "--output", str(artifact / "clip.mp4")], f"output {artifact / 'clip.mp4'} is inside the artifact {artifact}; write the clip to another folder"),
    ]
    for argv, message in cases:
        assert refused(capsys, ["generate", "--prepared-assets", str(receipt), "--overwrite", *argv]) == message
    with pytest.raises(VflashError, match=r"^output .*frame.png is the first frame; write the clip to another file$"):
        H3Pipeline.from_prepared(h3_prepared).generate(VideoRequest("<Picture 1>", first_frame=frame), str(frame), overwrite=True)
    assert {path: path.read_bytes() for path in (frame, prompt, receipt)} == before
    assert files_in(tmp_path) == sorted(before) and not (artifact / "clip.mp4").exists()


def test_a_prompt_with_a_nul_character_is_refused(h3_prepared, tmp_path, capsys, no_model_loads):
    """A prompt file holding a NUL byte (a binary file given by mistake) was generated from."""
    binary = tmp_path / "prompt.txt"
    binary.write_bytes(b"a kite\x00 over the sea")
    line = refused(capsys, ["generate", "--prepared-assets", str(h3_prepared), "--prompt-file", str(binary), "--output", str(tmp_path / "o.mp4")])
    assert line == "the prompt holds a NUL character (at character 6); give plain text, not a binary file"
    assert files_in(tmp_path) == [binary]


def test_demo_cache_bundle_and_workflow_files_that_are_not_what_they_claim(inputs, tmp_path, capsys):
    """A --cache-dir that is a file, a --bundle that is a file, and a workflow that is a FIFO, a binary file or
    nested beyond Python's recursion limit were tracebacks (or, for the FIFO, a hang)."""
    out = tmp_path / "out"
    out.mkdir()
    prompt = inputs / "latin1.txt"
    line = refused(capsys, ["demo", "--output", str(out / "demo.mp4"), "--cache-dir", str(prompt / "cache")])
    assert line == f"the demo model cache {prompt / 'cache'} cannot be created: it or a folder above it is a file; give --cache-dir (or $VFLASH_CACHE) a folder"
    denoise = ["denoise", "t2va-base4-exact-cpu", "--artifact", "a", "--schedule-overlay", "s", "--auxiliary-tensor", "x",
               "--bundle", str(inputs / "frame.png"), "--output-latents", str(out / "latents.safetensors")]
    assert refused(capsys, denoise) == f"--bundle {inputs / 'frame.png'} is not a folder; give the conditioning bundle's folder"
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    for workflow, message in ((inputs / "fifo.txt", "is a FIFO, not a file"), (inputs / "latin1.txt", r"is not UTF-8 text \(byte 3 is 0xe9\)"),
                              (deep, "nests arrays or objects too deeply"), (inputs / "a-folder.png", "is a folder, not a file")):
        line = refused(capsys, ["run-workflow", str(workflow), "--output-dir", str(out)])
        assert re.fullmatch(rf"workflow {re.escape(str(workflow))} {message}", line), line
    assert files_in(out) == []


def test_workflow_canvas_beyond_any_h3_model_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """`--set 4.width=1000000000 --set 4.height=1000000000` loaded the models, then failed allocating 4.6e18 bytes
    with a RuntimeError traceback."""
    from vflash_nodes import actions as node_actions

    def refuse(*args, **kwargs):
        raise AssertionError("a loader node ran for a workflow that must be refused when it is checked")

    for loader in ("load_model", "load_component", "load_text_encoder", "load_vae"):
        if hasattr(node_actions, loader):
            monkeypatch.setattr(node_actions, loader, refuse)
    workflow = API / "t2va.json"
    line = refused(capsys, ["run-workflow", str(workflow), "--set", "4.width=4096", "--set", "4.height=4096", "--output-dir", str(tmp_path / "out")])
    # The embedded demo's text encoder names the family's canvas rules (its modular_model_index.json), not the
    # released model's: what `vflash generate` refuses for the same model.
    assert line == ("the workflow was refused before running: node 5 (VflashSampler): canvas 4096x4096 is "
                    "16,777,216 pixels; this model generates at most 114,688 (canvas_max_pixels, within rounding "
                    "to multiples of 32; e.g. 448x256 at 16:9)")
    line = refused(capsys, ["run-workflow", str(workflow), "--set", "4.width=1000000000", "--output-dir", str(tmp_path / "out")])
    assert line == "invalid workflow: node 4 (VflashEncode).width must be an integer from 32 to 4,096, got 1000000000"
    assert files_in(tmp_path) == []


def test_workflow_save_and_load_nodes_are_checked_before_anything_runs(tmp_path, capsys, monkeypatch):
    """A filename_prefix outside the output folder or an unsupported container was refused by SaveVideo only after
    the clip had been generated (minutes on a real model), and an --output-dir that is a file failed there with a
    traceback; a missing LoadImage file, an empty prompt or a negative seed was refused only after the models loaded,
    seconds=1e308 was an OverflowError traceback, and a missing --models-dir was ignored."""
    from vflash_nodes import actions as node_actions

    def refuse(*args, **kwargs):
        raise AssertionError("a loader node ran for a workflow that must be refused when it is checked")

    for loader in ("load_model", "load_component", "load_text_encoder", "load_vae"):
        if hasattr(node_actions, loader):
            monkeypatch.setattr(node_actions, loader, refuse)
    api = API
    out = tmp_path / "out"
    cases = [
        (["t2va.json", "--set", "7.filename_prefix=../../escape"], f"node 7 (SaveVideo): filename_prefix '../../escape' points outside the output folder {out}"),
        (["t2va.json", "--set", "7.filename_prefix="], 'node 7 (SaveVideo): filename_prefix must be a non-empty string, got ""'),
        (["t2va.json", "--set", "7.format=webm"], "node 7 (SaveVideo): the headless runner writes mp4/h264 with its own encoding (got format 'webm', codec 'h264', encoding 'auto')"),
        (["i2va.json", "--input-dir", str(tmp_path / "none")], f"node 8 (LoadImage): input file 'vflash_first_frame.png' does not exist in the input folder {tmp_path / 'none'} (set --input-dir)"),
        (["t2va.json", "--set", "4.prompt= "], "node 4 (VflashEncode): the prompt must be a non-empty string"),
    ]
    for (workflow, *argv), message in cases:
        line = refused(capsys, ["run-workflow", str(api / workflow), *argv, "--output-dir", str(out)])
        assert line == f"the workflow was refused before running: {message}"
    # Several refusals: one line each (they were joined on one line with "; ").
    assert main(["run-workflow", str(api / "t2va.json"), "--set", "7.filename_prefix=", "--set", "4.prompt= ", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"vflash: error: the workflow was refused before running: {message}" for message in (
        "node 4 (VflashEncode): the prompt must be a non-empty string", 'node 7 (SaveVideo): filename_prefix must be a non-empty string, got ""'
    )]
    # Numbers outside their widgets' ranges, as ComfyUI refuses them when a prompt is queued (one number parser).
    for argv, message in ((["--set", "5.seed=-1"], "node 5 (VflashSampler).seed must be an integer from 0 to 9,223,372,036,854,775,807, got -1"),
                          (["--set", "4.seconds=1e308"], "node 4 (VflashEncode).seconds must be a number from 0 to 60, got 1e+308"),
                          (["--set", "4.seconds=NaN"], "node 4 (VflashEncode).seconds must be a number from 0 to 60, got nan")):
        assert refused(capsys, ["run-workflow", str(api / "t2va.json"), *argv, "--output-dir", str(out)]) == f"invalid workflow: {message}"
    a_file = tmp_path / "a-file"
    a_file.write_text("keep")
    for argv, message in ((["--output-dir", str(a_file / "out")], f"--output-dir {a_file / 'out'} cannot be a folder: {a_file} is a file"),
                          (["--models-dir", str(tmp_path / "none")], f"--models-dir {tmp_path / 'none'} does not exist; give a ComfyUI install's models folder, e.g. --models-dir ~/ComfyUI/models"),
                          (["--input-dir", str(a_file)], f"--input-dir {a_file} is not a folder")):
        assert refused(capsys, ["run-workflow", str(api / "t2va.json"), "--output-dir", str(out), *argv]) == message
    assert files_in(tmp_path) == [a_file] and a_file.read_text() == "keep"


def test_compiler_receipts_and_folders_that_are_not_what_they_claim(inputs, tmp_path, capsys):
    """`compile --receipt` of a JSON list, a folder or a binary file and `verify` of a file were tracebacks."""
    from vflash_core.weights.compiler import main as compiler_main

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    out = tmp_path / "compiled"
    cases = [
        (["compile", "--receipt", str(listed), "--output", str(out)], f"{listed}: not a Vflash receipt (format None); write one with `python -m vflash_core.weights.compiler prepare`"),
        (["compile", "--receipt", str(inputs / "a-folder.png"), "--output", str(out)], f"receipt {inputs / 'a-folder.png'} is a folder, not a file"),
        (["compile", "--receipt", str(inputs / "latin1.txt"), "--output", str(out)], f"receipt {inputs / 'latin1.txt'} is not UTF-8 text (byte 3 is 0xe9)"),
        (["verify", str(listed)], f"{listed} is not a folder; give the folder compile wrote (artifact/, schedule/, auxiliary.safetensors)"),
    ]
    for argv, message in cases:
        assert compiler_main(argv) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"error: {message}"], err
    assert files_in(tmp_path) == [listed]


def test_an_output_name_too_long_for_its_temporary_is_refused_before_loading(h3_prepared, tmp_path, capsys, no_model_loads):
    """A 250-byte file name passed the checks, and the clip's temporary (the name plus a writer tag) failed with
    'File name too long' and a traceback once the clip had been generated."""
    name = "a" * 250 + ".mp4"
    line = refused(capsys, ["generate", "--prepared-assets", str(h3_prepared), "--prompt", "x", "--output", str(tmp_path / name)])
    assert re.fullmatch(r"output file name a{40}\.\.\. is 254 bytes long; this folder takes names of at most \d+ bytes", line), line
    assert files_in(tmp_path) == []


def test_compile_output_folder_problems_are_refused_before_the_weights_are_hashed(tiny_transformer, inputs, tmp_path, capsys, monkeypatch):
    """An output folder under a file or with a name too long for its temporary failed with a traceback only after
    every weight file had been read and hashed (minutes at full size)."""
    from vflash_core.weights import compiler
    from vflash_core.weights.compiler import main as compiler_main
    from vflash_core.weights.compiler import prepare

    receipt = tmp_path / "receipt.json"
    prepare("t2va-base4-exact-cpu", tiny_transformer, receipt)

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read for a compile that must be refused first")

    monkeypatch.setattr(compiler, "verify_receipt_files", refuse)
    long_name = tmp_path / ("b" * 250)
    cases = [
        (inputs / "latin1.txt" / "compiled", f"output folder {inputs / 'latin1.txt' / 'compiled'} cannot be created: {inputs / 'latin1.txt'} is a file"),
        (long_name, r"output folder name b{40}\.\.\. is 250 bytes long; this folder takes names of at most \d+ bytes"),
        (tmp_path, f"{tmp_path} already exists; refusing to overwrite it"),
    ]
    for output, message in cases:
        assert compiler_main(["compile", "--receipt", str(receipt), "--output", str(output)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and re.fullmatch(f"error: {message}" if "\\d" in message else f"error: {re.escape(message)}", lines[0]), lines
    assert files_in(tmp_path) == [receipt]


def test_malformed_transformer_config_and_workflow_values_are_one_line(tiny_transformer, tmp_path, capsys):
    """A transformer config.json with `"num_layers": "many"` was a TypeError traceback in `compiler prepare`; a
    workflow node whose `_meta` is a string, and a `--set` integer of more digits than Python converts, were tracebacks
    in run-workflow."""
    import shutil

    from vflash_core.weights.compiler import main as compiler_main

    transformer = tmp_path / "transformer"
    shutil.copytree(tiny_transformer, transformer)
    (transformer / "config.json").write_text('{"num_layers": "many"}')
    assert compiler_main(["prepare", "--profile", "t2va-base4-exact-cpu", "--transformer", str(transformer), "--receipt", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {transformer / 'config.json'}: num_layers must be a positive integer, got 'many'"]

    workflow = tmp_path / "w.json"
    workflow.write_text('{"1": {"class_type": "SaveVideo", "inputs": {"filename_prefix": "x"}, "_meta": "Save"}}')
    assert refused(capsys, ["run-workflow", str(workflow), "--set", "Save.filename_prefix=y"]) == f"workflow {workflow}: node '1' has a '_meta' that is not an object"
    api = API / "t2va.json"
    line = refused(capsys, ["run-workflow", str(api), "--set", "5.seed=" + "9" * 5000, "--output-dir", str(tmp_path / "out")])
    assert line.startswith("invalid workflow: node 5 (VflashSampler).seed must be an integer from 0 to 9,223,372,036,854,775,807, got str '9999")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "out").exists()
