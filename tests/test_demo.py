"""`vflash demo`: builds the embedded family once (atomically), then produces a playable MP4 with a soundtrack."""

from __future__ import annotations

import time

import pytest

from vflash_core.cli.main import main
from vflash_core.media.mp4 import probe_mp4
from vflash_core.pipeline import demo


def test_demo_command_builds_once_and_writes_a_playable_clip(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert main(["demo", "--cache-dir", str(cache)]) == 0
    first_run = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "wrote demo.mp4: 124 frames 448x256 at 24 fps, t2va" in out and "build family" in out and "noise-like" in out
    for stage in ("initialization", "encode", "denoise", "decode", "write", "request total"):
        assert stage in out
    info = probe_mp4(tmp_path / "demo.mp4")
    assert (info["frames"], info["fps"], info["width"], info["height"]) == (124, 24.0, 448, 256)
    assert (info["audio_codec"], info["channels"], info["sample_rate"]) == ("aac", 2, 32000)
    assert info["audio_seconds"] == pytest.approx(124 / 24, abs=2e-3)
    assert first_run < 120

    receipt = demo.demo_receipt_path(cache)
    stamp = receipt.stat().st_mtime_ns
    assert demo.ensure_demo_assets(cache) == receipt and receipt.stat().st_mtime_ns == stamp
    # A second run reuses the family and never overwrites the first clip.
    assert main(["demo", "--cache-dir", str(cache)]) == 0
    second = capsys.readouterr().out
    assert "wrote demo-2.mp4" in second and "find family" in second
    assert probe_mp4(tmp_path / "demo-2.mp4")["frames"] == 124
    assert main(["demo", "--cache-dir", str(cache), "--output", "demo.mp4"]) == 2
    assert "demo.mp4 already exists; refusing to overwrite it (pass --overwrite, or another --output)" in capsys.readouterr().err
    assert [p.name for p in cache.iterdir()] == [receipt.parent.name]


def test_interrupted_build_leaves_no_family(tmp_path, monkeypatch):
    def fail(root, *args, **kwargs):
        (root / "transformer").mkdir(parents=True)
        raise OSError("disk full")

    monkeypatch.setattr(demo, "build_model_family", fail)
    with pytest.raises(OSError, match="disk full"):
        demo.ensure_demo_assets(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VFLASH_CACHE", str(tmp_path / "here"))
    assert demo.default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("VFLASH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.default_cache_dir() == tmp_path / "xdg" / "vflash"
