"""``flash_attn.flash_attn_interface`` as provided by torch_metal_flash's shim.

Same names, signatures and meaning as the ``flash_attn`` (2.x) package, on
torch_metal_flash's kernels.  Functions whose kernels are not implemented yet
raise :class:`NotImplementedError` naming what is missing; once
``torch_metal_flash.faces.functional`` provides them, the shim forwards to them.
"""
from __future__ import annotations

import importlib

from .. import functional as _functional
from ..functional import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
# (also _get_block_size_n, which flash-attn's own tests import)


# where torch_metal_flash implements each function (looked up at call time, so the shim picks
# implementations up as they land): torch_metal_flash.faces.functional first, then these modules
_PROVIDERS = {"flash_attn_with_kvcache": ("torch_metal_flash.faces.kvcache",)}


def _forward(name: str, missing: str):
    impl = getattr(_functional, name, None)
    for module_name in _PROVIDERS.get(name, ()):
        if impl is not None:
            break
        try:
            impl = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            impl = None
    if impl is None:
        raise NotImplementedError(
            f"flash_attn.{name} is not implemented by torch_metal_flash yet (missing: {missing}); "
            f"use flash_attn_func / torch_metal_flash.scaled_dot_product_attention with padding masks meanwhile")
    return impl


_VARLEN_MISSING = "variable-length attention over cu_seqlens (the varlen kernels)"
_KVCACHE_MISSING = "the decode path with a KV cache (cache_seqlens, in-place append, split-KV kernels)"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn.flash_attn_varlen_func``: q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim),
    ``cu_seqlens_q/k`` int32 (batch + 1,) cumulative sequence lengths."""
    impl = _forward("flash_attn_varlen_func", _VARLEN_MISSING)
    kwargs = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                  return_attn_probs=return_attn_probs)
    if block_table is not None:
        kwargs["block_table"] = block_table
    return impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_varlen_kvpacked_func``: kv (total_k, 2, nheads_k, headdim)."""
    _forward("flash_attn_varlen_func", _VARLEN_MISSING)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: qkv (total, 3, nheads, headdim)."""
    _forward("flash_attn_varlen_func", _VARLEN_MISSING)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block size flash-attn's test helpers (``normalize_flash_attn_S``) split
    ``S_dmask`` by: flash-attn's CUDA kernels write each block's probabilities
    relative to the running max of the blocks seen so far; torch_metal_flash writes
    every element relative to its row's final max, which is one block spanning every
    key (the helpers' cumulative max is then the row max)."""
    return 2 ** 31 - 1


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """``flash_attn.flash_attn_with_kvcache``: q (batch, seqlen_q, nheads, headdim), k_cache/v_cache
    (batch_cache, seqlen_cache, nheads_k, headdim), optional new k/v appended in place at ``cache_seqlens``."""
    impl = _forward("flash_attn_with_kvcache", _KVCACHE_MISSING)
    return impl(q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                num_splits=num_splits, return_softmax_lse=return_softmax_lse)
