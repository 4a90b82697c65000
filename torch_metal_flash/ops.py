"""The ``torch.ops.metal_flash`` custom ops: schemas, fake kernels, autograd.

``fwd`` returns ``(out, lse)``; ``bwd`` returns ``(dq, dk, dv, dbias, dsinks)``.
Both take the general problem of :mod:`torch_metal_flash.spec` so that the
SDPA and flash-attn faces map onto them without copies.  ``fwd_kvcache``
(``flash_attn_with_kvcache``) appends to a KV cache in place and attends to it.
Each call plans the kernels for the selected backend and falls back to the
reference path (with a one-time warning naming the reason) when the kernels do
not cover it.

Quantized K/V (:mod:`torch_metal_flash.quant`, inference only) have their own
ops, each the plain op's arguments with ``k``/``v`` (``k_cache``/``v_cache``)
the packed data, followed by the scales, the biases (None: symmetric int8) and
the format ``kv_bits, kv_group_size, kv_dtype`` (dtype code of
:data:`~torch_metal_flash.quant.DTYPE_CODES`):

* ``fwd_quantized(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset,
  window_left, window_right, softcap, k_scales, k_biases, v_scales, v_biases,
  kv_bits, kv_group_size, kv_dtype) -> (out, lse)``; its backward raises.
* ``fwd_kvcache_quantized(<fwd_kvcache's arguments>, k_cache_scales,
  k_cache_biases, v_cache_scales, v_cache_biases, kv_bits, kv_group_size,
  kv_dtype) -> (out, lse)``, mutating the caches' data, scales and biases (the
  new rows are quantized by the append kernel).

``fwd`` and ``fwd_kvcache`` also take K/V (caches) in float16 / bfloat16 under a
float32 q (mixed precision, on the decode kernels).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import dataclasses

from . import backends, kvcache_reference, planner, reference
from .layout import empty_in_layout
from .plan import Unsupported
from .planner.kvcache import KvCacheProblem, plan_kvcache
from .quant import from_flat
from .spec import AttentionSpec, make_spec, stats_dtype


def _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
          softcap) -> AttentionSpec:
    return make_spec(q, k, v, attn_mask, alibi_slopes, sinks, scale=scale, diag_offset=diag_offset,
                     window_left=window_left, window_right=window_right, softcap=softcap)


def unsupported_reason(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                       softcap) -> Optional[str]:
    """None when the selected backend would run the kernels for this call (and,
    when an input requires grad, for its backward); else why the op would take
    the reference path.  Plans without launching, warns about nothing."""
    backend, why = backends.select(q.device)
    if backend is None:
        return why or "the reference backend is selected"
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    family = getattr(backend, "family", "apple8")
    out, lse = _fwd_buffers(q, v)
    plan = planner.plan_forward(spec, out, lse, family=family, pipeline_info=backend.pipeline_info)
    if isinstance(plan, Unsupported):
        return plan.reason
    tensors = (q, k, v, attn_mask, sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        compute_dbias = attn_mask is not None and attn_mask.requires_grad
        plan = planner.plan_backward(spec, torch.empty_like(out), out, lse, None,
                                        *_bwd_buffers(spec, compute_dbias), family=family,
                                        pipeline_info=backend.pipeline_info)
        if isinstance(plan, Unsupported):
            return f"backward: {plan.reason}"
    return None


def _run_kernels(spec: AttentionSpec, plan_name: str, *plan_args) -> bool:
    """Plan and run on the selected backend; False means: use the reference path."""
    backend = backends.resolve(spec.q.device)
    if backend is not None and spec.q.numel() > 0 and spec.seqlen_k > 0:
        # The tile tables are per GPU family; the emulator plans like an M2 ("apple8").
        family = getattr(backend, "family", "apple8")
        # Launches are checked against the pipelines' limits here, before any is encoded.
        plan = getattr(planner, plan_name)(spec, *plan_args, family=family, pipeline_info=backend.pipeline_info)
        if not isinstance(plan, Unsupported):
            backend.run(plan)
            backends.record_run(backend.name)
            return True
        backends.fallback(plan.reason)
    # Also empty problems: nothing for a kernel to do, the reference fills zeros / lse.
    backends.record_run("reference")
    return False


@torch.library.custom_op("metal_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
        softcap: float) -> tuple[Tensor, Tensor]:
    """Attention forward on (B, H, L, D)-indexed tensors; see :mod:`torch_metal_flash.spec`."""
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    out, lse = _fwd_buffers(q, v)
    if not _run_kernels(spec, "plan_forward", out, lse):
        ref_out, ref_lse = reference.forward(spec)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    return out, lse


def _fwd_buffers(q: Tensor, v: Tensor):
    return empty_in_layout(q, v.shape[-1]), q.new_empty(q.shape[:3], dtype=stats_dtype(q.dtype))


@fwd.register_fake
def _(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap):
    return _fwd_buffers(q, v)


@torch.library.custom_op("metal_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
        attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
        diag_offset: int, window_left: int, window_right: int, softcap: float,
        compute_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`fwd`: ``dq, dk, dv`` in the inputs' dtypes and layouts,
    ``dbias`` (B, H, Lq, Lk) when ``compute_dbias`` else empty, ``dsinks`` (H,)
    when ``sinks`` is given else empty; both float32 (float64 for float64 inputs)."""
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    grads = _bwd_buffers(spec, compute_dbias)
    if not _run_kernels(spec, "plan_backward", dout, out, lse, dlse, *grads):
        for buf, ref in zip(grads, reference.backward(spec, dout, out, lse, dlse, compute_dbias)):
            buf.copy_(ref)
    return grads


