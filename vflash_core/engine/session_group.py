"""One request's trajectory over a session's group of devices: every rank runs its rows (sequence-head) or its shard
(tensor) in its own thread, the caller's callbacks are relayed from rank 0, and the ranks stop together at an
evaluation boundary when asked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..progress import PreviewFn, ProgressFn
from .bundle import ConditioningBundle
from .denoise import DenoiseOutput, Denoiser
from .parallel import LocalGroup, SequenceHeadAttention, split_rows
from .profiler import StageTimer

__all__ = ["run_group"]


def run_group(
    group: LocalGroup, denoisers: Sequence[Denoiser], strategy: str | None, bundle: ConditioningBundle,
    timers: list[StageTimer], progress: ProgressFn | None, between_blocks: Callable[[], None] | None,
    preview: PreviewFn | None,
) -> DenoiseOutput:
    """Every rank runs the trajectory on its rows; ranks stop together at an evaluation boundary when asked. For a
    preview, rank 0 gathers every rank's x0 rows onto its device between the boundary's two barriers."""
    ranks = len(denoisers)
    total = bundle.layout.sequence_length
    if strategy == "sequence-head":
        rows = split_rows(total, ranks)
        for den in denoisers:
            attention = den.ops.attention
            assert isinstance(attention, SequenceHeadAttention)  # what the session gives each rank with this strategy
            attention.assign_rows(rows)
    else:  # tensor: every rank holds every row
        rows = [(0, total)] * ranks
    stop: list[BaseException] = []
    denoised: list[torch.Tensor | None] = [None] * ranks

    def relay(callback: Callable[..., None] | None, *args: object) -> None:
        """Rank 0 calls the caller's callbacks; a request to stop is remembered and acted on at the boundary."""
        if callback is not None and not stop:
            try:
                callback(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller at the evaluation boundary
                stop.append(exc)

    def poll() -> None:  # between blocks, on rank 0
        relay(between_blocks)

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        den = denoisers[rank]
        state = den.start_request(bundle, rows[rank])
        nfe = den.nfe
        for step in range(nfe):
            denoised[rank] = den.step(
                state, step, bundle, timers[rank], poll if rank == 0 else None, denoised=preview is not None
            )
            if progress is not None or between_blocks is not None or preview is not None:
                if den.device.type == "cuda":
                    torch.cuda.current_stream(den.device).synchronize()
                group.barrier.wait()
                if rank == 0:
                    if preview is not None:
                        # tensor: every rank holds every row; sequence-head: the ranks' rows in order are all rows
                        parts = denoised[:1] if strategy == "tensor" else denoised
                        gathered = torch.cat([part.to(den.device) for part in parts])  # type: ignore[union-attr]
                        relay(preview, step + 1, nfe, den.video_latents(bundle, gathered))
                    relay(progress, step + 1, nfe)
                group.barrier.wait()
                if stop:
                    return None
        return state.video_rows.cpu(), state.audio_rows.cpu()

    results = group.run(rank_main)
    if stop:
        raise stop[0]
    if strategy == "tensor":
        results = results[:1]  # identical on every rank
    video, audio = (torch.cat([r[i] for r in results]) for i in (0, 1))  # type: ignore[index]
    return denoisers[0].finish(bundle, video, audio)
