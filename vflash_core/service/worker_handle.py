"""The parent's handle on one spawned worker process: its pipes, its cancel flag, and the event-loop plumbing that
notices at once (no threads) when it sends an event or dies, even by SIGKILL."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from .worker import JobOrder, WorkerConfig, worker_main

__all__ = ["CancelRequested", "Exited", "WorkerHandle", "describe_exit"]

logger = logging.getLogger(__name__)


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
