"""The named fast modes: the block selection, the block-sparse kernel against its masked dense reference, the
session's sparse attention and step cache on the tiny model, and the refusals.

The kernel runs in Triton's interpreter in a subprocess started with TRITON_INTERPRET=1 (so triton's own library
functions, `tl.max` and `tl.sum`, are decorated for the interpreter too), in fp16: the interpreter's bf16 arithmetic
is not the GPU's. The `gpu` test compares bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, assert_bitwise

from vflash_core import Geometry, NativeEngineSession, build_keyframe_bundle
from vflash_core.engine.artifact import CompiledPaths
from vflash_core.engine.engine_options import EngineOptions
from vflash_core.engine.fast_mode import FastMode
from vflash_core.engine.fast_mode_run import describe_fast_mode
from vflash_core.engine.model import sdpa_attention
from vflash_core.engine.sparse_attention import (
    BLOCK_ROWS,
    FLASH_ATTN4_BACKEND,
    MASKED_BACKEND,
    TRITON_BACKEND,
    BlockSparseAttention,
    attend_selected,
    cuda_sparse_backend,
    masked_attention,
    prepare_sparse_backend,
    rank_key_blocks_reference,
    select_key_blocks,
    sparse_backend,
    video_key_budget,
)
from vflash_core.errors import VflashError

ROOT = Path(__file__).resolve().parent.parent
HEIGHT, WIDTH, FRAMES = 256, 448, 124  # 4,144 generated video rows of the tiny model: 33 video blocks


def _qkv(rows: int, heads: int = 2, head_dim: int = 16, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, rows, heads, head_dim, generator=g).to(dtype) for _ in range(3))


# -- the selection ------------------------------------------------------------------------------------------------


def test_selection_keeps_prefix_local_blocks_and_respects_the_density_cap():
    rows, prefix_rows = 40 * BLOCK_ROWS + 50, 300  # ragged last block; the prefix ends inside block 2
    q, k, _ = _qkv(rows)
    sel = select_key_blocks(q, k, prefix_rows, density=0.35, mass=1.0, local_blocks=1)
    assert sel.blocks == 41 and sel.dense_query_blocks == 3
    mask = sel.block_mask()
    assert mask[:, :3].all(), "a query block holding a prefix row attends every key"
    assert mask[:, :, :3].all(), "every query block attends every prefix key block"
    for i in range(3, 41):
        for j in (i - 1, i, i + 1):
            if 3 <= j < 41:
                assert mask[:, i, j].all(), f"query block {i} keeps its neighbour {j}"
    kept_video = mask[:, 3:, 3:].sum(-1)
    # the map's 0.35 * 41 * 41 = 588.35 pairs less the 3 dense query blocks' 123 leave 12.2 a video query block, 3 of
    # them its prefix keys: 9 video key blocks each (mass 1.0: the budget decides)
    assert (kept_video == 9).all()
    assert sel.kv_counts.tolist() == (kept_video + 3).tolist()
    assert 0.35 - 1 / 41 < sel.kept_pairs / sel.total_pairs <= 0.35, "the density is that of the whole map"


def test_video_key_budget_spends_the_density_on_the_whole_map():
    assert video_key_budget(0.25, 299, 8) == 60  # 1344x768 5 s: (0.25 * 299^2 - 8 * 299) / 291 - 8 = 60.6
    assert video_key_budget(1.0, 299, 8) == 291, "full density: every video key block"
    assert video_key_budget(0.01, 299, 8) == 1, "below what the prefix takes: one block, the local ones still kept"
    for density in (0.15, 0.25, 0.5):
        blocks, prefix = 155, 8
        kept = prefix * blocks + (blocks - prefix) * (prefix + video_key_budget(density, blocks, prefix))
        assert density - 1 / blocks < kept / blocks**2 <= density


def test_selection_mass_threshold_keeps_the_dominant_block():
    rows = 20 * BLOCK_ROWS
    q, k, _ = _qkv(rows)
    # Every query shares a direction per head, and one key block points along it: that block holds most of the mass.
    direction = torch.randn(1, 1, 2, 16, generator=torch.Generator().manual_seed(9))
    q = q + direction
    k[:, 15 * BLOCK_ROWS : 16 * BLOCK_ROWS] = direction * 5
    sel = select_key_blocks(q, k, BLOCK_ROWS, density=0.5, mass=0.5, local_blocks=0)
    mask = sel.block_mask()
    assert mask[:, 1:, 15].all(), "the block with most of the pooled mass is kept by every query block"
    # mass 0.5 is reached by it alone: apart from the diagonal, nothing else
    assert int(mask[:, 1:, 1:].sum(-1).max()) <= 2


def test_ranking_breaks_ties_toward_the_lower_block_and_counts_forced_mass():
    # one head, 6 video blocks; query block 0 keeps its own block (forced), then blocks 1-3 tie at 0.25
    probabilities = torch.tensor([[[0.125, 0.25, 0.25, 0.25, 0.125, 0.0]] * 6])
    kv_blocks, kv_counts = rank_key_blocks_reference(probabilities, prefix=2, budget=3, mass=1.0, local_blocks=0)
    assert kv_blocks[0, 0].tolist() == [0, 1, 2, 3, 4], "the prefix blocks, forced 0, then the two lowest of the tie"
    assert kv_counts[0, 0] == 5
    # mass 0.375: blocks 0 and 1 rank above block 2 with 0.375 (not below it), so 2 is dropped; a marker follows
    kv_blocks, kv_counts = rank_key_blocks_reference(probabilities, prefix=2, budget=3, mass=0.375, local_blocks=0)
    assert kv_blocks[0, 0].tolist() == [0, 1, 2, 3, 8] and kv_counts[0, 0] == 4


def test_full_density_equals_dense_attention():
    q, k, v = _qkv(5 * BLOCK_ROWS + 7)
    sel = select_key_blocks(q, k, 200, density=1.0, mass=1.0, local_blocks=0)
    assert sel.kept_pairs == sel.total_pairs
    dense = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v))).permute(0, 2, 1, 3)
    torch.testing.assert_close(masked_attention(q, k, v, sel), dense, atol=1e-6, rtol=1e-5)


def test_attention_is_dense_until_armed():
    calls = []
    dense = lambda q, k, v: calls.append(q.shape) or q
    attention = BlockSparseAttention(dense, density=0.25, mass=0.9, local_blocks=1)
    q, k, v = _qkv(4 * BLOCK_ROWS)
    assert attention(q, k, v) is q and attention.dense_calls == 1 and attention.sparse_calls == 0
    attention.arm(BLOCK_ROWS)
    out = attention(q, k, v)
    assert out.shape == q.shape and attention.sparse_calls == 1 and len(calls) == 1
    assert 0 < attention.density_reached() < 1


def test_the_first_sparse_call_waits_for_the_preparation_and_runs_after_a_failed_one(monkeypatch, caplog):
    from vflash_core.engine import sparse_attention

    started = threading.Event()
    release = threading.Event()
    finished = []

    def prepare(device, head_dim, dense):
        started.set()
        release.wait(10)
        finished.append(head_dim)
        raise RuntimeError(f"no kernel for {head_dim}")

    monkeypatch.setattr(sparse_attention, "prepare_sparse_backend", prepare)
    caplog.set_level(logging.WARNING, logger="vflash_core.engine.sparse_attention")
    attention = BlockSparseAttention(lambda q, k, v: q, density=0.25, mass=0.9, local_blocks=1)
    attention.prepare(torch.device("cpu"), 16)
    attention.prepare(torch.device("cpu"), 32)  # once per attention
    assert started.wait(10)
    q, k, v = _qkv(4 * BLOCK_ROWS)
    assert attention(q, k, v) is q and not finished, "dense calls do not wait"
    attention.arm(BLOCK_ROWS)
    release.set()
    out = attention(q, k, v)
    assert finished == [16], "the sparse call waited for the preparation"
    assert out.shape == q.shape and attention.sparse_calls == 1 and attention.backend == MASKED_BACKEND
    assert [r.getMessage() for r in caplog.records] == [
        ("sparse-attention on cpu: preparing the sparse backend failed (RuntimeError: no kernel for 16); the first "
         "sparse call pays its first use")]


# -- the kernel in the interpreter ----------------------------------------------------------------------------------


def test_kernel_matches_the_masked_reference_in_the_interpreter():
    """fp16 (1, 5 blocks + 19 rows, 2 heads, 64): dense leading query blocks, listed blocks, a ragged last block; and
    an all-dense selection; then a sequence of whole blocks (nothing masked). Each with the dense query blocks in the
    kernel and handed to a dense attention function."""
    script = textwrap.dedent("""
        import json, torch
        from vflash_kernels.block_sparse_attention import block_sparse_attention
        from vflash_core.engine.model import sdpa_attention
        from vflash_core.engine.sparse_attention import masked_attention, select_key_blocks
        g = torch.Generator().manual_seed(3)
        calls = []
        def dense(q, k, v):
            calls.append(q.shape[1])
            return sdpa_attention(q.float(), k.float(), v.float()).to(q.dtype)
        q, k, v = (torch.randn(1, 5 * 128 + 19, 2, 64, generator=g).half() for _ in range(3))
        diffs = []
        whole = tuple(t[:, : 5 * 128].contiguous() for t in (q, k, v))
        for (q, k, v), prefix_rows, density in (((q, k, v), 200, 0.4), (whole, 200, 0.5), ((q, k, v), 5 * 128 + 19, 1.0)):
            sel = select_key_blocks(q, k, prefix_rows, density, 1.0, 0)
            assert (sel.kv_blocks[..., 1:] >= sel.kv_blocks[..., :-1]).all(), "the lists ascend"
            ref = masked_attention(q.float(), k.float(), v.float(), sel)
            for dense_fn in (None, dense):
                out = block_sparse_attention(q, k, v, sel.kv_blocks, sel.kv_counts, sel.dense_query_blocks, dense_fn)
                diffs.append(float((out.float() - ref).abs().max()))
        full = torch.nn.functional.scaled_dot_product_attention(*(t.float().permute(0, 2, 1, 3) for t in (q, k, v)))
        print(json.dumps({"diffs": diffs, "sparse_vs_dense": float((out.float() - full.permute(0, 2, 1, 3)).abs().max()),
                          "dense_rows": calls}))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(result["diffs"]) < 2e-3, result  # fp16 operands, fp32 accumulation on both sides
    assert result["sparse_vs_dense"] < 2e-3, "the all-dense selection is dense attention"
    assert result["dense_rows"] == [256, 256, 5 * 128 + 19], "the dense query blocks' rows, ragged at the end"


