"""The service's parts that need no worker: job queue, metrics text, input paths, upload names, client, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from vflash_core.cli.main import build_parser
from vflash_core.cli.serve import is_loopback
from vflash_core.pipeline.options import RunOptions
from vflash_core.service.app import WORK_DIR_OWNER, WORK_DIR_PREFIX, remove_stale_work_dirs
from vflash_core.service.client import _multipart
from vflash_core.service.jobs import Job, JobState, JobStore, QueueFullError, new_job_id, redact_paths
from vflash_core.service.metrics import Histogram, WorkerSeries, render
from vflash_core.service.submission import InputPolicy, resolve_input_path, upload_suffix
from vflash_core.service.worker_handle import describe_exit

pytestmark = pytest.mark.timeout(30)


def test_job_store_is_a_bounded_fifo():
    async def scenario() -> None:
        store = JobStore(max_queue=2)
        first, second, third = (Job(new_job_id(), None, None) for _ in range(3))
        store.add(first)
        store.add(second)
        with pytest.raises(QueueFullError, match="2 jobs waiting"):
            store.add(third)
        assert [store.queue_position(first), store.queue_position(second)] == [1, 2]
        taken = await store.take()
        assert taken is first
        store.put_back(taken)  # never reached a worker: keeps its place
        assert await store.take() is first
        store.remove_queued(second)
        second.cancel()
        assert store.queue_position(second) is None
        waiter = asyncio.ensure_future(store.take())
        await asyncio.sleep(0)
        assert not waiter.done()
        store.add(third)
        assert await waiter is third
        counts = store.counts()
        assert counts[JobState.CANCELLED] == 1 and counts[JobState.QUEUED] == 2

    asyncio.run(scenario())


def test_job_store_forgets_the_oldest_ended_jobs_beyond_its_limit():
    store = JobStore(max_queue=4, keep_finished=2)
    jobs = [Job(new_job_id(), None, None) for _ in range(5)]
    for job in jobs[:4]:
        store.add(job)
    store.remove_queued(jobs[0])
    jobs[0].cancel()
    for job in jobs[1:4]:  # jobs end in the order 3, 1, 2 (after 0)
        store.remove_queued(job)
        job.start(worker_pid=1)
    for job, stamp in ((jobs[3], 10.0), (jobs[1], 11.0), (jobs[2], 12.0)):
        job.fail("boom")
        job.finished = stamp
    jobs[0].finished = 9.0
    store.add(jobs[4])  # four ended records: the two that ended first (0, then 3) are forgotten
    assert [store.get(job.id) for job in jobs] == [None, jobs[1], jobs[2], None, jobs[4]]
    assert len(store) == 3 and store.counts()[JobState.FAILED] == 2
    assert JobStore(max_queue=1).keep_finished == 1000


def test_job_states_end_once():
    job = Job(new_job_id(), None, None)
    job.start(worker_pid=42)
    job.progress("denoise", 2, 4)
    job.progress("decode", 0, 1)
    view = job.view()
    assert view["status"] == "running" and view["evaluations"] == {"done": 2, "total": 4}
    assert view["progress"] == {"stage": "decode", "done": 0, "total": 1}
    job.fail("boom")
    with pytest.raises(AssertionError, match="already failed"):
        job.cancel()


def test_metrics_text_format():
    hist = Histogram((1.0, 10.0))
    for value in (0.5, 3.0, 30.0):
        hist.observe(value)
    workers = [WorkerSeries("0", "cuda:0", True, 2, 1), WorkerSeries("1", "cuda:1+cuda:2", False, 0, 0)]
    text = render({"queued": 1, "running": 0}, hist, workers, ready=True, queue_capacity=16)
    lines = text.splitlines()
    assert 'vflash_jobs{state="queued"} 1' in lines
    assert lines[lines.index("# TYPE vflash_request_seconds histogram") + 1 :][:5] == [
        'vflash_request_seconds_bucket{le="1.0"} 1',
        'vflash_request_seconds_bucket{le="10.0"} 2',
        'vflash_request_seconds_bucket{le="+Inf"} 3',
        "vflash_request_seconds_sum 33.5",
        "vflash_request_seconds_count 3",
    ]
    assert 'vflash_worker_restarts_total{worker="0",devices="cuda:0"} 2' in lines and "vflash_ready 1" in lines
    assert 'vflash_worker_ready{worker="1",devices="cuda:1+cuda:2"} 0' in lines
    assert 'vflash_worker_jobs{worker="0",devices="cuda:0"} 1' in lines
    assert text.endswith("\n")


def test_client_paths_stay_inside_the_input_folder(tmp_path):
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    (inputs / "sub" / "a.png").write_bytes(b"x")
    (tmp_path / "outside.png").write_bytes(b"x")
    (inputs / "link.png").symlink_to(tmp_path / "outside.png")
    (inputs / "inner-link.png").symlink_to(inputs / "sub" / "a.png")
    policy = InputPolicy(inputs.resolve(), 1024)
    assert resolve_input_path("sub/a.png", policy) == (inputs / "sub" / "a.png").resolve()
    assert resolve_input_path("inner-link.png", policy) == (inputs / "sub" / "a.png").resolve()
    assert resolve_input_path(str(inputs / "sub" / "a.png"), policy) == (inputs / "sub" / "a.png").resolve()
    for bad in ("../outside.png", "sub/../../outside.png", str(tmp_path / "outside.png"), "link.png", "/etc/passwd"):
        with pytest.raises(web.HTTPBadRequest) as info:
            resolve_input_path(bad, policy)
        assert "outside the input folder" in json.loads(info.value.text)["error"]
    with pytest.raises(web.HTTPBadRequest) as info:
        resolve_input_path("missing.png", policy)
    assert json.loads(info.value.text)["error"] == "input path 'missing.png' does not exist in the input folder"
    (inputs / "loop.png").symlink_to("loop.png")
    os.mkfifo(inputs / "fifo.png")
    for name, message in (("loop.png", "input path 'loop.png' is a symbolic link loop"), ("fifo.png", "input path 'fifo.png' is not a file in the input folder"),
                          ("sub", "input path 'sub' is not a file in the input folder")):
        with pytest.raises(web.HTTPBadRequest) as info:
            resolve_input_path(name, policy)
        assert json.loads(info.value.text)["error"] == message
    with pytest.raises(web.HTTPBadRequest) as info:
        resolve_input_path("sub/a.png", InputPolicy(None, 1024))
    assert "uploads only" in json.loads(info.value.text)["error"]


@pytest.mark.parametrize(
    ("filename", "suffix"),
    [("frame.PNG", ".png"), ("../../etc/passwd", ""), ("..\\..\\x.jpg", ".jpg"), ("a.tar.gz", ".gz"),
     ("noext", ""), (None, ""), ("x.pn g", ""), ("x.verylongext", ""), ("/abs/clip.wav", ".wav")],
)
def test_upload_names_take_only_a_short_extension(filename, suffix):
    assert upload_suffix(filename) == suffix


def test_client_multipart_body(tmp_path):
    image = tmp_path / 'odd"name.png'
    image.write_bytes(b"\x89PNG")
    body, content_type = _multipart({"prompt": "<Picture 1>"}, {"references": [image, image]})
    boundary = content_type.split("boundary=")[1]
    assert body.count(f"--{boundary}\r\n".encode()) == 3 and body.endswith(f"--{boundary}--\r\n".encode())
    assert b'name="request"' in body and body.count(b'name="references"; filename="oddname.png"') == 2


def test_client_messages_do_not_show_service_folders(tmp_path):
    work, upload = tmp_path / "out" / ".vflash-work-1", tmp_path / "out" / ".vflash-work-1" / "uploads" / "abc"
    message = f"first frame {upload}/first_frame.png cannot be read; see {work}/worker-2/x and {tmp_path}/in/a.png"
    assert redact_paths(message, (work, upload, None, tmp_path / "in")) == (
        "first frame first_frame.png cannot be read; see worker-2/x and a.png"
    )


def test_describe_exit_names_signals_and_exit_codes():
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(None) == "an unknown status"


def test_serve_command_and_loopback(tmp_path):
    args = build_parser().parse_args(["serve", "--demo", "--output-dir", str(tmp_path)])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.max_queue == 16 and args.demo
    assert args.keep_finished_jobs == 1000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--demo", "--prepared-assets", "p.json", "--output-dir", str(tmp_path)])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org") and not is_loopback("192.168.1.4")


def test_service_config_is_checked(tmp_path):
    from vflash_core.errors import VflashError
    from vflash_core.service import ServiceConfig

    receipt = tmp_path / "receipt.json"
    receipt.write_text("{}")
    with pytest.raises(VflashError, match="does not exist"):
        ServiceConfig(receipt, tmp_path / "missing")
    with pytest.raises(VflashError, match="max_queue"):
        ServiceConfig(receipt, tmp_path, max_queue=0)
    with pytest.raises(VflashError, match="keep_finished_jobs"):
        ServiceConfig(receipt, tmp_path, keep_finished_jobs=-1)
    with pytest.raises(VflashError, match="go together"):
        ServiceConfig(receipt, tmp_path, RunOptions(strategy="sequence-head"))
    config = ServiceConfig(receipt, tmp_path, input_dir=Path("."))
    assert config.input_dir == Path.cwd()
    with pytest.raises(VflashError, match=r"cancel_grace_seconds must be a number of seconds above 0 and at most 86,400, got nan"):
        ServiceConfig(receipt, tmp_path, cancel_grace_seconds=float("nan"))
    with pytest.raises(VflashError, match=r"video_threads must be an integer from 1 to 256, got 0"):
        ServiceConfig(receipt, tmp_path, RunOptions(media_video_threads=0))
    with pytest.raises(VflashError, match=r"prepared assets .* is a folder, not a file"):
        ServiceConfig(tmp_path, tmp_path)


def test_a_missing_output_folder_is_created_once_everything_else_checks_out(tmp_path):
    """`vflash serve --demo --output-dir out/` works on a fresh checkout: the CLI asks for the folder to be created."""
    from vflash_core.errors import VflashError
    from vflash_core.service import ServiceConfig

    receipt = tmp_path / "receipt.json"
    receipt.write_text("{}")
    with pytest.raises(VflashError, match="max_queue"):
        ServiceConfig(receipt, tmp_path / "out", max_queue=0, create_output_dir=True)
    assert not (tmp_path / "out").exists()  # a refused configuration creates nothing
    with pytest.raises(VflashError, match=r"output folder .*deeper/out cannot be created: .*deeper is not a folder"):
        ServiceConfig(receipt, tmp_path / "deeper" / "out", create_output_dir=True)
    with pytest.raises(VflashError, match=r"output folder .*receipt.json is not a folder"):
        ServiceConfig(receipt, receipt, create_output_dir=True)
    config = ServiceConfig(receipt, tmp_path / "out", create_output_dir=True)
    assert config.output_dir.is_dir() and ServiceConfig(receipt, tmp_path / "out", create_output_dir=True).output_dir == config.output_dir


def test_serve_refuses_bad_options_on_one_line(tmp_path, capsys):
    from vflash_core.cli.main import main

    for option, value, message in (("--port", "70000", "--port must be an integer from 0 to 65,535, got 70000"),
                                   ("--max-upload-mb", "nan", "--max-upload-mb must be a number of MiB above 0 and at most 1,048,576, got nan"),
                                   ("--max-upload-mb", "inf", "--max-upload-mb must be a number of MiB above 0 and at most 1,048,576, got inf")):
        assert main(["serve", "--demo", "--output-dir", str(tmp_path / "out"), option, value]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"vflash: error: {message}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.name != "posix", reason="the stale-folder sweep is POSIX only")
def test_stale_work_folders_of_ended_services_on_this_host_are_removed(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its process id names no process now
    host = socket.gethostname()

    def work_folder(name: str, owner: str | None) -> Path:
        folder = tmp_path / f"{WORK_DIR_PREFIX}{name}"
        (folder / "uploads").mkdir(parents=True)
        (folder / "uploads" / "a.png").write_bytes(b"x")
        if owner is not None:
            (folder / WORK_DIR_OWNER).write_text(owner + "\n")
        return folder

    stale = work_folder("dead", f"{host} {ended.pid}")
    live = work_folder("live", f"{host} {os.getpid()}")
    elsewhere = work_folder("other-host", f"{host}-elsewhere {ended.pid}")
    unstamped = work_folder("no-owner", None)
    garbled = work_folder("garbled", "not a stamp at all")
    user_file = tmp_path / "kite.mp4"
    user_file.write_bytes(b"video")
    assert remove_stale_work_dirs(tmp_path) == [stale]
    assert not stale.exists() and user_file.exists()
    assert all(folder.exists() for folder in (live, elsewhere, unstamped, garbled))


def test_client_faults_in_the_http_layer_are_logged_on_one_line(caplog):
    """Issue 15: a malformed HTTP message or a client hanging up mid-body was logged by aiohttp with a traceback;
    it is one warning line now, while any other exception keeps its traceback."""
    import logging

    from aiohttp.http_exceptions import LineTooLong

    from vflash_core.service.app import ClientFaultLogFilter

    logger = logging.getLogger("test-client-faults")
    logger.addFilter(ClientFaultLogFilter())
    with caplog.at_level(logging.INFO, logger="test-client-faults"):
        for exc in (LineTooLong(b"aaaa", 8190), ConnectionResetError("Connection lost")):
            logger.error("Error handling request from %s", "127.0.0.1", exc_info=exc)
        logger.error("Error handling request from %s", "127.0.0.1", exc_info=KeyError("a bug"))
    faults, bug = caplog.records[:2], caplog.records[2]
    assert [r.levelname for r in faults] == ["WARNING", "WARNING"] and all(r.exc_info is None for r in faults)
    assert faults[0].getMessage().startswith("Error handling request from 127.0.0.1: Got more than 8190 bytes")
    assert faults[1].getMessage() == "Error handling request from 127.0.0.1: Connection lost"
    assert bug.levelname == "ERROR" and bug.exc_info is not None


def test_serve_refuses_settings_address_and_receipt_before_building_the_demo_or_creating_anything(tmp_path, capsys, monkeypatch):
    """Issue 15, found by the adversarial corpus: a bad --input-dir, an unknown attention backend, an address that
    cannot be bound or a malformed receipt was refused only after the demo model was built (or, for the backend, by
    a worker while the service kept running), and the output folder was created first."""
    import socket

    from vflash_core.cli.main import main
    from vflash_core.pipeline import demo

    def refuse(*args, **kwargs):
        raise AssertionError("the demo model was built for a command that must be refused first")

    monkeypatch.setattr(demo, "ensure_demo_assets", refuse)
    out, a_file = tmp_path / "out", tmp_path / "a-file"
    a_file.write_text("x")
    garbage = tmp_path / "receipt.json"
    garbage.write_text("{not json")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    cases = [
        (["--demo", "--input-dir", str(a_file)], 2, rf"input folder {a_file} is not a folder"),
        (["--demo", "--max-upload-mb", "1e-9"], 2, r"--max-upload-mb 1e-09 is less than one byte"),
        (["--demo", "--attention-backend", "bogus"], 2, r"unknown attention backend 'bogus'; choose one of auto, "),
        (["--demo", "--port", str(port)], 1, rf"cannot serve on 127\.0\.0\.1:{port}: Address already in use"),
        (["--demo", "--host", "no-such-host.invalid", "--token", "t"], 1, r"cannot serve on no-such-host\.invalid:0: "),
        (["--prepared-assets", str(garbage)], 2, rf"prepared-assets receipt {garbage} cannot be read as JSON: Expecting property name"),
        # a token read from a file: every request was 401, since the check strips the header and not the token
        (["--demo", "--token", "s3cret\n"], 2, r"the bearer token has whitespace at an end \(a token read from a file ends with a newline\), which no Authorization header can carry: strip it$"),
        (["--demo", "--token", "s3\x00cret"], 2, r"the bearer token holds a control character"),
    ]
    try:
        for argv, status, message in cases:
            assert main(["serve", "--output-dir", str(out), "--port", "0", *argv]) == status
            err = capsys.readouterr().err
            lines = err.strip().splitlines()
            assert len(lines) == 1 and re.match(rf"^vflash: error: {message}", lines[0]) and "Traceback" not in err, err
            assert not out.exists()
        monkeypatch.setenv("VFLASH_SERVICE_TOKEN", "s3cret\n")  # the same token from the environment
        assert main(["serve", "--output-dir", str(out), "--port", "0", "--demo"]) == 2
        assert "the bearer token has whitespace at an end" in capsys.readouterr().err and not out.exists()
    finally:
        taken.close()


def test_client_refuses_missing_uploads_and_an_unreachable_service_on_one_line(tmp_path):
    """Issue 15: `submit(files=...)` of a missing file or a folder was a FileNotFoundError / IsADirectoryError
    traceback, and a service that is not running a URLError traceback."""
    from vflash_core.errors import RunFailedError, VflashError
    from vflash_core.service.client import VflashClient

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    client = VflashClient(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(VflashError, match=rf"^first_frame upload {tmp_path / 'kite.png'} does not exist$"):
        client.submit({"prompt": "<Picture 1> flies"}, files={"first_frame": tmp_path / "kite.png"})
    with pytest.raises(VflashError, match=rf"^references upload {tmp_path} is a folder, not a file$"):
        client.submit({"prompt": "x"}, files={"references": [tmp_path]})
    with pytest.raises(RunFailedError, match=rf"^cannot reach the Vflash service at http://127\.0\.0\.1:{port}: Connection refused$"):
        client.status("0" * 32)


def test_serve_places_one_worker_per_gpu_or_pair_and_refuses_gpus_on_a_machine_without_them(tmp_path, capsys):
    from vflash_core.cli.main import main
    from vflash_core.errors import VflashError
    from vflash_core.service import ServiceConfig

    args = build_parser().parse_args(["serve", "--demo", "--output-dir", str(tmp_path), "--gpus", "0+1,2+3"])
    assert args.gpus == ((0, 1), (2, 3)) and args.workers == 1 and args.pipelined
    for extra, message in (
        (["--gpus", "0,1"], "--gpus needs CUDA GPUs and this machine has none; on the CPU, use --workers N"),
        (["--gpus", "0,x"], ("--gpus takes CUDA indices separated by commas, pairs joined by '+' "
                             "(0,1 or 0+1,2+3), got '0,x'")),
        (["--gpus", "0", "--gpu", "1"], "--gpus replaces --gpu and --peer-gpu: give one or the other"),
        (["--workers", "2", "--gpu", "0"], ("2 workers on cuda:0 would each plan that GPU's whole memory; name one GPU "
                                            "per worker")),
        (["--workers", "0"], "--workers must be an integer from 1 to 64, got 0"),
    ):
        assert main(["serve", "--demo", "--output-dir", str(tmp_path / "out"), *extra]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"vflash: error: {message}"]
    assert not (tmp_path / "out").exists()

    receipt = tmp_path / "receipt.json"
    receipt.write_text("{}")
    pairs = ServiceConfig(receipt, tmp_path, RunOptions(device="cuda:0", peer_device="cuda:1", strategy="tensor"),
                          gpus=((0, 1), (2, 3)))
    assert [(o.device, o.peer_device, o.strategy) for o in pairs.worker_options()] == [
        ("cuda:0", "cuda:1", "tensor"), ("cuda:2", "cuda:3", "tensor")
    ]
    assert [o.device for o in ServiceConfig(receipt, tmp_path, gpus=((2,), (0,))).worker_options()] == ["cuda:2", "cuda:0"]
    assert ServiceConfig(receipt, tmp_path, workers=3).worker_options() == (RunOptions(),) * 3
    for changes, message in (
        ({"gpus": ((0,), (0,))}, r"a GPU serves one worker; \[0, 0\] names one twice"),
        ({"gpus": ((0, 1),)}, "two or more devices need strategy sequence-head or tensor, got None"),
        ({"gpus": ((0,), (1, 2))}, "every worker has one GPU, or every worker a pair"),
        ({"gpus": ((0,),), "workers": 2}, "not both"),
        ({"torch_threads": 0}, "torch_threads must be an integer from 1"),
    ):
        with pytest.raises(VflashError, match=message):
            ServiceConfig(receipt, tmp_path, **changes)
