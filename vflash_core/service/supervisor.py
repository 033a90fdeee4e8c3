"""The parent's side of the workers: one slot per worker (a GPU, a GPU pair, or on the CPU one of `--workers`), all
taking jobs from one queue; each slot spawns its worker, feeds it jobs, publishes results and replaces it when needed.

Each slot is one asyncio task that owns its current worker process (`WorkerHandle`). A worker that dies, even by
SIGKILL, is noticed at once: the jobs it held fail with the exit status, their staging files are removed, and a fresh
worker takes the slot's next job. The other slots are not disturbed.

Pipelining: a worker reports `Writing` once a job's decode is done and only its MP4's write on CPU threads is left.
When the service pipelines and the worker says the write fits beside another request (`Writing.overlap`, from the
memory plan), the slot hands it the next queued job at once, so that job's encode and denoise run during the write.

Outputs: the worker writes each MP4 into a per-job staging folder under the service's work folder; the parent
publishes it at `<output_dir>/<job id>.mp4` with `os.link` (atomic, never overwrites) only when the job succeeded
and was not cancelled, then removes the staging folder. A killed worker therefore never leaves a partial or
stray file at an output name.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..pipeline.options import RunOptions
from .config import ServiceConfig
from .jobs import Job, JobQueue, JobState, redact_paths
from .metrics import Histogram, WorkerSeries
from .worker import Cancelled, Failed, Fatal, Finished, JobOrder, Progress, Ready, Writing
from .worker_handle import CancelRequested, Exited, WorkerHandle, describe_exit

__all__ = ["WorkerSlot", "WorkerState", "WorkerSupervisor", "describe_exit"]

logger = logging.getLogger(__name__)

# A worker that dies before it reports ready this many times in a row is treated as a fatal configuration error,
# rather than restarted forever.
MAX_STARTUP_DEATHS = 3


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"  # checks passed; idle or running jobs
    FATAL = "fatal"  # a configuration error; no job can run on this slot
    STOPPED = "stopped"


def describe_devices(options: RunOptions) -> str:
    """`cpu`, `cuda:0`, or `cuda:0+cuda:1` for a pair."""
    return str(options.device) + ("" if options.peer_device is None else f"+{options.peer_device}")


class WorkerSlot:
    """One worker's place in the service: a succession of worker processes on the same devices."""

    def __init__(self, index: int, options: RunOptions, supervisor: WorkerSupervisor):
        self.index = index
        self.options = options
        self.devices = describe_devices(options)
        self.supervisor = supervisor
        self.state = WorkerState.STARTING
        self.fatal_error: str | None = None
        self.worker_pid: int | None = None
        self.workers_started = 0
        self.running: dict[str, Job] = {}  # jobs on the current worker: at most one computing, one writing
        self._overlap: dict[str, bool] = {}  # jobs whose write started -> whether another job may run beside it
        self._handle: WorkerHandle | None = None

    @property
    def restarts(self) -> int:
        return max(0, self.workers_started - 1)

    def view(self) -> dict[str, Any]:
        return {
            "index": self.index, "devices": self.devices, "state": self.state.value, "pid": self.worker_pid,
            "jobs": list(self.running), "restarts": self.restarts, "error": self.fatal_error,
        }

    async def run(self) -> None:
        try:
            await self._supervise()
        except asyncio.CancelledError:
            self.state = WorkerState.STOPPED
            raise

    async def _supervise(self) -> None:
        startup_deaths = 0
        loop = asyncio.get_running_loop()
        while True:
            self.state = WorkerState.STARTING
            self.workers_started += 1
            folder = self.supervisor.work_dir / f"worker-{self.index}-{self.workers_started}"
            handle = self._handle = WorkerHandle(self.supervisor.config.worker_config(self.options, folder), loop)
            self.worker_pid = handle.pid
            logger.info("worker %d on %s started (pid %d)", self.index, self.devices, handle.pid)
            try:
                event = await handle.events.get()
                if isinstance(event, Fatal):
                    self.go_fatal(event.message)
                    return
                if isinstance(event, Exited):
                    startup_deaths += 1
                    logger.error("worker %d died during startup with %s", handle.pid, describe_exit(event.exitcode))
                    if startup_deaths >= MAX_STARTUP_DEATHS:
                        self.go_fatal(
                            f"the worker died during startup {startup_deaths} times in a row "
                            f"(last: {describe_exit(event.exitcode)})"
                        )
                        return
                    continue
                assert isinstance(event, Ready), event
                startup_deaths = 0
                handle.ready = True
                self.state = WorkerState.READY
                logger.info("worker %d ready: %s", handle.pid, event.info)
                await self._serve(handle)
            finally:
                await handle.stop(self.supervisor.cancel_grace)
                self._handle = None
                self.worker_pid = None
                if self.state is not WorkerState.FATAL:
                    self.state = WorkerState.STARTING

    def go_fatal(self, message: str) -> None:
        logger.error("worker %d on %s cannot run on this configuration: %s", self.index, self.devices, message)
        self.state, self.fatal_error = WorkerState.FATAL, message
        self.supervisor.slot_went_fatal()

    # -- one worker process ---------------------------------------------------------------------------------------

    def _may_take(self, handle: WorkerHandle) -> bool:
        """An idle worker takes a job; a busy one only while its one job writes beside room for another."""
        if not handle.alive or not self.running:
            return handle.alive
        writing = [self._overlap.get(job_id, False) for job_id in self.running]
        return self.supervisor.config.pipelined and writing == [True]

    async def _serve(self, handle: WorkerHandle) -> None:
        """Run queued jobs on `handle` until it must be replaced (and the jobs it holds have ended)."""
        accepting = True  # false once the worker must be replaced: after a cancel, a worker-ending failure, its exit
        kill_at: float | None = None  # a cancelled job's grace ends here
        taken: asyncio.Future[Job] | None = None
        event: asyncio.Future[object] | None = None
        try:
            while accepting or self.running:
                if taken is None and accepting and self._may_take(handle):
                    taken = asyncio.ensure_future(self.supervisor.jobs.take())
                event = event or asyncio.ensure_future(handle.events.get())
                timeout = None if kill_at is None else max(0.0, kill_at - time.monotonic())
                waits: set[asyncio.Future[Any]] = {event} if taken is None else {event, taken}
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    logger.warning("worker %d did not stop within %.1f s of a cancel; killing it", handle.pid,
                                   self.supervisor.cancel_grace)
                    handle.kill()
                    kill_at = None
                    continue
                if event in done:
                    outcome, event = self._on_event(handle, event.result()), None
                    accepting = accepting and outcome != "replace"
                    if outcome == "cancelling":
                        accepting, kill_at = False, time.monotonic() + self.supervisor.cancel_grace
                if taken is not None and taken.done():
                    job, taken = taken.result(), None
                    if not (accepting and self._may_take(handle) and self._send(handle, job)):
                        self.supervisor.jobs.put_back(job)
                        accepting = accepting and handle.alive
        finally:
            if taken is not None:
                self.supervisor.untake(taken)
            if event is not None:
                event.cancel()
            for job in list(self.running.values()):  # only when the service stops: the loop waits for them
                job.fail("the service stopped while this job was running")
                self._ended(job)

    def _send(self, handle: WorkerHandle, job: Job) -> bool:
        staging = self._staging(job)
        staging.mkdir(parents=True)
        try:
            handle.send(JobOrder(job.id, job.request, str(staging / "video.mp4")))
        except OSError as exc:  # the worker died since it took its last job; a successor runs this one
            logger.warning("worker %d could not take job %s (%s)", handle.pid, job.id, exc)
            shutil.rmtree(staging)
            return False
        self.running[job.id] = job
        job.start(handle.pid)
        logger.info("job %s started on worker %d (%s)", job.id, handle.pid, self.devices)
        return True

    def _on_event(self, handle: WorkerHandle, event: object) -> str:
        """Apply one worker event; returns "replace" when the worker must not take another job, "cancelling" when
        it was asked to stop its computing job, else "ok"."""
        job = self.running.get(getattr(event, "job_id", ""))
        if isinstance(event, Exited):
            for held in list(self.running.values()):
                if held.cancel_requested:
                    held.cancel()
                else:
                    held.fail(
                        f"the worker process (pid {handle.pid}) exited with {describe_exit(event.exitcode)} while "
                        "running this job"
                    )
                self._ended(held)
            if not self.running and event.exitcode is not None and handle.ready:
                logger.info("worker %d exited with %s", handle.pid, describe_exit(event.exitcode))
            return "replace"
        if job is None:  # a cancel or late event for a job that already ended
            return "ok"
        if isinstance(event, Progress):
            job.progress(event.stage, event.done, event.total)
        elif isinstance(event, Writing):
            self._overlap[job.id] = event.overlap
        elif isinstance(event, CancelRequested):
            if job.id in self._overlap:  # only its write is left: it finishes and is not published
                return "ok"
            handle.cancel_flag.set()
            return "cancelling"
        elif isinstance(event, Cancelled):
            job.cancel()
            self._ended(job)
            return "replace"
        elif isinstance(event, Finished):
            if job.cancel_requested:  # a job that ended before it saw the cancel is cancelled all the same
                job.cancel()
            else:
                self.supervisor.publish(job, self._staging(job) / "video.mp4", event.result)
            self._ended(job)
        elif isinstance(event, Failed):
            job.fail(redact_paths(event.message, (job.upload_dir, self.supervisor.work_dir,
                                                  self.supervisor.config.input_dir)))
            self._ended(job)
            return "replace" if event.worker_exits else "ok"
        else:
            raise TypeError(f"unexpected worker event {event!r}")
        return "ok"

    def _staging(self, job: Job) -> Path:
        return self.supervisor.work_dir / "jobs" / job.id

    def _ended(self, job: Job) -> None:
        self.running.pop(job.id, None)
        self._overlap.pop(job.id, None)
        shutil.rmtree(self._staging(job), ignore_errors=True)
        self.supervisor.release_uploads(job)
        logger.info("job %s %s", job.id, job.state.value)

    def request_cancel(self, job: Job) -> None:
        assert self._handle is not None and job.id in self.running
        job.cancel_requested = True
        self._handle.events.put_nowait(CancelRequested(job.id))


