"""Compiler and artifact identity: receipts, atomic output, and every mismatch refused with both sides named."""

from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest
from conftest import TINY, compile_tiny, cpu_profile

from vflash_core import NativeEngineSession
from vflash_core.engine.artifact import CompiledArtifact, CompiledPaths
from vflash_core.errors import IdentityMismatchError, VflashError, WeightFileError
from vflash_core.profiles import AdapterSpec
from vflash_core.weights import synthetic
from vflash_core.weights.compiler import compile_receipt, prepare


def test_receipt_records_identities_without_request_data(tmp_path, tiny_transformer):
    receipt = prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r.json")
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk == receipt
    assert receipt["profile"]["id"] == "t2va-base4-exact-cpu" and receipt["adapter"] is None
    files = receipt["transformer"]["files"]
    assert len(files) > 1 and all(len(f["sha256"]) == 64 and f["size"] > 0 for f in files)
    assert receipt["transformer"]["config"] == TINY.to_dict()
    with pytest.raises(VflashError, match="already exists"):
        prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r.json")


def test_compiled_outputs_exclude_adaln_and_record_identity(tiny_compiled):
    artifact = CompiledArtifact(**tiny_compiled)
    manifest = artifact.manifest
    assert manifest["arch"] == "cpu" and manifest["profile_id"] == "t2va-base4-exact-cpu"
    block = artifact.read_block(0)
    assert not any("adaln" in name for name in block.tensors)
    assert block["attn.qkv.weight"].shape == (3 * TINY.inner_dim, TINY.hidden_size)
    # 4 steps; step 0 has t_v = t_a = 0 so t2va presents {0}; keyframes add 0.999.
    entries = artifact.overlay.manifest["entries"]
    assert [e["timesteps"] for e in entries if e["step"] == 0] == [[0.0], [0.0, pytest.approx(0.999)]]
    assert len({e["step"] for e in entries}) == 4


def test_receipt_hash_mismatch_is_refused(tmp_path, tiny_weights):
    folder = synthetic.write_diffusers_transformer(tmp_path / "t", TINY, tiny_weights)
    prepare("t2va-base4-exact-cpu", folder, tmp_path / "r.json")
    weights = dict(tiny_weights)
    weights["blocks.0.norm1.weight"] = weights["blocks.0.norm1.weight"] + 1
    synthetic.write_diffusers_transformer(folder, TINY, weights)  # same size, different bytes
    with pytest.raises(IdentityMismatchError, match="does not match the receipt"):
        compile_receipt(tmp_path / "r.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_compile_hashes_each_source_byte_once(tmp_path, tiny_weights):
    """Files whose size and mtime are still the ones prepare recorded are trusted; a touched file is re-hashed."""
    import os

    from vflash_core.weights import receipt

    folder = synthetic.write_diffusers_transformer(tmp_path / "t", TINY, tiny_weights, max_shard_bytes=40_000)
    prepare("t2va-base4-exact-cpu", folder, tmp_path / "r.json")
    with mock.patch.object(receipt, "describe_files", wraps=receipt.describe_files) as hashing:
        compile_receipt(tmp_path / "r.json", tmp_path / "out")
    assert not any(call.kwargs.get("with_hash") for call in hashing.call_args_list)
    touched = min(folder.glob("*.safetensors"))
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 1_000_000_000))
    with mock.patch.object(receipt, "describe_files", wraps=receipt.describe_files) as hashing:
        compile_receipt(tmp_path / "r.json", tmp_path / "out2")
    assert [call.args[0] for call in hashing.call_args_list] == [[touched]]
    compiled = CompiledArtifact(tmp_path / "out" / "artifact", tmp_path / "out" / "schedule", tmp_path / "out" / "auxiliary.safetensors")
    for record in compiled.manifest["blocks"]:  # hashed as written, never read back
        assert record["sha256"] == receipt.file_sha256(compiled.artifact_dir / record["file"])


