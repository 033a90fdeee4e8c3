"""Vflash core: a native, exact MiniMax-H3 inference engine. Imports without ComfyUI and without a GPU.

Public entry points::

    from vflash_core import NativeEngineSession, ConditioningBundle, BundleHandoff, get_profile
    from vflash_core.weights.compiler import prepare, compile_receipt
"""

from .engine.bundle import BundleHandoff, ConditioningBundle, build_keyframe_bundle
from .engine.config import H3Config
from .engine.layout import Geometry
from .engine.session import GenerationResult, NativeEngineSession
from .errors import VflashError
from .profiles import PROFILES, Profile, get_profile

__version__ = "0.1.0"

__all__ = [
    "PROFILES",
    "BundleHandoff",
    "ConditioningBundle",
    "GenerationResult",
    "Geometry",
    "H3Config",
    "NativeEngineSession",
    "Profile",
    "VflashError",
    "build_keyframe_bundle",
    "get_profile",
]
