"""`vflash serve` on the embedded default model: CPU, loopback only, one real spawned worker per test.

Each test builds its own service (its own worker process), so a worker killed or cancelled in one test cannot
leak into another. Most requests use the demo profile's shortest clip on the smallest canvas H3 accepts (32x32,
about 0.2 s each); the cancel test uses the demo's default canvas (448x256, a few seconds) and the kill test
224x128, so that the job is still running when the test acts on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import pytest
from aiohttp import FormData
from service_helpers import (
    FAST,
    MIDDLE,
    SLOW,
    files_under,
    job_status,
    png,
    published,
    submit,
    wait_for,
    wait_job,
    wait_ready,
)

from vflash_core.pipeline.options import RunOptions
from vflash_core.service import ServiceConfig, create_app
from vflash_core.service.app import JOBS, SUPERVISOR, WORK_DIR, WORK_DIR_OWNER

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


# -- the happy path ---------------------------------------------------------------------------------------------


async def test_submit_poll_download_playable_mp4(aiohttp_client, make_service, tmp_path):
    from mp4_probe import probe_mp4

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    png(inputs / "last.png")
    app, config = make_service(input_dir=inputs, options=RunOptions(encoder_residency="resident"))
    ended = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await ended.wait()
    stale = config.output_dir / ".vflash-work-0dead"  # left by a service on this host that was killed
    (stale / "uploads").mkdir(parents=True)
    (stale / WORK_DIR_OWNER).write_text(f"{socket.gethostname()} {ended.pid}\n")
    client = await aiohttp_client(app)
    assert not stale.exists() and (app[WORK_DIR] / WORK_DIR_OWNER).read_text().split() == [socket.gethostname(), str(os.getpid())]
    # The worker needs seconds to spawn and import torch: readiness is false meanwhile, liveness is not.
    starting = await client.get("/readyz")
    assert starting.status == 503 and (await starting.json())["worker"] == "starting"
    assert (await client.get("/healthz")).status == 200
    ready = await wait_ready(client)
    assert [worker["pid"] for worker in ready["workers"]] == [app[SUPERVISOR].slots[0].worker_pid]
    assert ready["workers"][0]["devices"] == "cpu"

    job_id = await submit(client, seed=7, **FAST)
    job = await wait_job(client, job_id)
    assert job["status"] == "succeeded", job
    assert job["error"] is None and job["video_url"] == f"/v1/jobs/{job_id}/video"
    assert job["evaluations"] == {"done": 4, "total": 4}  # progress per evaluation of the 4-NFE demo profile
    result = job["result"]
    assert result["path"] == f"{job_id}.mp4" and result["mode"] == "t2va"
    assert result["metadata"]["encoder_residency"] == "resident"  # the worker opened its pipeline with the service's option
    assert result["timing"]["request_index"] == 1
    assert {"validate", "encode", "denoise", "decode", "write"} <= set(result["stages"])
    assert 0 < result["elapsed_seconds"] <= job["timings"]["run_seconds"]

    response = await client.get(job["video_url"])
    assert response.status == 200 and response.headers["Content-Type"] == "video/mp4"
    downloaded = tmp_path / "downloaded.mp4"
    downloaded.write_bytes(await response.read())
    probe = probe_mp4(downloaded)
    assert (probe["frames"], probe["fps"]) == (result["num_frames"], result["fps"])
    assert (probe["width"], probe["height"]) == (32, 32)
    assert probe["audio_codec"] == "aac" and probe["audio_seconds"] > 4.9

    # Inputs as an upload (multipart) and as a path inside --input-dir.
    form = FormData()
    form.add_field("request", json.dumps({"prompt": "<Picture 1> starts to move", "seed": 8, **FAST}), content_type="application/json")
    form.add_field("first_frame", png(tmp_path / "first.png").read_bytes(), filename="first.png", content_type="image/png")
    response = await client.post("/v1/jobs", data=form)
    assert response.status == 202, await response.text()
    uploaded = (await response.json())["id"]
    by_path = await submit(client, prompt="the scene settles into <Picture 1>", last_frame="last.png", seed=9, **FAST)
    modes = [(await wait_job(client, i))["result"]["mode"] for i in (uploaded, by_path)]
    assert modes == ["i2va", "l2va"]

    assert published(config.output_dir) == sorted(config.output_dir / f"{i}.mp4" for i in (job_id, uploaded, by_path))
    assert files_under(app[WORK_DIR]) == []  # staging and uploads are gone
    text = await (await client.get("/metrics")).text()
    assert 'vflash_jobs{state="succeeded"} 3' in text
    assert "vflash_request_seconds_count 3" in text and 'vflash_worker_restarts_total{worker="0",devices="cpu"} 0' in text


async def test_queued_jobs_run_in_order_on_one_pipeline_then_429(aiohttp_client, make_service):
    """Four queued jobs (a queue of four, filled): run in submission order by one worker whose session counts four
    serial requests, none lost, each its own video; one more submission while the queue is full is 429, and the
    overflow jobs, cancelled while queued, hold no worker."""
    jobs_queued = 4
    app, config = make_service(max_queue=jobs_queued)
    client = await aiohttp_client(app)
    ids = [await submit(client, seed=seed, **FAST) for seed in range(jobs_queued)]
    # Fill the queue to the brim (jobs may already have left it for the worker), then one more.
    extra = []
    while True:
        response = await client.post("/v1/jobs", json={"prompt": "overflow", **FAST})
        if response.status == 429:
            assert "queue is full" in (await response.json())["error"]
            break
        assert response.status == 202 and len(extra) < jobs_queued
        extra.append((await response.json())["id"])
    for job_id in extra:
        await client.delete(f"/v1/jobs/{job_id}")  # queued ones are cancelled at once; any already running finish

    jobs = [await wait_job(client, job_id, timeout=600) for job_id in ids]
    assert [job["status"] for job in jobs] == ["succeeded"] * jobs_queued
    started = [job["started_at"] for job in jobs]
    assert started == sorted(started)
    # One pipeline, reused: one worker served them all, and its session counted the serial requests.
    assert {job["worker_pid"] for job in jobs} == {jobs[0]["worker_pid"]}
    assert [job["result"]["timing"]["request_index"] for job in jobs] == list(range(1, jobs_queued + 1))
    outputs = {config.output_dir / f"{job_id}.mp4" for job_id in ids}
    assert outputs <= set(published(config.output_dir))
    assert len({path.read_bytes() for path in outputs}) == jobs_queued  # one seed each, one different video each
    assert app[SUPERVISOR].restarts == 0


# -- rejected submissions ---------------------------------------------------------------------------------------


async def test_rejected_submissions_are_4xx_with_a_message_and_write_nothing(aiohttp_client, make_service, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    png(inputs / "frame.png")
    png(tmp_path / "secret.png")
    (inputs / "escape.png").symlink_to(tmp_path / "secret.png")
    app, config = make_service(input_dir=inputs, max_upload_bytes=4096)
    client = await aiohttp_client(app)

    async def rejected(status: int, *, json_body: Any = None, data: Any = None, headers=None) -> str:
        response = await client.post("/v1/jobs", json=json_body, data=data, headers=headers)
        body = await response.json()
        assert response.status == status, body
        assert body["error"]
        return body["error"]

    assert "not valid JSON" in await rejected(400, data=b"{not json", headers={"Content-Type": "application/json"})
    assert "JSON object" in await rejected(400, json_body=["a list"])
    assert "prompt is required" in await rejected(400, json_body={"seed": 1})
    assert "unknown field(s) output" in await rejected(400, json_body={"prompt": "x", "output": "/etc/x.mp4"})
    assert "seed must be an integer" in await rejected(400, json_body={"prompt": "x", "seed": "1"})
    assert "H3 generates 5-15 s" in await rejected(400, json_body={"prompt": "x", "duration_seconds": 60})
    assert "multiples of 32" in await rejected(400, json_body={"prompt": "x", "width": 33, "height": 32})
    assert "<Picture 1> is not bound" in await rejected(400, json_body={"prompt": "<Picture 1> walks along the shore", **FAST})
    for path in ("../secret.png", str(tmp_path / "secret.png"), "escape.png", "sub/../../secret.png"):
        assert "outside the input folder" in await rejected(400, json_body={"prompt": "x", "first_frame": path, **FAST})
    assert "multipart/form-data" in await rejected(415, data=b"prompt=x", headers={"Content-Type": "text/plain"})

    oversize = FormData()
    oversize.add_field("request", json.dumps({"prompt": "<Picture 1> waves", **FAST}), content_type="application/json")
    oversize.add_field("first_frame", b"\0" * 10_000, filename="../../big.png", content_type="image/png")
    assert "limit of 4096 bytes" in await rejected(413, data=oversize)

    traversal_name = FormData()  # the client's file name never becomes a path; the bad request is still refused
    traversal_name.add_field("request", json.dumps({"prompt": "<Picture 2> waves", **FAST}), content_type="application/json")
    traversal_name.add_field("first_frame", (inputs / "frame.png").read_bytes(), filename="../../../../escaped.png", content_type="image/png")
    assert "<Picture 2> is not bound" in await rejected(400, data=traversal_name)

    broken = FormData()  # the pipeline's own message, without the service's folders in it
    broken.add_field("request", json.dumps({"prompt": "<Picture 1> waves", **FAST}), content_type="application/json")
    broken.add_field("first_frame", b"not an image", filename="photo.png", content_type="image/png")
    message = await rejected(400, data=broken)
    assert message.startswith("first frame first_frame.png cannot be read as image") and str(tmp_path) not in message

    both = FormData()
    both.add_field("request", json.dumps({"prompt": "x", "first_frame": "frame.png"}), content_type="application/json")
    both.add_field("first_frame", (inputs / "frame.png").read_bytes(), filename="f.png", content_type="image/png")
    assert "both as a path and as an upload" in await rejected(400, data=both)

    unknown = await client.get("/v1/jobs/" + "0" * 32)
    assert unknown.status == 404 and "no job" in (await unknown.json())["error"]
    assert (await client.get("/v1/jobs/..%2F..%2Fetc")).status == 404
    assert (await client.delete("/v1/jobs/not-a-job")).status == 404

    assert len(app[JOBS]) == 0
    assert published(config.output_dir) == []
    assert files_under(app[WORK_DIR]) == []
    assert not list(tmp_path.rglob("escaped.png")) and not list(tmp_path.rglob("big.png"))


async def test_limits_types_and_malformed_bodies_are_4xx_json_and_write_nothing(aiohttp_client, make_service, tmp_path):
    """Issue 15's service cases: the pipeline's own validator and types, every refusal a JSON 4xx, nothing queued or
    written, the service up throughout."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    png(inputs / "frame.png")
    app, config = make_service(input_dir=inputs)
    client = await aiohttp_client(app)

    async def rejected(status: int, **post: Any) -> str:
        response = await client.post("/v1/jobs", **post)
        assert response.content_type == "application/json", await response.text()
        body = await response.json()
        assert response.status == status, body
        return body["error"]

    assert await rejected(400, json={"prompt": "x", "width": 100_000, "height": 100_000}) == (
        "canvas 100000x100000 is 10,000,000,000 pixels; this model generates at most 114,688 "
        "(canvas_max_pixels, within rounding to multiples of 32; e.g. 448x256 at 16:9)"
    )
    assert await rejected(400, json={"prompt": "x", "width": 448.7, "height": 256}) == "width must be an integer number of pixels, got float 448.7"
    assert await rejected(400, json={"prompt": "x", "seed": True}) == "seed must be an integer, got bool True"
    assert await rejected(400, json={"prompt": 5}) == "prompt must be a string, got int"
    assert await rejected(400, json={"prompt": "x", "duration_seconds": None}) == "duration_seconds must be a number of seconds, got NoneType None"
    assert (await rejected(400, json={"prompt": "a " * 139_999 + "a"})).startswith("the prompt is 140,000 tokens long; the text encoder reads at most 128,000")
    # One path string is one reference (never one reference per character): the demo profile refuses ref2va.
    assert await rejected(400, json={"prompt": "x", "references": "frame.png"}) == "profile t2va-base4-exact-cpu accepts t2va, i2va, l2va, fl2va; a ref2va request was given"
    assert await rejected(400, json={"prompt": "x", "references": 5}) == "references must be a path or a list of paths, got int"
    assert await rejected(413, data=json.dumps({"prompt": "x" * (1 << 20)}), headers={"Content-Type": "application/json"}) == "the request body exceeds 1048576 bytes"

    request_part = b'{"prompt": "<Picture 1> waves", "width": 32, "height": 32}'
    for header in (b'form-data; name="first_frame"; filename="a\x00b.png"', b'form-data; name="first\x00frame"'):
        body = (b'--XX\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n\r\n' + request_part + b"\r\n"
                b"--XX\r\nContent-Disposition: " + header + b"\r\nContent-Type: image/png\r\n\r\nPNG\r\n--XX--\r\n")
        message = await rejected(400, data=body, headers={"Content-Type": "multipart/form-data; boundary=XX"})
        assert message.startswith("the multipart body is malformed: Invalid HTTP header")
    truncated = b'--XX\r\nContent-Disposition: form-data; name="request"\r\n\r\n{"prompt": "x"}'
    assert (await rejected(400, data=truncated, headers={"Content-Type": "multipart/form-data; boundary=XX"})).startswith("the multipart body is malformed")

    many = FormData()  # uploads stop at the model's 12 references, before a 13th file is written
    many.add_field("request", json.dumps({"prompt": "x"}), content_type="application/json")
    for index in range(13):
        many.add_field("references", b"\x89PNG", filename=f"r{index}.png", content_type="image/png")
    assert await rejected(400, data=many) == "H3 takes at most 12 references in total, got more"

    assert len(app[JOBS]) == 0
    assert published(config.output_dir) == [] and files_under(app[WORK_DIR]) == []
    assert (await client.get("/healthz")).status == 200


