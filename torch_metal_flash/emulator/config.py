"""Launch defaults: checked mode, schedule order, seed; the math mode of the backend.

Precedence: explicit launch argument > innermost :func:`settings` context >
:func:`set_default_checked` > environment (``TORCH_METAL_FLASH_EMULATOR_CHECKED``,
``TORCH_METAL_FLASH_EMULATOR_ORDER``, ``TORCH_METAL_FLASH_EMULATOR_SEED``) >
built-in defaults (checked, forward, 0).

The emulator backend compiles the package's shaders in the math mode the
Metal launcher uses: ``settings(math_mode=...)``, else
``TORCH_METAL_FLASH_MATH_MODE`` (the launcher's variable), else "safe" (the launcher's one mode).
``compile_shader`` itself takes ``math_mode=`` per compile ("fast" by default,
like Metal's ``newLibraryWithSource``).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Callable, Iterator, Optional

ORDERS = ("forward", "reverse", "random")
MATH_MODES = ("fast", "relaxed", "safe")

_ctx: contextvars.ContextVar[dict] = contextvars.ContextVar("tmf_emulator_settings", default={})
_default_checked: Optional[bool] = None


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def set_default_checked(checked: bool) -> None:
    """Process-wide default for `checked=` (instrumented build with exact checks)."""
    global _default_checked
    _default_checked = bool(checked)


def default_checked() -> bool:
    s = _ctx.get()
    if s.get("checked") is not None:
        return s["checked"]
    if _default_checked is not None:
        return _default_checked
    return _env_bool("TORCH_METAL_FLASH_EMULATOR_CHECKED", True)


def check_order(order: str) -> str:
    order = str(order).strip().lower()
    if order not in ORDERS:
        raise ValueError(f"emulator: unknown schedule order {order!r}; expected one of {', '.join(ORDERS)}")
    return order


def default_order() -> str:
    s = _ctx.get()
    if s.get("order") is not None:
        return s["order"]
    return check_order(os.environ.get("TORCH_METAL_FLASH_EMULATOR_ORDER", "forward") or "forward")


def default_seed() -> int:
    s = _ctx.get()
    if s.get("seed") is not None:
        return s["seed"]
    return int(os.environ.get("TORCH_METAL_FLASH_EMULATOR_SEED", "0") or 0)


def check_math_mode(mode: str) -> str:
    mode = str(mode).strip().lower()
    if mode not in MATH_MODES:
        raise ValueError(f"emulator: unknown math mode {mode!r}; expected one of {', '.join(MATH_MODES)}")
    return mode


def backend_math_mode() -> str:
    """The math mode the emulator backend compiles the package's shaders in."""
    s = _ctx.get()
    if s.get("math_mode") is not None:
        return s["math_mode"]
    return check_math_mode(os.environ.get("TORCH_METAL_FLASH_MATH_MODE", "safe") or "safe")


def default_timeout() -> float:
    return float(os.environ.get("TORCH_METAL_FLASH_EMULATOR_TIMEOUT", "600") or 600)


def default_workers() -> int:
    v = os.environ.get("TORCH_METAL_FLASH_EMULATOR_WORKERS")
    if v:
        return max(1, int(v))
    return max(1, min(8, os.cpu_count() or 1))


DEFAULT_FAMILY = "apple8"  # the emulator backend plans with an M2's tile tables
FAMILIES = ("apple7", "apple8", "apple9", "apple10")


def family_override() -> Optional[str]:
    """The GPU family of the innermost ``settings(family=...)``, or None."""
    return _ctx.get().get("family")


def backend_family() -> str:
    """The GPU family the emulator backend plans as."""
    return family_override() or DEFAULT_FAMILY


def tensor_layout() -> int:
    """The cooperative-tensor layout of tensor ops for the family the emulator runs as (runtime.LAYOUT_*):
    Apple10's on apple10, Apple8/9's (PyTorch's MppAttention.h) below it (docs/emulator.md)."""
    return 0 if backend_family() == "apple10" else 1


@contextlib.contextmanager
def settings(*, order: Optional[str] = None, checked: Optional[bool] = None, seed: Optional[int] = None,
             math_mode: Optional[str] = None, family: Optional[str] = None) -> Iterator[None]:
    """Defaults for launches in this context (also those the emulator backend
    makes; ``math_mode`` applies to the backend's shader libraries; ``family``
    (``"apple7"`` ... ``"apple10"``) is the GPU family whose tile tables the
    backend plans with, default apple8, and whose cooperative-tensor layout
    every launch's tensor ops use)::

        with emulator.settings(order="reverse", checked=True, math_mode="fast", family="apple9"):
            out = op(...)
    """
    new = dict(_ctx.get())
    if order is not None:
        new["order"] = check_order(order)
    if checked is not None:
        new["checked"] = bool(checked)
    if seed is not None:
        new["seed"] = int(seed)
    if math_mode is not None:
        new["math_mode"] = check_math_mode(math_mode)
    if family is not None:
        if family not in FAMILIES:
            raise ValueError(f"emulator: unknown GPU family {family!r}; expected one of {', '.join(FAMILIES)}")
        new["family"] = family
    token = _ctx.set(new)
    if family is not None:
        _family_changed()
    try:
        yield
    finally:
        _ctx.reset(token)
        if family is not None:
            _family_changed()


_family_listeners: list[Callable[[Optional[str]], None]] = []


def on_family_change(listener: Callable[[Optional[str]], None]) -> None:
    """Call ``listener(family)`` when a :func:`settings` context sets or restores the family
    (the package's plan cache keys on it; the emulator imports nothing of the package)."""
    _family_listeners.append(listener)


def _family_changed() -> None:
    for listener in _family_listeners:
        listener(family_override())
