"""The request validator of the HTTP process, run before a job is queued.

It runs the pipeline's own validator (`validation.plan_request`: canvas, duration, mode, counts, labels, prompt
length, input files) against the profile, canvas rules and prompt budget of the served receipt. It holds no pipeline
and checks no device: the worker does that, and this process never initialises CUDA.
"""

from __future__ import annotations

from typing import Any

from .config import ServiceConfig

__all__ = ["RequestValidator"]


class RequestValidator:
    def __init__(self, config: ServiceConfig):
        from ..pipeline.assets import PreparedAssets
        from ..pipeline.validation import PromptBudget

        assets = PreparedAssets.load(config.prepared_assets)
        self._profile, self._canvas = assets.profile, assets.canvas
        self._prompt_budget = PromptBudget.from_model_root(assets.model_root)

    def __call__(self, fields: dict[str, Any]) -> Any:
        """A validated `VideoRequest` from its keyword arguments; raises `VflashError` with the reason."""
        from ..pipeline.validation import VideoRequest, plan_request

        request = VideoRequest(**fields)
        plan_request(request, self._profile, self._canvas, self._prompt_budget)
        return request