def test_ranking_kernel_matches_its_reference_in_the_interpreter():
    """Probabilities on a 2^-20 grid (every order of summing them is exact) with ties, budgets below and above the
    forced blocks, masses that stop early, a single block and rows that are not a power of two long."""
    script = textwrap.dedent("""
        import json, torch
        from vflash_kernels.block_selection import rank_key_blocks
        from vflash_core.engine.sparse_attention import rank_key_blocks_reference
        g = torch.Generator().manual_seed(0)
        cases = []
        for video, prefix, budget, mass, local, grid in ((1, 3, 1, 1.0, 1, 20), (5, 2, 3, 1.0, 1, 20),
                                                          (37, 3, 9, 0.5, 1, 20), (37, 0, 5, 0.3, 0, 8),
                                                          (64, 4, 70, 1.0, 2, 20), (100, 8, 2, 0.9, 1, 20),
                                                          (70, 1, 30, 0.95, 3, 6)):
            p = (torch.randn(2, video, video, generator=g) * 3).softmax(-1)
            p = (p * 2**grid).round() / 2**grid  # grid 6 and 8: many ties
            kernel, reference = rank_key_blocks(p, prefix, budget, mass, local), rank_key_blocks_reference(p, prefix, budget, mass, local)
            cases.append(torch.equal(kernel[0], reference[0]) and torch.equal(kernel[1], reference[1]))
        print(json.dumps(cases))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True] * 7


# -- the options ----------------------------------------------------------------------------------------------------


def test_cuda_backend_is_flash_attn4_only_on_hopper_where_installed(monkeypatch, caplog):
    """The rule, without a GPU: FlashAttention-4 on sm90 at head widths its 128-row tiles serve, when it imports;
    the Triton kernel otherwise, and on Hopper a one-time hint that flash-attn-4 would be faster."""
    from vflash_core.engine import sparse_attention

    monkeypatch.setattr(sparse_attention, "_flash_attn4", lambda: (object(), object()))
    assert cuda_sparse_backend((9, 0), 128) == FLASH_ATTN4_BACKEND
    assert cuda_sparse_backend((9, 0), 64) == FLASH_ATTN4_BACKEND
    for capability, head_dim in (((9, 0), 256), ((9, 0), 120), ((8, 0), 128), ((8, 9), 128), ((10, 0), 128),
                                 ((12, 0), 128)):
        assert cuda_sparse_backend(capability, head_dim) == TRITON_BACKEND, (capability, head_dim)
    monkeypatch.setattr(sparse_attention, "_flash_attn4", lambda: None)
    sparse_attention._say_flash_attn4_is_missing.cache_clear()
    with caplog.at_level(logging.INFO, logger="vflash_core.engine.sparse_attention"):
        assert cuda_sparse_backend((9, 0), 128) == TRITON_BACKEND
        assert cuda_sparse_backend((9, 0), 128) == TRITON_BACKEND
    hints = [r.getMessage() for r in caplog.records if r.name == "vflash_core.engine.sparse_attention"]
    assert len(hints) == 1 and "flash-attn-4 is not installed" in hints[0], hints  # said once a process
    assert sparse_backend(torch.zeros(1, 4, 2, 128)) == MASKED_BACKEND


def test_flash_attn4_compile_warning_is_hidden_and_no_other():
    """The one warning flash-attn-4's Hopper forward prints on each compile (as its 4.0.0b40 prints it) is hidden once
    flash-attn-4 is imported; the CUDA DSL's same warning about another argument still shows."""
    from vflash_core.engine import sparse_attention

    kernel = "cutlass___call___flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__Tensorgmemoi64i64i641"
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        sparse_attention._quiet_flash_attn4_compile_warning()
        for argument in ("aux_data (position 17)", "scale (position 3)"):
            warnings.warn(f"Argument {argument} cannot be converted to a JitArgument for function '{kernel}'. If it is a "
                          f"compile-time constant, annotate it", UserWarning, stacklevel=1)
    assert [str(w.message)[:27] for w in shown] == ["Argument scale (position 3)"]


def test_fast_mode_names_and_refusals():
    assert FastMode.parse(None).exact and FastMode.parse("exact").exact and FastMode.parse("").exact
    both = FastMode.parse("sparse-attention+step-cache")
    assert both.sparse_attention and both.step_cache and both.name == "sparse-attention+step-cache"
    assert FastMode.parse("step-cache, sparse-attention").modes == ("step-cache", "sparse-attention")
    with pytest.raises(VflashError, match="unknown fast mode 'teacache'"):
        FastMode.parse("teacache")
    with pytest.raises(VflashError, match="exact runs no fast mode, so it does not combine with one: got 'exact"):
        FastMode.parse("exact+sparse-attention")
    with pytest.raises(VflashError, match="sparse_density must be a number above 0 and at most 1"):
        FastMode.parse("sparse-attention", sparse_density=1.5)
    with pytest.raises(VflashError, match="step-cache runs on one GPU"):
        FastMode.parse("step-cache").check_placement(2, "sequence-head")
    with pytest.raises(VflashError, match="not with tensor"):
        FastMode.parse("sparse-attention").check_placement(2, "tensor")
    assert set(both.settings()) == {"sparse_density", "sparse_mass", "sparse_local_blocks", "sparse_dense_edge_layers",
                                    "sparse_dense_evaluations", "step_cache_threshold", "step_cache_warmup"}


def test_setting_flags_reach_their_mode_and_the_defaults_stand_without_them():
    parser = argparse.ArgumentParser()
    FastMode.add_arguments(parser)
    both = FastMode.from_arguments(parser.parse_args(
        ["--fast-mode", "sparse-attention+step-cache", "--sparse-density", "0.2", "--step-cache-threshold", "0.3"]))
    assert (both.sparse_density, both.step_cache_threshold) == (0.2, 0.3)
    assert FastMode.from_arguments(parser.parse_args(["--fast-mode", "sparse-attention"])) == FastMode(
        ("sparse-attention",))
    assert FastMode.from_arguments(parser.parse_args([])) == FastMode()


def test_a_report_without_sparse_calls_names_no_backend():
    """Where every layer ran dense (a stack no deeper than its dense edge layers), no backend or density is named."""
    report = {"modes": ["sparse-attention"], "block_evaluations": 8, "block_evaluations_exact": 8,
              "sparse_attention": {"backend": None, "sparse_calls": 0, "dense_calls": 8, "density_reached": None}}
    assert describe_fast_mode(report) == (
        "approximate fast mode sparse-attention: 0 sparse attention calls, 8 dense, 8 of 8 block evaluations")


# -- the session on the tiny model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle():
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(6, TINY.text_dim, generator=g).to(torch.bfloat16)
    return build_keyframe_bundle(embeds, torch.ones(6, dtype=torch.long), Geometry(HEIGHT, WIDTH, FRAMES), TINY,
                                 torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def exact(tiny_compiled, bundle):
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled)) as session:
        return session.generate(bundle)


