"""Launch defaults: checked mode, schedule order, seed.

Precedence: explicit launch argument > innermost :func:`settings` context >
:func:`set_default_checked` > environment (``TORCH_METAL_FLASH_EMULATOR_CHECKED``,
``TORCH_METAL_FLASH_EMULATOR_ORDER``, ``TORCH_METAL_FLASH_EMULATOR_SEED``) >
built-in defaults (checked, forward, 0).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Optional

ORDERS = ("forward", "reverse", "random")

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


def default_timeout() -> float:
    return float(os.environ.get("TORCH_METAL_FLASH_EMULATOR_TIMEOUT", "600") or 600)


def default_workers() -> int:
    v = os.environ.get("TORCH_METAL_FLASH_EMULATOR_WORKERS")
    if v:
        return max(1, int(v))
    return max(1, min(8, os.cpu_count() or 1))


@contextlib.contextmanager
def settings(*, order: Optional[str] = None, checked: Optional[bool] = None, seed: Optional[int] = None) -> Iterator[None]:
    """Defaults for launches in this context (also those the emulator backend makes)::

        with emulator.settings(order="reverse", checked=True):
            out = op(...)
    """
    new = dict(_ctx.get())
    if order is not None:
        new["order"] = check_order(order)
    if checked is not None:
        new["checked"] = bool(checked)
    if seed is not None:
        new["seed"] = int(seed)
    token = _ctx.set(new)
    try:
        yield
    finally:
        _ctx.reset(token)
