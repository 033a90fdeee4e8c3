"""Stand-in for `comfy_api.latest._io` (ComfyUI 0.33.0): the V3 schema objects the Vflash nodes use.

Mirrors the constructor signatures, `io_type` strings, `Schema` fields, `NodeOutput`, `Autogrow` templates (API
keys ``<group>.<prefix><i>`` with i from 0, passed to `execute` as a dict) and `DynamicCombo` (``<id>.<child>`` keys,
passed as ``{"<id>": choice, "<child>": ...}``), and the V1 input dict that `/object_info` publishes, which the
tests use to type-check workflows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FolderType(str, Enum):
    input = "input"
    output = "output"
    temp = "temp"


class UploadType(str, Enum):
    image = "image_upload"
    audio = "audio_upload"
    video = "video_upload"
    model = "file_upload"


class NumberDisplay(str, Enum):
    number = "number"
    slider = "slider"


def _prune(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


class Input:
    Parent: type = None

    def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                 extra_dict=None, raw_link: bool = None, advanced: bool = None):
        self.id = id
        self.display_name = display_name
        self.optional = optional
        self.tooltip = tooltip
        self.lazy = lazy
        self.extra_dict = extra_dict if extra_dict is not None else {}
        self.rawLink = raw_link
        self.advanced = advanced

    @property
    def io_type(self) -> str:
        return self.Parent.io_type

    def as_dict(self) -> dict:
        return _prune({"display_name": self.display_name, "optional": self.optional, "tooltip": self.tooltip,
                       "lazy": self.lazy, "rawLink": self.rawLink, "advanced": self.advanced}) | _prune(self.extra_dict)

    def get_io_type(self) -> str:
        return self.io_type

    def get_all(self) -> list[Input]:
        return [self]

    def validate(self) -> None:
        pass


class WidgetInput(Input):
    def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                 default: Any = None, socketless: bool = None, widget_type: str = None, force_input: bool = None,
                 extra_dict=None, raw_link: bool = None, advanced: bool = None):
        super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link, advanced)
        self.default = default
        self.socketless = socketless
        self.widget_type = widget_type
        self.force_input = force_input

    def as_dict(self) -> dict:
        return super().as_dict() | _prune({"default": self.default, "socketless": self.socketless,
                                           "widgetType": self.widget_type, "forceInput": self.force_input})

    def get_io_type(self) -> str:
        return self.widget_type if self.widget_type is not None else super().get_io_type()


class Output:
    Parent: type = None

    def __init__(self, id: str = None, display_name: str = None, tooltip: str = None, is_output_list=False):
        self.id = id
        self.display_name = display_name if display_name else id
        self.tooltip = tooltip
        self.is_output_list = is_output_list

    @property
    def io_type(self) -> str:
        return self.Parent.io_type

    def get_io_type(self) -> str:
        return self.io_type

    def validate(self) -> None:
        pass


class ComfyTypeI:
    io_type: str = None
    Type = Any

    class Input(Input):
        pass


class ComfyTypeIO(ComfyTypeI):
    class Output(Output):
        pass


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
    @comfytype(io_type=io_type)
    class CustomComfyType(ComfyTypeIO):
        pass

    return CustomComfyType


@comfytype(io_type="BOOLEAN")
class Boolean(ComfyTypeIO):
    Type = bool

    class Input(WidgetInput):
        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                     default: bool = None, label_on: str = None, label_off: str = None, socketless: bool = None,
                     force_input: bool = None, extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input, extra_dict, raw_link, advanced)
            self.label_on, self.label_off = label_on, label_off

        def as_dict(self):
            return super().as_dict() | _prune({"label_on": self.label_on, "label_off": self.label_off})


@comfytype(io_type="INT")
class Int(ComfyTypeIO):
    Type = int

    class Input(WidgetInput):
        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                     default: int = None, min: int = None, max: int = None, step: int = None,
                     control_after_generate: bool = None, display_mode: NumberDisplay = None, socketless: bool = None,
                     force_input: bool = None, extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input, extra_dict, raw_link, advanced)
            self.min, self.max, self.step = min, max, step
            self.control_after_generate = control_after_generate
            self.display_mode = display_mode

        def as_dict(self):
            return super().as_dict() | _prune({"min": self.min, "max": self.max, "step": self.step,
                                               "control_after_generate": self.control_after_generate,
                                               "display": self.display_mode.value if self.display_mode else None})


@comfytype(io_type="FLOAT")
class Float(ComfyTypeIO):
    Type = float

    class Input(WidgetInput):
        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                     default: float = None, min: float = None, max: float = None, step: float = None, round: float = None,
                     display_mode: NumberDisplay = None, socketless: bool = None, force_input: bool = None,
                     extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input, extra_dict, raw_link, advanced)
            self.min, self.max, self.step, self.round = min, max, step, round
            self.display_mode = display_mode

        def as_dict(self):
            return super().as_dict() | _prune({"min": self.min, "max": self.max, "step": self.step, "round": self.round,
                                               "display": self.display_mode})


@comfytype(io_type="STRING")
class String(ComfyTypeIO):
    Type = str

    class Input(WidgetInput):
        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                     multiline=False, placeholder: str = None, default: str = None, dynamic_prompts: bool = None,
                     socketless: bool = None, force_input: bool = None, extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input, extra_dict, raw_link, advanced)
            self.multiline, self.placeholder, self.dynamic_prompts = multiline, placeholder, dynamic_prompts

        def as_dict(self):
            return super().as_dict() | _prune({"multiline": self.multiline, "placeholder": self.placeholder,
                                               "dynamicPrompts": self.dynamic_prompts})


@comfytype(io_type="COMBO")
class Combo(ComfyTypeIO):
    Type = str

    class Input(WidgetInput):
        def __init__(self, id: str, options: list = None, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, default=None, control_after_generate: bool = None, upload: UploadType = None,
                     image_folder: FolderType = None, remote=None, socketless: bool = None, extra_dict=None,
                     raw_link: bool = None, advanced: bool = None):
            if isinstance(options, type) and issubclass(options, Enum):
                options = [v.value for v in options]
            if isinstance(default, Enum):
                default = default.value
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, None, extra_dict, raw_link, advanced)
            self.multiselect = False
            self.options = options
            self.control_after_generate = control_after_generate
            self.upload = upload
            self.image_folder = image_folder
            self.remote = remote

        def as_dict(self):
            return super().as_dict() | _prune({"multiselect": self.multiselect, "options": self.options,
                                               "control_after_generate": self.control_after_generate,
                                               **({self.upload.value: True} if self.upload is not None else {}),
                                               "image_folder": self.image_folder.value if self.image_folder else None})


def _plain(io_type: str):
    @comfytype(io_type=io_type)
    class T(ComfyTypeIO):
        pass

    return T


Image = _plain("IMAGE")
Mask = _plain("MASK")
Latent = _plain("LATENT")
Conditioning = _plain("CONDITIONING")
Clip = _plain("CLIP")
Vae = _plain("VAE")
Model = _plain("MODEL")
Audio = _plain("AUDIO")
Video = _plain("VIDEO")
AnyType = _plain("*")


class MultiType:
    """An input that takes several types; `get_io_type()` is their comma-joined io types (as in core)."""

    Type = Any

    class Input(Input):
        def __init__(self, id, types: list, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, extra_dict=None, raw_link: bool = None, advanced: bool = None):
            self.input_override = None
            if isinstance(id, Input):
                self.input_override = copy.copy(id)
                optional = id.optional if id.optional is True else optional
                tooltip = id.tooltip if id.tooltip is not None else tooltip
                display_name = id.display_name if id.display_name is not None else display_name
                id = id.id
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link, advanced)
            self._io_types = types

        def get_io_type(self) -> str:
            names = [t.io_type for t in self._io_types]
            if self.input_override is not None:
                names.insert(0, self.input_override.get_io_type())
            return ",".join(dict.fromkeys(names))

        @property
        def io_type(self) -> str:
            return self.get_io_type()

        def as_dict(self):
            base = self.input_override.as_dict() if self.input_override is not None else {}
            return base | super().as_dict()


class DynamicInput(Input):
    def get_all(self) -> list[Input]:
        raise NotImplementedError


@comfytype(io_type="COMFY_AUTOGROW_V3")
class Autogrow(ComfyTypeI):
    Type = dict
    _MaxNames = 100

    class _Template:
        def __init__(self, input: Input):
            assert not isinstance(input, DynamicInput)
            self.input = copy.copy(input)
            if isinstance(self.input, WidgetInput):
                self.input.force_input = True
            self.names: list[str] = []
            self.min = 0

        def get_all(self) -> list[Input]:
            out = []
            for name in self.names:
                clone = copy.copy(self.input)
                clone.id = name
                out.append(clone)
            return out

        def as_dict(self):
            return {"input": create_input_dict_v1([self.input])}

    class TemplatePrefix(_Template):
        def __init__(self, input: Input, prefix: str, min: int = 1, max: int = 10):
            super().__init__(input)
            assert min >= 0 and 1 <= max <= Autogrow._MaxNames
            self.prefix, self.min, self.max = prefix, min, max
            self.names = [f"{prefix}{i}" for i in range(max)]

        def as_dict(self):
            return super().as_dict() | {"prefix": self.prefix, "min": self.min, "max": self.max}

    class TemplateNames(_Template):
        def __init__(self, input: Input, names: list[str], min: int = 1):
            super().__init__(input)
            self.names = names[: Autogrow._MaxNames]
            self.min = min

        def as_dict(self):
            return super().as_dict() | {"names": self.names, "min": self.min}

    class Input(DynamicInput):
        def __init__(self, id: str, template, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, extra_dict=None):
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
            self.template = template

        def as_dict(self):
            return super().as_dict() | {"template": self.template.as_dict()}

        def get_all(self) -> list[Input]:
            return [self] + self.template.get_all()


@comfytype(io_type="COMFY_DYNAMICCOMBO_V3")
class DynamicCombo(ComfyTypeI):
    Type = dict

    class Option:
        def __init__(self, key: str, inputs: list[Input]):
            self.key, self.inputs = key, inputs

    class Input(DynamicInput):
        def __init__(self, id: str, options: list, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, extra_dict=None):
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
            self.options = options

        def get_all(self) -> list[Input]:
            return [self] + [i for o in self.options for i in o.inputs]


class Hidden(str, Enum):
    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    dynprompt = "DYNPROMPT"


class HiddenHolder:
    def __init__(self, unique_id=None, prompt=None, extra_pnginfo=None, dynprompt=None, **kwargs):
        self.unique_id, self.prompt, self.extra_pnginfo, self.dynprompt = unique_id, prompt, extra_pnginfo, dynprompt

    def __getattr__(self, key):
        return None


def create_input_dict_v1(inputs: list[Input]) -> dict:
    out: dict = {"required": {}}
    for i in inputs:
        d = i.as_dict()
        d.pop("optional", None)
        out.setdefault("optional" if i.optional else "required", {})[i.id] = (i.get_io_type(), d)
    return out


@dataclass
class Schema:
    node_id: str
    display_name: str = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    search_aliases: list = field(default_factory=list)
    is_input_list: bool = False
    is_output_node: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    is_dev_only: bool = False
    is_api_node: bool = False
    price_badge: Any = None
    not_idempotent: bool = False
    enable_expand: bool = False
    accept_all_inputs: bool = False
    essentials_category: str = None
    has_intermediate_output: bool = False

    def validate(self):
        ids = [i.id for inp in self.inputs if not isinstance(inp, DynamicInput) for i in inp.get_all()]
        out_ids = [o.id for o in self.outputs]
        issues = []
        if len(set(ids)) != len(ids):
            issues.append(f"Input ids must be unique: {ids}")
        if len(set(out_ids)) != len(out_ids):
            issues.append(f"Output ids must be unique: {out_ids}")
        if issues:
            raise ValueError("\n".join(issues))

    def finalize(self):
        if self.is_output_node:
            for h in (Hidden.prompt, Hidden.extra_pnginfo):
                if h not in self.hidden:
                    self.hidden.append(h)
        for i, output in enumerate(self.outputs):
            if output.id is None:
                output.id = f"_{i}_{output.io_type}_"

    def v1_info(self) -> dict:
        """What `/object_info/<node_id>` publishes (the subset the tests read)."""
        return {
            "input": create_input_dict_v1(self.inputs),
            "output": [o.io_type for o in self.outputs],
            "output_name": [o.display_name if o.display_name else o.io_type for o in self.outputs],
            "name": self.node_id,
            "display_name": self.display_name,
            "category": self.category,
            "description": self.description,
            "output_node": self.is_output_node,
        }


class ComfyNode:
    hidden: HiddenHolder = None

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def validate_inputs(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def GET_SCHEMA(cls) -> Schema:
        schema = cls.define_schema()
        schema.finalize()
        schema.validate()
        cls.SCHEMA = schema
        return schema


class NodeOutput:
    def __init__(self, *args: Any, ui=None, expand: dict = None, block_execution: str = None):
        self.args = args
        self.ui = ui
        self.expand = expand
        self.block_execution = block_execution

    @property
    def result(self):
        return self.args if len(self.args) > 0 else None

    def __getitem__(self, index):
        return self.args[index]