def test_sparse_attention_session_reports_what_ran(tiny_compiled, bundle, exact, caplog):
    caplog.set_level(logging.INFO, logger="vflash_core.engine.sparse_attention")
    mode = FastMode(("sparse-attention",), sparse_density=0.2, sparse_dense_edge_layers=0)
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(fast_mode=mode)) as session:
        result = session.generate(bundle)
        again = session.generate(bundle)
    report = result.metadata["fast_mode"]["sparse_attention"]
    assert result.metadata["exact"] is False and exact.metadata["exact"] is True
    assert report["sparse_calls"] == 3 * TINY.num_layers, "evaluation 0 dense, every layer of the 3 others sparse"
    assert report["dense_calls"] == TINY.num_layers, "the main blocks of evaluation 0 (the text refiner not counted)"
    assert report["backend"] == "masked-sdpa" and 0.1 < report["density_reached"] < 0.6
    assert result.metadata["fast_mode"]["settings"]["sparse_density"] == 0.2
    layers = TINY.num_layers
    assert describe_fast_mode(result.metadata["fast_mode"]) == (
        f"approximate fast mode sparse-attention: {3 * layers} sparse attention calls (masked-sdpa, density "
        f"{report['density_reached']:.2f}), {layers} dense, {4 * layers} of {4 * layers} block evaluations")
    assert torch.isfinite(result.video_latents).all()
    assert not torch.equal(result.video_latents, exact.video_latents), "sparse attention changes the trajectory"
    assert_bitwise(again.video_latents, result.video_latents, "a second request of the same session")
    prepared = [r.getMessage() for r in caplog.records if "prepared while the weights load" in r.getMessage()]
    assert len(prepared) == 1 and re.fullmatch(r"sparse-attention on cpu: the kept blocks run in masked-sdpa \(ready "
                                               r"in \d+\.\d s, prepared while the weights load\)", prepared[0])
    rel = float((result.video_latents - exact.video_latents).norm() / exact.video_latents.norm())
    assert rel < 0.5


