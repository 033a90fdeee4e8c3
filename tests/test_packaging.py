"""The install ships every package folder: pyproject's explicit package list names each folder with an __init__.py
under vflash_core/, kernels/ and nodes/ (an editable install would hide a missing one; a wheel would not)."""

import ast
import importlib
import json
import re
import subprocess
import sys
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


def test_run_from_a_checkout_the_kernels_folder_does_not_shadow_the_pypi_kernels_package():
    """`python -m vflash_core...` (or `-c`) in the repository root puts the root first on sys.path, where `kernels/`
    would be the top-level `kernels` that transformers imports; importing vflash_core takes the root off the path."""
    probe = (
        "import importlib.util, json, sys; import vflash_core; spec = importlib.util.find_spec('kernels'); "
        "print(json.dumps([sys.path, spec.origin if spec else None]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    path, origin = json.loads(out)
    assert all(Path(entry or ".").resolve() != ROOT for entry in path), path
    assert origin is None or Path(origin).resolve() != ROOT / "kernels" / "__init__.py", origin


# -- the public surface ----------------------------------------------------------------------------------------------


def _public_modules() -> list[tuple[str, Path]]:
    """Every vflash_core module but the private ones (a leading underscore), as (dotted name, file)."""
    modules = []
    for path in sorted((ROOT / "vflash_core").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            modules.append((".".join(parts), path))
    return modules


def _defined_public_names(path: Path) -> list[str]:
    """Names a module's top level defines (functions, classes, assignments), without underscore names."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return [name for name in names if not name.startswith("_")]


def test_every_public_module_declares_its_names_and_each_exists():
    """A module that defines public names says which are its API in `__all__`; every name listed there exists (a
    renamed function cannot leave a stale entry) and is listed once."""
    undeclared = []
    for name, path in _public_modules():
        module = importlib.import_module(name)
        if not hasattr(module, "__all__"):
            if _defined_public_names(path):
                undeclared.append(name)
            continue
        exported = module.__all__
        assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
        missing = [export for export in exported if not hasattr(module, export)]
        assert not missing, f"{name}.__all__ names what the module does not hold: {missing}"
    assert not undeclared, f"modules without __all__: {undeclared}"


def test_the_root_package_exports_the_user_facing_names():
    """`from vflash_core import H3Pipeline, VideoRequest, RunOptions, ...` is the same objects as the defining modules,
    and every error type of the request path (a `VflashError` subclass of errors, fileio or the pipeline) is there."""
    import vflash_core
    from vflash_core import errors, fileio
    from vflash_core.engine.session import NativeEngineSession
    from vflash_core.pipeline import h3_pipeline
    from vflash_core.pipeline.options import RunOptions
    from vflash_core.profiles import get_profile

    expected = {"H3Pipeline": h3_pipeline.H3Pipeline, "VideoRequest": h3_pipeline.VideoRequest, "VideoResult": h3_pipeline.VideoResult,
                "RunOptions": RunOptions, "NativeEngineSession": NativeEngineSession, "get_profile": get_profile}
    for module in (errors, fileio, h3_pipeline):
        expected.update({n: v for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, errors.VflashError)})
    assert {"VflashError", "RequestError", "RunFailedError", "OutputExistsError", "RequestCancelled"} <= set(expected)
    for name, value in expected.items():
        assert name in vflash_core.__all__ and getattr(vflash_core, name) is value, name
    assert [n for n in vflash_core.__all__ if not hasattr(vflash_core, n)] == []


def _documented_imports() -> list[tuple[str, ast.stmt]]:
    """The import statements of the README's and docs' Python blocks and `python -c "..."` lines."""
    statements = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        snippets = re.findall(r"```python\n(.*?)```", text, re.DOTALL) + [s.replace("\n", " ") for s in re.findall(r'python -c "(.*?)"', text, re.DOTALL)]
        for snippet in snippets:
            statements += [(doc.name, node) for node in ast.walk(ast.parse(snippet)) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return statements


def test_the_documented_imports_work():
    """Each `import` / `from ... import` the README and docs show runs here and names something that exists."""
    statements = _documented_imports()
    assert any(isinstance(node, ast.ImportFrom) and node.module == "vflash_core" for _, node in statements)
    for doc, node in statements:
        modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
        for module_name in modules:
            module = importlib.import_module(module_name)
            if isinstance(node, ast.ImportFrom):
                absent = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not absent, f"{doc}: from {module_name} import {absent} fails"