def _bwd_buffers(spec: AttentionSpec, compute_dbias: bool):
    q = spec.q
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    return (empty_in_layout(q), empty_in_layout(spec.k), empty_in_layout(spec.v),
            q.new_empty((B, H, Lq, Lk) if compute_dbias else (0,), dtype=stats_dtype(q.dtype)),
            q.new_empty((H,) if spec.sinks is not None else (0,), dtype=stats_dtype(q.dtype)))


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
      window_right, softcap, compute_dbias):
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    return _bwd_buffers(spec, compute_dbias)


_FWD_ARGS = ("q", "k", "v", "attn_mask", "alibi_slopes", "sinks", "scale", "diag_offset", "window_left",
             "window_right", "softcap")


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, alibi_slopes, sinks = inputs[:6]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes, sinks)
    ctx.scalars = inputs[6:]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, alibi_slopes, sinks = ctx.saved_tensors
    needs = dict(zip(_FWD_ARGS, ctx.needs_input_grad))
    if needs["alibi_slopes"]:
        raise NotImplementedError("metal_flash.fwd: gradients for alibi_slopes are not supported")
    if dout is None:
        dout = torch.zeros_like(out)
    compute_dbias = bool(needs["attn_mask"])
    dq, dk, dv, dbias, dsinks = torch.ops.metal_flash.bwd(
        dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes, sinks, *ctx.scalars, compute_dbias)
    dmask = dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if compute_dbias else None
    dsinks = dsinks.to(sinks.dtype) if needs["sinks"] else None
    return dq, dk, dv, dmask, None, dsinks, None, None, None, None, None


torch.library.register_autograd("metal_flash::fwd", _backward, setup_context=_setup_context)


@torch.library.custom_op("metal_flash::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                alibi_slopes: Optional[Tensor], seqlen: int, scale: float, window_left: int, window_right: int,
                softcap: float, rotary_interleaved: bool, num_splits: int) -> tuple[Tensor, Tensor]:
    """``flash_attn_with_kvcache`` as an op: rotary of q and the new ``k``, ``k``/``v``
    written into ``k_cache``/``v_cache`` **in place** at ``cache_seqlens`` (``seqlen``
    for every row when None), then q (B, Lq, Hq, D) attends to keys
    [cache_leftpad, cache_seqlens + seqlen_new) of its cache row, with the band
    ``window_left/right`` aligned bottom-right per row (causal: window_right = 0;
    q is rotated per row when a window side is >= 0).  Index tensors are int32;
    on the kernel path they are read on the GPU only, and out-of-range values are
    clamped or ignored (shaders/kvcache_index.h); the reference path, and the
    kernel path in debug mode (``TORCH_METAL_FLASH_DEBUG=1``), validate them on the
    host.  Returns ``out`` (B, Lq, Hq, D) and ``lse`` (B, Hq, Lq)."""
    return _kvcache(KvCacheProblem(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, alibi_slopes, seqlen, scale, window_left, window_right,
                                   softcap, rotary_interleaved, num_splits))


