"""The fixed-schedule denoising loop over compiled weights: one request, NFE evaluations, read top to bottom.

Per request, once: layout to the device, rotary cos/sin, the text stream, and each step's row-timestep plan with the
matching overlay tables. Per evaluation: project and pack the latent rows, run the blocks with the step's AdaLN rows,
apply the output heads, then take the Euler step on the generated rows only (conditioning rows keep their initial
values, as in the reference loop). Video and audio step in lockstep on their own schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import model as M
from .artifact import CompiledArtifact, StepTables
from .bundle import ConditioningBundle
from .layout import audio_rows_to_latents, unpatchify
from .schedule import euler_step, row_timestep_plan

# progress(evaluation_index_done, total_evaluations)
ProgressFn = Callable[[int, int], None]


class BlockSource:
    """Yields the main blocks' weights on the compute device, in order, once per evaluation."""

    def __iter__(self) -> Iterator[M.LayerWeights]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the device (and host) memory the source owns."""


class ResidentBlocks(BlockSource):
    """Every block's weights live on the device for the whole session."""

    def __init__(self, artifact: CompiledArtifact, device: torch.device, on_block: Callable[[int], None] | None = None):
        self.blocks: list[M.LayerWeights] = []
        for i in range(artifact.config.num_layers):
            w = artifact.read_block(i)
            self.blocks.append(
                M.LayerWeights({k: v.to(device) for k, v in w.tensors.items()}, {k: tuple(r.to(device) for r in rs) for k, rs in w.loras.items()})
            )
            if on_block is not None:
                on_block(i)

    def __iter__(self) -> Iterator[M.LayerWeights]:
        return iter(self.blocks)

    def close(self) -> None:
        self.blocks = []


@dataclass
class StepPlan:
    """Device tensors one evaluation needs beyond the latents."""

    timestep_indices: torch.Tensor  # (S,) int64 index into tables.timesteps
    adaln_indices: torch.Tensor  # (S,) int64 row of each block's AdaLN table
    tables: StepTables  # on the device


@dataclass
class RequestState:
    layout: dict[str, torch.Tensor]
    rotary: tuple[torch.Tensor, torch.Tensor]
    text: torch.Tensor
    plans: list[StepPlan]
    video_rows: torch.Tensor
    audio_rows: torch.Tensor


@dataclass
class DenoiseOutput:
    """video_latents: (1, C, F, h, w) fp32; audio_latents: (2, C_audio, A) fp32 (one item per stereo channel)."""

    video_latents: torch.Tensor
    audio_latents: torch.Tensor


