"""Named profiles: the fixed model, adapter, schedule and hardware a compiled artifact is bound to.

A profile fixes which generation modes a session accepts, which transformer partition it runs, which LoRA (if any) at
which alpha and rank, the number of evaluations and the two schedule shifts, the allowed clip durations and the GPU
architecture the tables were computed on. Compiled artifacts record the profile's identity; at load the identities
(not the name) are compared, so renaming a profile never converts assets, and a mismatch names both sides.

Each exact family exists for every GPU family of `formats.ARCH_FAMILIES` it fits (sm80, sm86, sm89, sm90, sm100,
sm120; the id ends in the family's tag, e.g. `t2va-turbo4-exact-sm120`): the exact path runs unchanged on all of them
(BF16 GEMMs, the Triton kernels, cuDNN attention; FlashAttention-3 only on sm90). The published ids for SM86 (RTX
3080) and SM89 (RTX 4090) are kept; the full-range Base16 families need the memory of sm90 / sm100 boards. CPU profiles
serve the tests and the embedded demo.

Approximate profiles carry it in their id and are never chosen for you: `-pruned` (a pruned file's reduced-rank
AdaLN) and `-fp8` (the four block linears compiled to E4M3 codes with FP32 row scales and run in FP8, `fp8.py`; only
they accept the approximate FP8 attention backend `fa3-fp8`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import IdentityMismatchError, VflashError
from .formats import ARCH_FAMILIES, ARCH_NAMES
from .schedule import FixedSchedule

__all__ = ["PROFILES", "AdapterSpec", "Profile", "check_identity", "get_profile"]

KEYFRAME_MODES = ("i2va", "l2va", "fl2va")
# (conditioned video, reference audio) per mode: references always carry video; soundtracks are optional.
_TIMESTEP_KINDS = {"t2va": [(False, False)], **{m: [(True, False)] for m in KEYFRAME_MODES},
                   "ref2va": [(True, False), (True, True)]}


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA a profile is built with: applied once as `strength * alpha / rank` per module (alpha and rank as
    released)."""

    name: str
    file_name: str
    alpha: float
    rank: int
    strength: float = 1.0


@dataclass(frozen=True)
class Profile:
    id: str
    modes: tuple[str, ...]  # generation modes a session of this profile accepts
    variant: str  # "transformer" (t2va / keyframes) or "transformer_ref" (ref2va)
    adapter: AdapterSpec | None
    nfe: int  # model evaluations per request
    video_shift: float
    audio_shift: float
    min_seconds: float
    max_seconds: float
    arch: str  # a GPU family tag (`formats.ARCH_FAMILIES`: "sm80" ... "sm120") or "cpu": where the tables were computed
    attention: str = "exact"
    # Approximate: compiled from a pruned file (an `adaln_t_table` replaces the time embedder; reduced-rank AdaLN),
    # whose tables are computed as ComfyUI core computes them for that file. Only pruned files compile for it.
    pruned: bool = False
    # Approximate: the block linears as E4M3 codes + FP32 row scales (an FP8 artifact) run as `fp8.RowFP8Matmul`
    # of this mode ("weight-only" or "w8a8"); None for BF16 block linears.
    fp8: str | None = None

    def __post_init__(self) -> None:
        if self.fp8 is not None and self.fp8 not in ("weight-only", "w8a8"):
            raise VflashError(f"profile {self.id}: fp8 must be 'weight-only' or 'w8a8', got {self.fp8!r}")
        if self.arch != "cpu" and self.arch not in ARCH_FAMILIES:
            raise VflashError(
                f"profile {self.id}: arch {self.arch!r} is not a GPU family ({', '.join(ARCH_FAMILIES)}) or 'cpu'"
            )
        # A GPU family without FP8 tensor cores never runs w8a8; on the CPU the session refuses it when it loads.
        if self.fp8 == "w8a8" and self.arch in ARCH_FAMILIES and not ARCH_FAMILIES[self.arch].fp8:
            raise VflashError(f"profile {self.id}: {_no_fp8(self.arch)}")

    @property
    def schedule(self) -> FixedSchedule:
        return FixedSchedule(self.nfe, self.video_shift, self.audio_shift)

    def timestep_kinds(self) -> list[tuple[bool, bool]]:
        """(conditioned video, reference audio) combinations a request of this profile can present to the model."""
        return sorted(set().union(*(_TIMESTEP_KINDS[mode] for mode in self.modes)))

    def identity(self) -> dict[str, object]:
        """What must agree between a profile and an artifact compiled for it (the id is not part of it)."""
        out = asdict(self)
        del out["id"], out["min_seconds"], out["max_seconds"], out["modes"]
        if not self.pruned:  # absent from the identities of artifacts compiled before pruned profiles existed
            del out["pruned"]
        if self.fp8 is None:  # likewise before FP8 profiles existed
            del out["fp8"]
        out["timestep_kinds"] = [list(k) for k in self.timestep_kinds()]
        return out

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def check_mode(self, mode: str) -> None:
        if mode not in self.modes:
            raise VflashError(f"profile {self.id} accepts {', '.join(self.modes)}; a {mode} request was given")

    def check_duration(self, seconds: float) -> None:
        if not self.min_seconds - 1e-9 <= seconds <= self.max_seconds + 1e-9:
            raise VflashError(
                f"profile {self.id} generates {self.min_seconds:g}-{self.max_seconds:g} s clips; "
                f"{seconds:.3f} s requested"
            )


