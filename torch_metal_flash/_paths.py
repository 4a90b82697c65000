"""Where the packaged shader and runtime sources live.

An installed package carries them as package data (``setup.py`` maps
``shaders/`` to ``torch_metal_flash/shaders`` and ``csrc/`` to
``torch_metal_flash/_csrc``); a source checkout uses the repo's folders.
"""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(installed: str, repo: str) -> Path:
    for candidate in (_PKG / installed, _PKG.parent / repo):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"torch_metal_flash: cannot find the {repo}/ folder (looked in "
                            f"{_PKG / installed} and {_PKG.parent / repo})")


def shaders_dir() -> Path:
    return _find("shaders", "shaders")


def csrc_dir() -> Path:
    return _find("_csrc", "csrc")
