"""The embedded default: a small random-weight H3 family that runs end to end on a fresh CPU machine, no download.

`ensure_demo_assets()` builds the family once under the cache (`$VFLASH_CACHE`, else `~/.cache/vflash`): the official
folder layout (`family.build_model_family`), the transformer compiled for the `t2va-base4-exact-cpu` profile, a
six-field assets file and the prepared-assets receipt. Building happens in a temporary folder renamed into place, so
an interrupted or concurrent build never leaves a half family behind; later calls reuse it.

`run_demo()` then generates through exactly the path a real model takes — `H3Pipeline.from_prepared` -> Qwen3-VL
conditioning -> bundle -> native core -> VAEs -> MP4. The weights are random, so the clip is noise-like by nature.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from .._version import __version__
from ..errors import VflashError
from ..fileio import OutputExistsError, check_writable_destination, temporary, write_errors
from ..weights.family import DEMO_FAMILY, build_model_family
from .options import RunOptions

__all__ = [
    "DEMO_LATENT_RGB_BIAS", "DEMO_LATENT_RGB_FACTORS", "DEMO_PROFILE", "default_cache_dir", "demo_receipt_path",
    "ensure_demo_assets", "run_demo",
]

logger = logging.getLogger(__name__)

DEMO_PROFILE = "t2va-base4-exact-cpu"
DEMO_PROMPT = "A robot dances in the rain on a neon street at night, while drums and bass play."
DEMO_SEED = 0
_RECEIPT = "pipeline.json"
# The demo's video latents have 8 channels, not the released 24, so a host's colours for H3 latents do not apply to
# them. These are the demo video VAE's own: the least-squares fit of the mean colour it decodes for each latent pixel
# (RGB in [-1, 1]) to that pixel's latent, rgb = latent @ factors + bias, for a live preview drawn the way a
# latent-to-RGB previewer draws a released model's (`tests/test_demo.py` checks them against the VAE).
DEMO_LATENT_RGB_FACTORS = (
    (-0.005669, 0.00542, -0.001764), (-0.001188, -0.003375, -0.000478), (-0.002557, -0.005108, 0.003376),
    (0.002263, 0.00468, -0.006948), (-0.007039, 0.004627, -0.000894), (-0.000244, 0.005043, 0.000815),
    (-0.004728, 0.002362, -0.002475), (-0.00499, 0.005539, -0.000521),
)
DEMO_LATENT_RGB_BIAS = (-0.029931, -0.087609, -0.181845)


def default_cache_dir() -> Path:
    """`$VFLASH_CACHE`, else `$XDG_CACHE_HOME/vflash`, else `~/.cache/vflash`."""
    if os.environ.get("VFLASH_CACHE"):
        return Path(os.environ["VFLASH_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vflash"


def _family_key() -> str:
    """Changes whenever what the demo builds changes, so an old cache is never reused for a new family."""
    from ..engine.config import PRESETS

    spec = {
        "family": asdict(DEMO_FAMILY), "transformer": PRESETS[DEMO_FAMILY.transformer], "profile": DEMO_PROFILE,
        "version": __version__
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _build(folder: Path, progress) -> None:
    """Family, compile, assets file: everything with paths relative to `folder` (it is renamed afterwards)."""
    from ..weights.compiler import compile_receipt, prepare

    progress("build family", 0, 3)
    build_model_family(folder / "model", DEMO_FAMILY, seed=0, with_ref=False)
    progress("build family", 1, 3)
    prepare(DEMO_PROFILE, folder / "model" / "transformer", folder / "weights-receipt.json")
    compile_receipt(folder / "weights-receipt.json", folder / "compiled")
    progress("build family", 2, 3)
    assets = {
        "model_root": "model", "decoder_root": "model", "adapter_path": None, "artifact": "compiled/artifact",
        "schedule_overlay": "compiled/schedule", "auxiliary_tensor": "compiled/auxiliary.safetensors",
    }
    (folder / "assets.json").write_text(json.dumps(assets, indent=2) + "\n")


def demo_receipt_path(cache_dir: str | Path | None = None) -> Path:
    """Where the prepared-assets receipt of the current demo family lives (built or not)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / f"demo-{_family_key()}" / _RECEIPT


def ensure_demo_assets(cache_dir: str | Path | None = None, progress=None) -> Path:
    """Build the embedded family once (idempotent, atomic) and return its prepared-assets receipt."""
    from .assets import prepare_pipeline

    receipt = demo_receipt_path(cache_dir)
    final, cache = receipt.parent, receipt.parent.parent
    if receipt.is_file():
        return receipt
    report = progress or (lambda stage, done, total: None)
    if not final.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            folder_is_file = isinstance(exc, (FileExistsError, NotADirectoryError))
            reason = "it or a folder above it is a file" if folder_is_file else exc.strerror
            raise VflashError(
                f"the demo model cache {cache} cannot be created: {reason}; "
                "give --cache-dir (or $VFLASH_CACHE) a folder"
            ) from None
        start = time.perf_counter()
        tmp = temporary(final, directory=True)  # named for this process: a killed build's is removed by the next
        try:
            with write_errors(final):
                _build(tmp, report)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                logger.info("another process built %s first; using it", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("built the embedded demo family in %s (%.1f s)", final, time.perf_counter() - start)
    try:
        prepare_pipeline(DEMO_PROFILE, final / "assets.json", receipt)
    except OutputExistsError:
        pass  # prepared concurrently
    report("build family", 3, 3)
    return receipt


def _free_output(name: str = "demo.mp4") -> Path:
    """demo.mp4, else demo-2.mp4, demo-3.mp4, ... in the current folder."""
    path = Path(name)
    k = 2
    while path.exists():
        path = Path(f"{Path(name).stem}-{k}{Path(name).suffix}")
        k += 1
    return path


def run_demo(
    output: str | Path | None = None, overwrite: bool = False, cache_dir: str | Path | None = None, progress=None,
    options: RunOptions | None = None
):
    """Generate the demo clip; returns (VideoResult, info) with `built` (whether this call built the family),
    `build_seconds`, `initialization_seconds` and the `receipt`. Without `output`, writes the first free name of
    demo.mp4, demo-2.mp4, ..."""
    from .h3_pipeline import H3Pipeline
    from .validation import VideoRequest

    target = Path(output) if output is not None else _free_output()
    try:
        check_writable_destination(target, overwrite)  # before the family is built: a bad output costs nothing
    except OutputExistsError as exc:
        raise VflashError(f"{exc} (pass --overwrite, or another --output)") from None
    built = not demo_receipt_path(cache_dir).is_file()
    start = time.perf_counter()
    receipt = ensure_demo_assets(cache_dir, progress)
    build = time.perf_counter() - start
    request = VideoRequest(prompt=DEMO_PROMPT, duration_seconds=5.0, seed=DEMO_SEED)
    with H3Pipeline.from_prepared(receipt, options) as pipeline:
        pipeline.validate(request)
        pipeline.load(progress)
        result = pipeline.generate(request, target, overwrite=overwrite, progress=progress)
        return result, {
            "built": built, "build_seconds": build, "initialization_seconds": pipeline.initialization_seconds,
            "receipt": str(receipt)
        }
