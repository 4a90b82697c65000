"""``flash_attn_with_kvcache``: attention of a few new query rows against a KV cache.

Same signature and semantics as ``flash_attn.flash_attn_with_kvcache``
(flash-attn 2.x); see :func:`flash_attn_with_kvcache` and ``docs/kvcache.md``.

The face checks shapes, dtypes and devices -- never index *values*: on MPS,
reading a device tensor on the host drains the GPU queue -- normalises the
arguments (int32 index vectors, causal as a window) and calls the op
``torch.ops.metal_flash.fwd_kvcache`` (ops.py), which mutates the caches and
traces under ``torch.compile``.  On the kernel backends (``metal``,
``emulator``) the op runs ``shaders/kvcache_append.metal`` (rotary of q and the
new k, the write into the cache, contiguous or paged) and the split-K decode
kernels of ``shaders/flash_decode.metal``; both read ``cache_seqlens``,
``cache_leftpad``, ``cache_batch_idx`` and ``block_table`` on the GPU and clamp
or ignore out-of-range values (``shaders/kvcache_index.h``).  With
``TORCH_METAL_FLASH_DEBUG=1`` the op validates the values on the host first,
with clear errors; the reference path (other backends, or what the kernels do
not cover) validates them always (:mod:`torch_metal_flash.reference.kvcache`).
Quantized caches (:mod:`torch_metal_flash.problem.quant`) go to the op
``metal_flash::fwd_kvcache_quantized`` (:meth:`KvCacheProblem.op_call`).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

import torch_metal_flash.ops as ops  # noqa: F401  (ops registers torch.ops.metal_flash)
from ..planner.kvcache import KvCacheProblem
import torch_metal_flash.problem.checks as checks
from ..reference.kvcache import Geometry, apply_rotary, check_rotary_length, check_seqlens

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]

_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _int32_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _in_dtype(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """New rows or a rotary table in ``dtype``, last dim contiguous (small tensors)."""
    if t is None:
        return None
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _int_tensor(name: str, t, batch: int, ndim: int, device: torch.device) -> torch.Tensor:
    """A (batch,) or (batch, n) index tensor as int32 with contiguous rows (converted on
    the device, no sync)."""
    checks.tensor(name, t, ndim=(ndim,))
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected an integer tensor (torch.int32), got dtype {t.dtype}")
    if ndim == 1 and t.shape[0] != batch:
        raise ValueError(f"{name}: expected shape ({batch},) (one entry per batch row of q), got {tuple(t.shape)}")
    if ndim == 2 and t.shape[0] != batch:
        raise ValueError(f"{name}: expected {batch} rows (batch size of q), got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return _int32_rows(t)


def _op_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
             num_splits) -> KvCacheProblem:
    """The op's arguments; the checks run once per call signature (a decode loop repeats one)."""
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits)
    signature = checks.memo_key(*args)
    checked = _CHECKED.get(signature)
    if checked is None:
        problem = _checked_op_args(*args)
        if signature is not None:
            _CHECKED.put(signature, (problem.seqlen, problem.scale, problem.window_left, problem.window_right,
                                     problem.softcap, None if rotary_cos is None else problem.rotary_cos.dtype))
        return problem
    seqlen, scale, left, right, softcap, table = checked
    if rotary_cos is not None:
        rotary_cos, rotary_sin = _in_dtype(rotary_cos, table), _in_dtype(rotary_sin, table)
    return KvCacheProblem(q, k_cache, v_cache, _in_dtype(k, k_cache.dtype), _in_dtype(v, k_cache.dtype),
                          rotary_cos, rotary_sin,
                          _int32_rows(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else None,
                          None if cache_batch_idx is None else _int32_rows(cache_batch_idx),
                          None if cache_leftpad is None else _int32_rows(cache_leftpad),
                          None if block_table is None else _int32_rows(block_table), alibi_slopes, seqlen, scale,
                          left, right, softcap, bool(rotary_interleaved), num_splits)


_CHECKED = checks.Memo("checks.kvcache")


def _checked_op_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
             num_splits) -> KvCacheProblem:
    """Checks shapes, dtypes, devices and host scalars; returns the op's arguments."""
    checks.tensor("q", q, ndim=(4,))
    checks.float_dtype("q", q)
    checks.last_dim_contiguous("q", q)
    checks.head_dim("q", q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.kv_tensor(name, t, ndim=(4,))
        if isinstance(t, torch.Tensor) and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides "
                             f"{t.stride()}; the cache is updated in place, so it cannot be copied")
    checks.kv_dtypes("q", q, ("k_cache", "v_cache"), k_cache, v_cache)
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)} but for the head dim, "
                         f"got {tuple(v_cache.shape)}")
    B, Lq, Hq, D = q.shape
    Dv = v_cache.shape[-1]
    dev = q.device
    nb, blen, Hkv, Dc = k_cache.shape
    checks.dim_equal("k_cache", Dc, D, "head dim (last dim) equal to q's")
    checks.gqa_heads(Hq, Hkv, "q", "k_cache/v_cache")
    if block_table is not None:
        block_table = _int_tensor("block_table", block_table, B, 2, dev)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not supported together with a paged cache (block_table); "
                             "reorder the rows of block_table instead")
        if blen < 1:
            raise ValueError(f"k_cache: paged cache with page_block_size {blen}")
    if cache_batch_idx is not None:
        cache_batch_idx = _int_tensor("cache_batch_idx", cache_batch_idx, B, 1, dev)
    elif block_table is None and nb < B:
        raise ValueError(f"k_cache: has {nb} batch rows but q has {B}; pass cache_batch_idx to pick rows")

    # New keys / values to append.
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    if k is not None:
        for name, t, width in (("k", k, D), ("v", v, Dv)):
            checks.tensor(name, t, ndim=(4,))
            checks.float_dtype(name, t)
            if t.dtype not in (k_cache.dtype, q.dtype):
                raise TypeError(f"{name}: expected dtype {k_cache.dtype} (the cache's) or q's, got {t.dtype}")
            if t.device != dev:
                raise ValueError(f"{name}: expected device {dev}, got {t.device}")
            if tuple(t.shape[:1]) != (B,) or tuple(t.shape[2:]) != (Hkv, width):
                raise ValueError(f"{name}: expected shape ({B}, seqlen_new, {Hkv}, {width}), got {tuple(t.shape)}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"v: expected the shape of k {tuple(k.shape)} but for the head dim, got {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: required when new k/v are given (where to append them)")
        # The new rows only (small): in the cache's dtype, last dim contiguous.
        k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
        if D > 1 and k.stride(-1) != 1:
            k = k.contiguous()
        if Dv > 1 and v.stride(-1) != 1:
            v = v.contiguous()
    g = Geometry.of(q, k_cache, k, block_table, -1, -1)

    # Sequence lengths: a host int is checked here; a tensor's values only in debug mode.
    seqlen = g.capacity
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
            raise TypeError(f"cache_seqlens: expected an int or a ({B},) int32 tensor, "
                            f"got {type(cache_seqlens).__name__}")
        if isinstance(cache_seqlens, torch.Tensor):
            cache_seqlens = _int_tensor("cache_seqlens", cache_seqlens, B, 1, dev)
        else:
            seqlen, cache_seqlens = cache_seqlens, None
            check_seqlens(g, [seqlen] * B)
    if cache_leftpad is not None:
        cache_leftpad = _int_tensor("cache_leftpad", cache_leftpad, B, 1, dev)

    # Window sides at least as long as the cache change nothing (flash-attn clamps
    # them); this also decides whether q is rotated per row ("local").
    left, right = checks.window(window_size, causal, g.capacity)
    g.local = left >= 0 or right >= 0

    # Rotary.
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos, rotary_sin: pass both or neither")
        if k is None:
            raise ValueError("rotary_cos: rotary embedding is applied to the new k (and q); it needs k and v")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            checks.tensor(name, t, ndim=(2,))
            checks.float_dtype(name, t)
            if t.device != dev:
                raise ValueError(f"{name}: expected device {dev}, got {t.device}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_sin: expected the shape of rotary_cos {tuple(rotary_cos.shape)}, "
                             f"got {tuple(rotary_sin.shape)}")
        rd = 2 * rotary_cos.shape[1]
        if rd < 2 or rd > D or rotary_cos.shape[0] < 1:
            raise ValueError(f"rotary_cos: expected shape (seqlen_ro >= 1, rotary_dim / 2) with 2 <= rotary_dim <= "
                             f"head dim {D}, got {tuple(rotary_cos.shape)}")
        if cache_seqlens is None:
            check_rotary_length(g, [seqlen] * B, rotary_cos.shape[0])
        # The kernels read the table in q's dtype or float32 (other dtypes convert exactly, but float64).
        if rotary_cos.dtype not in (q.dtype, torch.float32):
            rotary_cos, rotary_sin = rotary_cos.float(), rotary_sin.float()
        if rd > 2 and rotary_cos.stride(-1) != 1:
            rotary_cos = rotary_cos.contiguous()
        if rd > 2 and rotary_sin.stride(-1) != 1:
            rotary_sin = rotary_sin.contiguous()

    softcap = checks.softcap(softcap)
    alibi_slopes = checks.alibi(alibi_slopes, B, Hq, dev)
    if softmax_scale is None:
        scale = D ** -0.5
    else:
        if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale: expected a finite float, got {softmax_scale!r}")
        scale = float(softmax_scale)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    return KvCacheProblem(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table, alibi_slopes, seqlen, scale, left, right, softcap,
                          bool(rotary_interleaved), num_splits)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False):
    """Drop-in for ``flash_attn.flash_attn_with_kvcache`` (flash-attn 2 semantics). Inference only.

    If ``k`` and ``v`` are given, they are written into ``k_cache``/``v_cache``
    **in place** at positions ``cache_seqlens[b], cache_seqlens[b] + 1, ...``
    (after rotary embedding of ``k``), then ``q`` attends to the updated cache.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim) without
            ``block_table``; (num_blocks, page_block_size, nheads_k, headdim) with
            it (paged cache; any page size).  nheads a multiple of nheads_k (MQA/GQA).
            Same dtype as q (float16, bfloat16, float32; float64 on the reference path),
            float16 / bfloat16 under a float32 q, or quantized (:class:`~.problem.quant.QuantizedTensor`,
            e.g. from :func:`~torch_metal_flash.problem.quant.quantized_zeros`: the new rows are
            quantized by the append kernel, and this call attends to them as stored).
        k, v: optional (batch, seqlen_new, nheads_k, headdim) new keys/values to append,
            in the caches' dtype or q's.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2); rotate the first
            rotary_dim features of k at positions cache_seqlens + t, and of q at
            cache_seqlens + i when causal or local (window), else all q rows at
            cache_seqlens.  Requires k and v.
        cache_seqlens: int or (batch,) int32 tensor: the number of keys already in
            each cache row (None: the whole cache).  Keys attended: [cache_leftpad,
            cache_seqlens + seqlen_new).
        cache_batch_idx: optional (batch,) int32: cache row of each batch row
            (default 0..batch-1).  Not with a paged cache.
        cache_leftpad: optional (batch,) int32: where each row's sequence starts in
            the cache (positions before it are ignored; positions for causal,
            window and ALiBi count from it; rotary positions do not).
        block_table: optional (batch, max_blocks_per_seq) int32: pages of each row.
            Index values are read on the GPU; out-of-range ones are clamped or ignored
            (docs/kvcache.md, "Index values"); ``TORCH_METAL_FLASH_DEBUG=1`` raises instead.
        softmax_scale: default 1 / sqrt(headdim).
        causal: causal mask aligned bottom-right to each row's own key count:
            query i sees keys j <= i + seqlen_k[b] - seqlen_q.
        window_size: (left, right) sliding window, same alignment; -1 = unbounded.
        softcap: > 0 applies softcap * tanh(scores / softcap).
        rotary_interleaved: True pairs features (0,1), (2,3)...; False is GPT-NeoX style.
        alibi_slopes: (nheads,) or (batch, nheads) float32: adds
            -slope * |i + seqlen_k[b] - seqlen_q - j|.
        num_splits: split-K count for the decode kernels (0 = heuristic, 1 = no split).
        return_softmax_lse: also return the float32 (batch, nheads, seqlen_q) log-sum-exp.
    Returns:
        out (batch, seqlen_q, nheads, headdim), and ``softmax_lse`` if asked.
        A row with no visible key gets zeros (lse = +inf).
    """
    op, args = _op_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                        alibi_slopes, num_splits).op_call()
    with torch.no_grad():
        out, lse = op(*args)
    return (out, lse) if return_softmax_lse else out


def append_kv(k_cache, v_cache, k: torch.Tensor, v: torch.Tensor,
              cache_seqlens: Union[int, torch.Tensor], block_table: Optional[torch.Tensor] = None) -> None:
    """Write ``k``/``v`` (batch, seqlen_new, nheads_k, headdim) into the caches at
    ``cache_seqlens`` in place, without attending: :func:`flash_attn_with_kvcache` with
    no query rows (the append kernel alone; quantized caches get the rows quantized)."""
    B, _, H, D = k.shape
    q = torch.empty((B, 0, H, D), dtype=k_cache.dtype, device=k.device)
    flash_attn_with_kvcache(q, k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype),
                            cache_seqlens=cache_seqlens, block_table=block_table)
