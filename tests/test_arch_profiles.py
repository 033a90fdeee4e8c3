"""GPU families and their profiles, on the CPU: the device facts (CUDA's availability, device count and compute
capability) are simulated by monkeypatching `torch.cuda`, as ComfyUI's option lists are tested
(`tests/test_nodes_core_models.py`). Checked: which capabilities each family covers, the profiles each family has,
the attention `auto` resolves to and the explicit choices refused there, where FP8 w8a8 runs, and each refusal's one
line."""

from __future__ import annotations

import pytest
import torch

from vflash_core.engine import attention, fp8
from vflash_core.errors import IdentityMismatchError, VflashError
from vflash_core.formats import ARCH_FAMILIES, capability_arch, check_device, device_arch, gpu_device
from vflash_core.pipeline.options import RunOptions
from vflash_core.profiles import PROFILES, Profile, get_profile

CUDA0 = torch.device("cuda:0")
# (capability, family tag) of the boards users own; sm75 (RTX 20xx / T4) has no family.
BOARDS = [((8, 0), "sm80"), ((8, 6), "sm86"), ((8, 9), "sm89"), ((9, 0), "sm90"), ((10, 0), "sm100"), ((10, 3), "sm100"),
          ((12, 0), "sm120"), ((12, 1), "sm120"), ((7, 5), "sm75")]


@pytest.fixture
def gpu_of(monkeypatch):
    """Make this machine look like one with two CUDA devices of the given capability; returns the setter."""

    def simulate(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"simulated sm{capability[0]}{capability[1]}")

    return simulate


@pytest.fixture
def probes(monkeypatch):
    """The attention backends `resolve_attention` probed on the device (the probe itself needs a real GPU)."""
    probed: list[str] = []
    monkeypatch.setattr(attention, "_probe", lambda name, fn, device: probed.append(name))
    return probed


@pytest.mark.parametrize("capability,tag", BOARDS)
def test_each_capability_maps_to_its_family(gpu_of, capability, tag):
    gpu_of(capability)
    assert capability_arch(capability) == device_arch(CUDA0) == tag
    if tag in ARCH_FAMILIES:
        assert capability in ARCH_FAMILIES[tag].capabilities
    assert {c for f in ARCH_FAMILIES.values() for c in f.capabilities} == {c for c, t in BOARDS if t != "sm75"}


def test_every_family_has_the_exact_families_and_fp8_only_with_fp8_tensor_cores():
    for tag, family in ARCH_FAMILIES.items():
        ids = {p for p, v in PROFILES.items() if v.arch == tag}
        assert {f"t2va-turbo4-exact-{tag}", f"ref2va-turbo4-exact-{tag}", f"i2va-base16-bf16-{tag}", f"t2va-turbo4-pruned-{tag}"} <= ids
        fp8_ids = {p for p in ids if PROFILES[p].fp8}
        assert bool(fp8_ids) == family.fp8 and all("-fp8-" in p and PROFILES[p].fp8 == "w8a8" for p in fp8_ids)
    assert {t for t, f in ARCH_FAMILIES.items() if f.fp8} == {"sm89", "sm90", "sm100", "sm120"}
    assert [t for t, f in ARCH_FAMILIES.items() if f.fa3] == ["sm90"]
    # the sm120 profiles are the sm90 ones on another family: same schedule, adapter and modes
    for stem in ("t2va-turbo4-exact", "t2va-turbo4-fp8", "i2va-base16-fp8", "i2va-turbo8-544-exact"):
        sm90, sm120 = get_profile(f"{stem}-sm90"), get_profile(f"{stem}-sm120")
        assert {k: v for k, v in sm120.identity().items() if k != "arch"} == {k: v for k, v in sm90.identity().items() if k != "arch"}
    assert "t2va-base16-bf16-sm100" in PROFILES and "t2va-base16-bf16-sm120" not in PROFILES  # resident: 180 GB boards


def test_profiles_that_cannot_run_are_refused_in_one_line():
    with pytest.raises(VflashError, match=r"^no profile 't2va-turbo4-fp8-sm86': FP8 w8a8 needs FP8 tensor cores \(sm89, sm90, sm100, sm120\); sm86 GPUs .* have none; for sm86 choose a BF16 profile \(e.g. t2va-turbo4-exact-sm86\)$"):
        get_profile("t2va-turbo4-fp8-sm86")
    with pytest.raises(VflashError, match=r"^no profile 't2va-turbo4-fp8-sm80': FP8 w8a8 needs FP8 tensor cores"):
        get_profile("t2va-turbo4-fp8-sm80")
    with pytest.raises(VflashError, match=r"^no profile 't2va-turbo4-exact-sm75': no Vflash profile runs on sm75 \(GPU families: sm80, sm86, sm89, sm90, sm100, sm120\)$"):
        get_profile("t2va-turbo4-exact-sm75")
    base = get_profile("t2va-turbo4-fp8-sm120")
    with pytest.raises(VflashError, match=r"^profile x: FP8 w8a8 needs FP8 tensor cores .*; sm80 GPUs .* have none$"):
        Profile(**{**base.to_dict(), "id": "x", "arch": "sm80"})
    with pytest.raises(VflashError, match=r"^profile x: arch 'sm103' is not a GPU family"):  # sm103 is covered by sm100
        Profile(**{**base.to_dict(), "id": "x", "arch": "sm103"})


