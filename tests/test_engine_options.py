"""`EngineOptions` travels whole: a knob added to the options module alone reaches the session from a command-line flag
(`vflash denoise`, `vflash generate`'s run options) and from the model loader node's widget values, unchanged; and the
options are checked once, one line per bad value."""

from __future__ import annotations

import dataclasses

import pytest
from bundles import keyframe_bundle

from vflash_core.engine import session as session_module
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.errors import VflashError
from vflash_core.pipeline.options import RunOptions

PROFILE = "t2va-base4-exact-cpu"


@pytest.fixture
def knob(monkeypatch):
    """A new engine knob, `knob: int = 0` with its flag `--knob`, added to `EngineOptions` in place, as an edit of the
    options module would add it: its generated methods and fields become those of the class with the field, and its
    flags gain one. Nothing else is patched; the original class comes back after the test."""
    extended = dataclasses.make_dataclass("EngineOptions", [("knob", int, 0)], bases=(EngineOptions,), frozen=True)
    for name in ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__", "__dataclass_fields__"):
        monkeypatch.setattr(EngineOptions, name, extended.__dict__[name])
    monkeypatch.setattr(EngineOptions, "knob", 0, raising=False)
    add_flags = EngineOptions.add_arguments

    def add_arguments(parser):
        add_flags(parser)
        parser.add_argument("--knob", type=int, default=0)

    monkeypatch.setattr(EngineOptions, "add_arguments", staticmethod(add_arguments))
    assert EngineOptions(knob=7).knob == 7 and EngineOptions().knob == 0
    return 7


@pytest.fixture
def received(monkeypatch):
    """The options every `NativeEngineSession` built during the test received (the real session still loads)."""
    seen: list[EngineOptions] = []
    real_init = session_module.NativeEngineSession.__init__

    def spy(self, profile, paths, options=None, plan=None, hooks=None):
        seen.append(options)
        real_init(self, profile, paths, options, plan, hooks)

    monkeypatch.setattr(session_module.NativeEngineSession, "__init__", spy)
    return seen


def test_a_knob_reaches_the_session_from_vflash_denoise(knob, received, tmp_path, tiny_compiled):
    from vflash_core.cli.main import main

    keyframe_bundle(5).save(tmp_path / "bundle")
    status = main([
        "denoise", PROFILE, "--artifact", str(tiny_compiled["artifact"]),
        "--schedule-overlay", str(tiny_compiled["schedule_overlay"]), "--auxiliary-tensor", str(tiny_compiled["auxiliary"]),
        "--bundle", str(tmp_path / "bundle"), "--output-latents", str(tmp_path / "latents.safetensors"),
        "--knob", str(knob), "--execution", "reference",
    ])
    assert status == 0
    [options] = received
    assert type(options) is EngineOptions and options.knob == knob and options.execution == "reference"


def test_a_knob_reaches_the_run_options_from_vflash_generate_and_the_pipeline_hands_them_whole(knob, monkeypatch):
    """`vflash generate`'s parser to `RunOptions`, which holds the engine's options as parsed; the pipeline hands
    `options.engine` itself to its session (read from its loader's source: loading it needs the encoders)."""
    import argparse
    import inspect

    from vflash_core.pipeline import assets

    parser = argparse.ArgumentParser()
    RunOptions.add_arguments(parser)
    options = RunOptions.from_arguments(parser.parse_args(["--knob", str(knob), "--encoder-residency", "resident"]))
    assert options.engine.knob == knob and options.knob == knob and options.encoder_residency == "resident"
    assert dataclasses.replace(options, media_video_crf=30).engine == options.engine
    assert "options.engine, plan" in inspect.getsource(assets.PartLoader._session)


def test_a_knob_reaches_the_session_from_the_loader_nodes_widgets(pack, knob, received):
    loader = pack.nodes["VflashModelLoader"]
    widgets = dict(weight_residency="auto", device="cpu", peer_device="none", strategy="sequence-head",
                   attention_backend="auto", fast_mode="exact")
    spec = loader.execute(model="embedded-demo", profile="auto", knob=knob, **widgets).args[0]
    try:
        [options] = received
        assert type(options) is EngineOptions and options.knob == knob
        assert options is spec.options.engine  # the spec's options, not a copy rebuilt field by field
        assert pack.package.registry.ENGINES.engine("dit").options is options
    finally:
        pack.package.registry.ENGINES.release("dit")


def test_engine_options_are_checked_once_one_line_per_bad_value():
    with pytest.raises(VflashError) as refused:
        EngineOptions(weight_residency="everywhere", execution="fast", collective_timeout_seconds=0)
    assert str(refused.value).splitlines() == [
        "engine options:",
        "  weight_residency must be one of auto, resident, block-ring, disk-ring, got 'everywhere'",
        "  execution must be one of auto, fused, reference, got 'fast'",
        "  collective_timeout_seconds must be a number of seconds above 0 and at most 86,400, got 0",
    ]
    with pytest.raises(VflashError, match="^a peer GPU and a strategy go together"):
        RunOptions(strategy="tensor")
    with pytest.raises(VflashError, match="^a pipeline splits a request over two GPUs at most; got 2 peer devices$"):
        RunOptions(device=0, peer_device=[1, 2], strategy="sequence-head")
    assert EngineOptions(peer_device=["cpu"], strategy="sequence-head").peer_device == "cpu"
    assert RunOptions(EngineOptions(device=0), device=1).device == 1
