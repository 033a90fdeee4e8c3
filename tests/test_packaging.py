"""The install ships every package folder: pyproject's explicit package list names each folder with an __init__.py
under vflash_core/, kernels/ and nodes/ (an editable install would hide a missing one; a wheel would not)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    listed = set(setuptools["packages"])
    found = set()
    for top, folder in {"vflash_core": ROOT / "vflash_core", **folder_of}.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([top, *init.parent.relative_to(folder).parts]))
    assert listed == found, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
