"""The second wave of bad inputs and faults: numbers, path escapes, stale compiles, forged files, full disks
and killed writers, through the CLI, the compiler, run-workflow and the Python API.

As in test_user_errors.py, each case asserts the one line, the exit status (2: bad request, option or file; 1: a
valid request that could not complete), that no traceback reached the user and that nothing was written or left
behind. The HTTP service's cases live in test_service.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from headless_nodes import API
from refusals import files_in, refused

from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.config import H3Config
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.session_hooks import SessionHooks
from vflash_core.errors import CallbackGuard, Number, VflashError, is_int, is_real
from vflash_core.fileio import GIB, MIB, size_text
from vflash_core.formats import gpu_device, is_count, is_number, is_positive
from vflash_core.pipeline.options import RunOptions

pytestmark = pytest.mark.timeout(300)



# -- one number parser -----------------------------------------------------------------------------------------------


def test_the_number_parser_refuses_what_is_no_number_of_its_kind_on_one_line():
    gib = Number(float, 0, 2**20, above=True, unit="GiB")
    assert gib.check("cap", 8) == 8.0 and isinstance(gib.check("cap", 8), float) and gib.parse("--cap", " 2.5 ") == 2.5
    for value, shown in ((1e308, "1e+308"), (math.nan, "nan"), (-math.inf, "-inf"), (0, "0"), ("8", "str '8'"), (True, "bool True"),
                         (None, "NoneType None"), (10**400, "1" + "0" * 36 + "...")):
        with pytest.raises(VflashError, match=f"^{re.escape(f'cap must be a number of GiB above 0 and at most 1,048,576, got {shown}')}$"):
            gib.check("cap", value)
    count = Number(int, 1, 256)
    assert count.check("n", 3) == 3 and count.parse("--n", "256") == 256
    for value, shown in ((3.0, "float 3.0"), (0, "0"), (10**400, "1" + "0" * 36 + "...")):
        with pytest.raises(VflashError, match=rf"^n must be an integer from 1 to 256, got {shown}$"):
            count.check("n", value)
    for text in ("1.5", "1e3", "", "9" * 5000):  # more digits than Python converts is no integer either
        with pytest.raises(VflashError, match=r"^--n must be an integer from 1 to 256, got '"):
            count.parse("--n", text)


def test_a_bool_is_never_a_count_an_index_or_a_number():
    assert is_int(3) and is_int(-1) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_real(2.5) and is_real(2) and not is_real(False) and not is_real(None)
    assert is_count(0) and not is_count(True) and not is_count(-1) and is_positive(1) and not is_positive(0)
    assert is_number(1.5) and not is_number(True) and not is_number(math.inf) and not is_number(math.nan)
    with pytest.raises(VflashError, match=r"^transformer config: num_layers must be a positive integer, got True$"):
        H3Config.from_dict({"num_layers": True})
    with pytest.raises(VflashError, match=r"^transformer config: rope_theta must be a positive number, got False$"):
        H3Config.from_dict({"rope_theta": False})
    assert H3Config.from_dict({"num_layers": 3, "rope_theta": 500}).rope_theta == 500


def test_byte_sizes_and_gpu_flags_read_the_same_everywhere():
    assert size_text(3 * GIB // 2) == "1.5 GiB" and size_text(GIB) == "1.0 GiB" and size_text(512 * MIB) == "512.0 MiB"
    assert size_text(-2 * GIB) == "-2.0 GiB"  # a shortfall, in a refusal
    assert gpu_device(None) == "cpu" and gpu_device(2) == "cuda:2" and gpu_device(None, None) is None


def test_the_callback_guard_tells_what_the_callers_callback_raised():
    guard = CallbackGuard()
    assert guard(None) is None
    calls: list[int] = []
    guard(calls.append)(1)
    assert calls == [1] and guard.raised is None

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        guard(stop)(2)
    assert isinstance(guard.raised, KeyboardInterrupt)


def test_numeric_options_out_of_range_are_one_line_before_anything_loads(h3_prepared, tmp_path, capsys, no_model_loads):
    """`--max-device-memory 1e308` was an OverflowError traceback once the models had loaded (in a service worker's
    job too), `serve --max-upload-mb 1e308` one before the service started; other numbers were argparse's two-line
    usage errors."""
    from vflash_core.weights.compiler import main as compiler_main

    out = tmp_path / "out"
    out.mkdir()
    generate = ["generate", "--prepared-assets", str(h3_prepared), "--prompt", "x", "--output", str(out / "o.mp4")]
    cases = [
        ([*generate, "--max-device-memory", "1e308"], "--max-device-memory must be a number of GiB above 0 and at most 1,048,576, got 1e+308"),
        ([*generate, "--max-device-memory", "nan"], "--max-device-memory must be a number of GiB above 0 and at most 1,048,576, got nan"),
        ([*generate, "--seed", "abc"], "--seed must be an integer from 0 to 9,223,372,036,854,775,807, got 'abc'"),
        ([*generate, "--duration", "inf"], "--duration must be a number of seconds, got inf"),
        ([*generate, "--width", "448.0", "--height", "256"], "--width must be an integer number of pixels, got '448.0'"),
        ([*generate, "--gpu", "-1"], "--gpu must be an integer of at least 0, got -1"),
        ([*generate, "--media-video-threads", "1.5"], "--media-video-threads must be an integer from 1 to 256, got '1.5'"),
        (["serve", "--demo", "--output-dir", str(out / "served"), "--max-upload-mb", "1e308"],
         "--max-upload-mb must be a number of MiB above 0 and at most 1,048,576, got 1e+308"),
        (["serve", "--demo", "--output-dir", str(out / "served"), "--cancel-grace", "1e308"],
         "--cancel-grace must be a number of seconds above 0 and at most 86,400, got 1e+308"),
        (["serve", "--demo", "--output-dir", str(out / "served"), "--max-queue", "0"], "--max-queue must be an integer of at least 1, got 0"),
    ]
    for argv, message in cases:
        assert refused(capsys, argv) == message
    assert compiler_main(["compile", "--receipt", "r.json", "--output", str(out / "c"), "--gpu", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --gpu must be an integer of at least 0, got 'x'"]
    assert files_in(out) == []


def test_numeric_arguments_of_the_python_api_are_checked_before_anything_is_read(tmp_path):
    """`NativeEngineSession(max_device_memory=nan)` was a ValueError and `='8'` a ValueError after 1.6 s of loading;
    `RunOptions(max_device_memory=1e308)` was accepted and failed in the worker's first job (OverflowError)."""
    from vflash_core.engine.session import NativeEngineSession
    from vflash_core.service import ServiceConfig

    missing = {name: tmp_path / name for name in ("artifact", "schedule", "auxiliary.safetensors")}  # never read
    for value, shown in ((math.nan, "nan"), ("8", "str '8'"), (1e308, "1e+308"), (True, "bool True")):
        message = f"^{re.escape(f'max_device_memory must be a number of GiB above 0 and at most 1,048,576, got {shown}')}$"
        with pytest.raises(VflashError, match=message):
            NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(*missing.values()), EngineOptions(max_device_memory=value))
        with pytest.raises(VflashError, match=message):
            RunOptions(max_device_memory=value)
    with pytest.raises(VflashError, match=r"^collective_timeout_seconds must be a number of seconds above 0 and at most 86,400, got inf$"):
        NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(*missing.values()), EngineOptions(collective_timeout_seconds=math.inf))
    receipt = tmp_path / "receipt.json"
    receipt.write_text("{}")
    for field, value, message in (("max_upload_bytes", 2**80, "max_upload_bytes must be an integer from 1 to 1,099,511,627,776, got 1208925819614629174706176"),
                                  ("max_queue", "16", "max_queue must be an integer of at least 1, got str '16'"),
                                  ("cancel_grace_seconds", 1e308, "cancel_grace_seconds must be a number of seconds above 0 and at most 86,400, got 1e+308")):
        with pytest.raises(VflashError, match=f"^{re.escape(message)}$"):
            ServiceConfig(receipt, tmp_path, **{field: value})
    assert files_in(tmp_path) == [receipt]


