"""A Redis-backed fleet on the demo model: a real `redis-server` of this test on a free loopback port (its own temporary
folder, never the system's service), two `vflash fleet-worker` processes on the CPU sharing one output folder, and
fleet front ends (`ServiceConfig.redis_url`) built and thrown away around them.

The Redis server and the two workers are shared by the module's tests, in file order: after one worker is killed,
the next tests run on the other until one stops it; the tests after that need no worker.
In CI (`CI=true`) a missing `redis-server` or redis-py fails the module; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import FormData
from service_helpers import FAST, MIDDLE, SLOW, png, submit, wait_for, wait_job

from vflash_core.service import ServiceConfig, create_app

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_SECONDS = 2.0  # a killed worker is lost after this long


def _require_redis() -> str:
    missing = []
    server = shutil.which("redis-server")
    if server is None:
        missing.append("redis-server (Debian: apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install -e '.[fleet]')")
    if missing:
        message = f"the fleet tests need {' and '.join(missing)}"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    assert server is not None
    return server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_redis(server: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """A redis-server of this test's own on a free loopback port, answering pings; nothing saved."""
    import redis

    port = _free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "", "--appendonly", "no"],
        stdout=(folder / "redis.log").open("w"), stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return process, url
        except redis.ConnectionError:
            assert process.poll() is None and time.monotonic() < deadline, (folder / "redis.log").read_text()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    process, url = start_redis(_require_redis(), tmp_path_factory.mktemp("redis"))
    yield url
    process.terminate()
    process.wait(10)


class Fleet:
    def __init__(self, url: str, receipt: Path, output_dir: Path, workers: list[subprocess.Popen], logs: list[Path]):
        self.url, self.receipt, self.output_dir, self.workers, self.logs = url, receipt, output_dir, workers, logs

    def front_end(self, **changes: Any):
        settings = {"redis_url": self.url, **changes}
        config = ServiceConfig(prepared_assets=self.receipt, output_dir=self.output_dir, **settings)
        return create_app(config)

    def log_text(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in self.logs)


@pytest.fixture(scope="module")
def fleet(redis_url, demo_receipt, tmp_path_factory):
    """Two fleet workers (one torch thread each) on the shared output folder."""
    shared = tmp_path_factory.mktemp("shared-out")
    logs = [shared.parent / f"fleet-worker-{index}.log" for index in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "vflash_core.cli.main", "fleet-worker", "--redis", redis_url, "--prepared-assets",
             str(demo_receipt), "--output-dir", str(shared), "--worker-threads", "1",
             "--heartbeat", str(HEARTBEAT_SECONDS), "--cancel-grace", "3"],  # a worker loading its model is killed
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,  # a group: a host to lose
        )
        for log in logs
    ]
    yield Fleet(redis_url, demo_receipt, shared, workers, logs)
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()  # a graceful stop: its jobs go back to the queue
    for worker in workers:
        worker.wait(30)


async def ready_workers(client, count: int) -> list[dict[str, Any]]:
    async def ready():
        body = await (await client.get("/readyz")).json()
        views = [view for view in body["workers"] if view["state"] == "ready"]
        return views if len(views) == count and len(body["workers"]) == count else None

    return await wait_for(ready, timeout=120)


