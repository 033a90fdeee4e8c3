"""Flow-matching schedules of MiniMax-H3, bit-identical to diffusers' `MiniMaxH3Scheduler`.

Conventions: `t = 1 - sigma` in [0, 1] with t = 1 clean; `num_inference_steps` counts sigma
grid points including the terminal 0, so NFE evaluations need NFE + 1 points; the model predicts a data-ward velocity
(`x0 = x + (1 - t) * v`, with `1 - t` recomputed from the fp32 timestep); the update is the blend
`r * x + (1 - r) * x0` with `r = sigma_next / sigma` from the grid. Video and audio use two shifts (12 and 3 in the
release) stepped in lockstep.

Per step, the rows of the packed sequence sit at a handful of distinct timesteps: target video (text rows share it),
target audio, visual conditioning held at `max(t_video, 0.999)`, reference audio held clean at 1.0. The transformer
receives the sorted distinct values and a per-row index into them (`row_timestep_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "KEYFRAME_NOISE_AUG", "FixedSchedule", "distinct_timesteps", "euler_step", "flow_denoised", "flow_sigmas",
    "row_timestep_plan", "scale_noise",
]

# The t a visual conditioning anchor (keyframe or reference image/video) is held at for the whole trajectory.
KEYFRAME_NOISE_AUG = 0.999
# Reference soundtracks condition clean.
REFERENCE_AUDIO_TIMESTEP = 1.0


def flow_sigmas(num_grid_points: int, shift: float) -> torch.Tensor:
    """The shifted sigma grid, fp32 on the CPU, terminal 0 included; the exact op sequence of the reference."""
    if num_grid_points < 2:
        raise ValueError(f"a schedule needs at least 2 grid points, got {num_grid_points}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    base = torch.linspace(1.0, 0.0, int(num_grid_points), dtype=torch.float32)
    sigmas = float(shift) * base / (1 + (float(shift) - 1) * base)
    return torch.unique_consecutive(sigmas)


@dataclass(frozen=True)
class FixedSchedule:
    """The two lockstep schedules of one profile: `nfe` evaluations at the given video/audio shifts."""

    nfe: int
    video_shift: float
    audio_shift: float

    def __post_init__(self) -> None:
        if len(self.video_sigmas) != len(self.audio_sigmas) or len(self.video_sigmas) != self.nfe + 1:
            raise ValueError(
                f"shifts {self.video_shift}/{self.audio_shift} collapse grid points at NFE {self.nfe}; "
                "the video and audio schedules must both have NFE + 1 distinct sigmas"
            )

    @property
    def video_sigmas(self) -> torch.Tensor:
        return flow_sigmas(self.nfe + 1, self.video_shift)

    @property
    def audio_sigmas(self) -> torch.Tensor:
        return flow_sigmas(self.nfe + 1, self.audio_shift)

    @property
    def video_timesteps(self) -> torch.Tensor:
        return 1.0 - self.video_sigmas[:-1]

    @property
    def audio_timesteps(self) -> torch.Tensor:
        return 1.0 - self.audio_sigmas[:-1]

    def to_dict(self) -> dict[str, float | int]:
        return {"nfe": self.nfe, "video_shift": self.video_shift, "audio_shift": self.audio_shift}


def flow_denoised(velocity: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """The evaluation's prediction of the clean sample (x0), as `MiniMaxH3Scheduler.step` forms it before stepping."""
    return sample + (1 - timestep) * velocity


def euler_step(
    velocity: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """One `MiniMaxH3Scheduler.step` in fp32: `timestep`, `sigma`, `sigma_next` are 0-d fp32 tensors on the device."""
    denoised = flow_denoised(velocity, timestep, sample)
    ratio = sigma_next / sigma
    return ratio * sample + (1.0 - ratio) * denoised


def scale_noise(sample: torch.Tensor, timestep: float, noise: torch.Tensor) -> torch.Tensor:
    """Rectified-flow forward process `t * x0 + (1 - t) * noise`, with t held as an fp32 tensor."""
    t = torch.tensor(timestep, dtype=sample.dtype, device=sample.device)
    return t * sample + (1.0 - t) * noise


def row_timestep_plan(
    sequence_length: int,
    video_indices: torch.Tensor,
    audio_indices: torch.Tensor,
    num_condition_video_rows: int,
    num_condition_audio_rows: int,
    video_timestep: float,
    audio_timestep: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row timesteps reduced to (sorted distinct fp32 values, int64 index of every row), as diffusers does."""
    row_t = torch.full((sequence_length,), video_timestep, dtype=torch.float32)
    row_t[video_indices[:num_condition_video_rows]] = max(video_timestep, KEYFRAME_NOISE_AUG)
    row_t[audio_indices[num_condition_audio_rows:]] = audio_timestep
    row_t[audio_indices[:num_condition_audio_rows]] = REFERENCE_AUDIO_TIMESTEP
    return torch.unique(row_t, sorted=True, return_inverse=True)


def distinct_timesteps(
    video_timestep: float, audio_timestep: float, conditioned_video: bool, reference_audio: bool
) -> torch.Tensor:
    """The sorted distinct fp32 timestep vector of one step for a request of the given kind."""
    values = [video_timestep, audio_timestep]
    if conditioned_video:
        values.append(max(video_timestep, KEYFRAME_NOISE_AUG))
    if reference_audio:
        values.append(REFERENCE_AUDIO_TIMESTEP)
    return torch.unique(torch.tensor(values, dtype=torch.float32), sorted=True)
