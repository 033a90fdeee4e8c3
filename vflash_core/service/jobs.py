"""Job records and the bounded FIFO queue: in memory here (job state belongs to the HTTP process, not the worker), or
in Redis for a fleet (`fleet_store`), behind the same two interfaces (`JobRecords` for the HTTP handlers, `JobQueue`
for the worker supervisor).

A job's record lives in the parent and outlives any worker process: a worker that dies mid-job cannot take the
record with it. The in-memory records are never persisted; `vflash serve --redis` keeps them in Redis instead.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "JOB_ID_PATTERN", "Job", "JobQueue", "JobRecords", "JobState", "JobStore", "QueueFullError", "new_job_id",
    "redact_paths",
]


class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


JOB_ID_PATTERN = re.compile(r"[0-9a-f]{32}")


def new_job_id() -> str:
    """128 random bits as hex: unguessable by other clients, and safe as a file name."""
    return secrets.token_hex(16)


def redact_paths(message: str, folders: Iterable[Path | None]) -> str:
    """`message` for a client: the service's own folders are cut from the paths it quotes (an upload reads as its
    service-given name, an input as its path inside the input folder)."""
    for folder in sorted((f for f in folders if f is not None), key=lambda f: len(str(f)), reverse=True):
        message = message.replace(f"{folder}{os.sep}", "")
    return message


class QueueFullError(Exception):
    """The queue already holds `max_queue` jobs."""


@dataclass
class Job:
    id: str
    request: Any  # vflash_core.pipeline.h3_pipeline.VideoRequest; typed loosely so this module imports without torch
    upload_dir: Path | None  # service-owned copies of uploaded inputs, removed once the job ends
    created: float = field(default_factory=time.time)
    state: JobState = JobState.QUEUED
    started: float | None = None
    finished: float | None = None
    worker_pid: int | None = None
    attempts: int = 0  # times a worker started it (a fleet re-queues a lost worker's job)
    stage: str | None = None
    stage_done: int = 0
    stage_total: int = 0
    evaluations_done: int = 0
    evaluations_total: int | None = None
    cancel_requested: bool = False
    error: str | None = None
    output: Path | None = None  # the published MP4, set only when the job succeeded
    result: dict[str, Any] | None = None  # VideoResult fields (stages, session timing, geometry, metadata)

    def start(self, worker_pid: int) -> None:
        self.state, self.started, self.worker_pid = JobState.RUNNING, time.time(), worker_pid
        self.attempts += 1

    def progress(self, stage: str, done: int, total: int) -> None:
        self.stage, self.stage_done, self.stage_total = stage, done, total
        if stage == "denoise":
            self.evaluations_done, self.evaluations_total = done, total

    def succeed(self, output: Path, result: dict[str, Any]) -> None:
        self.output, self.result = output, result
        self._finish(JobState.SUCCEEDED)

    def fail(self, error: str) -> None:
        self.error = error
        self._finish(JobState.FAILED)

    def cancel(self) -> None:
        self._finish(JobState.CANCELLED)

    def _finish(self, state: JobState) -> None:
        assert not self.state.terminal, f"job {self.id} is already {self.state.value}"
        self.state, self.finished = state, time.time()

    def view(self, queue_position: int | None = None) -> dict[str, Any]:
        """The JSON a client sees. Times are UTC ISO 8601; durations are seconds measured by the service."""
        return {
            "id": self.id,
            "status": self.state.value,
            "created_at": _iso(self.created),
            "started_at": _iso(self.started),
            "finished_at": _iso(self.finished),
            "queue_position": queue_position,
            "progress": {"stage": self.stage, "done": self.stage_done, "total": self.stage_total},
            "evaluations": {"done": self.evaluations_done, "total": self.evaluations_total},
            "timings": {
                "queued_seconds": None if self.started is None else self.started - self.created,
                "run_seconds": None if self.started is None or self.finished is None else self.finished - self.started,
            },
            "cancel_requested": self.cancel_requested,
            "worker_pid": self.worker_pid,
            "attempts": self.attempts,
            "error": self.error,
            "result": self.result,
            "video_url": f"/v1/jobs/{self.id}/video" if self.state is JobState.SUCCEEDED else None,
        }


def _iso(stamp: float | None) -> str | None:
    return None if stamp is None else datetime.fromtimestamp(stamp, UTC).isoformat()


class JobRecords(Protocol):
    """What the HTTP handlers need of the job records."""

    max_queue: int

    def get(self, job_id: str) -> Job | None: ...
    def check_capacity(self) -> None: ...
    def add(self, job: Job) -> None: ...
    def queue_position(self, job: Job) -> int | None: ...
    def counts(self) -> dict[JobState, int]: ...


class JobQueue(Protocol):
    """What the worker supervisor needs of the queue."""

    async def take(self) -> Job: ...
    def put_back(self, job: Job) -> None: ...
    def remove_queued(self, job: Job) -> None: ...
    def drain_queue(self) -> list[Job]: ...


class JobStore:
    """The jobs this process remembers, and the FIFO of those still queued (at most `max_queue`).

    Records of ended jobs are forgotten, those that ended first going first, once more than `keep_finished` have
    ended (checked whenever a job is added), so a long-running service holds a bounded number of records; a
    forgotten job's published video stays in the output folder.
    """

    def __init__(self, max_queue: int, keep_finished: int = 1000):
        self.max_queue = max_queue
        self.keep_finished = keep_finished
        self._jobs: dict[str, Job] = {}
        self._queue: collections.deque[Job] = collections.deque()
        self._queued = asyncio.Event()

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def check_capacity(self) -> None:
        if len(self._queue) >= self.max_queue:
            raise QueueFullError(f"the queue is full ({self.max_queue} jobs waiting); retry later")

    def add(self, job: Job) -> None:
        self.check_capacity()
        self._forget_finished()
        self._jobs[job.id] = job
        self._queue.append(job)
        self._queued.set()

    def _forget_finished(self) -> None:
        ended = sorted((job for job in self._jobs.values() if job.state.terminal), key=lambda job: job.finished or 0.0)
        for job in ended[: max(0, len(ended) - self.keep_finished)]:
            del self._jobs[job.id]

    async def take(self) -> Job:
        """The oldest queued job, removed from the queue (still `queued` until the caller starts it)."""
        while not self._queue:
            self._queued.clear()
            await self._queued.wait()
        return self._queue.popleft()

    def put_back(self, job: Job) -> None:
        """Return a job that was taken but never reached a worker to the head of the queue."""
        self._queue.appendleft(job)
        self._queued.set()

    def remove_queued(self, job: Job) -> None:
        self._queue.remove(job)

    def drain_queue(self) -> list[Job]:
        jobs = list(self._queue)
        self._queue.clear()
        return jobs

    def queue_position(self, job: Job) -> int | None:
        """1 for the next job to run; None when the job is not queued."""
        if job.state is not JobState.QUEUED:
            return None
        return next((index + 1 for index, queued in enumerate(self._queue) if queued is job), None)

    def counts(self) -> dict[JobState, int]:
        counts = dict.fromkeys(JobState, 0)
        for job in self._jobs.values():
            counts[job.state] += 1
        return counts
