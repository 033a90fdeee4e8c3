"""Schedules, packed layouts and conditioning bundles against diffusers 0.42.1, plus bundle integrity checks."""

from __future__ import annotations

import json

import pytest
import torch
from bundles import keyframe_bundle
from conftest import TINY, assert_bitwise
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep

from vflash_core import BundleHandoff, ConditioningBundle, Geometry, build_keyframe_bundle
from vflash_core.engine.config import H3Config
from vflash_core.engine.layout import (
    align_num_frames,
    align_num_frames_down,
    audio_latent_count,
    frames_for_duration,
    keyframe_layout,
    resolve_canvas_size,
    video_latent_frames,
    video_num_frames,
)
from vflash_core.errors import BundleError, RequestError
from vflash_core.schedule import FixedSchedule, euler_step, flow_sigmas, row_timestep_plan


@pytest.mark.parametrize("points", [2, 5, 9, 17, 50])
@pytest.mark.parametrize("shift", [12.0, 6.0, 3.0])
def test_sigmas_and_steps_match_scheduler(points, shift):
    reference = MiniMaxH3Scheduler(shift)
    reference.set_timesteps(points)
    assert_bitwise(flow_sigmas(points, shift), reference.sigmas, "sigmas")
    g = torch.Generator().manual_seed(points)
    sample = torch.randn(40, 96, generator=g)
    sigmas = flow_sigmas(points, shift)
    timesteps = 1.0 - sigmas[:-1]
    for i, t in enumerate(reference.timesteps):
        velocity = torch.randn(40, 96, generator=g)
        expected = reference.step(velocity, t, sample, return_dict=False)[0]
        actual = euler_step(velocity, timesteps[i], sample, sigmas[i], sigmas[i + 1])
        assert_bitwise(actual, expected, f"step {i}")
        sample = expected


def test_documented_nine_point_schedule():
    schedule = FixedSchedule(8, 12.0, 3.0)
    assert schedule.video_timesteps[1].item() == pytest.approx(0.011764705, abs=1e-9)
    assert schedule.audio_sigmas[4].item() == 0.75
    assert len(schedule.video_timesteps) == 8


def test_frame_latent_and_canvas_geometry_rules():
    assert align_num_frames(120) == 124 and align_num_frames(124) == 124 and align_num_frames(125) == 141
    assert video_latent_frames(124) == 37 and video_latent_frames(243) == 72
    assert all(video_num_frames(video_latent_frames(17 * n + 5)) == 17 * n + 5 for n in range(1, 30))
    # snapped down to a whole chunk: the VAE encodes a reference clip without padding; fewer than 22 frames give 22
    assert [align_num_frames_down(f) for f in (3, 21, 22, 38, 39, 124, 140, 360)] == [22, 22, 22, 22, 39, 124, 124, 345]
    assert audio_latent_count(124) == 207 and audio_latent_count(243) == 405 and audio_latent_count(345) == 575
    assert resolve_canvas_size(16, 9) == (768, 1344) and resolve_canvas_size(9, 16) == (1344, 768) and resolve_canvas_size(4, 3) == (768, 1024)
    assert frames_for_duration(5) == 124 and frames_for_duration(10) == 243
    with pytest.raises(RequestError, match="5-15 s"):
        frames_for_duration(15)
    with pytest.raises(RequestError, match="5-15 s"):
        frames_for_duration(4)


@pytest.mark.parametrize("anchors", [(), ("first",), ("last",), ("first", "last")])
@pytest.mark.parametrize("canvas", [(64, 96, 124), (96, 64, 243), (544, 960, 124)])
def test_layout_and_row_timesteps_match_diffusers(anchors, canvas):
    height, width, frames = canvas
    tags = torch.ones(9, dtype=torch.long)
    tags[2:5] = 0
    geo = Geometry(height, width, frames)
    ours = keyframe_layout(tags, geo, (1, 2, 2), anchors)
    ref = MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, geo.num_latent_frames, geo.latent_height, geo.latent_width, geo.num_audio_latents, (1, 2, 2), 2, 2, 0, anchors)
    for name, a, b in zip(("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"), ours.tensors().values(), ref[:5]):
        assert_bitwise(a, b, name)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == ref[5:]
    for t_v, t_a in [(0.0, 0.0), (0.011764705181121826, 0.045454561710357666), (0.6315789222717285, 0.699999988079071)]:
        mine = row_timestep_plan(ours.sequence_length, ours.video_indices, ours.audio_indices, ours.num_condition_video_rows, 0, t_v, t_a)
        theirs = MiniMaxH3SetTimestepsStep.build_row_timesteps(ref[2], ref[3], ref[5], 0, 9, t_v, t_a, max(t_v, 0.999), 1.0)
        assert_bitwise(mine[0], theirs[0], "timesteps")
        assert_bitwise(mine[1], theirs[1], "timestep indices")


def test_bundle_round_trip(tmp_path):
    bundle = keyframe_bundle()
    bundle.save(tmp_path / "b")
    loaded = ConditioningBundle.load(tmp_path / "b")
    assert loaded.fingerprint() == bundle.fingerprint()
    assert loaded.mode == "l2va" and loaded.geometry == bundle.geometry and loaded.seed == 0
    with pytest.raises(Exception, match="already exists"):
        bundle.save(tmp_path / "b")


def test_bundle_tampered_after_hashing_is_rejected(tmp_path):
    keyframe_bundle().save(tmp_path / "b")
    path = tmp_path / "b" / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="does not match the hash"):
        ConditioningBundle.load(tmp_path / "b")


def test_bundle_manifest_edit_is_rejected(tmp_path):
    keyframe_bundle().save(tmp_path / "b")
    manifest = tmp_path / "b" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["num_condition_video_rows"] = 0
    manifest.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="inconsistent"):
        ConditioningBundle.load(tmp_path / "b")


def test_bundle_for_another_layout_is_rejected():
    other = H3Config.preset("h3")
    with pytest.raises(BundleError, match="model layout"):
        keyframe_bundle().check_model(other)


def test_handoff_is_one_shot_and_detects_modification():
    handoff = BundleHandoff(keyframe_bundle())
    bundle = handoff.consume()
    assert handoff.consumed
    with pytest.raises(BundleError, match="already consumed"):
        handoff.consume()
    modified = BundleHandoff(bundle)
    bundle.video_rows[0, 0] += 1.0
    with pytest.raises(BundleError, match="modified"):
        modified.consume()


def test_noise_draw_order_matches_the_contract():
    """Condition noise first, then video noise (as a latent), then audio noise (row layout), one generator."""
    g = torch.Generator().manual_seed(9)
    cond = torch.randn(1, 24, 1, 4, 6, generator=torch.Generator().manual_seed(1))
    bundle = build_keyframe_bundle(torch.zeros(3, TINY.text_dim), torch.ones(3, dtype=torch.long), Geometry(64, 96, 124), TINY, g, (cond,), ("first",))
    g = torch.Generator().manual_seed(9)
    cond_noise = torch.randn(cond.shape, generator=g)
    video_noise = torch.randn(1, 24, 37, 4, 6, generator=g)
    audio_noise = torch.randn(2 * 207, 32, generator=g)
    t = torch.tensor(0.999)
    from vflash_core.engine.layout import patchify

    assert_bitwise(bundle.video_rows[:6], patchify(t * cond + (1.0 - t) * cond_noise, (1, 2, 2)), "condition rows")
    assert_bitwise(bundle.video_rows[6:], patchify(video_noise, (1, 2, 2)), "video noise rows")
    assert_bitwise(bundle.audio_rows, audio_noise, "audio noise rows")