async def test_json_python_cannot_parse_wrong_json_types_and_nul_prompts_are_400(aiohttp_client, make_service, tmp_path):
    """Issue 15, found by the adversarial corpus: deeply nested JSON (RecursionError) and integer literals beyond
    Python's digit limit (ValueError) were HTTP 500 with a traceback in the log; a NUL in a prompt was queued."""
    app, config = make_service()
    client = await aiohttp_client(app)

    async def rejected(body: bytes, status: int = 400) -> str:
        response = await client.post("/v1/jobs", data=body, headers={"Content-Type": "application/json"})
        assert response.status == status and response.content_type == "application/json", await response.text()
        return (await response.json())["error"]

    assert await rejected(b"[" * 100_000) == "the request body nests arrays or objects too deeply"
    assert await rejected(b'{"prompt": "x", "seed": ' + b"[" * 50_000 + b"]" * 50_000 + b"}") == "the request body nests arrays or objects too deeply"
    assert (await rejected(b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}")).startswith(
        "the request body holds a number too long to read: Exceeds the limit (4300 digits)")
    for body, kind in ((b"null", "null"), (b"[1]", "array"), (b'"a prompt"', "string"), (b"5", "number"), (b"true", "boolean")):
        assert await rejected(body) == f"the request body must be a JSON object, got {kind}"
    assert await rejected(json.dumps({"prompt": "a\x00b"}).encode()) == "the prompt holds a NUL character (at character 1); give plain text, not a binary file"
    form = FormData()
    form.add_field("request", b"[" * 100_000, content_type="application/json")
    response = await client.post("/v1/jobs", data=form)
    assert response.status == 400 and (await response.json())["error"] == "the 'request' part nests arrays or objects too deeply"
    assert len(app[JOBS]) == 0
    assert published(config.output_dir) == [] and files_under(app[WORK_DIR]) == []
    assert (await client.get("/healthz")).status == 200


