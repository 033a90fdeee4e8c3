"""Shared fixtures: tiny random-weight H3 transformers in the official layouts, compiled artifacts, and the diffusers
0.42.1 reference driven offline (no text encoder, no VAEs) on the same weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

# Fixtures defined beside the helpers of their concern, shared by name with every test module (pytest finds a
# conftest's fixtures by the names it holds).
from comfyui_server_helpers import server  # noqa: F401
from filelock import FileLock
from kernel_harness import gpu, interp  # noqa: F401
from refusals import no_model_loads  # noqa: F401
from service_helpers import make_service  # noqa: F401

from vflash_core.engine.config import H3Config
from vflash_core.profiles import Profile, get_profile
from vflash_core.weights import synthetic
from vflash_core.weights.compiler import compile_receipt, prepare

# Two intra-op threads in one process; one per worker when xdist runs the tests in two (two cores in all either way:
# more threads than cores make torch's OpenMP workers wait on each other). Under xdist the processes the tests start
# (`vflash` commands, the service's spawned workers, interpreter children) run while their test waits on them, so they
# take the worker's share through the environment they inherit: without it each took torch's default of one thread per
# core, beside the other worker's.
TEST_THREADS = max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(TEST_THREADS)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)


# -- files built once per test run ---------------------------------------------------------------------------------
#
# `pytest -q` runs the tests in two pytest-xdist worker processes (`pytest_cmdline_main` below). A session fixture runs
# once per process, so a fixture that builds files (a model, a compile, the demo family) would build them once per
# worker: `built_once` builds them once per run instead, under a file lock, in a folder all workers share.


def _run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every process of this test run shares: xdist gives each worker a basetemp of its own inside the
    run's (`<run>/popen-gw0`, ...); without workers the run's basetemp is the process's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _encode_paths(result: Path | dict[str, Path]) -> str | dict[str, str]:
    return str(result) if isinstance(result, Path) else {key: str(path) for key, path in result.items()}


def _decode_paths(record: str | dict[str, str]) -> Path | dict[str, Path]:
    return Path(record) if isinstance(record, str) else {key: Path(path) for key, path in record.items()}


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path | dict[str, Path]]):
    """`build(folder)` (a new folder `name` of the run's shared folder) once per test run, whichever worker asks
    first; the others wait on the lock and get the paths it returned. A build that raised left no record: the next
    worker to ask removes its folder and builds again (and fails the same way, in its own tests)."""
    shared = _run_folder(tmp_path_factory)
    folder, record = shared / name, shared / f"{name}.built.json"
    with FileLock(shared / f"{name}.lock"):
        if record.is_file():
            return _decode_paths(json.loads(record.read_text()))
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        result = build(folder)
        record.write_text(json.dumps(_encode_paths(result)))
        return result

TINY = H3Config.preset("tiny")

# The example workflows: each API twin (workflows/api/<name>.json, what `vflash run-workflow` and `POST /prompt` take) and
# its UI template (workflows/<title>.json). ComfyUI's template browser shows a custom node's template by its file name,
# as its title and, dashes and underscores read as spaces, as its description, and searches those words; a card shows
# the title alone, on one line cut at about 30 characters. So each title starts with what its graph does, distinct
# within its first 28 characters, and ends with "MiniMax H3 Vflash", the words the searches find.
TEMPLATES = {
    "t2va": "Text to video + audio (demo weights) - MiniMax H3 Vflash",
    "i2va": "First frame to video + audio (demo weights) - MiniMax H3 Vflash",
    "fl2va": "First + last frame to video + audio (demo weights) - MiniMax H3 Vflash",
    "t2va_core_save": "Text to video + audio, core latent and Save Video (demo weights) - MiniMax H3 Vflash",
    "t2va_core_loaders": "Text to video + audio from Comfy-Org files - MiniMax H3 Vflash",
    "ref2va": "Reference image to video + audio (official weights) - MiniMax H3 Vflash",
    "t2va_two_gpu_sequence_head": "Text to video + audio on two GPUs (official weights) - MiniMax H3 Vflash",
}
CARD_TITLE_CHARS = 28  # no more of a title than a template card shows (`tests/test_comfyui_browser.py` measures it)


#: Worker processes of a plain `pytest` run on a machine without CUDA (CI's has 2 cores; more workers were not measured).
CPU_WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Without `-n`, a run on a machine without CUDA takes CPU_WORKERS pytest-xdist workers, whole test files each
    (`--dist loadfile`: a module's fixtures are built once), unless xdist is not installed (`-p no:xdist`, the device
    machines), `--pdb` is given or the machine has fewer cores. With CUDA the tests run in one process: the GPU tests
    would share the devices. `-n 0` runs one process anywhere. (An ini `addopts = -n` would be refused wherever xdist is
    missing.) Called before xdist's own hook, which turns the count into worker processes."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is not None or config.getoption("usepdb") or torch.cuda.is_available():
        return
    if len(os.sched_getaffinity(0)) < CPU_WORKERS:
        return
    config.option.numprocesses = CPU_WORKERS
    if config.option.dist == "no":
        config.option.dist = "loadfile"


#: The test files that take longest on two cores, longest first (measured with `--durations`): the xdist workers take
#: them first, so a run does not end with one worker on a long file while the other has nothing left.
LONGEST_FILES = (
    "test_service.py", "test_bad_inputs_and_faults.py", "test_fp8_profiles.py", "test_vae_decode_fused.py", "test_fp8.py",
    "test_fused_path.py", "test_nodes_core_models.py", "test_nodes.py", "test_workflows.py", "test_static_checks.py",
    "test_relayout_kernels.py", "test_vae_decode.py", "test_demo.py",
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' collection is the order xdist hands the files out in
        rank = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: the rest keep their order
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture(scope="session")
def tiny_config() -> H3Config:
    return TINY


@pytest.fixture(scope="session")
def tiny_weights() -> dict[str, torch.Tensor]:
    """Released mixed-precision layout: bf16 blocks, fp32 patch projections / time embedder / heads."""
    return synthetic.random_internal_weights(TINY, seed=1, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_transformer(tmp_path_factory, tiny_weights) -> Path:
    """A sharded diffusers `transformer/` folder of the tiny model (`tiny_weights`: the same seed in every worker)."""
    return built_once(tmp_path_factory, "tiny", lambda folder: synthetic.write_diffusers_transformer(
        folder / "transformer", TINY, tiny_weights, max_shard_bytes=40_000))


def compile_tiny(tmp: Path, transformer: Path, profile: Profile | str, adapter: Path | None = None, qkv_layout: str | None = None, device: str = "cpu") -> dict[str, Path]:
    """prepare + compile into `tmp`; returns the three paths a session takes."""
    receipt = tmp / "receipt.json"
    prepare(profile, transformer, receipt, adapter, qkv_layout)
    out = compile_receipt(receipt, tmp / "compiled", device)
    return {"artifact": out / "artifact", "schedule_overlay": out / "schedule", "auxiliary": out / "auxiliary.safetensors"}


@pytest.fixture(scope="session")
def tiny_compiled(tmp_path_factory, tiny_transformer) -> dict[str, Path]:
    """The tiny model compiled for the 4-NFE CPU profile (t2va and keyframe modes)."""
    return built_once(tmp_path_factory, "compiled4", lambda folder: compile_tiny(folder, tiny_transformer, "t2va-base4-exact-cpu"))


def cpu_profile(**changes) -> Profile:
    """A variant of the 4-NFE CPU profile (e.g. with an adapter) for tests that need one."""
    return replace(get_profile("t2va-base4-exact-cpu"), **changes)


# -- the diffusers reference ---------------------------------------------------------------------------------------


def diffusers_transformer(folder: Path, dtype: torch.dtype = torch.bfloat16):
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=dtype).eval()


def diffusers_denoise(transformer, profile: Profile, prompt_embeds, text_token_tags, height, width, num_frames, seed, condition_latents=(), keyframe_anchors=()):
    """The modular pipeline's core denoise step (t2va, or fl2va with keyframe latents) on a CPU generator."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
        MiniMaxH3CoreDenoiseStep,
        MiniMaxH3FL2VACoreDenoiseStep,
    )

    fl2va = bool(condition_latents)
    pipe = (MiniMaxH3FL2VACoreDenoiseStep() if fl2va else MiniMaxH3CoreDenoiseStep()).init_pipeline()
    pipe.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(profile.video_shift), audio_scheduler=MiniMaxH3Scheduler(profile.audio_shift))
    kwargs = dict(
        prompt_embeds=prompt_embeds, text_token_tags=text_token_tags, num_inference_steps=profile.nfe + 1,
        generator=torch.Generator().manual_seed(seed), height=height, width=width, num_frames=num_frames,
    )
    if fl2va:
        kwargs.update(condition_latents=list(condition_latents), keyframe_anchors=tuple(keyframe_anchors))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**kwargs, output=["latents", "audio_latents"])
    return out["latents"], out["audio_latents"]


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality with a useful report: count of differing elements, max abs difference, first index."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{what}: {actual.shape}/{actual.dtype} vs {expected.shape}/{expected.dtype}"
    same = actual == expected
    if bool(same.all()):
        return
    diff = (actual.double() - expected.double()).abs()
    first = tuple(int(i) for i in (~same).nonzero()[0])
    raise AssertionError(f"{what}: {int((~same).sum())}/{same.numel()} elements differ, max abs diff {diff.max().item():.3e}, first at {first}")


