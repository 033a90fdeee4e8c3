"""Test-only ComfyUI custom node for `tests/test_comfyui_server.py`: what ComfyUI's model management and the Vflash
node pack hold, read inside the server process.

* `GET /vflash_test/memory`: `now` (the entries of `comfy.model_management.current_loaded_models`: the model's and the
  patcher's class, device, loaded bytes, the Vflash engine kind), `snapshots` (the same, taken by the node below while
  a prompt ran), `vflash` (the pack's registry, kind -> option) and `engines` (every Vflash engine the probe has seen
  in the registry, with whether it is closed now);
* `POST /vflash_test/evict_on_preview_load` with `{"on": true}`: from then on, each time core loads a live preview's
  tiny decoder (`load_models_gpu` of a TAEHV model) it first evicts every other model on that device, as on a GPU
  with no room left; `GET /vflash_test/memory`'s `forced_evictions` counts them;
* `VflashTestMemorySnapshot`: passes a LATENT through and records the entries at that moment (between the sampler and
  the decode, while the graph's core models are alive: the server runs with `--cache-none`, which drops a node's
  outputs once its consumers ran). It is marked dev-only, so the frontend's node search (and its screenshots) leave
  it out unless the user turns on dev mode; the API runs it all the same.
"""

import sys

import comfy.model_management as mm
from aiohttp import web
from server import PromptServer

SNAPSHOTS: list[list[dict]] = []
SEEN: list[tuple[str, object]] = []  # (kind, engine) of every engine seen in the pack's registry


FORCED_EVICTIONS = {"on": False, "count": 0}
_load_models_gpu = mm.load_models_gpu


def _evicting_load_models_gpu(models, *args, **kwargs):
    if FORCED_EVICTIONS["on"] and models and type(models[0].model).__name__ == "TAEHV":
        FORCED_EVICTIONS["count"] += 1
        mm.free_memory(1e30, models[0].load_device)
    return _load_models_gpu(models, *args, **kwargs)


mm.load_models_gpu = _evicting_load_models_gpu


def _entries() -> list[dict]:
    return [
        {
            "model": type(entry.model.model).__name__, "patcher": type(entry.model).__name__, "device": str(entry.device),
            "loaded_bytes": int(entry.model_loaded_memory()), "vflash_kind": getattr(entry.model, "kind", None),
        }
        for entry in mm.current_loaded_models
        if entry.model is not None
    ]


def _closed(engine: object) -> bool:
    """A transformer session says so; a text encoder or VAE pair drops its modules when closed."""
    if hasattr(engine, "closed"):
        return bool(engine.closed)
    return getattr(engine, "text_encoder", None) is None and getattr(engine, "video_vae", None) is None


def _registry():
    registry = sys.modules["vflash_nodes.registry"].ENGINES
    for kind in ("dit", "te", "vae"):
        engine = registry.engine(kind)
        if engine is not None and not any(engine is e for _, e in SEEN):
            SEEN.append((kind, engine))
    return registry


@PromptServer.instance.routes.get("/vflash_test/memory")
async def memory(request):
    loaded = _registry().loaded()
    engines = [{"kind": kind, "id": id(engine), "closed": _closed(engine)} for kind, engine in SEEN]
    return web.json_response({"now": _entries(), "snapshots": SNAPSHOTS, "vflash": loaded, "engines": engines,
                              "forced_evictions": FORCED_EVICTIONS["count"]})


@PromptServer.instance.routes.post("/vflash_test/evict_on_preview_load")
async def evict_on_preview_load(request):
    FORCED_EVICTIONS["on"] = bool((await request.json())["on"])
    return web.json_response(FORCED_EVICTIONS)


class VflashTestMemorySnapshot:
    CATEGORY = "testing"
    DEV_ONLY = True  # test-only: the frontend lists it in its node search only in dev mode (not in the screenshots)
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "snapshot"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",)}}

    def snapshot(self, latent):
        _registry()
        SNAPSHOTS.append(_entries())
        return (latent,)


NODE_CLASS_MAPPINGS = {"VflashTestMemorySnapshot": VflashTestMemorySnapshot}
