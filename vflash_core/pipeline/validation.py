"""The one request validator: everything about a request that is knowable before a model loads.

`plan_request` is what `H3Pipeline.validate` / `generate` run (so the CLI and the Python API), and what the HTTP
service runs before it queues a job; `plan_inputs` is the same validator for a front end whose media are already
decoded (the node pack holds tensors, not files). The limits come from the model and the profile:

* prompt: a non-empty string of at most `MAX_PROMPT_BYTES` whose tokens fit the text encoder's context
  (`text_config.max_position_embeddings`), counted with the model's own tokenizer (`PromptBudget`);
* clip: the model's 5-15 s, within the profile's range;
* canvas: multiples of 32, aspect 1:4 .. 4:1, and no more pixels than the model's canvas rules give
  (`canvas_max_pixels`, within the rounding of each side to a multiple of 32 that the rules themselves apply);
* inputs: counts per kind, readable regular files of bounded size (`references.probe_media`), every prompt label
  bound to an input;
* devices: present on this machine and of the profile's architecture (`formats.check_device`).

`VideoRequest` checks its field types when it is built, with `media_input`, `media_inputs` and the numbers' specs
(`request_numbers`' `SEED`, `PIXELS`, `SECONDS`): a wrong type is refused with one line naming the field, and a single
path is one path, never a string of characters.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import PIL.Image

from ..engine.layout import FPS, MAX_DURATION_SECONDS, MIN_DURATION_SECONDS, Geometry, check_canvas, frames_for_duration
from ..errors import Number, RequestError, VflashError, check_callback, describe_value
from ..fileio import check_writable_destination, path_argument
from ..formats import is_positive
from ..media.references import (
    CANVAS_MULTIPLE,
    MAX_AUDIOS,
    MAX_IMAGES,
    MAX_REFERENCES,
    MAX_VIDEOS,
    CanvasRules,
    probe_media,
    reference_kind,
)
from ..profiles import Profile
from .model_loading import MODEL_LOAD_LOCK
from .request_numbers import PIXELS, SECONDS, SEED

__all__ = [
    "ANCHORS", "MAX_PROMPT_BYTES", "MediaInput", "PromptBudget", "RequestPlan",
    "VideoRequest", "check_canvas_size", "check_generate_arguments", "check_labels", "check_output_is_not_an_input",
    "check_prompt", "check_reference_counts", "check_seed", "media_input", "media_inputs", "plan_inputs",
    "plan_request",
    "request_mode",
]

#: A prompt's UTF-8 size limit: far above any prompt the encoder's context holds, it bounds what is read and tokenised.
MAX_PROMPT_BYTES = 1 << 20
# A byte-level BPE token covers at least one UTF-8 byte of the NFC-normalised text, and NFC turns one character into
# at most three (at most 12 bytes): a prompt of context / 12 characters always fits and needs no tokenizer.
_MAX_TOKENS_PER_CHARACTER = 12
_LABEL = re.compile(r"<(Picture|Video|Audio) (\d+)>")

MediaInput = str | os.PathLike | PIL.Image.Image
#: A request's keyframe anchors in packed order: field `<anchor>_frame`, named "<anchor> frame" in messages.
ANCHORS = ("first", "last")


# -- field types (VideoRequest) ------------------------------------------------------------------------------------


def media_input(value: object, field: str) -> MediaInput | None:
    """None, a PIL image, or a non-empty file path (str or `os.PathLike`), unchanged."""
    if value is None or isinstance(value, PIL.Image.Image):
        return value
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not isinstance(path, str) or not path:
            raise RequestError(f"{field} must be a non-empty file path, got {describe_value(value)}")
        if "\x00" in path:
            raise RequestError(f"{field} must not contain a NUL character")
        return value
    raise RequestError(f"{field} must be a file path (str or Path) or a PIL image, got {describe_value(value)}")


def media_inputs(value: object, field: str) -> tuple[MediaInput, ...]:
    """A tuple of media inputs from one input (a path or an image is one input) or a list or tuple of them."""
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike, PIL.Image.Image)):
        return (media_input(value, field),)  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if item is None:
                raise RequestError(f"{field}[{index}] is None; give a file path or a PIL image, or leave it out")
        return tuple(media_input(item, f"{field}[{index}]") for index, item in enumerate(value))  # type: ignore[misc]
    raise RequestError(f"{field} must be a file path, a PIL image or a list of them, got {describe_value(value)}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):
        return False


def check_output_is_not_an_input(output: str | os.PathLike, inputs: dict[str, object]) -> None:
    """Refuse an output path that names one of the input files in `inputs` (what -> path or image), or lies inside one
    of its folders, so --overwrite can never replace an input (or a model file) with the clip made from it."""
    target = Path(output)
    for what, item in inputs.items():
        if not isinstance(item, (str, os.PathLike)):
            continue
        if _same_file(target, Path(item)):
            raise VflashError(f"output {target} is the {what}; write the clip to another file")
        if Path(item).is_dir() and target.resolve().is_relative_to(Path(item).resolve()):
            raise VflashError(f"output {target} is inside the {what} {item}; write the clip to another folder")


def check_generate_arguments(
    request: VideoRequest, output: object, overwrite: object, progress: object = None, cancel: object = None,
    preview: object = None,
) -> None:
    """The arguments of `H3Pipeline.generate` besides the request, checked before anything loads: the output a
    writable file path that is none of the request's inputs, `overwrite` a bool, the callbacks callable."""
    if not isinstance(overwrite, bool):  # a truthy string such as "no" must never turn overwriting on
        raise VflashError(f"overwrite must be True or False, got {describe_value(overwrite)}")
    check_callback(progress, "progress")
    check_callback(cancel, "cancel")
    check_callback(preview, "preview")
    if output is not None:
        path_argument(output, "the output path")
        # as given (path_argument checked it is a str or os.PathLike): a trailing "/" names a folder
        check_writable_destination(cast("str | os.PathLike[str]", output), overwrite)
        inputs = {f"{anchor} frame": item for anchor, item in request.keyframes.items()}
        inputs.update({f"reference {index + 1}": item for index, item in enumerate(request.references)})
        check_output_is_not_an_input(output, inputs)  # type: ignore[arg-type]



