"""The text encoder with its decoder layers streamed through two slots from a host arena (`residency.ModuleRing`, the
block-ring mechanism) gives exactly the resident encoder's `hidden_states[50]` on the same device."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise
from encoder_inputs import encodings

from vflash_core.engine import residency as R
from vflash_core.media.conditioning import TextConditioner


def _inside(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    start = tensor.data_ptr()
    return any(b.data_ptr() <= start and start + tensor.nbytes <= b.data_ptr() + b.nbytes for b in buffers)


def test_streamed_encoder_equals_the_resident_encoder_bit_for_bit(h3_family, monkeypatch):
    conditioner = TextConditioner.from_pretrained(h3_family, "cpu")
    resident = encodings(conditioner)
    layers = list(conditioner.decoder_layers())
    conditioner.stream_layers()
    ring = conditioner.layer_ring
    assert ring is not None and ring.source.what == "decoder layer"
    # The layers' weights live in the arena now (held once), and only the rest of the encoder moves as a part.
    assert all(_inside(p, ring.source.segments) for layer in layers for p in layer.parameters())
    assert not any(m is layer or any(s is layer for s in m.modules()) for m in conditioner.device_modules() for layer in layers)
    moved = {id(p) for m in conditioner.device_modules() for p in m.parameters()}
    assert moved | {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in conditioner.text_encoder.parameters()}

    copies = []
    issue = R.WeightRing._issue_copy
    monkeypatch.setattr(R.WeightRing, "_issue_copy", lambda self, index: (copies.append(index), issue(self, index)))
    seen = []
    hook = layers[7].register_forward_hook(lambda module, args, out: seen.append(_inside(module.mlp.up_proj.weight, ring.ring.slots)))
    streamed = encodings(conditioner)
    hook.remove()

    for got, expected, what in zip(streamed, resident, ("text only", "with a picture")):
        assert_bitwise(got, expected, f"streamed vs resident hidden_states[50], {what}")
    assert copies == list(range(len(layers))) * 2  # every layer through a slot, once per encode
    assert seen == [True, True]  # a layer runs on its slot's bytes
    assert ring.ring is None and not any(layer._forward_pre_hooks for layer in layers)  # detached after each encode
    assert all(_inside(p, ring.source.segments) for layer in layers for p in layer.parameters())


def test_module_ring_refuses_layers_of_different_shapes():
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 6)]
    with pytest.raises(Exception, match=r"decoder layer 1: weight is torch.float32 \[6, 4\], decoder layer 0 has torch.float32 \[4, 4\]"):
        R.ModuleRing(layers, pin=False, what="decoder layer")


@pytest.mark.gpu
def test_streamed_encoder_equals_the_resident_encoder_on_the_gpu(h3_family):
    conditioner = TextConditioner.from_pretrained(h3_family, "cuda:0")
    with conditioner.on_device():
        resident = encodings(conditioner)
    conditioner.stream_layers()
    conditioner.materialize()
    baseline = torch.cuda.memory_allocated(0)
    with conditioner.on_device():
        streamed = encodings(conditioner)
    assert torch.cuda.memory_allocated(0) <= baseline  # slots and the rest of the encoder are given back
    for got, expected in zip(streamed, resident):
        assert_bitwise(got, expected, "streamed vs resident on cuda:0")
