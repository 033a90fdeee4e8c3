"""The native video decode (`vflash_core.media.vae_decode`) against diffusers' `AutoencoderKLMiniMaxH3.decode`, unmodified,
bit for bit: the demo family's VAE (2 blocks, 32 wide) loaded as the pipeline loads it, in fp32 and in bf16 with
diffusers' fp32 pins, at the released tile geometry (256 px tiles, so latents above 16 x 16 tile) and with smaller
tiles for many-tile and padding cases; split over two devices (two CPU "devices" here, two GPUs under `multigpu`)
against one."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from vae_inputs import SMALL_TILES, latents

from vflash_core.errors import VflashError
from vflash_core.media import vae_decode
from vflash_core.media.vae import MediaVAEs
from vflash_core.media.vae_decode import NativeVideoDecoder
from vflash_core.media.vae_decode_devices import split_calls
from vflash_core.media.vae_tiles import DecodeGeometry, TileWindow, split_tiles
from vflash_core.media.vae_vit import DecoderWeights

# 17 latent frames make 3 temporal windows; 20 x 24 latents are 320 x 384 px: 2 x 2 tiles of 256 px.
RELEASED_TILING_LATENTS = (1, 8, 17, 20, 24)


@pytest.fixture(scope="module")
def vae_root(h3_family):
    """The run's shared demo family (its `vae/` and `audio_vae/`)."""
    return h3_family


