"""Vflash core: a native, exact MiniMax-H3 inference engine. Imports without ComfyUI and without a GPU.

Public entry points::

    from vflash_core import H3Pipeline, RunOptions, VideoRequest      # prompt (+ media) -> MP4
    from vflash_core import NativeEngineSession, ConditioningBundle, BundleHandoff, get_profile   # the core alone
    from vflash_core.weights.compiler import prepare, compile_receipt
    from vflash_core.weights.lora import LoraStack, StackedLora      # prepare(..., loras=LoraStack(...))

Every name here is also importable from the module that defines it; the errors a caller may catch are all
`VflashError` subclasses. Importing the pipeline loads neither diffusers nor transformers (they load with the
models), so these imports stay eager.
"""

from ._imports import hide_repository_root

hide_repository_root()  # before anything imports transformers (`_imports.hide_repository_root` says why)

from ._version import __version__ as __version__  # re-exported: the version is the root's attribute
from .engine.bundle import BundleHandoff, ConditioningBundle, build_keyframe_bundle
from .engine.config import H3Config
from .engine.layout import Geometry
from .engine.session import GenerationResult, NativeEngineSession
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
from .pipeline.h3_pipeline import (
    H3Pipeline,
    PreparedAssets,
    RequestCancelled,
    VideoRequest,
    VideoResult,
    prepare_pipeline,
)
from .pipeline.options import RunOptions
from .profiles import PROFILES, Profile, get_profile

__all__ = [
    "PROFILES",
    "BundleError",
    "BundleHandoff",
    "ConditioningBundle",
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
    "VflashError",
    "VideoRequest",
    "VideoResult",
    "WeightFileError",
    "WriteFailedError",
    "build_keyframe_bundle",
    "get_profile",
    "prepare_pipeline",
]
