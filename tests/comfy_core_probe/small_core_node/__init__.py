"""Test-only ComfyUI custom node: sets core's MiniMax-H3 classes to the small test family's dimensions
(`../small_core.py`) when `VFLASH_TEST_SMALL_CORE=1`; registers no nodes."""

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("VFLASH_TEST_SMALL_CORE") == "1":
    spec = importlib.util.spec_from_file_location("vflash_test_small_core", Path(__file__).resolve().parent.parent / "small_core.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass needs the module registered
    spec.loader.exec_module(module)
    module.patch()

NODE_CLASS_MAPPINGS: dict = {}
