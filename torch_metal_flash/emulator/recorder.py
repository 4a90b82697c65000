"""recording(): collect the LaunchStats of every emulator launch made in a block.

    with emulator.recording() as launches:
        out = tmf.flash_attn_func(q, k, v)      # under tmf.backend("emulator")
    [(s.kernel, s.device_bytes, s.mma) for s in launches]

Every launch counts: kernels of the package's plans (forward, backward, decode
...) and kernels of :func:`compile_shader` libraries called directly.  The
active recordings live in a context variable, so a recording sees only the
launches of its own thread (or asyncio task) and nested recordings each get
every launch made inside them.  A launch that raises is not recorded.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_active: contextvars.ContextVar[tuple] = contextvars.ContextVar("tmf_emulator_recordings", default=())


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """A list that receives the LaunchStats of each launch in this context, in launch order."""
    launches: list = []
    token = _active.set(_active.get() + (launches,))
    try:
        yield launches
    finally:
        _active.reset(token)


def record(stats) -> None:
    for launches in _active.get():
        launches.append(stats)
