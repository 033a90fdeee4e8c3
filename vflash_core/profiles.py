"""Named profiles: the fixed model, adapter, schedule and hardware a compiled artifact is bound to.

A profile fixes which generation modes a session accepts, which transformer partition it runs, which LoRA (if any) at
which alpha and rank, the number of evaluations and the two schedule shifts, the allowed clip durations and the GPU
architecture the tables were computed on. Compiled artifacts record the profile's identity; at load the identities
(not the name) are compared, so renaming a profile never converts assets, and a mismatch names both sides.

The published profile ids for SM86 (RTX 3080) and SM89 (RTX 4090) are kept; SM90 (H100/H200) variants and CPU profiles (tests,
the embedded demo) are added.

Approximate profiles carry it in their id and are never chosen for you: `-pruned` (a pruned file's reduced-rank
AdaLN) and `-fp8` (the four block linears compiled to E4M3 codes with FP32 row scales and run in FP8, `fp8.py`; only
they accept the approximate FP8 attention backend `fa3-fp8`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .engine.schedule import FixedSchedule
from .errors import IdentityMismatchError, VflashError

__all__ = ["PROFILES", "AdapterSpec", "Profile", "check_identity", "get_profile"]

KEYFRAME_MODES = ("i2va", "l2va", "fl2va")
# (conditioned video, reference audio) per mode: references always carry video; soundtracks are optional.
_TIMESTEP_KINDS = {"t2va": [(False, False)], **{m: [(True, False)] for m in KEYFRAME_MODES},
                   "ref2va": [(True, False), (True, True)]}


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA a profile is built with: applied once as `strength * alpha / rank` per module (alpha, rank as released)."""

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
    arch: str  # "sm86", "sm89", "sm90" or "cpu": where the schedule tables were computed
    attention: str = "exact"
    # Approximate: compiled from a pruned file (an `adaln_t_table` replaces the time embedder; reduced-rank AdaLN),
    # whose tables are computed as ComfyUI core computes them for that file. Only pruned files compile for it.
    pruned: bool = False
    # Approximate: the block linears as E4M3 codes + FP32 row scales (an FP8 artifact) run as `fp8.RowFP8Execution`
    # of this mode ("weight-only" or "w8a8"); None for BF16 block linears.
    fp8: str | None = None

    def __post_init__(self) -> None:
        if self.fp8 is not None and self.fp8 not in ("weight-only", "w8a8"):
            raise VflashError(f"profile {self.id}: fp8 must be 'weight-only' or 'w8a8', got {self.fp8!r}")

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
                f"profile {self.id} generates {self.min_seconds:g}-{self.max_seconds:g} s clips; {seconds:.3f} s requested"
            )


def check_identity(expected: Profile, recorded: dict[str, object], what: str) -> None:
    """Compare a profile's identity with the one an artifact recorded; the error names both sides."""
    mine = expected.identity()
    diffs = [f"{k}: profile {expected.id} has {mine.get(k)!r}, {what} has {recorded.get(k)!r}" for k in sorted(set(mine) | set(recorded)) if mine.get(k) != recorded.get(k)]
    if diffs:
        raise IdentityMismatchError(f"{what} does not match profile {expected.id}: " + "; ".join(diffs))


_REF_TURBO4 = AdapterSpec("Ref Turbo4 v0.1", "minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors", 8.0, 128)
_BASE_TURBO4 = AdapterSpec("Base Turbo4 v1.0", "minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors", 128.0, 128)
_LIGHTX_V01 = AdapterSpec("LightX Turbo4 v0.1", "minimax_h3_fl2v_turbo_4step_v0.1.safetensors", 8.0, 128)
_LIGHTX_TURBO8 = AdapterSpec("LightX Turbo8 v1.0 544p", "minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors", 8.0, 128)
_KEYFRAMES = KEYFRAME_MODES


def _family(stem: str, archs: tuple[str, ...], **fields: object) -> dict[str, Profile]:
    return {f"{stem}-{arch}": Profile(id=f"{stem}-{arch}", arch=arch, **fields) for arch in archs}  # type: ignore[arg-type]


