"""The linter and the type checker, run from the test suite so that `pytest -q` (what CI runs) runs them too.

ruff checks `vflash_core`, `nodes`, `kernels`, `tests` and `benchmarks` with the rules of `pyproject.toml` (120 columns
in the product; the tests and benchmarks are exempt from the line length only); mypy checks the packages `vflash_core`,
`vflash_kernels` and `vflash_nodes` with its `[tool.mypy]` settings (ComfyUI's own modules, which the node pack imports,
are missing imports there). Each test fails with the tool's own report.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (it comes with the test extra: pip install -e '.[test]')")


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    _require("ruff")
    folders = ["vflash_core", "nodes", "kernels", "tests", "benchmarks"]
    result = _run([sys.executable, "-m", "ruff", "check", "--no-fix", *folders])
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"


def test_mypy_finds_nothing(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    _require("mypy")
    # The kernels and nodes folders are imported as `vflash_kernels` and `vflash_nodes` (pyproject's package-dir),
    # names mypy cannot find on disk: a folder holding a link of each name to its folder goes on MYPYPATH. mypy's
    # cache lives beside pytest's (a run on a fresh clone, as in CI, starts without one) or, without pytest's cache,
    # in this run's temporary folder.
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    work = cache.mkdir("mypy") if cache is not None else tmp_path_factory.mktemp("mypy")
    search_path = work / "path"
    search_path.mkdir(exist_ok=True)
    links = {search_path / "vflash_kernels": ROOT / "kernels", search_path / "vflash_nodes": ROOT / "nodes"}
    for link, folder in links.items():
        if not (link.is_symlink() and link.resolve() == folder):
            link.unlink(missing_ok=True)
            link.symlink_to(folder, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(search_path)}
    command = [
        sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(work / "cache"),
        "-p", "vflash_core", "-p", "vflash_kernels", "-p", "vflash_nodes",
    ]
    result = _run(command, env)
    report = result.stdout + result.stderr
    for link, folder in links.items():  # the report names the files by their links: absolute, or under ROOT relative
        report = report.replace(str(link), folder.name)
        if link.is_relative_to(ROOT):
            report = report.replace(str(link.relative_to(ROOT)), folder.name)
    assert result.returncode == 0, f"mypy found errors:\n{report}"
