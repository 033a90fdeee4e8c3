"""From an HTTP body to the keyword arguments of a `VideoRequest`.

Two body types:

* `application/json`: the request itself, e.g. `{"prompt": "...", "seed": 1, "duration_seconds": 5}`. Input files
  (`first_frame`, `last_frame`, `references`) are paths relative to the service's `--input-dir`.
* `multipart/form-data`: a `request` part holding that JSON, plus file parts named `first_frame`, `last_frame` or
  `references` (repeatable, in order). A field is given either as a path or as an upload, never both.

Client paths are resolved (symlinks included) and must stay inside the input folder. Uploads are streamed to
service-named files under the job's upload folder, with a limit on their total size; the client's file name
contributes at most its extension. Every rejection is an `HTTPException` carrying `{"error": message}`; the caller
removes the upload folder when one is raised.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import VflashError
from ..fileio import resolve_inside
from ..media.references import MAX_REFERENCES

__all__ = ["InputPolicy", "bad_request", "http_error", "read_submission", "resolve_input_path", "upload_suffix"]

FILE_FIELDS = ("first_frame", "last_frame", "references")
SCALAR_FIELDS = ("prompt", "duration_seconds", "seed", "width", "height")
REQUEST_PART = "request"
MAX_REQUEST_JSON_BYTES = 2**20  # the JSON of one request, in either body type
_CHUNK = 2**16
_SUFFIX = re.compile(r"\.[a-z0-9]{1,8}")


def http_error(cls: type[web.HTTPException], message: str, **kwargs: Any) -> web.HTTPException:
    """A client error whose body is `{"error": message}`."""
    return cls(text=json.dumps({"error": message}), content_type="application/json", **kwargs)


def bad_request(message: str) -> web.HTTPException:
    return http_error(web.HTTPBadRequest, message)


@dataclass(frozen=True)
class InputPolicy:
    input_dir: Path | None  # resolved; None: uploads only
    max_upload_bytes: int


async def read_submission(request: web.Request, upload_dir: Path, policy: InputPolicy) -> dict[str, Any]:
    """The request's fields as `VideoRequest` keyword arguments; file inputs become local paths (str)."""
    try:
        return await _read_submission(request, upload_dir, policy)
    except ConnectionResetError:  # the client went away mid-body; the answer goes to the log only
        raise bad_request("the client closed the connection before its request body was complete") from None


async def _read_submission(request: web.Request, upload_dir: Path, policy: InputPolicy) -> dict[str, Any]:
    if request.content_type == "application/json":
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # the server's body limit, answered in this API's JSON form
            limit = request.client_max_size
            raise http_error(web.HTTPRequestEntityTooLarge, f"the request body exceeds {limit} bytes",
                             max_size=limit, actual_size=request.content_length or limit + 1) from None
        return _request_fields(_parse_json(raw, "the request body"), policy, {})
    if request.content_type == "multipart/form-data":
        largest = policy.max_upload_bytes + MAX_REQUEST_JSON_BYTES
        if request.content_length is not None and request.content_length > largest:
            raise _too_large(policy, request.content_length)
        try:
            body, uploads = await _read_multipart(request, upload_dir, policy)
        except (HttpProcessingError, ValueError) as exc:
            # aiohttp's parser: a bad boundary, headers (a NUL byte), framing
            raise bad_request(f"the multipart body is malformed: {getattr(exc, 'message', None) or exc}") from None
        return _request_fields(body, policy, uploads)
    raise http_error(
        web.HTTPUnsupportedMediaType, f"send application/json or multipart/form-data, not {request.content_type!r}"
    )