@pytest.fixture(scope="module")
def media(vae_root) -> dict[torch.dtype, MediaVAEs]:
    """The demo VAEs as the pipeline loads them: fp32 (the CPU default) and bf16 (diffusers' pins keep the norms and
    scales in fp32)."""
    return {dtype: MediaVAEs.from_pretrained(vae_root, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}


def reference(vae, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


@pytest.fixture(scope="module")
def released_tiling_reference(media) -> dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]:
    """(latents, diffusers' decode) per dtype at the released tile geometry, computed once."""
    z = latents(RELEASED_TILING_LATENTS)
    return {dtype: (z, reference(vaes.video_vae, z)) for dtype, vaes in media.items()}


@pytest.fixture
def small_tiles(media):
    """The bf16 and fp32 video VAEs with 64 px tiles for the duration of a test."""
    for vaes in media.values():
        vaes.video_vae.enable_tiling(*SMALL_TILES)
    yield
    for vaes in media.values():
        vaes.video_vae.enable_tiling(256, 256, 64, 64)


# -- geometry ---------------------------------------------------------------------------------------------------------


def test_split_tiles_is_the_vae_tiling(media):
    vae = media[torch.float32].video_vae
    for length in range(16, 1600, 16):
        for tile, overlap in ((256, 64), (64, 32), (128, 48)):
            starts, size, overlaps = split_tiles(length, tile, overlap, 16)
            expected = vae._split_tiles(length, tile, overlap)
            assert (starts, [size] * len(starts), overlaps) == expected, (length, tile, overlap)


def test_released_geometry_plan():
    """1344 x 768 at 5 s (37 latent frames): 7 windows of 7 latents, 4 x 7 tiles of 16 x 16 latents, 124 frames."""
    from diffusers import AutoencoderKLMiniMaxH3

    with torch.device("meta"):
        vae = AutoencoderKLMiniMaxH3()
    plan = DecodeGeometry.from_vae(vae).plan(37, 48, 84)
    assert plan.window_starts == (0, 5, 10, 15, 20, 25, 30) and plan.window_latents == 7
    assert (len(plan.row_starts), len(plan.col_starts), plan.tile_height, plan.tile_width) == (4, 7, 16, 16)
    assert plan.output_frames == 124 and (plan.pixel_height, plan.pixel_width) == (768, 1344)


# -- bit for bit with diffusers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, windows_per_call", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 5)])
def test_released_tiling_bitwise(media, released_tiling_reference, dtype, windows_per_call):
    """2 x 2 tiles of 256 px, 3 windows with cross-fades: equal to diffusers whether each ViT call runs one tile-window
    (the reference's shapes) or stacks several (5 does not divide the 12 tile-windows: a shorter last call)."""
    z, expected = released_tiling_reference[dtype]
    decoder = NativeVideoDecoder.from_vae(media[dtype].video_vae, windows_per_call=windows_per_call)
    assert decoder.attention_backend == "torch-sdpa"
    assert_bitwise(decoder.decode(z), expected, f"{dtype} windows_per_call={windows_per_call}")


def recorded_calls(patch: pytest.MonkeyPatch) -> list[tuple[DecoderWeights, bool, int]]:
    """Every ViT call from now on: (the weights it ran on, whether on the calling thread, its tile-windows)."""
    calls = []
    original = vae_decode.decode_tile_windows

    def recording(w, latents, *args):
        calls.append((w, threading.current_thread() is threading.main_thread(), latents.shape[0]))
        return original(w, latents, *args)

    patch.setattr(vae_decode, "decode_tile_windows", recording)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tiles_padding_and_two_devices_bitwise(media, small_tiles, dtype):
    """4 x 4 tiles, 13 latent frames (3 windows, the last ending on repeated latents whose frames are cut), calls of 7
    tile-windows that straddle windows; then the same calls split between two devices, the second on a replica of the
    weights driven by a thread of its own, its tiles staged on the host and gathered on the first: all equal to
    diffusers and the split equal to one device. Both devices are the CPU here, which runs the two-GPU code: the
    replica, the split, the peer's thread, the staging and the gather."""
    vae = media[dtype].video_vae
    z = latents((1, 8, 13, 9, 10), seed=1)
    expected = reference(vae, z)
    one = NativeVideoDecoder.from_vae(vae, windows_per_call=7).decode(z)
    assert_bitwise(one, expected, "one device")

    two = NativeVideoDecoder.from_vae(vae, devices=["cpu", "cpu"], windows_per_call=7)
    own, replica = two.weights
    assert own.blocks[0].to_q is vae.decoder.transformer_blocks[0].attn.to_q.weight
    assert replica.blocks[0].to_q is not own.blocks[0].to_q and torch.equal(replica.blocks[0].to_q, own.blocks[0].to_q)
    with pytest.MonkeyPatch.context() as patch:
        calls = recorded_calls(patch)
        got = two.decode(z)
    assert_bitwise(got, one, "two devices against one")
    assert_bitwise(got, expected, "two devices")
    # 48 tile-windows in calls of 7 (the last of 6): the first 3 calls on the first device and the calling thread,
    # the last 4 on the replica and the peer's thread.
    assert sorted((w is replica, on_caller, count) for w, on_caller, count in calls) == [(False, True, 7)] * 3 + [(True, False, 6)] + [(True, False, 7)] * 3


def test_split_calls_is_contiguous_and_even():
    calls = [[TileWindow(i, 0, 0)] for i in range(7)]
    assert [len(part) for part in split_calls(calls, 2)] == [3, 4]
    assert [len(part) for part in split_calls(calls, 3)] == [2, 2, 3]
    assert [len(part) for part in split_calls(calls[:1], 2)] == [0, 1]
    assert [call for part in split_calls(calls, 3) for call in part] == calls


def test_peer_failure_is_raised_by_the_decode(media, small_tiles):
    """An error on the peer's thread ends the decode with that error, the thread finished."""
    vae = media[torch.float32].video_vae
    two = NativeVideoDecoder.from_vae(vae, devices=["cpu", "cpu"], windows_per_call=7)
    replica = two.weights[1]
    original = vae_decode.decode_tile_windows

    def failing_on_the_peer(w, *args):
        if w is replica:
            raise RuntimeError("peer device lost")
        return original(w, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vae_decode, "decode_tile_windows", failing_on_the_peer)
        with pytest.raises(RuntimeError, match="peer device lost"):
            two.decode(latents((1, 8, 13, 9, 10), seed=1))
    assert [t for t in threading.enumerate() if t.name.startswith("vae-decode-device-")] == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_gpu_bitwise_equal_to_diffusers(vae_root, dtype):
    """On a GPU, where diffusers' attention, convolutions and GEMMs pick CUDA kernels: the released tiling (2 x 2
    tiles, 3 windows) and 4 x 4 small tiles with padded windows, equal to diffusers with the default calls (stacked
    for bf16 weights, one tile-window for fp32 ones, whose stacked GEMMs round differently on cuBLAS) and with one
    and five tile-windows per call in bf16."""
    vae = MediaVAEs.from_pretrained(vae_root, "cuda:0", dtype=dtype, video_decoder="native").video_vae.to("cuda:0")
    for tiling, shape, seed in ((None, RELEASED_TILING_LATENTS, 0), (SMALL_TILES, (1, 8, 13, 9, 10), 1)):
        if tiling is not None:
            vae.enable_tiling(*tiling)
        z = latents(shape, seed=seed).to("cuda:0")
        expected = reference(vae, z).cpu()  # the native decode brings each window's frames to the host
        for windows_per_call in (None, 1, 5) if dtype == torch.bfloat16 else (None, 1):
            decoder = NativeVideoDecoder.from_vae(vae, windows_per_call=windows_per_call)
            assert decoder.windows_per_call == (windows_per_call or (8 if dtype == torch.bfloat16 else 1))
            assert_bitwise(decoder.decode(z), expected, f"{dtype} {shape} windows_per_call={decoder.windows_per_call}")


@pytest.mark.gpu
def test_frames_land_on_the_host_as_they_were_on_the_device():
    """Parts on CUDA (permuted views, as the pipeline's frames are) into a host tensor through pinned memory without
    waiting: the host tensor holds each part's bytes, also when the device overwrites the part right after, and a
    part on the host is placed at once."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    video = torch.rand(3, 23, 40, 56, generator=torch.Generator().manual_seed(3))
    on_device = video.cuda()
    output = torch.empty(23, 40, 56, 3)
    landing = vae_decode.FrameLanding(output, frame_dim=0)
    for start, stop in ((0, 9), (9, 17), (17, 21)):
        landing(start, on_device[:, start:stop].permute(1, 2, 3, 0))
        on_device[:, start:stop] = -1.0  # queued after the part's copy
    landing(21, video[:, 21:].permute(1, 2, 3, 0))
    landing.finish()
    assert_bitwise(output, video.permute(1, 2, 3, 0), "landed frames")


@pytest.mark.multigpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_gpus_bitwise_equal_to_one(vae_root, dtype):
    """The decode split over cuda:0 and cuda:1 gives one GPU's pixels bit for bit (4 x 4 tiles, 3 windows, calls of 7
    and of the default 8); through `MediaVAEs` with a peer device too."""
    vaes = MediaVAEs.from_pretrained(vae_root, "cuda:0", dtype=dtype, video_decoder="native")
    vae = vaes.video_vae.to("cuda:0")
    vae.enable_tiling(*SMALL_TILES)
    z = latents((1, 8, 13, 9, 10), seed=1).to("cuda:0")
    for windows_per_call in (7, 8):
        one = NativeVideoDecoder.from_vae(vae, windows_per_call=windows_per_call).decode(z)
        two = NativeVideoDecoder.from_vae(vae, devices=["cuda:0", "cuda:1"], windows_per_call=windows_per_call).decode(z)
        assert_bitwise(two, one, f"{dtype} windows_per_call={windows_per_call}")
    vaes.audio_vae.to("cuda:0")
    video, audio = latents((1, 8, 13, 9, 10), seed=2), latents((2, 8, 30), seed=3)
    expected = vaes.decode(video, audio)
    vaes.peer_device = torch.device("cuda:1")
    assert_bitwise(vaes.decode(video, audio).frames, expected.frames, f"{dtype} MediaVAEs with a peer")


@pytest.mark.parametrize("frames", range(3, 14))
def test_every_clip_length_bitwise(media, frames):
    """Latent frame counts 3..13 (fewer make no window), every padding case, one 16 px tile: frame count and values
    equal diffusers'."""
    vae = media[torch.bfloat16].video_vae
    z = latents((1, 8, frames, 1, 1), seed=frames)
    assert_bitwise(NativeVideoDecoder.from_vae(vae, windows_per_call=2).decode(z), reference(vae, z), f"{frames} latent frames")