# -- the complete pipeline: one random-weight model family in the official layout, compiled and prepared -------------
#
# The embedded demo (`vflash_core.pipeline.demo.ensure_demo_assets`: the family without its ref2va partition, its
# transformer compiled for t2va-base4-exact-cpu, the assets file and the prepared receipt) is built once per test run
# and shared by every test that needs a whole model: the pipeline tests, the CLI, the service, the node pack and the
# headless workflows. It is read-only: a test that changes a file of it copies the file first.


@pytest.fixture(scope="session")
def demo_receipt(tmp_path_factory) -> Path:
    """The shared demo build's prepared-assets receipt (t2va / i2va / l2va / fl2va, 4 NFE, CPU)."""
    from vflash_core.pipeline.demo import ensure_demo_assets

    return built_once(tmp_path_factory, "demo-cache", ensure_demo_assets)


def linked_demo_cache(cache: Path, demo_receipt: Path) -> Path:
    """Make `cache` (created) a demo cache folder of its own (for `$VFLASH_CACHE` or `--cache-dir`) in which the demo
    is found built: its one entry links to the shared build, so what a test writes into its cache stays its own."""
    cache.mkdir(parents=True, exist_ok=True)
    (cache / demo_receipt.parent.name).symlink_to(demo_receipt.parent, target_is_directory=True)
    return cache