# -- input folders are boundaries ------------------------------------------------------------------------------------


@pytest.fixture
def no_loader_runs(monkeypatch):
    """Fail the test if a run-workflow loader node starts model work."""
    from vflash_nodes import actions as node_actions

    def refuse(*args, **kwargs):
        raise AssertionError("a loader node ran for a workflow that must be refused when it is checked")

    for loader in ("load_model", "load_component"):
        monkeypatch.setattr(node_actions, loader, refuse)


def test_a_graph_cannot_read_files_outside_its_input_folder(tmp_path, capsys, no_loader_runs):
    """A LoadImage of `../outside.png` read a real PNG outside --input-dir and generated from it (exit 0)."""
    from PIL import Image

    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "outside.png")
    Image.new("RGB", (64, 64)).save(inputs / "inside.png")
    (inputs / "link-out.png").symlink_to(tmp_path / "outside.png")
    (inputs / "link-in.png").symlink_to(inputs / "inside.png")
    outside = f"is outside the input folder {inputs}"
    for name, refusal in (("../outside.png", f"input file '../outside.png' {outside}"), (str(tmp_path / "outside.png"), f"input file '{tmp_path / 'outside.png'}' {outside}"),
                          ("link-out.png", f"input file 'link-out.png' {outside}"), ("sub/../../outside.png", f"input file 'sub/../../outside.png' {outside}"),
                          ("a\x00.png", "input file 'a\\x00.png' must not contain a NUL character")):
        argv = ["run-workflow", str(API / "i2va.json"), "--input-dir", str(inputs), "--output-dir", str(out), "--set", f"8.image={name}"]
        assert refused(capsys, argv) == f"the workflow was refused before running: node 8 (LoadImage): {refusal}"
    # A link that stays inside the folder, and an absolute path into it, are files of the folder like any other.
    from vflash_nodes.headless import installed

    with installed(out, inputs):
        import folder_paths

        assert folder_paths.get_annotated_filepath("link-in.png") == str((inputs / "inside.png").resolve())
        assert folder_paths.get_annotated_filepath(str(inputs / "inside.png")) == str((inputs / "inside.png").resolve())
    assert not out.exists()


# -- graphs: ids and links in every form ComfyUI writes, no recursion, save names checked first ----------------------


def test_node_ids_and_links_in_every_form_comfyui_writes(tmp_path, capsys, no_loader_runs):
    """A link written ["1", "0"] (a string output index) was an AttributeError traceback, a node id "²" (a unicode
    digit: str.isdigit but not int()) a ValueError one."""
    from vflash_nodes.workflow import check_api_workflow

    workflow = json.loads((API / "t2va.json").read_text())
    forms = check_api_workflow({int(k) if k == "6" else k: {**v, "inputs": {name: [int(x[0]), str(x[1])] if isinstance(x, list) and k == "7" else x
                                                                   for name, x in v["inputs"].items()}} for k, v in workflow.items()})
    assert forms == check_api_workflow(workflow) and forms["7"]["inputs"]["video"] == ["6", 2]
    cases = [
        ({"²": {"class_type": "SaveVideo", "inputs": {}}}, "node id '²' is not one ComfyUI writes"),
        ({"1.5": {"class_type": "SaveVideo", "inputs": {}}}, "node id '1.5' is not one ComfyUI writes"),
        ({**workflow, "7": {**workflow["7"], "inputs": {**workflow["7"]["inputs"], "video": ["6", "x"]}}},
         'node 7 (SaveVideo).video: a list is a link, [source node id, output index], got ["6", "x"]'),
        ({**workflow, "7": {**workflow["7"], "inputs": {**workflow["7"]["inputs"], "video": ["²", 0]}}},
         'node 7 (SaveVideo).video: a list is a link, [source node id, output index], got ["\\u00b2", 0]'),
        ({**workflow, "7": {**workflow["7"], "inputs": {**workflow["7"]["inputs"], "video": [6, 0, 1]}}},
         "node 7 (SaveVideo).video: a list is a link, [source node id, output index], got [6, 0, 1]"),
    ]
    graph = tmp_path / "graph.json"
    for data, message in cases:
        graph.write_text(json.dumps(data))
        assert refused(capsys, ["run-workflow", str(graph), "--output-dir", str(tmp_path / "out")]).startswith(f"workflow {graph}: {message}")
    graph.write_text(json.dumps(forms))
    assert refused(capsys, ["run-workflow", str(graph), "--output-dir", str(tmp_path / "out"), "--set", '7.video=["6", 2]']) == \
        "--set '7.video=[\"6\", 2]': input 'video' of node 7 is a link, not a value"
    assert refused(capsys, ["run-workflow", str(graph), "--output-dir", str(tmp_path / "out"), "--set", '4.prompt=["6", 2]']) == \
        "--set '4.prompt=[\"6\", 2]': a widget value is a number, a boolean or a string"
    assert files_in(tmp_path) == [graph]


