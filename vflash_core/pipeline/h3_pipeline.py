"""`H3Pipeline`: prompt (+ keyframes or references) -> conditioning bundle -> native core -> VAEs -> MP4.

Ownership: the pipeline owns three serial owners of one device — the `TextConditioner` (Qwen3-VL), the
`MediaVAEs` and the `NativeEngineSession` — and the temporary media of a request; it is reused across serial
requests. On a GPU, the encoder and the VAEs sit on the CPU until their stage, take the device, and give it back
(`torch.cuda.empty_cache()`), so the core's weights and activations have it in between; a GPU with room for all three
keeps them there (`encoder_residency="resident"`), which saves their copies on every request. Where each part lives
is decided once, when the pipeline loads, by one memory plan (`memory_plan`, whose module says how); the session
takes the same plan and enforces the cap, and every request is checked against it before it runs.

A request is checked completely before any model loads (`validate`, which runs `validation.plan_request`, the
validator the service shares; its module lists the limits); `generate` also checks the output path. Devices and the
attention backend are checked when the pipeline is created. The encoders hand their tensors to the core through a
validated one-shot `BundleHandoff` (no temporary file). The request's steps are functions of the parts they run on
(`steps`: `encode_request`, then `EncodedRequest.bundle` for a seed, `vae.decode_latents`), so a front end whose text
encoder and VAEs come from separate loaders (or from another implementation) runs this code and no copy of it; the
prepared assets and the loading of the parts under one memory plan are `assets`'.

Threads: concurrent first calls load the models once, and requests on one pipeline run one at a time (after their
validation, so a bad request is refused without waiting). Model loading is serialised process-wide
(`model_loading.MODEL_LOAD_LOCK`).

Timing: `initialization_seconds` is the time `load()` took (the first `generate` loads when needed,
after its input checks, and that time is not part of the request); `VideoResult.elapsed_seconds` covers the request:
validation, encoding, denoising, decoding and writing. `VideoResult.stages` holds the top-level stages `validate`,
`encode`, `denoise`, `decode`, `write` (their sum is at most `elapsed_seconds`) and nested details whose names carry
their stage as a prefix (`encode.inputs`, `encode.text`, `encode.vae`, `encode.bundle`, `decode.video`,
`decode.audio`); nested entries are already inside their stage and must not be added to it.

A cancelled request (the `cancel` callable raised) closes the pipeline, as does any failure that is not a
`VflashError`; create a new pipeline to continue.
"""


from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

import torch

from ..engine.bundle import BundleHandoff
from ..engine.config import H3Config
from ..engine.layout import FPS, Geometry, request_rows
from ..engine.session import GenerationResult, NativeEngineSession, SessionTiming
from ..engine.session_hooks import BlockLoader, NativeDenoiserLoader, check_loader_hooks
from ..errors import (
    CallbackGuard,
    IdentityMismatchError,
    RequestError,
    RunFailedError,
    SessionClosedError,
    VflashError,
    check_callback,
    describe_value,
)
from ..media.conditioning import TextConditioner, TextEncoderLoader
from ..media.mp4 import MP4Stream, mp4_stream, write_mp4
from ..media.references import CanvasRules
from ..media.vae import DecodedMedia, MediaVAEs, decode_latents
from ..profiles import Profile
from ..progress import PreviewFn, StageProgress
from .assets import (
    ASSET_FIELDS,
    LoadedParts,
    PartLoader,
    PreparedAssets,
    largest_request,
    prepare_pipeline,
    resolve_profile,
)
from .model_loading import MODEL_LOAD_LOCK
from .options import RunOptions
from .steps import EncodedRequest, build_request_bundle, delivered_soundtrack, encode_request, stage_timer
from .validation import PromptBudget, RequestPlan, VideoRequest, check_generate_arguments, plan_request

