"""A Hugging Face ``Cache`` that keeps K/V quantized and feeds them to the kernels as they are.

::

    from torch_metal_flash.integrations import transformers as tmf_hf
    tmf_hf.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="metal_sdpa")
    cache = tmf_hf.QuantizedKVCache(bits=4, group_size=64)      # or mode="symmetric" (int8)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    print(cache.memory())                                        # bytes held vs the same cache in float16

Each layer's ``update`` quantizes the new key/value rows **on the GPU, by the
append kernel** (``flash_attn_with_kvcache`` with no query rows: no host
synchronisation, no dequantized copy) into a (B, H_kv, capacity, D)
:class:`~torch_metal_flash.problem.quant.QuantizedTensor` that grows by doubling, and
returns views of the filled part; the ``metal_sdpa`` attention function passes
them to the quantized op, whose kernels dequantize in registers.  Every step,
prefill included, attends to the stored (quantized) values.  Sliding-window
layers keep every row (the mask, built by transformers for the full length,
applies the window), and attention sinks (``s_aux``) work as with plain K/V.

``dequantize=True`` returns ``dequantize()``-d tensors instead (what
transformers' own ``QuantizedCache`` feeds to any attention implementation):
the same stored values, for comparisons with ``sdpa`` / ``eager``.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..faces.kvcache import append_kv
from ..problem.quant import QuantizedTensor, _check_format, quantized_zeros

__all__ = ["QuantizedKVCache", "QuantizedKVLayer"]

MIN_CAPACITY = 64  # rows per head allocated at first; then the capacity doubles


class QuantizedKVLayer(CacheLayerMixin):
    """One layer's quantized K/V (see the module doc)."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, bits: Optional[int] = None, group_size: Optional[int] = None, mode: str = "affine",
                 dtype: Optional[torch.dtype] = None, dequantize: bool = False):
        super().__init__()
        self.bits, self.group_size, self.mode = _check_format(bits, group_size, mode)
        self.dtype, self.return_dequantized = dtype, dequantize
        self.length = 0
        self._k: Optional[QuantizedTensor] = None  # (B, H_kv, capacity, D)
        self._v: Optional[QuantizedTensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = self.dtype or key_states.dtype
        self._k = self._v = None
        self.is_initialized = True

    def _storage(self, shape) -> QuantizedTensor:
        return quantized_zeros(shape, bits=self.bits, group_size=self.group_size, mode=self.mode, dtype=self.dtype,
                               device=self.device)

    def _reserve(self, key_states: torch.Tensor, rows: int) -> None:
        B, H, _, D = key_states.shape
        cap = 0 if self._k is None else self._k.shape[2]
        if rows <= cap:
            return
        new_cap = max(rows, 2 * cap, MIN_CAPACITY)
        k, v = self._storage((B, H, new_cap, D)), self._storage((B, H, new_cap, D))
        if self.length:
            k[:, :, :self.length] = self._k[:, :, :self.length]
            v[:, :, :self.length] = self._v[:, :, :self.length]
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Quantize ``key_states``/``value_states`` (B, H_kv, L_new, D) into the cache (the append
        kernel) and return the filled part: QuantizedTensor views (B, H_kv, L, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(key_states, self.length + n)
        # The caches seen as flash_attn_with_kvcache's (B, capacity, H_kv, D), the new rows as (B, L_new, H_kv, D).
        append_kv(self._k.transpose(1, 2), self._v.transpose(1, 2), key_states.transpose(1, 2),
                  value_states.transpose(1, 2), self.length)
        self.length += n
        return self._current(dequantize=self.return_dequantized)

    def _current(self, dequantize: bool = False):
        k, v = self._k[:, :, :self.length], self._v[:, :, :self.length]
        return (k.dequantize(), v.dequantize()) if dequantize else (k, v)

    @property
    def keys(self):
        return None if self._k is None else self._current()[0]

    @keys.setter
    def keys(self, value):
        if value is not None:
            raise AttributeError("QuantizedKVLayer.keys is read-only (the cache is written by update())")

    @property
    def values(self):
        return None if self._v is None else self._current()[1]

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("QuantizedKVLayer.values is read-only (the cache is written by update())")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop: pass a negative number of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def _select(self, fn) -> None:
        if self._k is not None:
            self._k, self._v = fn(self._k), fn(self._v)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)).contiguous())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, 0).contiguous())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices].contiguous())

    def offload(self):
        self._select(lambda t: t.to("cpu"))

    def prefetch(self):
        if self._k is not None and self._k.device != self.device:
            self._select(lambda t: t.to(self.device))

    def memory(self) -> tuple[int, int, int]:
        """(bytes allocated, bytes of the filled rows, bytes of the filled rows in the model's dtype)."""
        if self._k is None:
            return 0, 0, 0
        k, v = self._current()
        dense = 2 * k.numel() * torch.empty((), dtype=self.dtype).element_size()
        return self._k.nbytes + self._v.nbytes, k.nbytes + v.nbytes, dense


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` of :class:`QuantizedKVLayer` s: K/V stay quantized (affine
    ``bits`` 4/8 in groups of ``group_size``, or ``mode="symmetric"`` int8); pass it as
    ``past_key_values`` to ``generate`` / ``forward`` of a model using ``attn_implementation="metal_sdpa"``.
    ``dtype``: the logical dtype of the stored values (default: the model's).  ``dequantize=True``:
    layers return dequantized tensors (for other attention implementations, e.g. comparisons)."""

    def __init__(self, bits: Optional[int] = None, group_size: Optional[int] = None, mode: str = "affine",
                 dtype: Optional[torch.dtype] = None, dequantize: bool = False):
        _check_format(bits, group_size, mode)
        settings = dict(bits=bits, group_size=group_size, mode=mode, dtype=dtype, dequantize=dequantize)
        super().__init__(layers=None, layer_class_to_replicate=lambda: QuantizedKVLayer(**settings))

    def memory(self) -> dict:
        """Bytes over all layers: ``allocated`` (capacity), ``used`` (the filled rows, with their
        scales and biases), and ``dense`` (the filled rows unquantized, in the model's dtype)."""
        rows = [layer.memory() for layer in self.layers]
        return {"allocated": sum(r[0] for r in rows), "used": sum(r[1] for r in rows), "dense": sum(r[2] for r in rows)}