def test_a_chain_of_ten_thousand_nodes_is_planned_without_recursion(tmp_path, capsys):
    """10,000 independent nodes worked; a chain of 10,000 was a RecursionError traceback."""
    chain = {"1": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 448, "height": 256, "length": 124}}}
    for i in range(2, 10_002):
        chain[str(i)] = {"class_type": "VflashUnload", "inputs": {"anything": [str(i - 1), 0], "what": "all"}}
    chain["10002"] = {"class_type": "SaveVideo", "inputs": {"video": ["10001", 0], "filename_prefix": "x", "format": "mp4"}}
    graph = tmp_path / "chain.json"
    graph.write_text(json.dumps(chain))
    assert main_output(capsys, ["run-workflow", str(graph), "--print-plan", "--output-dir", str(tmp_path / "out")]).startswith(
        "1 EmptyMiniMaxH3LatentAV -> 2 VflashUnload -> 3 VflashUnload")
    chain["2"]["inputs"]["anything"] = ["10001", 0]  # the chain closed into a cycle
    graph.write_text(json.dumps(chain))
    line = refused(capsys, ["run-workflow", str(graph), "--print-plan", "--output-dir", str(tmp_path / "out")])
    assert line == "the workflow has a cycle of 10000 node(s): 2 -> 10001 -> 10000 -> 9999 -> 9998 -> 9997 -> ... -> 6 -> 5 -> 4 -> 3 -> 2"


def main_output(capsys, argv: list[str]) -> str:
    from vflash_core.cli.main import main

    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_save_names_are_checked_before_the_graph_runs(tmp_path, capsys, no_loader_runs):
    """A filename_prefix holding a NUL byte was a ValueError traceback; a 5,000-character one was refused only after
    the whole graph had run (minutes of generation on a real model)."""
    out = tmp_path / "out"
    for prefix, message in (('"a\\u0000b"', "filename_prefix must not contain a NUL character"),
                            ("a" * 5000, r"filename_prefix file name a{40}\.\.\. is 5011 bytes long; this folder takes names of at most \d+ bytes"),
                            ("b" * 300 + "/clip", r"filename_prefix folder b{40}\.\.\. is 300 bytes long; this folder takes names of at most \d+ bytes")):
        line = refused(capsys, ["run-workflow", str(API / "t2va.json"), "--output-dir", str(out), "--set", f"7.filename_prefix={prefix}"])
        assert re.fullmatch(f"the workflow was refused before running: node 7 \\(SaveVideo\\): {message}", line), line
    assert not out.exists()


# -- non-finite weights, scales and bundles ----------------------------------------------------------------------------


def _compiler(capsys, argv: list[str]) -> str:
    """`python -m vflash_core.weights.compiler argv` in-process; its one error line (exit status 2)."""
    from vflash_core.weights.compiler import main as compiler_main

    code = compiler_main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("compile blocks")]  # tqdm's bar
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("error: ")


def test_non_finite_weights_and_scales_are_refused_when_the_file_is_compiled(tmp_path, capsys):
    """An fp8_scaled Comfy-Org file whose QKV scale is NaN passed prepare, compile and prepare-pipeline, and
    generate failed in the MP4 encoder (avcodec_send_frame() returned 22); a NaN weight compiled as well."""
    import torch
    from conftest import TINY
    from safetensors.torch import load_file, save_file

    from vflash_core.weights import synthetic
    from vflash_core.weights.compiler import prepare

    weights = synthetic.random_internal_weights(TINY, seed=3)
    fp8 = synthetic.write_comfy_transformer(tmp_path / "h3_fp8.safetensors", TINY, weights, fp8="metadata")
    state = load_file(fp8)
    state["blocks.0.attn.qkv_proj.weight_scale"] = torch.tensor(float("nan"))
    save_file(state, str(fp8), metadata={"config": json.dumps(TINY.to_dict()), "_quantization_metadata": _quantization_metadata(fp8)})
    receipt = tmp_path / "receipt.json"
    line = _compiler(capsys, ["prepare", "--profile", "t2va-base4-exact-cpu", "--transformer", str(fp8), "--receipt", str(receipt)])
    assert line == f"{fp8}: tensor 'blocks.0.attn.qkv_proj.weight_scale' holds a non-finite value (nan at element 0); the file is corrupt"

    bad = {**weights, "blocks.1.ffn.out.weight": weights["blocks.1.ffn.out.weight"].clone()}
    bad["blocks.1.ffn.out.weight"][3, 5] = float("inf")
    folder = synthetic.write_diffusers_transformer(tmp_path / "transformer", TINY, bad)
    assert not receipt.exists()
    prepare("t2va-base4-exact-cpu", folder, receipt)  # hashes the files; their values are read when they are compiled
    line = _compiler(capsys, ["compile", "--receipt", str(receipt), "--output", str(tmp_path / "compiled")])
    assert line == f"{folder}: tensor 'transformer_blocks.1.ff.net.2.weight' holds a non-finite value (inf at element {3 * TINY.ffn_dim + 5}); the file is corrupt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3_fp8.safetensors", "receipt.json", "transformer"]  # nothing published or left


