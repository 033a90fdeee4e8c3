"""Session lifecycle (closed, failed, aborted, timing fields) and the `vflash denoise` / compiler command lines."""

from __future__ import annotations

import pytest
from bundles import keyframe_bundle
from conftest import TINY, assert_bitwise
from safetensors.torch import load_file

from vflash_core import BundleHandoff, NativeEngineSession
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.errors import BundleError, SessionClosedError, VflashError
from vflash_core.weights.compiler import main as compiler_main

PROFILE = "t2va-base4-exact-cpu"


class Abort(BaseException):
    """Like ComfyUI's InterruptProcessingException: a BaseException raised from a progress callback."""


def test_timing_fields_and_progress(tiny_compiled):
    calls = []
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        first = session.generate(keyframe_bundle(1), progress=lambda done, total: calls.append((done, total)))
        second = session.generate(BundleHandoff(keyframe_bundle(1)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert first.timing.request_index == 1 and second.timing.request_index == 2
    assert first.timing.initialization_charged_seconds == first.timing.initialization_seconds > 0
    assert second.timing.initialization_charged_seconds == 0.0 and second.timing.request_wall_seconds > 0
    assert_bitwise(first.video_latents, second.video_latents, "same bundle, same session")
    assert first.metadata["attention_backend"] == "torch-sdpa" and first.metadata["weight_residency"] == "resident"


def test_closed_session_refuses_calls(tiny_compiled):
    session = NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled))
    session.close()
    session.close()  # idempotent
    with pytest.raises(SessionClosedError, match="closed"):
        session.generate(keyframe_bundle())


def test_abort_from_callback_leaves_session_usable(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        def stop_at_two(done, total):
            if done == 2:
                raise Abort()

        with pytest.raises(Abort):
            session.generate(keyframe_bundle(3), progress=stop_at_two)
        blocks_seen = []

        def stop_between_blocks():
            blocks_seen.append(1)
            if len(blocks_seen) == 3:
                raise Abort()

        with pytest.raises(Abort):
            session.generate(keyframe_bundle(3), between_blocks=stop_between_blocks)
        assert len(blocks_seen) == 3
        after = session.generate(keyframe_bundle(3))
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as fresh:
        assert_bitwise(after.video_latents, fresh.generate(keyframe_bundle(3)).video_latents, "after an abort")


def test_failed_trajectory_fails_the_session(tiny_compiled, monkeypatch):
    session = NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled))
    from vflash_core.engine import model

    def broken(*args, **kwargs):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(model, "feed_forward", broken)
    with pytest.raises(RuntimeError, match="injected"):
        session.generate(keyframe_bundle())
    monkeypatch.undo()
    with pytest.raises(SessionClosedError, match="failed earlier .*injected device fault"):
        session.generate(keyframe_bundle())
    session.close()


def test_bad_input_does_not_fail_the_session(tiny_compiled):
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        handoff = BundleHandoff(keyframe_bundle())
        session.generate(handoff)
        with pytest.raises(BundleError, match="already consumed"):
            session.generate(handoff)
        session.generate(keyframe_bundle())


@pytest.fixture
def vflash(capsys, caplog):
    """`vflash ARGS...` in this process (the command line's `main`; the installed command in a process of its own is
    test_user_errors.py's): its exit status and what it wrote to stderr, log records included (the command logs to
    stderr at INFO; here pytest holds them)."""
    import logging

    from vflash_core.cli.main import main

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse's refusals (usage on stderr, exit 2)
                status = exc.code
        logged = "".join(f"{record.getMessage()}\n" for record in caplog.records)
        return status, logged + capsys.readouterr().err

    return run


def test_cli_denoise_writes_latents_and_refuses_overwrite(tmp_path, tiny_compiled, vflash):
    keyframe_bundle(5).save(tmp_path / "bundle")
    out = tmp_path / "latents.safetensors"
    args = [
        "denoise", PROFILE, "--artifact", str(tiny_compiled["artifact"]), "--schedule-overlay", str(tiny_compiled["schedule_overlay"]),
        "--auxiliary-tensor", str(tiny_compiled["auxiliary"]), "--bundle", str(tmp_path / "bundle"), "--output-latents", str(out),
    ]
    status, stderr = vflash(*args)
    assert status == 0, stderr
    latents = load_file(str(out))
    with NativeEngineSession(PROFILE, CompiledPaths(**tiny_compiled)) as session:
        expected = session.generate(keyframe_bundle(5))
    assert_bitwise(latents["video_latents"], expected.video_latents, "cli video latents")
    assert_bitwise(latents["audio_latents"], expected.audio_latents, "cli audio latents")
    before = out.read_bytes()
    status, stderr = vflash(*args)
    assert status == 2 and stderr.strip().count("\n") == 0 and "already exists" in stderr
    assert "Traceback" not in stderr and out.read_bytes() == before


def test_cli_bad_inputs_are_one_line_errors(tmp_path, tiny_compiled, vflash):
    out = tmp_path / "latents.safetensors"
    common = ["--artifact", str(tiny_compiled["artifact"]), "--schedule-overlay", str(tiny_compiled["schedule_overlay"]), "--auxiliary-tensor", str(tiny_compiled["auxiliary"]), "--output-latents", str(out)]
    status, stderr = vflash("denoise", PROFILE, "--bundle", str(tmp_path / "nope"), *common)
    assert status == 2 and "not a conditioning bundle" in stderr and "Traceback" not in stderr
    keyframe_bundle().save(tmp_path / "b")
    status, stderr = vflash("denoise", "t2va-base16-exact-cpu", "--bundle", str(tmp_path / "b"), *common)
    assert status == 2 and "nfe" in stderr and "Traceback" not in stderr
    status, stderr = vflash("denoise", "no-such-profile", "--bundle", str(tmp_path / "b"), *common)
    assert status == 2 and "unknown profile" in stderr
    assert not out.exists()