async def test_an_upload_onto_a_full_disk_is_507_and_leaves_nothing(aiohttp_client, make_service, tmp_path, monkeypatch):
    """An OS error while an upload was stored (a full disk under the output folder) was HTTP 500 with a traceback."""
    import errno

    from vflash_core.service import submission

    class FullDisk:
        def __init__(self, path, mode):
            self.file = open(path, mode)  # noqa: SIM115 - it stands in for `open`: its caller closes it

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.file.close()

    monkeypatch.setattr(submission, "open", FullDisk, raising=False)
    app, _ = make_service()
    client = await aiohttp_client(app)
    form = FormData()
    form.add_field("request", json.dumps({"prompt": "<Picture 1> waves", **FAST}), content_type="application/json")
    form.add_field("first_frame", png(tmp_path / "frame.png").read_bytes(), filename="frame.png", content_type="image/png")
    response = await client.post("/v1/jobs", data=form)
    assert response.status == 507
    assert (await response.json())["error"] == "the service cannot store the first_frame upload now: No space left on device"
    assert files_under(app[WORK_DIR]) == [] and len(app[JOBS]) == 0
    assert (await client.get("/healthz")).status == 200


async def test_an_eight_channel_audio_upload_is_400_before_a_worker_decodes_it(
    aiohttp_client, h3_prepared_ref, tmp_path
):
    """The upload reached the worker, whose decoder crashed (SIGSEGV): any client could force a worker restart and a
    full model reload. The header check refuses it in the HTTP process, before a job exists."""
    import wave

    eight_channels = tmp_path / "eight.wav"
    with wave.open(str(eight_channels), "wb") as audio:
        audio.setnchannels(8)
        audio.setsampwidth(2)
        audio.setframerate(32000)
        audio.writeframes(bytes(2 * 8 * 3200))
    out = tmp_path / "out"
    out.mkdir()
    app = create_app(ServiceConfig(prepared_assets=h3_prepared_ref, output_dir=out))
    client = await aiohttp_client(app)
    form = FormData()
    form.add_field("request", json.dumps({"prompt": "<Picture 1> sings", **FAST}), content_type="application/json")
    form.add_field("references", png(tmp_path / "face.png").read_bytes(), filename="face.png", content_type="image/png")
    form.add_field("references", eight_channels.read_bytes(), filename="voice.wav", content_type="audio/wav")
    response = await client.post("/v1/jobs", data=form)
    body = await response.json()
    assert response.status == 400, body
    assert body["error"] == ("reference 2 reference-2.wav has 8 audio channels; soundtracks must be mono or stereo "
                             "(1 or 2 channels): downmix it first")
    assert len(app[JOBS]) == 0 and files_under(app[WORK_DIR]) == []


