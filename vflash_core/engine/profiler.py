"""Denoise profiler: per-evaluation, per-stage device timings of one request.

Off by default and then free: the disabled timer's `stage()` is a shared no-op context. When enabled on CUDA, each
stage records a pair of CUDA events on the current stream (no synchronisation); the events are read once, after the
trajectory, in `summary()`. On the CPU, stages are timed with the host clock (CPU work is synchronous).

Stages of one evaluation: `pack_inputs`, per block `adaln_modulation` (norm1 + modulation), `qkv_projection`,
`qk_norm_rope`, `attention`, `attention_output` (output projection + gated residual), `ffn_norm_modulation`,
`ffn_input`, `swiglu`, `ffn_output` (output projection + gated residual), then `final_layer` and `latent_update`;
`blocks` spans the whole block loop (it contains the per-block stages and any wait for streamed weights, so it is not
added to them). Block-ring sources add `h2d_copy_ms` (copy-stream time, which overlaps compute and must not be added
to it).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

__all__ = ["NO_TIMER", "StageTimer"]

_NULL = contextlib.nullcontext()


class StageTimer:
    """Collects (evaluation, stage) timings; `enabled=False` makes every call a no-op."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.evaluation = 0
        self._cuda_events: list[tuple[int, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[tuple[int, str, float]] = []
        self.copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def stage(self, name: str) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return _NULL
        return self._cuda_stage(name) if self.cuda else self._host_stage(name)

    @contextlib.contextmanager
    def _cuda_stage(self, name: str) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._cuda_events.append((self.evaluation, name, start, end))

    @contextlib.contextmanager
    def _host_stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._host.append((self.evaluation, name, (time.perf_counter() - start) * 1e3))

    def summary(self) -> dict[str, object] | None:
        """{"evaluations": [{stage: ms}], "total_ms": {stage: ms}}; synchronises once (CUDA)."""
        if not self.enabled:
            return None
        if self.cuda:
            torch.cuda.synchronize()
            rows = [(e, n, s.elapsed_time(t)) for e, n, s, t in self._cuda_events]
        else:
            rows = self._host
        per_eval: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        totals: dict[str, float] = defaultdict(float)
        for evaluation, name, ms in rows:
            per_eval[evaluation][name] += ms
            totals[name] += ms
        out: dict[str, object] = {
            "evaluations": [dict(per_eval[e]) for e in sorted(per_eval)],
            "total_ms": dict(totals),
        }
        if self.copy_events:
            out["h2d_copy_ms"] = sum(s.elapsed_time(t) for s, t in self.copy_events)
        return out


# Shared disabled timer for callers that do not profile.
NO_TIMER = StageTimer(torch.device("cpu"), enabled=False)