# The public names of the request path (`H3Pipeline`, its requests, results, assets and steps) are importable from here.
__all__ = [
    "ASSET_FIELDS", "EncodedRequest", "H3Pipeline", "PreparedAssets", "RequestCancelled", "VideoRequest",
    "VideoResult", "build_request_bundle", "delivered_soundtrack", "encode_request", "largest_request",
    "plan_request", "prepare_pipeline",
]

logger = logging.getLogger(__name__)

# Progress stages (`StageProgress`): "load", "encode", "denoise", "decode", "write".


class RequestCancelled(RunFailedError):
    """Raised when a request is aborted through its `cancel` callable (the pipeline is closed)."""


# -- results -----------------------------------------------------------------------------------------------------------


@dataclass
class VideoResult:
    """One finished request. `path` is None when no output file was asked for (then `media` holds the decode)."""

    path: Path | None
    elapsed_seconds: float
    stages: dict[str, float]
    timing: SessionTiming
    mode: str
    width: int
    height: int
    num_frames: int
    fps: int
    sample_rate: int
    metadata: dict[str, object] = field(default_factory=dict)
    media: DecodedMedia | None = None


# -- the pipeline --------------------------------------------------------------------------------------------------


class H3Pipeline:
    """The complete pipeline around one native session. Compose it from loaded parts, or `from_prepared` (lazy).
    Thread-safe (see the module's doc).

    Args:
        profile: the profile the session runs (id or `Profile`).
        conditioner, vaes, session: the three loaded parts (a front end may load them separately); all None only when
            a `loader` is given (what `from_prepared` does).
        canvas: the model's canvas rules (default: the conditioner's).
        prompt_budget: the text encoder's context and tokenizer (default: the conditioner's).
        options: the run options this pipeline was made with; of them a composed pipeline uses the MP4 delivery
            (`media_video_input`, `media_video_threads`, `media_video_crf`, `media_video_preset`) and `profile_denoise`
            (per-evaluation device timings in `metadata["denoise_profile"]`, a diagnostic).
    """

    def __init__(
        self,
        profile: Profile | str,
        conditioner: TextConditioner | None,
        vaes: MediaVAEs | None,
        session: NativeEngineSession | None,
        *,
        canvas: CanvasRules | None = None,
        prompt_budget: PromptBudget | None = None,
        options: RunOptions | None = None,
        loader: Callable[[StageProgress | None], LoadedParts] | None = None,
    ):
        self.profile = resolve_profile(profile)
        parts = (conditioner, vaes, session)
        if loader is None and any(p is None for p in parts):
            raise VflashError("H3Pipeline needs a conditioner, VAEs and a session (or a loader, see from_prepared)")
        if session is not None and not isinstance(getattr(session, "profile", None), Profile):
            raise VflashError(f"session must be a loaded NativeEngineSession, got {describe_value(session)}")
        if session is not None and session.profile.id != self.profile.id:
            raise IdentityMismatchError(
                f"the session runs profile {session.profile.id}, the pipeline was given {self.profile.id}"
            )
        self.conditioner, self.vaes, self.session = parts
        self.canvas = canvas or (conditioner.canvas if conditioner is not None else CanvasRules())
        # A closed conditioner (text_encoder None) has no tokenizer to count with.
        if prompt_budget is None and conditioner is not None and conditioner.text_encoder is not None:
            context = conditioner.text_encoder.config.text_config.max_position_embeddings
            prompt_budget = PromptBudget.of_tokenizer(conditioner.tokenizer, context)
        self.prompt_budget = prompt_budget
        self.options = options or RunOptions()
        self._loader = loader
        self._closed = False
        # Guards loading and running: one request at a time, and the parts never change under a running request.
        self._lock = threading.RLock()
        self.initialization_seconds = 0.0  # set by load(); a pipeline composed from loaded parts has none

    @classmethod
    def from_prepared(
        cls,
        prepared_assets: str | Path | PreparedAssets,
        options: RunOptions | None = None,
        *,
        text_encoder_loader: TextEncoderLoader | None = None,
        native_denoiser_loader: NativeDenoiserLoader | None = None,
        block_loader: BlockLoader | None = None,
    ) -> H3Pipeline:
        """A pipeline over prepared assets that loads nothing until `load()` or the first request. The devices
        (present on this machine, of the profile's architecture) and the attention backend are checked now.

        Trusted loader hooks (Python callables, code rather than options, so never read from a file, a command line
        or a request): `text_encoder_loader(model_root)` returns the CPU Qwen3-VL model the conditioner then trims,
        offloads and releases (`conditioning.TextConditioner.from_pretrained`); `native_denoiser_loader` and
        `block_loader` load the core's resident weights (`session.NativeEngineSession`). What a hook raises
        propagates from `load()` (or the first request) after the parts loaded before it are released; the
        pipeline stays open, and the next `load()` calls the loaders again.

        `options`: see `RunOptions`; the placement it asks for and its memory cap are planned when the pipeline
        loads (`assets.PartLoader`).
        """
        options = options or RunOptions()
        if not isinstance(options, RunOptions):
            raise VflashError(
                f"options must be a RunOptions, got {describe_value(options)}; e.g. RunOptions(device=0)"
            )
        assets = (
            prepared_assets if isinstance(prepared_assets, PreparedAssets) else PreparedAssets.load(prepared_assets)
        )
        primary, peer = options.check_devices(assets.profile)
        if text_encoder_loader is not None and not callable(text_encoder_loader):
            raise VflashError(
                f"text_encoder_loader must be a Python callable, got {type(text_encoder_loader).__name__}"
            )
        core_hooks = check_loader_hooks(native_denoiser_loader, block_loader, options.strategy, 1 + (peer is not None))
        # The core's loader hooks load resident blocks: the plan places them so unless told otherwise (then refused).
        weight_residency = "resident" if core_hooks and options.weight_residency == "auto" else options.weight_residency
        loader = PartLoader(
            assets, options, (primary,) if peer is None else (primary, peer), weight_residency, text_encoder_loader,
            native_denoiser_loader, block_loader,
        )
        return cls(
            assets.profile, None, None, None, canvas=assets.canvas,
            prompt_budget=PromptBudget.from_model_root(assets.model_root), options=options, loader=loader,
        )

    # -- lifecycle ----------------------------------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.session is not None

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this pipeline is closed (closed, cancelled or failed); create a new H3Pipeline")

    def load(self, progress: StageProgress | None = None) -> None:
        """Load the text encoder, the VAEs and the native session now (once, whichever thread asks first); sets
        `initialization_seconds`."""
        self._check_open()
        check_callback(progress, "progress")
        with self._lock:
            self._check_open()  # closed while this thread waited
            if self.loaded:
                return
            start = time.perf_counter()
            assert self._loader is not None
            with MODEL_LOAD_LOCK:
                self.conditioner, self.vaes, self.session = self._loader(progress)
            self.initialization_seconds = time.perf_counter() - start
            logger.info("pipeline %s ready in %.2f s", self.profile.id, self.initialization_seconds)

    def close(self) -> None:
        """Release the session (waits for its devices and for a running request), the encoder and the VAEs.
        Idempotent."""
        self._closed = True
        with self._lock:
            for part in (self.session, self.conditioner, self.vaes):
                if part is not None:
                    part.close()
            self.session = self.conditioner = self.vaes = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stages -------------------------------------------------------------------------------------------------------

    def validate(self, request: VideoRequest) -> RequestPlan:
        """Everything about `request` that can be checked before any model loads; raises `VflashError`."""
        self._check_open()
        if not isinstance(request, VideoRequest):
            hint = ""
            if isinstance(request, str):
                hint = f"; wrap the prompt: VideoRequest(prompt={request[:20]!r}{'...' if len(request) > 20 else ''})"
            raise RequestError(f"H3Pipeline.validate takes a VideoRequest, got {type(request).__name__}{hint}")
        return plan_request(request, self.profile, self.canvas, self.prompt_budget)

    @property
    def config(self) -> H3Config:
        self.load()
        assert self.session is not None  # load() sets every part or raises
        return self.session.compiled.config

    def encode(self, request: VideoRequest, timings: dict[str, float] | None = None) -> BundleHandoff:
        """Prompt and media -> a one-shot conditioning handoff for `denoise`."""
        request_plan = self.validate(request)
        with self._lock:
            self.load()
            assert self.conditioner is not None and self.vaes is not None  # load() sets every part or raises
            return build_request_bundle(
                self.conditioner, self.vaes, request, request_plan, self.config, self.canvas, timings
            )

    def denoise(
        self, bundle_or_handoff, progress: Callable[[int, int], None] | None = None, preview: PreviewFn | None = None
    ) -> GenerationResult:
        """Run the native core; `progress(done, total)` and `preview(done, total, video x0)` after every evaluation
        (either may raise to abort; `progress.PreviewFn`)."""
        self._check_open()
        with self._lock:
            self.load()
            assert self.session is not None  # load() sets every part or raises
            return self.session.generate(
                bundle_or_handoff, progress=progress, profile_denoise=self.options.profile_denoise, preview=preview
            )

    def decode(self, video_latents: torch.Tensor, audio_latents: torch.Tensor) -> DecodedMedia:
        """(1, C, F, h, w) and (2, C_a, A) normalised latents -> frames and stereo waveform."""
        self._check_open()
        with self._lock:
            self.load()
            self._check_memory(Geometry.of_latents(video_latents, audio_latents), denoise=False)
            assert self.vaes is not None  # load() sets every part or raises
            return self.vaes.decode(video_latents, audio_latents)

    def _check_memory(self, geometry: Geometry, denoise: bool = True) -> None:
        """Refuse, before anything runs, a request whose denoise or decode does not fit the memory plan (a pipeline
        loaded with `from_prepared` on a GPU or under a cap). The denoise is checked here without the text rows, which
        only the encode knows (the session checks it again, exactly, before it runs); the encode is checked exactly by
        the conditioner before it moves anything."""
        assert self.session is not None and self.vaes is not None  # its callers load the parts first
        memory_plan = self.session.plan
        if memory_plan is None or memory_plan.placement.vaes is None:
            return
        # The VAEs took this plan (`from_prepared`), and a plan that places them chooses their video decoder.
        needs = {"decode": self.vaes.decode_need(geometry.num_frames, geometry.height, geometry.width).transient}
        if denoise:
            needs["denoise"] = self.session.memory.evaluation_bytes(request_rows(self.config, geometry, 0))
        memory_plan.check(needs, f"a {geometry.width}x{geometry.height} clip of {geometry.num_frames} frames")

    # -- one request --------------------------------------------------------------------------------------------------

    def generate(
        self,
        request: VideoRequest,
        output: str | Path | None,
        overwrite: bool = False,
        progress: StageProgress | None = None,
        cancel: Callable[[], None] | None = None,
        preview: PreviewFn | None = None,
        exact: bool = False,
    ) -> VideoResult:
        """Generate one clip and write it to `output` (MP4; None keeps the decoded media in the result).

        With `exact`, a pipeline run with a fast mode (`RunOptions.fast_mode`) renders this request exactly.

        `cancel()` is polled between stages, between the denoiser's evaluations and the video decoder's blocks; what
        it raises ends the request as `RequestCancelled` and closes the pipeline. `preview(done, total, video x0)` runs
        after every evaluation (`progress.PreviewFn`). What `progress` or `preview` raises aborts the request, re-raised
        unchanged, and leaves the pipeline usable."""
        start = time.perf_counter()
        request_plan = self.validate(request)
        check_generate_arguments(request, output, overwrite, progress, cancel, preview)
        validated = time.perf_counter() - start
        with self._lock:
            write = self._run(request, request_plan, output, overwrite, progress, cancel, preview, validated, exact)
        return write()  # holds no lock: another thread's request may encode and denoise meanwhile

    def _run(
        self, request: VideoRequest, request_plan: RequestPlan, output: str | Path | None, overwrite: bool,
        progress: StageProgress | None, cancel: Callable[[], None] | None, preview: PreviewFn | None, validated: float,
        exact: bool = False,
    ) -> Callable[[], VideoResult]:
        """One validated request up to its decode, under the pipeline's lock (the clock starts after any wait for
        it); returns the rest, the MP4's write, which runs on the CPU once the lock is released."""
        start = time.perf_counter() - validated
        stages: dict[str, float] = {"validate": validated}
        initialization = 0.0
        if not self.loaded:
            load_start = time.perf_counter()
            self.load(progress)
            initialization = time.perf_counter() - load_start
        self._check_open()  # closed while this request waited
        control = _RequestControl(progress, cancel, preview)
        self._check_memory(request_plan.geometry)
        try:
            # An MP4 stream opened here outlives the lock: `write` takes its context over once the decode is done.
            with contextlib.ExitStack() as stack:
                handoff = self._encode_stage(request, request_plan, stages, control)
                generation = self._denoise_stage(handoff, stages, control, exact)
                media, stream = self._decode_stage(
                    generation, request_plan.geometry, output, overwrite, stages, control, stack
                )
                t = time.perf_counter()
                soundtrack = delivered_soundtrack(media)
                open_stream = stack.pop_all()
        except BaseException as exc:
            self._end_on_failure(exc, control.guarded)
            raise
        metadata, session_timing = self._metadata(request, generation, media, soundtrack), generation.timing
        del generation  # the write keeps no device tensor

        def write() -> VideoResult:
            path = None
            try:
                with open_stream:
                    if stream is not None:
                        stream.finish(soundtrack)
                        assert output is not None  # a stream is opened for an output only
                        path = Path(output)
                    elif output is not None:
                        path = self._write_mp4(output, media, soundtrack, overwrite)
                if path is not None:
                    stages["write"] = time.perf_counter() - t
                    control.report("write", 1, 1)
            except BaseException as exc:
                self._end_on_failure(exc, control.guarded)
                raise
            return VideoResult(
                path=path, elapsed_seconds=time.perf_counter() - start - initialization, stages=stages,
                timing=session_timing, mode=request_plan.mode, width=request_plan.geometry.width,
                height=request_plan.geometry.height,
                num_frames=media.num_frames, fps=FPS, sample_rate=media.sample_rate, metadata=metadata,
                media=None if output is not None else media,
            )

        return write

    def _end_on_failure(self, exc: BaseException, guarded: CallbackGuard) -> None:
        """A cancel, or a failure that is not the user's, ends the pipeline (what a caller's callback raised does
        not)."""
        caller_stopped = guarded.raised is not None
        if not caller_stopped and (isinstance(exc, RequestCancelled) or not isinstance(exc, VflashError)):
            self.close()

    # Each stage reports (stage, 0, total) as it starts, so that a progress bar times the whole stage.

    def _encode_stage(
        self, request: VideoRequest, request_plan: RequestPlan, stages: dict[str, float], control: _RequestControl
    ) -> BundleHandoff:
        assert self.conditioner is not None and self.vaes is not None  # loaded by `_run`
        control.poll()
        control.report("encode", 0, 1)
        t = time.perf_counter()
        handoff = build_request_bundle(
            self.conditioner, self.vaes, request, request_plan, self.config, self.canvas, stages
        )
        stages["encode"] = time.perf_counter() - t
        control.report("encode", 1, 1)
        return handoff

    def _denoise_stage(
        self, handoff: BundleHandoff, stages: dict[str, float], control: _RequestControl, exact: bool
    ) -> GenerationResult:
        assert self.session is not None  # loaded by `_run`
        control.poll()

        def on_evaluation(done: int, total: int) -> None:
            control.report("denoise", done, total)
            control.poll()

        control.report("denoise", 0, self.profile.nfe)
        t = time.perf_counter()
        generation = self.session.generate(
            handoff, progress=on_evaluation, profile_denoise=self.options.profile_denoise, preview=control.preview,
            exact=exact,
        )
        stages["denoise"] = time.perf_counter() - t
        return generation

    def _decode_stage(
        self, generation: GenerationResult, geometry: Geometry, output: str | Path | None, overwrite: bool,
        stages: dict[str, float], control: _RequestControl, stack: contextlib.ExitStack,
    ) -> tuple[DecodedMedia, MP4Stream | None]:
        """Decode; where the MP4 streams (`media_video_input="stream"`), into the MP4 opened on `stack`, encoded
        while the video decodes (its `write` is what is left of it after the decode). Returns the media and the
        stream (None where the frames stay in `media`); with an output, the `write` stage has started."""
        assert self.vaes is not None  # loaded by `_run`
        options = self.options
        control.poll()
        control.report("decode", 0, 2)
        t = time.perf_counter()
        after_stage = stage_timer(
            stages, lambda stage: control.report("decode", ("decode.video", "decode.audio").index(stage) + 1, 2)
        )
        between_blocks = control.poll if control.cancel is not None else None
        stream = None
        if output is not None and options.media_video_input == "stream":
            stream = stack.enter_context(mp4_stream(
                output, geometry.width, geometry.height, self.vaes.sample_rate, FPS,
                video_threads=options.media_video_threads, overwrite=overwrite, video_crf=options.media_video_crf,
                video_preset=options.media_video_preset,
            ))
        media = decode_latents(
            self.vaes, generation.video_latents, generation.audio_latents, after_stage, between_blocks,
            video_sink=None if stream is None else stream.add,
        )
        stages["decode"] = time.perf_counter() - t
        if output is not None:
            control.poll()
            control.report("write", 0, 1)
        return media, stream

    def _write_mp4(
        self, output: str | Path, media: DecodedMedia, soundtrack: torch.Tensor, overwrite: bool
    ) -> Path:
        """The decoded frames and soundtrack written to the MP4 `output` (a decode that did not stream)."""
        options = self.options
        assert media.frames is not None  # decoded without a video sink
        return write_mp4(
            output, media.frames, soundtrack, media.sample_rate, FPS, options.media_video_input,
            options.media_video_threads, overwrite, video_crf=options.media_video_crf,
            video_preset=options.media_video_preset,
        )

    def _metadata(
        self, request: VideoRequest, generation: GenerationResult, media: DecodedMedia, soundtrack: torch.Tensor
    ) -> dict[str, object]:
        """A finished request's metadata: the session's, the request's and the delivery's, the plan's placement."""
        assert self.conditioner is not None and self.session is not None  # loaded by `_run`
        metadata = {
            **generation.metadata,
            "seed": request.seed,
            "duration_seconds": media.num_frames / FPS,
            "audio_samples": soundtrack.shape[1],
            "media_video_input": self.options.media_video_input,
            "media_video_threads": self.options.media_video_threads,
            "media_video_crf": self.options.media_video_crf,
            "media_video_preset": self.options.media_video_preset,
            "encoder_residency": "resident" if self.conditioner.keep_on_device else "offload",
        }
        if self.session.plan is not None and self.session.plan.placement.vaes is not None:
            metadata["memory_plan"] = asdict(self.session.plan.placement)
        if generation.denoise_profile is not None:
            metadata["denoise_profile"] = generation.denoise_profile
        return metadata


class _RequestControl:
    """One request's callbacks: the caller's `cancel` polled between stages (what it raises ends the request as
    `RequestCancelled`), its `progress` and `preview` guarded (what they raise aborts the request and leaves the
    pipeline usable: `guarded.raised`)."""

    def __init__(
        self, progress: StageProgress | None, cancel: Callable[[], None] | None, preview: PreviewFn | None
    ):
        self.cancel = cancel
        self.guarded = CallbackGuard()
        self.report: StageProgress = self.guarded(progress) or (lambda stage, done, total: None)
        self.preview = self.guarded(preview)

    def poll(self) -> None:
        if self.cancel is not None:
            try:
                self.cancel()
            except BaseException as exc:
                raise RequestCancelled(f"request cancelled: {exc}") from exc

