"""The bounded cache every process-wide cache of the package is (:class:`LRU`), and their
registry, which :func:`torch_metal_flash.cache_info` reads and :func:`torch_metal_flash.clear_caches`
empties.  This module imports nothing of the package: every layer may use it.

=============================  ======  ===================================================
cache                          size    holds
=============================  ======  ===================================================
``plan``                       512     the C++ core's launch templates, one per problem
                                       signature (``TORCH_METAL_FLASH_PLAN_CACHE_SIZE``;
                                       :func:`~torch_metal_flash.plan_cache_info`)
``checks.sdpa``, ``checks.     512     the faces' argument-check verdicts per call
flash``, ``checks.override``           signature (emptied when full)
``emulator.sources``           64      preprocessed .metal sources (text, kernel list)
``emulator.checks``            64      what the rules and analysis passes found per source
``emulator.builds``            64      loaded kernel libraries, one per source and mode
``emulator.libraries``         256     the emulator backend's libraries per (source,
                                       function-constant values, math mode)
``emulator.pipeline_info``     1024    the emulator backend's pipeline limits per kernel
``metal.pipeline_info``        1024    the Metal backend's pipeline limits per kernel
``emulator.symbols``           1024    symbolized error locations
``fallback_warnings``          1024    reasons already warned about (warn once each)
=============================  ======  ===================================================

The :class:`LRU` caches drop the least recently used entry first; the plan cache
is an LRU in C++.  An evicted emulator build keeps its shared object mapped
(loading the same file again reuses the mapping), so memory stays bounded by the
distinct builds.  The Metal launcher's pipelines live in C++ (one per kernel and
function-constant values: a bounded set).
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable

_MISSING = object()


class LRU:
    """A thread-safe mapping with at most ``maxsize`` entries, least recently used evicted first."""

    def __init__(self, name: str, maxsize: int):
        self.name, self.maxsize = name, maxsize
        self._data: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        register(name, self.info, self.clear)

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                self.misses += 1
                return default
            self.hits += 1
            self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
                self.evictions += 1

    def add(self, key: Hashable) -> None:
        """Set-like use (e.g. reasons already warned about)."""
        self.put(key, True)

    def __contains__(self, key: Hashable) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def info(self) -> dict:
        return {"size": len(self._data), "maxsize": self.maxsize, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}


_registry: dict[str, tuple[Callable[[], dict], Callable[[], None]]] = {}


def register(name: str, info: Callable[[], dict], clear: Callable[[], None]) -> None:
    """Add a cache to :func:`cache_info` / :func:`clear_caches` (``info()`` returns at least
    ``size`` and ``maxsize``)."""
    _registry[name] = (info, clear)


def registered() -> dict[str, tuple[Callable[[], dict], Callable[[], None]]]:
    """``{cache name: (info, clear)}`` of the caches registered so far."""
    return dict(_registry)
