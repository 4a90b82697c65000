"""Argument checks shared by the public faces: clear errors naming the argument.

The faces remember what their checks concluded per call signature
(:class:`Memo`): the checks read only the shapes, dtypes, devices and last-dim
strides of the tensors and the other arguments' values, so a call with the same
signature skips them; a new signature runs them (raising as ever).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

import torch_metal_flash.caches as caches

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(name: str, t, ndim: Optional[Sequence[int]] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in ndim:
        want = " or ".join(f"{n}-D" for n in ndim)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    return t


def float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")


def same(names: Sequence[str], tensors: Sequence[torch.Tensor], what: str) -> None:
    values = [getattr(t, what) for t in tensors]
    if any(v != values[0] for v in values[1:]):
        listed = ", ".join(f"{n}={v}" for n, v in zip(names, values))
        raise ValueError(f"{', '.join(names)}: expected the same {what}, got {listed}")


def last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides {t.stride()}; "
                         f"call .contiguous() first")


def dim_equal(name: str, got: int, want: int, what: str) -> None:
    if got != want:
        raise ValueError(f"{name}: expected {what} {want}, got {got}")


def gqa_heads(q_heads: int, kv_heads: int, q_name: str = "query", kv_name: str = "key/value") -> None:
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"{q_name} has {q_heads} heads and {kv_name} {kv_heads}: the number of query heads "
                         f"must be a multiple of the number of key/value heads")


def dropout(p) -> float:
    if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {p!r}")
    return float(p)


def broadcastable(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if t.dim() > len(shape) or any(a not in (1, b) for a, b in zip(reversed(t.shape), reversed(shape))):
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not broadcast to {tuple(shape)} "
                         f"(batch, heads, seqlen_q, seqlen_k)")


def window(window_size, causal: bool = False, seqlen_k: Optional[int] = None) -> tuple[int, int]:
    """(left, right) of a flash-attn ``window_size``; ``causal`` sets right = 0.  With
    ``seqlen_k``, a side >= seqlen_k becomes -1 (unbounded), as flash-attn's ``mha_fwd``,
    ``mha_varlen_fwd``, ``mha_bwd`` and ``mha_fwd_kvcache`` all do (see spec.py)."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right) of ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected values >= 0 or -1 (unbounded), got {window_size!r}")
    if causal:
        right = 0
    if seqlen_k is not None:
        left, right = (-1 if w >= seqlen_k else w for w in (left, right))
    return left, right


def alibi(alibi_slopes, batch: int, heads: int, device: torch.device) -> Optional[torch.Tensor]:
    if alibi_slopes is None:
        return None
    tensor("alibi_slopes", alibi_slopes)
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected dtype float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes: expected device {device}, got {alibi_slopes.device}")
    return alibi_slopes


def sinks(s, heads: int, device: torch.device) -> Optional[torch.Tensor]:
    if s is None:
        return None
    tensor("sinks", s)
    float_dtype("sinks", s)
    if tuple(s.shape) != (heads,):
        raise ValueError(f"sinks: expected shape ({heads},) (one logit per query head), got {tuple(s.shape)}")
    if s.device != device:
        raise ValueError(f"sinks: expected device {device}, got {s.device}")
    return s


def _symbolic(value) -> bool:
    """A torch.compile symbol: checked when the graph runs, not while tracing (no guards)."""
    return isinstance(value, (torch.SymInt, torch.SymFloat))