def test_interrupted_compile_leaves_nothing_that_loads(tmp_path, tiny_transformer):
    prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r.json")
    with (
        mock.patch("vflash_core.weights.artifact_writer._save_hashed", side_effect=[None, None, KeyboardInterrupt]),
        pytest.raises(KeyboardInterrupt),
    ):
        compile_receipt(tmp_path / "r.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    compile_receipt(tmp_path / "r.json", tmp_path / "out")  # a clean retry works
    with pytest.raises(VflashError, match="already exists"):
        compile_receipt(tmp_path / "r.json", tmp_path / "out")


def test_progress_reports_each_file_and_block_and_may_abandon_the_call(tmp_path, tiny_transformer):
    steps = []
    prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r.json", progress=lambda *step: steps.append(step))
    files = len(json.loads((tmp_path / "r.json").read_text())["transformer"]["files"])
    assert steps == [("hash", k, files) for k in range(1, files + 1)]
    steps.clear()
    compile_receipt(tmp_path / "r.json", tmp_path / "out", progress=lambda *step: steps.append(step))
    assert steps == [*(("verify", k, files) for k in range(1, files + 1)), *(("compile", i, TINY.num_layers) for i in range(1, TINY.num_layers + 1))]

    def cancel_at(stage_to_cancel):
        def progress(stage, done, total):
            if stage == stage_to_cancel:
                raise KeyboardInterrupt

        return progress

    with pytest.raises(KeyboardInterrupt):
        compile_receipt(tmp_path / "r.json", tmp_path / "again", progress=cancel_at("compile"))
    assert not (tmp_path / "again").exists()
    with pytest.raises(KeyboardInterrupt):
        prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r2.json", progress=cancel_at("hash"))
    assert not (tmp_path / "r2.json").exists()


def test_architecture_mismatch(tmp_path, tiny_transformer):
    prepare("t2va-base16-bf16-sm90", tiny_transformer, tmp_path / "r.json")
    with pytest.raises(IdentityMismatchError, match=r"profile t2va-base16-bf16-sm90 runs on sm90 GPUs \(H100 / H200\); the device cpu is cpu"):
        compile_receipt(tmp_path / "r.json", tmp_path / "out", device="cpu")
    with pytest.raises(VflashError, match="cuda:0 does not exist: CUDA is not available|cuda:0 is sm"):  # checked before any weight is read
        compile_receipt(tmp_path / "r.json", tmp_path / "out", device="cuda:0")
    assert not (tmp_path / "out").exists()


def test_compile_removes_what_a_killed_compile_left(tmp_path, tiny_transformer):
    """A SIGKILLed compile cannot clean up: its temporary names its host and process, and the next compile into the
    same destination removes it when that process is gone (a live writer's and another host's are kept)."""
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    host = socket.gethostname()
    left = tmp_path / f".out.{host}+{dead.stdout.strip()}+abcd.partial"
    live = tmp_path / f".out.{host}+{os.getpid()}+efgh.partial"
    other = tmp_path / f".out.another-host+{dead.stdout.strip()}+ijkl.partial"
    for folder in (left, live, other):
        folder.mkdir()
        (folder / "block_000.safetensors").write_bytes(b"half written")
    prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r.json")
    compile_receipt(tmp_path / "r.json", tmp_path / "out")
    assert not left.exists() and live.exists() and other.exists()


def test_verify_finds_a_flipped_byte(tmp_path, tiny_transformer, capsys):
    from vflash_core.weights.compiler import main

    prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r.json")
    compile_receipt(tmp_path / "r.json", tmp_path / "out")
    assert main(["verify", str(tmp_path / "out")]) == 0
    block = tmp_path / "out" / "artifact" / "block_001.safetensors"
    data = bytearray(block.read_bytes())
    data[-3] ^= 0x10  # same size: loading still accepts it
    block.write_bytes(bytes(data))
    CompiledArtifact(tmp_path / "out" / "artifact", tmp_path / "out" / "schedule", tmp_path / "out" / "auxiliary.safetensors")
    assert main(["verify", str(tmp_path / "out")]) == 2
    assert "block_001.safetensors" in capsys.readouterr().err


def test_profile_schedule_mismatch_names_both_sides(tiny_compiled):
    with pytest.raises(IdentityMismatchError) as info:
        NativeEngineSession("t2va-base16-exact-cpu", CompiledPaths(**tiny_compiled))
    message = str(info.value)
    assert "nfe: profile t2va-base16-exact-cpu has 16" in message and "has 4" in message


def test_renamed_profile_does_not_convert_assets(tiny_compiled):
    # Same name-independent identity loads; a different architecture under the same modes does not.
    NativeEngineSession(cpu_profile(id="renamed-but-identical"), CompiledPaths(**tiny_compiled)).close()
    with pytest.raises(IdentityMismatchError, match="arch"):
        NativeEngineSession(cpu_profile(id="t2va-base4-exact-cpu", arch="sm89"), CompiledPaths(**tiny_compiled))


def test_adapter_identity_mismatch(tmp_path, tiny_transformer):
    with pytest.raises(IdentityMismatchError, match="needs adapter"):
        prepare(cpu_profile(adapter=AdapterSpec("test", "x.safetensors", 4.0, 4)), tiny_transformer, tmp_path / "r.json")
    with pytest.raises(IdentityMismatchError, match="uses no adapter"):
        prepare("t2va-base4-exact-cpu", tiny_transformer, tmp_path / "r2.json", adapter=tmp_path / "x.safetensors")


def test_outputs_of_different_compiles_do_not_mix(tmp_path, tiny_transformer, tiny_compiled):
    other = compile_tiny(tmp_path, tiny_transformer, "t2va-base4-exact-cpu")
    with pytest.raises(IdentityMismatchError, match="different compiles"):
        CompiledArtifact(tiny_compiled["artifact"], other["schedule_overlay"], tiny_compiled["auxiliary"])


def test_changed_artifact_file_size_is_refused(tmp_path, tiny_compiled):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_compiled["artifact"].parent, copy)
    with open(copy / "artifact" / "block_001.safetensors", "ab") as handle:
        handle.write(b"x")
    with pytest.raises(WeightFileError, match="were recorded"):
        CompiledArtifact(copy / "artifact", copy / "schedule", copy / "auxiliary.safetensors")