def test_sparse_attention_at_full_density_stays_close_to_exact(tiny_compiled, bundle, exact):
    mode = FastMode(("sparse-attention",), sparse_density=1.0, sparse_mass=1.0, sparse_dense_edge_layers=0)
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(fast_mode=mode)) as session:
        result = session.generate(bundle)
    assert result.metadata["fast_mode"]["sparse_attention"]["density_reached"] == 1.0
    torch.testing.assert_close(result.video_latents, exact.video_latents, atol=2e-2, rtol=2e-2)


def test_dense_edge_layers_and_evaluations_leave_nothing_sparse(tiny_compiled, bundle, exact):
    mode = FastMode(("sparse-attention",), sparse_dense_edge_layers=1)  # the tiny model's 2 layers are both edges
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(fast_mode=mode)) as session:
        result = session.generate(bundle)
    assert result.metadata["fast_mode"]["sparse_attention"]["sparse_calls"] == 0
    assert result.metadata["fast_mode"]["sparse_attention"]["density_reached"] is None
    assert_bitwise(result.video_latents, exact.video_latents, "no sparse layer: the exact trajectory")


@pytest.mark.parametrize("residency", ["resident", "block-ring"])
def test_step_cache_skips_and_reports(tiny_compiled, bundle, exact, residency):
    mode = FastMode(("step-cache",), step_cache_threshold=10.0, step_cache_warmup=1)
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(fast_mode=mode, weight_residency=residency)) as session:
        result = session.generate(bundle)
    report = result.metadata["fast_mode"]
    # evaluation 0 has nothing to compare with; 1 reuses; 2 follows a reused one; 3 is the last
    assert report["step_cache"]["evaluations_cached"] == [1]
    layers = TINY.num_layers
    assert report["block_evaluations"] == 4 * layers - (layers - 1) and report["block_evaluations_exact"] == 4 * layers
    assert not torch.equal(result.video_latents, exact.video_latents)


