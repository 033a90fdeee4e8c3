"""The parent's side of the worker: spawn it, feed it one job at a time, publish results, replace it when needed.

One asyncio task (`WorkerSupervisor.run`) owns the current worker process. It reads the worker's events and its
process sentinel through the event loop (no threads), so a worker that dies, even by SIGKILL, is noticed at once:
its running job fails with the exit status, its staging files are removed, and a fresh worker takes the next job.

Outputs: the worker writes each MP4 into a per-job staging folder under the service's work folder; the parent
publishes it at `<output_dir>/<job id>.mp4` with `os.link` (atomic, never overwrites) only when the job succeeded
and was not cancelled, then removes the staging folder. A killed worker therefore never leaves a partial or
stray file at an output name.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ServiceConfig
from .jobs import Job, JobState, JobStore, redact_paths
from .metrics import Histogram
from .worker import Cancelled, Failed, Fatal, Finished, JobOrder, Progress, Ready, WorkerConfig, worker_main

__all__ = ["WorkerState", "WorkerSupervisor", "describe_exit"]

logger = logging.getLogger(__name__)

# A worker that dies before it reports ready this many times in a row is treated as a fatal configuration error,
# rather than restarted forever.
MAX_STARTUP_DEATHS = 3


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"  # checks passed; idle or running a job
    FATAL = "fatal"  # a configuration error; no job can run in this process
    STOPPED = "stopped"


@dataclass(frozen=True)
class Exited:
    """Parent-side event: the worker process is gone."""

    exitcode: int | None


@dataclass(frozen=True)
class CancelRequested:
    """Parent-side event: a client cancelled the running job."""

    job_id: str


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "an unknown status"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class WorkerHandle:
    """One spawned worker process and the event-loop plumbing that watches it."""

    def __init__(self, config: WorkerConfig, loop: asyncio.AbstractEventLoop):
        ctx = multiprocessing.get_context("spawn")
        orders_out, self._orders = ctx.Pipe(duplex=False)
        self._events, events_in = ctx.Pipe(duplex=False)
        self.cancel_flag = ctx.Event()
        self.scratch = Path(config.scratch_dir)
        self.scratch.mkdir(parents=True)
        self.process = ctx.Process(
            target=worker_main, args=(config, orders_out, events_in, self.cancel_flag), name="vflash-worker",
            daemon=True
        )
        self.process.start()
        # Close the child's ends here, so the pipes report EOF when the child dies.
        orders_out.close()
        events_in.close()
        assert self.process.pid is not None  # started above
        self.pid = self.process.pid
        self.ready = False  # set by the supervisor when the worker reports `Ready`
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self.exit_code: asyncio.Future[int | None] = loop.create_future()
        self._loop = loop
        loop.add_reader(self._events.fileno(), self._on_event)
        loop.add_reader(self.process.sentinel, self._on_exit)

    @property
    def alive(self) -> bool:
        return not self.exit_code.done()

    def send(self, order: JobOrder | None) -> None:
        self._orders.send(order)

    def kill(self) -> None:
        if self.alive:
            self.process.kill()

    def _on_event(self) -> None:
        try:
            self.events.put_nowait(self._events.recv())
        except EOFError:
            self._loop.remove_reader(self._events.fileno())

    def _on_exit(self) -> None:
        self._loop.remove_reader(self.process.sentinel)
        # Events written just before the exit are still in the pipe: deliver them before `Exited`.
        self._loop.remove_reader(self._events.fileno())
        try:
            while self._events.poll():
                self.events.put_nowait(self._events.recv())
        except EOFError:
            logger.debug("worker %d: event pipe drained", self.pid)
        self.process.join()
        self.events.put_nowait(Exited(self.process.exitcode))
        self.exit_code.set_result(self.process.exitcode)

    async def stop(self, grace: float) -> None:
        """Ask the worker to stop, kill it after `grace` seconds, and release its pipes and scratch folder.

        A worker still starting holds no job and reads no orders yet: it is killed at once.
        """
        if self.alive:
            if self.ready:
                self.cancel_flag.set()
                try:
                    self.send(None)
                except OSError:  # BrokenPipeError: it is exiting already
                    logger.debug("worker %d already closed its order pipe", self.pid)
            else:
                self.kill()
            try:
                await asyncio.wait_for(asyncio.shield(self.exit_code), grace)
            except TimeoutError:
                logger.warning("worker %d did not stop within %.1f s; killing it", self.pid, grace)
                self.kill()
                await self.exit_code
        self._orders.close()
        self._events.close()
        self.process.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


class WorkerSupervisor:
    """Runs the queue on a succession of workers; the only owner of the current worker process."""

    def __init__(self, config: ServiceConfig, jobs: JobStore, work_dir: Path):
        self.config = config
        self.jobs = jobs
        self.output_dir = config.output_dir
        self.work_dir = work_dir  # created and removed by the app's lifecycle
        self.cancel_grace = config.cancel_grace_seconds
        self.state = WorkerState.STARTING
        self.fatal_error: str | None = None
        self.worker_pid: int | None = None
        self.workers_started = 0
        self.request_seconds = Histogram()  # elapsed_seconds of succeeded jobs, for /metrics
        self._handle: WorkerHandle | None = None
        self._running: Job | None = None

    @property
    def restarts(self) -> int:
        return max(0, self.workers_started - 1)

    # -- the worker task ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """The single worker task: runs until cancelled (service shutdown) or a fatal configuration error."""
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
            config = self.config.worker_config(self.work_dir / f"worker-{self.workers_started}")
            handle = self._handle = WorkerHandle(config, loop)
            self.worker_pid = handle.pid
            logger.info("started worker %d (pid %d)", self.workers_started, handle.pid)
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
                await handle.stop(self.cancel_grace)
                self._handle = None
                self.worker_pid = None
                if self.state is not WorkerState.FATAL:
                    self.state = WorkerState.STARTING

    async def _serve(self, handle: WorkerHandle) -> None:
        """Run queued jobs on `handle` until it must be replaced."""
        while True:
            taken = asyncio.ensure_future(self.jobs.take())
            try:
                either: set[asyncio.Future[Any]] = {taken, handle.exit_code}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                self._untake(taken)
                raise
            if not handle.alive:
                self._untake(taken)
                logger.error("idle worker %d exited with %s", handle.pid, describe_exit(handle.exit_code.result()))
                return
            if not await self._run_job(handle, taken.result()):
                return

    def _untake(self, taken: asyncio.Future[Job]) -> None:
        """A job taken from the queue that never reached a worker keeps its place at the head of the queue."""
        if taken.done():
            self.jobs.put_back(taken.result())
        else:
            taken.cancel()

    async def _run_job(self, handle: WorkerHandle, job: Job) -> bool:
        """Run `job` on the worker; returns whether the worker may take another job."""
        staging = self.work_dir / "jobs" / job.id
        staging.mkdir(parents=True)
        try:
            handle.send(JobOrder(job.id, job.request, str(staging / "video.mp4")))
        except OSError as exc:  # the worker died since it took its last job; its successor runs this one
            logger.warning("worker %d could not take job %s (%s)", handle.pid, job.id, exc)
            shutil.rmtree(staging)
            self.jobs.put_back(job)
            return False
        self._running = job
        job.start(handle.pid)
        logger.info("job %s started on worker %d", job.id, handle.pid)
        try:
            return await self._follow(handle, job, staging / "video.mp4")
        except asyncio.CancelledError:
            job.fail("the service stopped while this job was running")
            raise
        finally:
            self._running = None
            shutil.rmtree(staging, ignore_errors=True)
            self._release_uploads(job)
            logger.info("job %s %s", job.id, job.state.value)

    async def _follow(self, handle: WorkerHandle, job: Job, staged: Path) -> bool:
        deadline: float | None = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = await asyncio.wait_for(handle.events.get(), timeout)
            except TimeoutError:
                logger.warning(
                    "worker %d did not stop within %.1f s of a cancel; killing it", handle.pid, self.cancel_grace
                )
                handle.kill()
                deadline = None
                continue
            if isinstance(event, Progress):
                job.progress(event.stage, event.done, event.total)
            elif isinstance(event, CancelRequested):
                handle.cancel_flag.set()
                deadline = time.monotonic() + self.cancel_grace
            elif isinstance(event, Cancelled) or isinstance(event, (Finished, Failed, Exited)) and job.cancel_requested:
                # A job that ended before it saw the cancel is cancelled all the same: nothing is published.
                job.cancel()
                return False
            elif isinstance(event, Finished):
                self._publish(job, staged, event.result)
                return True
            elif isinstance(event, Failed):
                job.fail(redact_paths(event.message, (job.upload_dir, self.work_dir, self.config.input_dir)))
                return not event.worker_exits
            elif isinstance(event, Exited):
                job.fail(
                    f"the worker process (pid {handle.pid}) exited with "
                    f"{describe_exit(event.exitcode)} while running this job"
                )
                return False
            else:
                raise TypeError(f"unexpected worker event {event!r}")

    def _publish(self, job: Job, staged: Path, result: dict[str, Any]) -> None:
        final = self.output_dir / f"{job.id}.mp4"
        try:
            os.link(staged, final)  # atomic; fails rather than overwrite
        except OSError as exc:
            job.fail(f"could not publish the video at {final.name}: {exc}")
            return
        job.succeed(final, {"path": final.name, **result})
        self.request_seconds.observe(float(result["elapsed_seconds"]))

    def _release_uploads(self, job: Job) -> None:
        if job.upload_dir is not None:
            shutil.rmtree(job.upload_dir, ignore_errors=True)

    def go_fatal(self, message: str) -> None:
        """No job can run in this process: /readyz fails, queued jobs fail, submissions get 503."""
        logger.error("the worker cannot run on this configuration: %s", message)
        self.state, self.fatal_error = WorkerState.FATAL, message
        for job in self.jobs.drain_queue():
            job.fail(f"the service cannot run jobs: {message}")
            self._release_uploads(job)

    # -- called by handlers ---------------------------------------------------------------------------------------

    def cancel(self, job: Job) -> None:
        """Cancel a queued job now, or ask the worker to stop the running one (it is replaced afterwards)."""
        if job.state is JobState.QUEUED:
            self.jobs.remove_queued(job)
            job.cancel()
            self._release_uploads(job)
        elif job.state is JobState.RUNNING and not job.cancel_requested:
            assert self._handle is not None and self._running is job
            job.cancel_requested = True
            self._handle.events.put_nowait(CancelRequested(job.id))
