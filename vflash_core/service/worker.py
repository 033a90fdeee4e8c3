"""The spawned worker process: one `H3Pipeline`, reused across jobs.

The parent starts this module's `worker_main` with the `spawn` start method, so the worker never inherits a forked
copy of the parent (the parent never touches CUDA, and CUDA cannot be used after a fork anyway). The two sides talk
through two one-way pipes: `JobOrder`s (or `None` to stop) go down, events go up. A shared `cancel` flag reaches the
worker while it is busy; the pipeline polls it between evaluations.

Each job runs on a thread of its own. The pipeline runs one request at a time up to its decode and writes the MP4
after releasing its lock, so a second order, which the parent sends only after `Writing(overlap=True)`, encodes and
denoises while the first one's MP4 is written. `Writing.overlap` asks the memory plan whether the write's host memory
fits beside the pipeline's planned host budget.

Exit rules: after a cancelled job and after any failure other than a `RequestError` (a failed trajectory leaves device
state that must not be reused) the parent sends no more jobs, and stops this worker once the jobs it holds have
ended; it then starts a fresh worker.

Nothing in this module imports torch at import time: the parent imports it for the message types only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from ..errors import RequestError, VflashError
from ..pipeline.options import RunOptions

__all__ = [
    "Cancelled", "Failed", "Fatal", "Finished", "JobOrder", "Progress", "Ready", "WorkerConfig", "Writing",
    "worker_main",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker needs to open its pipeline; picklable."""

    prepared_assets: str
    options: RunOptions
    scratch_dir: str  # the worker's TMPDIR, owned and removed by the parent
    log_level: int = logging.INFO
    torch_threads: int | None = None  # torch's intra-op threads (None: torch's default, every core)


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
class Writing:
    """The job's decode is done; only its MP4's write on CPU threads is left. `overlap`: another job may start."""

    job_id: str
    overlap: bool


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


class EventSender:
    """The event pipe, shared by the job threads: one message at a time."""

    def __init__(self, events: Connection):
        self._events = events
        self._lock = threading.Lock()

    def send(self, event: object) -> None:
        with self._lock:
            self._events.send(event)


def worker_main(config: WorkerConfig, orders: Connection, events: Connection, cancel: Event) -> None:
    logging.basicConfig(level=config.log_level, format="[vflash worker %(process)d] %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the parent decides when its worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Media and encoder temporaries land in a folder the parent removes even if this process is killed.
    os.environ["TMPDIR"] = config.scratch_dir
    tempfile.tempdir = config.scratch_dir
    sender = EventSender(events)
    try:
        pipeline, info = _open_pipeline(config)
    except Exception as exc:  # any startup failure is fatal: the next worker would meet the same configuration
        logger.error("worker startup failed: %s", _describe(exc), exc_info=_is_bug(exc))
        sender.send(Fatal(_describe(exc)))
        return
    sender.send(Ready(os.getpid(), info))
    try:
        # Two threads: one job computing, one writing its MP4 (the parent sends no more than that).
        with ThreadPoolExecutor(2, thread_name_prefix="vflash-job") as jobs:
            while True:
                try:
                    order = orders.recv()
                except EOFError:  # the parent is gone
                    cancel.set()
                    return
                if order is None:
                    return
                jobs.submit(_run, pipeline, order, sender, cancel)
    finally:
        pipeline.close()


def _open_pipeline(config: WorkerConfig) -> tuple[Any, dict[str, Any]]:
    """Open the lazy pipeline, which checks the devices against the profile; loads no model."""
    from ..pipeline.h3_pipeline import H3Pipeline

    if config.torch_threads is not None:
        import torch

        torch.set_num_threads(config.torch_threads)
    pipeline = H3Pipeline.from_prepared(config.prepared_assets, config.options)
    info: dict[str, Any] = {
        "profile": pipeline.profile.id, "strategy": config.options.strategy, "torch_threads": config.torch_threads
    }
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


def _run(pipeline: Any, order: JobOrder, events: EventSender, cancel: Event) -> None:
    """Run one job and report how it ended."""
    from ..pipeline.h3_pipeline import RequestCancelled

    def check_cancel() -> None:
        if cancel.is_set():
            raise JobCancelled(order.job_id)

    def progress(stage: str, done: int, total: int) -> None:
        events.send(Progress(order.job_id, stage, done, total))
        if stage == "write":  # the decode is done: what is left runs beside the next job, and is never cancelled
            if done == 0:
                events.send(Writing(order.job_id, write_overlaps(pipeline, order.request)))
            return
        check_cancel()  # the pipeline does not poll `cancel` while it loads the model

    try:
        result = pipeline.generate(order.request, order.output, progress=progress, cancel=check_cancel)
        report = _result_json(result)
    except (JobCancelled, RequestCancelled):
        logger.info("job %s cancelled; this worker takes no more jobs", order.job_id)
        events.send(Cancelled(order.job_id))
        return
    except RequestError as exc:  # a bad input (its checks, or reading it): the pipeline stays usable
        events.send(Failed(order.job_id, str(exc), worker_exits=False))
        return
    except Exception as exc:  # a failed trajectory: report it; the worker ends (its CUDA context is not trusted again)
        logger.error("job %s failed, this worker takes no more jobs: %s", order.job_id, _describe(exc),
                     exc_info=_is_bug(exc))
        events.send(Failed(order.job_id, _describe(exc), worker_exits=True))
        return
    events.send(Finished(order.job_id, report))


def write_overlaps(pipeline: Any, request: Any) -> bool:
    """Whether the next job may encode and denoise while this request's MP4 is written: the write holds no device
    memory, only host memory (the whole clip's RGB frames when they are fed from a file, next to nothing when they
    were streamed to the encoder during the decode), which must fit the pipeline's planned host budget."""
    plan = pipeline.session.plan if pipeline.session is not None else None
    if plan is None or plan.host_budget is None:
        return True
    geometry = pipeline.validate(request).geometry
    frames_bytes = 3 * geometry.num_frames * geometry.height * geometry.width  # RGB, one byte a channel
    held = 0 if pipeline.options.media_video_input == "stream" else frames_bytes
    return bool(plan.fits_host(extra_bytes=held))


def _is_bug(exc: BaseException) -> bool:
    """Anything but a `VflashError` is a bug: it is logged with its traceback."""
    return not isinstance(exc, VflashError)


def _describe(exc: BaseException) -> str:
    """A `VflashError`'s own message (it names the offending values); a bug keeps its type name."""
    return f"{type(exc).__name__}: {exc}" if _is_bug(exc) else str(exc)


# What a client sees of a VideoResult: not `path` (a service staging path; the parent reports the published name)
# and not `media` (decoded tensors, only present when no file was written).
RESULT_FIELDS = (
    "elapsed_seconds", "stages", "timing", "mode", "width", "height", "num_frames", "fps", "sample_rate", "metadata"
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