def test_fast_modes_stream_weights_as_they_run_resident(tiny_compiled, bundle):
    """Both fast modes at once, with the blocks resident, in a ring of two device slots, and read from their files on
    every pass: the weights' residency changes where a block's weights come from, never what the modes compute."""
    mode = FastMode(("sparse-attention", "step-cache"), sparse_density=0.2, sparse_dense_edge_layers=0,
                    step_cache_threshold=10.0, step_cache_warmup=1)
    results = {}
    for residency in ("resident", "block-ring", "disk-ring"):
        with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(fast_mode=mode, weight_residency=residency)) as session:
            results[residency] = session.generate(bundle)
    resident = results["resident"]
    assert resident.metadata["fast_mode"]["sparse_attention"]["sparse_calls"] > 0
    assert resident.metadata["fast_mode"]["step_cache"]["evaluations_cached"] == [1]
    for residency in ("block-ring", "disk-ring"):
        got = results[residency]
        assert got.metadata["weight_residency"] == residency
        assert got.metadata["fast_mode"] == resident.metadata["fast_mode"], residency
        assert_bitwise(got.video_latents, resident.video_latents, f"{residency} vs resident under both fast modes")
        assert_bitwise(got.audio_latents, resident.audio_latents, f"{residency} vs resident audio")