_GPU = ("sm86", "sm89", "sm90")
PROFILES: dict[str, Profile] = {
    **_family("ref2va-turbo4-exact", _GPU, modes=("ref2va",), variant="transformer_ref", adapter=_REF_TURBO4, nfe=4, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=5.2),
    **_family("t2va-turbo4-exact", _GPU, modes=("t2va",), variant="transformer", adapter=_BASE_TURBO4, nfe=4, video_shift=6.0, audio_shift=3.0, min_seconds=5.0, max_seconds=5.2),
    **_family("i2va-base16-bf16", _GPU, modes=_KEYFRAMES, variant="transformer", adapter=None, nfe=16, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2),
    **_family("fl2va-base16-bf16", _GPU, modes=_KEYFRAMES, variant="transformer", adapter=None, nfe=16, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2),
    **_family("i2va-turbo4-v01-544-exact", ("sm89", "sm90"), modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_V01, nfe=4, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2),
    **_family("fl2va-turbo4-v01-544-exact", ("sm89", "sm90"), modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_V01, nfe=4, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2),
    **_family("i2va-turbo8-544-exact", ("sm89", "sm90"), modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_TURBO8, nfe=8, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2),
    **_family("fl2va-turbo8-544-exact", ("sm89", "sm90"), modes=_KEYFRAMES, variant="transformer", adapter=_LIGHTX_TURBO8, nfe=8, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=10.2),
    # The official Base model at its 16 evaluations, every mode of its partition, full 5-15 s range (SM90 only:
    # the 141 GB H200 runs it resident).
    **_family("t2va-base16-bf16", ("sm90",), modes=("t2va", *_KEYFRAMES), variant="transformer", adapter=None, nfe=16, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0),
    **_family("ref2va-base16-bf16", ("sm90",), modes=("ref2va",), variant="transformer_ref", adapter=None, nfe=16, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0),
    # Pruned Comfy-Org files (approximate, never chosen for you): the Turbo4 t2va and Base16 profiles over a pruned
    # file's rank-k time embedding (its `adaln_t_table` read by linear interpolation) and reduced-rank AdaLN.
    **_family("t2va-turbo4-pruned", _GPU, modes=("t2va",), variant="transformer", adapter=_BASE_TURBO4, nfe=4, video_shift=6.0, audio_shift=3.0, min_seconds=5.0, max_seconds=5.2, pruned=True),
    **_family("t2va-base16-pruned-bf16", ("sm90",), modes=("t2va", *_KEYFRAMES), variant="transformer", adapter=None, nfe=16, video_shift=12.0, audio_shift=3.0, min_seconds=5.0, max_seconds=15.0, pruned=True),
    # FP8 (approximate, never chosen for you): the Turbo4 t2va profile and the Base16 profiles with the block linears
    # in w8a8 FP8 on Hopper (FP8 artifacts: half the block bytes on the device and through the block ring).
    "t2va-turbo4-fp8-sm90": Profile("t2va-turbo4-fp8-sm90", ("t2va",), "transformer", _BASE_TURBO4, 4, 6.0, 3.0, 5.0, 5.2, "sm90", fp8="w8a8"),
    "i2va-base16-fp8-sm90": Profile("i2va-base16-fp8-sm90", _KEYFRAMES, "transformer", None, 16, 12.0, 3.0, 5.0, 10.2, "sm90", fp8="w8a8"),
    "t2va-base16-fp8-sm90": Profile("t2va-base16-fp8-sm90", ("t2va", *_KEYFRAMES), "transformer", None, 16, 12.0, 3.0, 5.0, 15.0, "sm90", fp8="w8a8"),
    # CPU profiles: tests and the embedded demo.
    # The Turbo4 t2va profile's schedule and adapter on the CPU: the end-to-end benchmark's dry run at demo size.
    "t2va-turbo4-exact-cpu": Profile("t2va-turbo4-exact-cpu", ("t2va",), "transformer", _BASE_TURBO4, 4, 6.0, 3.0, 5.0, 5.2, "cpu"),
    "t2va-base4-exact-cpu": Profile("t2va-base4-exact-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu"),
    "t2va-base16-exact-cpu": Profile("t2va-base16-exact-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 16, 12.0, 3.0, 5.0, 15.0, "cpu"),
    "t2va-base4-pruned-cpu": Profile("t2va-base4-pruned-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu", pruned=True),
    "t2va-base4-fp8-cpu": Profile("t2va-base4-fp8-cpu", ("t2va", *_KEYFRAMES), "transformer", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu", fp8="weight-only"),
    "ref2va-base4-exact-cpu": Profile("ref2va-base4-exact-cpu", ("ref2va",), "transformer_ref", None, 4, 12.0, 3.0, 5.0, 15.0, "cpu"),
}


def get_profile(profile_id: str | Profile) -> Profile:
    """The registered profile of an id; a `Profile` is returned as it is."""
    if isinstance(profile_id, Profile):
        return profile_id
    try:
        return PROFILES[profile_id]
    except KeyError:
        raise VflashError(f"unknown profile {profile_id!r}; known profiles: {', '.join(sorted(PROFILES))}") from None