async def test_bearer_token_guards_the_api_but_not_the_probes(aiohttp_client, make_service):
    app, _ = make_service(token="s3cret")
    client = await aiohttp_client(app)
    assert (await client.get("/healthz")).status == 200  # probes stay open
    assert (await client.get("/readyz")).status in (200, 503)
    response = await client.post("/v1/jobs", json={"prompt": "x", **FAST})
    assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert (await client.get("/metrics", headers={"Authorization": "Bearer wrong"})).status == 401
    assert (await client.get("/metrics", headers={"Authorization": "Bearer s3cret"})).status == 200
    assert len(app[JOBS]) == 0


async def test_authorization_headers_of_any_bytes_and_any_scheme_case(aiohttp_client, make_service, caplog):
    """An Authorization header holding bytes that are not UTF-8 answered 500 and logged a UnicodeEncodeError; the
    scheme written `bearer` was refused although auth schemes are case-insensitive."""
    app, _ = make_service(token="s3cret")
    client = await aiohttp_client(app)
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert (await client.get("/metrics", headers={"Authorization": f"{scheme} s3cret"})).status == 200
    for header in ("Basic s3cret", "Bearer S3CRET", "Bearers3cret", "s3cret", "Bearer"):
        assert (await client.get("/metrics", headers={"Authorization": header})).status == 401
    for raw in (b"Bearer \xff\xfe", b"\xc3\x28 s3cret", b"Bearer s3cret\x80"):
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: " + raw + b"\r\nConnection: close\r\n\r\n")
        await writer.drain()
        status = (await reader.readline()).split()[1]
        writer.close()
        assert status in (b"400", b"401"), (raw, status)
    assert "Traceback" not in caplog.text and "UnicodeEncodeError" not in caplog.text
    assert (await client.get("/healthz")).status == 200


