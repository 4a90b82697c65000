"""Route ``torch.nn.attention.flex_attention.flex_attention`` to :func:`flex_attention`.

::

    torch_metal_flash.enable_flex()            # process-wide, until disable_flex()
    with torch_metal_flash.flex_override():    # or scoped
        model(x)

The module attribute is replaced (flex_attention is a Python function, not an
ATen operator): code that looks it up at call time --
``torch.nn.attention.flex_attention.flex_attention(...)``, or a module that
imported the module -- is routed; a reference captured before enabling
(``from ... import flex_attention`` at import time) is not.  A call is served
when its tensors are on ``mps`` with the Metal backend selected, or on ``cpu``
with the emulator backend selected (``backend("emulator")``); everything else,
and calls asking for what only torch's kernels give (``return_aux`` beyond the
lse, ``kernel_options`` are ignored), goes to torch's original unchanged.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch.nn.attention import flex_attention as torch_flex

import torch_metal_flash.backends as backends
from .attention import flex_attention

_original = torch_flex.flex_attention
_lock = threading.Lock()


@torch._dynamo.assume_constant_result  # torch.compile decides once, when it traces the call
def _serves(device_type: str) -> bool:
    name = backends.requested()
    if name == "auto":
        name = "metal" if device_type == "mps" else "reference"
    return (name, device_type) in (("metal", "mps"), ("emulator", "cpu"))


def _routed(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
            kernel_options=None, *, return_aux=None):
    wants_lse_only = return_aux is None or (getattr(return_aux, "lse", False)
                                            and not getattr(return_aux, "max_scores", False))
    if not _serves(query.device.type) or not wants_lse_only:
        return _original(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                         return_aux=return_aux)
    if return_aux is not None:
        out, lse = flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse=True)
        return out, torch_flex.AuxOutput(lse=lse)
    return flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse)


def enable_flex() -> None:
    """Route torch's ``flex_attention`` to the kernels (see the module docstring)."""
    with _lock:
        torch_flex.flex_attention = _routed


def disable_flex() -> None:
    with _lock:
        torch_flex.flex_attention = _original


def is_flex_enabled() -> bool:
    return torch_flex.flex_attention is _routed


@contextlib.contextmanager
def flex_override() -> Iterator[None]:
    """:func:`enable_flex` inside the block; restores the previous state after."""
    was = is_flex_enabled()
    enable_flex()
    try:
        yield
    finally:
        if not was:
            disable_flex()
