"""`vflash demo`: builds the embedded family once (atomically), then produces a playable MP4 with a soundtrack."""

from __future__ import annotations

import time

import pytest
from mp4_probe import probe_mp4

from vflash_core.cli.main import main
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


def test_demo_latent_rgb_factors_are_the_demo_vaes_colours(demo_receipt):
    """The demo's live-preview colours (its latents are not core's 24-channel format) predict the mean colour the
    demo video VAE decodes for each latent pixel, on latents other than those they were fitted on: a changed demo VAE
    fails here until they are fitted again (as the comment above `DEMO_LATENT_RGB_FACTORS` says)."""
    import torch

    from vflash_core.media.vae import MediaVAEs
    from vflash_core.pipeline.h3_pipeline import PreparedAssets

    vaes = MediaVAEs.from_pretrained(PreparedAssets.load(demo_receipt).decoder_root)
    factors, bias = torch.tensor(demo.DEMO_LATENT_RGB_FACTORS), torch.tensor(demo.DEMO_LATENT_RGB_BIAS)
    assert factors.shape == (vaes.latent_channels, 3)
    generator = torch.Generator().manual_seed(1)
    latents, colours = [], []
    for _ in range(2):
        # One latent per pixel held over the clip, so each latent pixel's colour is the mean of its 16x16 block.
        z = torch.randn(1, 8, 1, 8, 8, generator=generator).expand(1, 8, 7, 8, 8).contiguous()
        frames = vaes.decode_video(z)  # (F, 128, 128, 3) in [0, 1]
        colours.append((frames.mean(0).reshape(8, 16, 8, 16, 3).mean((1, 3)) * 2 - 1).reshape(-1, 3))
        latents.append(z[0, :, 0].permute(1, 2, 0).reshape(-1, 8))
    want, got = torch.cat(colours), torch.cat(latents) @ factors + bias
    explained = 1 - ((want - got) ** 2).sum(0) / ((want - want.mean(0)) ** 2).sum(0)
    assert (explained > 0.3).all(), explained
    assert (want - got).abs().mean() < 0.02