def _kvcache(problem: KvCacheProblem):
    """The body of both KV-cache ops (caches plain or QuantizedTensor)."""
    q = problem.q
    out, lse = _kvcache_buffers(q)
    backend = backends.resolve(q.device)
    if backend is not None:
        if backends.is_debug():  # a GPU synchronisation on MPS: opt-in only
            p = problem
            kvcache_reference.host_indices(
                kvcache_reference.Geometry.of(q, p.k_cache, p.k, p.block_table, p.window_left, p.window_right),
                p.cache_seqlens, p.seqlen, p.cache_batch_idx, p.cache_leftpad, p.block_table, p.rotary_cos)
        plan = plan_kvcache(problem, out, lse, family=getattr(backend, "family", "apple8"),
                            pipeline_info=backend.pipeline_info)
        if not isinstance(plan, Unsupported):
            backend.run(plan)
            backends.record_run(backend.name)
            return out, lse
        backends.fallback(plan.reason)
    backends.record_run("reference")
    ref_out, ref_lse = kvcache_reference.forward(*problem[:-1])
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def _kvcache_buffers(q: Tensor):
    B, Lq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Lq), dtype=stats_dtype(q.dtype))


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
      alibi_slopes, seqlen, scale, window_left, window_right, softcap, rotary_interleaved, num_splits):
    return _kvcache_buffers(q)


# ---------------------------------------------------------------------------
# Quantized K/V (inference only): the ops take each quantized tensor flat.
# ---------------------------------------------------------------------------

@torch.library.custom_op("metal_flash::fwd_quantized", mutates_args=())
def fwd_quantized(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
                  softcap: float, k_scales: Tensor, k_biases: Optional[Tensor], v_scales: Tensor,
                  v_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                  kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd` over quantized K/V: ``k``/``v`` are the packed data of (B, Hkv, Lk, D)
    QuantizedTensors (see the module doc).  The kernels dequantize in registers; the
    reference path dequantizes the tensors first."""
    kq = from_flat(k, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype)
    vq = from_flat(v, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype)
    spec = _spec(q, kq, vq, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap)
    out, lse = _fwd_buffers(q, vq)
    if not _run_kernels(spec, "plan_forward", out, lse):
        ref_out, ref_lse = reference.forward(dataclasses.replace(spec, k=kq.dequantize(), v=vq.dequantize()))
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    return out, lse


@fwd_quantized.register_fake
def _(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap, k_scales,
      k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype):
    return _fwd_buffers(q, from_flat(v, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype))


def _no_backward(ctx, *grads):
    raise RuntimeError("metal_flash::fwd_quantized is inference-only: quantized K/V have no gradient (run under "
                       "torch.no_grad(), or attend to dequantize()d tensors to train)")


torch.library.register_autograd("metal_flash::fwd_quantized", _no_backward,
                                setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("metal_flash::fwd_kvcache_quantized",
                         mutates_args=("k_cache", "v_cache", "k_cache_scales", "k_cache_biases", "v_cache_scales",
                                       "v_cache_biases"))
def fwd_kvcache_quantized(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                          rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                          cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                          block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], seqlen: int, scale: float,
                          window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                          num_splits: int, k_cache_scales: Tensor, k_cache_biases: Optional[Tensor],
                          v_cache_scales: Tensor, v_cache_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                          kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd_kvcache` over quantized caches (``k_cache``/``v_cache`` their packed
    data): the new ``k``/``v`` rows (in the caches' dtype) are quantized by the append
    kernel into the caches in place, and the attention reads the stored values."""
    kc = from_flat(k_cache, k_cache_scales, k_cache_biases, kv_bits, kv_group_size, kv_dtype)
    vc = from_flat(v_cache, v_cache_scales, v_cache_biases, kv_bits, kv_group_size, kv_dtype)
    return _kvcache(KvCacheProblem(q, kc, vc, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, alibi_slopes, seqlen, scale, window_left, window_right,
                                   softcap, rotary_interleaved, num_splits))


@fwd_kvcache_quantized.register_fake
def _(q, *args):
    return _kvcache_buffers(q)
