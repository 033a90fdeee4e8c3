"""ComfyUI entry point of the Vflash node pack.

ComfyUI imports this file from `custom_nodes/<folder>/`. It makes `vflash_core`, `vflash_kernels` and
`vflash_nodes` importable by their own names (from this folder when they are not pip-installed) without putting this
folder on `sys.path`, and does nothing heavy: no CUDA initialisation, no model load.

Inside ComfyUI (where `comfy_api` exists) it exposes the V3 entry point `comfy_entrypoint` of the node pack
(`nodes/`, registered as `vflash_nodes`). A second copy of the pack in ComfyUI's custom-nodes folders exposes no node
and logs a WARNING naming both folders (`vflash_nodes.extension.claim_pack_folder`). Elsewhere (pip-installed use,
the CLI, the tests) importing it only registers the three packages; any other import error surfaces.
"""

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def _load_imports_helper():
    spec = importlib.util.spec_from_file_location("_vflash_imports", _ROOT / "vflash_core" / "_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helper = _load_imports_helper()
_helper.load_package("vflash_core", _ROOT / "vflash_core")
_helper.load_package("vflash_kernels", _ROOT / "kernels")
_helper.load_package("vflash_nodes", _ROOT / "nodes")

try:
    import comfy_api.latest  # noqa: F401  (present only inside ComfyUI)
except ModuleNotFoundError as exc:
    if exc.name not in ("comfy_api", "comfy_api.latest"):
        raise
else:
    from vflash_nodes.extension import claim_pack_folder

    # The folder as ComfyUI imported it (`__file__` unresolved), so two links to one checkout count as two copies.
    if claim_pack_folder(Path(__file__).absolute().parent):
        from vflash_nodes.extension import comfy_entrypoint  # noqa: F401
    else:
        NODE_CLASS_MAPPINGS: dict = {}  # loaded with no nodes: the warning is the only thing ComfyUI logs about it