def test_step_cache_that_never_reuses_is_exact(tiny_compiled, bundle, exact):
    mode = FastMode(("step-cache",), step_cache_threshold=1e-9)
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**tiny_compiled), EngineOptions(fast_mode=mode)) as session:
        result = session.generate(bundle)
    assert result.metadata["fast_mode"]["step_cache"]["evaluations_cached"] == []
    assert_bitwise(result.video_latents, exact.video_latents, "video latents")
    assert_bitwise(result.audio_latents, exact.audio_latents, "audio latents")


def test_step_cache_on_a_16_evaluation_profile(tmp_path_factory, tiny_transformer, bundle):
    from conftest import compile_tiny

    compiled = compile_tiny(tmp_path_factory.mktemp("c16"), tiny_transformer, "t2va-base16-exact-cpu")
    mode = FastMode(("step-cache",), step_cache_threshold=10.0)
    with NativeEngineSession("t2va-base16-exact-cpu", CompiledPaths(**compiled), EngineOptions(fast_mode=mode)) as session:
        report = session.generate(bundle).metadata["fast_mode"]
    assert report["step_cache"]["evaluations_cached"] == [2, 4, 6, 8, 10, 12, 14]
    assert len(report["step_cache"]["first_block_change"]) == 16
    layers = TINY.num_layers  # a reusing evaluation runs the first block only
    assert describe_fast_mode(report) == (f"approximate fast mode step-cache: reused 7 of 16 evaluations, "
                                          f"{16 * layers - 7 * (layers - 1)} of {16 * layers} block evaluations")


