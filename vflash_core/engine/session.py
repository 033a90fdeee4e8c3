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

Execution: an FP8 profile's artifact (approximate) runs its block linears through `fp8.RowFP8Matmul` of the
profile's mode, with the Triton activation quantizers in the fused execution; only such a session accepts the
approximate attention backend `fa3-fp8`. A named fast mode (`fast_mode.FastMode`: block-sparse attention, a step
cache) is approximate too, and each result then says so (`metadata["exact"]`, `metadata["fast_mode"]`). Nothing else
ever runs approximately.

A session is built from three objects that travel whole: where the compile is (`artifact.CompiledPaths`), how it runs
(`engine_options.EngineOptions`, checked when built; the session keeps it as `options`) and the caller's trusted hooks
(`session_hooks.SessionHooks`: load progress, loaders of the resident blocks), plus a pipeline's memory plan.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

from ..errors import (
    CallbackGuard,
    IdentityMismatchError,
    SessionClosedError,
    VflashError,
    check_callback,
    describe_value,
)
from ..fileio import GIB, atomic_file, check_writable_destination, path_argument
from ..formats import check_device, device_arch
from ..memory_plan import DeviceCap, MemoryNeed, MemoryPlan, cap_bytes, plan_memory
from ..profiles import Profile, get_profile
from ..progress import PreviewFn, ProgressFn
from .artifact import CompiledArtifact, CompiledPaths
from .attention import resolve_attention
from .bundle import MODE_VARIANT, BundleHandoff, ConditioningBundle
from .config import H3Config
from .core_memory import CoreMemory
from .denoise import DenoiseOutput, Denoiser
from .device_owner import release_host_memory
from .engine_options import EngineOptions
from .fast_mode_run import FastModeRun
from .fp8 import FusedRowFP8Ops, RowFP8Matmul, RowFP8Ops
from .fused import FusedOps
from .layout import FPS
from .model import AttentionFn, BlockOps
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
from .session_group import run_group
from .session_hooks import DenoiserLoad, SessionHooks

__all__ = ["GenerationResult", "NativeEngineSession", "SessionTiming"]

logger = logging.getLogger(__name__)


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
    timing: SessionTiming
    metadata: dict[str, object] = field(default_factory=dict)
    denoise_profile: dict[str, object] | None = None


