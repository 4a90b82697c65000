"""The emulator backend: executes a plan by running the shaders/ kernels on the CPU.

Each launch compiles ``shaders_dir() / launch.source`` (include dir: the
shaders folder; cached per source and function-constant values, and one build
serves all constant values whenever the emulator can make them launch-time
values) and runs ``launch.kernel`` over ``launch.grid_threads``, binding the
launch's buffers by index.  Schedule order, checked mode and seed come from
:func:`torch_metal_flash.emulator.settings`, then the environment
(``TORCH_METAL_FLASH_EMULATOR_ORDER`` / ``..._CHECKED`` / ``..._SEED``).

``last_stats`` holds the :class:`~torch_metal_flash.emulator.LaunchStats` of
the most recent plan the calling thread ran, one per launch (bytes moved, MMA
counts ...).
"""
from __future__ import annotations

import threading

from .. import emulator
from .._paths import shaders_dir
from ..caches import LRU
from ..plan import Plan


class EmulatorBackend:
    name = "emulator"

    def __init__(self):
        self._libs = LRU("emulator.libraries", 256)
        self._local = threading.local()

    @property
    def last_stats(self) -> list:
        """Stats of the most recent plan this thread ran."""
        return getattr(self._local, "stats", [])

    def library(self, source: str, function_constants: dict) -> "emulator.Library":
        key = (source, tuple(sorted(function_constants.items())))
        lib = self._libs.get(key)
        if lib is None:
            lib = emulator.compile_shader(shaders_dir() / source, function_constants=dict(function_constants))
            self._libs.put(key, lib)
        return lib

    def run(self, plan: Plan) -> None:
        stats = []
        for launch in plan.launches:
            lib = self.library(launch.source, launch.function_constants)
            kernel = lib[launch.kernel]
            stats.append(kernel(buffers=dict(launch.buffers), grid=launch.grid_threads, threadgroup=launch.threadgroup,
                                threadgroup_memory=dict(launch.threadgroup_memory) or None))
        self._local.stats = stats