def _quantization_metadata(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata()["_quantization_metadata"]


def test_a_missing_fp8_scale_is_named_by_the_key_its_marking_reads(tmp_path):
    """It was named by the legacy key `scale_weight` whatever the file's marking."""
    from conftest import TINY
    from safetensors.torch import load_file, save_file

    from vflash_core.errors import WeightFileError
    from vflash_core.weights import synthetic
    from vflash_core.weights.checkpoint import SourceWeights

    weights = synthetic.random_internal_weights(TINY, seed=3)
    for marking, key in (("metadata", "weight_scale"), ("comfy_quant", "weight_scale"), ("legacy", "scale_weight")):
        path = synthetic.write_comfy_transformer(tmp_path / f"h3_{marking}.safetensors", TINY, weights, fp8=marking)
        metadata = {"config": json.dumps(TINY.to_dict())}
        if marking == "metadata":
            metadata["_quantization_metadata"] = _quantization_metadata(path)
        state = load_file(path)
        del state[f"blocks.0.attn.qkv_proj.{key}"]
        if marking == "legacy":  # the legacy layout marks a layer by its scale: the one left without is a plain float8 weight
            key, message = "scale_weight", r"weight\(s\) stored as float8_e4m3fn without ComfyUI quantization metadata \(e\.g\. blocks\.0\.attn\.qkv_proj\.weight\)"
        else:
            message = rf"missing 1 tensor\(s\): blocks\.0\.attn\.qkv_proj\.{key}"
        save_file(state, str(path), metadata=metadata)
        with pytest.raises(WeightFileError, match=message):
            SourceWeights(path)


def _forged_bundle(folder: Path, manifest_changes: dict | None = None, tensor_changes=None) -> Path:
    """A saved bundle with its manifest or tensors changed, the manifest's hash recomputed (so only the checks of its
    fields and values can tell)."""
    import torch  # noqa: F401 (the changes build tensors)
    from bundles import keyframe_bundle
    from safetensors.torch import load_file, save_file

    from vflash_core.tensor_store import file_sha256

    keyframe_bundle().save(folder)
    if tensor_changes is not None:
        tensors = load_file(folder / "tensors.safetensors")
        tensor_changes(tensors)
        save_file(tensors, str(folder / "tensors.safetensors"), metadata={"format": "vflash-bundle/1"})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(manifest_changes or {}, tensors_sha256=file_sha256(folder / "tensors.safetensors"))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_forged_bundles_are_refused_field_by_field_and_range_by_range(tmp_path, tiny_compiled, capsys):
    """Bundles whose manifest hash was recomputed: `num_condition_video_rows: "abc"` was a ValueError traceback,
    `text_indices` past the sequence an IndexError, and a bundle full of NaN gave NaN latents with exit 0."""
    import torch

    from vflash_core.engine.bundle import ConditioningBundle
    from vflash_core.errors import BundleError

    def nan_rows(t):
        t["video_rows"][0, 0] = float("nan")

    def past_the_end(t):
        t["text_indices"][-1] = t["position_ids"].shape[0] + 7

    def negative(t):
        t["video_indices"][0] = -1

    def float_tags(t):
        t["token_tags"] = t["token_tags"].float()

    cases = [
        ({"num_condition_video_rows": "abc"}, None, r"manifest\.json: num_condition_video_rows must be an integer of 0 or more, got str 'abc'$"),
        ({"num_condition_video_rows": 10**6}, None, r"num_condition_video_rows 1000000 is outside 0\.\.\d+ \(the rows there are\)$"),
        ({"geometry": {"height": 64, "width": "96", "num_frames": 124}}, None, r"geometry\.width must be a positive integer, got str '96'$"),
        ({"model_layout": {"text_dim": 8}}, None, r"has no model_layout\.video_patch_dim$"),
        ({"mode": "t2v"}, None, r"mode must be one of t2va, i2va, l2va, fl2va, ref2va, got str 't2v'$"),
        ({"seed": -3}, None, r"seed must be an integer of 0 or more, or null, got int -3$"),
        ({}, past_the_end, r"text_indices holds values \d+\.\.\d+, outside 0\.\.\d+$"),
        ({}, negative, r"video_indices holds values -1\.\.\d+, outside 0\.\.\d+$"),
        ({}, float_tags, r"token_tags is torch\.float32, expected torch\.int64 or torch\.int32$"),
        ({}, nan_rows, r"video_rows holds NaN or infinite values; the bundle is corrupt$"),
        ({}, lambda t: t.pop("audio_rows"), r"incomplete bundle: tensors\.safetensors has no audio_rows$"),
    ]
    for index, (changes, tensors, message) in enumerate(cases):
        folder = _forged_bundle(tmp_path / f"bundle{index}", changes, tensors)
        with pytest.raises(BundleError, match=message):
            ConditioningBundle.load(folder)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["denoise", "t2va-base4-exact-cpu", "--artifact", str(tiny_compiled["artifact"]), "--schedule-overlay", str(tiny_compiled["schedule_overlay"]),
            "--auxiliary-tensor", str(tiny_compiled["auxiliary"]), "--bundle", str(tmp_path / "bundle9"), "--output-latents", str(out / "latents.safetensors")]
    assert refused(capsys, argv) == f"{tmp_path / 'bundle9'}: video_rows holds NaN or infinite values; the bundle is corrupt"
    assert files_in(out) == [] and torch.isfinite(ConditioningBundle.load(_forged_bundle(tmp_path / "plain")).video_rows).all()


def test_session_generate_of_something_that_is_no_bundle_is_one_line(tiny_compiled):
    """`generate(42)` / `generate(None)` were raw TypeErrors (the pipeline's `generate("a prompt")` explains itself)."""
    from vflash_core.engine.session import NativeEngineSession

    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled)) as session:
        for value, shown in ((42, "int 42"), (None, "NoneType None"), ("", "str ''"), (b"bundle", "bytes b'bundle'")):
            with pytest.raises(VflashError, match=re.escape(f"NativeEngineSession.generate takes a ConditioningBundle, a BundleHandoff or a bundle folder path, got {shown}")):
                session.generate(value)
        assert not session.closed and session._failure is None  # bad input leaves the session usable


def test_the_memory_refusal_on_the_cpu_speaks_of_the_cap_not_of_a_gpu(tiny_compiled):
    """On the CPU (where the budget is the cap) the refusal said "This GPU is too small for H3"."""
    from vflash_core.engine.session import NativeEngineSession
    from vflash_core.errors import RunFailedError

    with pytest.raises(RunFailedError) as info:
        NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(max_device_memory=1e-6))
    message = str(info.value)
    assert message.startswith("the weights do not fit on cpu: ") and "GPU" not in message
    assert message.endswith("Raise max_device_memory, or leave it out on the CPU (no cap: everything stays in host memory).")


def test_verify_weights_runs_before_anything_loads(tmp_path, h3_family, no_model_loads):
    """`--verify-weights` hashed the compile after the text encoder and VAEs had loaded."""
    from conftest import prepare_family

    from vflash_core.errors import WeightFileError
    from vflash_core.pipeline.h3_pipeline import H3Pipeline

    receipt = prepare_family(tmp_path, h3_family, "t2va-base4-exact-cpu", "transformer")
    block = tmp_path / "compiled" / "artifact" / "block_001.safetensors"
    data = bytearray(block.read_bytes())
    data[-1] ^= 0x01
    block.write_bytes(bytes(data))
    with (
        H3Pipeline.from_prepared(receipt, RunOptions(verify_weights=True)) as pipeline,
        pytest.raises(WeightFileError, match=r"1 compiled file\(s\) differ from what the compiler wrote .*block_001\.safetensors$"),
    ):
        pipeline.load()  # `no_model_loads` fails the test if an encoder or a VAE loads first


