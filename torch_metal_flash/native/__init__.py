"""The package's compiled extension, loaded in one place.

On macOS ``torch_metal_flash._C`` holds the Metal launcher and the C++ op core
(``csrc/metal``, ``csrc/core``; built by ``setup.py``).  Elsewhere, or on a Mac
without ``_C``, the op core alone is compiled at first use (:mod:`.build`) and
serves CPU tensors behind the emulator backend.

``_C`` is imported once per process.  When that fails, the reason (the import
error itself: an ABI mismatch with the running torch, a missing symbol, a wrong
architecture; or "not built" with why) is kept for the Metal backend's
``unavailable_reason`` and so for the fallback warning.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Optional

import torch

from .._paths import build_info

# Builds the extension against the torch that runs (no isolated build environment).
REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."
_PACKAGE = Path(__file__).resolve().parents[1]


def installed_copy() -> Optional[Path]:
    """The package folder of the installed distribution when this process imported
    another copy (a source checkout shadowing it: Python puts the working directory
    first on ``sys.path``), else None."""
    try:
        dist = importlib.metadata.distribution("torch_metal_flash")
        installed = Path(dist.locate_file("torch_metal_flash")).resolve()
    except (importlib.metadata.PackageNotFoundError, TypeError, OSError):
        return None
    return installed if installed != _PACKAGE and installed.is_dir() else None


def _not_built_reason() -> str:
    if sys.platform != "darwin":
        return f"torch_metal_flash._C (the Metal launcher) is not built: this is a pure-Python install ({sys.platform})"
    installed = installed_copy()
    if installed is not None and any(installed.glob("_C*.so")):
        return (f"torch_metal_flash was imported from {_PACKAGE}, a source checkout without the built launcher "
                f"(_C), which the installed copy in {installed} has: Python imports the folder you run in "
                f"first. Run from another directory, or build the checkout in place with `pip install -e .`")
    note = build_info().get("extension")
    why = f" ({note})" if isinstance(note, str) else ""
    return (f"torch_metal_flash._C (the Metal launcher) is not built in this install{why}; "
            f"build it from a checkout with `{REBUILD}`")


@functools.lru_cache(maxsize=None)
def load_launcher() -> tuple[Optional[object], Optional[str]]:
    """``(_C, None)`` or ``(None, why)``; the import is attempted once per process."""
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
                  f"{versions}. Rebuild it against the torch you run, from a checkout: `{REBUILD}`")


def launcher():
    """``_C``, or None (see :func:`load_launcher` for why)."""
    return load_launcher()[0]


def core_extension():
    """The module holding the C++ op core: ``_C`` where it has one, else the build made at first use."""
    ext = launcher()
    if ext is not None and hasattr(ext, "core"):
        return ext
    from . import build
    return build.load()
