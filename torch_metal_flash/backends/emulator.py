"""The emulator backend: executes a plan by running the shaders/ kernels on the CPU.

Each launch compiles ``shaders_dir() / launch.source`` (include dir: the
shaders folder; one build serves every function-constant value) in the math
mode the Metal launcher uses (``TORCH_METAL_FLASH_MATH_MODE``, default
relaxed; ``emulator.settings(math_mode=...)`` overrides it) and runs
``launch.kernel`` over ``launch.grid_threads``, binding the launch's buffers
by index.  Schedule order, checked mode and seed come from
:func:`torch_metal_flash.emulator.settings`, then the environment
(``TORCH_METAL_FLASH_EMULATOR_ORDER`` / ``..._CHECKED`` / ``..._SEED``).

``last_stats`` holds the :class:`~torch_metal_flash.emulator.LaunchStats` of
the most recent plan, one per launch (bytes moved, MMA counts ...).
"""
from __future__ import annotations

import threading

from .. import emulator
from ..emulator import config
from .._paths import shaders_dir
from ..plan import Plan


class EmulatorBackend:
    name = "emulator"

    def __init__(self):
        self._libs: dict = {}
        self._lock = threading.Lock()
        self.last_stats: list = []

    def library(self, source: str, function_constants: dict) -> "emulator.Library":
        math_mode = config.backend_math_mode()
        key = (source, tuple(sorted(function_constants.items())), math_mode)
        with self._lock:
            lib = self._libs.get(key)
        if lib is None:
            lib = emulator.compile_shader(shaders_dir() / source, function_constants=dict(function_constants),
                                          math_mode=math_mode)
            with self._lock:
                self._libs[key] = lib
        return lib

    def pipeline_info(self, source: str, kernel: str, function_constants: dict) -> dict:
        """The kernel's pipeline limits (the keys of the Metal launcher's ``pipeline_info``)."""
        return self.library(source, dict(function_constants)).pipeline_info(kernel)

    def run(self, plan: Plan) -> None:
        stats = []
        for launch in plan.launches:
            lib = self.library(launch.source, launch.function_constants)
            kernel = lib[launch.kernel]
            stats.append(kernel(buffers=dict(launch.buffers), grid=launch.grid_threads, threadgroup=launch.threadgroup,
                                threadgroup_memory=dict(launch.threadgroup_memory) or None))
        self.last_stats = stats
