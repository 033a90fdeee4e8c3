"""What the full-size benchmarks got wrong on the H200 once, checked on the CPU (the benchmarks' own code)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from end_to_end import BITWISE_ATTENTION  # noqa: E402
from full_family import StagedFamily  # noqa: E402

from vflash_core.engine.attention import BACKENDS  # noqa: E402
from vflash_core.weights.family import DEMO_FAMILY  # noqa: E402


def test_a_resumed_staging_counts_the_compile_it_made_as_its_own(tmp_path):
    """A second run on the staged machine was refused: the compile on the disk counted against the plan's free space."""
    staged = StagedFamily(tmp_path / "work", tmp_path / "shm", replace(DEMO_FAMILY, text_layers_written=50), "cpu")
    before = staged.plan().disk_free
    staged.compiled.mkdir(parents=True)
    (staged.compiled / "block_000.safetensors").write_bytes(b"\1" * (64 << 20))
    assert abs(staged.plan().disk_free - before) < (16 << 20), "the compile's bytes count as used space the plan does not know"


def test_the_bitwise_comparison_names_an_attention_backend_the_session_knows():
    assert BITWISE_ATTENTION in BACKENDS
