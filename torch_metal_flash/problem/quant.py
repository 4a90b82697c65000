"""Quantized tensors for KV caches: affine 4/8-bit (MLX packing) and symmetric int8.

::

    qt = tmf.quantize(x, bits=4, group_size=64)                   # affine (default)
    qt = tmf.quantize(x, bits=8, group_size=32, mode="symmetric") # int8, one fp16 scale per 32 values
    x_hat = qt.dequantize()                                       # qt.shape, qt.dtype
    cache = tmf.quantized_zeros((B, L_max, H_kv, D), bits=4, group_size=64, dtype=torch.float16, device="mps")

A :class:`QuantizedTensor` stands for a tensor of ``shape (..., D)`` and
``dtype`` quantized along its last dim in groups of ``group_size`` consecutive
values (the last group of a row is shorter when ``group_size`` does not divide
``D``):

* ``mode="affine"``, ``bits`` 4 or 8: ``data`` int32 ``(..., D * bits / 32)``
  (uint32 words; element ``j`` of a row sits in bits ``(j % (32 / bits)) *
  bits`` and up of word ``j // (32 / bits)``, as MLX packs them),
  ``scales`` and ``biases`` ``(..., ceil(D / group_size))`` in ``dtype``;
  ``x_hat = scale * q + bias`` with ``q`` in ``[0, 2**bits - 1]``.
* ``mode="symmetric"`` (int8): ``data`` int8 ``(..., D)``, ``scales`` float16
  ``(..., ceil(D / group_size))``, ``biases`` None; ``x_hat = scale * q``
  with ``q`` in ``[-127, 127]``.

Rounding (the same in :func:`quantize` and in the kernels that quantize rows
as they are appended to a cache, ``shaders/kv_quant.h``; float32 arithmetic,
round-half-to-even):

* affine: ``bias = min(group)`` (exact: it is a value of ``dtype``),
  ``scale = (max - min) / (2**bits - 1)`` rounded **up** to ``dtype``,
  ``q = rint((x - bias) / scale)``;
* symmetric: ``scale = max|group| / 127`` rounded **up** to float16 (at most
  65504: larger groups saturate), ``q = clamp(rint(x / scale), -127, 127)``;
* a group with ``scale == 0`` (all values equal, or all zero) stores ``q = 0``.

Rounding the scale up keeps every ``(x - bias) / scale`` inside the code range, so
``|x - x_hat| <= scale / 2`` (plus float32 rounding) before ``x_hat`` is rounded
to ``dtype`` (half an ulp of ``x_hat`` more).  :meth:`QuantizedTensor.dequantize`
computes ``scale * q (+ bias)`` in float32 and rounds once to ``dtype``, as the
kernels do in registers.

Views on the leading dims (``qt[:, :n]``, ``qt.transpose(1, 2)``, ``reshape``,
``unsqueeze`` ...) apply to the three component tensors alike; the head dim is
never sliced.  Quantized K/V are inference-only: the attention faces raise when
a gradient is requested through them.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

__all__ = ["QuantizedTensor", "quantize", "quantized_zeros", "MODES", "BITS", "GROUP_SIZES"]

MODES = ("affine", "symmetric")
BITS = {"affine": (4, 8), "symmetric": (8,)}
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = {"affine": 64, "symmetric": 32}
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SYM_MAX = 127


def _check_format(bits, group_size, mode) -> tuple[int, int, str]:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if bits is None:
        bits = BITS[mode][0]
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE[mode]
    if isinstance(bits, bool) or bits not in BITS[mode]:
        raise ValueError(f"bits: expected {' or '.join(map(str, BITS[mode]))} for mode={mode!r}, got {bits!r}")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {GROUP_SIZES}, got {group_size!r}")
    return int(bits), int(group_size), mode


def _check_head_dim(name: str, D: int, bits: int, mode: str) -> None:
    if D < 1:
        raise ValueError(f"{name}: the last dim (head dim) must not be empty")
    per_word = 32 // bits if mode == "affine" else 1
    if D % per_word:
        raise ValueError(f"{name}: the last dim ({D}) must be a multiple of {per_word} for {bits}-bit affine "
                         f"quantization (whole uint32 words per row)")


def _words(D: int, bits: int, mode: str) -> int:
    """Last dim of ``data``: uint32 words (affine) or int8 values (symmetric)."""
    return D * bits // 32 if mode == "affine" else D


class QuantizedTensor:
    """A tensor of ``shape`` / ``dtype`` stored quantized along its last dim (see the module doc).

    Build one with :func:`quantize` or :func:`quantized_zeros`, or from existing
    components (e.g. MLX's ``mx.quantize`` output: pass its uint32 words as an
    int32 or uint32 tensor)::

        QuantizedTensor(data, scales, biases, bits=4, group_size=64)              # affine
        QuantizedTensor(data, scales, None, bits=8, group_size=32, mode="symmetric", dtype=torch.bfloat16)
    """

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, biases: Optional[torch.Tensor] = None, *,
                 bits: Optional[int] = None, group_size: Optional[int] = None, mode: str = "affine",
                 dtype: Optional[torch.dtype] = None):
        bits, group_size, mode = _check_format(bits, group_size, mode)
        for name, t in (("data", data), ("scales", scales)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if mode == "affine":
            if data.dtype == torch.uint32:
                data = data.view(torch.int32)
            if data.dtype != torch.int32:
                raise TypeError(f"data: expected int32 (or uint32) words for affine mode, got {data.dtype}")
            if not isinstance(biases, torch.Tensor):
                raise TypeError("biases: affine mode needs a biases tensor (like scales)")
            if scales.dtype not in SCALE_DTYPES or biases.dtype != scales.dtype:
                raise TypeError(f"scales, biases: expected the same dtype, float16, bfloat16 or float32; got "
                                f"{scales.dtype} and {biases.dtype}")
            if dtype is not None and dtype != scales.dtype:
                raise TypeError(f"dtype: affine scales/biases are in the tensor's dtype ({scales.dtype}), got {dtype}")
            dtype = scales.dtype
            D = data.shape[-1] * 32 // bits if data.dim() else 0
        else:
            if data.dtype != torch.int8:
                raise TypeError(f"data: expected int8 for symmetric mode, got {data.dtype}")
            if biases is not None:
                raise ValueError("biases: symmetric mode has no biases (pass None)")
            if scales.dtype != torch.float16:
                raise TypeError(f"scales: expected float16 for symmetric mode, got {scales.dtype}")
            dtype = torch.float16 if dtype is None else dtype
            if dtype not in SCALE_DTYPES:
                raise TypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
            D = data.shape[-1] if data.dim() else 0
        if data.dim() < 1:
            raise ValueError("data: expected at least one dim (the packed last dim)")
        lead = tuple(data.shape[:-1])
        groups = -(-D // group_size)
        for name, t in (("scales", scales), ("biases", biases)):
            if t is None:
                continue
            if tuple(t.shape) != lead + (groups,):
                raise ValueError(f"{name}: expected shape {lead + (groups,)} (one per group of {group_size} values of "
                                 f"the last dim {D}), got {tuple(t.shape)}")
            if t.device != data.device:
                raise ValueError(f"{name}: expected device {data.device}, got {t.device}")
        for name, t in (("data", data), ("scales", scales), ("biases", biases)):
            if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
        self.data, self.scales, self.biases = data, scales, biases
        self.bits, self.group_size, self.mode, self.dtype = bits, group_size, mode, dtype

    # -- the logical tensor -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * 32 // self.bits if self.mode == "affine" else self.data.shape[-1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(tuple(self.data.shape[:-1]) + (self.head_dim,))

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.data.dim()

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def requires_grad(self) -> bool:
        return False

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the components' elements (what the cache occupies, for contiguous ones)."""
        return sum(t.numel() * t.element_size() for t in self._parts())

    def format(self) -> dict:
        """``dict(bits=, group_size=, mode=)``: the storage format."""
        return dict(bits=self.bits, group_size=self.group_size, mode=self.mode)

    def same_format(self, other: "QuantizedTensor") -> bool:
        return isinstance(other, QuantizedTensor) and self.format() == other.format() and self.dtype == other.dtype

    def __repr__(self) -> str:
        return (f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, mode={self.mode!r}, bits={self.bits}, "
                f"group_size={self.group_size}, device={self.device})")

    def dequantize(self) -> torch.Tensor:
        """The tensor ``scale * q (+ bias)`` in float32, rounded once to ``dtype``."""
        D, gs = self.head_dim, self.group_size
        if self.mode == "affine":
            per_word = 32 // self.bits
            shifts = torch.arange(per_word, device=self.device, dtype=torch.int32) * self.bits
            q = ((self.data.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)).flatten(-2)
        else:
            q = self.data
        scale = self.scales.float().repeat_interleave(gs, dim=-1)[..., :D]
        x = scale * q.float()
        if self.biases is not None:
            x = x + self.biases.float().repeat_interleave(gs, dim=-1)[..., :D]
        return x.to(self.dtype)

    # -- views and copies (the leading dims only) ------------------------------------------------
    def _parts(self):
        return [t for t in (self.data, self.scales, self.biases) if t is not None]

    def _map(self, fn) -> "QuantizedTensor":
        return QuantizedTensor(fn(self.data), fn(self.scales), None if self.biases is None else fn(self.biases),
                               bits=self.bits, group_size=self.group_size, mode=self.mode, dtype=self.dtype)

    def _lead_dim(self, dim: int) -> int:
        n = self.dim()
        d = dim + n if dim < 0 else dim
        if not 0 <= d < n:
            raise IndexError(f"dim {dim} out of range for a {n}-D QuantizedTensor")
        if d == n - 1:
            raise IndexError("QuantizedTensor: the last dim (head dim) is quantized; only the leading dims can be "
                             "viewed, indexed or reordered")
        return d

    def _key(self, key) -> tuple:
        """``key`` over the logical dims, checked to leave the last dim whole (the same key
        then indexes every component)."""
        key = key if isinstance(key, tuple) else (key,)

        def width(t):  # dims an index entry consumes
            if t is None or t is Ellipsis:
                return 0
            return t.dim() if isinstance(t, torch.Tensor) and t.dtype == torch.bool else 1
        n = self.dim()
        used = sum(width(t) for t in key)
        if used > n:
            raise IndexError(f"QuantizedTensor: index {key!r} has more entries than the {n} dims")
        if any(t is Ellipsis for t in key):
            at = next(i for i, t in enumerate(key) if t is Ellipsis)
            key = key[:at] + (slice(None),) * (n - used) + key[at + 1:]
        else:
            key = key + (slice(None),) * (n - used)
        consumed = 0
        for t in key:
            consumed += width(t)
            if consumed == n:  # the entry that reaches the last dim
                if not (isinstance(t, slice) and t == slice(None)):
                    raise IndexError(f"QuantizedTensor: index {key!r} reaches the last dim (head dim); only the "
                                     f"{n - 1} leading dims can be indexed")
                break
        return key

    def __getitem__(self, key) -> "QuantizedTensor":
        key = self._key(key)
        return self._map(lambda t: t[key])

    def __setitem__(self, key, value: "QuantizedTensor") -> None:
        if not self.same_format(value):
            raise TypeError(f"QuantizedTensor assignment: expected a QuantizedTensor of the same format and dtype "
                            f"({self.format()}, {self.dtype}), got {value!r}")
        key = self._key(key)
        for mine, theirs in zip(self._parts(), value._parts()):
            mine[key] = theirs

    def transpose(self, dim0: int, dim1: int) -> "QuantizedTensor":
        d0, d1 = self._lead_dim(dim0), self._lead_dim(dim1)
        return self._map(lambda t: t.transpose(d0, d1))

    def permute(self, *dims) -> "QuantizedTensor":
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        n = self.dim()
        norm = [d + n if d < 0 else d for d in dims]
        if sorted(norm) != list(range(n)) or norm[-1] != n - 1:
            raise ValueError(f"QuantizedTensor.permute: expected a permutation of the leading dims that keeps the last "
                             f"dim last, got {dims}")
        return self._map(lambda t: t.permute(*norm))

    def unsqueeze(self, dim: int) -> "QuantizedTensor":
        n = self.dim() + 1
        d = dim + n if dim < 0 else dim
        if not 0 <= d < n - 1:
            raise IndexError(f"QuantizedTensor.unsqueeze: dim {dim} must insert a leading dim")
        return self._map(lambda t: t.unsqueeze(d))

    def reshape(self, *shape) -> "QuantizedTensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if not shape or shape[-1] not in (-1, self.head_dim):
            raise ValueError(f"QuantizedTensor.reshape: the last dim must stay {self.head_dim}, got {shape}")
        lead = shape[:-1]
        return self._map(lambda t: t.reshape(lead + (t.shape[-1],)))

    def flatten(self, start_dim: int = 0, end_dim: int = -2) -> "QuantizedTensor":
        s, e = self._lead_dim(start_dim), self._lead_dim(end_dim)
        return self._map(lambda t: t.flatten(s, e))

    def select(self, dim: int, index: int) -> "QuantizedTensor":
        d = self._lead_dim(dim)
        return self._map(lambda t: t.select(d, index))

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        d = self._lead_dim(dim)
        return self._map(lambda t: t.narrow(d, start, length))

    def index_select(self, dim: int, index: torch.Tensor) -> "QuantizedTensor":
        d = self._lead_dim(dim)
        return self._map(lambda t: t.index_select(d, index))

    def repeat_interleave(self, repeats: int, dim: int) -> "QuantizedTensor":
        d = self._lead_dim(dim)
        return self._map(lambda t: t.repeat_interleave(repeats, dim=d))

    def expand(self, *shape) -> "QuantizedTensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        lead = shape[:-1]
        return self._map(lambda t: t.expand(lead + (t.shape[-1],)))

    def contiguous(self) -> "QuantizedTensor":
        return self._map(lambda t: t.contiguous())

    def clone(self) -> "QuantizedTensor":
        return self._map(lambda t: t.clone())

    def to(self, device: Union[str, torch.device]) -> "QuantizedTensor":
        """Moves the components to ``device`` (the format and dtype stay)."""
        if isinstance(device, torch.dtype):
            raise TypeError("QuantizedTensor.to: only a device; dequantize() gives a tensor of another dtype")
        return self._map(lambda t: t.to(device))

    def cpu(self) -> "QuantizedTensor":
        return self.to("cpu")

    def copy_(self, other: "QuantizedTensor") -> "QuantizedTensor":
        self[...] = other
        return self

    def zero_(self) -> "QuantizedTensor":
        for t in self._parts():
            t.zero_()
        return self


