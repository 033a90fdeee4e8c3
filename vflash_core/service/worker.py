"""The spawned worker process: one `H3Pipeline`, reused across serial jobs.

The parent starts this module's `worker_main` with the `spawn` start method, so the worker never inherits a forked
copy of the parent (the parent never touches CUDA, and CUDA cannot be used after a fork anyway). The two sides talk
through two one-way pipes: `JobOrder`s (or `None` to stop) go down, events go up. A shared `cancel` flag reaches the
worker while it is busy; the pipeline polls it between evaluations.

Exit rules: the worker exits after a cancelled job and after any failure other than a `RequestError` (a failed
trajectory leaves device state that must not be reused); the parent then starts a fresh worker.

Nothing in this module imports torch at import time: the parent imports it for the message types only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from ..errors import RequestError, VflashError
from ..pipeline.options import RunOptions

__all__ = ["Cancelled", "Failed", "Fatal", "Finished", "JobOrder", "Progress", "Ready", "WorkerConfig", "worker_main"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker needs to open its pipeline; picklable."""

    prepared_assets: str
    options: RunOptions
    scratch_dir: str  # the worker's TMPDIR, owned and removed by the parent
    log_level: int = logging.INFO


# -- parent -> worker --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobOrder:
    job_id: str
    request: Any  # a validated VideoRequest
    output: str  # where the pipeline publishes the MP4 (a service staging path, never a client path)


# -- worker -> parent --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ready:
    """The profile and device checks passed (the model itself loads lazily, on the first job)."""

    pid: int
    info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Fatal:
    """The configuration cannot work on this machine; restarting the worker would fail the same way."""

    message: str


@dataclasses.dataclass(frozen=True)
class Progress:
    job_id: str
    stage: str
    done: int
    total: int


@dataclasses.dataclass(frozen=True)
class Finished:
    job_id: str
    result: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Failed:
    job_id: str
    message: str
    worker_exits: bool


@dataclasses.dataclass(frozen=True)
class Cancelled:
    job_id: str


class JobCancelled(Exception):
    """Raised from the pipeline's cancel/progress hooks when the parent asked to cancel the running job."""


def worker_main(config: WorkerConfig, orders: Connection, events: Connection, cancel: Event) -> None:
    logging.basicConfig(level=config.log_level, format="[vflash worker %(process)d] %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the parent decides when its worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Media and encoder temporaries land in a folder the parent removes even if this process is killed.
    os.environ["TMPDIR"] = config.scratch_dir
    tempfile.tempdir = config.scratch_dir
    try:
        pipeline, info = _open_pipeline(config)
    except Exception as exc:  # any startup failure is fatal: the next worker would meet the same configuration
        logger.error("worker startup failed: %s", _describe(exc), exc_info=_is_bug(exc))
        events.send(Fatal(_describe(exc)))
        return
    events.send(Ready(os.getpid(), info))
    try:
        while True:
            try:
                order = orders.recv()
            except EOFError:  # the parent is gone
                return
            if order is None or not _run(pipeline, order, events, cancel):
                return
    finally:
        pipeline.close()


def _open_pipeline(config: WorkerConfig) -> tuple[Any, dict[str, Any]]:
    """Open the lazy pipeline, which checks the devices against the profile; loads no model."""
    from ..pipeline.h3_pipeline import H3Pipeline

    pipeline = H3Pipeline.from_prepared(config.prepared_assets, config.options)
    info: dict[str, Any] = {"profile": pipeline.profile.id, "strategy": config.options.strategy}
    for role, device in (("device", config.options.device), ("peer_device", config.options.peer_device)):
        if device is not None:
            info[role] = _describe_device(device)
    return pipeline, info


def _describe_device(name: str | int) -> str:
    """`cpu`, or `cuda:N (GPU name, smXY)`, for the readiness report. Runs only in the worker: it initialises CUDA."""
    import torch

    from ..formats import device_arch

    device = torch.device(name)
    if device.type == "cpu":
        return str(name)
    return f"{name} ({torch.cuda.get_device_name(device)}, {device_arch(device)})"


def _run(pipeline: Any, order: JobOrder, events: Connection, cancel: Event) -> bool:
    """Run one job and report it; returns whether this worker may take another job."""
    from ..pipeline.h3_pipeline import RequestCancelled

    def check_cancel() -> None:
        if cancel.is_set():
            raise JobCancelled(order.job_id)

    def progress(stage: str, done: int, total: int) -> None:
        events.send(Progress(order.job_id, stage, done, total))
        check_cancel()  # the pipeline does not poll `cancel` while it loads the model

    try:
        result = pipeline.generate(order.request, order.output, progress=progress, cancel=check_cancel)
        report = _result_json(result)
    except (JobCancelled, RequestCancelled):
        logger.info("job %s cancelled; this worker exits", order.job_id)
        events.send(Cancelled(order.job_id))
        return False
    except RequestError as exc:  # a bad input (its checks, or reading it): the pipeline stays usable
        events.send(Failed(order.job_id, str(exc), worker_exits=False))
        return True
    except Exception as exc:  # a failed trajectory: report it, then exit (its CUDA context cannot be trusted again)
        logger.error("job %s failed, this worker exits: %s", order.job_id, _describe(exc), exc_info=_is_bug(exc))
        events.send(Failed(order.job_id, _describe(exc), worker_exits=True))
        return False
    events.send(Finished(order.job_id, report))
    return True


def _is_bug(exc: BaseException) -> bool:
    """Anything but a `VflashError` is a bug: it is logged with its traceback."""
    return not isinstance(exc, VflashError)


def _describe(exc: BaseException) -> str:
    """A `VflashError`'s own message (it names the offending values); a bug keeps its type name."""
    return f"{type(exc).__name__}: {exc}" if _is_bug(exc) else str(exc)


# What a client sees of a VideoResult: not `path` (a service staging path; the parent reports the published name)
# and not `media` (decoded tensors, only present when no file was written).
RESULT_FIELDS = (
    "elapsed_seconds", "stages", "session", "mode", "width", "height", "num_frames", "fps", "sample_rate", "metadata"
)


def _result_json(result: Any) -> dict[str, Any]:
    """The reported VideoResult fields as JSON types (a dataclass becomes a dict, a path a string)."""

    def default(obj: object) -> object:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        if isinstance(obj, Path):
            return str(obj)
        raise TypeError(f"VideoResult holds a {type(obj).__name__}, which is not JSON-serialisable")

    return json.loads(json.dumps({name: getattr(result, name) for name in RESULT_FIELDS}, default=default))
