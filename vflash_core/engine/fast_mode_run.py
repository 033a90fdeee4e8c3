"""What a named fast mode (`fast_mode.FastMode`) does while a request runs on one device: the block-sparse attention
its main blocks call, armed per evaluation and layer, and the request's first-block step cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fast_mode import FastMode
from .model import AttentionFn
from .sparse_attention import BlockSparseAttention

__all__ = ["FastModeRun", "StepCache", "describe_fast_mode"]


class StepCache:
    """The first-block cache of one request: decides per evaluation whether blocks 1..L-1 run, and keeps what reuse
    needs (the first block's residual of the last fully computed evaluation and the other blocks' residual)."""

    def __init__(self, threshold: float, warmup: int, evaluations: int):
        self.threshold, self.warmup, self.evaluations = threshold, warmup, evaluations
        self.first_residual: torch.Tensor | None = None
        self.rest_residual: torch.Tensor | None = None
        self.cached: list[int] = []  # evaluations that reused the residual
        self.changes: list[float | None] = []  # per evaluation: the first block's relative change (None: not compared)
        self._previous_cached = False

    def reuse(self, step: int, first_residual: torch.Tensor) -> bool:
        """Whether evaluation `step`, whose first block added `first_residual`, reuses the cached residual (one host
        sync: the comparison)."""
        if self.first_residual is None or self.rest_residual is None:
            self.changes.append(None)
            return False
        change = float((first_residual - self.first_residual).abs().float().mean()
                       / self.first_residual.abs().float().mean().clamp_min(1e-12))
        self.changes.append(change)
        allowed = step >= self.warmup and step < self.evaluations - 1 and not self._previous_cached
        self._previous_cached = allowed and change < self.threshold
        if self._previous_cached:
            self.cached.append(step)
        return self._previous_cached

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The stream after the first block -> the stream after the last, from the cached residual."""
        assert self.rest_residual is not None  # `reuse` said yes only with one
        return x + self.rest_residual

    def store(self, first_residual: torch.Tensor, rest_residual: torch.Tensor) -> None:
        self.first_residual, self.rest_residual = first_residual, rest_residual

    def close(self) -> None:
        self.first_residual = self.rest_residual = None


@dataclass
class FastModeRun:
    """One device's fast mode: the sparse attention its blocks call (None without sparse-attention) and the request's
    step cache; the denoiser arms them per evaluation and layer."""

    mode: FastMode
    attention: BlockSparseAttention | None
    step_cache: StepCache | None = None
    layers: int = 0
    block_evaluations: int = 0

    @classmethod
    def wrap(cls, mode: FastMode, dense: AttentionFn) -> tuple[FastModeRun, AttentionFn]:
        """The run object and the attention function the blocks should call (`dense` itself without
        sparse-attention)."""
        if not mode.sparse_attention:
            return cls(mode, None), dense
        attention = BlockSparseAttention(dense, mode.sparse_density, mode.sparse_mass, mode.sparse_local_blocks)
        return cls(mode, attention), attention

    def start_request(self, evaluations: int, layers: int) -> None:
        self.layers, self.block_evaluations = layers, 0
        if self.attention is not None:
            self.attention.reset()
            self.attention.arm(None)
        if self.step_cache is not None:
            self.step_cache.close()
        self.step_cache = (
            StepCache(self.mode.step_cache_threshold, self.mode.step_cache_warmup, evaluations)
            if self.mode.step_cache else None
        )

    def arm_layer(self, step: int, layer: int, sparse_from_row: int) -> None:
        """Before layer `layer` of evaluation `step`: sparse or dense attention for it."""
        self.block_evaluations += 1
        if self.attention is None:
            return
        edge = self.mode.sparse_dense_edge_layers
        sparse = step >= self.mode.sparse_dense_evaluations and edge <= layer < self.layers - edge
        self.attention.arm(sparse_from_row if sparse else None)

    def end_evaluation(self) -> None:
        if self.attention is not None:
            self.attention.arm(None)

    def report(self, evaluations: int, attention_backend: str) -> dict[str, object]:
        """What ran for the request: exact=false, the modes and their settings, and per mechanism what it did."""
        report: dict[str, object] = {"exact": False, "modes": list(self.mode.modes), "settings": self.mode.settings(),
                                     "block_evaluations": self.block_evaluations,
                                     "block_evaluations_exact": evaluations * self.layers}
        if self.attention is not None:
            report["sparse_attention"] = {
                "backend": self.attention.backend,
                "dense_backend": attention_backend,
                "sparse_calls": self.attention.sparse_calls, "dense_calls": self.attention.dense_calls,
                "density_reached": self.attention.density_reached(),
            }
        if self.step_cache is not None:
            report["step_cache"] = {"evaluations_cached": list(self.step_cache.cached),
                                    "first_block_change": self.step_cache.changes}
            self.step_cache.close()
        return report


def describe_fast_mode(report: dict) -> str:
    """One line of what a fast mode did for a request, from its report (`metadata["fast_mode"]`), for the logs and
    the command line: the evaluations the step cache reused, the attention density reached, the block evaluations
    run against an exact request's."""
    done = []
    cache = report.get("step_cache")
    if cache:
        done.append(f"reused {len(cache['evaluations_cached'])} of {len(cache['first_block_change'])} evaluations")
    sparse = report.get("sparse_attention")
    if sparse:
        ran = f" ({sparse['backend']}, density {sparse['density_reached']:.2f})" if sparse["sparse_calls"] else ""
        done.append(f"{sparse['sparse_calls']} sparse attention calls{ran}, {sparse['dense_calls']} dense")
    done.append(f"{report['block_evaluations']} of {report['block_evaluations_exact']} block evaluations")
    return f"approximate fast mode {'+'.join(report['modes'])}: " + ", ".join(done)