class WorkerSupervisor:
    """Runs the one queue on the service's worker slots; the only owner of the worker processes."""

    def __init__(self, config: ServiceConfig, jobs: JobQueue, work_dir: Path):
        self.config = config
        self.jobs = jobs
        self.output_dir = config.output_dir
        self.work_dir = work_dir  # created and removed by the app's lifecycle
        self.cancel_grace = config.cancel_grace_seconds
        self.slots = [WorkerSlot(index, options, self) for index, options in enumerate(config.worker_options())]
        self.request_seconds = Histogram()  # elapsed_seconds of succeeded jobs, for /metrics
        self._stopped = False
        self._error: str | None = None  # an internal error that stopped every slot

    @property
    def state(self) -> WorkerState:
        """Ready while any worker is; fatal once every one is."""
        states = {slot.state for slot in self.slots}
        if self._stopped:
            return WorkerState.STOPPED
        if WorkerState.READY in states:
            return WorkerState.READY
        return WorkerState.FATAL if states == {WorkerState.FATAL} else WorkerState.STARTING

    @property
    def fatal_error(self) -> str | None:
        if self._error is not None or self.state is not WorkerState.FATAL:
            return self._error
        return "; ".join(dict.fromkeys(slot.fatal_error or "" for slot in self.slots))

    @property
    def restarts(self) -> int:
        return sum(slot.restarts for slot in self.slots)

    def worker_views(self) -> list[dict[str, Any]]:
        return [slot.view() for slot in self.slots]

    def worker_series(self) -> list[WorkerSeries]:
        return [
            WorkerSeries(str(slot.index), slot.devices, slot.state is WorkerState.READY, slot.restarts,
                         len(slot.running))
            for slot in self.slots
        ]

    async def run(self) -> None:
        """The slots' tasks: run until cancelled (service shutdown) or every slot met a fatal configuration error."""
        try:
            async with asyncio.TaskGroup() as group:
                for slot in self.slots:
                    group.create_task(slot.run(), name=f"vflash-worker-slot-{slot.index}")
        except asyncio.CancelledError:
            self._stopped = True
            raise

    def slot_went_fatal(self) -> None:
        """No job can run once every slot is fatal: /readyz fails, queued jobs fail, submissions get 503."""
        if self.state is WorkerState.FATAL:
            for job in self.jobs.drain_queue():
                job.fail(f"the service cannot run jobs: {self.fatal_error}")
                self.release_uploads(job)

    def go_fatal(self, message: str) -> None:
        """An internal error stopped every slot."""
        self._error = message
        for slot in self.slots:
            slot.state, slot.fatal_error = WorkerState.FATAL, message
        self.slot_went_fatal()

    def untake(self, taken: asyncio.Future[Job]) -> None:
        """A job taken from the queue that never reached a worker keeps its place at the head of the queue."""
        if taken.done() and not taken.cancelled():
            self.jobs.put_back(taken.result())
        else:
            taken.cancel()

    def publish(self, job: Job, staged: Path, result: dict[str, Any]) -> None:
        final = self.output_dir / f"{job.id}.mp4"
        try:
            os.link(staged, final)  # atomic; fails rather than overwrite
        except OSError as exc:
            job.fail(f"could not publish the video at {final.name}: {exc}")
            return
        job.succeed(final, {"path": final.name, **result})
        self.request_seconds.observe(float(result["elapsed_seconds"]))

    def release_uploads(self, job: Job) -> None:
        if job.upload_dir is not None:
            shutil.rmtree(job.upload_dir, ignore_errors=True)

    # -- called by handlers ---------------------------------------------------------------------------------------

    def cancel(self, job: Job) -> None:
        """Cancel a queued job now, or ask its worker to stop it (that worker is replaced afterwards)."""
        if job.state is JobState.QUEUED:
            self.jobs.remove_queued(job)
            job.cancel()
            self.release_uploads(job)
        elif job.state is JobState.RUNNING and not job.cancel_requested:
            slot = next(slot for slot in self.slots if job.id in slot.running)
            slot.request_cancel(job)
