"""Injected kernel faults: a kernel that fails to compile or whose pipeline fails to build, as a new
macOS or Xcode whose compiler rejects it would make it, on whichever backend runs the calls."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch_metal_flash.backends.faults as faults


@contextlib.contextmanager
def inject_faults(compile: Optional[str] = None, pipeline: Optional[str] = None) -> Iterator[faults.Injection]:
    """Inside, every kernel whose name contains ``compile`` fails to compile, and every kernel whose
    name contains ``pipeline`` fails to build its pipeline, in the backend at hand (Metal or emulator).
    The failure flows as a real one: the kernel is remembered as unusable, the planner tries the next
    variant, and with none left the call falls back to the reference path with one
    :class:`~torch_metal_flash.FallbackWarning` naming the kernel (``UnsupportedError`` in strict
    mode).  The object yielded counts the faults that fired (``.fired``).  Leaving forgets the
    injected faults and the failures they caused (plans made meanwhile are dropped too)::

        with tmf.testing.inject_faults(compile="flash_fwd_") as f:
            out = tmf.scaled_dot_product_attention(q, k, v)   # the reference path, one warning
        assert f.fired
    """
    for name, pattern in (("compile", compile), ("pipeline", pipeline)):
        if pattern is not None and (not isinstance(pattern, str) or not pattern):
            raise TypeError(f"inject_faults: {name} must be a non-empty str (part of a kernel name), got {pattern!r}")
    injection = faults.Injection(compile=compile, pipeline=pipeline)
    faults.push(injection)
    try:
        yield injection
    finally:
        faults.pop(injection)