async def test_python_client_against_a_loopback_server(aiohttp_server, make_service, tmp_path):
    from vflash_core.fileio import OutputExistsError
    from vflash_core.service.client import JobFailedError, ServiceError, VflashClient

    app, _ = make_service(token="t0k")
    server = await aiohttp_server(app, host="127.0.0.1")
    client = VflashClient(str(server.make_url("/")), token="t0k")
    frame = png(tmp_path / "frame.png")

    def session() -> None:
        deadline = time.monotonic() + 120
        while not client.ready():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        job_id = client.submit({"prompt": "<Picture 1> sways", "seed": 3, **FAST}, files={"first_frame": frame})
        assert client.wait(job_id, poll_seconds=0.05)["result"]["mode"] == "i2va"
        target = client.download(job_id, tmp_path / "client.mp4")
        assert target.stat().st_size > 0
        with pytest.raises(OutputExistsError):
            client.download(job_id, target)
        with pytest.raises(ServiceError) as info:
            client.submit({"prompt": "<Picture 3> sways", **FAST})
        assert info.value.status == 400 and "<Picture 3> is not bound" in str(info.value)
        with pytest.raises(ServiceError) as info:
            VflashClient(client.base_url).status(job_id)
        assert info.value.status == 401
        running = client.submit({"prompt": "first", **SLOW})  # long enough that the next one is still queued
        doomed = client.submit({"prompt": "second", **FAST})
        assert client.cancel(doomed)["status"] == "cancelled"
        with pytest.raises(JobFailedError, match="cancelled"):
            client.wait(doomed)
        client.cancel(running)  # its render is the kill and cancel tests' business; the client's ends here
        with pytest.raises(JobFailedError, match="cancelled"):
            client.wait(running, poll_seconds=0.05)

    await asyncio.to_thread(session)