def _no_fp8(arch: str) -> str:
    """Why an architecture has no FP8 w8a8 profile."""
    with_fp8 = ", ".join(tag for tag, family in ARCH_FAMILIES.items() if family.fp8)
    return f"FP8 w8a8 needs FP8 tensor cores ({with_fp8}); {ARCH_NAMES.get(arch, arch)} have none"


def check_identity(expected: Profile, recorded: dict[str, object], what: str) -> None:
    """Compare a profile's identity with the one an artifact recorded; the error names both sides."""
    mine = expected.identity()
    diffs = [
        f"{k}: profile {expected.id} has {mine.get(k)!r}, {what} has {recorded.get(k)!r}"
        for k in sorted(set(mine) | set(recorded))
        if mine.get(k) != recorded.get(k)
    ]
    if diffs:
        raise IdentityMismatchError(f"{what} does not match profile {expected.id}: " + "; ".join(diffs))


_REF_TURBO4 = AdapterSpec("Ref Turbo4 v0.1", "minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors", 8.0, 128)
_BASE_TURBO4 = AdapterSpec("Base Turbo4 v1.0", "minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors", 128.0, 128)
_LIGHTX_V01 = AdapterSpec("LightX Turbo4 v0.1", "minimax_h3_fl2v_turbo_4step_v0.1.safetensors", 8.0, 128)
_LIGHTX_TURBO8 = AdapterSpec("LightX Turbo8 v1.0 544p", "minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors", 8.0, 128)
_KEYFRAMES = KEYFRAME_MODES


def _family(stem: str, archs: tuple[str, ...], **fields: object) -> dict[str, Profile]:
    return {f"{stem}-{arch}": Profile(id=f"{stem}-{arch}", arch=arch, **fields) for arch in archs}  # type: ignore[arg-type]


