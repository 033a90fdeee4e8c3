"""The node pack's engine registry: the one object that owns every Vflash engine loaded in this process (see
`engines.EngineRegistry`); `VflashUnload` and `force_offload` release entries here."""

from .engines import EngineRegistry

ENGINES = EngineRegistry()
