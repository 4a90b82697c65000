"""The public faces: ``scaled_dot_product_attention`` (torch semantics) and the
``flash_attn`` package API.  Both check their arguments here and map onto the
one ``metal_flash.fwd`` op without copying or transposing memory -- or, for
quantized K/V (:class:`~torch_metal_flash.problem.quant.QuantizedTensor`, inference
only), onto ``metal_flash.fwd_quantized``.  K/V may also be float16 / bfloat16
under a float32 query (mixed precision).  Dropout runs in the kernels, each
call drawing its Philox (seed, offset) from the device's default generator
(:mod:`torch_metal_flash.problem.philox`); the varlen faces make one op call for all
their sequences, reading ``cu_seqlens`` on the GPU only."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

import torch_metal_flash.core as core  # noqa: F401  (ops registers torch.ops.metal_flash)
import torch_metal_flash.ops as ops
import torch_metal_flash.reference as reference
import torch_metal_flash.faces.stock as stock
import torch_metal_flash.problem.checks as checks
import torch_metal_flash.problem.philox as philox
from ..problem.quant import QuantizedTensor, flat_format
from ..problem.spec import stats_dtype


class Varlen(NamedTuple):
    """The varlen arguments of the ops (see :mod:`torch_metal_flash.ops`)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    max_seqlen_q: int
    max_seqlen_k: int


_NO_VARLEN = Varlen(None, None, None, None, 0, 0)


def _attention(q, k, v, mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
               dropout_p, varlen: Optional[Varlen] = None, return_probs: bool = False):
    """(out, lse) for (B, H, L, D)-indexed views (K/V tensors or QuantizedTensors), or
    (1, H, total, D) views of packed sequences with ``varlen``; with ``return_probs``
    and dropout also flash-attn's ``S_dmask`` (:func:`torch.ops.metal_flash.fwd_probs`,
    None without dropout, as flash-attn)."""
    quantized = isinstance(k, QuantizedTensor)
    if sinks is not None and (sinks.dtype != stats_dtype(q.dtype) or not sinks.is_contiguous()):
        sinks = sinks.to(stats_dtype(q.dtype)).contiguous()  # the kernels read float32 sinks
    if dropout_p > 0 or varlen is not None:
        # The dropout and varlen kernels read K/V in q's dtype: quantized or mixed-precision
        # K/V (inference caches) are converted first, a copy.
        if quantized:
            k, v = k.dequantize(), v.dequantize()
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        quantized = False
    elif quantized:
        out, lse = torch.ops.metal_flash.fwd_quantized(q, k.data, v.data, mask, alibi_slopes, sinks, scale,
                                                       diag_offset, window_left, window_right, softcap, k.scales,
                                                       k.biases, v.scales, v.biases, *flat_format(k))
        return (out, lse, None) if return_probs else (out, lse)
    if dropout_p == 0 and varlen is None:  # the common call, positionally (each argument costs a parse)
        out, lse, _ = _FWD(q, k, v, mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                           ops.needs_grad(q, k, v, mask, sinks))
        return (out, lse, None) if return_probs else (out, lse)
    vl = varlen or _NO_VARLEN
    named = dict(q=q, k=k, v=v, attn_mask=mask, alibi_slopes=alibi_slopes, sinks=sinks, scale=scale,
                 diag_offset=diag_offset, window_left=window_left, window_right=window_right, softcap=softcap,
                 dropout_p=float(dropout_p), rng_state=philox.new_rng_state(q.device) if dropout_p > 0 else None,
                 cu_seqlens_q=vl.cu_seqlens_q, cu_seqlens_k=vl.cu_seqlens_k, seqused_k=vl.seqused_k,
                 block_table=vl.block_table, max_seqlen_q=vl.max_seqlen_q, max_seqlen_k=vl.max_seqlen_k)
    out, lse, _ = ops.fwd_call(**named, return_aux=ops.needs_grad(q, k, v, mask, sinks))
    if not return_probs:
        return out, lse
    probs = None
    if dropout_p > 0:
        probs = ops.fwd_probs_call(**{n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in named.items()})
    return out, lse, probs


