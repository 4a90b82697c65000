"""The Metal backend: hands a plan to the Objective-C++ launcher (macOS only).

The launcher (``csrc/metal/launcher.mm``, built as ``torch_metal_flash._C``)
encodes each launch on PyTorch's current MPS stream; everything it needs
(kernel name, function constants, buffers, grid) arrives in the plan.
"""
from __future__ import annotations

import torch

from .._paths import shaders_dir
from ..plan import Plan


def _extension():
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _C


def unavailable_reason(device: torch.device):
    if device.type != "mps":
        return f"the metal backend runs on MPS tensors, got {device.type}"
    if _extension() is None:
        return "torch_metal_flash._C (the Metal launcher) is not built in this install"
    return None


class MetalBackend:
    name = "metal"

    def __init__(self):
        self._C = _extension()
        self._C.set_shader_dir(str(shaders_dir()))
        self.family = self._C.gpu_family()  # selects the tile tables

    def run(self, plan: Plan) -> None:
        for launch in plan.launches:
            buffers = sorted(launch.buffers.items())
            self._C.launch(
                launch.source,
                launch.kernel,
                sorted(launch.function_constants.items()),
                [i for i, _ in buffers],
                [b for _, b in buffers],
                list(launch.threadgroups),
                list(launch.threadgroup),
                sorted(launch.threadgroup_memory.items()),
            )
