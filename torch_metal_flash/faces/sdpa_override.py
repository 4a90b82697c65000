"""Route ``torch.nn.functional.scaled_dot_product_attention`` to torch_metal_flash.

::

    import torch_metal_flash
    torch_metal_flash.enable_sdpa()            # process-wide, until disable_sdpa()
    with torch_metal_flash.sdpa_override():    # or scoped
        model(x)
    torch_metal_flash.sdpa_stats()             # how many calls went where, and why

How it works: instead of replacing the Python attribute
``torch.nn.functional.scaled_dot_product_attention`` (which misses every
reference captured before enabling, e.g. ``from torch.nn.functional import
scaled_dot_product_attention`` at import time), we register a kernel for the
ATen operator ``aten::scaled_dot_product_attention`` itself, at the dispatch
keys ``AutogradMPS``/``MPS`` and ``AutogradCPU``/``CPU``, through a
``torch.library.Library("aten", "IMPL")`` that :func:`disable_sdpa` destroys
again.  Every path that reaches the operator is therefore covered: ``F.``
attribute look-ups, captured references, ``torch._C._nn.`` calls,
``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` /
``nn.TransformerDecoderLayer`` (their Python path calls SDPA through the
``torch.nn.functional`` module global), ``torch.inference_mode`` (the
backend-key registration), and ``torch.compile`` (the operator is traced into
the graph, where our kernel turns it into the opaque ``metal_flash::fwd`` op).

A call is served by torch_metal_flash when:

* its tensors are on ``mps`` and the Metal backend is selected and available
  (``backend("auto")`` / ``"metal"``), or they are on ``cpu`` and the
  emulator backend is selected (``backend("emulator")``), or CPU routing was
  forced with ``enable_sdpa(cpu=True)`` (runs our reference path: for tests
  and comparisons);
* dtypes are float16/bfloat16/float32 (dropout too: in the kernels, each call
  drawing its mask's Philox seed from the device's default generator), tensors
  are dense (not nested), the last dim is contiguous, shapes, dtypes and the
  mask are valid.

Everything else goes to torch's original implementation, unchanged (including
invalid input, so errors are torch's own).  ``sdpa_stats()`` counts both and
the reasons; the ``torch_metal_flash.sdpa`` logger logs every decision at
DEBUG level.

Not covered (documented in ``docs/dropins.md``): torch's fused C++ fast paths
``torch._native_multi_head_attention`` / ``torch._transformer_encoder_layer_fwd``
(taken only for CPU/CUDA tensors in eval mode without grad, never for MPS
tensors); ``nn.MultiheadAttention(need_weights=True)`` (computes the weights
with bmm + softmax, no SDPA call); direct calls to the lower-level fused ops
(``aten::_scaled_dot_product_flash_attention`` and friends).  Under
``torch.compile`` the routing decision is taken when the graph is traced.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Iterator, Optional

import torch

import torch_metal_flash.backends as backends
import torch_metal_flash.ops as ops
import torch_metal_flash.problem.checks as checks
import torch_metal_flash.faces.stock as stock
from .functional import _as_4d, _sdpa_checks, mask_as_4d, scaled_dot_product_attention, sdpa_checked

__all__ = ["enable_sdpa", "disable_sdpa", "sdpa_override", "sdpa_stats", "reset_sdpa_stats", "is_sdpa_enabled"]

log = logging.getLogger("torch_metal_flash.sdpa")

_OP_NAME = "scaled_dot_product_attention"
_DISPATCH_KEYS = ("AutogradMPS", "MPS", "AutogradCPU", "CPU")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_lock = threading.RLock()
_lib: Optional[torch.library.Library] = None
_depth = 0  # nesting of enable_sdpa() / sdpa_override()
_cpu_modes: list = []  # the cpu= argument of each active enable, innermost last
_cpu_now: Optional[bool] = None  # _cpu_modes[-1] (or None), read without the lock on every call

ROUTED_TO_TORCH = "the tuned route: torch's SDPA is faster for this problem class (docs/tuning.md)"
_stats_lock = threading.Lock()
_stats = {"routed": 0, "original": 0, "traced_routed": 0, "traced_original": 0}
_reasons: collections.Counter = collections.Counter()
_MAX_REASONS = 256


# ----------------------------------------------------------------------------------------------------------------
# public API


def enable_sdpa(*, cpu: Optional[bool] = None) -> None:
    """Route ``F.scaled_dot_product_attention`` calls we can serve to torch_metal_flash.

    ``cpu``: ``None`` (default) routes CPU tensors only while the emulator
    backend is selected; ``True`` routes every CPU call we can serve (to the
    selected backend, normally the reference path: useful for testing);
    ``False`` never routes CPU tensors.  Calls nest: each ``enable_sdpa()``
    needs its own ``disable_sdpa()``; the innermost ``cpu`` wins.
    """
    if cpu is not None and not isinstance(cpu, bool):
        raise TypeError(f"cpu: expected None, True or False, got {cpu!r}")
    global _lib, _depth
    with _lock:
        if _lib is None:
            lib = torch.library.Library("aten", "IMPL")
            for key in _DISPATCH_KEYS:
                lib.impl(_OP_NAME, _kernel, key)
            _lib = lib
            _clear_python_dispatch_cache()
        _depth += 1
        _cpu_modes.append(cpu)
        _set_cpu_now()


def disable_sdpa() -> None:
    """Undo one :func:`enable_sdpa`; the last one restores torch's original dispatch.

    Calling it when the override is not enabled is a no-op.
    """
    global _lib, _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        _cpu_modes.pop()
        _set_cpu_now()
        if _depth == 0 and _lib is not None:
            _lib._destroy()
            _lib = None
            _clear_python_dispatch_cache()


def is_sdpa_enabled() -> bool:
    return _lib is not None


@contextlib.contextmanager
def sdpa_override(*, cpu: Optional[bool] = None) -> Iterator[None]:
    """Context manager form of :func:`enable_sdpa` / :func:`disable_sdpa`."""
    enable_sdpa(cpu=cpu)
    try:
        yield
    finally:
        disable_sdpa()


def sdpa_stats() -> dict:
    """Counts since the last :func:`reset_sdpa_stats`.

    ``routed``/``original``: eager calls served by torch_metal_flash / sent to
    torch's implementation; ``traced_routed``/``traced_original``: the same
    decisions taken while ``torch.compile`` traced a graph (each compiled run
    then repeats the decision without passing here); ``reasons``: why calls
    went to the original, with counts.
    """
    with _stats_lock:
        out = dict(_stats)
        out["reasons"] = dict(_reasons)
    return out


def reset_sdpa_stats() -> None:
    with _stats_lock:
        for key in _stats:
            _stats[key] = 0
        _reasons.clear()


# ----------------------------------------------------------------------------------------------------------------
# the dispatcher kernel


def _clear_python_dispatch_cache() -> None:
    """torch's Python dispatcher (used while torch.compile traces) caches the kernel it resolved per
    dispatch key on the OpOverload; it must not keep using a resolution from before (or during) the
    override.  Without this, a graph traced after disable_sdpa() dispatched to a stale entry."""
    cache = getattr(_aten_original(), "_dispatch_cache", None)
    if isinstance(cache, dict):
        cache.clear()


def _aten_original():
    return torch.ops.aten.scaled_dot_product_attention.default


def _call_original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    # torch's own CompositeImplicitAutograd kernel: exactly what the operator runs without us.
    return stock.original_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _set_cpu_now() -> None:
    global _cpu_now
    _cpu_now = _cpu_modes[-1] if _cpu_modes else None


def _cpu_mode() -> Optional[bool]:
    return _cpu_now


def _device_reason(device: torch.device) -> Optional[str]:
    """None when torch_metal_flash's kernels (or, forced, its CPU path) serve ``device``."""
    name = backends.requested()
    if device.type == "mps":
        if name not in ("auto", "metal"):
            return f"backend {name!r} selected for MPS tensors"
        import torch_metal_flash.backends.metal as metal
        return metal.unavailable_reason(device)
    if device.type == "cpu":
        mode = _cpu_mode()
        if mode is True:
            return None
        if mode is False:
            return "CPU routing disabled (enable_sdpa(cpu=False))"
        if name != "emulator":
            return f"CPU tensor with backend {name!r} (route CPU calls with backend('emulator') " \
                   f"or enable_sdpa(cpu=True))"
        return None
    return f"device {device.type} is not served by torch_metal_flash"


