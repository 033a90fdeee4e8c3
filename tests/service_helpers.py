"""What the service tests share: the requests they send, a factory of apps serving the demo model, and the client
steps (submit, poll until a state, wait for readiness) over aiohttp's test client."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from vflash_core.service import ServiceConfig, create_app
from vflash_core.service.app import WORK_DIR_OWNER

FAST: dict[str, Any] = {"duration_seconds": 5, "width": 32, "height": 32}  # the cheapest complete request
SLOW: dict[str, Any] = {"duration_seconds": 5}  # the demo's default 448x256 canvas
# A quarter of the default canvas: its MP4 stage (what the kill test waits for) still lasts about a second.
MIDDLE: dict[str, Any] = {"duration_seconds": 5, "width": 224, "height": 128}
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def make_service(demo_receipt, tmp_path):
    """An app serving the demo model (the run's shared demo build), publishing into `tmp_path / "out"`."""

    def make(**changes: Any) -> tuple[web.Application, ServiceConfig]:
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        config = ServiceConfig(prepared_assets=demo_receipt, output_dir=out, **changes)
        return create_app(config), config

    return make


def png(path: Path, size: tuple[int, int] = (64, 64)) -> Path:
    import PIL.Image

    PIL.Image.new("RGB", size, (200, 40, 40)).save(path)
    return path


async def wait_for(predicate, timeout: float = 120.0, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(poll)


async def wait_ready(client) -> dict[str, Any]:
    async def ready():
        response = await client.get("/readyz")
        return (await response.json()) if response.status == 200 else None

    return await wait_for(ready)


async def job_status(client, job_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/jobs/{job_id}")
    assert response.status == 200
    return await response.json()


async def wait_job(client, job_id: str, until=lambda job: job["status"] in TERMINAL, timeout: float = 180.0) -> dict[str, Any]:
    async def reached():
        job = await job_status(client, job_id)
        assert until(job) or job["status"] not in TERMINAL, f"job ended before the awaited point: {job}"
        return job if until(job) else None

    return await wait_for(reached, timeout)


async def submit(client, **fields: Any) -> str:
    response = await client.post("/v1/jobs", json={"prompt": "a lighthouse at dusk", **fields})
    body = await response.json()
    assert response.status == 202, body
    return body["id"]


def files_under(folder: Path) -> list[Path]:
    """Files in a work folder besides its owner stamp."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / WORK_DIR_OWNER)


def published(out: Path) -> list[Path]:
    """What a client could see: everything outside the service's hidden work folder."""
    return sorted(p for p in out.iterdir() if not p.name.startswith(".vflash-work-"))