# The hot paths' call: the overload itself (the packet's __call__ costs a lookup per call), its positional
# arguments checked here against the schema's names.
_FWD = ops.fwd_call.prefix("q", "k", "v", "attn_mask", "alibi_slopes", "sinks", "scale", "diag_offset",
                           "window_left", "window_right", "softcap", "return_aux")


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """SDPA accepts (..., L, E); the op wants (B, H, L, E)."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.reshape((-1,) + tuple(t.shape[-3:]))


def mask_as_4d(attn_mask: torch.Tensor, mask_shape: tuple) -> torch.Tensor:
    """An SDPA mask broadcasting to ``mask_shape`` (..., L, S) as the op takes it: 4-D, its
    broadcast dims kept at size 1 rather than expanded.  The op's backward then sums the
    mask gradient over them in float32 before rounding it to the mask's dtype; expanded
    here, autograd would sum values already rounded one by one (a float16 (1,) mask's
    gradient, exactly 0, came out 4e-3)."""
    mask = attn_mask.reshape((1,) * (len(mask_shape) - attn_mask.dim()) + tuple(attn_mask.shape))
    if mask.dim() > 4 and any(n != 1 for n in mask.shape[:-3]):  # batch dims merge: expand those only
        mask = mask.expand(tuple(mask_shape[:-3]) + tuple(mask.shape[-3:]))
    return _as_4d(mask)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` (torch's semantics).

    ``query`` (..., Hq, L, E), ``key`` (..., Hkv, S, E), ``value`` (..., Hkv, S, Ev).
    ``is_causal`` aligns the mask top-left (query i sees keys j <= i).  A bool
    ``attn_mask`` marks the pairs that take part (True); a float one is added to
    the scaled scores; both broadcast to (..., Hq, L, S).  A mask together with
    ``is_causal=True`` is an error, as in torch (its MPS and math paths, every
    supported release).  Batch dims (all but the last three) broadcast as torch's
    matmuls broadcast them.  ``enable_gqa`` lets Hq be a multiple of Hkv (K/V are
    never repeated in memory).  Rows with no visible key return zeros.  Returns
    (..., Hq, L, Ev) in the query's dtype.
    ``key``/``value`` may be quantized (:class:`~torch_metal_flash.problem.quant.QuantizedTensor`,
    inference only), or float16 / bfloat16 under a float32 ``query``.  A problem class the
    tuner routed to torch (docs/tuning.md) runs torch's own SDPA (:mod:`.stock`).
    """
    signature = checks.memo_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    checked = _SDPA_CHECKED.get(signature)
    if checked is None:
        checked = _sdpa_checks(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if signature is not None:
            _SDPA_CHECKED.put(signature, checked)
    if stock.takes_torch(signature, query, key, value, attn_mask, dropout_p, is_causal):
        return stock.run_torch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return sdpa_checked(query, key, value, attn_mask, checked)


def sdpa_checked(query, key, value, attn_mask, checked):
    """:func:`scaled_dot_product_attention` after its checks (``checked``: what
    :func:`_sdpa_checks` returned for these arguments)."""
    scale, window_right, dropout_p, mask_shape, lead = checked
    if lead is not None:  # broadcast batch dims: expanded views (the op's 4-D reshape then copies them)
        query, key, value = (t.expand(lead + tuple(t.shape[-3:])) for t in (query, key, value))
    if isinstance(key, QuantizedTensor):
        checks.inference_only("quantized key/value", (("query", query), ("attn_mask", attn_mask)))
    mask = None if attn_mask is None else mask_as_4d(attn_mask, mask_shape)
    out, _ = _attention(_as_4d(query), _as_4d(key), _as_4d(value), mask, None, None, scale, 0, -1, window_right, 0.0,
                        dropout_p)
    return out if query.dim() == 4 else out.reshape(tuple(query.shape[:-1]) + (value.shape[-1],))


_SDPA_CHECKED = checks.Memo("checks.sdpa")


def kernels_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``tmf.scaled_dot_product_attention`` on the kernels whatever the class's route (what the
    tuner, the doctor and bench/timing.py compare with torch)."""
    checked = _sdpa_checks(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return sdpa_checked(query, key, value, attn_mask, checked)


def _sdpa_checks(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Check the SDPA face's arguments; (scale, window_right, dropout_p, mask shape) for the op."""
    checks.tensor("query", query)
    checks.float_dtype("query", query)
    for name, t in (("query", query), ("key", key), ("value", value)):
        checks.kv_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., L, E), got shape {tuple(t.shape)}")
        if isinstance(t, torch.Tensor):
            checks.last_dim_contiguous(name, t)
        checks.head_dim(name, t)
    checks.kv_dtypes("query", query, ("key", "value"), key, value)
    checks.dim_equal("key", key.shape[-1], query.shape[-1], "embedding size (last dim) equal to query's")
    checks.dim_equal("value", value.shape[-2], key.shape[-2], "sequence length (dim -2) equal to key's")
    dropout_p = checks.dropout(dropout_p)
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    lead = _broadcast_batch(query, key, value)
    if lead is not None:
        query, key, value = (t.expand(lead + tuple(t.shape[-3:])) for t in (query, key, value))
    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    hq, hkv = q.shape[1], k.shape[1]
    checks.dim_equal("value", v.shape[1], hkv, "number of heads (dim -3) equal to key's")
    if hq != hkv and hkv != 1:
        if not enable_gqa:
            raise ValueError(f"key/value have {hkv} heads and query {hq}: pass enable_gqa=True for "
                             f"grouped-query attention")
        checks.gqa_heads(hq, hkv)
    L, S = q.shape[2], k.shape[2]
    mask_shape = None
    if attn_mask is not None:
        checks.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            raise TypeError(f"attn_mask: expected dtype bool or the query's dtype {query.dtype}, got {attn_mask.dtype}")
        checks.same(("query", "attn_mask"), (query, attn_mask), "device")
        mask_shape = tuple(query.shape[:-2]) + (L, S)
        checks.broadcastable("attn_mask", attn_mask, mask_shape)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else checks.scale("scale", scale)
    return scale, 0 if is_causal else -1, dropout_p, mask_shape, lead