def _broadcasts(shape, target) -> bool:
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _checks(tracing: bool, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple:
    """``(reason, face_checks, signature)``: why a call goes to torch's original whatever the kernels
    say (or None), and the SDPA face's own checks of it.  Memoised per call signature
    (with the selected backend and the CPU routing mode)."""
    signature = None
    if not tracing:
        try:
            call = checks.memo_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        except RuntimeError:  # nested tensors: no memo
            call = None
        if call is not None:
            signature = (call, backends.requested(), _cpu_mode())
    checked = _CHECKED.get(signature)
    if checked is None:
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        reason, face_checks = _argument_reason(*args), None
        if reason is None:
            try:
                face_checks = _sdpa_checks(*args)
            except (ValueError, TypeError, RuntimeError) as exc:  # torch's original gives its own error
                reason = f"invalid arguments: {exc}"
        checked = (reason, face_checks)
        if signature is not None:
            _CHECKED.put(signature, checked)
    return (*checked, signature)


_CHECKED = checks.Memo("checks.override")


def _argument_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Optional[str]:
    """Why a call goes to torch's original whatever the kernels say, or None."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "non-tensor query/key/value"
    if any(t.is_nested for t in tensors) or (attn_mask is not None and attn_mask.is_nested):
        return "nested tensors"
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        return "dropout_p outside [0, 1]"
    if query.dtype not in _KERNEL_DTYPES:
        return f"dtype {query.dtype}"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return "query/key/value dtypes differ"
    if key.device != query.device or value.device != query.device:
        return "query/key/value devices differ"
    device_reason = _device_reason(query.device)
    if device_reason is not None:
        return device_reason
    if not query.dim() == key.dim() == value.dim() or query.dim() < 2:
        return "query/key/value ranks differ or are < 2"
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in tensors):
        return "non-contiguous last dimension"
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        return "empty tensors"
    if key.shape[-1] != query.shape[-1] or value.shape[-2] != key.shape[-2]:
        return "shape mismatch"
    if query.dim() >= 3:
        if key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3]:
            return "batch dims differ (broadcast batch)"
        hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if hk != hv:
            return "key/value head counts differ"
        if hq != hk and hk != 1 and not (enable_gqa and hq % hk == 0):
            return "query/key head counts incompatible"
    if scale is not None and not isinstance(scale, (int, float)):
        return "non-float scale"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return "non-tensor attn_mask"
        if attn_mask.device != query.device:
            return "attn_mask on another device"
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            return f"attn_mask dtype {attn_mask.dtype}"
        if not _broadcasts(tuple(attn_mask.shape), tuple(query.shape[:-2]) + (query.shape[-2], key.shape[-2])):
            return "attn_mask does not broadcast"
    return None


def _kernel_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Optional[str]:
    """Ask the ops layer whether the kernels serve this call (a call they do not serve would run
    on our reference path, which is no better than torch's original)."""
    if query.device.type == "cpu" and _cpu_mode() is True:
        return None
    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    mask = None
    if attn_mask is not None:
        mask = mask_as_4d(attn_mask, tuple(query.shape[:-2]) + (query.shape[-2], key.shape[-2]))
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    try:
        return ops.unsupported_reason(q, k, v, mask, None, None, scale, 0, -1, 0 if is_causal else -1, 0.0,
                                      dropout_p=float(dropout_p))
    except Exception as exc:  # noqa: BLE001
        if _is_tracing():
            return None  # e.g. fake tensors have no data pointer: the op decides at run time
        return f"kernel probe failed: {type(exc).__name__}: {exc}"


def _is_tracing() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:  # pragma: no cover
        return False


def _record(routed: bool, reason: Optional[str], query, traced: bool) -> None:
    key = ("traced_" if traced else "") + ("routed" if routed else "original")
    with _stats_lock:
        _stats[key] += 1
        if reason is not None:  # distinct reasons are bounded (they may carry sizes)
            _reasons[reason if reason in _reasons or len(_reasons) < _MAX_REASONS else "(other reasons)"] += 1
    if log.isEnabledFor(logging.DEBUG):
        where = "torch_metal_flash" if routed else f"torch original ({reason})"
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else None
        log.debug("scaled_dot_product_attention%s %s %s -> %s", " (tracing)" if traced else "", shape,
                  getattr(query, "device", None), where)


def _kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    tracing = _is_tracing()
    reason, face_checks, signature = _checks(tracing, *args)
    out = None
    if reason is None and stock.takes_torch(signature, query, key, value, attn_mask, dropout_p, is_causal):
        _record(False, ROUTED_TO_TORCH, query, tracing)
        return stock.run_torch(*args)
    if reason is None:
        if tracing or _cpu_mode() is True or dropout_p > 0 or ops.needs_grad(query, key, value, attn_mask):
            # Ask first: the backward must be served too, a dropout call must not draw its seed
            # twice, a traced call has no data, forced CPU routing serves everything.
            reason = _kernel_reason(*args)
            if reason is None:
                out = scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                   enable_gqa=enable_gqa)
        else:
            try:  # the common inference call: one trip through the op, which declines what it cannot run
                with backends.declining():
                    out = sdpa_checked(query, key, value, attn_mask, face_checks)
            except backends.Declined as declined:
                reason = declined.reason
    _record(reason is None, reason, query, tracing)
    if reason is not None:
        return _call_original(*args)
    return out