def test_sparse_attention_with_sequence_head_equals_one_device(tmp_path_factory):
    """Two CPU ranks (Gloo) split the heads: each selects for its own heads over the whole sequence, so the result is
    the single device's, bit for bit."""
    from dataclasses import replace

    from conftest import compile_tiny

    from vflash_core.weights import synthetic

    wide = replace(TINY, num_attention_heads=4)
    folder = tmp_path_factory.mktemp("wide4")
    synthetic.write_diffusers_transformer(folder / "transformer", wide,
                                          synthetic.random_internal_weights(wide, seed=2, dtype=torch.bfloat16))
    compiled = compile_tiny(folder, folder / "transformer", "t2va-base4-exact-cpu")
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(6, wide.text_dim, generator=g).to(torch.bfloat16)
    bundle = build_keyframe_bundle(embeds, torch.ones(6, dtype=torch.long), Geometry(HEIGHT, WIDTH, FRAMES), wide, g)
    mode = FastMode(("sparse-attention",), sparse_density=0.2, sparse_dense_edge_layers=0)
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**compiled), EngineOptions(fast_mode=mode)) as single:
        expected = single.generate(bundle)
    with NativeEngineSession("t2va-base4-exact-cpu", CompiledPaths(**compiled), EngineOptions(fast_mode=mode, peer_device="cpu", strategy="sequence-head")) as group:
        got = group.generate(bundle)
    assert_bitwise(got.video_latents, expected.video_latents, "video latents")
    assert got.metadata["fast_mode"]["sparse_attention"]["density_reached"] == pytest.approx(
        expected.metadata["fast_mode"]["sparse_attention"]["density_reached"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ranking_kernel_on_cuda_matches_its_reference():
    """H3's 1344x768 5 s map (8 prefix and 291 video blocks, 56 heads): list for list on a 2^-20 grid of probabilities;
    on the raw ones, only where a block's mass lands within rounding of the threshold can the two differ."""
    from vflash_kernels.block_selection import rank_key_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    raw = (torch.randn(56, 291, 291, device="cuda", generator=g) * 2).softmax(-1)
    for mass in (1.0, 0.9):
        for p in ((raw * 2**20).round() / 2**20, raw):
            kernel = rank_key_blocks(p, 8, 60, mass, 1)
            reference = rank_key_blocks_reference(p.cpu(), 8, 60, mass, 1)
            same = (kernel[1].cpu() == reference[1]).float().mean()
            if p is raw and mass < 1.0:
                assert same > 0.999, float(same)
            else:
                assert torch.equal(kernel[0].cpu(), reference[0]) and torch.equal(kernel[1].cpu(), reference[1]), mass


def _bf16_cases_on_cuda():
    """The GPU tests' inputs at H3's head width: 8 heads x 128, 4,171 rows (33 blocks, the last ragged), with the
    selection the mode runs at densities 0.15 / 0.5 / 1.0, then at 0.25 with v as the fused projection's view (row
    stride 3I), as the blocks hand it over. Yields (density, q, k, v, selection, the masked fp32 reference)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4171, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    cases = [(density, q, k, v) for density in (0.15, 0.5, 1.0)]
    qkv = torch.randn(1, 4171, 3 * 8 * 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cases.append((0.25, *(t.unflatten(-1, (8, 128)) for t in qkv.split(8 * 128, dim=-1))))
    for density, q, k, v in cases:
        sel = select_key_blocks(q, k, 600, density, 0.9, 1)
        yield density, q, k, v, sel, masked_attention(q.float(), k.float(), v.float(), sel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_matches_the_masked_reference_bf16():
    """The Triton kernel on `_bf16_cases_on_cuda`: the dense query blocks in the kernel, and (the contiguous inputs)
    in cuDNN/flash SDPA."""
    from vflash_kernels.block_sparse_attention import block_sparse_attention

    for density, q, k, v, sel, ref in _bf16_cases_on_cuda():
        for dense in (None, sdpa_attention) if v.is_contiguous() else (None,):
            out = block_sparse_attention(q, k, v, sel.kv_blocks, sel.kv_counts, sel.dense_query_blocks, dense)
            assert float((out.float() - ref).abs().max()) < 1e-2, density  # bf16 operands and output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attn4_block_sparse_matches_the_masked_reference_bf16():
    """FlashAttention-4's block-sparse forward, where the mode picks it (Hopper with flash-attn-4 installed), on the
    Triton kernel's cases (`_bf16_cases_on_cuda`), the dense query blocks in cuDNN/flash SDPA."""
    if sparse_backend(torch.zeros(1, 8, 2, 128, device="cuda", dtype=torch.bfloat16)) != FLASH_ATTN4_BACKEND:
        pytest.skip("the mode runs flash-attn-4 only on Hopper, with flash-attn-4 installed")
    cases = list(_bf16_cases_on_cuda())
    for density, q, k, v, sel, ref in cases:
        out = attend_selected(q, k, v, sel, sdpa_attention, FLASH_ATTN4_BACKEND)
        assert float((out.float() - ref).abs().max()) < 1e-2, density  # bf16 operands and output
    # a selection whose query blocks all hold prefix rows leaves nothing to the block-sparse forward
    _, q, k, v, _, _ = cases[0]
    sel = select_key_blocks(q, k, q.shape[1], 0.25, 0.9, 1)
    out = attend_selected(q, k, v, sel, sdpa_attention, FLASH_ATTN4_BACKEND)
    assert torch.equal(out, sdpa_attention(q, k, v))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_preparing_compiles_the_kernel_the_requests_run():
    """`prepare_sparse_backend`'s small call compiles the flash-attn-4 kernel a request's call at H3's head count and
    another length runs: that call compiles nothing more. The in-memory cache starts empty, so that kernels the tests
    before this one compiled cannot stand in for the preparation's."""
    x = torch.zeros(1, 8, 2, 128, device="cuda", dtype=torch.bfloat16)
    if sparse_backend(x) != FLASH_ATTN4_BACKEND:
        pytest.skip("the mode runs flash-attn-4 only on Hopper, with flash-attn-4 installed")
    from flash_attn.cute.interface import _flash_attn_fwd

    _flash_attn_fwd.compile_cache.clear()
    assert prepare_sparse_backend(torch.device("cuda"), 128, sdpa_attention) == FLASH_ATTN4_BACKEND
    compiled = set(_flash_attn_fwd.compile_cache.cache)
    assert compiled, "the preparation compiled a kernel"
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 9001, 56, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    attend_selected(q, k, v, select_key_blocks(q, k, 700, 0.25, 0.9, 1), sdpa_attention, FLASH_ATTN4_BACKEND)
    assert set(_flash_attn_fwd.compile_cache.cache) == compiled
