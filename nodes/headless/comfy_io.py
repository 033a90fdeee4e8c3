"""`comfy_api.latest.io` for the headless host: the V3 schema objects the Vflash nodes and the core stand-ins build.

Constructor signatures, `io_type` strings, `Schema` fields, `NodeOutput`, `Autogrow` templates (API keys
``<group>.<prefix><i>``) and `DynamicCombo` options follow ComfyUI 0.33.0's interface, so the same node classes run
here and in ComfyUI. What only ComfyUI's server reads (the `/object_info` dicts, display options of number widgets)
is kept as attributes and never interpreted: the runner needs each input's id, io type, optionality and children.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class UploadType(str, Enum):
    image = "image_upload"
    audio = "audio_upload"


class Input:
    Parent: type[ComfyTypeI]

    def __init__(
        self, id: str, display_name: str | None = None, optional: bool = False, tooltip: str | None = None, **extra: Any
    ):
        self.id, self.display_name, self.optional, self.tooltip = id, display_name, optional, tooltip
        # the other options (min, max, step, control_after_generate, ...) as ComfyUI's attributes
        vars(self).update(extra)

    def get_io_type(self) -> str:
        return self.Parent.io_type

    def get_all(self) -> list[Input]:
        return [self]


class WidgetInput(Input):
    default: Any = None  # ComfyUI's defaults of the widget options that `extra` sets
    force_input: bool | None = None


class Output:
    Parent: type[ComfyTypeI]

    def __init__(self, id: str | None = None, display_name: str | None = None, tooltip: str | None = None):
        self.id, self.display_name, self.tooltip = id, display_name or id, tooltip

    def get_io_type(self) -> str:
        return self.Parent.io_type


class ComfyTypeI:
    io_type = ""
    Input = Input


class ComfyTypeIO(ComfyTypeI):
    Output = Output


def comfytype(io_type: str):
    """Bind `io_type` to a ComfyType and give it its own Input/Output subclasses (so `Parent` is per type)."""

    def decorator(cls):
        cls.io_type = io_type
        for name in ("Input", "Output"):
            base = getattr(cls, name, None)
            if base is not None:
                setattr(cls, name, type(name, (base,), {"Parent": cls, "__qualname__": f"{cls.__name__}.{name}"}))
        return cls

    return decorator


def Custom(io_type: str) -> type[ComfyTypeIO]:
    return comfytype(io_type)(type(io_type, (ComfyTypeIO,), {}))


class _Widget(ComfyTypeIO):
    Input = WidgetInput


Boolean, Int, Float = (
    comfytype(t)(type(n, (_Widget,), {})) for n, t in (("Boolean", "BOOLEAN"), ("Int", "INT"), ("Float", "FLOAT"))
)
Image, Mask, Latent, Clip, Vae, Audio, Video = (
    Custom(t) for t in ("IMAGE", "MASK", "LATENT", "CLIP", "VAE", "AUDIO", "VIDEO")
)
AnyType = Custom("*")


@comfytype(io_type="STRING")
class String(ComfyTypeIO):
    class Input(WidgetInput):
        multiline = False


@comfytype(io_type="COMBO")
class Combo(ComfyTypeIO):
    class Input(WidgetInput):
        def __init__(
            self,
            id: str,
            options: list | type[Enum] | None = None,
            display_name: str | None = None,
            optional: bool = False,
            tooltip: str | None = None,
            default: Any = None,
            upload: UploadType | None = None,
            **extra: Any,
        ):
            super().__init__(
                id, display_name, optional, tooltip, default=default.value if isinstance(default, Enum) else default,
                **extra,
            )
            self.options = (
                [v.value for v in options] if isinstance(options, type) and issubclass(options, Enum) else options
            )
            self.upload = upload  # the frontend adds a "choose file to upload" button widget


class MultiType:
    """An input that takes several types; its io type is theirs comma-joined (ComfyUI's multi-type socket)."""

    class Input(Input):
        def __init__(
            self,
            id: str,
            types: list,
            display_name: str | None = None,
            optional: bool = False,
            tooltip: str | None = None,
            **extra: Any,
        ):
            super().__init__(id, display_name, optional, tooltip, **extra)
            self.types = types

        def get_io_type(self) -> str:
            return ",".join(dict.fromkeys(t.io_type for t in self.types))


class DynamicInput(Input):
    pass


@comfytype(io_type="COMFY_AUTOGROW_V3")
class Autogrow(ComfyTypeI):
    class TemplatePrefix:
        """Slots ``<prefix>0`` .. ``<prefix><max - 1>`` of one input; the first `min` are required."""

        def __init__(self, input: Input, prefix: str, min: int = 1, max: int = 10):
            self.input, self.prefix, self.min, self.max = input, prefix, min, max

        def get_all(self) -> list[Input]:
            slots = [copy.copy(self.input) for _ in range(self.max)]
            for i, slot in enumerate(slots):
                slot.id = f"{self.prefix}{i}"
            return slots

    class Input(DynamicInput):
        def __init__(
            self,
            id: str,
            template: Autogrow.TemplatePrefix,
            display_name: str | None = None,
            optional: bool = False,
            tooltip: str | None = None,
            **extra: Any,
        ):
            super().__init__(id, display_name, optional, tooltip, **extra)
            self.template = template

        def get_all(self) -> list[Input]:
            return [self, *self.template.get_all()]


@comfytype(io_type="COMFY_DYNAMICCOMBO_V3")
class DynamicCombo(ComfyTypeI):
    class Option:
        def __init__(self, key: str, inputs: list[Input]):
            self.key, self.inputs = key, inputs

    class Input(DynamicInput):
        def __init__(
            self,
            id: str,
            options: list,
            display_name: str | None = None,
            optional: bool = False,
            tooltip: str | None = None,
            **extra: Any,
        ):
            super().__init__(id, display_name, optional, tooltip, **extra)
            self.options = options

        def get_all(self) -> list[Input]:
            return [self, *(i for o in self.options for i in o.inputs)]


class Hidden(str, Enum):
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"


class HiddenHolder:
    """What a node reads as `cls.hidden`: the API prompt, and the UI workflow's extra info (none for an API file)."""

    def __init__(self, prompt: Mapping[str, Any] | None = None, extra_pnginfo: dict | None = None):
        self.prompt, self.extra_pnginfo = prompt, extra_pnginfo


@dataclass
class Schema:
    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    search_aliases: list = field(default_factory=list)
    is_output_node: bool = False
    not_idempotent: bool = False

    def finalize(self) -> None:
        """Output ids as ComfyUI names unnamed outputs; duplicate ids are a schema error there too."""
        for i, output in enumerate(self.outputs):
            output.id = output.id or f"_{i}_{output.get_io_type()}_"
        ids = [i.id for inp in self.inputs if not isinstance(inp, DynamicInput) for i in inp.get_all()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.node_id}: input ids must be unique: {ids}")


class ComfyNode:
    hidden: HiddenHolder | None = None

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs: Any) -> NodeOutput:
        raise NotImplementedError

    @classmethod
    def validate_inputs(cls, **kwargs: Any) -> bool | str:
        """Not called: as in ComfyUI, only a node's own override runs (`workflow.node_types` checks for one)."""
        raise NotImplementedError

    @classmethod
    def GET_SCHEMA(cls) -> Schema:
        schema = cls.define_schema()
        schema.finalize()
        return schema


class NodeOutput:
    def __init__(self, *args: Any, ui: Any = None):
        self.args, self.ui = args, ui
