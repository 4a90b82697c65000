"""The Metal backend: hands a plan to the Objective-C++ launcher (macOS only).

The launcher (``csrc/metal/launcher.mm``, built as ``torch_metal_flash._C``
together with the C++ op core) holds the Metal encoder: the ops' C++ bodies
encode cached launch templates on PyTorch's current MPS stream, one
``dispatch_sync`` per plan; :meth:`MetalBackend.run` encodes a plan as it is.
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
        """Encode a plan as it is (the ops replay cached templates in C++ instead)."""
        from .. import core
        core.run_plan("metal", plan)
