"""The node pack's engine registry: the one object that owns every Vflash engine loaded in this process (see
`ops.EngineRegistry`); `VflashUnload` and `force_offload` release entries here."""

from .ops import EngineRegistry

ENGINES = EngineRegistry()