def softcap(value) -> float:
    if _symbolic(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {value!r}")
    return float(value)


def scale(name: str, value) -> float:
    """A softmax scale: a finite number."""
    if _symbolic(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    return float(value)


def head_dim(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] < 1:
        raise ValueError(f"{name}: expected a head dim (last dim) >= 1, got shape {tuple(t.shape)}")


def window_side(name: str, value) -> int:
    if _symbolic(value):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{name}: expected an int >= 0 or -1 (unbounded), got {value!r}")
    return value


def signature(t) -> Any:
    """What the checks read of a tensor argument (``None`` for None); a tensor's
    shape, dtype, device and whether its last dim is contiguous."""
    if t is None:
        return None
    from .quant import QuantizedTensor
    if isinstance(t, QuantizedTensor):  # its last dim is contiguous by construction
        return t.shape, t.dtype, t.device, t.bits, t.group_size, t.mode
    if not isinstance(t, torch.Tensor):
        raise TypeError  # not memoisable: the checks explain
    return t.shape, t.dtype, t.device, t.dim() > 0 and (t.shape[-1] <= 1 or t.stride(-1) == 1)


_native_signature = None  # the C++ core's call signature, once the core is loaded


def use_native_signature(fn) -> None:
    """Let :func:`call_signature` use the C++ core's (``fn(*args)`` -> bytes or None)."""
    global _native_signature
    _native_signature = fn


def call_signature(*args) -> Any:
    """The memo key of a face call with these arguments (tensors, QuantizedTensors, None,
    scalars, tuples of scalars): what the checks read of each (:func:`signature`,
    :func:`scalar`).  Computed in C++ when the core is loaded (a few tensors' Python
    attribute reads would cost as much as the op itself); raises TypeError for an
    argument it cannot key."""
    if _native_signature is not None:
        key = _native_signature(*args)
        if key is not None:
            return key
    return tuple(signature(a) if a is None or not isinstance(a, (bool, int, float, tuple)) else scalar(a)
                 for a in args)


def memo_key(*args) -> Any:
    """:func:`call_signature`, or None where a face must check every call: while
    torch.compile traces (symbolic sizes), or for an argument it cannot key (the checks
    then explain it)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return call_signature(*args)
    except TypeError:
        return None


def scalar(x) -> tuple:
    """A scalar argument with its type (``True`` and ``1.0`` are checked differently)."""
    return type(x), x


class Memo:
    """A face's check results per call signature, listed by
    :func:`torch_metal_flash.cache_info` as ``name``.  Bounded, and emptied when full
    rather than LRU: a hit is one dict lookup, no lock, on every call of the face."""

    def __init__(self, name: str, size: int = 512):
        self._results: dict = {}
        self._size = size
        caches.register(name, lambda: {"size": len(self._results), "maxsize": self._size}, self._results.clear)

    def get(self, key) -> Any:
        try:
            return self._results.get(key)
        except TypeError:  # unhashable (symbolic sizes, odd scalars): check every time
            return None

    def put(self, key, result) -> None:
        try:
            if len(self._results) >= self._size:
                self._results.clear()
            self._results[key] = result
        except TypeError:
            pass


def kv_tensor(name: str, t, ndim: Optional[Sequence[int]] = None):
    """A K/V argument: a tensor, or a :class:`~torch_metal_flash.problem.quant.QuantizedTensor`."""
    from .quant import QuantizedTensor
    if isinstance(t, QuantizedTensor):
        if ndim is not None and t.dim() not in ndim:
            want = " or ".join(f"{n}-D" for n in ndim)
            raise ValueError(f"{name}: expected a {want} tensor, got a QuantizedTensor of shape {tuple(t.shape)}")
        return t
    tensor(name, t, ndim)
    float_dtype(name, t)
    return t


def kv_dtypes(q_name: str, q: torch.Tensor, names: Sequence[str], k, v) -> bool:
    """K and V alike (dtype; the same format when quantized) and readable for ``q``: in q's
    dtype, or float16 / bfloat16 (plain or quantized) under a float32 q (mixed precision).
    Returns whether K/V are quantized."""
    from .quant import QuantizedTensor
    quantized = isinstance(k, QuantizedTensor)
    if quantized != isinstance(v, QuantizedTensor):
        raise TypeError(f"{', '.join(names)}: pass both quantized (QuantizedTensor) or neither, got "
                        f"{type(k).__name__} and {type(v).__name__}")
    if quantized and not k.same_format(v):
        raise ValueError(f"{', '.join(names)}: expected the same quantization format and dtype, got {k!r} and {v!r}")
    mixed = q.dtype == torch.float32 and k.dtype in (torch.float16, torch.bfloat16)
    if k.dtype != v.dtype or (k.dtype != q.dtype and not mixed):
        raise ValueError(f"{q_name}, {', '.join(names)}: expected the same dtype (or {'/'.join(names)} in float16 / "
                         f"bfloat16 under a float32 {q_name}: mixed precision), got {q_name}={q.dtype}, "
                         f"{names[0]}={k.dtype}, {names[1]}={v.dtype}")
    for name, t in zip(names, (k, v)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {t.device}")
    return quantized


def inference_only(what: str, tensors) -> None:
    """Quantized K/V have no backward: a clear error when autograd would need one."""
    if torch.is_grad_enabled():
        for name, t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise RuntimeError(f"{name}: requires grad, but {what} are inference-only (no gradient through "
                                   f"quantized K/V); run under torch.no_grad(), or attend to dequantize()d K/V")