# -- worker death, cancel, readiness ----------------------------------------------------------------------------


async def test_killed_worker_fails_its_job_and_a_new_worker_runs_the_next(aiohttp_client, make_service, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    # Serial: a pipelining worker would already hold the next job while the victim writes, and both would fail.
    app, config = make_service(input_dir=inputs, pipelined=False)
    client = await aiohttp_client(app)
    await wait_ready(client)
    victim = await submit(client, seed=1, **MIDDLE)
    survivor = await submit(client, seed=2, **FAST)
    # Valid when queued, unreadable when it runs: a request error in the worker costs the job, not the worker.
    vanished = await submit(client, prompt="<Picture 1> fades", first_frame=png(inputs / "frame.png").name, **FAST)
    (inputs / "frame.png").unlink()
    # Kill it while it writes the MP4: the worst moment, with a partial file on disk.
    writing = await wait_job(client, victim, until=lambda job: job["progress"] == {"stage": "write", "done": 0, "total": 1})
    os.kill(writing["worker_pid"], signal.SIGKILL)

    failed = await wait_job(client, victim)
    assert failed["status"] == "failed"
    assert failed["error"] == f"the worker process (pid {writing['worker_pid']}) exited with signal SIGKILL while running this job"
    done = await wait_job(client, survivor)
    assert done["status"] == "succeeded", done
    assert done["worker_pid"] != writing["worker_pid"]
    refused = await wait_job(client, vanished)
    assert refused["status"] == "failed" and refused["error"] == "first frame frame.png does not exist"
    assert refused["worker_pid"] == done["worker_pid"] == app[SUPERVISOR].slots[0].worker_pid
    assert published(config.output_dir) == [config.output_dir / f"{survivor}.mp4"]
    assert not [p for p in config.output_dir.rglob("*") if "partial" in p.name]
    assert files_under(app[WORK_DIR]) == []
    response = await client.get(f"/v1/jobs/{victim}/video")
    assert response.status == 409 and "SIGKILL" in (await response.json())["error"]
    assert 'vflash_worker_restarts_total{worker="0",devices="cpu"} 1' in await (await client.get("/metrics")).text()


async def test_cancel_running_job_stops_within_one_evaluation(aiohttp_client, make_service):
    app, config = make_service()
    client = await aiohttp_client(app)
    await wait_ready(client)
    victim = await submit(client, seed=3, **SLOW)
    survivor = await submit(client, seed=4, **FAST)

    running = await wait_job(client, victim, until=lambda job: job["evaluations"]["done"] >= 1)
    # Freeze the worker so the test, not the scheduler, decides where the cancel lands; the events it already
    # sent are read before the count of finished evaluations is taken.
    os.kill(running["worker_pid"], signal.SIGSTOP)
    try:
        await asyncio.sleep(0.2)
        at_cancel = await job_status(client, victim)
        assert at_cancel["status"] == "running"
        response = await client.delete(f"/v1/jobs/{victim}")
        assert response.status == 202 and (await response.json())["cancel_requested"]
    finally:
        os.kill(running["worker_pid"], signal.SIGCONT)
    cancelled = await wait_job(client, victim)
    assert cancelled["status"] == "cancelled" and cancelled["error"] is None
    assert cancelled["evaluations"]["done"] <= at_cancel["evaluations"]["done"] + 1
    assert (await client.delete(f"/v1/jobs/{victim}")).status == 409

    done = await wait_job(client, survivor)
    assert done["status"] == "succeeded" and done["worker_pid"] != running["worker_pid"]
    assert published(config.output_dir) == [config.output_dir / f"{survivor}.mp4"]
    assert files_under(app[WORK_DIR]) == []
    assert app[SUPERVISOR].restarts == 1


async def test_readyz_false_after_a_fatal_config_error_and_parent_never_touches_cuda(aiohttp_client, make_service, monkeypatch):
    import torch

    def no_cuda(*args: object, **kwargs: object) -> None:
        raise AssertionError("the HTTP process initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    app, _ = make_service(options=RunOptions(device="cuda:99"))  # no machine has this device: the worker's checks must fail
    client = await aiohttp_client(app)

    async def fatal():
        body = await (await client.get("/readyz")).json()
        return body if body["worker"] == "fatal" else None

    body = await wait_for(fatal)
    assert body["ready"] is False and "cuda:99" in body["error"]
    assert (await client.get("/readyz")).status == 503
    response = await client.post("/v1/jobs", json={"prompt": "x", **FAST})
    assert response.status == 503 and "cannot run jobs" in (await response.json())["error"]
    assert (await client.get("/healthz")).status == 200
    assert "vflash_ready 0" in await (await client.get("/metrics")).text()
    assert app[SUPERVISOR].restarts == 0  # a configuration error is not retried
