"""Opt-in ``flash_attn`` shim: code written for the CUDA ``flash_attn`` package runs unmodified.

::

    import torch_metal_flash
    torch_metal_flash.install_flash_attn_shim()
    from flash_attn import flash_attn_func          # -> torch_metal_flash.flash_attn_func
    from flash_attn.flash_attn_interface import flash_attn_varlen_func

Nothing is installed on import of torch_metal_flash: only
:func:`install_flash_attn_shim` puts the shim package
(``torch_metal_flash.faces.flash_attn_package``) into ``sys.modules`` as
``flash_attn`` and ``flash_attn.flash_attn_interface``.  The functions are
looked up at call time (``flash_attn_varlen_func`` and its packed forms in
``torch_metal_flash.faces.functional``, ``flash_attn_with_kvcache`` there or in
``torch_metal_flash.faces.kvcache``); one that does not exist raises
:class:`NotImplementedError` naming what is missing.
"""
from __future__ import annotations

import sys
import threading
from types import ModuleType

__all__ = ["install_flash_attn_shim", "uninstall_flash_attn_shim", "is_flash_attn_shim_installed"]

_SHIM_PACKAGE = "torch_metal_flash.faces.flash_attn_package"
_SUBMODULES = ("flash_attn_interface", "bert_padding")

_lock = threading.Lock()
_saved: dict = {}  # what sys.modules held under our names before install (force=True)


def _names():
    return ["flash_attn"] + [f"flash_attn.{sub}" for sub in _SUBMODULES]


def _is_ours(module) -> bool:
    return getattr(module, "__torch_metal_flash_shim__", False) or \
        getattr(module, "__name__", "").startswith(_SHIM_PACKAGE)


def is_flash_attn_shim_installed() -> bool:
    return _is_ours(sys.modules.get("flash_attn"))


def install_flash_attn_shim(*, force: bool = False) -> ModuleType:
    """Make ``import flash_attn`` resolve to torch_metal_flash; returns the shim module.

    Raises :class:`RuntimeError` if another ``flash_attn`` (the real CUDA
    package) is already imported, unless ``force=True`` (then it is replaced
    until :func:`uninstall_flash_attn_shim`).  Idempotent.
    """
    import importlib

    with _lock:
        shim = importlib.import_module(_SHIM_PACKAGE)
        modules = {"flash_attn": shim}
        for sub in _SUBMODULES:
            modules[f"flash_attn.{sub}"] = importlib.import_module(f"{_SHIM_PACKAGE}.{sub}")
        current = sys.modules.get("flash_attn")
        if current is not None and not _is_ours(current):
            if not force:
                raise RuntimeError(
                    f"install_flash_attn_shim: another flash_attn is already imported "
                    f"({getattr(current, '__file__', current)!r}); pass force=True to replace it")
            for name in list(sys.modules):
                if name == "flash_attn" or name.startswith("flash_attn."):
                    _saved[name] = sys.modules.pop(name)
        sys.modules.update(modules)
        return shim


def uninstall_flash_attn_shim() -> None:
    """Remove the shim from ``sys.modules`` (restoring a package it replaced with ``force=True``)."""
    with _lock:
        for name in list(sys.modules):
            if (name == "flash_attn" or name.startswith("flash_attn.")) and _is_ours(sys.modules[name]):
                del sys.modules[name]
        sys.modules.update(_saved)
        _saved.clear()
