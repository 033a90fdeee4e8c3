"""The fixed-schedule denoising loop over compiled weights: one request, NFE evaluations, read top to bottom.

Per request, once: layout to the device, rotary cos/sin, the text stream, and each step's row-timestep plan with the
matching overlay tables. Per evaluation: project and pack the latent rows, run the blocks with the step's AdaLN rows,
apply the output heads, then take the Euler step on the generated rows only (conditioning rows keep their initial
values, as in the reference loop). Video and audio step in lockstep on their own schedules.

A `Denoiser` may own only a contiguous range of the packed rows (one rank of a sequence-parallel group): it then
packs, evaluates and updates just those rows; the attention function it is given exchanges what attention needs.
Every per-row operation is unchanged by the split, so a single device is simply the range [0, S).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..progress import PreviewFn, ProgressFn
from ..schedule import euler_step, flow_denoised, row_timestep_plan
from . import model as M
from .artifact import CompiledArtifact, StepTables
from .bundle import ConditioningBundle
from .config import H3Config
from .fast_mode import FastMode
from .fast_mode_run import FastModeRun
from .layout import audio_rows_to_latents, unpatchify
from .profiler import NO_TIMER, StageTimer
from .residency import BlockSource, device_loras

__all__ = ["DenoiseOutput", "Denoiser", "RequestState", "denoise_bytes"]


@dataclass
class StepPlan:
    """Device tensors one evaluation needs beyond the latents (for this denoiser's rows)."""

    timestep_indices: torch.Tensor  # (S_local,) int64 index into tables.timesteps
    adaln_indices: torch.Tensor  # (S_local,) int64 row of each block's AdaLN table
    tables: StepTables  # on the device


@dataclass
class RequestState:
    """One request on one device: local layout (positions within this denoiser's rows), text, tables and latents.

    `video_rows` / `audio_rows` hold the latent rows that fall in this denoiser's range, in the order of the
    bundle's index tensors; `video_range` / `audio_range` say which slice of the bundle's rows that is.
    """

    layout: dict[str, torch.Tensor]
    rotary: tuple[torch.Tensor, torch.Tensor]
    text: torch.Tensor
    plans: list[StepPlan]
    video_rows: torch.Tensor
    audio_rows: torch.Tensor
    video_range: tuple[int, int]
    audio_range: tuple[int, int]
    sparse_from_row: int  # the first generated video row of the whole sequence (block-sparse attention's prefix end)


@dataclass
class DenoiseOutput:
    """video_latents: (1, C, F, h, w) fp32; audio_latents: (2, C_audio, A) fp32 (one item per stereo channel)."""

    video_latents: torch.Tensor
    audio_latents: torch.Tensor


def _local(indices: torch.Tensor, start: int, stop: int) -> tuple[tuple[int, int], torch.Tensor]:
    """The slice [a, b) of an increasing index tensor that falls in rows [start, stop), and its local positions."""
    a = int(torch.searchsorted(indices, start))
    b = int(torch.searchsorted(indices, stop))
    return (a, b), indices[a:b] - start


class Denoiser:
    """Runs whole trajectories (or one rank's rows of them) on one device; `ops` are the main blocks' operations
    (`model.BlockOps`: the torch reference, or fused kernels, a sequence-head attention, a tensor-parallel shard).
    `fast`, set by the session for a named fast mode, arms its sparse attention per layer and runs its step cache."""

    def __init__(self, artifact: CompiledArtifact, blocks: BlockSource, device: torch.device, ops: M.BlockOps):
        self.artifact = artifact
        self.config = artifact.config
        self.device = device
        self.ops = ops
        # The text refiner runs whole on every device, with the reference operations and a local attention.
        self.text_ops = M.BlockOps(self.config, getattr(ops.attention, "local", ops.attention))
        self.blocks = blocks
        aux, refiner, aux_loras = artifact.read_auxiliary()
        self.aux = {k: v.to(device) for k, v in aux.items()}
        self.refiner = [M.LayerWeights({k: v.to(device) for k, v in w.tensors.items()}, device_loras(w.loras, device))
                        for w in refiner]
        self.aux_loras = device_loras(aux_loras, device)
        self.inv_freq = M.rope_inv_freq(self.config)
        overlay = artifact.overlay
        self.video_sigmas = overlay.video_sigmas.to(device)
        self.audio_sigmas = overlay.audio_sigmas.to(device)
        self.video_timesteps = (1.0 - overlay.video_sigmas[:-1]).to(device)
        self.audio_timesteps = (1.0 - overlay.audio_sigmas[:-1]).to(device)
        self.fast: FastModeRun | None = None

    @property
    def nfe(self) -> int:
        return self.artifact.overlay.nfe

    @property
    def block_dtype(self) -> torch.dtype:
        return self.aux["refiner.final_norm.weight"].dtype

    @torch.no_grad()
    def start_request(self, bundle: ConditioningBundle, rows: tuple[int, int] | None = None) -> RequestState:
        """Everything that depends only on the request, for packed rows [start, stop) (default: all)."""
        dev = self.device
        lay = bundle.layout
        start, stop = rows or (0, lay.sequence_length)
        video_range, video_pos = _local(lay.video_indices, start, stop)
        audio_range, audio_pos = _local(lay.audio_indices, start, stop)
        text_range, text_pos = _local(lay.text_indices, start, stop)
        layout = {
            "token_tags": lay.token_tags[start:stop].to(dev),
            "video_indices": video_pos.to(dev),
            "audio_indices": audio_pos.to(dev),
            "text_indices": text_pos.to(dev),
        }
        cos, sin = M.rope_cos_sin(lay.position_ids[start:stop].to(dev), self.inv_freq.to(dev))
        rotary = (cos.to(self.block_dtype)[None, :, None, :], sin.to(self.block_dtype)[None, :, None, :])
        if text_range[1] > text_range[0]:
            # The refiner attends over the whole prompt, so it runs on all of it; only this range's rows are kept.
            text = M.text_stream(
                bundle.prompt_embeds[None].to(dev), self.aux, self.refiner, self.text_ops, self.aux_loras
            )
            text = text[:, text_range[0] : text_range[1]]
        else:
            text = torch.empty(1, 0, self.config.hidden_size, dtype=self.block_dtype, device=dev)
        plans = []
        overlay = self.artifact.overlay
        for step, (t_v, t_a) in enumerate(zip(self.video_timesteps.tolist(), self.audio_timesteps.tolist())):
            timesteps, indices = row_timestep_plan(
                lay.sequence_length, lay.video_indices, lay.audio_indices, lay.num_condition_video_rows,
                lay.num_condition_audio_rows, t_v, t_a
            )
            tables = overlay.read_step(step, overlay.find(step, timesteps))
            tables = StepTables(tables.timesteps.to(dev), [t.to(dev) for t in tables.blocks], tables.norm_out.to(dev))
            indices = indices[start:stop].to(dev)
            plans.append(StepPlan(indices, M.adaln_indices(indices, layout["token_tags"]), tables))
        video_rows = bundle.video_rows[video_range[0] : video_range[1]].to(dev, torch.float32).clone()
        audio_rows = bundle.audio_rows[audio_range[0] : audio_range[1]].to(dev, torch.float32).clone()
        if self.fast is not None:
            self.fast.start_request(self.nfe, len(plans[0].tables.blocks) if plans else 0)
        sparse_from_row = int(lay.video_indices[lay.num_condition_video_rows]) if lay.video_indices.numel() > \
            lay.num_condition_video_rows else lay.sequence_length
        return RequestState(
            layout, rotary, text, plans, video_rows, audio_rows, video_range, audio_range, sparse_from_row
        )

    @torch.no_grad()
    def evaluate(
        self, state: RequestState, step: int, timer: StageTimer = NO_TIMER,
        between_blocks: Callable[[], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One model evaluation: fp32 velocities of this state's video and audio rows."""
        plan = state.plans[step]
        with timer.stage("pack_inputs"):
            x = M.pack_inputs(state.video_rows, state.audio_rows, state.text, self.aux, state.layout, self.aux_loras)
        with timer.stage("blocks"):  # the whole block loop, including any wait for streamed weights
            x = self._blocks(x, state, step, plan, timer, between_blocks)
        with timer.stage("final_layer"):
            return M.output_heads(
                x, plan.tables.norm_out, plan.timestep_indices, self.aux, state.layout, self.config, self.aux_loras
            )

    def _blocks(
        self, x: torch.Tensor, state: RequestState, step: int, plan: StepPlan, timer: StageTimer,
        between_blocks: Callable[[], None] | None,
    ) -> torch.Tensor:
        """The main blocks on the residual stream; under a fast mode, each layer's attention armed, and with the step
        cache, blocks 1..L-1 skipped when the first block's residual says so."""
        fast = self.fast
        cache = fast.step_cache if fast is not None else None
        blocks = iter(self.blocks)
        before = first = after_first = x  # each replaced before it is read (the step cache's tensors)
        try:
            for layer, (w, table) in enumerate(zip(blocks, plan.tables.blocks)):
                if fast is not None:
                    fast.arm_layer(step, layer, state.sparse_from_row)
                if cache is not None and layer == 0:
                    before = x.clone()  # the fused ops update the stream in place
                x = M.main_block(x, w, table, plan.adaln_indices, state.rotary, self.ops, timer)
                if between_blocks is not None:
                    between_blocks()
                if cache is not None and layer == 0:
                    first = x - before
                    del before
                    if cache.reuse(step, first):
                        return cache.apply(x)
                    after_first = x.clone()
        finally:
            close = getattr(blocks, "close", None)  # a ring left mid-pass releases its slot (`WeightRing`)
            if close is not None:
                close()
            if fast is not None:
                fast.end_evaluation()
        if cache is not None:
            cache.store(first, x - after_first)
        return x

    @torch.no_grad()
    def update(
        self, state: RequestState, step: int, velocity: torch.Tensor, audio_velocity: torch.Tensor, num_cond_video: int,
        num_cond_audio: int
    ) -> None:
        """Euler step of the generated rows; conditioning rows are never written."""
        cv = max(0, num_cond_video - state.video_range[0])  # local rows before this are conditioning
        ca = max(0, num_cond_audio - state.audio_range[0])
        state.video_rows[cv:] = euler_step(
            velocity[cv:].float(), self.video_timesteps[step], state.video_rows[cv:], self.video_sigmas[step],
            self.video_sigmas[step + 1]
        )
        state.audio_rows[ca:] = euler_step(
            audio_velocity[ca:].float(), self.audio_timesteps[step], state.audio_rows[ca:], self.audio_sigmas[step],
            self.audio_sigmas[step + 1]
        )

    def step(
        self, state: RequestState, step: int, bundle: ConditioningBundle, timer: StageTimer,
        between_blocks: Callable[[], None] | None = None,
        denoised: bool = False,
    ) -> torch.Tensor | None:
        """One evaluation and its Euler step; with `denoised`, returns the evaluation's x0 prediction of this state's
        video rows (all of them, conditioning rows included: `video_latents` drops those), taken before the step."""
        timer.evaluation = step
        velocity, audio_velocity = self.evaluate(state, step, timer, between_blocks)
        x0 = flow_denoised(velocity.float(), self.video_timesteps[step], state.video_rows) if denoised else None
        with timer.stage("latent_update"):
            self.update(
                state, step, velocity, audio_velocity, bundle.layout.num_condition_video_rows,
                bundle.layout.num_condition_audio_rows
            )
        return x0

    def run(
        self, bundle: ConditioningBundle, timer: StageTimer, progress: ProgressFn | None = None,
        between_blocks: Callable[[], None] | None = None,
        preview: PreviewFn | None = None,
    ) -> DenoiseOutput:
        """The whole trajectory; `progress` and `preview` are called after every evaluation (either may raise to abort).

        With either callback the host waits for each evaluation to finish before reporting it, so progress and
        cancellation track the device; without one nothing synchronises until the end.
        """
        state = self.start_request(bundle)
        for step in range(self.nfe):
            x0 = self.step(state, step, bundle, timer, between_blocks, denoised=preview is not None)
            if progress is not None or preview is not None:
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                if preview is not None:
                    assert x0 is not None  # step(..., denoised=True) returns it
                    preview(step + 1, self.nfe, self.video_latents(bundle, x0))
                if progress is not None:
                    progress(step + 1, self.nfe)
        return self.finish(bundle, state.video_rows, state.audio_rows)

    def video_latents(self, bundle: ConditioningBundle, video_rows: torch.Tensor) -> torch.Tensor:
        """All packed video rows (conditioning first, as in the bundle) -> (1, C, F, h, w) of the generated frames,
        on the rows' device."""
        lay, geo, cfg = bundle.layout, bundle.geometry, self.config
        return unpatchify(
            video_rows[lay.num_condition_video_rows :], cfg.in_channels, geo.num_latent_frames, geo.latent_height,
            geo.latent_width, cfg.patch_size
        )

    def finish(self, bundle: ConditioningBundle, video_rows: torch.Tensor, audio_rows: torch.Tensor) -> DenoiseOutput:
        """Drop conditioning rows and unpack all rows into latents on the CPU."""
        video = self.video_latents(bundle, video_rows)
        audio = audio_rows_to_latents(
            audio_rows[bundle.layout.num_condition_audio_rows :], bundle.geometry.num_audio_latents
        )
        return DenoiseOutput(video.cpu(), audio.cpu())

    def close(self) -> None:
        self.blocks.close()
        self.aux, self.refiner, self.aux_loras = {}, [], {}


# -- memory ---------------------------------------------------------------------------------------------------------


def denoise_bytes(config: H3Config, rows: int, fast_mode: FastMode | None = None) -> int:
    """Upper estimate of one evaluation's transient device memory at `rows` packed rows (bf16 blocks).

    Per row, the main block's largest live set with the reference operations (the fused ones hold less): the residual
    stream and the normalised input (2H), plus either the attention's fused QKV (3I, kept by v), q and k normalised
    (2I) and rotated (2I) and its output (I), or the FFN's [value; gate] projection (2F), SiLU (F) and product (F);
    plus 2 KiB of request state (rotary cos/sin, fp32 latent rows and velocities, each evaluation's row indices); with
    a 10 % allowance for the allocator and the attention kernel's workspace.

    A fast mode adds its own: the step cache keeps two (S, H) residuals across evaluations and two more while an
    evaluation runs; the block selection holds two fp32 (heads, blocks, blocks) score matrices.
    """
    h, i, f = config.hidden_size, config.inner_dim, config.ffn_dim
    per_row = 2 * (2 * h + max(8 * i, 4 * f)) + 2048
    extra = 0
    if fast_mode is not None and fast_mode.step_cache:
        extra += 4 * 2 * rows * h
    if fast_mode is not None and fast_mode.sparse_attention:
        blocks = -(-rows // 128)
        extra += 2 * 4 * config.num_attention_heads * blocks * blocks
    return int(rows * per_row * 1.1) + extra
