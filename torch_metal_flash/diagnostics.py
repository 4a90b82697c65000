"""What the process holds and did: its caches (:func:`cache_info`, :func:`clear_caches`) and
the op calls each backend ran (:func:`run_counts`).  Sits above every layer: it imports the
modules whose caches register when they load."""
from __future__ import annotations

import torch_metal_flash.caches as caches  # noqa: F401  (core registers the plan cache)
import torch_metal_flash.core as core
from .backends import run_counts  # noqa: F401
import torch_metal_flash.backends.emulator as _emulator_backend
import torch_metal_flash.backends.metal as _metal_backend
import torch_metal_flash.emulator.library as _library  # noqa: F401
import torch_metal_flash.emulator.runtime as _runtime

__all__ = ["cache_info", "clear_caches", "run_counts"]


def cache_info() -> dict[str, dict]:
    """``{cache name: {"size", "maxsize", ...}}`` for every cache of the process (see :mod:`.caches`)."""
    return {name: info() for name, (info, _) in sorted(caches.registered().items())}


def clear_caches() -> None:
    """Empty every cache (compiled kernels are rebuilt, or reloaded from the disk cache, on next use)."""
    for _, clear in caches.registered().values():
        clear()
