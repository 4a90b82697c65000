"""Kernels that cannot be built, remembered for the process, and injected faults.

A kernel whose library fails to compile, or whose function or pipeline fails to
build, stays unusable for the process together with the compiler's message: each
backend's ``pipeline_info`` raises the remembered
:class:`~torch_metal_flash.planner.limits.KernelBuildError` before building anything,
so no later call compiles it again, and the planners try the next variant (the op
falls back, naming the kernel, when none is left).  A library that fails to compile
marks every kernel of it.

:func:`torch_metal_flash.testing.inject_faults` makes kernels fail here as a real
compiler would; leaving it forgets those failures.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch_metal_flash.caches as caches
from ..planner.limits import KernelBuildError

_WHOLE_LIBRARY = ""  # the kernel name under which a library's compile failure is kept
_failed: dict[tuple[str, str, str], tuple[str, str, Optional["Injection"]]] = {}  # -> (stage, message, cause)
_injections: list["Injection"] = []
_lock = threading.Lock()
# Caches that would let a call skip the checks here: plans and pipeline limits built before a fault (and the
# fallback warnings already given, so that a fault's warning is seen).
_PLANNING_CACHES = ("plan", "metal.pipeline_info", "emulator.pipeline_info", "fallback_warnings")


@dataclasses.dataclass(eq=False)
class Injection:
    """Faults for kernels whose names contain ``compile`` (their library fails to compile) or ``pipeline``
    (their pipeline fails to build); ``fired``: how many fired."""
    compile: Optional[str] = None
    pipeline: Optional[str] = None
    fired: int = 0


def check(backend: str, source: str, kernel: str) -> None:
    """Raise the remembered failure of ``kernel`` (of ``source``) on ``backend``, or the injected fault that
    matches it first (remembered from then on)."""
    with _lock:
        found = _failed.get((backend, source, kernel)) or _failed.get((backend, source, _WHOLE_LIBRARY))
        if found is None:
            for inj in reversed(_injections):
                stage = "compile" if inj.compile and inj.compile in kernel else \
                    "pipeline" if inj.pipeline and inj.pipeline in kernel else None
                if stage is not None:
                    pattern = inj.compile if stage == "compile" else inj.pipeline
                    found = (stage, f"injected fault (torch_metal_flash.testing.inject_faults({stage}={pattern!r}))",
                             inj)
                    _failed[(backend, source, kernel)] = found
                    inj.fired += 1
                    break
    if found is not None:
        raise KernelBuildError(kernel, found[0], found[1])


def remember(backend: str, source: str, kernel: str, stage: str, message: str) -> KernelBuildError:
    """Mark ``kernel`` (the whole library of ``source`` for stage "compile") unusable on ``backend``; returns
    the error to raise."""
    with _lock:
        _failed[(backend, source, _WHOLE_LIBRARY if stage == "compile" else kernel)] = (stage, message, None)
    return KernelBuildError(kernel, stage, message)


def failures() -> dict[tuple[str, str, str], str]:
    """``{(backend, source, kernel): reason}`` of the kernels marked unusable ("" kernel: a whole library)."""
    with _lock:
        return {key: KernelBuildError(key[2] or f"shaders/{key[1]}", stage, message).reason
                for key, (stage, message, _) in _failed.items()}


def reset() -> None:
    """Forget every failure (a process that changed its compiler or shaders; tests)."""
    with _lock:
        _failed.clear()
    _clear_planning_caches()


def _clear_planning_caches() -> None:
    registered = caches.registered()
    for name in _PLANNING_CACHES:
        if name in registered:
            registered[name][1]()


def push(inj: Injection) -> None:
    with _lock:
        _injections.append(inj)
    _clear_planning_caches()


def pop(inj: Injection) -> None:
    """End ``inj``: its faults and the failures they caused are forgotten."""
    with _lock:
        _injections.remove(inj)
        for key in [key for key, (_, _, cause) in _failed.items() if cause is inj]:
            del _failed[key]
    _clear_planning_caches()
