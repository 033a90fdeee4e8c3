"""The process-wide lock every model (and tokenizer) load of Vflash holds.

transformers and diffusers load under context managers that patch process-wide functions (`torch.nn.init`,
`nn.Module.register_parameter` for meta-device construction) and restore them on exit, and transformers' lazy
top-level module is not safe to import from two threads at once. Two loads interleaved in threads restore each
other's patches, leaving every later model of the process on the meta device ("Cannot copy out of meta tensor").
Loads therefore run one at a time. Re-entrant, so a loader may take it again.
"""

from __future__ import annotations

import threading

__all__ = ["MODEL_LOAD_LOCK"]

MODEL_LOAD_LOCK = threading.RLock()
