"""The callbacks every stage of Vflash reports through: progress within a stage, progress across stages, live previews.

The compiler, the denoising loop, the session and the pipeline all take them, and the front ends pass them in; they
are plain callables, so a front end needs nothing from Vflash to write one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["PreviewFn", "ProgressFn", "StageProgress"]

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
