"""What the weights compiler writes and the runtime reads: file format tags, the one field-by-field check of the JSON
records they come with (`check_fields`: receipts, manifests, bundles), the hardware identity of a compile
(`device_arch`, over the GPU families `ARCH_FAMILIES`) and the one device check against it (`check_device`).

Both sides import these from here, so loading a compiled model never imports the compiler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard, overload

from .errors import IdentityMismatchError, Number, VflashError, describe_value, is_int, is_real

if TYPE_CHECKING:
    import torch

__all__ = [
    "ARCH_FAMILIES", "ARCH_NAMES", "ARTIFACT_FORMAT", "ARTIFACT_FP8_FORMAT", "GPU_INDEX", "MISSING", "OVERLAY_FORMAT",
    "PIPELINE_FORMAT", "WEIGHTS_RECEIPT_FORMAT", "Field", "arch_family", "capability_arch", "check_device",
    "check_fields", "device_arch", "field_problem", "gpu_device", "is_count", "is_file_name", "is_number", "is_object",
    "is_positive", "is_text", "list_of",
]

WEIGHTS_RECEIPT_FORMAT = "vflash-receipt/1"  # `compiler prepare`: a profile bound to hashed base weights and adapter
ARTIFACT_FORMAT = "vflash-artifact/1"  # `compiler compile`: packed blocks and auxiliary tensors
# `compiler compile` for an FP8 profile (approximate): the same, with the four block linears as E4M3 codes + FP32 row
# scales (`fp8.quantize_block`); a kind of its own, so no BF16 loader or profile ever takes one for the other.
ARTIFACT_FP8_FORMAT = "vflash-artifact-fp8-rows/1"
OVERLAY_FORMAT = "vflash-schedule-overlay/1"  # `compiler compile`: the fixed-schedule AdaLN tables
PIPELINE_FORMAT = "vflash-pipeline/1"  # `prepare-pipeline`: a profile bound to its six assets


@dataclass(frozen=True)
class ArchFamily:
    """One architecture tag of the profiles: the CUDA compute capabilities it covers and what runs there.

    Every family runs the exact path unchanged (BF16 GEMMs, the Triton kernels, cuDNN SDPA). `fp8`: torch's row-wise
    scaled FP8 GEMM (`torch._scaled_mm`, FP8 tensor cores) exists there, so FP8 w8a8 profiles do; `fa3`:
    FlashAttention-3's SM90 kernels (the `fa3` and `fa3-fp8` attention backends) run there."""

    tag: str
    name: str  # what the tag means to a user
    capabilities: tuple[tuple[int, int], ...]
    fp8: bool
    fa3: bool


#: The GPU families Vflash has profiles for, by tag. A family covers capabilities whose kernels are the same code
#: (torch dispatches its GEMMs, SDPA and scaled-FP8 kernels per major version there; Triton compiles the same source):
#: sm103 (B300) runs sm100's, sm121 (GB10) sm120's. sm86 and sm89 are families of their own: the published profile
#: ids name them, and sm89 adds FP8 tensor cores. Measured on sm90 (H200) only; see docs/engine.md "Architectures".
ARCH_FAMILIES: dict[str, ArchFamily] = {f.tag: f for f in (
    ArchFamily("sm80", "sm80 GPUs (A100 / A800 / A30)", ((8, 0),), fp8=False, fa3=False),
    ArchFamily("sm86", "sm86 GPUs (RTX 30xx / A-series)", ((8, 6),), fp8=False, fa3=False),
    ArchFamily("sm89", "sm89 GPUs (RTX 40xx / L4 / L40)", ((8, 9),), fp8=True, fa3=False),
    ArchFamily("sm90", "sm90 GPUs (H100 / H200)", ((9, 0),), fp8=True, fa3=True),
    ArchFamily("sm100", "sm100 GPUs (B200 / GB200, sm103 B300 / GB300)", ((10, 0), (10, 3)), fp8=True, fa3=False),
    ArchFamily(
        "sm120", "sm120 GPUs (RTX 50xx / RTX PRO Blackwell, sm121 GB10)", ((12, 0), (12, 1)), fp8=True, fa3=False
    ),
)}
_CAPABILITY_FAMILY = {capability: family.tag for family in ARCH_FAMILIES.values() for capability in family.capabilities}


def capability_arch(capability: tuple[int, int]) -> str:
    """The architecture tag of a CUDA compute capability: its family's (`ARCH_FAMILIES`), else `"smXY"` (no profile
    runs there; `check_device` says so)."""
    major, minor = capability
    return _CAPABILITY_FAMILY.get((major, minor), f"sm{major}{minor}")


def device_arch(device: torch.device | str) -> str:
    """`"cpu"` or the architecture tag of a CUDA device's compute capability (`capability_arch`): where a compile's
    tables were computed."""
    import torch  # here, not above: the command line's parsers import this module's names without torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return capability_arch(torch.cuda.get_device_capability(device))
    raise VflashError(f"unsupported device {device}")


