"""The emulator backend: executes a plan by running the shaders/ kernels on the CPU.

Each launch compiles ``shaders_dir() / launch.source`` (include dir: the
shaders folder; cached per source and function-constant values, and one build
serves all constant values whenever the emulator can make them launch-time
values) and runs ``launch.kernel`` over ``launch.grid_threads``, binding the
launch's buffers by index.  Schedule order, checked mode and seed come from
:func:`torch_metal_flash.emulator.settings`, then the environment
(``TORCH_METAL_FLASH_EMULATOR_ORDER`` / ``..._CHECKED`` / ``..._SEED``).

Two ways in, one way to launch: the C++ core's emulator encoder calls
:meth:`EmulatorBackend.prepare` once per launch of a cached template and
:meth:`EmulatorBackend.encode` per call (raw bindings); :meth:`EmulatorBackend.run`
runs a :class:`~torch_metal_flash.plan.Plan` as it is (tests, benches).

``pipeline_info`` reports a kernel's limits as the Metal backend does
(``emulator.Library.pipeline_info``: ``[[max_total_threads_per_threadgroup(n)]]``,
else 1024; threadgroup memory), so the planners check the same limits here.

``last_stats`` holds the :class:`~torch_metal_flash.emulator.LaunchStats` of
the most recent plan, one per launch (bytes moved, MMA counts ...).
"""
from __future__ import annotations

import threading

from .. import emulator
from .._paths import shaders_dir
from ..plan import Plan


class EmulatorBackend:
    name = "emulator"
    family = "apple8"  # the emulator plans with an M2's tile tables

    def __init__(self):
        self._libs: dict = {}
        self._lock = threading.Lock()
        self._pipeline_info: dict = {}
        self.last_stats: list = []

    def library(self, source: str, function_constants: dict) -> "emulator.Library":
        key = (source, tuple(sorted(function_constants.items())))
        with self._lock:
            lib = self._libs.get(key)
        if lib is None:
            lib = emulator.compile_shader(shaders_dir() / source, function_constants=dict(function_constants))
            with self._lock:
                self._libs[key] = lib
        return lib

    def prepare(self, source: str, kernel: str, function_constants: dict, threadgroups, threadgroup,
                threadgroup_memory: dict):
        """Everything a launch needs but its buffers."""
        grid = tuple(g * t for g, t in zip(threadgroups, threadgroup))
        return self.library(source, function_constants)[kernel], grid, tuple(threadgroup), dict(threadgroup_memory)

    def encode(self, launches) -> None:
        """Run ``[(prepared, {index: buffer})]`` in order."""
        self.last_stats = [kernel(buffers=buffers, grid=grid, threadgroup=threadgroup,
                                  threadgroup_memory=tg_memory or None)
                           for (kernel, grid, threadgroup, tg_memory), buffers in launches]

    def pipeline_info(self, source: str, kernel: str, function_constants: dict) -> dict:
        """The kernel's limits (keys as ``_C.pipeline_info``), cached; builds its library
        first, as the Metal backend builds the pipeline."""
        key = (source, kernel, tuple(sorted(function_constants.items())))
        info = self._pipeline_info.get(key)
        if info is None:
            lib = self.library(source, function_constants).build()
            if hasattr(lib, "pipeline_info"):
                info = dict(lib.pipeline_info(kernel))
            else:  # until emulator.Library.pipeline_info (issue 11) lands: the emulator's fixed limits
                lib[kernel]  # raises KeyError for a kernel the library does not have
                info = {"max_total_threads_per_threadgroup": 1024, "thread_execution_width": 32,
                        "static_threadgroup_memory_length": 0, "max_threadgroup_memory_length": 32768}
            self._pipeline_info[key] = info
        return info

    def run(self, plan: Plan) -> None:
        self.encode([(self.prepare(launch.source, launch.kernel, launch.function_constants, launch.threadgroups,
                                   launch.threadgroup, launch.threadgroup_memory), dict(launch.buffers))
                     for launch in plan.launches])
