"""`vflash serve` with several workers behind one queue, and a worker pipelining its jobs: the embedded demo model on
the CPU, loopback only, real spawned worker processes (two per service where the test says so, each pinned to one
torch thread so that two of them share this machine's cores fairly)."""

from __future__ import annotations

import os
import signal
from itertools import pairwise

import pytest
from service_helpers import FAST, MIDDLE, published, submit, wait_for, wait_job, wait_ready

from vflash_core.service.app import SUPERVISOR, WORK_DIR

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


async def test_two_cpu_workers_share_one_queue_and_a_killed_one_fails_only_its_job(aiohttp_client, make_service):
    app, config = make_service(workers=2, torch_threads=1, pipelined=False)
    client = await aiohttp_client(app)

    async def both_ready():
        body = await (await client.get("/readyz")).json()
        return body if [worker["state"] for worker in body["workers"]] == ["ready", "ready"] else None

    ready = await wait_for(both_ready)
    pids = {worker["pid"] for worker in ready["workers"]}
    assert len(pids) == 2 and [worker["devices"] for worker in ready["workers"]] == ["cpu", "cpu"]

    victim = await submit(client, seed=1, **MIDDLE)
    bystander = await submit(client, seed=2, **MIDDLE)
    # Both run at once, one on each worker.
    running = [await wait_job(client, job_id, until=lambda job: job["status"] == "running") for job_id in (victim, bystander)]
    assert {job["worker_pid"] for job in running} == pids
    writing = await wait_job(client, victim, until=lambda job: job["progress"]["stage"] == "write")
    os.kill(writing["worker_pid"], signal.SIGKILL)
    failed = await wait_job(client, victim)
    assert failed["status"] == "failed" and "SIGKILL" in failed["error"]
    assert (await wait_job(client, bystander))["status"] == "succeeded"

    # The killed worker's slot has a fresh worker; the other slot kept its own. Both take the next jobs.
    again = await wait_for(both_ready)
    restarted = {worker["index"]: worker["restarts"] for worker in again["workers"]}
    killed_slot = next(worker["index"] for worker in ready["workers"] if worker["pid"] == writing["worker_pid"])
    assert restarted == {killed_slot: 1, 1 - killed_slot: 0}
    later = [await submit(client, seed=seed, **FAST) for seed in (3, 4, 5)]
    assert [(await wait_job(client, job_id))["status"] for job_id in later] == ["succeeded"] * 3
    metrics = await (await client.get("/metrics")).text()
    assert f'vflash_worker_restarts_total{{worker="{killed_slot}",devices="cpu"}} 1' in metrics
    assert 'vflash_worker_ready{worker="0",devices="cpu"} 1' in metrics
    assert 'vflash_worker_ready{worker="1",devices="cpu"} 1' in metrics
    assert published(config.output_dir) == sorted(config.output_dir / f"{i}.mp4" for i in (bystander, *later))
    assert app[SUPERVISOR].restarts == 1


async def render_two(aiohttp_client, make_service, pipelined: bool) -> tuple[list[bytes], list[dict]]:
    app, config = make_service(pipelined=pipelined)
    client = await aiohttp_client(app)
    await wait_ready(client)
    ids = [await submit(client, seed=seed, **MIDDLE) for seed in (11, 12)]
    jobs = [await wait_job(client, job_id) for job_id in ids]
    assert [job["status"] for job in jobs] == ["succeeded"] * 2, jobs
    videos = [(config.output_dir / f"{job_id}.mp4").read_bytes() for job_id in ids]
    assert not [p for p in app[WORK_DIR].rglob("*") if p.is_file() and p.name != "owner"]
    await client.close()
    for path in config.output_dir.glob("*.mp4"):
        path.unlink()
    return videos, jobs


async def test_a_pipelined_worker_starts_the_next_job_during_a_write_and_writes_the_same_bytes(aiohttp_client, make_service):
    serial, serial_jobs = await render_two(aiohttp_client, make_service, pipelined=False)
    pipelined, pipelined_jobs = await render_two(aiohttp_client, make_service, pipelined=True)
    assert pipelined == serial and len(set(serial)) == 2
    # Serial: each job starts after the last one ended. Pipelined: during its write, on the same worker.
    assert all(b["started_at"] >= a["finished_at"] for a, b in pairwise(serial_jobs))
    assert all(b["started_at"] < a["finished_at"] for a, b in pairwise(pipelined_jobs))
    assert len({job["worker_pid"] for job in pipelined_jobs}) == 1
    assert [job["result"]["timing"]["request_index"] for job in pipelined_jobs] == [1, 2]


async def test_cancelling_a_job_while_it_writes_spares_the_job_computing_beside_it(aiohttp_client, make_service):
    app, config = make_service(pipelined=True)
    client = await aiohttp_client(app)
    await wait_ready(client)
    first = await submit(client, seed=21, **MIDDLE)
    second = await submit(client, seed=22, **MIDDLE)
    await wait_job(client, second, until=lambda job: job["status"] == "running")
    response = await client.delete(f"/v1/jobs/{first}")
    assert response.status == 202 and (await response.json())["cancel_requested"]  # its write lasts about a second
    ended = await wait_job(client, first)
    assert ended["status"] == "cancelled"
    done = await wait_job(client, second)
    assert done["status"] == "succeeded" and done["worker_pid"] == ended["worker_pid"]
    assert published(config.output_dir) == [config.output_dir / f"{second}.mp4"]
    assert app[SUPERVISOR].restarts == 0  # nothing was interrupted: the worker goes on