def arch_family(device: torch.device | str) -> ArchFamily | None:
    """The `ArchFamily` of a device (None for the CPU and for a GPU no family covers)."""
    return ARCH_FAMILIES.get(device_arch(device))


#: What an architecture tag means to a user.
ARCH_NAMES = {"cpu": "the CPU", **{tag: family.name for tag, family in ARCH_FAMILIES.items()}}

#: A CUDA device index on a command line (`--gpu`, `--peer-gpu`); whether this machine has it, `check_device`.
GPU_INDEX = Number(int, 0)


@overload
def gpu_device(gpu: int | None, default: str = "cpu") -> str: ...


@overload
def gpu_device(gpu: int | None, default: None) -> str | None: ...


def gpu_device(gpu: int | None, default: str | None = "cpu") -> str | None:
    """The device a command line's `--gpu N` names, `"cuda:N"`, or `default` where it was not given."""
    return default if gpu is None else f"cuda:{gpu}"


def check_device(
    device: int | str | torch.device, arch: str | None, role: str = "device", profile_id: str | None = None
) -> torch.device:
    """The one resolution of a device a caller names (`"cpu"`, `"cuda:N"`, a GPU index, a `torch.device`; `"cuda"` is
    the current CUDA device, with its index): a device this machine has and, when `arch` is given, of the
    architecture the profile's tables were computed on; checked before any model loads (`profile_id` names the
    profile in the refusal). Initialises CUDA for a CUDA device, so the service's HTTP process never calls it."""
    import torch

    try:
        resolved = torch.device(f"cuda:{device}") if is_int(device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise VflashError(f"{role} {device!r} is not a device; use 'cpu', a GPU index or 'cuda:N'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else " (this torch build has no CUDA support)"
            raise VflashError(f"{role} {resolved} does not exist: CUDA is not available on this machine{build}")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise VflashError(f"{role} {resolved} does not exist: this machine has {count} CUDA device(s)")
        if resolved.index is None:  # one name per device: a group of devices or a placement compares them
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise VflashError(f"{role} {resolved}: Vflash runs on cpu or cuda devices")
    found = device_arch(resolved)
    if arch is not None and found != arch:
        profile = f"profile {profile_id}" if profile_id else "the profile"
        uncovered = (
            "" if found in ARCH_NAMES
            else f", which no Vflash profile runs on (GPU families: {', '.join(ARCH_FAMILIES)})"
        )
        raise IdentityMismatchError(
            f"{profile} runs on {ARCH_NAMES.get(arch, arch)}; the {role} {resolved} is {found}{uncovered}"
        )
    return resolved


# -- the JSON records: receipts, manifests, bundles --------------------------------------------------------------

#: One field of a record: (dotted key, what it must be, the test of its value).
Field = tuple[str, str, Callable[[object], bool]]


def is_count(value: object) -> TypeGuard[int]:
    """An int of 0 or more (a bool is not a count)."""
    return is_int(value) and value >= 0


def is_positive(value: object) -> TypeGuard[int]:
    return is_count(value) and value > 0


def is_number(value: object) -> bool:
    """A finite int or float (a bool is not a number)."""
    return is_real(value) and math.isfinite(value)


def is_text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value)


def is_file_name(value: object) -> bool:
    """A plain file name: a record naming a file beside it must not reach outside its folder."""
    return (
        is_text(value)
        and "/" not in value
        and "\\" not in value
        and "\x00" not in value
        and value not in (".", "..")
    )


def is_object(value: object) -> bool:
    return isinstance(value, dict)


def list_of(*fields: Field) -> Callable[[object], bool]:
    """The test of a list of records, each of which has `fields`."""
    return lambda value: isinstance(value, list) and all(not field_problem(item, fields) for item in value)


def field_problem(record: object, fields: Sequence[Field]) -> tuple[str, object, str] | None:
    """(key, value, what it must be) of the first field of `fields` that `record` lacks (value `MISSING`) or fails,
    or of the part of its key that holds no object where one must be; None if every field passes."""
    for key, what, valid in fields:
        value: object = record
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if depth and not isinstance(value, dict):
                return ".".join(parts[:depth]), value, "an object"
            if not isinstance(value, dict) or part not in value:
                return key, MISSING, what
            value = value[part]
        if not valid(value):
            return key, value, what
    return None


#: `field_problem`'s value of a field that is not there.
MISSING = object()


def check_fields(
    record: object, fields: Sequence[Field], where: str, hint: str = "", error: type[VflashError] = VflashError
) -> None:
    """Refuse a record (a receipt, a manifest, a bundle's) unless every field of `fields` is present and passes its
    test, before any value is used: "<where> has no <key>" or "<where>: <key> must be <what>, got <value>", then
    `hint` (what to do about it)."""
    problem = field_problem(record, fields)
    if problem is None:
        return
    key, value, what = problem
    tail = f"; {hint}" if hint else ""
    if value is MISSING:
        raise error(f"{where} has no {key}{tail}")
    raise error(f"{where}: {key} must be {what}, got {describe_value(value)}{tail}")
