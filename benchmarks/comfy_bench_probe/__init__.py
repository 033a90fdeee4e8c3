"""Benchmark-only ComfyUI custom node for `benchmarks/vs_comfy_core.py`: the memory figures of the server process,
read inside it, the same way for core's nodes and Vflash's; registers no nodes.

* `GET /vflash_bench/memory`: `device_used_bytes` (the driver's count of the devices' memory in use now, all
  processes, `torch.cuda.mem_get_info`: what core's dynamic VRAM allocates outside PyTorch's allocator counts here),
  `device_peak_bytes` (`torch.cuda.max_memory_allocated`, all devices: PyTorch's allocator only; 0 on the CPU),
  `comfy_pinned_bytes` (core's `comfy.model_management.TOTAL_PINNED_MEMORY`: host memory core page-locks with
  `cudaHostRegister`, now) and `torch_pinned_bytes` (PyTorch's page-locked host allocator, `allocated_bytes.current`
  of `torch.cuda.host_memory_stats()`, where Vflash's pinned buffers come from; 0 without CUDA);
* `POST /vflash_bench/reset_peaks`: resets the device peaks before a run.

With `VFLASH_BENCH_DEVICE_CAP_GIB` set, PyTorch's allocator is capped at that many GiB of the device at import
(`set_per_process_memory_fraction`), for core's nodes and Vflash's alike: the cap holds whatever each side plans.
"""

import os

import comfy.model_management as mm
import torch
from aiohttp import web
from server import PromptServer

_CAP = os.environ.get("VFLASH_BENCH_DEVICE_CAP_GIB")
if _CAP and torch.cuda.is_available():
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(_CAP) * (1 << 30) / total), index)


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@PromptServer.instance.routes.get("/vflash_bench/memory")
async def memory(request):
    device_peak = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) if _cuda() else 0
    device_used = sum(total - free for free, total in map(torch.cuda.mem_get_info, range(torch.cuda.device_count()))) if _cuda() else 0
    torch_pinned = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)) if _cuda() else 0
    return web.json_response({"device_used_bytes": int(device_used), "device_peak_bytes": int(device_peak),
                              "comfy_pinned_bytes": int(mm.TOTAL_PINNED_MEMORY),
                              "torch_pinned_bytes": torch_pinned})


@PromptServer.instance.routes.post("/vflash_bench/reset_peaks")
async def reset_peaks(request):
    if _cuda():
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)
    return web.json_response({})


NODE_CLASS_MAPPINGS: dict = {}
