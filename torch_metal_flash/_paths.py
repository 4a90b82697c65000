"""Where the packaged shader and runtime sources live.

An installed package carries them as package data (``setup.py`` maps
``shaders/`` to ``torch_metal_flash/shaders`` and ``csrc/`` to
``torch_metal_flash/_csrc``); a source checkout uses the repo's folders.
``build_info()`` reads the record ``setup.py`` leaves next to the package.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

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
