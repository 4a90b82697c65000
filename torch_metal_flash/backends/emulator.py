"""The emulator backend: executes a plan by running the shaders/ kernels on the CPU.

Each launch compiles ``shaders_dir() / launch.source``, or the text of a
source generated at run time under that name (``_paths.generated_source``;
include dir: the shaders folder; one build serves every function-constant value) in the math
mode the Metal launcher uses (``TORCH_METAL_FLASH_MATH_MODE``, default
safe; ``emulator.settings(math_mode=...)`` overrides it) and runs
``launch.kernel`` over ``launch.grid_threads``, binding the launch's buffers
by index.  Schedule order, checked mode and seed come from
:func:`torch_metal_flash.emulator.settings`, then the environment
(``TORCH_METAL_FLASH_EMULATOR_ORDER`` / ``..._CHECKED`` / ``..._SEED``).

Two ways in, one way to launch: the C++ core's emulator encoder calls
:meth:`EmulatorBackend.prepare` once per launch of a cached template and
:meth:`EmulatorBackend.encode` per call (raw bindings); :meth:`EmulatorBackend.run`
runs a :class:`~torch_metal_flash.planner.plan.Plan` as it is (tests, benches).

``pipeline_info`` reports a kernel's limits as the Metal backend does
(``emulator.Library.pipeline_info``: ``[[max_total_threads_per_threadgroup(n)]]``,
else 1024; threadgroup memory), so the planners check the same limits here.

``last_stats`` holds the :class:`~torch_metal_flash.emulator.LaunchStats` of
the most recent plan the calling thread ran, one per launch (bytes moved, MMA
counts ...).
"""
from __future__ import annotations

import threading

import torch_metal_flash.emulator as emulator
from .._paths import generated_source, is_nax_source, shader_language, shaders_dir
from ..caches import LRU
import torch_metal_flash.emulator.config as config
from ..planner.plan import Plan
from ..planner.tiles import NAX_FAMILY
import torch_metal_flash.backends.faults as faults


# Shared by every instance (what they hold depends only on the key).
_libraries = LRU("emulator.libraries", 256)
_pipeline_infos = LRU("emulator.pipeline_info", 1024)


class EmulatorBackend:
    name = "emulator"

    @property
    def family(self) -> str:
        """The tile tables it plans with: an M2's, or ``emulator.settings(family=...)``."""
        return config.backend_family()

    @property
    def neural_accelerators_reason(self) -> str:
        """Empty when the neural-accelerator path is active (the emulator plans as apple10), else why not."""
        family = self.family
        return "" if family == NAX_FAMILY else f"the emulator plans as {family}"

    def __init__(self):
        self._local = threading.local()

    @property
    def last_stats(self) -> list:
        """Stats of the most recent plan this thread ran."""
        return getattr(self._local, "stats", [])

    def library(self, source: str, function_constants: dict) -> "emulator.Library":
        math_mode = config.backend_math_mode()
        key = (source, tuple(sorted(function_constants.items())), math_mode)
        why = self.neural_accelerators_reason if is_nax_source(source) else ""
        if why:  # as the Metal launcher: such a kernel runs only where the path is active
            raise RuntimeError(f"torch_metal_flash: shaders/{source} is a neural-accelerator kernel (Metal "
                               f"Shading Language 4.0), which this backend cannot run: {why} (use "
                               "emulator.settings(family='apple10'))")
        lib = _libraries.get(key)
        if lib is None:
            text = generated_source(source)
            if text is not None:  # a run-time source: compiled as if it sat in shaders/
                lib = emulator.compile_shader(text, include_dirs=(shaders_dir(),), name=source,
                                              function_constants=dict(function_constants), math_mode=math_mode,
                                              language_version=shader_language(source))
            else:
                lib = emulator.compile_shader(shaders_dir() / source, function_constants=dict(function_constants),
                                              math_mode=math_mode, language_version=shader_language(source))
            _libraries.put(key, lib)
        return lib

    def prepare(self, source: str, kernel: str, function_constants: dict, threadgroups, threadgroup,
                threadgroup_memory: dict):
        """Everything a launch needs but its buffers.  The library is looked up at encode
        time: a cached template must follow the current math mode (``emulator.settings``)."""
        grid = tuple(g * t for g, t in zip(threadgroups, threadgroup))
        return source, kernel, dict(function_constants), grid, tuple(threadgroup), dict(threadgroup_memory)

    def encode(self, launches) -> None:
        """Run ``[(prepared, {index: buffer})]`` in order (the kernels not built yet are built
        first, in parallel)."""
        libs = [self.library(source, constants) for (source, _, constants, *_), _ in launches]
        kernels: dict = {}
        for lib, ((_, kernel, *_), _) in zip(libs, launches):
            kernels.setdefault(id(lib), (lib, []))[1].append(kernel)
        for lib, names in kernels.values():
            lib.prebuild(names)
        self._local.stats = [lib[kernel](buffers=buffers, grid=grid, threadgroup=threadgroup,
                                         threadgroup_memory=tg_memory or None)
                             for lib, ((_, kernel, _, grid, threadgroup, tg_memory), buffers) in zip(libs, launches)]

    def pipeline_info(self, source: str, kernel: str, function_constants: dict) -> dict:
        """The kernel's limits (keys as ``_C.pipeline_info``), cached; builds its library
        first, as the Metal backend builds the pipeline.  A kernel that cannot be built
        raises :class:`~torch_metal_flash.planner.limits.KernelBuildError`, remembered
        (:mod:`.faults`)."""
        faults.check(self.name, source, kernel)
        key = (source, kernel, tuple(sorted(function_constants.items())))
        info = _pipeline_infos.get(key)
        if info is None:
            try:
                lib = self.library(source, function_constants)
            except emulator.CompileError as e:
                raise faults.remember(self.name, source, kernel, "compile", str(e)) from None
            try:
                info = dict(lib.pipeline_info(kernel))
            except emulator.CompileError as e:  # kernels are built on first use
                raise faults.remember(self.name, source, kernel, "function", str(e)) from None
            _pipeline_infos.put(key, info)
        return info

    def run(self, plan: Plan) -> None:
        self.encode([(self.prepare(launch.source, launch.kernel, launch.function_constants, launch.threadgroups,
                                   launch.threadgroup, launch.threadgroup_memory), dict(launch.buffers))
                     for launch in plan.launches])
