"""`vflash serve --fast-mode`: the flag reaches the spawned worker's pipeline, and each job's result says so."""

from __future__ import annotations

import pytest
from service_helpers import FAST, submit, wait_job, wait_ready

from vflash_core.cli.main import build_parser
from vflash_core.pipeline.options import RunOptions

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


async def test_a_service_started_with_a_fast_mode_reports_inexact_results(aiohttp_client, make_service, tmp_path):
    args = build_parser().parse_args(
        ["serve", "--demo", "--output-dir", str(tmp_path / "out"), "--fast-mode", "sparse-attention"]
    )
    options = RunOptions.from_arguments(args)  # what `vflash serve` hands its ServiceConfig
    app, _ = make_service(options=options)
    client = await aiohttp_client(app)
    await wait_ready(client)
    job = await wait_job(client, await submit(client, seed=5, **FAST))
    assert job["status"] == "succeeded", job
    metadata = job["result"]["metadata"]
    assert metadata["exact"] is False
    assert metadata["fast_mode"]["modes"] == ["sparse-attention"]
    assert metadata["fast_mode"]["settings"]["sparse_density"] == 0.25
