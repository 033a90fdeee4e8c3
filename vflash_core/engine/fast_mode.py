"""The named fast modes: approximate execution a user asks for by name, never the default.

`FastMode()` is exact (the default everywhere). Two mechanisms can be named, alone or together
(`FastMode.parse("sparse-attention,step-cache")`):

* `sparse-attention`: block-sparse attention in the main blocks (`sparse_attention`): the generated video's query
  blocks attend the prefix (text, conditioning, audio), their local neighbourhood and the key blocks with the
  highest pooled scores; prefix rows stay dense. Dense where errors cost most: the first `sparse_dense_evaluations`
  evaluations (the composition forms there) and `sparse_dense_edge_layers` layers at each end of the stack.
* `step-cache`: the first block's residual decides whether an evaluation reuses the previous evaluation's residual of
  the other blocks (`StepCache`): when it moved less than `step_cache_threshold` (relative L1) since the last fully
  computed evaluation, blocks 1..L-1 are skipped and their cached residual is added instead. Never the first
  `step_cache_warmup` evaluations, nor the last one, nor two evaluations in a row.

Defaults, and why:

* density 0.25 of the attention map (the dense prefix rows and keys included), mass 0.9: at 1344x768 a quarter of the
  map is where block-sparse attention runs 3-3.7x FlashAttention-3 dense on an H100 (Vflash's Triton kernel to
  FlashAttention-4's block-sparse forward) and published training-free selections keep most of the attention mass;
* 3 dense edge layers at each end (44 of 50 sparse) and the first evaluation dense;
* step-cache threshold 0.1 (relative L1 of the first block's residual), warm-up 2 evaluations: a conservative setting
  of the first-block cache, which on a 16-evaluation schedule can skip at most every other evaluation after warm-up.

Every result reports exact=false, the modes, the attention backend that ran, the density reached and the evaluations
cached (`fast_mode_run.FastModeRun.report`). This module imports no torch: command lines parse it before anything
heavy loads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

from ..errors import Number, VflashError

__all__ = ["FAST_MODES", "FastMode"]

SPARSE_ATTENTION, STEP_CACHE = "sparse-attention", "step-cache"
FAST_MODES = (SPARSE_ATTENTION, STEP_CACHE)

_FRACTION = Number(float, 0, 1, above=True)
_COUNT = Number(int, 0, 50)
_THRESHOLD = Number(float, 0, 10, above=True)


@dataclass(frozen=True)
class FastMode:
    """Which approximate mechanisms run, with their settings (see the module docstring); `FastMode()` is exact."""

    modes: tuple[str, ...] = ()
    sparse_density: float = 0.25
    sparse_mass: float = 0.9
    sparse_local_blocks: int = 1
    sparse_dense_edge_layers: int = 3
    sparse_dense_evaluations: int = 1
    step_cache_threshold: float = 0.1
    step_cache_warmup: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.modes, tuple):
            raise VflashError(f"fast mode names must be a tuple, got {self.modes!r}")
        for mode in self.modes:
            if mode not in FAST_MODES:
                raise VflashError(f"unknown fast mode {mode!r}; choose from {', '.join(FAST_MODES)} (or exact)")
        if len(set(self.modes)) != len(self.modes):
            raise VflashError(f"fast mode named twice: {','.join(self.modes)}")
        _FRACTION.check("sparse_density", self.sparse_density)
        _FRACTION.check("sparse_mass", self.sparse_mass)
        for name in ("sparse_local_blocks", "sparse_dense_edge_layers", "sparse_dense_evaluations",
                     "step_cache_warmup"):
            _COUNT.check(name, getattr(self, name))
        _THRESHOLD.check("step_cache_threshold", self.step_cache_threshold)

    @classmethod
    def parse(cls, value: FastMode | str | None, **settings: object) -> FastMode:
        """A `FastMode` from itself, None / "" / "exact" (exact), or names joined by commas or "+"."""
        if isinstance(value, FastMode):
            return replace(value, **settings)  # type: ignore[arg-type]
        if value is not None and not isinstance(value, str):
            raise VflashError(f"fast_mode must be a name such as {SPARSE_ATTENTION!r}, got {value!r}")
        names = [] if value in (None, "", "exact") else [n.strip() for n in value.replace("+", ",").split(",")]
        if "exact" in names:
            raise VflashError(f"exact runs no fast mode, so it does not combine with one: got {value!r}")
        return cls(tuple(names), **settings)  # type: ignore[arg-type]

    @property
    def exact(self) -> bool:
        return not self.modes

    @property
    def sparse_attention(self) -> bool:
        return SPARSE_ATTENTION in self.modes

    @property
    def step_cache(self) -> bool:
        return STEP_CACHE in self.modes

    @property
    def name(self) -> str:
        return "+".join(self.modes) or "exact"

    def check_placement(self, devices: int, strategy: str | None) -> None:
        """Refuse, in one line, a mode asked for where it cannot run."""
        if self.step_cache and devices > 1:
            raise VflashError(
                "fast mode step-cache runs on one GPU (every rank would have to agree on each skip); "
                "with a peer GPU use sparse-attention alone"
            )
        if self.sparse_attention and strategy == "tensor":
            raise VflashError("fast mode sparse-attention runs on one GPU or with sequence-head, not with tensor")

    def settings(self) -> dict[str, object]:
        """The settings of the modes that run (for a result's report)."""
        prefixes = [m.replace("-", "_").removesuffix("_attention") + "_" for m in self.modes]
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "modes" and any(f.name.startswith(p) for p in prefixes)}

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """`--fast-mode` and the settings worth a flag (`vflash generate`, `denoise`, `serve`, `compare`)."""
        parser.add_argument("--fast-mode", default="exact", metavar="MODES",
                            help=f"approximate, off by default: {' and/or '.join(FAST_MODES)} (comma-separated); "
                                 "exact (default) keeps the reference's bits")
        parser.add_argument("--sparse-density", type=_FRACTION.option("--sparse-density"), metavar="FRACTION",
                            help="sparse-attention: the largest share of the attention map computed, the dense text, "
                                 f"conditioning and audio rows included (default {FastMode.sparse_density})")
        parser.add_argument("--step-cache-threshold", type=_THRESHOLD.option("--step-cache-threshold"), metavar="X",
                            help="step-cache: reuse the cached blocks' residual while the first block's residual "
                                 f"moved less than X (relative L1; default {FastMode.step_cache_threshold})")

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> FastMode:
        """The mode from `add_arguments`' flags. A setting's flag without its mode is refused: the request would run
        without the mode the user meant to tune (exact, where no mode is named)."""
        mode = cls.parse(args.fast_mode)
        settings: dict[str, float] = {}
        for flag, field, name in (("--sparse-density", "sparse_density", SPARSE_ATTENTION),
                                  ("--step-cache-threshold", "step_cache_threshold", STEP_CACHE)):
            value = getattr(args, field)
            if value is None:
                continue
            if name not in mode.modes:
                raise VflashError(f"{flag} sets the {name} fast mode, which --fast-mode does not name "
                                  f"({mode.name}): add --fast-mode {name}, or leave {flag} out")
            settings[field] = value
        return replace(mode, **settings)  # type: ignore[arg-type]
