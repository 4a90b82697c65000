"""How the decode and append kernels address a K/V cache: a tensor, or a QuantizedTensor.

A plain cache is bound as it is, with its element strides.  A quantized one
(:mod:`torch_metal_flash.problem.quant`, ``shaders/kv_quant.h``) is bound as three
buffers -- the packed words where a plain cache goes, then its scales (and
biases) -- and addressed by row: the kernels take the strides of its leading
dims counted in rows, which must be the same for the three components (true
for what :func:`~torch_metal_flash.problem.quant.quantize` /
:func:`~torch_metal_flash.problem.quant.quantized_zeros` make and for every view of
their leading dims).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..problem.quant import QuantizedTensor

Cache = Union[torch.Tensor, QuantizedTensor]
FORMATS = ("plain", "affine", "symmetric")
# Cache dtypes a float32 q reads directly (mixed precision: the "_kv<dtype>" kernels).
MIXED_KV_DTYPES = (torch.float16, torch.bfloat16)


def kv_format(cache: Cache) -> str:
    return cache.mode if isinstance(cache, QuantizedTensor) else "plain"


def dtype_reason(q_dtype: torch.dtype, kc: Cache, vc: Cache) -> Optional[str]:
    """Why the kernels cannot read caches ``kc``/``vc`` for a q of ``q_dtype``, or None."""
    if isinstance(kc, QuantizedTensor) != isinstance(vc, QuantizedTensor):
        return "k_cache and v_cache must both be quantized, or neither"
    if isinstance(kc, QuantizedTensor) and not kc.same_format(vc):
        return f"k_cache and v_cache formats differ ({kc!r}, {vc!r})"
    if kc.dtype != vc.dtype:
        return f"k_cache and v_cache dtypes differ ({kc.dtype}, {vc.dtype})"
    if kc.dtype != q_dtype and not (q_dtype == torch.float32 and kc.dtype in MIXED_KV_DTYPES):
        return (f"q is {q_dtype} and the caches {kc.dtype}: the kernels take one dtype, or a float32 q over "
                f"float16 / bfloat16 caches")
    return None


def row_strides(cache: Cache, dims: int = 3) -> Optional[tuple[int, ...]]:
    """Strides of the first ``dims`` dims: in elements for a tensor, in rows for a
    QuantizedTensor (None when its components' strides do not agree in rows)."""
    if not isinstance(cache, QuantizedTensor):
        return tuple(cache.stride()[:dims])
    data = cache.data
    out = []
    for d in range(dims):
        if data.shape[d] == 1:
            out.append(0)  # only index 0: any stride
            continue
        rows, rem = divmod(data.stride(d), data.shape[-1])
        if rem or any(t.stride(d) != rows * t.shape[-1] for t in (cache.scales, cache.biases) if t is not None):
            return None
        out.append(rows)
    return tuple(out)


def layout_reason(name: str, cache: Cache) -> Optional[str]:
    """Why the kernels cannot address ``cache``, or None."""
    if not isinstance(cache, QuantizedTensor):
        if cache.shape[-1] > 1 and cache.stride(-1) != 1:
            return f"{name} last dim is not contiguous"
        return None
    if row_strides(cache, cache.dim() - 1) is None:
        return (f"{name}: the strides of its data, scales and biases differ in rows (a view that is not of the "
                f"leading dims of one quantized tensor)")
    if cache.mode == "symmetric" and (cache.head_dim % 4 or (cache.data.storage_offset() % 4)):
        return f"{name}: int8 rows are read as 4-byte words: head dim and offset must be multiples of 4"
    return None


def bind(buffers: dict, cache: Cache, data: int, scales: int, biases: int, sym_scales: int) -> None:
    """Bind ``cache`` at buffer ``data`` (and its scales / biases at the given indices)."""
    if not isinstance(cache, QuantizedTensor):
        buffers[data] = cache
        return
    buffers[data] = cache.data
    if cache.mode == "symmetric":
        buffers[sym_scales] = cache.scales
    else:
        buffers[scales], buffers[biases] = cache.scales, cache.biases


def format_params(cache: Cache) -> tuple[int, int]:
    """(bits, group_size) for the kernels' params (0, 0 for a plain cache)."""
    if isinstance(cache, QuantizedTensor):
        return cache.bits, cache.group_size
    return 0, 0


def row_bytes(cache: Cache) -> int:
    """Device bytes of one cached row (head dim values): packed values, scales and biases."""
    if not isinstance(cache, QuantizedTensor):
        return cache.shape[-1] * cache.element_size()
    return sum(t.shape[-1] * t.element_size() for t in cache._parts())