# The ops take a quantized tensor flat (the schemas know no dtype type): its data, scales and
# biases (None: symmetric mode), then (bits, group_size, dtype code).
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def flat_format(qt: QuantizedTensor) -> tuple[int, int, int]:
    """``(bits, group_size, dtype code)`` of ``qt`` as the quantized ops take them."""
    return qt.bits, qt.group_size, DTYPE_CODES[qt.dtype]


def from_flat(data: torch.Tensor, scales: torch.Tensor, biases: Optional[torch.Tensor], bits: int,
              group_size: int, dtype_code: int) -> QuantizedTensor:
    """The QuantizedTensor of an op's flat arguments (affine when ``biases`` is given)."""
    if dtype_code not in _CODE_DTYPES:
        raise ValueError(f"kv_dtype: expected a dtype code in {sorted(_CODE_DTYPES)} (float16, bfloat16, float32), "
                         f"got {dtype_code}")
    mode = "symmetric" if biases is None else "affine"
    return QuantizedTensor(data, scales, biases, bits=bits, group_size=group_size, mode=mode,
                           dtype=_CODE_DTYPES[dtype_code])


# ---------------------------------------------------------------------------
# Quantization (the host side of the rule in shaders/kv_quant.h)
# ---------------------------------------------------------------------------

def _next_up(r: torch.Tensor) -> torch.Tensor:
    """The next representable value above ``r`` (float16 / bfloat16), by its bits."""
    bits = r.view(torch.int16)
    step = torch.where(r > 0, 1, -1).to(torch.int16)
    up = (bits + step).view(r.dtype)
    return torch.where(r == 0, torch.tensor(1, dtype=torch.int16, device=r.device).view(r.dtype), up)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) rounded to ``dtype`` toward +inf (exact for float32)."""
    r = x.to(dtype)
    if dtype == torch.float32:
        return r
    return torch.where(r.float() < x, _next_up(r), r)


def _group_reduce(x: torch.Tensor, group_size: int, op: str, pad: float) -> torch.Tensor:
    D = x.shape[-1]
    groups = -(-D // group_size)
    if groups * group_size != D:
        x = torch.nn.functional.pad(x, (0, groups * group_size - D), value=pad)
    x = x.unflatten(-1, (groups, group_size))
    return x.amax(-1) if op == "max" else x.amin(-1)


def _per_element(g: torch.Tensor, group_size: int, D: int) -> torch.Tensor:
    return g.repeat_interleave(group_size, dim=-1)[..., :D]


@torch.no_grad()
def quantize(x: torch.Tensor, bits: Optional[int] = None, group_size: Optional[int] = None,
             mode: str = "affine") -> QuantizedTensor:
    """Quantize ``x`` (..., D) along its last dim; see the module doc for the format and rounding.

    ``mode="affine"``: ``bits`` 4 (default) or 8, ``group_size`` 32, 64 (default) or 128;
    ``mode="symmetric"``: int8 (``bits=8``), ``group_size`` 32 (default), 64 or 128.
    ``x``: float16, bfloat16 or float32, any device.  Affine packing needs ``D``
    a multiple of ``32 / bits``.  Returns a contiguous :class:`QuantizedTensor`.
    """
    bits, group_size, mode = _check_format(bits, group_size, mode)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SCALE_DTYPES:
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x: expected at least one dim (quantized along the last)")
    D = x.shape[-1]
    _check_head_dim("x", D, bits, mode)
    xf = x.float()
    if mode == "affine":
        n = (1 << bits) - 1
        lo = _group_reduce(xf, group_size, "min", math.inf)
        hi = _group_reduce(xf, group_size, "max", -math.inf)
        bias = lo.to(x.dtype)  # exact: min of the group is a value of x
        scale = round_up((hi - bias.float()) / n, x.dtype)
        s, b = _per_element(scale.float(), group_size, D), _per_element(bias.float(), group_size, D)
        q = torch.where(s > 0, torch.round((xf - b) / torch.where(s > 0, s, 1.0)), 0.0).clamp(0, n).to(torch.int64)
        per_word = 32 // bits
        shifts = torch.arange(per_word, device=x.device, dtype=torch.int64) * bits
        words = (q.unflatten(-1, (-1, per_word)) << shifts).sum(-1)
        data = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        return QuantizedTensor(data.contiguous(), scale.contiguous(), bias.contiguous(), bits=bits,
                               group_size=group_size, mode=mode)
    amax = _group_reduce(xf.abs(), group_size, "max", 0.0)
    scale = round_up(amax / _SYM_MAX, torch.float16).clamp(max=torch.finfo(torch.float16).max)
    s = _per_element(scale.float(), group_size, D)
    q = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, 1.0)), 0.0).clamp(-_SYM_MAX, _SYM_MAX)
    return QuantizedTensor(q.to(torch.int8).contiguous(), scale.contiguous(), None, bits=bits, group_size=group_size,
                           mode=mode, dtype=x.dtype)


def quantized_zeros(shape: Sequence[int], bits: Optional[int] = None, group_size: Optional[int] = None,
                    mode: str = "affine", dtype: torch.dtype = torch.float16,
                    device: Union[str, torch.device, None] = None) -> QuantizedTensor:
    """An all-zero :class:`QuantizedTensor` of logical ``shape`` (..., D), e.g. a KV cache
    ``(B, L_max, H_kv, D)`` for :func:`~torch_metal_flash.flash_attn_with_kvcache`."""
    bits, group_size, mode = _check_format(bits, group_size, mode)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape: expected at least one dim (quantized along the last)")
    if dtype not in SCALE_DTYPES:
        raise TypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    D = shape[-1]
    _check_head_dim("shape", D, bits, mode)
    lead, groups = shape[:-1], -(-D // group_size)
    if mode == "affine":
        data = torch.zeros(lead + (_words(D, bits, mode),), dtype=torch.int32, device=device)
        scales = torch.zeros(lead + (groups,), dtype=dtype, device=device)
        return QuantizedTensor(data, scales, torch.zeros_like(scales), bits=bits, group_size=group_size, mode=mode)
    data = torch.zeros(lead + (D,), dtype=torch.int8, device=device)
    scales = torch.zeros(lead + (groups,), dtype=torch.float16, device=device)
    return QuantizedTensor(data, scales, None, bits=bits, group_size=group_size, mode=mode, dtype=dtype)
