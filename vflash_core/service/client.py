"""A small synchronous client for `vflash serve` (standard library only).

    from vflash_core.service.client import VflashClient

    client = VflashClient("http://127.0.0.1:8000", token=None)
    job_id = client.submit({"prompt": "a red kite over a beach", "seed": 1, "duration_seconds": 5},
                           files={"first_frame": "kite.png"})
    job = client.wait(job_id)            # polls until succeeded; raises JobFailedError if failed or cancelled
    client.download(job_id, "kite.mp4")  # atomic, never overwrites

`files` uploads local files (`first_frame`, `last_frame`, or `references` with a list, in order). Without
`files`, input fields in the request are paths inside the service's `--input-dir`.
"""

from __future__ import annotations

import json
import mimetypes
import secrets
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import RunFailedError, VflashError
from ..fileio import atomic_file, check_input_file

__all__ = ["JobFailedError", "ServiceError", "VflashClient"]

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class ServiceError(VflashError):
    """The service answered with an error status; `status` is the HTTP code, the message is the service's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class JobFailedError(VflashError):
    """A job ended `failed` or `cancelled`; `job` is its last status."""

    def __init__(self, job: dict[str, Any]):
        detail = f": {job['error']}" if job.get("error") else ""
        super().__init__(f"job {job['id']} {job['status']}{detail}")
        self.job = job


class VflashClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", token: str | None = None, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout  # per HTTP call, not per job

    def submit(
        self, request: Mapping[str, Any], files: Mapping[str, str | Path | Sequence[str | Path]] | None = None
    ) -> str:
        """Queue a job; returns its id. Raises `ServiceError` (400 invalid, 413 too large, 429 queue full, ...)."""
        if not files:
            body, content_type = json.dumps(dict(request)).encode(), "application/json"
        else:
            body, content_type = _multipart(request, files)
        return self._call("POST", "/v1/jobs", body, content_type)["id"]

    def status(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/jobs/{job_id}")

    def ready(self) -> bool:
        try:
            return bool(self._call("GET", "/readyz")["ready"])
        except ServiceError as exc:
            if exc.status == 503:
                return False
            raise

    def wait(self, job_id: str, poll_seconds: float = 1.0, timeout: float | None = None) -> dict[str, Any]:
        """Poll until the job ends; returns its status when it succeeded, raises `JobFailedError` otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.status(job_id)
            if job["status"] in TERMINAL_STATES:
                if job["status"] != "succeeded":
                    raise JobFailedError(job)
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise VflashError(f"job {job_id} is still {job['status']} after {timeout} s")
            time.sleep(poll_seconds)

    def download(self, job_id: str, path: str | Path) -> Path:
        """Save the job's MP4 at `path` (published atomically; an existing file is never overwritten)."""
        with (
            atomic_file(path, suffix=".mp4") as tmp,
            self._open("GET", f"/v1/jobs/{job_id}/video") as response,
            open(tmp, "wb") as out,
        ):
            shutil.copyfileobj(response, out)
        return Path(path)

    def _call(
        self, method: str, route: str, body: bytes | None = None, content_type: str | None = None
    ) -> dict[str, Any]:
        with self._open(method, route, body, content_type) as response:
            return json.loads(response.read())

    def _open(self, method: str, route: str, body: bytes | None = None, content_type: str | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.base_url + route, data=body, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise ServiceError(exc.code, _error_message(exc)) from None
        except (urllib.error.URLError, OSError) as exc:  # refused, unresolvable, timed out, reset
            reason = getattr(exc, "reason", None) or exc
            raise RunFailedError(
                f"cannot reach the Vflash service at {self.base_url}: {getattr(reason, 'strerror', None) or reason}"
            ) from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    raw = exc.read()
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):  # not one of the service's JSON errors (e.g. a proxy's page)
        return raw.decode(errors="replace").strip() or exc.reason


def _multipart(request: Mapping[str, Any], files: Mapping[str, str | Path | Sequence[str | Path]]) -> tuple[bytes, str]:
    """multipart/form-data: the request JSON in a `request` part, then one part per file, in order."""
    boundary = f"vflash-{secrets.token_hex(16)}"
    parts = [_part(boundary, 'name="request"', "application/json", json.dumps(dict(request)).encode())]
    for field, value in files.items():
        for path in [value] if isinstance(value, (str, Path)) else list(value):
            path = check_input_file(path, f"{field} upload")  # a missing file, a folder or a FIFO is named as such
            kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            name = path.name.replace('"', "").replace("\r", "").replace("\n", "")  # keep the header well-formed
            parts.append(_part(boundary, f'name="{field}"; filename="{name}"', kind, path.read_bytes()))
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _part(boundary: str, disposition: str, content_type: str, payload: bytes) -> bytes:
    head = f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\nContent-Type: {content_type}\r\n\r\n"
    return head.encode() + payload + b"\r\n"
