"""Decode + MP4 as a request runs them after its last denoising step: today's serial path against the streamed one,
one process, the H3 VAEs at their released size (random weights), one H200.

    python benchmarks/delivery.py [--cache /tmp/vflash-bench] [--photos DIR] [--repeat 1] [--video-decoder native]
                                  [--canvases 1344x768 960x544] [--durations 5 10] [--carry-from FILE]
    python benchmarks/delivery.py --small      # dry run: the demo family's VAEs on the CPU at 320x256

For each canvas (1344x768, 960x544) and duration (5 s, 10 s) both paths take the same random video and audio latents:

* `serial` (`media_video_input="file"`): `decode_latents` (video, then audio) to host frames, then `write_mp4`;
* `streaming` (`"stream"`): `decode_latents` handing each decoded part to an `MP4Stream`, whose thread converts and
  encodes it while the decoder goes on, then `finish` with the soundtrack.

Two clips go through each: `noise`, the frames the random-weight decoder makes (x264's worst case), and `natural`, a
slow pan over photographs (--photos: a folder of photos; by default scikit-image's sample photos when it is
installed) placed on the decoding device before the timing; the decode runs as for noise and the pan's frames take
the decoded frames' place as they are handed on (a part's frames in the streaming path, the whole clip in the serial
one), so the decode's work is the real one and the encoder's is a natural clip's.

Per path: `decode_seconds` (last latent -> the audio decoded; in the streaming path it includes any wait for the
encoder), `mp4_seconds` (from there to the MP4 published), `delivery_seconds` (last latent -> MP4 published) and
`mp4_tail_seconds` (last video frame decoded -> MP4 published), medians of --repeat after one warm-up of each path.
`same_encoder_input`: both paths handed the muxer the same uint8 frames (sha256 over them) and the same soundtrack;
`same_mp4_bytes`: the two files' sha256 (libx264's bytes for equal input are not reproducible in every process, so
this can be false with equal inputs); `bitwise_equal_to_diffusers`: the decoder's frames (noise) equal diffusers'
`vae.decode` of the same latents. Video decoder: --video-decoder (`native`, what the memory plan picks on small
cards and the faster one; `diffusers`).

Writes benchmarks/results/delivery_h200.json (--small: delivery_small_cpu.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, write_result
from vae import CANVASES, SMALL_CANVASES, family_spec, load_vaes, synchronize

from vflash_core.engine.layout import FPS, audio_latent_count, frames_for_duration, video_latent_frames
from vflash_core.media import mp4
from vflash_core.media.vae import MediaVAEs, decode_latents
from vflash_core.pipeline.steps import delivered_soundtrack
from vflash_core.weights.family import DEMO_FAMILY

SEED = 0
SECONDS = (5.0, 10.0)
PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg")
# scikit-image's colour photographs (its data folder ships them with the wheel).
SKIMAGE_PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png")


def photos(folder: Path | None) -> list[PIL.Image.Image]:
    """The photos the natural clip pans over: every image in `folder`, or scikit-image's sample photos."""
    if folder is None:
        try:
            import skimage
        except ImportError:
            raise SystemExit("the natural clip needs photos: pass --photos DIR or install scikit-image") from None
        paths = [Path(skimage.__file__).parent / "data" / name for name in SKIMAGE_PHOTOS]
    else:
        paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in PHOTO_SUFFIXES)
    if not paths:
        raise SystemExit(f"no photos ({', '.join(PHOTO_SUFFIXES)}) in {folder}")
    return [PIL.Image.open(p).convert("RGB") for p in paths]