# -- receipts and manifests, field by field ----------------------------------------------------------------------------


def test_receipts_and_manifests_are_checked_field_by_field(tmp_path, tiny_transformer, tiny_compiled, capsys):
    """`compiler verify` on a manifest without `blocks` was a KeyError traceback, `compiler compile` with a receipt
    missing `profile` a KeyError one and with `transformer` a string a TypeError one."""
    import shutil

    from vflash_core.formats import MISSING
    from vflash_core.weights.compiler import prepare

    receipt = tmp_path / "receipt.json"
    prepare("t2va-base4-exact-cpu", tiny_transformer, receipt)
    record = json.loads(receipt.read_text())
    forged = tmp_path / "forged.json"
    redo = "write it again with `python -m vflash_core.weights.compiler prepare`"
    for changes, message in (
        ({"profile": MISSING}, f"receipt {forged} has no profile.id; {redo}"),
        ({"profile": None}, f"receipt {forged}: profile must be an object, got NoneType None; {redo}"),
        ({"transformer": "models/x"}, f"receipt {forged}: transformer must be an object, got str 'models/x'; {redo}"),
        ({"transformer": {**record["transformer"], "files": [{"name": "../x", "size": 1, "sha256": "0"}]}},
         f"receipt {forged}: transformer.files must be a list of {{name, size, sha256}} records, got list [{{'name': '../x', 'size': 1, 'sha256'...; {redo}"),
        ({"profile": {**record["profile"], "nfe": "4"}}, f"receipt {forged}: profile.nfe must be a positive integer, got str '4'; {redo}"),
        ({"adapter": "lora.safetensors"}, f"receipt {forged}: adapter must be null or a {{path, name, size, sha256, format, alpha_source, network_alpha}} record, got str 'lora.safetensors'; {redo}"),
    ):
        forged.write_text(json.dumps({k: v for k, v in {**record, **changes}.items() if v is not MISSING}))
        assert _compiler(capsys, ["compile", "--receipt", str(forged), "--output", str(tmp_path / "compiled")]) == message
    assert not (tmp_path / "compiled").exists()

    compiled = tmp_path / "copy"
    shutil.copytree(tiny_compiled["artifact"].parent, compiled)
    manifest_path = compiled / "artifact" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for changes, message in (
        ({"blocks": None}, "has no blocks"),
        ({"blocks": [{**manifest["blocks"][0], "file": "../../../etc/passwd"}, manifest["blocks"][1]]}, "blocks must be a list of {file, size, sha256, lora} records"),
        ({"auxiliary": {"size": -1, "sha256": "x"}}, "auxiliary.size must be a byte count, got int -1"),
        ({"config": [1]}, "config must be an object, got list [1]"),
    ):
        manifest_path.write_text(json.dumps({k: v for k, v in {**manifest, **changes}.items() if v is not None}))
        assert _compiler(capsys, ["verify", str(compiled)]).startswith(f"{manifest_path}{':' if 'has no' not in message else ''} {message}")
    manifest_path.write_text(json.dumps(manifest))
    overlay_path = compiled / "schedule" / "manifest.json"
    overlay = json.loads(overlay_path.read_text())
    overlay_path.write_text(json.dumps({**overlay, "entries": [{"step": "0", "variant": 0, "timesteps": [1.0]}]}))
    assert _compiler(capsys, ["verify", str(compiled)]).startswith(f"{overlay_path}: entries must be a list of {{step, variant, timesteps}} records")


# -- writers under faults: a full disk, a killed run ---------------------------------------------------------------


def _mounts_allowed(folder: Path) -> bool:
    """Whether this machine lets a child mount a tmpfs in a mount namespace of its own (root, or unprivileged user
    namespaces); the full-disk test uses an RLIMIT_FSIZE child otherwise."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {folder}"],
                           check=False, capture_output=True, timeout=30)
    return probe.returncode == 0


# Runs each [command, room] of argv[3] (JSON: a `vflash` argument list, "{disk}" standing for the folder, and the bytes
# it may write) with the folder argv[1] full to within `room` (a tmpfs mounted there and a ballast file, or a file
# size limit of `room`), then reports each run's exit status, what it wrote to stderr (file descriptor 2, where its
# logging and progress bars write too) and what the folder holds after it, as JSON. The runs call the command line's
# `main` one after another in this one process: they share its imports, not their pipelines.
_FULL_DISK_RUNS = """
import json, os, resource, signal, sys, threading
from vflash_core.cli.main import main
folder, limit, commands = sys.argv[1], sys.argv[2] == "limit", json.loads(sys.argv[3])
ballast = os.path.join(folder, "ballast")
unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing the writer
runs = []
for argv, room in commands:
    if not limit:
        open(ballast, "wb").close()
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        with open(ballast, "wb") as f:
            f.write(b"\\0" * max(0, free - room))
    reader, writer = os.pipe()  # a pipe, which no file size limit applies to, read by a thread while the run writes
    chunks = []
    drain = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(reader, 65536), b"")))
    drain.start()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(writer, 2)
    os.close(writer)
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, unlimited[1]))
    try:
        status = main([a.replace("{disk}", folder) for a in argv])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closed: the thread reads to its end
        os.close(saved)
        drain.join()
        os.close(reader)
    stderr = b"".join(chunks).decode(errors="replace")
    runs.append([status, stderr, sorted(name for name in os.listdir(folder) if name != "ballast")])
if os.path.exists(ballast):
    os.unlink(ballast)