def test_compiler_cli_prepares_compiles_and_refuses_a_missing_receipt(tmp_path, tiny_transformer, capsys):
    assert compiler_main(["prepare", "--profile", PROFILE, "--transformer", str(tiny_transformer), "--receipt", str(tmp_path / "r.json")]) == 0
    assert compiler_main(["compile", "--receipt", str(tmp_path / "r.json"), "--output", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "artifact" / "block_000.safetensors").is_file()
    assert compiler_main(["compile", "--receipt", str(tmp_path / "missing.json"), "--output", str(tmp_path / "d")]) == 2
    assert "no such receipt" in capsys.readouterr().err
    assert TINY.num_layers == len(list((tmp_path / "c" / "artifact").glob("block_*.safetensors")))


def test_compiler_cli_refuses_a_missing_gpu_before_reading_and_stops_cleanly(tmp_path, tiny_transformer, capsys, monkeypatch):
    """User errors of the compiler command are one line with exit 2, checked before any weight is read; Ctrl-C is one
    line with exit 130 and publishes nothing."""
    import torch

    from vflash_core.weights import compiler

    assert compiler_main(["prepare", "--profile", PROFILE, "--transformer", str(tiny_transformer), "--receipt", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    if not torch.cuda.is_available():
        hashed = []
        monkeypatch.setattr(compiler, "verify_receipt_files", lambda *args: hashed.append(args))
        assert compiler_main(["compile", "--receipt", str(tmp_path / "r.json"), "--output", str(tmp_path / "c"), "--gpu", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "CUDA is not available" in err and "Traceback" not in err
        assert not hashed and not (tmp_path / "c").exists()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compiler, "write_compiled", interrupt)
    assert compiler_main(["compile", "--receipt", str(tmp_path / "r.json"), "--output", str(tmp_path / "c")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing was published" in err
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.*"))


def test_attention_auto_fallback_is_logged_once_per_device(monkeypatch, caplog):
    """"auto" on an SM90 GPU without FlashAttention-3 falls back to cuDNN and says so once per device, although the
    options check, the session and every rank resolve it again (the GPU is simulated: capability and probe patched)."""
    import logging

    import torch

    from vflash_core.engine import attention

    def no_fa3() -> None:
        raise VflashError("fa3-fwd is not installed")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention, "_fa3", no_fa3)
    monkeypatch.setattr(attention, "_probe", lambda name, fn, device: None)
    monkeypatch.setattr(attention, "_FALLBACK_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        chosen = [attention.resolve_attention("auto", torch.device(d))[0] for d in ("cuda:0", "cuda:0", "cuda:1", "cuda:0")]
    assert chosen == ["torch-cudnn"] * 4
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and messages[0].startswith("attention auto on cuda:0: FlashAttention-3 unavailable")
    assert messages[1].startswith("attention auto on cuda:1: FlashAttention-3 unavailable") and "fa3-fwd is not installed" in messages[1]


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["--help"], 0), (["no-such-command"], 2), (["-v"], 2),
        # every command's parser (its --help) and one refused option of each
        (["denoise", "--help"], 0), (["denoise", "p", "--max-device-memory", "0"], 2),
        (["prepare-pipeline", "--help"], 0), (["prepare-pipeline", "--profile"], 2),
        (["generate", "--help"], 0), (["generate", "--duration", "abc"], 2), (["generate", "--gpu", "x"], 2),
        (["demo", "--help"], 0), (["demo", "--cache-dir"], 2),
        (["compare", "--help"], 0), (["compare", "--media-video-crf", "52"], 2),
        (["serve", "--help"], 0), (["serve", "--port", "-1"], 2),
        (["run-workflow", "--help"], 0), (["run-workflow", "--no-such-option"], 2),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else f"exit {value}",
)
def test_help_and_a_refused_command_import_neither_torch_nor_the_pipeline(argv, status):
    """`vflash --help` and every one-line refusal imported torch before parsing (2 s idle, 11-13 s on a busy machine):
    the package root imported the pipeline, and every command's parser was built from the pipeline's modules. A
    command's own --help and a refused option of it still did (3-6 s busy), through the names and ranges of its
    options (the run options', the session's, the attention backends', the MP4 encoder's, the request's numbers)."""
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys\n"
        "from vflash_core.cli.main import main\n"
        "try:\n"
        f"    status = main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    status = exit.code\n"
        "heavy = ('torch', 'numpy', 'PIL', 'aiohttp', 'vflash_core.pipeline.h3_pipeline')\n"
        "print(json.dumps([status, sorted(m for m in heavy if m in sys.modules)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [status, []], done.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_take_every_strategy_denoise_takes(command):
    """`generate` and `serve` offered only `--strategy sequence-head`, where `denoise` (and RunOptions) take tensor too."""
    import argparse

    from vflash_core.cli.main import build_parser

    def strategies(name: str) -> tuple[str, ...]:
        sub = next(a for a in build_parser(name)._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        return tuple(next(a for a in sub._actions if a.dest == "strategy").choices)

    assert strategies(command) == strategies("denoise") == ("sequence-head", "tensor")
