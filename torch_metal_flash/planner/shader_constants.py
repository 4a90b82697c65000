"""The ``[[function_constant(i)]]`` indices of the shaders, by name.

``shaders/function_constants.h`` is their one definition: lines
``#define FC_<FAMILY>_<NAME> <index>``.  It is read once, here, so the planners
write ``{FWD.has_mask: ..., FWD.mask_kind: ...}`` and never an index.  A kernel
family sees the names of one or more header families (the forward: ``ATTN``,
the features it shares with the backward, and ``FWD``); within it, a name and
an index each appear once.
"""
from __future__ import annotations

import re
from types import MappingProxyType

from .._paths import shaders_dir

HEADER = "function_constants.h"
_DEFINE = re.compile(r"^\s*#\s*define\s+FC_([A-Z0-9]+)_(\w+)\s+(\d+)\s*$", re.MULTILINE)


def read_header(text: str) -> dict[str, dict[str, int]]:
    """{family: {constant name (lower case): index}} of the header's ``#define`` lines."""
    families: dict[str, dict[str, int]] = {}
    for family, name, index in _DEFINE.findall(text):
        names = families.setdefault(family, {})
        if name.lower() in names:
            raise ValueError(f"{HEADER}: FC_{family}_{name} is defined twice")
        names[name.lower()] = int(index)
    return families


class Indices:
    """The function-constant indices of one kernel family: ``FWD.has_mask`` is an index;
    ``indices()`` lists them all (e.g. to set every constant)."""

    def __init__(self, label: str, families: dict[str, dict[str, int]], parts: tuple[str, ...]):
        merged: dict[str, int] = {}
        for part in parts:
            if part not in families:
                raise ValueError(f"{HEADER}: no FC_{part}_* constants")
            for name, index in families[part].items():
                if name in merged:
                    raise ValueError(f"{HEADER}: {label} has two constants named {name}")
                merged[name] = index
        by_index: dict[int, str] = {}
        for name, index in merged.items():
            if index in by_index:
                raise ValueError(f"{HEADER}: {label} gives index {index} to both {by_index[index]} and {name}")
            by_index[index] = name
        self._label = label
        self._names = MappingProxyType(merged)

    def __getattr__(self, name: str) -> int:
        try:
            return self._names[name]
        except KeyError:
            raise AttributeError(f"{self._label} has no function constant {name!r} ({HEADER})") from None

    def names(self) -> dict[str, int]:
        return dict(self._names)

    def indices(self) -> list[int]:
        return sorted(self._names.values())

    def __repr__(self) -> str:
        return f"Indices({self._label}: {dict(self._names)})"


_FAMILIES = read_header((shaders_dir() / HEADER).read_text())

FWD = Indices("flash_fwd.metal", _FAMILIES, ("ATTN", "FWD"))
BWD = Indices("flash_bwd.metal", _FAMILIES, ("ATTN", "BWD"))
DECODE = Indices("flash_decode.metal", _FAMILIES, ("DECODE",))
APPEND = Indices("kvcache_append.metal", _FAMILIES, ("APPEND",))
