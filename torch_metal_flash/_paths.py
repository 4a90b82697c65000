"""Where the packaged shader and runtime sources live.

An installed package carries them as package data (``setup.py`` maps
``shaders/`` to ``torch_metal_flash/shaders`` and ``csrc/`` to
``torch_metal_flash/_csrc``); a source checkout uses the repo's folders.
``build_info()`` reads the record ``setup.py`` leaves next to the package.
"""
from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Callable, Optional

_PKG = Path(__file__).resolve().parent
VERSION = "0.1.0"  # the distribution's version (pyproject.toml reads it from here)


def _find(installed: str, repo: str) -> Path:
    for candidate in (_PKG / installed, _PKG.parent / repo):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"torch_metal_flash: cannot find the {repo}/ folder (looked in "
                            f"{_PKG / installed} and {_PKG.parent / repo})")


def shaders_dir() -> Path:
    return _find("shaders", "shaders")


NAX_SUFFIX = "_nax.metal"  # the neural-accelerator kernels' shader files (Metal 4 tensor ops)


def is_nax_source(source: str) -> bool:
    """Whether ``source`` (a shader file name) is a neural-accelerator kernel (compiled as MSL 4.0)."""
    return source.endswith(NAX_SUFFIX)


def shader_language(source: str) -> str:
    """The Metal Shading Language version a shader file is compiled as: 4.0 for the
    neural-accelerator kernels, 3.1 for the others (the Metal launcher's rule too)."""
    return "4.0" if is_nax_source(source) else "3.1"


# Shader sources generated at run time (FlexAttention), by name: they include the
# files of shaders/ as if they were there.  Listeners (the Metal backend) hear of each.
_generated: dict[str, str] = {}
_generated_listeners: list[Callable[[str, str], None]] = []
_generated_lock = threading.Lock()


def register_generated_source(name: str, text: str) -> None:
    """Make ``name`` (a file name, no directories) a shader source with this text."""
    if "/" in name or ".." in name or not name.endswith(".metal"):
        raise ValueError(f"generated shader names are .metal file names, got {name!r}")
    with _generated_lock:
        if _generated.get(name) == text:
            return
        _generated[name] = text
        listeners = list(_generated_listeners)
    for listener in listeners:
        listener(name, text)


def generated_source(name: str) -> Optional[str]:
    """The text of a generated source, or None for the files of shaders/."""
    with _generated_lock:
        return _generated.get(name)


def on_generated_source(listener: Callable[[str, str], None]) -> None:
    """Call ``listener(name, text)`` for every generated source, past and future."""
    with _generated_lock:
        _generated_listeners.append(listener)
        known = list(_generated.items())
    for name, text in known:
        listener(name, text)


def csrc_dir() -> Path:
    return _find("_csrc", "csrc")


@functools.lru_cache(maxsize=None)
def build_info() -> dict:
    """What ``setup.py`` recorded when it built this install (``_build_info.json``):
    ``platform``, ``torch`` (the version built against), ``extension`` (True, or why
    not), ``metallib`` (the precompiled shader libraries, or why none).  Empty for a
    source checkout."""
    try:
        return json.loads((_PKG / "_build_info.json").read_text())
    except (OSError, ValueError):
        return {}
