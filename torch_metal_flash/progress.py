"""Progress of long steps (first-use kernel compiles, the doctor's sweep, tuning) on stderr.

Drawn by tqdm (the optional ``progress`` extra: ``pip install "torch_metal_flash[progress]"``)
when stderr is a terminal; quiet otherwise (logs, CI, pipes).  Without tqdm a terminal gets
one line per step instead.  ``TORCH_METAL_FLASH_PROGRESS=0`` turns it off, ``=1`` on even
when stderr is not a terminal.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, Optional

ENV = "TORCH_METAL_FLASH_PROGRESS"
TICK = 0.5  # seconds between redraws of a step that reports nothing while it runs (a compile)


def enabled() -> bool:
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return sys.stderr is not None and sys.stderr.isatty()


class Bar:
    """One progress bar: ``update(n, text)`` after each finished step."""

    def __init__(self, total: Optional[int], description: str, unit: str):
        self._bar = None
        self._line = None
        self._stop = threading.Event()
        if not enabled():
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._line = description
            sys.stderr.write(f"{description} ...\n")
            return
        self._bar = tqdm(total=total, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True,
                         leave=total is not None, bar_format=None if total else "{desc} {elapsed}")
        threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK):  # keeps the elapsed time moving through a long step
            self._bar.refresh()

    def update(self, n: int = 1, text: Optional[str] = None) -> None:
        if self._bar is not None:
            if text is not None:
                self._bar.set_postfix_str(text[:60], refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def bar(total: Optional[int], description: str, unit: str = "step") -> Iterator[Bar]:
    """A progress bar for the steps inside (``total`` None: a count and the time taken)."""
    b = Bar(total, description, unit)
    try:
        yield b
    finally:
        b.close()