class Denoiser:
    """Runs whole trajectories on one device with the reference (PyTorch) math."""

    def __init__(self, artifact: CompiledArtifact, blocks: BlockSource, device: torch.device, attention: M.AttentionFn):
        self.artifact = artifact
        self.config = artifact.config
        self.device = device
        self.attention = attention
        self.blocks = blocks
        aux, refiner, aux_loras = artifact.read_auxiliary()
        self.aux = {k: v.to(device) for k, v in aux.items()}
        self.refiner = [M.LayerWeights({k: v.to(device) for k, v in w.tensors.items()}, {k: tuple(r.to(device) for r in rs) for k, rs in w.loras.items()}) for w in refiner]
        self.aux_loras = {k: tuple(r.to(device) for r in rs) for k, rs in aux_loras.items()}
        self.inv_freq = M.rope_inv_freq(self.config)
        overlay = artifact.overlay
        self.video_sigmas = overlay.video_sigmas.to(device)
        self.audio_sigmas = overlay.audio_sigmas.to(device)
        self.video_timesteps = (1.0 - overlay.video_sigmas[:-1]).to(device)
        self.audio_timesteps = (1.0 - overlay.audio_sigmas[:-1]).to(device)

    @property
    def nfe(self) -> int:
        return self.artifact.overlay.nfe

    @torch.no_grad()
    def prepare(self, bundle: ConditioningBundle) -> RequestState:
        """Everything that depends only on the request: layout, rotary, text stream, per-step tables."""
        dev = self.device
        lay = bundle.layout
        layout = {k: v.to(dev) for k, v in lay.tensors().items()}
        block_dtype = self.aux["refiner.final_norm.weight"].dtype
        cos, sin = M.rope_cos_sin(lay.position_ids.to(dev), self.inv_freq.to(dev))
        rotary = (cos.to(block_dtype)[None, :, None, :], sin.to(block_dtype)[None, :, None, :])
        text = M.text_stream(bundle.prompt_embeds[None].to(dev), self.aux, self.refiner, self.config, self.attention, self.aux_loras)
        plans = []
        overlay = self.artifact.overlay
        for step, (t_v, t_a) in enumerate(zip(self.video_timesteps.tolist(), self.audio_timesteps.tolist())):
            timesteps, indices = row_timestep_plan(
                lay.sequence_length, lay.video_indices, lay.audio_indices, lay.num_condition_video_rows, lay.num_condition_audio_rows, t_v, t_a
            )
            variant = overlay.find(step, timesteps)
            tables = overlay.read_step(step, variant)
            tables = StepTables(tables.timesteps.to(dev), [t.to(dev) for t in tables.blocks], tables.norm_out.to(dev))
            indices = indices.to(dev)
            adaln = M.adaln_indices(indices, layout["token_tags"])
            plans.append(StepPlan(indices, adaln, tables))
        return RequestState(layout, rotary, text, plans, bundle.video_rows.to(dev, torch.float32).clone(), bundle.audio_rows.to(dev, torch.float32).clone())

    @torch.no_grad()
    def evaluate(self, state: RequestState, step: int, between_blocks: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One model evaluation: (Nv, P) and (Na, C) fp32 velocities in the row order of the index tensors."""
        plan = state.plans[step]
        x = M.pack_inputs(state.video_rows, state.audio_rows, state.text, self.aux, state.layout, self.aux_loras)
        for w, table in zip(self.blocks, plan.tables.blocks):
            x = M.main_block(x, w, M.Modulation.gather(table, plan.adaln_indices), self.config, self.attention, state.rotary)
            if between_blocks is not None:
                between_blocks()
        return M.output_heads(x, plan.tables.norm_out, plan.timestep_indices, self.aux, state.layout, self.config, self.aux_loras)

    @torch.no_grad()
    def update(self, state: RequestState, step: int, velocity: torch.Tensor, audio_velocity: torch.Tensor, num_cond_video: int, num_cond_audio: int) -> None:
        """Euler step of the generated rows; conditioning rows are never written."""
        state.video_rows[num_cond_video:] = euler_step(
            velocity[num_cond_video:].float(), self.video_timesteps[step], state.video_rows[num_cond_video:], self.video_sigmas[step], self.video_sigmas[step + 1]
        )
        state.audio_rows[num_cond_audio:] = euler_step(
            audio_velocity[num_cond_audio:].float(), self.audio_timesteps[step], state.audio_rows[num_cond_audio:], self.audio_sigmas[step], self.audio_sigmas[step + 1]
        )

    def run(self, bundle: ConditioningBundle, progress: ProgressFn | None = None, between_blocks: Callable[[], None] | None = None) -> DenoiseOutput:
        """The whole trajectory; `progress` is called after every evaluation (it may raise to abort)."""
        state = self.prepare(bundle)
        lay, geo = bundle.layout, bundle.geometry
        for step in range(self.nfe):
            velocity, audio_velocity = self.evaluate(state, step, between_blocks)
            self.update(state, step, velocity, audio_velocity, lay.num_condition_video_rows, lay.num_condition_audio_rows)
            if progress is not None:
                progress(step + 1, self.nfe)
        cfg = self.config
        video = unpatchify(state.video_rows[lay.num_condition_video_rows :], cfg.in_channels, geo.num_latent_frames, geo.latent_height, geo.latent_width, cfg.patch_size)
        audio = audio_rows_to_latents(state.audio_rows[lay.num_condition_audio_rows :], geo.num_audio_latents)
        return DenoiseOutput(video.cpu(), audio.cpu())

    def close(self) -> None:
        self.blocks.close()
        self.aux, self.refiner, self.aux_loras = {}, [], {}
