"""The package's compiled extension, loaded in one place.

On macOS ``torch_metal_flash._C`` holds the Metal launcher and the C++ op core
(``csrc/metal``, ``csrc/core``).  ``_C`` compiles torch's ``MPSStream`` internals into
itself, so it runs only with the torch minor it was built against: a prebuilt ``_C``
(a wheel's, or ``setup.py``'s with torch at build time) whose build record names
another minor is refused, and the launcher is built at first use against the torch
that runs (:mod:`.build`; cached per torch).  Elsewhere, or on a Mac without a
launcher, the op core alone is built at first use and serves CPU tensors behind
the emulator backend.

The launcher is resolved once per process.  When there is none, the reason (the
refusal, the import error itself, why the first-use build failed, or "not built"
with why) is kept for the Metal backend's ``unavailable_reason`` and so for the
fallback warning and the doctor.
"""
from __future__ import annotations

import functools
import importlib
import sys
import warnings
from typing import Optional

import torch

from .._paths import build_info
from .targets import TORCH_NEWEST, TORCH_OLDEST, TORCH_REQUIREMENT, torch_minor

# Builds the extension against the torch that runs (no isolated build environment).
REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def unsupported_torch(version: Optional[str] = None) -> Optional[str]:
    """Why ``version`` (default: the running torch's) is outside the supported range, or None."""
    version = version or torch.__version__
    if TORCH_OLDEST <= torch_minor(version) <= TORCH_NEWEST:
        return None
    return (f"torch_metal_flash supports {TORCH_REQUIREMENT} (torch {TORCH_OLDEST[0]}.{TORCH_OLDEST[1]} to "
            f"{TORCH_NEWEST[0]}.{TORCH_NEWEST[1]}); this process runs torch {version}. "
            f"Install a supported torch: pip install \"{TORCH_REQUIREMENT}\"")


def check_torch() -> None:
    """At import: a torch older than the range cannot run the package (ImportError saying so);
    a newer one is untested (one warning, so that a later failure is read with it)."""
    why = unsupported_torch(torch.__version__)
    if why is None:
        return
    if torch_minor(torch.__version__) < TORCH_OLDEST:
        raise ImportError(why)
    warnings.warn(f"{why} (torch {torch.__version__} is newer than the package was tested with; "
                  f"errors may follow)", UserWarning, stacklevel=3)


def stale_build(record: dict, running: Optional[str] = None) -> Optional[str]:
    """Why a prebuilt ``_C`` with this build record must not be loaded by ``running`` torch
    (default: the running one), or None."""
    running = running or torch.__version__
    built = record.get("torch")
    if not built or record.get("extension") is not True or torch_minor(built) == torch_minor(running):
        return None
    return (f"the prebuilt torch_metal_flash._C was built for torch {built} and this process runs torch {running}: "
            f"_C compiles torch's MPS stream internals into itself, so it runs only with the torch minor it was "
            f"built for, and it is not loaded")


def _prebuilt() -> tuple[Optional[object], Optional[str]]:
    """The prebuilt ``_C`` when it exists, matches the running torch and imports; else ``(None, why)``
    with ``why`` None when there is no prebuilt ``_C`` at all."""
    record = build_info()
    stale = stale_build(record)
    if stale:
        return None, stale
    try:
        return importlib.import_module("torch_metal_flash._C"), None
    except ModuleNotFoundError as e:
        if e.name == "torch_metal_flash._C":
            return None, None
        error = e
    except Exception as e:  # noqa: BLE001 -- any failure of the import is the diagnosis we report
        error = e
    built = record.get("torch")
    versions = (f"; it was built against torch {built}, this process runs torch {torch.__version__}"
                if built and built != torch.__version__ else "")
    return None, f"torch_metal_flash._C (the Metal launcher) failed to import: {type(error).__name__}: {error}{versions}"


def _cannot_build_reason() -> Optional[str]:
    """Why this process cannot build the launcher at first use, or None."""
    if sys.platform != "darwin":
        return f"the Metal launcher is built on macOS only; this is {sys.platform}"
    if not torch.backends.mps.is_built():
        return f"torch {torch.__version__} was built without MPS"
    return unsupported_torch()


@functools.lru_cache(maxsize=None)
def load_launcher() -> tuple[Optional[object], Optional[str]]:
    """``(_C, None)`` or ``(None, why)``; resolved once per process."""
    module, refused = _prebuilt()
    if module is not None:
        return module, None
    cannot = _cannot_build_reason()
    if cannot is None:
        from . import build
        try:
            return build.load_launcher(), None
        except Exception as e:  # noqa: BLE001 -- the build's failure is the diagnosis we report
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            cannot = f"building it at first use against torch {torch.__version__} failed: {first}"
    if refused is None and sys.platform != "darwin":
        return None, (f"torch_metal_flash._C (the Metal launcher) is not built: this is a pure-Python install "
                      f"({sys.platform})")
    if refused is None:
        note = build_info().get("extension")
        refused = "torch_metal_flash._C (the Metal launcher) is not built in this install" + (
            f" ({note})" if isinstance(note, str) else "")
    return None, f"{refused}; {cannot}. Rebuild it against the torch you run, from a checkout: `{REBUILD}`"


def launcher():
    """``_C``, or None (see :func:`load_launcher` for why)."""
    return load_launcher()[0]


def core_extension():
    """The module holding the C++ op core: ``_C`` where it has one, else the build made at first use."""
    ext = launcher()
    if ext is not None and hasattr(ext, "core"):
        return ext
    from . import build
    try:
        return build.load_core()
    except Exception as e:
        outside = unsupported_torch()
        if outside is None:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"{outside} (building the C++ op core against it failed: {first})") from None
