"""Stand-in for `comfy.model_management` under `--cpu`: device queries, the interrupt flag, model unloading.

`InterruptProcessingException` derives from BaseException as in core. `calls` records the memory-cooperation calls
so tests can check the nodes make them.
"""

import threading
from collections import Counter

import torch

calls = Counter()


class InterruptProcessingException(BaseException):
    pass


_interrupt = False
_mutex = threading.RLock()


def interrupt_current_processing(value=True):
    global _interrupt
    with _mutex:
        _interrupt = value


def processing_interrupted():
    with _mutex:
        return _interrupt


def throw_exception_if_processing_interrupted():
    global _interrupt
    with _mutex:
        if _interrupt:
            _interrupt = False
            raise InterruptProcessingException()


def get_torch_device():
    calls["get_torch_device"] += 1
    return torch.device("cpu")


def intermediate_device():
    return torch.device("cpu")


def unet_offload_device():
    return torch.device("cpu")


def cpu_mode():
    return True


def is_device_cpu(device):
    return torch.device(device).type == "cpu"


def get_free_memory(dev=None, torch_free_too=False):
    return (1 << 40, 1 << 40) if torch_free_too else 1 << 40


def unload_all_models():
    calls["unload_all_models"] += 1


def soft_empty_cache(force=False):
    calls["soft_empty_cache"] += 1