def natural_clip(images: list[PIL.Image.Image], num_frames: int, height: int, width: int) -> torch.Tensor:
    """(F, H, W, 3) float32 in [0, 1]: a window of the canvas panning left to right (and drifting down a little)
    across the photos side by side, each scaled to 1.25x the canvas height."""
    strip_height = round(height * 1.25)
    scaled = [np.asarray(im.resize((max(width // 2, round(im.width * strip_height / im.height)), strip_height), PIL.Image.LANCZOS))
              for im in images]
    strip = np.concatenate(scaled, axis=1)
    while strip.shape[1] < 2 * width:
        strip = np.concatenate([strip, strip], axis=1)
    travel_x, travel_y = strip.shape[1] - width, strip_height - height
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for i in range(num_frames):
        x, y = round(travel_x * i / max(1, num_frames - 1)), round(travel_y * i / max(1, num_frames - 1))
        frames[i] = strip[y : y + height, x : x + width]
    return torch.from_numpy(frames).float().div_(255.0)


class MuxerInputs:
    """sha256 of the frames and soundtrack the MP4 writers hand the muxer (a wrapper around `mp4._Muxer`)."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self._add_frame, self._finish = mp4._Muxer.add_frame, mp4._Muxer.finish
        inputs = self

        def add_frame(muxer, rgb: np.ndarray) -> None:
            inputs.digest.update(rgb.tobytes())
            inputs._add_frame(muxer, rgb)

        def finish(muxer, audio: np.ndarray) -> None:
            inputs.digest.update(audio.tobytes())
            inputs._finish(muxer, audio)

        mp4._Muxer.add_frame, mp4._Muxer.finish = add_frame, finish

    def take(self) -> str:
        value, self.digest = self.digest.hexdigest(), hashlib.sha256()
        return value


def serial(vaes: MediaVAEs, z: torch.Tensor, audio: torch.Tensor, clip: torch.Tensor | None, out: Path, device: torch.device) -> dict[str, float]:
    """Today's path: decode everything to the host, then write the MP4 from a temporary RGB file (`clip`: the
    natural clip on the host, in the decoded frames' place)."""
    marks: dict[str, float] = {}
    synchronize(device)
    start = time.perf_counter()
    media = decode_latents(vaes, z, audio, lambda stage: marks.setdefault(stage, time.perf_counter()))
    decoded = time.perf_counter()
    frames = media.frames if clip is None else clip
    mp4.write_mp4(out, frames, delivered_soundtrack(media), media.sample_rate, FPS, video_input="file")
    end = time.perf_counter()
    return {"decode_seconds": decoded - start, "mp4_seconds": end - decoded, "delivery_seconds": end - start,
            "mp4_tail_seconds": end - marks["decode.video"]}


def streaming(vaes: MediaVAEs, z: torch.Tensor, audio: torch.Tensor, clip: torch.Tensor | None, out: Path, device: torch.device) -> dict[str, float]:
    """The streamed path: each decoded part to the MP4 stream's encoder thread as the decoder finishes it (`clip`: the
    natural clip on the decoding device, each part's frames in the decoded frames' place)."""
    marks: dict[str, float] = {}
    synchronize(device)
    start = time.perf_counter()
    height, width = z.shape[3] * vaes.video_vae.spatial_compression_ratio, z.shape[4] * vaes.video_vae.spatial_compression_ratio
    with mp4.mp4_stream(out, width, height, vaes.sample_rate, FPS) as stream:
        sink: Callable[[int, torch.Tensor], None] = stream.add
        if clip is not None:
            def sink(first: int, frames: torch.Tensor) -> None:  # the pan's frames in the decoded frames' place
                stream.add(first, clip[first : first + frames.shape[0]])
        media = decode_latents(vaes, z, audio, lambda stage: marks.setdefault(stage, time.perf_counter()), video_sink=sink)
        decoded = time.perf_counter()
        stream.finish(delivered_soundtrack(media))
    end = time.perf_counter()
    return {"decode_seconds": decoded - start, "mp4_seconds": end - decoded, "delivery_seconds": end - start,
            "mp4_tail_seconds": end - marks["decode.video"]}


def equal_to_diffusers(vaes: MediaVAEs, z: torch.Tensor) -> bool:
    """The configured decoder's frames of `z` against diffusers' `vae.decode` (through the same mapping to [0, 1])."""
    decoder = vaes.video_decoder
    with vaes.on_device():
        got = vaes.decode_video(z)
        vaes.video_decoder = "diffusers"
        try:
            return torch.equal(got, got if decoder == "diffusers" else vaes.decode_video(z))
        finally:
            vaes.video_decoder = decoder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(vaes: MediaVAEs, device: torch.device, canvases: dict[str, tuple[int, int]], seconds_list: tuple[float, ...],
        images: list[PIL.Image.Image], repeat: int, folder: Path, save: Callable[[dict[str, object]], None]) -> None:
    """Every record, saved as soon as it is measured (`save(result)`: a long run keeps what it measured)."""
    vae, g = vaes.video_vae, torch.Generator().manual_seed(SEED)
    inputs = MuxerInputs()
    records: list[dict[str, object]] = []
    result = {**environment(), "dtype": str(vae.decoder.proj_out.weight.dtype), "video_decoder": vaes.video_decoder, "records": records}
    for canvas, (height, width) in canvases.items():
        for seconds in seconds_list:
            frames = frames_for_duration(seconds)
            ratio = vae.spatial_compression_ratio
            z = torch.randn(1, vaes.latent_channels, video_latent_frames(frames), height // ratio, width // ratio, generator=g)
            audio = torch.randn(2, vaes.audio_latent_channels, audio_latent_count(frames), generator=g)
            pan = natural_clip(images, frames, height, width)
            clips = {"noise": {"serial": None, "streaming": None}, "natural": {"serial": pan, "streaming": pan.to(device)}}
            for source, clip_of in clips.items():
                record: dict[str, object] = {"canvas": canvas, "seconds": seconds, "frames": frames, "source": source,
                                             "video_decoder": vaes.video_decoder}
                digests = {}
                for name, path_fn in (("serial", serial), ("streaming", streaming)):
                    times = []
                    for attempt in range(1 + repeat):  # the first is the warm-up
                        out = folder / f"{canvas}-{seconds:g}-{source}-{name}-{attempt}.mp4"
                        inputs.take()
                        times.append(path_fn(vaes, z, audio, clip_of[name], out, device))
                        digests[name] = (inputs.take(), sha256(out))
                        out.unlink()
                    record[name] = {key: round(statistics.median(t[key] for t in times[1:]), 4) for key in times[0]}
                record["same_encoder_input"] = digests["serial"][0] == digests["streaming"][0]
                record["same_mp4_bytes"] = digests["serial"][1] == digests["streaming"][1]
                record["delivery_speedup"] = round(record["serial"]["delivery_seconds"] / record["streaming"]["delivery_seconds"], 4)
                if source == "noise":
                    record["bitwise_equal_to_diffusers"] = equal_to_diffusers(vaes, z)
                print(record, flush=True)
                records.append(record)
                save(result)
            del pan, clips
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vflash-bench"))
    parser.add_argument("--photos", type=Path, default=None, help="a folder of photos for the natural clip (default: scikit-image's)")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each path after its warm-up")
    parser.add_argument("--video-decoder", default="native", choices=("native", "diffusers"))
    parser.add_argument("--small", action="store_true", help="dry run: the demo family's VAEs on the CPU at a small canvas")
    parser.add_argument("--canvases", nargs="+", choices=sorted(CANVASES), default=list(CANVASES), help="canvases to run (not with --small)")
    parser.add_argument("--durations", type=float, nargs="+", default=list(SECONDS), help="clip lengths in seconds (not with --small)")
    parser.add_argument("--carry-from", type=Path, default=Path(__file__).resolve().parent / "results" / "delivery_h200.json",
                        help="an earlier result file whose records of canvases and durations not run here are kept (marked measured_at_commit)")
    args = parser.parse_args()
    if args.small:
        device, spec, canvases, seconds_list = torch.device("cpu"), DEMO_FAMILY, SMALL_CANVASES, (5.0,)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --small)")
        device, spec = torch.device("cuda:0"), family_spec()
        canvases, seconds_list = {c: CANVASES[c] for c in args.canvases}, tuple(args.durations)
    images = photos(args.photos)
    vaes = load_vaes(args.cache, spec, device)
    vaes.video_decoder = args.video_decoder
    vaes.keep_on_device = True  # a warm request's VAEs, as the resident configuration keeps them
    name = "delivery_small_cpu" if args.small else "delivery_h200"
    carried = [] if args.small else carried_records(args.carry_from, canvases, seconds_list)
    with tempfile.TemporaryDirectory(prefix="vflash-delivery-") as folder:
        run(vaes, device, canvases, seconds_list, images, args.repeat, Path(folder),
            lambda result: write_result(name, {**result, "records": result["records"] + carried, "small": args.small}))


def carried_records(path: Path, canvases: dict[str, tuple[int, int]], seconds_list: tuple[float, ...]) -> list[dict[str, object]]:
    """`path`'s records of the canvases and durations this run leaves out, each marked with the commit it measured."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    return [{**r, "measured_at_commit": r.get("measured_at_commit", earlier.get("commit"))} for r in earlier["records"]
            if not (r["canvas"] in canvases and r["seconds"] in seconds_list)]


if __name__ == "__main__":
    main()
