"""The Metal backend: hands a plan to the Objective-C++ launcher (macOS only).

The launcher (``csrc/metal/launcher.mm``, built as ``torch_metal_flash._C``
together with the C++ op core) holds the Metal encoder: the ops' C++ bodies
encode cached launch templates on PyTorch's current MPS stream, one
``dispatch_sync`` per plan; :meth:`MetalBackend.run` encodes a plan as it is.

The extension is loaded by :mod:`torch_metal_flash.native`; when it cannot be,
:func:`unavailable_reason` reports why (and so the fallback warning).
"""
from __future__ import annotations

import platform
import subprocess
import sys
from typing import Callable, Optional

import torch

from .._paths import on_generated_source, shaders_dir
from ..caches import LRU
from ..native import launcher, load_launcher
from ..planner.plan import Plan
from ..planner.tiles import NAX_FAMILY
import torch_metal_flash.backends.faults as faults


def chip_name() -> str:
    """The machine's chip (the GPU's name on a Mac: the tuning cache is kept per chip)."""
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """None when the metal backend can run on ``device`` (default: the MPS device), else why not."""
    if device is not None and device.type != "mps":
        return f"the metal backend runs on MPS tensors, got {device.type}"
    module, why = load_launcher()
    if module is None:
        return why
    if device is None and not torch.backends.mps.is_available():
        return "torch reports no usable MPS device (torch.backends.mps.is_available() is False)"
    return None


def planning_family(hw_family: str, accelerator_reason: str) -> str:
    """The family whose tile tables the Metal backend plans with, given the GPU's family
    (``_C.gpu_family()``) and ``_C.neural_accelerators()`` ("" when that path can run).

    ``apple10`` (the neural-accelerator tables) needs both an apple10-or-newer GPU and the
    path; such a GPU without it (macOS before 26.2, say) plans as ``apple9``, the
    simdgroup-matrix tables.  Other families are returned as they are (the planner names
    those it cannot serve).
    """
    if not isinstance(hw_family, str):
        raise TypeError(f"planning_family: hw_family must be a str, got {type(hw_family).__name__}")
    if not isinstance(accelerator_reason, str):
        raise TypeError(f"planning_family: accelerator_reason must be a str, got {type(accelerator_reason).__name__}")
    number = hw_family[5:]
    if not (hw_family.startswith("apple") and number.isdigit() and int(number) >= int(NAX_FAMILY[5:])):
        return hw_family
    return NAX_FAMILY if accelerator_reason == "" else "apple9"


def build_stage(message: str) -> str:
    """Which step of building a kernel the launcher's error ``message`` reports (csrc/metal/launcher.mm:
    the library's compile, specialising the function, or the pipeline state)."""
    if "cannot specialise kernel" in message or "has no kernel named" in message:
        return "function"
    if "cannot build the pipeline state" in message:
        return "pipeline"
    return "compile"


_pipeline_infos = LRU("metal.pipeline_info", 1024)  # the pipelines themselves stay in _C


class MetalBackend:
    name = "metal"

    def __init__(self):
        self._C = launcher()
        self._C.set_shader_dir(str(shaders_dir()))
        on_generated_source(self._C.register_source)  # run-time sources (FlexAttention) next to shaders/
        self.hardware_family = self._C.gpu_family()
        # "" when the neural-accelerator path (MSL 4.0 *_nax.metal kernels) can run, else why not
        self.neural_accelerators_reason = self._C.neural_accelerators()
        self.family = planning_family(self.hardware_family, self.neural_accelerators_reason)  # the tile tables

    def pipeline_info(self, source: str, kernel: str, function_constants: dict) -> dict:
        """The pipeline's limits (``_C.pipeline_info``: builds the pipeline once, then cached).
        A kernel that cannot be built raises
        :class:`~torch_metal_flash.planner.limits.KernelBuildError`, remembered (:mod:`.faults`;
        the launcher keeps the failure in its slot too, so nothing is compiled twice)."""
        faults.check(self.name, source, kernel)
        constants = sorted(function_constants.items())
        key = (source, kernel, tuple(constants))
        info = _pipeline_infos.get(key)
        if info is None:
            try:
                info = dict(self._C.pipeline_info(source, kernel, constants))
            except RuntimeError as e:
                raise faults.remember(self.name, source, kernel, build_stage(str(e)), str(e)) from None
            _pipeline_infos.put(key, info)
        return info

    def run(self, plan: Plan) -> None:
        """Encode a plan as it is (the ops replay cached templates in C++ instead)."""
        _run_plan("metal", plan)


def _no_runner(backend_name: str, plan: Plan) -> None:
    raise RuntimeError("torch_metal_flash: the C++ core is not imported; import torch_metal_flash first")


_run_plan: Callable[[str, Plan], None] = _no_runner


def run_plans_with(runner: Callable[[str, Plan], None]) -> None:
    """The core's encoder runs :meth:`MetalBackend.run`'s plans (the core registers it: it sits above)."""
    global _run_plan
    _run_plan = runner