def _broadcast_batch(query, key, value) -> Optional[tuple]:
    """The broadcast batch dims (all but the last three) of query, key and value when they
    differ in rank or size, as torch's matmuls broadcast them; None when they already agree."""
    shapes = [tuple(t.shape) for t in (query, key, value)]
    if len({len(s) for s in shapes}) == 1 and len({s[:-3] for s in shapes}) == 1:
        return None
    if min(len(s) for s in shapes) < 3:
        raise RuntimeError(f"query, key, value: ranks {[len(s) for s in shapes]} differ and one has no heads dim "
                           f"(dim -3) to broadcast the batch dims against")
    try:
        return tuple(torch.broadcast_shapes(*(s[:-3] for s in shapes)))
    except RuntimeError as e:
        raise RuntimeError(f"query, key, value: batch dims {[s[:-3] for s in shapes]} do not broadcast: {e}") from None


def _flash_checks(q, k, v, *, varlen: bool = False, paged: bool = False) -> bool:
    """flash-attn inputs: (batch, seqlen, heads, headdim), or for varlen (total, heads, headdim)
    with paged k/v as (num_blocks, page_block_size, heads, headdim).  v's head dim may differ
    from q's and k's (as flash-attn 3 allows).  Returns whether k/v are quantized."""
    q_ndim, kv_ndim = (3, 4 if paged else 3) if varlen else (4, 4)
    checks.tensor("q", q, ndim=(q_ndim,))
    checks.float_dtype("q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.kv_tensor(name, t, ndim=(q_ndim if name == "q" else kv_ndim,))
        if isinstance(t, torch.Tensor):
            checks.last_dim_contiguous(name, t)
        checks.head_dim(name, t)
    quantized = checks.kv_dtypes("q", q, ("k", "v"), k, v)
    if not varlen:
        checks.dim_equal("k", k.shape[0], q.shape[0], "batch size equal to q's")
        checks.dim_equal("v", v.shape[0], q.shape[0], "batch size equal to q's")
    checks.dim_equal("k", k.shape[-1], q.shape[-1], "head dim equal to q's")
    if paged:
        checks.dim_equal("v", v.shape[0], k.shape[0], "number of blocks equal to k's")
        checks.dim_equal("v", v.shape[1], k.shape[1], "page size equal to k's")
    else:
        checks.dim_equal("v", v.shape[-3], k.shape[-3], "seqlen equal to k's")
    checks.dim_equal("v", v.shape[-2], k.shape[-2], "number of heads equal to k's")
    checks.gqa_heads(q.shape[-2], k.shape[-2], "q", "k/v")
    return quantized


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Drop-in for ``flash_attn.flash_attn_func`` (flash-attn 2 semantics).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads a multiple of nheads_k (MQA/GQA).
        dropout_p: dropout probability on the attention probabilities (0.0 for evaluation);
            the mask is drawn per call from the device's default generator.
        softmax_scale: scaling of QK^T before softmax, default 1 / sqrt(headdim).
        causal: causal mask aligned to the bottom-right corner of the score matrix.
        window_size: (left, right); when not (-1, -1), query i attends keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
        softcap: > 0 applies ``softcap * tanh(scores / softcap)``.
        alibi_slopes: float32 (nheads,) or (batch, nheads); adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores.
        deterministic: accepted for compatibility; the backward is always deterministic.
        return_attn_probs: also return the log-sum-exp and, with dropout, ``S_dmask``
            (for tests; O(L^2)).
    Returns:
        out (batch, seqlen_q, nheads, headdim); with ``return_attn_probs``,
        ``(out, softmax_lse (batch, nheads, seqlen_q) float32, S_dmask)``: ``S_dmask``
        (batch, nheads, seqlen_q, seqlen_k) in q's dtype is flash-attn 2's: the
        unnormalised probability ``exp(s - m)`` (``m`` the row's max) of every
        element, negated where dropout drops it (the sign bit: ``S_dmask >= 0`` is the
        keep mask), 0 where nothing is seen; None without dropout.

    ``k``/``v`` may be quantized (:class:`~torch_metal_flash.problem.quant.QuantizedTensor`,
    inference only), or float16 / bfloat16 under a float32 ``q`` (mixed precision).
    """
    if isinstance(k, QuantizedTensor):
        checks.inference_only("quantized k/v", (("q", q), ("alibi_slopes", alibi_slopes)))
    signature = checks.memo_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    checked = _FLASH_CHECKED.get(signature)
    if checked is None:
        _flash_checks(q, k, v)
        checked = _flash_arguments(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   seqlen_k=k.shape[1], batch=q.shape[0])
        if signature is not None:
            _FLASH_CHECKED.put(signature, checked)
    return _flash_attn(q, k, v, alibi_slopes, return_attn_probs, *checked)


_FLASH_CHECKED = checks.Memo("checks.flash")


def _flash_arguments(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, seqlen_k, batch):
    """Check the flash faces' other arguments; (dropout_p, scale, window left, window right, softcap)
    for the op.  ``seqlen_k`` is the length windows are clamped against (the call's key
    length; the batch's longest for varlen), as flash-attn does."""
    dropout_p = checks.dropout(dropout_p)
    left, right = checks.window(window_size, causal=causal, seqlen_k=seqlen_k)
    softcap = checks.softcap(softcap)
    checks.alibi(alibi_slopes, batch, q.shape[-2], q.device)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else checks.scale("softmax_scale", softmax_scale)
    return dropout_p, scale, left, right, softcap


def _flash_attn(q, k, v, alibi_slopes, return_attn_probs, dropout_p, scale, left, right, softcap):
    """flash_attn_func on checked arguments."""
    if dropout_p == 0 and not return_attn_probs and not isinstance(k, QuantizedTensor):
        # the common call, without _attention's generality (a face's host time is per call)
        if torch.compiler.is_compiling():  # dynamo traces view ops, not the core's C++ call
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            qt, kt, vt = core.transpose_12(q, k, v)
        out = _FWD(qt, kt, vt, None, alibi_slopes, None, scale, k.shape[1] - q.shape[1], left, right, softcap,
                   ops.needs_grad(qt, kt, vt))[0]
        return out.transpose(1, 2)
    res = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, alibi_slopes, None, scale,
                     k.shape[1] - q.shape[1], left, right, softcap, dropout_p, return_probs=return_attn_probs)
    out = res[0].transpose(1, 2)
    return (out, res[1], res[2]) if return_attn_probs else out


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_kvpacked_func``: ``kv`` is (batch, seqlen_k, 2, nheads_k, headdim)."""
    checks.kv_tensor("kv", kv, ndim=(5,))
    checks.dim_equal("kv", kv.shape[2], 2, "size of dim 2 (k and v)")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_qkvpacked_func``: ``qkv`` is (batch, seqlen, 3, nheads, headdim)."""
    checks.tensor("qkv", qkv, ndim=(5,))
    checks.dim_equal("qkv", qkv.shape[2], 3, "size of dim 2 (q, k and v)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, seqused_k=None):
    """``flash_attn.flash_attn_varlen_func``: sequences of different lengths packed along dim 0.

    Arguments:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with
            ``block_table`` paged caches (num_blocks, page_block_size, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative sequence lengths, starting at 0.
        max_seqlen_q, max_seqlen_k: ints, the largest lengths (bound the kernels' grids; as
            flash-attn, window sizes >= max_seqlen_k mean unbounded).
        k, v may also be quantized (:class:`~torch_metal_flash.problem.quant.QuantizedTensor`) or
            float16 / bfloat16 under a float32 ``q``: converted to q's dtype first (a copy).
        block_table: int32 (batch, max_num_blocks_per_seq): sequence b's key j is row
            j % page_block_size of block block_table[b, j // page_block_size].  Differentiable: the
            caches' gradients have their shape (torch_metal_flash.ops.paged: blocks shared by several
            sequences get the sum of their gradients, deterministically).
        seqused_k: int32 (batch,) (flash-attn 3's argument): only the first seqused_k[b]
            keys of sequence b are attended (causal/windows aligned to them).
        The other arguments are those of :func:`flash_attn_func`, applied per sequence
        (causal and windows aligned to each sequence's bottom-right corner, ALiBi slopes
        (nheads,) or (batch, nheads), dropout drawn per sequence).
    Returns:
        out (total_q, nheads, headdim); with ``return_attn_probs``,
        ``(out, softmax_lse (nheads, total_q) float32, S_dmask)``, ``S_dmask`` (batch,
        nheads, max_seqlen_q, max_seqlen_k) as in :func:`flash_attn_func` (None without
        dropout).

    One op call for all the sequences: the kernels read ``cu_seqlens`` on the GPU (no
    host synchronisation, nothing copied, traceable by ``torch.compile``).  Index values
    are not checked on the host (out-of-range ones are clamped to the tensors);
    ``TORCH_METAL_FLASH_DEBUG=1`` validates them (one GPU sync per call).
    """
    paged = block_table is not None
    if _flash_checks(q, k, v, varlen=True, paged=paged):
        checks.inference_only("quantized k/v", (("q", q),))
    cu_q, cu_k = (_index_vector(name, t, q.device) for name, t in (("cu_seqlens_q", cu_seqlens_q),
                                                                  ("cu_seqlens_k", cu_seqlens_k)))
    batch = cu_q.shape[0] - 1
    checks.dim_equal("cu_seqlens_k", cu_k.shape[0], batch + 1, "length equal to cu_seqlens_q's")
    used = None if seqused_k is None else _index_vector("seqused_k", seqused_k, q.device)
    if used is not None:
        checks.dim_equal("seqused_k", used.shape[0], batch, "length (the batch size)")
    table = None if block_table is None else _index_vector("block_table", block_table, q.device, ndim=2)
    if table is not None:
        checks.dim_equal("block_table", table.shape[0], batch, "rows (the batch size)")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)) or (isinstance(n, int) and n < 0):
            raise ValueError(f"{name}: expected an int >= 0 (a tensor would need a host sync), got {n!r}")
    dropout_p, scale, left, right, softcap = _flash_arguments(q, dropout_p, softmax_scale, causal, window_size,
                                                              softcap, alibi_slopes, max_seqlen_k, batch)
    # (1, H, total, D) views of the packed tensors; paged caches as (num_blocks, Hkv, page, D)
    kv_view = (lambda t: t.transpose(1, 2)) if paged else (lambda t: t.transpose(0, 1).unsqueeze(0))
    varlen = Varlen(cu_q, cu_k, used, table, max_seqlen_q, max_seqlen_k)
    res = _attention(q.transpose(0, 1).unsqueeze(0), kv_view(k), kv_view(v), None, alibi_slopes, None, scale, 0,
                     left, right, softcap, dropout_p, varlen=varlen, return_probs=return_attn_probs)
    # squeeze, not [0]: select's backward would zero-fill and copy a full-size gradient
    out = res[0].squeeze(0).transpose(0, 1)
    return (out, res[1].squeeze(0), res[2]) if return_attn_probs else out


def _index_vector(name: str, t, device, ndim: int = 1) -> torch.Tensor:
    """An index tensor of a varlen call, int32 (int64 is converted on the device: no sync)."""
    checks.tensor(name, t, ndim=(ndim,))
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t if t.dtype == torch.int32 and t.stride(-1) == 1 else t.to(torch.int32).contiguous()


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_varlen_kvpacked_func``: ``kv`` is (total_k, 2, nheads_k, headdim)."""
    checks.kv_tensor("kv", kv, ndim=(4,))
    checks.dim_equal("kv", kv.shape[1], 2, "size of dim 1 (k and v)")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: ``qkv`` is (total, 3, nheads, headdim)."""
    checks.tensor("qkv", qkv, ndim=(4,))
    checks.dim_equal("qkv", qkv.shape[1], 3, "size of dim 1 (q, k and v)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)
