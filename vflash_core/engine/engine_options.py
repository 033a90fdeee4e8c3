"""`EngineOptions`: how a `NativeEngineSession` runs (devices, split, residency, kernels, limits, fast mode), one
frozen object that every front end builds once and hands on whole: the command line's flags (`add_arguments`, shared
by `vflash denoise`, `generate`, `compare` and `serve`), the pipeline's `RunOptions`, which holds one, and the node
pack's loader widgets. A knob is a field here, read by the part that uses it; nothing between re-lists the fields.

Validated once, when built, without torch and before anything loads: one line per bad value (several, one a line).
Whether this machine has the devices, and whether they can run the profile, is the session's (or
`RunOptions.check_devices`') to check: that needs torch and the profile.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from ..errors import Number, VflashError, check_choice, listing
from ..formats import GPU_INDEX, gpu_device
from ..memory_plan import DEVICE_MEMORY_GIB, cap_bytes, check_disk_ring, check_host_budget_on_cpu
from .attention_backends import BACKENDS, CPU_BACKENDS
from .fast_mode import FastMode
from .session_options import STRATEGIES, WEIGHT_RESIDENCIES

if TYPE_CHECKING:  # this module imports no torch: the command line's parsers are built from it
    import torch

__all__ = ["COLLECTIVE_TIMEOUT", "EXECUTIONS", "EngineOptions"]

EXECUTIONS = ("auto", "fused", "reference")  # Triton elementwise kernels or plain PyTorch: the same bits
#: How long a rank waits for its peers in one collective: positive, and at most a day (a wait is a deadline).
COLLECTIVE_TIMEOUT = Number(float, 0, 86_400, above=True, unit="seconds")


@dataclass(frozen=True)
class EngineOptions:
    """device: `"cpu"`, a CUDA index, `"cuda:N"` or a `torch.device`; peer_device: further GPU(s) for one request (one,
    or a list), only with a `strategy`: `"sequence-head"` (rows split, heads exchanged for attention; exact per row and
    head) or `"tensor"` (heads and FFN channels split, partial projections summed; rounding differs);
    weight_residency: `"auto"` (the memory plan chooses), `"resident"`, `"block-ring"` or `"disk-ring"` (one GPU);
    attention_backend: see `attention_backends.BACKENDS`; execution: `"fused"` (the CUDA default), `"reference"` (the
    CPU default) or `"auto"`, the same bits; collective_timeout_seconds: how long a rank waits for its peers in one
    collective before the group fails; max_device_memory: a cap in GiB on what may be held on each device, planned
    against and enforced; max_host_memory: a budget in GiB for the weights held in host memory with a margin for the
    process, planned against, not enforced (on the CPU only with max_device_memory); fast_mode: exact by default, or
    a named approximate mode (`fast_mode.FastMode`, or its names: "sparse-attention", "step-cache" or both)."""

    device: int | str | torch.device = "cpu"
    peer_device: int | str | torch.device | tuple[int | str | torch.device, ...] | None = None
    strategy: str | None = None
    weight_residency: str = "auto"
    attention_backend: str = "auto"
    execution: str = "auto"
    collective_timeout_seconds: float = 120.0
    max_device_memory: float | None = None
    max_host_memory: float | None = None
    fast_mode: FastMode = field(default_factory=FastMode)

    def __post_init__(self) -> None:
        # A name is taken for the fast mode, a list for the peers (one peer is held as itself).
        if isinstance(self.fast_mode, str) or self.fast_mode is None:
            object.__setattr__(self, "fast_mode", FastMode.parse(self.fast_mode))
        if isinstance(self.peer_device, (list, tuple)):
            peers = tuple(self.peer_device)
            object.__setattr__(self, "peer_device", peers[0] if len(peers) == 1 else (peers or None))
        problems = [problem for check in self._checks() if (problem := _refusal(check)) is not None]
        if problems:
            raise VflashError(problems[0] if len(problems) == 1 else listing("engine options", problems))

    def _checks(self) -> list[Callable[[], object]]:
        """Each value's check, independent of the others' outcome: a refusal names one value (or one combination)."""
        devices = len(self.devices_named)
        return [
            lambda: _check_fast_mode(self.fast_mode),
            lambda: check_choice("weight_residency", self.weight_residency, WEIGHT_RESIDENCIES),
            lambda: _check_backend(self.attention_backend),  # whether it runs on the device: the session's
            lambda: check_choice("execution", self.execution, EXECUTIONS),
            lambda: COLLECTIVE_TIMEOUT.check("collective_timeout_seconds", self.collective_timeout_seconds),
            lambda: _check_strategy(self.strategy, devices),
            lambda: cap_bytes(self.max_device_memory),
            lambda: cap_bytes(self.max_host_memory, "max_host_memory"),
            lambda: check_host_budget_on_cpu(self.max_host_memory, self.max_device_memory)
            if str(self.device) == "cpu" else None,
            lambda: check_disk_ring(self.weight_residency, devices),
            lambda: self.fast_mode.check_placement(devices, self.strategy)
            if isinstance(self.fast_mode, FastMode) else None,
        ]

    @property
    def peers(self) -> tuple[int | str | torch.device, ...]:
        """The peer devices as named (none, one or several)."""
        if self.peer_device is None:
            return ()
        return self.peer_device if isinstance(self.peer_device, tuple) else (self.peer_device,)

    @property
    def devices_named(self) -> tuple[int | str | torch.device, ...]:
        """The device, then its peers, as named (resolved against this machine by the session)."""
        return (self.device, *self.peers)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The engine's command-line flags, one definition for `vflash denoise`, `generate`, `compare` and `serve`
        (`from_arguments` reads them)."""
        parser.add_argument("--gpu", type=GPU_INDEX.option("--gpu"), help="CUDA device index (default: CPU)")
        parser.add_argument("--peer-gpu", type=GPU_INDEX.option("--peer-gpu"), action="append",
                            help="another GPU for the native core (needs --strategy; `vflash denoise` takes it "
                                 "repeated, a pipeline one)")
        parser.add_argument("--strategy", choices=STRATEGIES,
                            help="how the core splits one request over several GPUs: sequence-head (one all-to-all "
                                 "per block) or tensor (the weights split, one all-reduce per block)")
        parser.add_argument("--weight-residency", default="auto", choices=WEIGHT_RESIDENCIES,
                            help="GPU: the core's blocks all on the device, streamed from pinned host memory "
                                 "(block-ring) or from their compiled files (disk-ring, one GPU); auto: the memory "
                                 "plan chooses")
        parser.add_argument("--attention-backend", default="auto",
                            help=f"attention kernel, pinned on every call: {', '.join(BACKENDS)}; on the CPU "
                                 f"{', '.join(CPU_BACKENDS)} (default auto: the exact default for the device)")
        parser.add_argument("--execution", default="auto", choices=EXECUTIONS,
                            help="the core's elementwise ops: fused (Triton, the CUDA default) or reference (plain "
                                 "PyTorch, the CPU default); the same bits")
        parser.add_argument("--collective-timeout-seconds", type=COLLECTIVE_TIMEOUT.option("--collective-timeout"
                                                                                           "-seconds"),
                            default=120.0, metavar="SECONDS",
                            help="with peer GPUs: how long a GPU waits for the others in one exchange before the "
                                 "request fails (default 120)")
        parser.add_argument("--max-device-memory", type=DEVICE_MEMORY_GIB.option("--max-device-memory"), metavar="GIB",
                            help="cap on the device memory Vflash may use, in GiB (default: what the GPU has free); "
                                 "placement is planned against it and it is enforced")
        parser.add_argument("--max-host-memory", type=DEVICE_MEMORY_GIB.option("--max-host-memory"), metavar="GIB",
                            help="budget for the host memory the weights may hold, in GiB, with a margin for the "
                                 "process (default: not planned); where the core's pinned blocks do not fit, they "
                                 "stream from their compiled files (disk-ring)")
        FastMode.add_arguments(parser)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> EngineOptions:
        """The options from `add_arguments`' flags: every field from the flag of its name, the devices from --gpu and
        --peer-gpu, the fast mode from its flags."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(
            device=gpu_device(args.gpu),
            peer_device=None if not args.peer_gpu else tuple(gpu_device(gpu) for gpu in args.peer_gpu),
            fast_mode=FastMode.from_arguments(args),
        )
        return cls(**values)


def _refusal(check: Callable[[], object]) -> str | None:
    try:
        check()
    except VflashError as exc:
        return str(exc)
    return None


def _check_fast_mode(fast_mode: object) -> None:
    if not isinstance(fast_mode, FastMode):
        raise VflashError(f"fast_mode must be a FastMode or its names, e.g. 'sparse-attention', got {fast_mode!r}")


def _check_backend(backend: object) -> None:
    if backend not in BACKENDS:
        raise VflashError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _check_strategy(strategy: str | None, devices: int) -> None:
    if strategy is not None:
        check_choice("strategy", strategy, STRATEGIES)
        if devices == 1:
            raise VflashError("a peer GPU and a strategy go together (e.g. --peer-gpu 1 --strategy sequence-head)")
    elif devices > 1:
        raise VflashError(f"two or more devices need strategy {' or '.join(STRATEGIES)}, got None")