@pytest.mark.parametrize("capability,tag", [b for b in BOARDS if b[1] != "sm90"])
def test_auto_attention_is_cudnn_off_sm90_and_fa3_is_refused_there(gpu_of, probes, capability, tag):
    gpu_of(capability)
    assert attention.resolve_attention("auto", CUDA0)[0] == "torch-cudnn" and probes == ["torch-cudnn"]
    for name, kind in (("fa3", "kernels"), ("fa3-fp8", "FP8 kernels")):
        with pytest.raises(VflashError, match=rf"^attention backend {name} runs FlashAttention-3's SM90 {kind} only; cuda:0 is .*{tag}.*: use auto \(cuDNN there\)$"):
            attention.resolve_attention(name, CUDA0, approximate_allowed=True)
    assert probes == ["torch-cudnn"]  # refused before anything was imported or probed


def test_auto_attention_tries_fa3_on_sm90_only(gpu_of, probes, monkeypatch):
    gpu_of((9, 0))
    tried = []
    monkeypatch.setattr(attention, "_fa3", lambda: tried.append("fa3") or (lambda q, k, v: q))
    assert attention.resolve_attention("auto", CUDA0)[0] == "fa3" and tried == ["fa3"] and probes == ["fa3"]
    gpu_of((12, 0))
    assert attention.resolve_attention("auto", CUDA0)[0] == "torch-cudnn" and tried == ["fa3"]


@pytest.mark.parametrize("capability,tag", BOARDS)
def test_w8a8_runs_on_the_fp8_families_only(gpu_of, capability, tag):
    gpu_of(capability)
    refusal = fp8.w8a8_refusal(CUDA0)
    if tag in ("sm89", "sm90", "sm100", "sm120"):
        assert refusal is None
        fp8.RowFP8Matmul("w8a8").check_device(CUDA0)
    else:
        assert refusal == f"FP8 w8a8 execution needs FP8 tensor cores, a CUDA device of sm89, sm90, sm100, sm120; cuda:0 is {'sm75' if tag == 'sm75' else ARCH_FAMILIES[tag].name}"
        with pytest.raises(VflashError, match="needs FP8 tensor cores"):
            fp8.RowFP8Matmul("w8a8").check_device(CUDA0)


def test_device_check_pairs_a_profile_with_its_family(gpu_of, probes, monkeypatch):
    gpu_of((10, 3))  # a B300 runs the sm100 profiles
    assert check_device(1, "sm100", profile_id="t2va-turbo4-exact-sm100") == torch.device("cuda:1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    # one name per device: a bare "cuda" is the current device with its index, as the session and the plan compare them
    assert check_device("cuda", "sm100") == check_device(torch.device("cuda:1"), "sm100") == torch.device("cuda:1")
    assert check_device(gpu_device(0), "sm100") == torch.device("cuda:0")
    RunOptions(device="cuda:0").check_devices(get_profile("t2va-turbo4-fp8-sm100"))
    with pytest.raises(IdentityMismatchError, match=r"^profile t2va-turbo4-exact-sm120 runs on sm120 GPUs \(RTX 50xx .*\); the device cuda:0 is sm100$"):
        check_device("cuda:0", "sm120", profile_id="t2va-turbo4-exact-sm120")
    gpu_of((7, 5))
    with pytest.raises(IdentityMismatchError, match=r"^profile t2va-turbo4-exact-sm80 runs on sm80 GPUs .*; the device cuda:0 is sm75, which no Vflash profile runs on \(GPU families: sm80, sm86, sm89, sm90, sm100, sm120\)$"):
        check_device("cuda:0", "sm80", profile_id="t2va-turbo4-exact-sm80")
    gpu_of((12, 0))
    with pytest.raises(VflashError, match="fa3 runs FlashAttention-3's SM90 kernels only; cuda:0 is sm120"):
        RunOptions(device="cuda:0", attention_backend="fa3").check_devices(get_profile("t2va-turbo4-exact-sm120"))
