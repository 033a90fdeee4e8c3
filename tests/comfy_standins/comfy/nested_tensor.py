"""Stand-in for `comfy.nested_tensor`: a list of tensors that acts like one in the few ways core code relies on.

Interface as in ComfyUI 0.33.0: `NestedTensor(tensors)`, `.tensors` (list), `.is_nested` (True), element-wise
arithmetic with a scalar or another NestedTensor, `unbind()`, `to()`, `float()`, and `shape` / `device` / `dtype` of
the first tensor.
"""

import torch


class NestedTensor:
    def __init__(self, tensors):
        self.tensors = list(tensors)
        self.is_nested = True

    def _map(self, other, fn):
        if isinstance(other, NestedTensor):
            return NestedTensor([fn(a, b) for a, b in zip(self.tensors, other.tensors)])
        return NestedTensor([fn(a, other) for a in self.tensors])

    def __add__(self, other):
        return self._map(other, lambda a, b: a + b)

    def __sub__(self, other):
        return self._map(other, lambda a, b: a - b)

    def __mul__(self, other):
        return self._map(other, lambda a, b: a * b)

    def __truediv__(self, other):
        return self._map(other, lambda a, b: a / b)

    def __getitem__(self, index):
        return NestedTensor([t[index] for t in self.tensors])

    def unbind(self):
        return self.tensors

    def to(self, *args, **kwargs):
        return NestedTensor([t.to(*args, **kwargs) for t in self.tensors])

    def float(self):
        return self.to(dtype=torch.float)

    def size(self):
        return self.tensors[0].size()

    @property
    def shape(self):
        return self.tensors[0].shape

    @property
    def ndim(self):
        return max(t.ndim for t in self.tensors)

    @property
    def device(self):
        return self.tensors[0].device

    @property
    def dtype(self):
        return self.tensors[0].dtype
