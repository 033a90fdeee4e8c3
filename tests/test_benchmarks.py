"""What the full-size benchmarks got wrong on the H200 once, checked on the CPU (the benchmarks' own code)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from end_to_end import BITWISE_ATTENTION, Run
from full_family import StagedFamily

from vflash_core.engine.attention_backends import BACKENDS
from vflash_core.weights.family import DEMO_FAMILY


def test_a_resumed_staging_counts_the_compile_it_made_as_its_own(tmp_path):
    """A second run on the staged machine was refused: the compile on the disk counted against the plan's free space."""
    staged = StagedFamily(tmp_path / "work", tmp_path / "shm", replace(DEMO_FAMILY, text_layers_written=50), "cpu")
    before = staged.plan().disk_free
    staged.compiled.mkdir(parents=True)
    (staged.compiled / "block_000.safetensors").write_bytes(b"\1" * (64 << 20))
    assert abs(staged.plan().disk_free - before) < (16 << 20), "the compile's bytes count as used space the plan does not know"


def test_the_bitwise_comparison_names_an_attention_backend_the_session_knows():
    assert BITWISE_ATTENTION in BACKENDS


def test_a_skipped_phase_keeps_what_an_earlier_run_measured_with_its_commit(tmp_path):
    """A session too short for the whole set re-runs some phases; the result file must still hold the others."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({
        "commit": "abc", "phases": {"vflash_block_ring": {"initialization_seconds": 84.7}, "bitwise": {"error": "broke"},
                                    "vflash_resident": {"measured_at_commit": "def"}},
        "stage_digests": {"1344x768": {"frames": "0f"}}, "bitwise_equal_to_diffusers": False,
        "requests": [{"side": "vflash", "config": "block_ring", "elapsed_seconds": 38.9},
                     {"side": "vflash", "config": "resident", "elapsed_seconds": 40.5}],
    }))
    run = Run("carried", deadline=0.0, small=True, skip=("vflash_block_ring", "bitwise", "vflash_resident"))
    run.carry_skipped(earlier, "requests", lambda r: f"vflash_{r['config']}",
                      {"bitwise": ("bitwise_equal_to_diffusers",), "vflash_resident": ("stage_digests",)})
    with run.phase("vflash_block_ring", 1) as rec:
        assert rec is None
    with run.phase("bitwise", 1) as rec:
        assert rec is None
    assert run.data["phases"]["vflash_block_ring"] == {"initialization_seconds": 84.7, "measured_at_commit": "abc"}
    assert run.data["phases"]["bitwise"] == {"skipped": "--skip"}, "a failed phase is not carried"
    assert run.data["requests"] == [
        {"side": "vflash", "config": "block_ring", "elapsed_seconds": 38.9, "measured_at_commit": "abc"},
        {"side": "vflash", "config": "resident", "elapsed_seconds": 40.5, "measured_at_commit": "def"},
    ]
    assert run.data["stage_digests"] == {"1344x768": {"frames": "0f"}}, "a carried phase keeps the results it wrote at the top level"
    assert "bitwise_equal_to_diffusers" not in run.data, "a failed phase's top-level result is not carried"


def test_an_evaluation_run_at_another_density_keeps_the_default_records_and_labels_its_own(tmp_path):
    """A run of the evaluation phase at a lower `--sparse-density` must not replace the default cap's records (the
    speed targets are judged on those), and its results must say which cap they were measured at."""
    from fast_mode import kept_records, summarize

    def evaluation(seconds, cap, speedup):
        return {"phase": "evaluation", "seconds": seconds, "density_cap": cap, "evaluation_speedup_vs_exact": speedup}

    earlier = tmp_path / "fast_mode_h100.json"
    earlier.write_text(json.dumps({"commit": "abc", "records": [evaluation(5, 0.25, 1.56), evaluation(15, 0.25, 2.03)]}))
    kept = kept_records(earlier, ["evaluation"], [15], [0.2])
    assert [(r["seconds"], r["density_cap"], r["measured_at_commit"]) for r in kept] == [(5, 0.25, "abc"), (15, 0.25, "abc")]
    assert [r["seconds"] for r in kept_records(earlier, ["evaluation"], [15], [0.25, 0.2])] == [5], "re-measured: replaced"
    assert summarize([*kept, evaluation(15, 0.2, 2.2)])["evaluation_speedup_vs_exact"] == {
        "1344x768 5 s": 1.56, "1344x768 15 s": 2.03, "1344x768 15 s, density 0.2": 2.2}
