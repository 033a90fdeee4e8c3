"""`ServiceConfig`: what `vflash serve` was started with, checked once when the service is built."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Number, VflashError
from ..fileio import MIB, check_folder, check_input_file
from ..pipeline.options import RunOptions
from .worker import WorkerConfig

__all__ = [
    "CANCEL_GRACE", "KEEP_FINISHED_JOBS", "MAX_QUEUE", "RETRIES", "TORCH_THREADS", "WORKERS", "ServiceConfig",
    "check_service_settings", "check_workers",
]

MAX_QUEUE = Number(int, 1)
KEEP_FINISHED_JOBS = Number(int, 0)
MAX_UPLOAD_BYTES = Number(int, 1, 2**40)  # 1 TiB
#: How long a cancelled or stopping worker may take: positive, and at most a day (it is an asyncio deadline).
CANCEL_GRACE = Number(float, 0, 86_400, above=True, unit="seconds")
WORKERS = Number(int, 1, 64)
TORCH_THREADS = Number(int, 1, 1024)
#: How many times a fleet runs a job again after the worker running it was lost.
RETRIES = Number(int, 0, 100)


@dataclass(frozen=True)
class ServiceConfig:
    prepared_assets: Path  # the prepared-assets receipt the pipeline is opened from
    output_dir: Path  # published MP4s (`<job id>.mp4`) and the service's hidden work folder
    # How each worker's pipeline runs; only the workers use devices.
    options: RunOptions = field(default_factory=RunOptions)
    # One worker per entry, on a GPU `(index,)` or a pair `(index, peer)` (with `options.strategy`), which replace
    # `options`' devices; empty: `workers` workers on `options.device`.
    gpus: tuple[tuple[int, ...], ...] = ()
    workers: int = 1  # worker processes on `options.device` when `gpus` is empty; more than one on the CPU only
    pipelined: bool = True  # a worker starts the next job while the last one's MP4 is written, where both fit
    torch_threads: int | None = None  # each worker's torch threads (None: torch's default)
    input_dir: Path | None = None  # client paths must resolve inside it; None accepts uploads only
    max_queue: int = 16  # queued (not running) jobs before 429
    keep_finished_jobs: int = 1000  # records of ended jobs kept for GET /v1/jobs/{id}; older ones are forgotten
    max_upload_bytes: int = 64 * MIB  # all uploaded files of one submission together
    token: str | None = None  # bearer token required on every endpoint but /healthz and /readyz
    cancel_grace_seconds: float = 10.0  # how long a cancelled or stopping worker may take before it is killed
    log_level: int = field(default=logging.INFO)
    create_output_dir: bool = False  # create a missing output folder (its parent must exist) once all else checks out
    # A fleet front end: job records and queue in this Redis, run by `vflash fleet-worker`s (the output folder is
    # shared with them); None: this process's own workers, records in memory.
    redis_url: str | None = None
    retries: int = 1  # fleet: runs of a job after the first whose worker was lost, before it fails

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise paths once, here
        set_(self, "prepared_assets", Path(self.prepared_assets).resolve())
        set_(self, "output_dir", Path(self.output_dir).resolve())
        if self.input_dir is not None:
            set_(self, "input_dir", Path(self.input_dir).resolve())
        check_input_file(self.prepared_assets, "prepared assets")
        create = check_service_settings(
            self.output_dir, self.create_output_dir, self.input_dir, self.max_queue, self.keep_finished_jobs,
            self.max_upload_bytes, self.cancel_grace_seconds, self.token
        )
        set_(self, "gpus", tuple(tuple(entry) for entry in self.gpus))
        check_workers(self.options, self.gpus, self.workers, self.torch_threads)
        RETRIES.check("retries", self.retries)
        self.worker_options()  # each worker's options are checked (a pair without a strategy, say)
        if create:
            self.output_dir.mkdir()

    def worker_options(self) -> tuple[RunOptions, ...]:
        """The run options of each worker, in slot order."""
        if not self.gpus:
            return (self.options,) * self.workers
        engines = (
            dataclasses.replace(self.options.engine, device=f"cuda:{entry[0]}",
                                peer_device=f"cuda:{entry[1]}" if len(entry) > 1 else None)
            for entry in self.gpus
        )
        return tuple(dataclasses.replace(self.options, engine=engine) for engine in engines)

    def worker_config(self, options: RunOptions, scratch_dir: Path) -> WorkerConfig:
        return WorkerConfig(
            prepared_assets=str(self.prepared_assets), options=options, scratch_dir=str(scratch_dir),
            log_level=self.log_level, torch_threads=self.torch_threads,
        )


def check_workers(
    options: RunOptions, gpus: tuple[tuple[int, ...], ...], workers: int, torch_threads: int | None
) -> None:
    """One worker per GPU (or pair), or several on the CPU; never two workers planning one GPU's memory."""
    WORKERS.check("workers", workers)
    if torch_threads is not None:
        TORCH_THREADS.check("torch_threads", torch_threads)
    if gpus and workers != 1:
        raise VflashError("give either GPUs (one worker each) or a number of CPU workers, not both")
    if workers > 1 and str(options.device) != "cpu":
        raise VflashError(
            f"{workers} workers on {options.device} would each plan that GPU's whole memory; name one GPU per worker"
        )
    seen: list[int] = []
    for entry in gpus:
        if len(entry) not in (1, 2) or not all(isinstance(index, int) and index >= 0 for index in entry):
            raise VflashError(f"a worker's GPUs are one or two CUDA indices, got {entry!r}")
        seen += entry
    if len(set(seen)) != len(seen):
        raise VflashError(f"a GPU serves one worker; {sorted(seen)} names one twice")
    if len({len(entry) for entry in gpus}) > 1:
        raise VflashError("every worker has one GPU, or every worker a pair; not a mix")


def check_service_settings(
    output_dir: Path, create_output_dir: bool, input_dir: Path | None, max_queue: int, keep_finished_jobs: int,
    max_upload_bytes: int, cancel_grace_seconds: float, token: str | None,
) -> bool:
    """Everything about a service's settings but its model, checked without writing anything (so `vflash serve
    --demo` refuses a bad folder or limit before it builds the demo model); returns whether the output folder is
    to be created."""
    output_dir = Path(output_dir).resolve()
    create = create_output_dir and not os.path.lexists(output_dir)
    if create and not output_dir.parent.is_dir():
        raise VflashError(f"output folder {output_dir} cannot be created: {output_dir.parent} is not a folder")
    if not create:
        check_folder(output_dir, "output folder")
    if not os.access(output_dir.parent if create else output_dir, os.W_OK):
        raise VflashError(f"output folder {output_dir} is not writable")
    if input_dir is not None:
        check_folder(input_dir, "input folder")
    MAX_QUEUE.check("max_queue", max_queue)
    KEEP_FINISHED_JOBS.check("keep_finished_jobs", keep_finished_jobs)
    MAX_UPLOAD_BYTES.check("max_upload_bytes", max_upload_bytes)
    CANCEL_GRACE.check("cancel_grace_seconds", cancel_grace_seconds)
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise VflashError("the bearer token must be a non-empty string")
    if token is not None and (token != token.strip() or not token.isprintable()):
        # A header value has no whitespace at its ends and no control characters, so no client could ever match it.
        raise VflashError(
            f"the bearer token {'has whitespace at an end' if token != token.strip() else 'holds a control character'} "
            "(a token read from a file ends with a newline), which no Authorization header can carry: strip it"
        )
    return create
