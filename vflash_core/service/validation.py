"""The CLI's request validation, run in the HTTP process before a job is queued.

It uses a lazy `H3Pipeline` opened from the same prepared-assets receipt as the worker: `validate` checks the
canvas, duration, mode, image count and `<Picture N>` labels against the profile, and the input files, without
loading a model or touching the device (the parent must never initialise CUDA; seed 001).
"""

from __future__ import annotations

from typing import Any

from .config import ServiceConfig


class RequestValidator:
    def __init__(self, config: ServiceConfig):
        from ..pipeline import H3Pipeline

        self._pipeline = H3Pipeline.from_prepared(
            config.prepared_assets, device=config.device, peer_device=config.peer_device, strategy=config.strategy,
            attention_backend=config.attention_backend, weight_residency=config.weight_residency, encoder_residency=config.encoder_residency,
            media_video_input=config.media_video_input, media_video_threads=config.media_video_threads,
        )

    def __call__(self, fields: dict[str, Any]) -> Any:
        """A validated `VideoRequest` from its keyword arguments; raises `VflashError` with the reason."""
        from ..pipeline import VideoRequest

        request = VideoRequest(**fields)
        self._pipeline.validate(request)
        return request