def _parse_json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"{what} nests arrays or objects too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"{what} is not valid JSON: {exc}") from None
    except ValueError as exc:  # an integer literal beyond Python's digit limit
        raise bad_request(f"{what} holds a number too long to read: {str(exc).split(';')[0]}") from None
    if not isinstance(body, dict):
        raise bad_request(f"{what} must be a JSON object, got {json_type(body)}")
    return body


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type (null, boolean, number, string, array, object)."""
    for kind, name in (
        (type(None), "null"), (bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"),
        (dict, "object")
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _request_fields(body: dict[str, Any], policy: InputPolicy, uploads: dict[str, list[Path]]) -> dict[str, Any]:
    """Scalars pass through as given: `VideoRequest` checks their types (one validator); file fields become local
    paths. A path field may be one path string or, for references, a list of them."""
    unknown = sorted(set(body) - set(SCALAR_FIELDS) - set(FILE_FIELDS))
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(unknown)}; accepted: {', '.join(SCALAR_FIELDS + FILE_FIELDS)}")
    if "prompt" not in body:
        raise bad_request("prompt is required")
    fields: dict[str, Any] = {name: body[name] for name in SCALAR_FIELDS if name in body}
    for name in FILE_FIELDS:
        if name in body and name in uploads:
            raise bad_request(f"{name} was given both as a path and as an upload")
    for name in ("first_frame", "last_frame"):
        if name in uploads:
            fields[name] = str(uploads[name][0])
        elif body.get(name) is not None:
            fields[name] = str(resolve_input_path(_string(name, body[name]), policy))
    if "references" in uploads:
        fields["references"] = tuple(str(path) for path in uploads["references"])
    elif body.get("references") is not None:
        refs = body["references"]
        if not isinstance(refs, (str, list)):
            raise bad_request(f"references must be a path or a list of paths, got {type(refs).__name__}")
        refs = [refs] if isinstance(refs, str) else refs
        fields["references"] = tuple(str(resolve_input_path(_string("references", ref), policy)) for ref in refs)
    return fields


def _string(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty path string, got {json.dumps(value)}")
    return value


def resolve_input_path(value: str, policy: InputPolicy) -> Path:
    """A client path, resolved with symlinks; it must name a file inside the input folder (`fileio.resolve_inside`),
    which the client is told of as "the input folder", never by its path on this host."""
    if policy.input_dir is None:
        raise bad_request(
            f"this service takes input files as uploads only (it was started without --input-dir); got path {value!r}"
        )
    try:
        return resolve_inside(policy.input_dir, value, "input path")
    except VflashError as exc:
        raise bad_request(str(exc).replace(f" {policy.input_dir}", "")) from None


async def _read_multipart(
    request: web.Request, upload_dir: Path, policy: InputPolicy
) -> tuple[dict[str, Any], dict[str, list[Path]]]:
    body: dict[str, Any] | None = None
    uploads: dict[str, list[Path]] = {}
    remaining = policy.max_upload_bytes
    reader = await request.multipart()
    async for part in reader:
        if not isinstance(part, BodyPartReader):
            raise bad_request("nested multipart bodies are not accepted")
        if part.name == REQUEST_PART:
            if body is not None:
                raise bad_request(f"more than one {REQUEST_PART!r} part")
            raw = await _read_capped(part, MAX_REQUEST_JSON_BYTES)
            if raw is None:
                raise http_error(
                    web.HTTPRequestEntityTooLarge, f"the {REQUEST_PART!r} part exceeds {MAX_REQUEST_JSON_BYTES} bytes",
                    max_size=MAX_REQUEST_JSON_BYTES, actual_size=MAX_REQUEST_JSON_BYTES + 1,
                )
            body = _parse_json(raw, f"the {REQUEST_PART!r} part")
        elif part.name in FILE_FIELDS:
            files = uploads.setdefault(part.name, [])
            if files and part.name != "references":
                raise bad_request(f"more than one {part.name} upload")
            if len(files) == MAX_REFERENCES:  # refused before another file is written
                raise bad_request(f"H3 takes at most {MAX_REFERENCES} references in total, got more")
            index = len(files) + 1
            target = upload_dir / (f"reference-{index}" if part.name == "references" else part.name)
            target = target.with_name(target.name + upload_suffix(part.filename))
            remaining -= await _save(part, target, remaining, policy)
            files.append(target)
        else:
            raise bad_request(
                f"unknown multipart part {part.name!r}; accepted: {REQUEST_PART}, {', '.join(FILE_FIELDS)}"
            )
    if body is None:
        raise bad_request(f"a multipart submission needs a {REQUEST_PART!r} part holding the JSON request")
    return body, uploads


def upload_suffix(filename: str | None) -> str:
    """The only thing taken from a client's file name: a short alphanumeric extension, which media loaders use."""
    if not filename:
        return ""
    suffix = PurePosixPath(PureWindowsPath(filename).name).suffix.lower()
    return suffix if _SUFFIX.fullmatch(suffix) else ""


async def _read_capped(part: BodyPartReader, limit: int) -> bytes | None:
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


async def _save(part: BodyPartReader, target: Path, budget: int, policy: InputPolicy) -> int:
    """Stream one upload to `target`; returns its size. Raises 413 as soon as the budget is exceeded."""
    written = 0
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # "x": service names are unique; never follow or replace an existing file. File I/O runs off the event loop.
        out = await asyncio.to_thread(open, target, "xb")
        try:
            while chunk := await part.read_chunk(_CHUNK):
                written += len(chunk)
                if written > budget:
                    raise _too_large(policy, policy.max_upload_bytes - budget + written)
                await asyncio.to_thread(out.write, chunk)
        finally:
            out.close()
    except ConnectionResetError:  # the client went away: `read_submission` answers it
        raise
    except OSError as exc:  # a full disk under the work folder: the service's fault, said without its paths
        raise http_error(
            web.HTTPInsufficientStorage, f"the service cannot store the {part.name} upload now: {exc.strerror or exc}"
        ) from None
    if written == 0:
        raise bad_request(f"the {part.name} upload is empty")
    return written


def _too_large(policy: InputPolicy, actual: int) -> web.HTTPException:
    """`actual` is the size seen so far (reading stops at the first byte over the limit)."""
    return http_error(
        web.HTTPRequestEntityTooLarge,
        f"uploads exceed this service's limit of {policy.max_upload_bytes} bytes per job",
        max_size=policy.max_upload_bytes, actual_size=actual,
    )