class NativeEngineSession:
    """Run fixed-schedule H3 trajectories for one profile on one device or an explicit group of devices.

    Args:
        profile: a registered profile id or a `Profile`.
        paths: the three outputs of one `compile` (`CompiledPaths`).
        options: how it runs (`EngineOptions`: devices, strategy, residency, attention, execution, the collective
            timeout, the device cap and host budget, the fast mode); kept unchanged as `options`. The devices must
            match the architecture the artifact was compiled on. A cap is planned against and enforced
            (`memory_plan.DeviceCap`) until `close`; a host budget is planned against, not enforced (the plan's
            estimates; the host has no allocator to cap). The attention backend used is logged once and reported per
            result; a fast mode is refused where it cannot run.
        plan: a pipeline's memory plan (`memory_plan.plan_memory`), which then decides the residency and carries the
            cap and the host budget: the options' residency must agree with it, their limits be left out or the plan's.
        hooks: the caller's trusted callables (`SessionHooks`: load progress, a loader of the denoiser or of the
            resident blocks).
    """

    def __init__(
        self,
        profile: Profile | str,
        paths: CompiledPaths,
        options: EngineOptions | None = None,
        plan: MemoryPlan | None = None,
        hooks: SessionHooks | None = None,
    ):
        start = time.perf_counter()
        loaders = self._check(profile, paths, EngineOptions() if options is None else options, plan,
                              SessionHooks() if hooks is None else hooks)
        self._place(plan, loaders)
        self.closed = False
        self._denoisers: list[Denoiser] = []
        self._group: LocalGroup | None = None
        self._host_blocks: list[BlockArena | BlockFiles] = []  # what the block rings copy from
        try:
            self._load(self.hooks)
        except BaseException:
            self.close()  # what was loaded before the failure (a loader hook's exception included), and the cap
            raise
        self._failure: str | None = None
        self._requests = 0
        self.initialization_seconds = time.perf_counter() - start
        logger.info("Vflash session %s: %s", self.profile.id, self.memory_plan())

    def _check(
        self, profile: Profile | str, paths: CompiledPaths, options: EngineOptions, plan: MemoryPlan | None,
        hooks: SessionHooks,
    ) -> list[str]:
        """Everything knowable before a weight loads: the arguments' types, the devices on this machine and the
        artifact's identity against the profile and the devices; the resolved choices become attributes. Returns the
        names of the loader hooks given."""
        for name, value, kind in (("paths", paths, CompiledPaths), ("options", options, EngineOptions),
                                  ("hooks", hooks, SessionHooks), ("plan", plan, (MemoryPlan, type(None)))):
            if not isinstance(value, kind):
                raise VflashError(f"{name} must be a {kind if name == 'plan' else kind.__name__}, "  # type: ignore
                                  f"got {describe_value(value)}")
        self.options, self.hooks, self.fast_mode = options, hooks, options.fast_mode
        self.profile = get_profile(profile)
        # devices this machine has: "tpu" or cuda:9 is one line, not a RuntimeError
        self.devices = [check_device(options.device, None, "device")] + [
            check_device(p, None, "peer device") for p in options.peers
        ]
        self.device = self.devices[0]
        self.strategy = options.strategy  # EngineOptions: set exactly when there are peers
        if plan is not None and (
            options.max_device_memory is not None and cap_bytes(options.max_device_memory) != plan.cap
            or options.max_host_memory is not None
            and cap_bytes(options.max_host_memory, "max_host_memory") != plan.host_budget
        ):
            raise VflashError(
                "a session given a memory plan takes its limits from the plan; "
                "leave max_device_memory and max_host_memory out or give the plan's"
            )
        loaders = hooks.check(self.strategy, len(self.devices))
        self.compiled = CompiledArtifact(paths.artifact, paths.schedule_overlay, paths.auxiliary)
        self.compiled.check_profile(self.profile)
        self.memory = CoreMemory(self.compiled, self.profile, self.fast_mode)
        for dev in self.devices:
            arch = device_arch(dev)
            if arch != self.compiled.arch:
                raise IdentityMismatchError(
                    f"the artifact was compiled on {self.compiled.arch}; device {dev} is {arch}"
                )
        if self.strategy is not None:
            head_groups(self.compiled.config.num_attention_heads, len(self.devices))
        if self.profile.fp8 is not None and self.strategy == "tensor":
            raise VflashError(
                f"profile {self.profile.id} runs FP8 block linears on one device or with sequence-head; "
                "the tensor strategy shards BF16 blocks only"
            )
        fp8 = self.profile.fp8 is not None
        self.attention_backend = resolve_attention(options.attention_backend, self.device, fp8)[0]
        execution = options.execution
        self.execution = ("fused" if self.device.type == "cuda" else "reference") if execution == "auto" else execution
        return loaders

    def _place(self, plan: MemoryPlan | None, loaders: list[str]) -> None:
        """Where the blocks live: the pipeline's plan, this session's own (on a GPU or under a cap) or resident; the
        cap enforced from now on."""
        options = self.options
        # The loader hooks load the resident block stack: placed so unless told otherwise (then refused).
        residency = "resident" if loaders and options.weight_residency == "auto" else options.weight_residency
        cap = cap_bytes(options.max_device_memory)
        # Planned unless on the CPU without a cap (resident blocks there).
        if plan is None and (self.device.type == "cuda" or cap is not None):
            # this session's own plan, for the core alone: its blocks and the profile's largest request
            largest = {"denoise": self.memory.largest_evaluation_bytes()}
            host_budget = cap_bytes(options.max_host_memory, "max_host_memory")
            plan = plan_memory(
                self.compiled.part_sizes(), largest, self.devices, cap, residency, host_budget=host_budget
            )
        elif plan is not None and residency not in ("auto", plan.placement.core):
            raise VflashError(
                f"weight_residency={residency!r} disagrees with the memory plan's {plan.placement.core!r}"
            )
        self.plan = plan
        self.weight_residency = (
            self.plan.placement.core if self.plan is not None else ("resident" if residency == "auto" else residency)
        )
        if loaders and self.weight_residency != "resident":
            raise VflashError(
                f"{loaders[0]} loads the resident block stack; "
                f"this session's blocks are {self.weight_residency} (the memory plan's choice)"
            )
        self._cap = (
            DeviceCap(self.plan.cap, self.devices) if self.plan is not None and self.plan.cap is not None else None
        )

    def _load(self, hooks: SessionHooks) -> None:
        """Load the weights where the plan put them (or through the caller's loader) and build one denoiser
        per device."""
        config = self.compiled.config
        timeout = self.options.collective_timeout_seconds
        self._group = LocalGroup(self.devices, timeout) if self.strategy else None
        size = len(self.devices)
        shards = [TensorShard(config, r, size) if self.strategy == "tensor" else None for r in range(size)]
        progress = hooks.on_load_progress
        load = None if progress is None else (lambda i: progress(i + 1, config.num_layers))
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
            ops, fast = self._rank_ops(config, rank, dev)
            if fast.attention is not None:
                fast.attention.prepare(dev, config.attention_head_dim)
            if hooks.native_denoiser_loader is not None:
                den = hooks.load_denoiser(self.compiled, DenoiserLoad(dev, ops, load))
            else:
                blocks: BlockSource
                if self._host_blocks:
                    blocks = BlockRing(self._host_blocks[rank % len(self._host_blocks)], dev)
                elif hooks.block_loader is not None:
                    blocks = LoadedBlocks(self.compiled, dev, hooks.block_loader(self.compiled, dev))
                else:
                    blocks = ResidentBlocks(self.compiled, dev, load if rank == 0 else None, shards[rank])
                den = Denoiser(self.compiled, blocks, dev, ops)
            den.fast = None if self.fast_mode.exact else fast
            self._denoisers.append(den)

    def _rank_ops(self, config: H3Config, rank: int, dev: torch.device) -> tuple[BlockOps, FastModeRun]:
        """One rank's block operations (its strategy's attention exchange or shards around the local attention) and
        the fast mode's run around that attention."""
        attention = resolve_attention(self.options.attention_backend, dev, self.profile.fp8 is not None)[1]
        fast, local = FastModeRun.wrap(self.fast_mode, attention)
        group = self._group.groups[rank] if self._group is not None else None
        if self.strategy == "sequence-head":
            exchange = SequenceHeadAttention(
                group, [(0, 0)] * len(self.devices), config.num_attention_heads, local, *relayout_ops(dev),  # type: ignore[arg-type]
            )
            return self._block_ops(config, exchange, dev), fast
        if self.strategy == "tensor":
            ops = tensor_parallel_ops(
                config, group, len(self.devices), local, FusedOps if self.execution == "fused" else BlockOps,  # type: ignore[arg-type]
            )
            return ops, fast
        return self._block_ops(config, local, dev), fast

    def _block_ops(self, config: H3Config, attention: AttentionFn, device: torch.device) -> BlockOps:
        """The main blocks' operations for this session's execution; for an FP8 profile its `RowFP8Matmul` (the
        fused execution quantizes activations in the Triton kernels that produce them), checked against `device`."""
        fused = self.execution == "fused"
        if self.profile.fp8 is None:
            return FusedOps(config, attention) if fused else BlockOps(config, attention)
        matmul = RowFP8Matmul(self.profile.fp8, "triton" if fused and self.profile.fp8 == "w8a8" else "torch")
        matmul.check_device(device)
        if not fused:
            return RowFP8Ops(config, attention, matmul)
        keep_values = self.compiled.blocks_carry_lora  # LoRA branches read BF16 inputs
        return FusedRowFP8Ops(config, attention, matmul, keep_values)

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

    def resident_bytes(self) -> int:
        """The bytes this session holds on each of its devices between requests: its weights as placed."""
        return self.memory.weights(self.weight_residency)

    def denoise_needs(self, rows: int) -> list[MemoryNeed]:
        """What a request of `rows` packed rows needs on each device beside the weights (`CoreMemory.request_needs`)."""
        return self.memory.request_needs(self.devices, rows)

    def _check_request_fits(self, bundle: ConditioningBundle) -> None:
        """Refuse a request whose activations do not fit the plan (nothing to check without one: CPU, no cap)."""
        if self.plan is None:
            return
        rows = bundle.layout.sequence_length
        # With sequence-head: local rows everywhere, plus whole-sequence q/k/v/out for 1/P of the heads.
        if self.strategy == "sequence-head":
            rows = max(stop - start for start, stop in split_rows(rows, len(self.devices))) + rows // len(self.devices)
        self.plan.check(
            {"denoise": self.memory.evaluation_bytes(rows)},
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
        bundle = self._open_bundle(bundle)
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
                output = run_group(
                    self._group, self._denoisers, self.strategy, bundle, timers, guarded(progress),
                    guarded(between_blocks), guarded(preview),
                )
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
        metadata = self._metadata(bundle, exact)
        summaries = [t.summary() for t in timers]
        profile: dict[str, object] | None = (
            (summaries[0] if len(summaries) == 1 else {"ranks": summaries}) if profile_denoise else None
        )
        return GenerationResult(output.video_latents, output.audio_latents, timing, metadata, profile)

    def _open_bundle(self, bundle: ConditioningBundle | BundleHandoff | str | Path) -> ConditioningBundle:
        """The request's bundle (a handoff consumed, a folder read), checked against this open session."""
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
        return bundle

    def _metadata(self, bundle: ConditioningBundle, exact: bool) -> dict[str, object]:
        """What a result says about how it was made: devices, kernels, weights, memory, exactness, the fast mode."""
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
        return metadata

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


def write_latents(path: str | Path, output: DenoiseOutput, metadata: dict[str, str]) -> None:
    """Latents as safetensors (`video_latents`, `audio_latents`), published atomically, never overwriting."""
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(
            {"video_latents": output.video_latents.contiguous(), "audio_latents": output.audio_latents.contiguous()},
            str(tmp), metadata=metadata,
        )
