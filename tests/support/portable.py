"""``torch.randn_like`` and ``Tensor.normal_`` drawing through oracle.randn,
whose bits do not depend on the CPU (tests/conftest.py installs them for every test; benches
that rebuild a test's inputs install them too)."""
from __future__ import annotations

import torch

from torch_metal_flash.testing.oracle import randn


def randn_like(t, *, generator=None, dtype=None, device=None, requires_grad=False, **_):
    return randn(t.shape, generator=generator, dtype=dtype or t.dtype, device=device or t.device,
                 requires_grad=requires_grad)


def normal_(self, mean=0.0, std=1.0, *, generator=None):
    with torch.no_grad():
        return self.copy_(randn(self.shape, generator=generator, dtype=torch.float64) * std + mean)