#: The GPU families each kind of family is built for (`formats.ARCH_FAMILIES`): every one for the exact families that
#: fit a 24 GB card, the published 544p LightX ones from sm89 on, the full-range Base16 ones where the board's memory
#: holds them resident (sm90: 141 GB, sm100: 180 GB), and FP8 on the families with FP8 tensor cores.
_GPU = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120")
_GPU_544 = ("sm89", "sm90", "sm100", "sm120")
_LARGE = ("sm90", "sm100")
_FP8 = tuple(tag for tag, family in ARCH_FAMILIES.items() if family.fp8)
_FP8_LARGE = tuple(tag for tag in _LARGE if ARCH_FAMILIES[tag].fp8)
PROFILES: dict[str, Profile] = {
    **_family(
        "ref2va-turbo4-exact", _GPU, modes=("ref2va",), variant="transformer_ref", adapter=_REF_TURBO4, nfe=4,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=5.2
    ),
    **_family(
        "t2va-turbo4-exact", _GPU, modes=("t2va",), variant="transformer", adapter=_BASE_TURBO4, nfe=4, video_shift=6.0,
        audio_shift=3.0, min_seconds=5.0, max_seconds=5.2
    ),
    **_family(
        "i2va-base16-bf16", _GPU, modes=_KEYFRAMES, variant="transformer", adapter=None, nfe=16, video_shift=12.0,
        audio_shift=3.0, min_seconds=5.0, max_seconds=10.2
    ),
    **_family(
        "fl2va-base16-bf16", _GPU, modes=_KEYFRAMES, variant="transformer", adapter=None, nfe=16, video_shift=12.0,
        audio_shift=3.0, min_seconds=5.0, max_seconds=10.2
    ),
    **_family(
        "i2va-turbo4-v01-544-exact", _GPU_544, modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_V01, nfe=4,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2
    ),
    **_family(
        "fl2va-turbo4-v01-544-exact", _GPU_544, modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_V01, nfe=4,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2
    ),
    **_family(
        "i2va-turbo8-544-exact", _GPU_544, modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_TURBO8, nfe=8,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2
    ),
    **_family(
        "fl2va-turbo8-544-exact", _GPU_544, modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_TURBO8, nfe=8,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2
    ),
    # The official Base model at its 16 evaluations, every mode of its partition, full 5-15 s range (resident).
    **_family(
        "t2va-base16-bf16", _LARGE, modes=("t2va", *_KEYFRAMES), variant="transformer", adapter=None, nfe=16,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0
    ),
    **_family(
        "ref2va-base16-bf16", _LARGE, modes=("ref2va",), variant="transformer_ref", adapter=None, nfe=16,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0
    ),
    # Pruned Comfy-Org files (approximate, never chosen for you): the Turbo4 t2va and Base16 profiles over a pruned
    # file's rank-k time embedding (its `adaln_t_table` read by linear interpolation) and reduced-rank AdaLN.
    **_family(
        "t2va-turbo4-pruned", _GPU, modes=("t2va",), variant="transformer", adapter=_BASE_TURBO4, nfe=4,
        video_shift=6.0, audio_shift=3.0, min_seconds=5.0, max_seconds=5.2, pruned=True
    ),
    **_family(
        "t2va-base16-pruned-bf16", _LARGE, modes=("t2va", *_KEYFRAMES), variant="transformer", adapter=None, nfe=16,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0, pruned=True
    ),
    # FP8 (approximate, never chosen for you): the Turbo4 t2va profile and the Base16 profiles with the block linears
    # in w8a8 FP8 (FP8 artifacts: half the block bytes on the device and through the block ring), on every family
    # with FP8 tensor cores; compiled from a BF16 file (row scales of its weights) or straight from an fp8_scaled
    # file (its own E4M3 codes, its per-tensor scale per row).
    **_family(
        "t2va-turbo4-fp8", _FP8, modes=("t2va",), variant="transformer", adapter=_BASE_TURBO4, nfe=4, video_shift=6.0,
        audio_shift=3.0, min_seconds=5.0, max_seconds=5.2, fp8="w8a8"
    ),
    **_family(
        "i2va-base16-fp8", _FP8, modes=_KEYFRAMES, variant="transformer", adapter=None, nfe=16, video_shift=12.0,
        audio_shift=3.0, min_seconds=5.0, max_seconds=10.2, fp8="w8a8"
    ),
    **_family(
        "t2va-base16-fp8", _FP8_LARGE, modes=("t2va", *_KEYFRAMES), variant="transformer", adapter=None, nfe=16,
        video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0, fp8="w8a8"
    ),
    # CPU profiles: tests and the embedded demo.
    # The Turbo4 t2va profile's schedule and adapter on the CPU: the end-to-end benchmark's dry run at demo size.
    "t2va-turbo4-exact-cpu": Profile(
        "t2va-turbo4-exact-cpu", ("t2va",), "transformer", _BASE_TURBO4, 4, 6.0, 3.0, 5.0, 5.2, "cpu"
    ),
    "t2va-base4-exact-cpu": Profile(
        "t2va-base4-exact-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu"
    ),
    "t2va-base16-exact-cpu": Profile(
        "t2va-base16-exact-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 16, 12.0, 3.0, 5.0, 15.0, "cpu"
    ),
    "t2va-base4-pruned-cpu": Profile(
        "t2va-base4-pruned-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu", pruned=True
    ),
    "t2va-base4-fp8-cpu": Profile(
        "t2va-base4-fp8-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu",
        fp8="weight-only"
    ),
    "ref2va-base4-exact-cpu": Profile(
        "ref2va-base4-exact-cpu", ("ref2va",), "transformer_ref", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu"
    ),
}


def get_profile(profile_id: str | Profile) -> Profile:
    """The registered profile of an id; a `Profile` is returned as it is."""
    if isinstance(profile_id, Profile):
        return profile_id
    try:
        return PROFILES[profile_id]
    except KeyError:
        pass
    stem, _, arch = str(profile_id).rpartition("-")
    if "-fp8" in stem and arch in ARCH_FAMILIES and not ARCH_FAMILIES[arch].fp8:
        raise VflashError(
            f"no profile {profile_id!r}: {_no_fp8(arch)}; "
            f"for {arch} choose a BF16 profile (e.g. t2va-turbo4-exact-{arch})"
        )
    if stem and arch.startswith("sm") and arch not in ARCH_FAMILIES:
        raise VflashError(
            f"no profile {profile_id!r}: no Vflash profile runs on {arch} (GPU families: {', '.join(ARCH_FAMILIES)})"
        )
    raise VflashError(f"unknown profile {profile_id!r}; known profiles: {', '.join(sorted(PROFILES))}")
