"""The callbacks every stage of Vflash reports through: progress within a stage, progress across stages, live previews.

The compiler, the denoising loop, the session and the pipeline all take them, and the front ends pass them in; they
are plain callables, so a front end needs nothing from Vflash to write one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["PREVIEW_FRAMES", "PreviewFn", "ProgressFn", "StageProgress", "preview_strip"]

# The two progress callbacks of Vflash: within one stage, progress(done, total) (the evaluations of a trajectory);
# across stages, progress(stage, done, total) (the compiler's hash / verify / compile, the pipeline's load / encode /
# denoise / decode / write). Either may raise to abandon the call.
ProgressFn = Callable[[int, int], None]
StageProgress = Callable[[str, int, int], None]
# A live preview: preview(done, total, video) after every evaluation, beside or instead of the progress callback (a
# front end that draws the image with its progress, as ComfyUI does, passes only this). `video` is that evaluation's
# prediction of the clean video latents (x0, as the scheduler forms it): (1, C, F, h, w) fp32 on the denoiser's
# device, the generated frames only; a tensor of its own, which the loop never reads again, so reading it (or even
# writing it) leaves the trajectory bitwise unchanged. It may raise to abandon the call.
PreviewFn = Callable[[int, int, torch.Tensor], None]

#: Latent frames a preview strip shows side by side: enough to show the motion, still a small image.
PREVIEW_FRAMES = 4


def preview_strip(video: torch.Tensor, frames: int = PREVIEW_FRAMES) -> torch.Tensor:
    """(1, C, F, h, w) -> (1, C, 1, h, k w): up to `frames` latent frames spread evenly over the clip (the first and
    the last included), side by side in time order, as one frame for an image previewer to draw. Views and one small
    gather on the latents' device; nothing is copied to the host."""
    count = video.shape[2]
    k = min(frames, count)
    picks = sorted({round(i * (count - 1) / max(1, k - 1)) for i in range(k)})
    side_by_side = torch.stack([video[:, :, i] for i in picks], dim=3)  # (1, C, h, k, w)
    return side_by_side.flatten(3, 4).unsqueeze(2)