@pytest.fixture(scope="module")
def pack(tmp_path_factory, demo_receipt):
    """The node pack installed in the headless ComfyUI host (`nodes/headless/`) with the stand-in core nodes, over a
    demo cache of its own (`linked_demo_cache`); one per test module, as each module's nodes keep their engines."""
    from comfy_standins import harness

    cache = linked_demo_cache(tmp_path_factory.mktemp("vflash-cache"), demo_receipt)
    with harness.installed(cache, tmp_path_factory.mktemp("comfyui")) as loaded:
        yield loaded


@pytest.fixture
def demo_cache(demo_receipt, tmp_path) -> Path:
    """This test's demo cache folder (`linked_demo_cache`)."""
    return linked_demo_cache(tmp_path / "vflash-cache", demo_receipt)


@pytest.fixture(scope="session")
def h3_family(tmp_path_factory, demo_receipt) -> Path:
    """The demo's family with its ref2va partition (Qwen3-VL with 52 layers, both VAEs, both transformer
    partitions): the shared demo build's parts linked in; only `transformer_ref/` and the index naming it are
    written here (each part has its own seed, so this equals a family built whole)."""
    from vflash_core.weights.family import DEMO_FAMILY, build_model_family

    def build(folder: Path) -> Path:
        built = demo_receipt.parent / "model"
        root = folder / "model"
        root.mkdir()
        for part in built.iterdir():
            if part.name != "modular_model_index.json":
                (root / part.name).symlink_to(part, target_is_directory=part.is_dir())
        return build_model_family(root, DEMO_FAMILY, seed=0, with_ref=True, parts=("transformer_ref", "index"))

    return built_once(tmp_path_factory, "family", build)


def prepare_family(tmp: Path, family: Path, profile: str, partition: str) -> Path:
    """Compile one transformer partition of `family` for `profile`, write the six-field assets file, prepare."""
    import json

    from vflash_core.pipeline.h3_pipeline import prepare_pipeline

    compiled = compile_tiny(tmp, family / partition, profile)
    assets = {
        "model_root": str(family), "decoder_root": str(family), "adapter_path": None, "artifact": str(compiled["artifact"]),
        "schedule_overlay": str(compiled["schedule_overlay"]), "auxiliary_tensor": str(compiled["auxiliary"]),
    }
    (tmp / "assets.json").write_text(json.dumps(assets))
    prepare_pipeline(profile, tmp / "assets.json", tmp / "pipeline.json")
    return tmp / "pipeline.json"


@pytest.fixture(scope="session")
def h3_prepared(demo_receipt) -> Path:
    """Prepared-assets receipt of the family's `transformer/` for t2va / i2va / l2va / fl2va (4 NFE, CPU): the shared
    demo build's, whose transformer is `h3_family`'s."""
    return demo_receipt


@pytest.fixture(scope="session")
def h3_prepared_ref(tmp_path_factory, h3_family) -> Path:
    """Prepared-assets receipt of the family's `transformer_ref/` for ref2va (4 NFE, CPU)."""
    return built_once(tmp_path_factory, "prepared_ref4", lambda folder: prepare_family(folder, h3_family, "ref2va-base4-exact-cpu", "transformer_ref"))