print(json.dumps({"runs": runs, "left": sorted(os.listdir(folder))}))
"""


@pytest.mark.timeout(600)
def test_a_full_disk_is_one_line_and_leaves_nothing(h3_prepared, tiny_compiled, tmp_path):
    """`generate --output` into a full tmpfs: the first run died with SIGBUS (a memory-mapped temporary written past
    the disk's end), the second printed OSError [Errno 28] with a traceback, and a `.vflash-frames.*.rgb.partial`
    temporary was left behind. Found by this issue's adversarial run: `denoise --output-latents` and the demo
    family's build there were SafetensorError tracebacks (safetensors' writer reports the OS error as text).

    Each of the MP4 writer's three video inputs (the streamed MP4, the raw frames file that was memory-mapped, the
    per-frame pipe) meets the full disk once, on the smallest canvas (32x32: a 213 KB clip, 381 KB of raw frames)
    with 64 KiB of room, and the folder is checked empty after every run (so a second run would start where the first
    did: the two identical runs of the default clip into 4 MiB that this test made before checked nothing more)."""
    import subprocess
    import sys

    from bundles import keyframe_bundle

    disk = tmp_path / "disk"
    disk.mkdir()
    bundle = keyframe_bundle().save(tmp_path / "bundle")
    generate = ["generate", "--prepared-assets", str(h3_prepared), "--prompt", "a kite", "--width", "32", "--height", "32", "--output", "{disk}/clip.mp4"]
    denoise = ["denoise", "t2va-base4-exact-cpu", "--artifact", str(tiny_compiled["artifact"]), "--schedule-overlay", str(tiny_compiled["schedule_overlay"]),
               "--auxiliary-tensor", str(tiny_compiled["auxiliary"]), "--bundle", str(bundle), "--output-latents", "{disk}/latents.safetensors"]
    commands = [(([*generate, "--media-video-input", video_input], 64 << 10), "clip.mp4") for video_input in ("stream", "file", "pipe")]
    commands.append(((denoise, 512), "latents.safetensors"))
    script = tmp_path / "runs.py"
    script.write_text(_FULL_DISK_RUNS)
    argv = json.dumps([command for command, _ in commands])
    if _mounts_allowed(disk):
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount -t tmpfs -o size=4m tmpfs "$1" && exec "{sys.executable}" "$2" "$1" tmpfs "$3"', "sh", str(disk), str(script), argv]
        full = "No space left on device"
    else:
        argv, full = [sys.executable, str(script), str(disk), "limit", argv], "File too large"
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])  # the runs' own output lines come before it
    assert len(report["runs"]) == len(commands)
    for (status, stderr, left), (_, name) in zip(report["runs"], commands):
        lines = [line for line in stderr.splitlines() if "error" in line.lower()]  # beside them: log lines and progress bars
        assert status == 1 and "Traceback" not in stderr, stderr
        assert len(lines) == 1 and re.fullmatch(rf"vflash: error: writing {re.escape(str(disk / name))} failed: {full} \(\d+\.\d [MG]iB free in {re.escape(str(disk))}\)", lines[0]), lines
        assert left == [], (name, left)
    assert report["left"] == []


@pytest.mark.parametrize("video_input, temporary", [("file", "rgb"), ("stream", "mp4")])
def test_a_killed_runs_temporaries_are_removed_by_the_next_run_into_its_folder(h3_prepared, tmp_path, video_input, temporary):
    """A `vflash generate` SIGKILLed in its MP4 stage left its raw frames temporary, and a rerun into the same folder
    did not remove it (the atomic writers' temporaries were swept, that one was not). The streamed MP4's temporary
    exists for the whole decode. The killed run's 224x128 canvas keeps its MP4 stage long enough to be caught (about
    a second on an idle machine, polled every 2 ms) at a quarter of the default canvas's work."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    out.mkdir()
    keep = out / ".notes.txt.partial"  # not a Vflash temporary (no writer in its name): never touched
    keep.write_text("mine")
    run = subprocess.Popen([sys.executable, "-m", "vflash_core.cli.main", "generate", "--prepared-assets", str(h3_prepared), "--prompt", "a kite",
                            "--width", "224", "--height", "128", "--media-video-threads", "1", "--media-video-input", video_input,
                            "--output", str(out / "first.mp4")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not list(out.glob(f".first.mp4.*.partial.{temporary}")):
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before its MP4 stage was seen"
        time.sleep(0.002)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    left = sorted(p.name for p in out.iterdir() if p != keep)
    assert left and all(name.startswith(f".first.mp4.{os.uname().nodename}+{run.pid}+") for name in left), left
    main_output_of_generate = subprocess.run([sys.executable, "-m", "vflash_core.cli.main", "generate", "--prepared-assets", str(h3_prepared),
                                              "--prompt", "a kite", "--width", "32", "--height", "32", "--output", str(out / "second.mp4")],
                                             check=False, capture_output=True, text=True, timeout=240)
    assert main_output_of_generate.returncode == 0, main_output_of_generate.stderr
    assert sorted(out.iterdir()) == [keep, out / "second.mp4"] and keep.read_text() == "mine"


# -- compile on first use, keyed by the files' identity ----------------------------------------------------------------


@pytest.fixture
def models_folder(tmp_path, monkeypatch, demo_cache):
    """A models folder holding one Comfy-Org single file of the demo's transformer, and a demo family cache for the
    text encoder and VAE loaders' `embedded-demo` (the run's shared demo build)."""
    from vflash_core.engine.config import H3Config
    from vflash_core.weights import synthetic

    monkeypatch.setenv("VFLASH_CACHE", str(demo_cache))
    models = tmp_path / "models"
    (models / "diffusion_models").mkdir(parents=True)
    demo = H3Config.preset("demo")
    synthetic.write_comfy_transformer(models / "diffusion_models" / "h3.safetensors", demo, synthetic.random_internal_weights(demo, seed=4))
    return models


def test_compile_on_first_use_follows_the_file_never_a_stale_compile(models_folder, tmp_path, capsys, caplog):
    """run-workflow on a diffusion_models file, then the file replaced by other weights under the same name: the
    second run used the first file's compile and never said so. A first use interrupted after its prepare left a
    receipt that every later run met with "does not match the receipt" once the file was replaced."""
    import logging
    import os

    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.engine.config import H3Config
    from vflash_core.tensor_store import file_sha256
    from vflash_core.weights import synthetic

    weights = models_folder / "diffusion_models" / "h3.safetensors"
    compiled = models_folder / "vflash" / "compiled" / "h3-t2va-base4-exact-cpu"
    receipt = compiled.with_name(compiled.name + ".weights-receipt.json")
    argv = ["run-workflow", str(API / "t2va.json"), "--models-dir", str(models_folder), "--output-dir", str(tmp_path / "out"),
            "--set", "1.model=h3.safetensors", "--set", "1.profile=t2va-base4-exact-cpu", "--set", "4.width=32", "--set", "4.height=32"]

    def run() -> tuple[str, list[str]]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            main_output(capsys, argv)
        artifact = CompiledArtifact(compiled / "artifact", compiled / "schedule", compiled / "auxiliary.safetensors")
        assert [f["sha256"] for f in artifact.base_weights["files"]] == [file_sha256(weights)]  # the compile is of the file as it is
        # what the host said about the weights file or its compile (not, e.g., that this host draws no previews)
        about_the_weights = ("Vflash: h3.safetensors", "Vflash: preparing", "Vflash: compiling", f"Vflash: {compiled}")
        return artifact.compile_id, [r.getMessage() for r in caplog.records if r.getMessage().startswith(about_the_weights)]

    first, said = run()
    assert [line.split(" (")[0].split(" for ")[0] for line in said] == ["Vflash: preparing h3.safetensors", "Vflash: compiling h3.safetensors"]
    assert run() == (first, [])  # the same file: the same compile, nothing hashed again

    demo = H3Config.preset("demo")
    synthetic.write_comfy_transformer(weights, demo, synthetic.random_internal_weights(demo, seed=5))  # replaced, same name
    second, said = run()
    assert second != first and said[0].startswith("Vflash: h3.safetensors is not the file it was prepared from")
    assert any(line.startswith(f"Vflash: {compiled} was compiled from other weights") for line in said)

    # A first use interrupted after its prepare: the receipt is there, the compile is not; then the file is replaced.
    os.rename(compiled, tmp_path / "aside")
    synthetic.write_comfy_transformer(weights, demo, synthetic.random_internal_weights(demo, seed=6))
    third, said = run()
    assert third not in (first, second) and said[0].startswith("Vflash: h3.safetensors is not the file it was prepared from")
    assert receipt.is_file() and not [p for p in compiled.parent.iterdir() if ".partial" in p.name]


def test_a_workflow_saved_with_the_old_single_file_spelling_is_refused_naming_the_new_option(models_folder, tmp_path, capsys, no_loader_runs):
    """The loader named a single file `diffusion_models/<rel>` before it named it as core's UNETLoader does (`<rel>`):
    a workflow saved then is refused before anything runs, in one line naming the option to pick (and, when that file
    is not there either, the folder it belongs in)."""
    t2va = ["run-workflow", str(API / "t2va.json"), "--models-dir", str(models_folder), "--output-dir", str(tmp_path / "out"),
            "--set", "1.profile=t2va-base4-exact-cpu"]
    assert refused(capsys, [*t2va, "--set", "1.model=diffusion_models/h3.safetensors"]) == (
        "the workflow was refused before running: node 1 (VflashModelLoader): 'diffusion_models/h3.safetensors' is the old spelling "
        "of h3.safetensors; pick h3.safetensors in the loader")
    gone = refused(capsys, [*t2va, "--set", "1.model=diffusion_models/gone.gguf"])
    assert gone.startswith("the workflow was refused before running: node 1 (VflashModelLoader): 'diffusion_models/gone.gguf' is the old "
                           "spelling of gone.gguf; pick gone.gguf in the loader once it is in models/diffusion_models (ComfyUI looks in "), gone
    assert str(models_folder / "diffusion_models") in gone
    assert not (tmp_path / "out").exists() and not (models_folder / "vflash").exists()


# -- the command lines' help ---------------------------------------------------------------------------------------


def test_every_option_of_every_command_has_help_text():
    """`--prompt`, `--seed` and `--attention-backend` had none (nor had the compiler's `--profile`, `--receipt`,
    `--output`)."""
    import argparse

    from vflash_core.cli.main import build_parser
    from vflash_core.weights.compiler import build_parser as compiler_parser

    def undocumented(parser: argparse.ArgumentParser, name: str) -> list[str]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += [f"{name} {sub} (the command)" for sub in action.choices if not any(c.dest == sub and c.help for c in action._choices_actions)]
                out += [found for sub, child in action.choices.items() for found in undocumented(child, f"{name} {sub}")]
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                out.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
        return out

    assert undocumented(build_parser(), "vflash") + undocumented(compiler_parser(), "compiler") == []


def test_a_model_not_found_without_a_models_folder_names_models_dir(tmp_path, capsys):
    """run-workflow without --models-dir said "not found in the diffusers folders (none registered)"."""
    argv = ["run-workflow", str(API / "t2va.json"), "--output-dir", str(tmp_path / "out"), "--set", "1.model=diffusers/minimax-h3"]
    assert refused(capsys, argv) == ("the workflow was refused before running: node 1 (VflashModelLoader): diffusers/minimax-h3 is missing: minimax-h3 "
                                     "belongs in models/diffusers, and no diffusers folder is registered (vflash run-workflow registers them under --models-dir)")
    assert not (tmp_path / "out").exists()


# -- found by this issue's own adversarial run -------------------------------------------------------------------------


def test_json_records_nested_too_deeply_or_under_a_file_are_one_line(h3_prepared, tmp_path, capsys, no_model_loads):
    """A prepared-assets receipt of 200,000 nested arrays was a RecursionError traceback, and an assets file whose
    artifact is a regular file a NotADirectoryError one (reading <file>/manifest.json)."""
    from vflash_core.pipeline.h3_pipeline import PreparedAssets

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    out = tmp_path / "o.mp4"
    assert refused(capsys, ["generate", "--prepared-assets", str(deep), "--prompt", "x", "--output", str(out)]) == \
        f"prepared-assets receipt {deep} nests arrays or objects too deeply to be read"
    record = PreparedAssets.load(h3_prepared).record
    assets = tmp_path / "assets.json"
    assets.write_text(json.dumps({**{k: record["assets"][k] for k in ("model_root", "decoder_root", "adapter_path", "schedule_overlay", "auxiliary_tensor")},
                                  "artifact": str(deep)}))
    line = refused(capsys, ["prepare-pipeline", "--profile", "t2va-base4-exact-cpu", "--assets", str(assets), "--receipt", str(tmp_path / "r.json")])
    assert line == f"{deep}: not a compiled artifact (no manifest.json)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assets.json", "deep.json"]


def test_fifos_named_as_weights_configs_or_manifests_never_block(tmp_path, tiny_compiled, capsys):
    """`compiler prepare --transformer <a FIFO>` blocked forever in open() (so would a FIFO named config.json,
    *.safetensors.index.json or manifest.json, or one among the receipts the model loader lists)."""
    import os
    import shutil

    from vflash_core.engine.artifact import CompiledArtifact
    from vflash_core.engine.config import H3Config
    from vflash_core.errors import WeightFileError
    from vflash_core.tensor_store import TensorStore

    fifo = tmp_path / "h3.safetensors"
    os.mkfifo(fifo)
    receipt = tmp_path / "r.json"
    assert _compiler(capsys, ["prepare", "--profile", "t2va-base4-exact-cpu", "--transformer", str(fifo), "--receipt", str(receipt)]) == \
        f"safetensors file {fifo} is a FIFO, not a file"
    index = tmp_path / "sharded"
    index.mkdir()
    os.mkfifo(index / "model.safetensors.index.json")
    with pytest.raises(WeightFileError, match=r"^safetensors index .*model\.safetensors\.index\.json is a FIFO, not a file$"):
        TensorStore(index)
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(VflashError, match=r"^transformer config .*config\.json is a FIFO, not a file$"):
        H3Config.from_file(tmp_path / "config.json")
    compiled = tmp_path / "compiled"
    shutil.copytree(tiny_compiled["artifact"].parent, compiled)
    (compiled / "artifact" / "manifest.json").unlink()
    os.mkfifo(compiled / "artifact" / "manifest.json")
    with pytest.raises(VflashError, match=r"^JSON file .*artifact/manifest\.json is a FIFO, not a file$"):
        CompiledArtifact(compiled / "artifact", compiled / "schedule", compiled / "auxiliary.safetensors")

    from vflash_nodes import model_files

    class Folders:  # a models/vflash folder holding a FIFO named like a receipt
        def filenames(self, key):
            return ["stuck.json"] if key == "vflash" else []

        def folders(self, key):
            return [str(tmp_path)]

        def full_path(self, key, name):
            return str(tmp_path / name)

    os.mkfifo(tmp_path / "stuck.json")
    assert model_files.model_options(Folders()) == [model_files.DEMO]
    assert not receipt.exists()


def test_load_nodes_save_formats_and_combo_values_are_checked_before_the_graph_runs(tmp_path, capsys, no_loader_runs):
    """Found by this issue's adversarial run: a LoadImage of a text file named .png, of a truncated PNG or of a
    60000x60000 PNG header was a PIL traceback once the graph ran; SaveVideo's `format.codec` av1 and a combo value
    no option names (VflashUnload `what`: "everything") were refused only after the models had run."""
    from PIL import Image

    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    (inputs / "text.png").write_text("not an image")
    Image.new("RGB", (64, 48)).save(inputs / "whole.png")
    (inputs / "truncated.png").write_bytes((inputs / "whole.png").read_bytes()[:40])
    for name in ("text.png", "truncated.png"):
        argv = ["run-workflow", str(API / "i2va.json"), "--input-dir", str(inputs), "--output-dir", str(out), "--set", f"8.image={name}"]
        assert refused(capsys, argv) == (f"the workflow was refused before running: node 8 (LoadImage): image file '{name}': {inputs.resolve() / name} "
                                         f"cannot be read as image: cannot identify image file '{inputs.resolve() / name}'")
    t2va = ["run-workflow", str(API / "t2va.json"), "--output-dir", str(out)]
    assert refused(capsys, [*t2va, "--set", "7.format.codec=av1"]) == ("the workflow was refused before running: node 7 (SaveVideo): the headless "
                                                                     "runner writes mp4/h264 with its own encoding (got format 'mp4', codec 'av1', encoding 'auto')")
    workflow = json.loads((API / "t2va.json").read_text())
    workflow["9"] = {"class_type": "VflashUnload", "inputs": {"anything": ["6", 2], "what": "everything"}}
    graph = tmp_path / "unload.json"
    graph.write_text(json.dumps(workflow))
    assert refused(capsys, ["run-workflow", str(graph), "--output-dir", str(out)]) == \
        "the workflow was refused before running: node 9 (VflashUnload): what must be one of all, dit, te, vae, got \"everything\""
    assert main_output(capsys, ["run-workflow", str(graph), "--print-plan", "--output-dir", str(out)]).strip().endswith("7 SaveVideo -> 9 VflashUnload")  # the order needs no values
    assert not out.exists()


def test_python_api_paths_devices_and_callbacks_of_the_wrong_kind_are_one_line(tiny_compiled, tmp_path):
    """Found by this issue's adversarial run: NativeEngineSession with an artifact of None, a device "tpu", a
    progress callback that is an int (a TypeError after the first evaluation), ConditioningBundle.load(5),
    prepare(transformer=5) and compile_receipt(5, ...) were TypeError / RuntimeError tracebacks."""
    from bundles import keyframe_bundle

    from vflash_core.engine.bundle import ConditioningBundle
    from vflash_core.engine.session import NativeEngineSession
    from vflash_core.weights.compiler import compile_receipt, prepare

    profile = "t2va-base4-exact-cpu"
    cases = [
        (lambda: NativeEngineSession(profile, CompiledPaths(None, None, None)), "artifact must be a file path (str or Path), got NoneType None"),
        (lambda: NativeEngineSession(profile, CompiledPaths(**tiny_compiled), EngineOptions(device="tpu")), "device 'tpu' is not a device; use 'cpu', a GPU index or 'cuda:N'"),
        (lambda: NativeEngineSession(profile, CompiledPaths(**tiny_compiled), EngineOptions(peer_device=["gpu1"], strategy="tensor")), "peer device 'gpu1' is not a device; use 'cpu', a GPU index or 'cuda:N'"),
        (lambda: NativeEngineSession(profile, CompiledPaths(**tiny_compiled), hooks=SessionHooks(on_load_progress=5)), "on_load_progress must be a callable or None, got int 5"),
        (lambda: ConditioningBundle.load(5), "the bundle folder must be a file path (str or Path), got int 5"),
        (lambda: prepare(profile, 5, tmp_path / "r.json"), "the transformer must be a file path (str or Path), got int 5"),
        (lambda: compile_receipt(5, tmp_path / "c"), "the receipt must be a file path (str or Path), got int 5"),
    ]
    for call, message in cases:
        with pytest.raises(VflashError, match=f"^{re.escape(message)}$"):
            call()
    with NativeEngineSession(profile, CompiledPaths(**tiny_compiled)) as session:
        for keyword, value in (("progress", 5), ("between_blocks", "stop")):
            with pytest.raises(VflashError, match=f"^{keyword} must be a callable or None, got "):
                session.generate(keyframe_bundle(), **{keyword: value})
        with pytest.raises(VflashError, match=r"^output_latents must be a file path \(str or Path\), got int 7$"):
            session.generate(keyframe_bundle(), output_latents=7)
        assert session._failure is None and session.generate(keyframe_bundle()).video_latents.isfinite().all()
    assert list(tmp_path.iterdir()) == []
