"""The Metal backend: hands a plan to the Objective-C++ launcher (macOS only).

The launcher (``csrc/metal/launcher.mm``, built as ``torch_metal_flash._C``
together with the C++ op core) holds the Metal encoder: the ops' C++ bodies
encode cached launch templates on PyTorch's current MPS stream, one
``dispatch_sync`` per plan; :meth:`MetalBackend.run` encodes a plan as it is.

The extension is imported once per process.  When that fails, the reason
(the import error itself: an ABI mismatch with the running torch, a missing
symbol, a wrong architecture; or "not built" with why) is kept and reported
by :func:`unavailable_reason`, and so in the fallback warning.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Optional

import torch

from .._paths import build_info, shaders_dir
from ..caches import LRU
from ..plan import Plan

# Builds the extension against the torch that runs (no isolated build environment).
_REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def _installed_copy() -> Optional[Path]:
    """The package folder of the installed distribution when this process imported
    another copy (a source checkout shadowing it: Python puts the working directory
    first on ``sys.path``), else None."""
    try:
        dist = importlib.metadata.distribution("torch_metal_flash")
        installed = Path(dist.locate_file("torch_metal_flash")).resolve()
    except (importlib.metadata.PackageNotFoundError, TypeError, OSError):
        return None
    here = Path(__file__).resolve().parents[1]
    return installed if installed != here and installed.is_dir() else None


def _not_built_reason() -> str:
    if sys.platform != "darwin":
        return f"torch_metal_flash._C (the Metal launcher) is not built: this is a pure-Python install ({sys.platform})"
    here = Path(__file__).resolve().parents[1]
    installed = _installed_copy()
    if installed is not None and any(installed.glob("_C*.so")):
        return (f"torch_metal_flash was imported from {here}, a source checkout without the built launcher "
                f"(_C), which the installed copy in {installed} has: Python imports the folder you run in "
                f"first. Run from another directory, or build the checkout in place with `pip install -e .`")
    note = build_info().get("extension")
    why = f" ({note})" if isinstance(note, str) else ""
    return (f"torch_metal_flash._C (the Metal launcher) is not built in this install{why}; "
            f"build it from a checkout with `{_REBUILD}`")


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[object], Optional[str]]:
    """``(module, None)`` or ``(None, why)``; the import is attempted once per process."""
    try:
        return importlib.import_module("torch_metal_flash._C"), None
    except ModuleNotFoundError as e:
        if e.name == "torch_metal_flash._C":
            return None, _not_built_reason()
        error = e
    except Exception as e:  # noqa: BLE001 -- any failure of the import is the diagnosis we report
        error = e
    built = build_info().get("torch")
    versions = (f"; it was built against torch {built}, this process runs torch {torch.__version__}"
                if built and built != torch.__version__ else "")
    return None, (f"torch_metal_flash._C (the Metal launcher) failed to import: {type(error).__name__}: {error}"
                  f"{versions}. Rebuild it against the torch you run, from a checkout: `{_REBUILD}`")


def _extension():
    """The launcher module, or None (see :func:`unavailable_reason`)."""
    return _load()[0]


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """None when the metal backend can run on ``device`` (default: the MPS device), else why not."""
    if device is not None and device.type != "mps":
        return f"the metal backend runs on MPS tensors, got {device.type}"
    module, why = _load()
    if module is None:
        return why
    if device is None and not torch.backends.mps.is_available():
        return "torch reports no usable MPS device (torch.backends.mps.is_available() is False)"
    return None


_pipeline_infos = LRU("metal.pipeline_info", 1024)  # the pipelines themselves stay in _C


class MetalBackend:
    name = "metal"

    def __init__(self):
        self._C = _extension()
        self._C.set_shader_dir(str(shaders_dir()))
        self.family = self._C.gpu_family()  # selects the tile tables

    def pipeline_info(self, source: str, kernel: str, function_constants: dict) -> dict:
        """The pipeline's limits (``_C.pipeline_info``: builds the pipeline once, then cached)."""
        constants = sorted(function_constants.items())
        key = (source, kernel, tuple(constants))
        info = _pipeline_infos.get(key)
        if info is None:
            info = dict(self._C.pipeline_info(source, kernel, constants))
            _pipeline_infos.put(key, info)
        return info

    def run(self, plan: Plan) -> None:
        """Encode a plan as it is (the ops replay cached templates in C++ instead)."""
        from .. import core
        core.run_plan("metal", plan)