def test_mode_not_in_profile_is_refused(tmp_path, tiny_transformer):
    """A t2va-only profile is compiled without keyframe tables and refuses keyframe requests before running."""
    profile = cpu_profile(id="t2va-only-cpu", modes=("t2va",))
    assert profile.timestep_kinds() == [(False, False)]
    paths = compile_tiny(tmp_path, tiny_transformer, profile)
    from bundles import keyframe_bundle

    with NativeEngineSession(profile, CompiledPaths(**paths)) as session:
        with pytest.raises(VflashError, match="accepts t2va; a l2va request"):
            session.generate(keyframe_bundle())
        assert not session.closed  # bad input does not fail the session


def test_pipeline_verify_weights_refuses_a_corrupt_compile_before_loading(tmp_path, h3_family):
    from conftest import prepare_family

    from vflash_core.pipeline.h3_pipeline import H3Pipeline
    from vflash_core.pipeline.options import RunOptions

    receipt = prepare_family(tmp_path, h3_family, "t2va-base4-exact-cpu", "transformer")
    block = tmp_path / "compiled" / "artifact" / "block_000.safetensors"
    data = bytearray(block.read_bytes())
    data[-1] ^= 0x01
    block.write_bytes(bytes(data))
    with (
        H3Pipeline.from_prepared(receipt, RunOptions(verify_weights=True)) as pipeline,
        pytest.raises(WeightFileError, match="block_000.safetensors"),
    ):
        pipeline.load()
