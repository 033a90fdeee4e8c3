"""`NativeEngineSession`: one profile, one GPU group, one loaded compiled model, reused across serial requests.

Ownership: the session owns its profile, devices and weights; each `generate` call owns its request's
tensors. Closing waits for the devices, then drops every weight reference and communicator. A trajectory that fails
(anything other than bad input, or an abort raised by the caller's own progress / between-block callback) marks the
session failed: it refuses further calls and must be closed and replaced.

Memory placement: `weight_residency="resident"` keeps every block on the device; `"block-ring"` streams blocks from
one pinned host arena through two device slots; `"disk-ring"` streams them through the same slots from their compiled
files, read again on every pass into a few pinned staging buffers (one GPU); `"auto"` lets the memory plan
(`memory_plan.plan_memory`) choose: resident when the blocks and the profile's largest request fit the free device
memory (or the `max_device_memory` cap, which the session then enforces on its devices until it closes) with the
plan's margin, else block-ring, or disk-ring where the arena does not fit the `max_host_memory` budget. Inside
a pipeline the pipeline's plan (the encoder and the VAEs too) is passed in and used instead. Each request is checked
against the plan before it runs. Several GPUs (`peer_device`, `strategy`) are used only when the caller names them.

Execution: an FP8 profile's artifact (approximate) runs its block linears through `fp8.RowFP8Execution` of the
profile's mode, with the Triton activation quantizers in the fused execution; only such a session accepts the
approximate attention backend `fa3-fp8`. A named fast mode (`fast_mode.FastMode`: block-sparse attention, a step
cache) is approximate too, and each result then says so (`metadata["exact"]`, `metadata["fast_mode"]`). Nothing else
ever runs approximately.

Trusted loader hooks (`native_denoiser_loader`, `block_loader`) are Python callables given by the caller, never names
resolved to code.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

from ..errors import (
    CallbackGuard,
    IdentityMismatchError,
    Number,
    SessionClosedError,
    VflashError,
    check_callback,
    check_choice,
    describe_value,
)
from ..fileio import GIB, atomic_file, check_writable_destination, path_argument
from ..formats import check_device, device_arch
from ..memory_plan import (
    DeviceCap,
    MemoryPlan,
    cap_bytes,
    check_disk_ring,
    check_host_budget_on_cpu,
    plan_memory,
)
from ..profiles import Profile, get_profile
from ..progress import PreviewFn, ProgressFn
from .artifact import CompiledArtifact
from .attention import resolve_attention
from .bundle import MODE_VARIANT, BundleHandoff, ConditioningBundle
from .config import H3Config
from .denoise import DenoiseOutput, Denoiser, denoise_bytes
from .device_owner import release_host_memory
from .fast_mode import FastMode
from .fast_mode_run import FastModeRun
from .fp8 import FusedRowFP8Ops, RowFP8Execution, RowFP8Ops
from .fused import FusedOps
from .layout import FPS, largest_request_rows
from .model import AttentionFn, BlockOps, LayerWeights
from .parallel import (
    LocalGroup,
    SequenceHeadAttention,
    TensorShard,
    head_groups,
    relayout_ops,
    split_rows,
    tensor_parallel_ops,
)
from .profiler import StageTimer
from .residency import BlockArena, BlockFiles, BlockRing, BlockSource, LoadedBlocks, ResidentBlocks
from .session_options import STRATEGIES, WEIGHT_RESIDENCIES

__all__ = [
    "BlockLoader", "DenoiserLoad", "GenerationResult", "NativeDenoiserLoader", "NativeEngineSession", "SessionTiming",
    "check_loader_hooks",
]

logger = logging.getLogger(__name__)

EXECUTIONS = ("auto", "fused", "reference")
#: How long a rank waits for its peers in one collective: positive, and at most a day (a wait is a deadline).
COLLECTIVE_TIMEOUT = Number(float, 0, 86_400, above=True, unit="seconds")


@dataclass(frozen=True)
class DenoiserLoad:
    """What a `native_denoiser_loader` is handed beside the verified artifact: the device, the block operations the
    session chose for it (execution, attention, FP8) and a callback to call with each block's index once it is loaded
    (None when nobody listens)."""

    device: torch.device
    ops: BlockOps
    on_block: Callable[[int], None] | None


#: (verified artifact, load arguments) -> the `Denoiser` of the session's one device, its blocks resident.
NativeDenoiserLoader = Callable[[CompiledArtifact, DenoiserLoad], Denoiser]
#: (verified artifact, device) -> every main block's weights on that device, in order (checked against the artifact).
BlockLoader = Callable[[CompiledArtifact, torch.device], Sequence[LayerWeights]]


@dataclass
class SessionTiming:
    """Where one request's time went: the session's one-off initialisation, charged to its first request, and the
    request itself."""

    request_index: int  # 1-based index of this request in the session
    initialization_seconds: float  # time the session took to initialise
    initialization_charged_seconds: float  # initialization_seconds on the first request, 0 afterwards
    request_wall_seconds: float  # this request inside the initialised session (incl. writing an output file)


@dataclass
class GenerationResult:
    """video_latents: (1, C, F, h, w) fp32 CPU; audio_latents: (2, C_audio, A) fp32 CPU."""

    video_latents: torch.Tensor
    audio_latents: torch.Tensor
    session: SessionTiming
    metadata: dict[str, object] = field(default_factory=dict)
    denoise_profile: dict[str, object] | None = None


class NativeEngineSession:
    """Run fixed-schedule H3 trajectories for one profile on one device or an explicit group of devices.

    Args:
        profile: a registered profile id or a `Profile`.
        artifact, schedule_overlay, auxiliary: the three outputs of one `compile`.
        device: `"cpu"`, an index or `"cuda:N"`; must match the architecture the artifact was compiled on.
        peer_device: further GPU(s) for one request (index, name or list); needs `strategy`.
        strategy: with `peer_device`, `"sequence-head"` (rows split, heads exchanged for attention; exact per row and
            head) or `"tensor"` (heads and FFN channels split, partial projections summed; rounding differs).
        weight_residency: `"auto"`, `"resident"`, `"block-ring"` or `"disk-ring"`.
        max_device_memory: a cap in GiB on what the session may hold on each device: planned against and enforced
            (`memory_plan.DeviceCap`) until `close`.
        max_host_memory: a budget in GiB for what the session holds in host memory (the block-ring arena or the
            disk ring's staging buffers, plus `memory_plan.HOST_MARGIN_BYTES` for the process): planned against, not
            enforced (the plan's estimates; the host has no allocator to cap).
        plan: a pipeline's memory plan (`memory_plan.plan_memory`), which then decides the residency and carries the
            cap and the host budget; `weight_residency` must agree with it and the two limits be left out.
        attention_backend: see `attention_backends.BACKENDS`; the backend used is logged once and reported per result.
        fast_mode: None / "exact" (default), or a named approximate mode (`fast_mode.FastMode`, or its names, e.g.
            "sparse-attention", "sparse-attention,step-cache"); refused where it cannot run.
        execution: `"fused"` (Triton elementwise kernels, the CUDA default), `"reference"` (plain PyTorch, the CPU
            default) or `"auto"`; both give the same bits.
        on_load_progress: called with (blocks loaded, total) while weights load.
        collective_timeout_seconds: how long a rank waits for its peers in one collective before the group fails.
        native_denoiser_loader: a trusted Python callable `(artifact, DenoiserLoad) -> Denoiser` that builds the
            denoiser in place of the session's own loading; resident weights on one device only.
        block_loader: a trusted Python callable `(artifact, device) -> blocks` supplying the resident block stack
            (names, shapes, dtypes, device and LoRA linears are checked against the artifact); not with
            `native_denoiser_loader` (which loads its own) nor the tensor strategy (which shards blocks).
    """

    def __init__(
        self,
        profile: Profile | str,
        artifact: str | Path,
        schedule_overlay: str | Path,
        auxiliary: str | Path,
        device: int | str | torch.device = "cpu",
        peer_device: int | str | torch.device | list | None = None,
        strategy: str | None = None,
        weight_residency: str = "auto",
        attention_backend: str = "auto",
        execution: str = "auto",
        on_load_progress: Callable[[int, int], None] | None = None,
        collective_timeout_seconds: float = 120.0,
        max_device_memory: float | None = None,
        max_host_memory: float | None = None,
        plan: MemoryPlan | None = None,
        native_denoiser_loader: NativeDenoiserLoader | None = None,
        block_loader: BlockLoader | None = None,
        fast_mode: FastMode | str | None = None,
    ):
        start = time.perf_counter()
        self.fast_mode = FastMode.parse(fast_mode)
        cap = cap_bytes(max_device_memory)  # checked before anything is read (a string or NaN is refused here)
        host_budget = cap_bytes(max_host_memory, "max_host_memory")
        COLLECTIVE_TIMEOUT.check("collective_timeout_seconds", collective_timeout_seconds)
        check_callback(on_load_progress, "on_load_progress")
        artifact, schedule_overlay, auxiliary = (path_argument(value, name) for value, name in (
            (artifact, "artifact"), (schedule_overlay, "schedule_overlay"), (auxiliary, "auxiliary")))
        self.profile = get_profile(profile)
        peers = [] if peer_device is None else (
            list(peer_device) if isinstance(peer_device, (list, tuple)) else [peer_device]
        )
        # devices this machine has: "tpu" or cuda:9 is one line, not a RuntimeError
        self.devices = [check_device(device, None, "device")] + [check_device(p, None, "peer device") for p in peers]
        self.device = self.devices[0]
        if peers and strategy not in STRATEGIES:
            raise VflashError(f"two or more devices need strategy {' or '.join(STRATEGIES)}, got {strategy!r}")
        if not peers and strategy is not None:
            raise VflashError(f"strategy {strategy!r} needs a peer_device")
        self.strategy = strategy if peers else None
        self.fast_mode.check_placement(len(self.devices), self.strategy)
        check_choice("weight_residency", weight_residency, WEIGHT_RESIDENCIES)
        if plan is not None and (max_device_memory is not None or max_host_memory is not None):
            raise VflashError(
                "a session given a memory plan takes its limits from the plan; "
                "leave max_device_memory and max_host_memory out"
            )
        check_disk_ring(weight_residency, len(self.devices))
        if self.device.type != "cuda":
            check_host_budget_on_cpu(host_budget, cap)
        hooks = check_loader_hooks(native_denoiser_loader, block_loader, self.strategy, len(self.devices))
        if hooks and weight_residency == "auto":
            weight_residency = "resident"
        self.compiled = CompiledArtifact(artifact, schedule_overlay, auxiliary)
        self.compiled.check_profile(self.profile)
        for dev in self.devices:
            arch = device_arch(dev)
            if arch != self.compiled.arch:
                raise IdentityMismatchError(
                    f"the artifact was compiled on {self.compiled.arch}; device {dev} is {arch}"
                )
        config = self.compiled.config
        if self.strategy is not None:
            head_groups(config.num_attention_heads, len(self.devices))
        if self.profile.fp8 is not None and self.strategy == "tensor":
            raise VflashError(
                f"profile {self.profile.id} runs FP8 block linears on one device or with sequence-head; "
                "the tensor strategy shards BF16 blocks only"
            )
        self.attention_backend = resolve_attention(attention_backend, self.device, self.profile.fp8 is not None)[0]
        check_choice("execution", execution, EXECUTIONS)
        self.execution = ("fused" if self.device.type == "cuda" else "reference") if execution == "auto" else execution
        # Planned unless on the CPU without a cap (resident blocks there).
        if plan is None and (self.device.type == "cuda" or max_device_memory is not None):
            # this session's own plan, for the core alone: its blocks and the profile's largest request
            largest = {"denoise": denoise_bytes(config, largest_request_rows(self.profile, config), self.fast_mode)}
            plan = plan_memory(
                self.compiled.part_sizes(), largest, self.devices, cap, weight_residency, host_budget=host_budget
            )
        elif plan is not None and weight_residency not in ("auto", plan.placement.core):
            raise VflashError(
                f"weight_residency={weight_residency!r} disagrees with the memory plan's {plan.placement.core!r}"
            )
        self.plan = plan
        self.weight_residency = (
            self.plan.placement.core if self.plan is not None
            else ("resident" if weight_residency == "auto" else weight_residency)
        )
        if hooks and self.weight_residency != "resident":
            raise VflashError(
                f"{hooks[0]} loads the resident block stack; "
                f"this session's blocks are {self.weight_residency} (the memory plan's choice)"
            )
        self._cap = (
            DeviceCap(self.plan.cap, self.devices) if self.plan is not None and self.plan.cap is not None else None
        )
        self.closed = False
        self._denoisers: list[Denoiser] = []
        self._group: LocalGroup | None = None
        self._host_blocks: list[BlockArena | BlockFiles] = []  # what the block rings copy from
        try:
            self._load(
                config, attention_backend, on_load_progress, collective_timeout_seconds,
                native_denoiser_loader, block_loader,
            )
        except BaseException:
            self.close()  # what was loaded before the failure (a loader hook's exception included), and the cap
            raise
        self._failure: str | None = None
        self._requests = 0
        self.initialization_seconds = time.perf_counter() - start
        logger.info("Vflash session %s: %s", self.profile.id, self.memory_plan())

    def _load(
        self,
        config: H3Config,
        attention_backend: str,
        on_load_progress: Callable[[int, int], None] | None,
        collective_timeout_seconds: float,
        native_denoiser_loader: NativeDenoiserLoader | None,
        block_loader: BlockLoader | None,
    ) -> None:
        """Load the weights where the plan put them (or through the caller's loader) and build one denoiser
        per device."""
        self._group = LocalGroup(self.devices, collective_timeout_seconds) if self.strategy else None
        size = len(self.devices)
        shards = [TensorShard(config, r, size) if self.strategy == "tensor" else None for r in range(size)]
        load = None if on_load_progress is None else (lambda i: on_load_progress(i + 1, config.num_layers))
        # One host arena shared by every ring (sequence-head replicates blocks); one arena of shards per rank (tensor).
        pin = self.device.type == "cuda"
        if self.weight_residency == "block-ring":
            if self.strategy == "tensor":
                self._host_blocks = [
                    BlockArena(self.compiled, pin, load if r == 0 else None, shard) for r, shard in enumerate(shards)
                ]
            else:
                self._host_blocks = [BlockArena(self.compiled, pin, load)]
        elif self.weight_residency == "disk-ring":
            self._host_blocks = [BlockFiles(self.compiled, pin, load)]
        for rank, dev in enumerate(self.devices):
            fast, local = FastModeRun.wrap(
                self.fast_mode, resolve_attention(attention_backend, dev, self.profile.fp8 is not None)[1]
            )
            if self.strategy == "sequence-head":
                attention = SequenceHeadAttention(
                    self._group.groups[rank],  # type: ignore[union-attr,arg-type]
                    [(0, 0)] * size, config.num_attention_heads, local, *relayout_ops(dev),
                )
                ops = self._block_ops(config, attention, dev)
            elif self.strategy == "tensor":
                ops = tensor_parallel_ops(
                    config, self._group.groups[rank],  # type: ignore[union-attr,arg-type]
                    size, local, FusedOps if self.execution == "fused" else BlockOps,
                )
            else:
                ops = self._block_ops(config, local, dev)
            if native_denoiser_loader is not None:
                den = _loaded_denoiser(native_denoiser_loader, self.compiled, DenoiserLoad(dev, ops, load))
            else:
                blocks: BlockSource
                if self._host_blocks:
                    blocks = BlockRing(self._host_blocks[rank % len(self._host_blocks)], dev)
                elif block_loader is not None:
                    blocks = LoadedBlocks(self.compiled, dev, block_loader(self.compiled, dev))
                else:
                    blocks = ResidentBlocks(self.compiled, dev, load if rank == 0 else None, shards[rank])
                den = Denoiser(self.compiled, blocks, dev, ops)
            den.fast = None if self.fast_mode.exact else fast
            self._denoisers.append(den)

    def _block_ops(self, config: H3Config, attention: AttentionFn, device: torch.device) -> BlockOps:
        """The main blocks' operations for this session's execution; for an FP8 profile its `RowFP8Execution` (the
        fused execution quantizes activations in the Triton kernels that produce them), checked against `device`."""
        fused = self.execution == "fused"
        if self.profile.fp8 is None:
            return FusedOps(config, attention) if fused else BlockOps(config, attention)
        execution = RowFP8Execution(self.profile.fp8, "triton" if fused and self.profile.fp8 == "w8a8" else "torch")
        execution.check_device(device)
        if not fused:
            return RowFP8Ops(config, attention, execution)
        keep_values = self.compiled.blocks_carry_lora  # LoRA branches read BF16 inputs
        return FusedRowFP8Ops(config, attention, execution, keep_values)

    # -- memory -------------------------------------------------------------------------------------------------

    def memory_plan(self) -> str:
        """One line: devices, strategy, attention, residency, blocks on device, pinned host bytes."""
        report = self._memory_report()
        devices = ", ".join(str(d) for d in self.devices)
        strategy = f" {self.strategy}" if self.strategy else ""
        linears = f", approximate FP8 {self.profile.fp8} block linears" if self.profile.fp8 else ""
        linears += "" if self.fast_mode.exact else f", approximate fast mode {self.fast_mode.name}"
        return (
            f"{devices}{strategy}, {self.execution} kernels{linears}, attention {self.attention_backend}, "
            f"weights {self.weight_residency}"
            f"{', read from the compiled block files on every pass' if self.weight_residency == 'disk-ring' else ''} "
            f"({report['blocks_on_device']} blocks on device, "
            f"{report['device_weight_bytes'] / GIB:.2f} GiB block weights per device, "  # type: ignore[operator]
            f"{report['pinned_host_bytes'] / GIB:.2f} GiB pinned host)"  # type: ignore[operator]
        )

    def _check_request_fits(self, bundle: ConditioningBundle) -> None:
        """Refuse a request whose activations do not fit the plan (nothing to check without one: CPU, no cap)."""
        if self.plan is None:
            return
        rows = bundle.layout.sequence_length
        # With sequence-head: local rows everywhere, plus whole-sequence q/k/v/out for 1/P of the heads.
        if self.strategy == "sequence-head":
            rows = max(stop - start for start, stop in split_rows(rows, len(self.devices))) + rows // len(self.devices)
        self.plan.check(
            {"denoise": denoise_bytes(self.compiled.config, rows, self.fast_mode)},
            f"this request's activations ({bundle.layout.sequence_length} packed rows, "
            f"weights {self.weight_residency})",
            "Use a smaller canvas or a shorter clip, weight_residency='block-ring', or a second GPU.",
        )

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the devices, then release every weight and communicator this session owns. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for dev in self.devices:
            if dev.type == "cuda":
                try:
                    torch.cuda.synchronize(dev)
                except RuntimeError as exc:  # an aborted collective: completion cannot be confirmed
                    logger.warning("closing %s after a failure: %s; do not reuse this process's CUDA context", dev, exc)
        for den in self._denoisers:
            den.close()
        self._denoisers = []
        if self._group is not None:
            self._group.close()
            self._group = None
        for host_blocks in self._host_blocks:
            host_blocks.close()
        self._host_blocks = []
        release_host_memory()
        if self._cap is not None:
            self._cap.release()
            self._cap = None

    # -- requests -------------------------------------------------------------------------------------------------

    def validate(self, bundle: ConditioningBundle) -> None:
        """Everything about a request that can be checked before any heavy work; raises `VflashError`."""
        bundle.validate()
        bundle.check_model(self.compiled.config)
        self.profile.check_mode(bundle.mode)
        if MODE_VARIANT[bundle.mode] != self.profile.variant:
            raise VflashError(
                f"a {bundle.mode} request needs the {MODE_VARIANT[bundle.mode]} partition; "
                f"profile {self.profile.id} runs {self.profile.variant}"
            )
        self.profile.check_duration(bundle.geometry.num_frames / FPS)
        self._check_request_fits(bundle)

    def generate(
        self,
        bundle: ConditioningBundle | BundleHandoff | str | Path,
        progress: ProgressFn | None = None,
        between_blocks: Callable[[], None] | None = None,
        output_latents: str | Path | None = None,
        profile_denoise: bool = False,
        preview: PreviewFn | None = None,
        exact: bool = False,
    ) -> GenerationResult:
        """Denoise one request. `bundle` may be a bundle, a one-shot handoff, or a persisted bundle folder.

        With `exact`, a session made with a fast mode runs this request exactly (its sparse attention stays dense and
        nothing is cached: the bits of a session without the mode), e.g. to compare the two on one loaded model.

        `progress(done, total)` runs after every evaluation and `between_blocks()` between blocks (with several GPUs,
        at the next evaluation boundary); `preview(done, total, video)` after every evaluation too, with that
        evaluation's x0 prediction of the video latents on the first device (`progress.PreviewFn`: it only reads a copy,
        so the latents are bitwise those of a run without it). An exception these raise aborts the request and leaves
        the session usable.
        With `output_latents`, the latents are also written there atomically, inside the timed region. With
        `profile_denoise`, per-stage device timings are returned in `denoise_profile`.
        """
        if self._failure is not None:
            raise SessionClosedError(f"this session failed earlier ({self._failure}); close it and create a new one")
        if self.closed:
            raise SessionClosedError("this session is closed; create a new NativeEngineSession")
        if isinstance(bundle, BundleHandoff):
            bundle = bundle.consume()
        elif isinstance(bundle, (str, os.PathLike)) and os.fspath(bundle):
            bundle = ConditioningBundle.load(bundle)
        elif not isinstance(bundle, ConditioningBundle):
            raise VflashError(
                "NativeEngineSession.generate takes a ConditioningBundle, a BundleHandoff or a bundle folder path, "
                f"got {describe_value(bundle)}"
            )
        self.validate(bundle)
        check_callback(progress, "progress")
        check_callback(between_blocks, "between_blocks")
        check_callback(preview, "preview")
        if output_latents is not None:
            check_writable_destination(path_argument(output_latents, "output_latents"))
        guarded = CallbackGuard()  # a stop the caller's callback raised is no failure of the session
        for dev in self.devices:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
        timers = [StageTimer(dev, profile_denoise) for dev in self.devices]
        for den, timer in zip(self._denoisers, timers):
            if isinstance(den.blocks, BlockRing):
                den.blocks.time_copies(timer.copy_events if profile_denoise else None)
        start = time.perf_counter()
        fast_runs = [den.fast for den in self._denoisers]
        if exact:
            for den in self._denoisers:
                den.fast = None
        try:
            if self._group is None:
                output = self._denoisers[0].run(
                    bundle, timers[0], guarded(progress), guarded(between_blocks), guarded(preview)
                )
            else:
                output = self._run_group(bundle, timers, guarded(progress), guarded(between_blocks), guarded(preview))
            if output_latents is not None:
                write_latents(output_latents, output, {"profile": self.profile.id, "mode": bundle.mode})
        except BaseException as exc:
            # the caller's callback stopped it, a bad input or Ctrl-C: the session stays usable, unless a rank failed
            caller_caused = guarded.raised is not None or isinstance(exc, (VflashError, KeyboardInterrupt))
            if not caller_caused or (self._group is not None and self._group.failed):
                self._failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            for den, run in zip(self._denoisers, fast_runs):
                den.fast = run
        wall = time.perf_counter() - start
        self._requests += 1
        timing = SessionTiming(
            self._requests, self.initialization_seconds,
            self.initialization_seconds if self._requests == 1 else 0.0, wall,
        )
        metadata: dict[str, object] = {
            "profile": self.profile.id,
            "mode": bundle.mode,
            "devices": [str(d) for d in self.devices],
            "strategy": self.strategy,
            "attention_backend": self.attention_backend,
            "execution": self.execution,
            "fp8": self.profile.fp8,
            "weight_residency": self.weight_residency,
            "compile_id": self.compiled.compile_id,
            # e.g. format fp8_scaled, pruned
            "base_weights": {k: v for k, v in self.compiled.base_weights.items() if k != "files"},
            "nfe": self._denoisers[0].nfe,
            "memory": self._memory_report(),
            "exact": (
                (exact or self.fast_mode.exact) and self.profile.fp8 is None and self.attention_backend != "fa3-fp8"
            ),
        }
        if not (exact or self.fast_mode.exact):
            metadata["fast_mode"] = self._fast_mode_report()
        summaries = [t.summary() for t in timers]
        profile: dict[str, object] | None = (
            (summaries[0] if len(summaries) == 1 else {"ranks": summaries}) if profile_denoise else None
        )
        return GenerationResult(output.video_latents, output.audio_latents, timing, metadata, profile)

    def _fast_mode_report(self) -> dict[str, object]:
        """The first device's report of what the fast mode did; with sequence-head, the density over every rank's
        heads."""
        runs = [den.fast for den in self._denoisers if den.fast is not None]
        report = runs[0].report(self._denoisers[0].nfe, self.attention_backend)
        sparse = [run.attention for run in runs if run.attention is not None]
        if len(sparse) > 1 and isinstance(report.get("sparse_attention"), dict):
            kept = sum(float(a.kept_pairs) for a in sparse)
            total = sum(a.total_pairs for a in sparse)
            report["sparse_attention"]["density_reached"] = kept / total if total else None  # type: ignore[index]
        return report

    def _memory_report(self) -> dict[str, object]:
        report: dict[str, object] = {
            "weight_residency": self.weight_residency,
            "blocks_on_device": self.compiled.config.num_layers if self.weight_residency == "resident" else 2,
            "device_weight_bytes": self._denoisers[0].blocks.device_weight_bytes,
            "pinned_host_bytes": sum(a.nbytes for a in self._host_blocks),
        }
        files = next((h for h in self._host_blocks if isinstance(h, BlockFiles)), None)
        if files is not None:
            report["block_file_reads"] = len(files.read_seconds)
            report["block_file_bytes_read"] = files.bytes_read
        if self.device.type == "cuda":
            report["peak_allocated_bytes"] = [torch.cuda.max_memory_allocated(d) for d in self.devices]
            report["peak_reserved_bytes"] = [torch.cuda.max_memory_reserved(d) for d in self.devices]
        return report

    def _run_group(
        self, bundle: ConditioningBundle, timers: list[StageTimer], progress: ProgressFn | None,
        between_blocks: Callable[[], None] | None, preview: PreviewFn | None,
    ) -> DenoiseOutput:
        """Every rank runs the trajectory on its rows; ranks stop together at an evaluation boundary when asked. For a
        preview, rank 0 gathers every rank's x0 rows onto its device between the boundary's two barriers."""
        group = self._group
        assert group is not None
        total = bundle.layout.sequence_length
        if self.strategy == "sequence-head":
            rows = split_rows(total, len(self.devices))
            for den in self._denoisers:
                attention = den.ops.attention
                assert isinstance(attention, SequenceHeadAttention)  # what _load gives each rank with this strategy
                attention.assign_rows(rows)
        else:  # tensor: every rank holds every row
            rows = [(0, total)] * len(self.devices)
        stop: list[BaseException] = []
        denoised: list[torch.Tensor | None] = [None] * len(self.devices)

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
            den = self._denoisers[rank]
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
                            parts = denoised[:1] if self.strategy == "tensor" else denoised
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
        if self.strategy == "tensor":
            results = results[:1]  # identical on every rank
        video, audio = (torch.cat([r[i] for r in results]) for i in (0, 1))  # type: ignore[index]
        return self._denoisers[0].finish(bundle, video, audio)


def check_loader_hooks(
    native_denoiser_loader: object, block_loader: object, strategy: str | None, devices: int
) -> list[str]:
    """The names of the loader hooks given, after checking they are callables used where they can be."""
    hooks = {"native_denoiser_loader": native_denoiser_loader, "block_loader": block_loader}
    given = [name for name, hook in hooks.items() if hook is not None]
    for name in given:
        if not callable(hooks[name]):
            raise VflashError(f"{name} must be a Python callable, got {type(hooks[name]).__name__}")
    if len(given) == 2:
        raise VflashError(
            "give a native_denoiser_loader or a block_loader, not both: the denoiser loader loads its own blocks"
        )
    if native_denoiser_loader is not None and devices > 1:
        raise VflashError(
            "native_denoiser_loader builds the denoiser of one device (resident, single-device only); "
            "leave peer_device and strategy out"
        )
    if block_loader is not None and strategy == "tensor":
        raise VflashError(
            "block_loader supplies whole blocks; the tensor strategy shards them (use sequence-head or one device)"
        )
    return given


def _loaded_denoiser(loader: NativeDenoiserLoader, artifact: CompiledArtifact, load: DenoiserLoad) -> Denoiser:
    """Call the caller's denoiser loader and check what it returned is a denoiser of this artifact on this device."""
    denoiser = loader(artifact, load)
    if not isinstance(denoiser, Denoiser):
        raise VflashError(
            "native_denoiser_loader must return a vflash_core.engine.denoise.Denoiser, "
            f"got {type(denoiser).__name__}"
        )
    if denoiser.artifact is not artifact or denoiser.device != load.device:
        denoiser.close()
        raise VflashError(
            f"native_denoiser_loader returned a denoiser of another artifact or device ({denoiser.device}); "
            "it must use the artifact and device it is handed"
        )
    return denoiser


def write_latents(path: str | Path, output: DenoiseOutput, metadata: dict[str, str]) -> None:
    """Latents as safetensors (`video_latents`, `audio_latents`), published atomically, never overwriting."""
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(
            {"video_latents": output.video_latents.contiguous(), "audio_latents": output.audio_latents.contiguous()},
            str(tmp), metadata=metadata,
        )
