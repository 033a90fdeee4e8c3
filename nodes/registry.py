"""The node pack's engine registry: the one explicit object that owns every loaded Vflash engine in this process.

Engines (DiT sessions, text encoders, VAEs) are keyed by their spec (weights identity, profile, devices, residency,
attention backend); node outputs carry only specs, so a cached loader output stays valid after an unload, a
`force_offload` or an interrupt: the next use loads the engine again. `VflashUnload` and `force_offload` release
entries here.
"""

from .ops import EngineRegistry

ENGINES = EngineRegistry()