@dataclass(frozen=True)
class VideoRequest:
    """One generation. `first_frame` / `last_frame` make i2va, l2va or fl2va; `references` (image, video or audio
    files by extension, or PIL images, in the order the prompt's labels number them; one path or image, or a list or
    tuple of them) make ref2va; neither is t2va. `width` / `height` (multiples of 32, both or neither) default to the
    model's canvas for the mode.

    Field types are checked when the request is built (a wrong type raises `RequestError` naming the field); values
    are checked against a model and a profile by `H3Pipeline.validate` (`plan_request`)."""

    prompt: str
    first_frame: MediaInput | None = None
    last_frame: MediaInput | None = None
    references: tuple[MediaInput, ...] = ()
    duration_seconds: float = 5.0
    seed: int = 0
    width: int | None = None
    height: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise RequestError(f"prompt must be a string, got {type(self.prompt).__name__}")
        checked = {
            "first_frame": media_input(self.first_frame, "first_frame"),
            "last_frame": media_input(self.last_frame, "last_frame"),
            "references": media_inputs(self.references, "references"),
            "duration_seconds": SECONDS.check("duration_seconds", self.duration_seconds, RequestError),
            "seed": Number(int).check("seed", self.seed, RequestError),  # its range: `check_seed`, with the request
            "width": None if self.width is None else PIXELS.check("width", self.width, RequestError),
            "height": None if self.height is None else PIXELS.check("height", self.height, RequestError),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: normalised once, here

    @property
    def mode(self) -> str:
        return request_mode(self.first_frame is not None, self.last_frame is not None, bool(self.references))

    @property
    def keyframes(self) -> dict[str, MediaInput]:
        """Anchor ("first", "last") -> keyframe, in packed order; the fields are `<anchor>_frame`."""
        return {anchor: k for anchor in ANCHORS if (k := getattr(self, f"{anchor}_frame")) is not None}


# -- limits ----------------------------------------------------------------------------------------------------------


class PromptBudget:
    """The text encoder's context in tokens, and the model's tokenizer to count a prompt against it.

    The tokenizer loads on the first prompt long enough to need it (see `_MAX_TOKENS_PER_CHARACTER`), so ordinary
    prompts are checked without it. Thread-safe: counting holds a lock, because a fast tokenizer must not be used by
    two threads at once.
    """

    def __init__(self, context_tokens: int, load_tokenizer: Callable[[], Any]):
        self.context_tokens = context_tokens
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_model_root(cls, model_root: str | Path) -> PromptBudget:
        """The context from `text_encoder/config.json`; the tokenizer from `tokenizer/` when first needed."""
        root = Path(model_root)
        config = root / "text_encoder" / "config.json"
        try:
            context = json.loads(config.read_text(encoding="utf-8"))["text_config"]["max_position_embeddings"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise VflashError(
                f"{config} does not give the text encoder's context (text_config.max_position_embeddings): {exc}"
            ) from None
        if not is_positive(context):
            raise VflashError(
                f"{config}: text_config.max_position_embeddings must be a positive integer, got {context!r}"
            )
        folder = root / "tokenizer"

        def load() -> Any:
            with MODEL_LOAD_LOCK:
                from transformers import Qwen2TokenizerFast

                return Qwen2TokenizerFast.from_pretrained(folder, local_files_only=True)

        return cls(context, load)

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, context_tokens: int) -> PromptBudget:
        """A budget over a loaded tokenizer (a text conditioner's); it counts with its own copy of it, so counting
        never shares the tokenizer with an encode running in another thread."""
        return cls(context_tokens, lambda: copy.deepcopy(tokenizer))

    def count(self, prompt: str) -> int:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = self._load_tokenizer()
                except (OSError, ValueError) as exc:
                    raise VflashError(
                        f"cannot load the model's tokenizer to count the prompt's tokens: {exc}"
                    ) from None
            return len(self._tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def check(self, prompt: str) -> None:
        if len(prompt) * _MAX_TOKENS_PER_CHARACTER <= self.context_tokens:
            return
        tokens = self.count(prompt)
        if tokens > self.context_tokens:
            raise RequestError(
                f"the prompt is {tokens:,} tokens long; the text encoder reads at most {self.context_tokens:,} "
                f"(its context, text_config.max_position_embeddings)"
            )


def check_prompt(prompt: object, budget: PromptBudget | None = None) -> None:
    """A non-empty string of valid Unicode, at most `MAX_PROMPT_BYTES`, whose tokens fit `budget` (when given)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("the prompt must be a non-empty string")
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"the prompt is not valid Unicode text (a lone surrogate at character {exc.start})"
        ) from None
    if "\x00" in prompt:
        raise RequestError(
            f"the prompt holds a NUL character (at character {prompt.index(chr(0))}); "
            "give plain text, not a binary file"
        )
    if size > MAX_PROMPT_BYTES:
        raise RequestError(
            f"the prompt is {size:,} bytes long; prompts of at most {MAX_PROMPT_BYTES:,} bytes are accepted"
        )
    if budget is not None:
        budget.check(prompt)


def check_seed(seed: object) -> None:
    SEED.check("seed", seed, RequestError)


def clip_frames(duration_seconds: float, profile: Profile) -> int:
    """The aligned frame count of a duration the model generates and the profile accepts."""
    if not math.isfinite(duration_seconds):
        raise RequestError(f"duration must be a finite number of seconds, got {duration_seconds!r}")
    # Far outside: no frame count to align (1e308 s would overflow).
    if abs(duration_seconds) > 2 * MAX_DURATION_SECONDS:
        raise RequestError(
            f"duration {duration_seconds:g} s cannot be generated; "
            f"H3 generates {MIN_DURATION_SECONDS:g}-{MAX_DURATION_SECONDS:g} s"
        )
    num_frames = frames_for_duration(float(duration_seconds))
    profile.check_duration(num_frames / FPS)
    return num_frames


def check_canvas_size(height: int, width: int, canvas: CanvasRules) -> None:
    """Multiples of 32 at an aspect ratio H3 accepts, within the model's pixel budget.

    The budget admits every canvas the canvas rules can pick: they scale the area to at most `canvas_max_pixels`,
    then round each side to a multiple of 32, which adds at most half a multiple (16) per side.
    """
    slack = CANVAS_MULTIPLE // 2
    # In integers, before `check_canvas` divides: an enormous side must not overflow a float.
    if height > 0 and width > 0 and (height - slack) * (width - slack) > canvas.max_pixels:
        largest_h, largest_w = canvas.default_canvas(16, 9)
        raise RequestError(
            f"canvas {width}x{height} is {height * width:,} pixels; this model generates at most {canvas.max_pixels:,} "
            "(canvas_max_pixels, within rounding to multiples of "
            f"{CANVAS_MULTIPLE}; e.g. {largest_w}x{largest_h} at 16:9)"
        )
    check_canvas(height, width)


def check_reference_counts(kinds: list[str]) -> None:
    """ref2va limits of the released checkpoint: per kind, in total, and no audio without a picture or video."""
    for kind, limit in (("image", MAX_IMAGES), ("video", MAX_VIDEOS), ("audio", MAX_AUDIOS)):
        if kinds.count(kind) > limit:
            raise RequestError(f"H3 takes at most {limit} {kind} references, got {kinds.count(kind)}")
    if len(kinds) > MAX_REFERENCES:
        raise RequestError(f"H3 takes at most {MAX_REFERENCES} references in total, got {len(kinds)}")
    if kinds and set(kinds) == {"audio"}:
        raise RequestError("audio references need at least one image or video reference beside them")


def _count_label(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def check_labels(prompt: str, mode: str, pictures: int, videos: int, audios: int) -> None:
    """Every `<Picture N>`, `<Video K>`, `<Audio J>` in the prompt names a provided input (1-based)."""
    bound = {"Picture": pictures, "Video": videos, "Audio": audios}
    for word, number in _LABEL.findall(prompt):
        if len(number) > 3 or not 1 <= int(number) <= bound[word]:
            raise RequestError(
                f"prompt label <{word} {number}> is not bound to an input: this {mode} request provides "
                f"{_count_label(pictures, 'picture')}, {_count_label(videos, 'video')} "
                f"and {_count_label(audios, 'audio clip')}"
            )


# -- the whole request -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestPlan:
    """What validation resolved: mode, geometry, and how many pictures / videos / audio clips labels may name."""

    mode: str
    geometry: Geometry
    pictures: int
    videos: int
    audios: int


def request_mode(first_frame: bool, last_frame: bool, references: bool) -> str:
    """The mode of a request from which inputs it has; keyframes and references together have none."""
    if references and (first_frame or last_frame):
        raise RequestError("a request takes either keyframes (first/last frame) or references, not both")
    keyframe_modes = {(False, False): "t2va", (True, False): "i2va", (False, True): "l2va", (True, True): "fl2va"}
    return "ref2va" if references else keyframe_modes[(first_frame, last_frame)]


def plan_request(
    request: VideoRequest, profile: Profile, canvas: CanvasRules, prompt_budget: PromptBudget | None = None
) -> RequestPlan:
    """Check a request against a profile, a model's canvas rules and its prompt budget without loading any model;
    raises `RequestError` / `VflashError` naming the offending values. Cheap checks run first, file probes last."""
    check_prompt(request.prompt, prompt_budget)
    check_seed(request.seed)
    mode = request.mode
    profile.check_mode(mode)
    num_frames = clip_frames(request.duration_seconds, profile)
    if (request.width is None) != (request.height is None):
        raise RequestError(f"width and height go together: got width={request.width}, height={request.height}")
    if request.width is not None and request.height is not None:  # (both or neither: checked above)
        check_canvas_size(request.height, request.width, canvas)

    keyframe_sizes = []
    for anchor, item in request.keyframes.items():
        probe = probe_media(item, f"{anchor} frame")
        if probe.kind != "image" or probe.size is None:
            raise RequestError(f"{anchor} frame {item} is not an image")
        keyframe_sizes.append(probe.size)
    names = [f"reference {index + 1}" for index in range(len(request.references))]
    kinds = [reference_kind(item, name) for item, name in zip(request.references, names)]
    check_reference_counts(kinds)  # from the extensions, before any file is opened
    probes = [probe_media(item, name) for item, name in zip(request.references, names)]

    if request.width is not None and request.height is not None:
        height, width = request.height, request.width
    elif keyframe_sizes:
        height, width = canvas.default_canvas(*keyframe_sizes[0])
    else:
        height, width = canvas.default_canvas(16, 9)

    soundtracks = sum(probe.has_soundtrack for probe in probes)
    return _bind_labels(
        request.prompt, mode, Geometry(height, width, num_frames), len(request.keyframes), kinds, soundtracks
    )


def plan_inputs(
    prompt: str, mode: str, geometry: Geometry, keyframes: int, reference_kinds: list[str], soundtracks: int,
    canvas: CanvasRules, profile: Profile | None = None, prompt_budget: PromptBudget | None = None,
) -> RequestPlan:
    """`plan_request` for a request whose media are already decoded (no files to probe): the prompt, the profile's
    modes and clip durations (when `profile` is given; a front end that encodes before it knows the transformer checks
    them with the profile later), the canvas against the model's canvas rules, the reference counts and the labels.
    `geometry` holds an aligned frame count; `soundtracks` counts the reference clips that carry sound."""
    check_prompt(prompt, prompt_budget)
    if profile is not None:
        profile.check_mode(mode)
        profile.check_duration(geometry.num_frames / FPS)
    check_canvas_size(geometry.height, geometry.width, canvas)
    check_reference_counts(reference_kinds)
    return _bind_labels(prompt, mode, geometry, keyframes, reference_kinds, soundtracks)


def _bind_labels(
    prompt: str, mode: str, geometry: Geometry, keyframes: int, kinds: list[str], soundtracks: int
) -> RequestPlan:
    """The plan, once every label of the prompt names an input: pictures are the keyframes or the image references,
    and `<Audio j>` counts audio references and reference clips' soundtracks alike."""
    if mode == "ref2va":
        pictures, videos, audios = kinds.count("image"), kinds.count("video"), kinds.count("audio") + soundtracks
    else:
        pictures, videos, audios = keyframes, 0, 0
    check_labels(prompt, mode, pictures, videos, audios)
    return RequestPlan(mode, geometry, pictures, videos, audios)
