"""Vflash core: a native, exact MiniMax-H3 inference engine. Imports without ComfyUI and without a GPU.

Public entry points::

    from vflash_core import H3Pipeline, RunOptions, VideoRequest      # prompt (+ media) -> MP4
    from vflash_core import NativeEngineSession, ConditioningBundle, BundleHandoff, get_profile   # the core alone
    from vflash_core.weights.compiler import prepare, compile_receipt
    from vflash_core.weights.lora import LoraStack, StackedLora      # prepare(..., loras=LoraStack(...))

Every name here is also importable from the module that defines it; the errors a caller may catch are all
`VflashError` subclasses. The names load on first use (`__getattr__`): importing a submodule, such as the command
line's parser, runs this file first, and an eager import of the pipeline here would load torch before `vflash --help`
could answer.
"""

from __future__ import annotations

from ._imports import LazyNames, hide_repository_root

hide_repository_root()  # before anything imports transformers (`_imports.hide_repository_root` says why)

import warnings
from typing import TYPE_CHECKING, Any

# diffusers' audio VAE builds its convolutions with `torch.nn.utils.weight_norm`, which torch deprecates with a
# FutureWarning on every load: noise on every run that no user of Vflash can act on.
warnings.filterwarnings("ignore", r"`torch\.nn\.utils\.weight_norm` is deprecated", FutureWarning)

from ._version import __version__ as __version__  # re-exported: the version is the root's attribute

if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from .engine.artifact import CompiledPaths
    from .engine.bundle import BundleHandoff, ConditioningBundle, build_keyframe_bundle
    from .engine.config import H3Config
    from .engine.engine_options import EngineOptions
    from .engine.layout import Geometry
    from .engine.session import GenerationResult, NativeEngineSession
    from .engine.session_hooks import SessionHooks
    from .errors import (
        BundleError,
        IdentityMismatchError,
        RequestError,
        RunFailedError,
        SessionClosedError,
        VflashError,
        WeightFileError,
    )
    from .fileio import MissingInputError, OutputExistsError, WriteFailedError
    from .pipeline.assets import PreparedAssets, prepare_pipeline
    from .pipeline.h3_pipeline import H3Pipeline, RequestCancelled, VideoResult
    from .pipeline.options import RunOptions
    from .pipeline.validation import VideoRequest
    from .profiles import PROFILES, Profile, get_profile

#: public name -> the module (relative to this package) that defines it.
_SOURCES = {
    "CompiledPaths": ".engine.artifact",
    **dict.fromkeys(("BundleHandoff", "ConditioningBundle", "build_keyframe_bundle"), ".engine.bundle"),
    "H3Config": ".engine.config",
    "EngineOptions": ".engine.engine_options",
    "Geometry": ".engine.layout",
    **dict.fromkeys(("GenerationResult", "NativeEngineSession"), ".engine.session"),
    "SessionHooks": ".engine.session_hooks",
    **dict.fromkeys((
        "BundleError", "IdentityMismatchError", "RequestError", "RunFailedError", "SessionClosedError",
        "VflashError", "WeightFileError",
    ), ".errors"),
    **dict.fromkeys(("MissingInputError", "OutputExistsError", "WriteFailedError"), ".fileio"),
    **dict.fromkeys(("PreparedAssets", "prepare_pipeline"), ".pipeline.assets"),
    **dict.fromkeys(("H3Pipeline", "RequestCancelled", "VideoResult"), ".pipeline.h3_pipeline"),
    "VideoRequest": ".pipeline.validation",
    "RunOptions": ".pipeline.options",
    **dict.fromkeys(("PROFILES", "Profile", "get_profile"), ".profiles"),
}


_LAZY = LazyNames(__name__, _SOURCES)


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.names()


__all__ = [
    "PROFILES",
    "BundleError",
    "BundleHandoff",
    "CompiledPaths",
    "ConditioningBundle",
    "EngineOptions",
    "GenerationResult",
    "Geometry",
    "H3Config",
    "H3Pipeline",
    "IdentityMismatchError",
    "MissingInputError",
    "NativeEngineSession",
    "OutputExistsError",
    "PreparedAssets",
    "Profile",
    "RequestCancelled",
    "RequestError",
    "RunFailedError",
    "RunOptions",
    "SessionClosedError",
    "SessionHooks",
    "VflashError",
    "VideoRequest",
    "VideoResult",
    "WeightFileError",
    "WriteFailedError",
    "build_keyframe_bundle",
    "get_profile",
    "prepare_pipeline",
]
