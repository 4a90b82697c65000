"""Shared helpers for the emulator tests."""
from __future__ import annotations

from pathlib import Path

from torch_metal_flash import emulator

KERNELS = Path(__file__).resolve().parent / "kernels"
ORDERS = ("forward", "reverse", "random")
_libs: dict = {}


def lib(name: str, **kw) -> "emulator.Library":
    """Compile tests/emulator/kernels/<name> (memoised per process)."""
    key = (name, tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _libs:
        _libs[key] = emulator.compile_shader(KERNELS / name, **kw)
    return _libs[key]