def published(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


@pytest.mark.asyncio
async def test_two_fleet_workers_run_jobs_side_by_side_and_publish_to_the_shared_folder(aiohttp_client, fleet):
    client = await aiohttp_client(fleet.front_end())
    views = await ready_workers(client, 2)
    assert len({view["worker"] for view in views}) == 2 and {view["devices"] for view in views} == {"cpu"}

    ids = [await submit(client, seed=seed, **FAST) for seed in (1, 2)]
    jobs = [await wait_job(client, job_id) for job_id in ids]
    assert [job["status"] for job in jobs] == ["succeeded"] * 2, fleet.log_text()
    first, second = jobs
    assert first["worker_pid"] != second["worker_pid"]  # one on each worker, at the same time
    assert first["started_at"] < second["finished_at"] and second["started_at"] < first["finished_at"]
    assert [job["attempts"] for job in jobs] == [1, 1]
    video = await client.get(f"/v1/jobs/{ids[0]}/video")
    assert video.status == 200 and await video.read() == (fleet.output_dir / f"{ids[0]}.mp4").read_bytes()
    assert set(published(fleet.output_dir)) >= {f"{job_id}.mp4" for job_id in ids}
    metrics = await (await client.get("/metrics")).text()
    assert 'vflash_jobs{state="succeeded"} 2' in metrics and "vflash_request_seconds_count 2" in metrics
    assert sum(line.startswith("vflash_worker_ready{") and line.endswith(" 1") for line in metrics.splitlines()) == 2


@pytest.mark.asyncio
async def test_a_restarted_front_end_serves_the_jobs_in_flight(aiohttp_client, fleet, tmp_path):
    first = await aiohttp_client(fleet.front_end())
    form = FormData()
    form.add_field("request", json.dumps({"prompt": "<Picture 1> starts to move", "seed": 3, **FAST}),
                   content_type="application/json")
    form.add_field("first_frame", png(tmp_path / "first.png").read_bytes(), filename="first.png",
                   content_type="image/png")
    response = await first.post("/v1/jobs", data=form)
    assert response.status == 202, await response.text()
    ids = [(await response.json())["id"], await submit(first, seed=4, **FAST), await submit(first, seed=5, **MIDDLE)]
    await first.close()  # the front end stops with its jobs queued or running

    second = await aiohttp_client(fleet.front_end())
    assert (await (await second.get(f"/v1/jobs/{ids[2]}")).json())["status"] in ("queued", "running")
    jobs = [await wait_job(second, job_id) for job_id in ids]
    assert [job["status"] for job in jobs] == ["succeeded"] * 3, fleet.log_text()
    assert jobs[0]["result"]["mode"] == "i2va" and jobs[1]["result"]["mode"] == "t2va"
    assert not (fleet.output_dir / ".vflash-fleet" / "uploads" / ids[0]).exists()  # removed once the job ended
    assert (await second.get(f"/v1/jobs/{ids[2]}/video")).status == 200


@pytest.mark.asyncio
async def test_queued_jobs_of_a_lost_worker_run_again_or_fail_with_their_record(aiohttp_client, fleet):
    """The re-queue policy on the real broker, in a database of its own that no worker serves: a job whose worker
    was lost runs again while it has retries, else fails with its record kept; a queued job is cancelled at once."""
    import redis

    from vflash_core.service.fleet_store import QUEUE, WORKERS, job_key, processing_key, reap_lost_workers

    url = fleet.url.rsplit("/", 1)[0] + "/1"
    broker = redis.Redis.from_url(url, decode_responses=True)
    retried_app, final_app = fleet.front_end(redis_url=url, retries=1), fleet.front_end(redis_url=url, retries=0)
    retried_client, final_client = await aiohttp_client(retried_app), await aiohttp_client(final_app)
    retried, final = await submit(retried_client, seed=7, **FAST), await submit(final_client, seed=8, **FAST)
    for job_id in (retried, final):  # a worker that claimed and started both, then vanished without a heartbeat
        assert broker.blmove(QUEUE, processing_key("ghost:1"), 1, "RIGHT", "LEFT") in (retried, final)
        broker.hset(job_key(job_id), mapping={"state": "running", "started": repr(time.time()), "attempts": "1"})
    broker.sadd(WORKERS, "ghost:1")

    assert reap_lost_workers(broker) == [final]
    again, failed = [await (await retried_client.get(f"/v1/jobs/{i}")).json() for i in (retried, final)]
    assert again["status"] == "queued" and again["queue_position"] == 1 and again["attempts"] == 1
    assert failed["status"] == "failed" and "ghost:1" in failed["error"] and "heartbeat" in failed["error"]
    assert failed["attempts"] == 1 and failed["finished_at"] is not None
    assert not broker.exists(processing_key("ghost:1")) and not broker.sismember(WORKERS, "ghost:1")

    response = await final_client.delete(f"/v1/jobs/{retried}")  # queued: cancelled at once
    assert response.status == 200 and (await response.json())["status"] == "cancelled"
    assert broker.llen(QUEUE) == 0
    broker.flushdb()


@pytest.mark.asyncio
async def test_a_lost_fleet_worker_s_job_runs_again_on_the_other_worker(aiohttp_client, fleet):
    client = await aiohttp_client(fleet.front_end())
    views = await ready_workers(client, 2)
    job_id = await submit(client, seed=9, **MIDDLE)
    running = await wait_job(client, job_id, until=lambda job: job["status"] == "running")
    lost = next(view for view in views if view["pid"] == running["worker_pid"])
    worker = next(w for w in fleet.workers if lost["worker"].endswith(f":{w.pid}"))
    os.killpg(worker.pid, signal.SIGKILL)  # the host is gone: the fleet worker and its engine process
    worker.wait(10)

    done = await wait_job(client, job_id)
    assert done["status"] == "succeeded" and done["attempts"] == 2, (done, fleet.log_text())
    assert done["worker_pid"] != running["worker_pid"]
    assert (fleet.output_dir / f"{job_id}.mp4").is_file()
    survivors = await ready_workers(client, 1)  # the lost worker left /readyz with its heartbeat
    assert survivors[0]["worker"] != lost["worker"]


@pytest.mark.asyncio
async def test_cancel_reaches_the_running_fleet_worker(aiohttp_client, fleet):
    client = await aiohttp_client(fleet.front_end())
    await ready_workers(client, 1)  # the one the test before left
    job_id = await submit(client, seed=6, **SLOW)
    running = await wait_job(client, job_id, until=lambda job: job["evaluations"]["done"] >= 1)
    # The fleet worker forwards a cancel on its heartbeat, and a fast machine can finish the demo request first: the
    # engine process waits, frozen, until the fleet worker says it forwarded the cancel, so it lands mid-request.
    os.kill(running["worker_pid"], signal.SIGSTOP)
    try:
        response = await client.delete(f"/v1/jobs/{job_id}")
        assert response.status == 202 and (await response.json())["cancel_requested"]

        async def forwarded() -> bool:
            return f"job {job_id}: a client cancelled it" in fleet.log_text()

        await wait_for(forwarded, timeout=30)
    finally:
        os.kill(running["worker_pid"], signal.SIGCONT)
    ended = await wait_job(client, job_id, timeout=30)
    assert ended["status"] == "cancelled" and ended["evaluations"]["done"] < ended["evaluations"]["total"]
    assert f"{job_id}.mp4" not in published(fleet.output_dir)
    assert (await client.delete(f"/v1/jobs/{job_id}")).status == 409


@pytest.mark.asyncio
async def test_a_stopped_fleet_worker_gives_its_running_job_back_to_the_queue(aiohttp_client, fleet):
    client = await aiohttp_client(fleet.front_end())
    (view,) = await ready_workers(client, 1)
    job_id = await submit(client, seed=10, **MIDDLE)
    await wait_job(client, job_id, until=lambda job: job["status"] == "running")
    worker = next(w for w in fleet.workers if view["worker"].endswith(f":{w.pid}"))
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, fleet.log_text()

    back = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert (back["status"], back["queue_position"], back["attempts"]) == ("queued", 1, 0), back  # no retry spent
    assert (await (await client.get("/readyz")).json())["workers"] == []
    assert f"{job_id}.mp4" not in published(fleet.output_dir)


@pytest.mark.asyncio
async def test_a_front_end_whose_redis_went_away_answers_503(aiohttp_client, fleet, tmp_path):
    process, url = start_redis(_require_redis(), tmp_path)
    client = await aiohttp_client(fleet.front_end(redis_url=url))
    job_id = await submit(client, seed=11, **FAST)  # accepted: no worker serves this Redis
    process.kill()
    process.wait(10)
    for response in (await client.get(f"/v1/jobs/{job_id}"), await client.post("/v1/jobs", json={"prompt": "x"})):
        assert response.status == 503
        assert (await response.json())["error"].startswith("the job store (Redis) is unavailable")


def test_the_fleet_commands_refuse_in_one_line(capsys, demo_receipt, tmp_path):
    from vflash_core.cli.main import main

    _require_redis()
    dead = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    assert main(["serve", "--demo", "--redis", dead, "--workers", "2", "--output-dir", str(tmp_path)]) == 2
    assert "a fleet front end (--redis) runs no worker" in capsys.readouterr().err
    worker = ["fleet-worker", "--redis", dead, "--prepared-assets", str(demo_receipt), "--output-dir", str(tmp_path)]
    assert main(worker) == 1
    assert f"cannot reach the fleet's Redis at {dead}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
