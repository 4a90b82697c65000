"""Which backend executes an op, and the fallback policy.

``metal`` encodes plans on the MPS stream, ``emulator`` runs the same plans on
the CPU, ``reference`` is plain PyTorch.  The choice comes from, in order: the
innermost :func:`backend` context, ``TORCH_METAL_FLASH_BACKEND``, then
``auto`` (MPS tensors -> metal, everything else -> reference).

When the chosen backend cannot run a call (the planner's reason, a missing
extension, a device it does not serve), the call falls back to the reference
path with a one-time warning naming the reason; in strict mode it raises
:class:`UnsupportedError` instead.

The ops' bodies run in the C++ core (:mod:`torch_metal_flash.core`), which
mirrors each thread's choice (:func:`backend` tells it through the setter the
core registers with :func:`mirror_choice_to`) and calls back here for the
fallback and the reference path.  This layer sits below the core: it imports
nothing above it.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import threading
import warnings
from typing import Callable, Iterator, Optional

import torch

import torch_metal_flash.caches as caches

BACKENDS = ("auto", "metal", "emulator", "reference")

_choice: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("tmf_backend", default=None)
_strict: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("tmf_strict", default=None)
_tell_core_the_choice: Optional[Callable[[Optional[str]], None]] = None


def mirror_choice_to(setter: Callable[[Optional[str]], None]) -> None:
    """Tell ``setter`` this thread's choice each time :func:`backend` changes it (the C++ core,
    once loaded, keeps its own copy so that a call needs no Python to know its backend)."""
    global _tell_core_the_choice
    _tell_core_the_choice = setter


class UnsupportedError(RuntimeError):
    """Raised in strict mode when a call cannot run on the selected backend."""


class FallbackWarning(UserWarning):
    """A call ran on the reference path instead of the selected backend."""


class KernelsUnavailable(RuntimeError):
    """Raised by an op whose planner found no kernel that can run the call (``reason``), for a caller
    that serves it on the reference path itself (after :func:`fallback`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def requested() -> str:
    """The backend name asked for (may be ``auto``)."""
    name = _choice.get()
    if name is None:
        name = _check_name(os.environ.get("TORCH_METAL_FLASH_BACKEND", "auto").strip().lower() or "auto",
                           "TORCH_METAL_FLASH_BACKEND")
    return name


def is_strict() -> bool:
    strict = _strict.get()
    if strict is None:
        strict = os.environ.get("TORCH_METAL_FLASH_STRICT", "0").strip().lower() not in ("", "0", "false", "no")
    return strict


def is_debug() -> bool:
    """``TORCH_METAL_FLASH_DEBUG=1``: validate index values on the host (kv-cache calls),
    at the cost of a GPU synchronisation per call on MPS."""
    return os.environ.get("TORCH_METAL_FLASH_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def backend(name: str, *, strict: Optional[bool] = None) -> Iterator[None]:
    """Run the enclosed calls on backend ``name`` (``auto|metal|emulator|reference``).

    ``strict=True`` raises :class:`UnsupportedError` instead of falling back.
    """
    token = _choice.set(_check_name(name, "backend()"))
    strict_token = _strict.set(strict) if strict is not None else None
    if _tell_core_the_choice is not None:
        _tell_core_the_choice(name)
    try:
        yield
    finally:
        _choice.reset(token)
        if strict_token is not None:
            _strict.reset(strict_token)
        if _tell_core_the_choice is not None:
            _tell_core_the_choice(_choice.get())


def set_strict(strict: bool) -> None:
    """Process-wide strict mode (same as ``TORCH_METAL_FLASH_STRICT=1``)."""
    os.environ["TORCH_METAL_FLASH_STRICT"] = "1" if strict else "0"


_runs: collections.Counter = collections.Counter()
_runs_lock = threading.Lock()


def record_run(name: str) -> None:
    """Count one op call executed by backend ``name``."""
    with _runs_lock:
        _runs[name] += 1


_more_runs: list[Callable[[bool], dict]] = []


def count_runs_from(counter: Callable[[bool], dict]) -> None:
    """Add ``counter(reset) -> {backend: runs}`` to :func:`run_counts` (the C++ core counts the plans it encodes)."""
    _more_runs.append(counter)


def run_counts(reset: bool = False) -> dict[str, int]:
    """How many op calls each backend executed (``reference`` includes fallbacks)."""
    with _runs_lock:
        counts = collections.Counter(_runs)
        if reset:
            _runs.clear()
    for counter in _more_runs:
        counts.update(counter(reset))
    return dict(counts)


_warned = caches.LRU("fallback_warnings", 1024)  # reasons already warned about
_warned_lock = threading.Lock()


class Declined(Exception):
    """Raised by :func:`fallback` inside :func:`declining`: the caller serves the call elsewhere."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_declining = threading.local()


class _Declining:
    # a plain class, not contextlib's generator: the override enters it on every inference call
    def __enter__(self) -> None:
        _declining.depth = getattr(_declining, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _declining.depth -= 1


_DECLINING = _Declining()


def declining() -> _Declining:
    """Calls inside (a ``with`` block) that would fall back to the reference path raise
    :class:`Declined` instead (no warning, nothing run): a drop-in that has a better fallback
    of its own (torch's original) tries the kernels first rather than asking the planner twice."""
    return _DECLINING


def fallback(reason: str) -> None:
    """Record that a call runs on the reference path; warn once per reason."""
    if getattr(_declining, "depth", 0):
        raise Declined(reason)
    if is_strict():
        raise UnsupportedError(f"torch_metal_flash (strict): {reason}")
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(f"torch_metal_flash: falling back to the reference path: {reason}",
                  FallbackWarning, stacklevel=3)


def select(device: torch.device):
    """``(backend, None)`` for the backend that serves tensors on ``device``;
    ``(None, None)`` when the reference path is the choice, ``(None, reason)``
    when the requested backend cannot serve the device."""
    name = requested()
    if name == "auto":
        name = "metal" if device.type == "mps" else "reference"
    if name == "reference":
        return None, None
    if name == "metal":
        from . import metal
        why = metal.unavailable_reason(device)
    else:
        why = None if device.type == "cpu" else f"the emulator backend runs on CPU tensors, got {device.type}"
    if why is not None:
        return None, why
    return instance(name), None


def instance(name: str):
    """The process's ``metal`` or ``emulator`` backend object."""
    if name not in _instances:
        with _instances_lock:
            if name not in _instances:
                if name == "metal":
                    from .metal import MetalBackend
                    _instances[name] = MetalBackend()
                else:
                    from .emulator import EmulatorBackend
                    _instances[name] = EmulatorBackend()
    return _instances[name]


def resolve(device: torch.device):
    """Like :func:`select`, but reports a backend that cannot serve (see :func:`fallback`)."""
    chosen, why = select(device)
    if why is not None:
        fallback(why)
    return chosen


_instances: dict = {}
_instances_lock = threading.Lock()