def test_untiled_vae_bitwise(media):
    vae = media[torch.float32].video_vae
    z = latents((1, 8, 7, 3, 5), seed=2)
    vae.disable_tiling()
    try:
        assert_bitwise(NativeVideoDecoder.from_vae(vae).decode(z), reference(vae, z), "tiling off")
    finally:
        vae.enable_tiling()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_rows_gemm_is_rowwise(dtype):
    """What stacking tile-windows relies on: a linear layer over stacked rows gives each row block the bits it gets
    alone, here at the full-size decoder's shapes (1797 tokens per tile-window, 2048 wide, SwiGLU 2 x 8192)."""
    g = torch.Generator().manual_seed(3)
    for rows, k, n in ((1797, 2048, 2048), (1797, 8192, 2048), (1797, 2048, 3072), (1792, 24, 2048)):
        weight, bias = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        x = torch.randn(2, rows, k, generator=g).to(dtype)
        stacked = F.linear(x, weight, bias)
        for i in range(2):
            assert_bitwise(stacked[i : i + 1], F.linear(x[i : i + 1], weight, bias), f"{dtype} {rows}x{k}x{n} block {i}")


# -- memory -----------------------------------------------------------------------------------------------------------


def peak_allocated_bytes(fn) -> int:
    """Peak of the bytes allocated by `fn` and not yet freed, from the profiler's record of every CPU allocation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_memory_does_not_grow_with_clip_length(media, small_tiles):
    """With a sink that takes the frames away, the decode's peak allocation is the same for 6 and for 12 windows (by 6
    windows every combination of calls in flight, window tiles and cross-fade frames has occurred), while diffusers'
    (which keeps every window until the end) grows with the clip."""
    vae = media[torch.bfloat16].video_vae
    decoder = NativeVideoDecoder.from_vae(vae, windows_per_call=3)
    short, long = latents((1, 8, 32, 6, 6), seed=4), latents((1, 8, 62, 6, 6), seed=4)
    assert [len(decoder.plan(z.shape).window_starts) for z in (short, long)] == [6, 12]

    def drain(start: int, frames: torch.Tensor) -> None:
        assert start >= 0 and frames.shape[2] > 0

    native = [peak_allocated_bytes(lambda z=z: decoder.decode(z, drain)) for z in (short, long)]
    diffusers = [peak_allocated_bytes(lambda z=z: reference(vae, z)) for z in (short, long)]
    assert native[1] == native[0], native
    assert diffusers[1] > 1.5 * diffusers[0], diffusers


# -- options ----------------------------------------------------------------------------------------------------------


def test_attention_backend_and_arguments_are_checked(media):
    vae = media[torch.float32].video_vae
    with pytest.raises(VflashError, match="unknown attention backend"):
        NativeVideoDecoder.from_vae(vae, attention="flash")
    with pytest.raises(VflashError, match="needs a CUDA device"):
        NativeVideoDecoder.from_vae(vae, attention="fa3")
    with pytest.raises(VflashError, match="windows_per_call"):
        NativeVideoDecoder.from_vae(vae, windows_per_call=0)
    with pytest.raises(VflashError, match="on at least one device"):
        NativeVideoDecoder(DecodeGeometry.from_vae(vae), [])
    with pytest.raises(VflashError, match=r"latents \(1, C, F, h, w\)"):
        NativeVideoDecoder.from_vae(vae).decode(torch.zeros(2, 8, 3, 1, 1))
    with pytest.raises(VflashError, match="too few"):
        NativeVideoDecoder.from_vae(vae).decode(torch.zeros(1, 8, 2, 1, 1))


def test_hooked_vae_is_refused(vae_root):
    from diffusers import AutoencoderKLMiniMaxH3

    vae = AutoencoderKLMiniMaxH3.from_pretrained(vae_root / "vae")
    vae.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with pytest.raises(VflashError, match="forward hook"):
        NativeVideoDecoder.from_vae(vae)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_media_vaes_native_decode_is_the_default_decode(vae_root, dtype):
    """The pipeline's decode stage with `video_decoder="native"` gives the default's frames bit for bit (2 tiles of
    256 px, 12 latent frames); the soundtrack is untouched."""
    default = MediaVAEs.from_pretrained(vae_root, dtype=dtype)
    native = MediaVAEs.from_pretrained(vae_root, dtype=dtype, video_decoder="native")
    # With a peer (the CPU again) and 4 tile-windows in one call, the peer decodes it all and the first device gathers.
    shared = MediaVAEs.from_pretrained(vae_root, dtype=dtype, video_decoder="native", peer_device="cpu")
    video = latents((1, 8, 12, 17, 5), seed=5)
    audio = latents((2, 8, 30), seed=6)
    expected = default.decode(video, audio)
    assert expected.frames.shape == (39, 272, 80, 3)
    for name, vaes in (("native", native), ("native with a peer", shared)):
        got = vaes.decode(video, audio)
        assert_bitwise(got.frames, expected.frames, f"{dtype} {name} frames")
        assert_bitwise(got.waveform, expected.waveform, f"{name} waveform")
    with pytest.raises(VflashError, match="video_decoder"):
        MediaVAEs.from_pretrained(vae_root, video_decoder="fast")
