"""What the bad-input tests share: a refusal through `vflash` in-process as its one error line, a guard that no model
starts loading, and the files a folder holds (nothing may be written for a refused request)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vflash_core.cli.main import main
from vflash_core.pipeline import h3_pipeline as pipeline_module


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything starts loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a request that must be refused before loading")

    for part in (pipeline_module.TextConditioner, pipeline_module.MediaVAEs):
        monkeypatch.setattr(part, "from_pretrained", refuse)


def refused(capsys, argv: list[str], status: int = 2) -> str:
    """Run `vflash argv` in-process; return its one error line (asserting the status and that there is one line)."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == status, err
    assert len(lines) == 1 and lines[0].startswith("vflash: error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("vflash: error: ")


def files_in(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*"))
