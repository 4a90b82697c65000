"""The ``torch.ops.metal_flash`` custom ops: schemas, fake kernels, autograd.

Schemas (flat: tensors, optional tensors, int, float, bool)::

    fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? alibi_slopes, Tensor? sinks,
        float scale, int diag_offset, int window_left, int window_right, float softcap,
        bool return_aux) -> (Tensor out, Tensor lse, Tensor aux)
    bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor aux, Tensor? dlse,
        Tensor? attn_mask, Tensor? alibi_slopes, Tensor? sinks, float scale, int diag_offset,
        int window_left, int window_right, float softcap, bool compute_dbias)
        -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias, Tensor dsinks)

``aux`` is the row state the backward needs (:mod:`torch_metal_flash.spec`:
row max and sum, and the unrounded output for fp16/bf16), written only when
``return_aux`` (the faces pass ``True`` when an input requires grad), else an
empty tensor; either side of a training step may fall back to the reference
path, aux is the same contract for both.  Both take the general problem of
:mod:`torch_metal_flash.spec` so that the SDPA and flash-attn faces map onto
them without copies.  ``fwd_kvcache`` (``flash_attn_with_kvcache``) appends to
a KV cache in place and attends to it.

Their bodies run in the C++ core (:mod:`torch_metal_flash.core`): each op is a
:class:`~torch_metal_flash.core.CoreOp` (outputs, planner, reference path) and
a call replays a cached launch template, planning once per problem signature;
configurations the kernels do not cover fall back to the reference path with a
one-time warning naming the reason.  The Python bodies below only serve devices
the core does not (CUDA ...) and hand the first kernel call over to the core.

Schema notes: the kernels take ``alibi_slopes`` as float32 and ``sinks`` as a
contiguous float32 vector (other dtypes take the reference path; the faces
convert), and ``bwd`` takes ``dout`` with a contiguous last dim and a
contiguous ``dlse`` (the autograd formula makes them so).  ``fwd`` and
``fwd_kvcache`` also take K/V (caches) in float16 / bfloat16 under a float32 q
(mixed precision, on the decode kernels).

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
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import backends, checks, core, kvcache_reference, planner, reference
from .layout import empty_in_layout
from .planner.kvcache import KvCacheProblem, plan_kvcache
from .quant import from_flat
from .spec import AttentionSpec, aux_width, make_spec, stats_dtype


def check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
               softcap) -> None:
    """Clear errors, naming the argument, for what the op cannot mean (the faces check
    their own arguments first; this guards direct calls of the ops).  The ops' ``outputs``
    functions run it: the C++ core calls them once per plan-cache key, on a miss (the
    checks read only what the key holds: dtypes, devices, shapes, scalars), the reference
    path and the fake kernels (torch.compile) on every call.  K/V may be quantized."""
    checks.tensor("q", q, ndim=(4,))
    checks.float_dtype("q", q)
    checks.head_dim("q", q)
    for name, t in (("k", k), ("v", v)):
        checks.kv_tensor(name, t, ndim=(4,))
        checks.head_dim(name, t)
    checks.kv_dtypes("q", q, ("k", "v"), k, v)
    B, H, Lq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected shape ({B}, Hkv, Lk, {D}) (q's batch and head dim), got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected shape ({', '.join(map(str, k.shape[:3]))}, Dv) like k's, got {tuple(v.shape)}")
    checks.gqa_heads(H, k.shape[1], "q", "k/v")
    if attn_mask is not None:
        checks.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask: expected dtype bool or a float dtype, got {attn_mask.dtype}")
        checks.same(("q", "attn_mask"), (q, attn_mask), "device")
        checks.broadcastable("attn_mask", attn_mask, (B, H, Lq, k.shape[2]))
    if alibi_slopes is not None:
        checks.tensor("alibi_slopes", alibi_slopes)
        checks.float_dtype("alibi_slopes", alibi_slopes)
        checks.same(("q", "alibi_slopes"), (q, alibi_slopes), "device")
        checks.broadcastable("alibi_slopes", alibi_slopes, (B, H))
    checks.sinks(sinks, H, q.device)
    checks.scale("scale", scale)
    checks.window_side("window_left", window_left)
    checks.window_side("window_right", window_right)
    checks.softcap(softcap)


def _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
          softcap) -> AttentionSpec:
    return make_spec(q, k, v, attn_mask, alibi_slopes, sinks, scale=scale, diag_offset=diag_offset,
                     window_left=window_left, window_right=window_right, softcap=softcap)


def unsupported_reason(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                       softcap) -> Optional[str]:
    """None when the selected backend would run the kernels for this call (and,
    when an input requires grad, for its backward); else why the op would take
    the reference path.  Answered from the plan cache; warns about nothing."""
    backend, why = backends.select(q.device)
    if backend is None:
        return why or "the reference backend is selected"
    grad = needs_grad(q, k, v, attn_mask, sinks)
    args = (q, k, v, attn_mask, alibi_slopes, sinks, float(scale), int(diag_offset), int(window_left),
            int(window_right), float(softcap), grad)
    reason = core.probe(FWD, backend.name, args)
    if reason is not None:
        return reason
    if grad:
        out, lse, aux = _fwd_outputs(*args)
        compute_dbias = attn_mask is not None and attn_mask.requires_grad
        reason = core.probe(BWD, backend.name, (torch.empty_like(out), q, k, v, out, aux, None, *args[3:11],
                                                compute_dbias))
        if reason is not None:
            return f"backward: {reason}"
    return None


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will ask for gradients of a call with these inputs (the
    faces pass it as ``return_aux``)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------
# fwd
# ---------------------------------------------------------------------------

def _fwd_buffers(q: Tensor, v: Tensor, return_aux: bool):
    B, H, Lq, _ = q.shape
    aux_shape = (B, H, Lq, aux_width(q.dtype, v.shape[-1])) if return_aux else (0,)
    return (empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Lq), dtype=stats_dtype(q.dtype)),
            q.new_empty(aux_shape, dtype=stats_dtype(q.dtype)))


def _fwd_outputs(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                 return_aux):
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap)
    return _fwd_buffers(q, v, return_aux)


def _fwd_plan(backend, args: tuple, outputs: tuple):
    spec = _spec(*args[:11])
    if spec.q.numel() == 0 or spec.seqlen_k == 0:
        return None  # nothing for a kernel to do: the reference fills zeros / lse / aux
    out, lse, aux = outputs
    # Launches are checked against the pipelines' limits here, before any is encoded.
    return planner.plan_forward(spec, out, lse, aux if args[11] else None, family=backend.family,
                                pipeline_info=backend.pipeline_info)


def _fwd_reference(*args):
    out, lse, aux = _fwd_outputs(*args)
    ref_out, ref_lse = reference.forward(_spec(*args[:11]), aux if args[11] else None)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse, aux


@torch.library.custom_op("metal_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
        softcap: float, return_aux: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward on (B, H, L, D)-indexed tensors; see :mod:`torch_metal_flash.spec`.
    Returns ``out``, ``lse`` and ``aux`` (the backward's row state when
    ``return_aux``, else empty)."""
    return core.call_slow(FWD, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                window_right, softcap, return_aux))


fwd.register_fake(_fwd_outputs)


# ---------------------------------------------------------------------------
# bwd
# ---------------------------------------------------------------------------

def _bwd_buffers(spec: AttentionSpec, compute_dbias: bool):
    q = spec.q
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    return (empty_in_layout(q), empty_in_layout(spec.k), empty_in_layout(spec.v),
            q.new_empty((B, H, Lq, Lk) if compute_dbias else (0,), dtype=stats_dtype(q.dtype)),
            q.new_empty((H,) if spec.sinks is not None else (0,), dtype=stats_dtype(q.dtype)))


def _bwd_outputs(dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                 window_right, softcap, compute_dbias):
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap)
    want = (*q.shape[:3], aux_width(q.dtype, v.shape[-1]))
    if tuple(aux.shape) != want:
        raise ValueError(f"metal_flash.bwd: aux must be the forward's aux of shape {want} (fwd with "
                         f"return_aux=True), got {tuple(aux.shape)}")
    return _bwd_buffers(_spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                              window_right, softcap), compute_dbias)


def _bwd_plan(backend, args: tuple, outputs: tuple):
    dout, q, k, v, out, aux, dlse = args[:7]
    spec = _spec(q, k, v, *args[7:15])
    if q.numel() == 0 or spec.seqlen_k == 0:
        return None
    return planner.plan_backward(spec, dout, out, aux, dlse, *outputs, family=backend.family,
                                 pipeline_info=backend.pipeline_info)


def _bwd_reference(*args):
    dout, q, k, v, out, aux, dlse = args[:7]
    compute_dbias = args[15]
    grads = _bwd_outputs(*args)
    for buf, ref in zip(grads, reference.backward(_spec(q, k, v, *args[7:15]), dout, out, aux, dlse,
                                                  compute_dbias)):
        buf.copy_(ref)
    return grads


@torch.library.custom_op("metal_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, dlse: Optional[Tensor],
        attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
        diag_offset: int, window_left: int, window_right: int, softcap: float,
        compute_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`fwd` from its ``out`` and ``aux`` (``return_aux=True``):
    ``dq, dk, dv`` in the inputs' dtypes and layouts, ``dbias`` (B, H, Lq, Lk)
    when ``compute_dbias`` else empty, ``dsinks`` (H,) when ``sinks`` is given
    else empty; both float32 (float64 for float64 inputs)."""
    return core.call_slow(BWD, (dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset,
                                window_left, window_right, softcap, compute_dbias))


bwd.register_fake(_bwd_outputs)


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------

_FWD_ARGS = ("q", "k", "v", "attn_mask", "alibi_slopes", "sinks", "scale", "diag_offset", "window_left",
             "window_right", "softcap", "return_aux")


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, alibi_slopes, sinks = inputs[:6]
    out, lse, aux = output
    ctx.mark_non_differentiable(aux)
    ctx.save_for_backward(q, k, v, out, aux, attn_mask, alibi_slopes, sinks)
    ctx.scalars = inputs[6:11]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, _daux):
    q, k, v, out, aux, attn_mask, alibi_slopes, sinks = ctx.saved_tensors
    needs = dict(zip(_FWD_ARGS, ctx.needs_input_grad))
    if needs["alibi_slopes"]:
        raise NotImplementedError("metal_flash.fwd: gradients for alibi_slopes are not supported")
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.shape[-1] > 1 and dout.stride(-1) != 1:
        dout = dout.contiguous()  # e.g. the expanded gradient of a sum(): the kernels read rows
    if dlse is not None:
        dlse = dlse.contiguous()
    if aux.dim() == 1:
        # fwd ran with return_aux=False (a direct op call): recompute the row state.
        _, _, aux = torch.ops.metal_flash.fwd(q, k, v, attn_mask, alibi_slopes, sinks, *ctx.scalars, True)
    compute_dbias = bool(needs["attn_mask"])
    dq, dk, dv, dbias, dsinks = torch.ops.metal_flash.bwd(
        dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, *ctx.scalars, compute_dbias)
    dmask = dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if compute_dbias else None
    dsinks = dsinks.to(sinks.dtype) if needs["sinks"] else None
    return dq, dk, dv, dmask, None, dsinks, None, None, None, None, None, None


# ---------------------------------------------------------------------------
# fwd_kvcache
# ---------------------------------------------------------------------------

def _kvcache_buffers(q: Tensor):
    B, Lq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Lq), dtype=stats_dtype(q.dtype))


def _kvcache_outputs(q, *args):
    return _kvcache_buffers(q)


def _kvcache_plan(backend, args: tuple, outputs: tuple):
    return _kvcache_problem_plan(KvCacheProblem(*args), backend, outputs)


def _kvcache_problem_plan(problem: KvCacheProblem, backend, outputs: tuple):
    return plan_kvcache(problem, *outputs, family=backend.family, pipeline_info=backend.pipeline_info)


def _kvcache_debug_check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes, seqlen, scale, window_left, window_right, softcap,
                         rotary_interleaved, num_splits):
    kvcache_reference.host_indices(kvcache_reference.Geometry.of(q, k_cache, k, block_table, window_left, window_right),
                                   cache_seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_cos)


def _kvcache_reference(*args):
    return _kvcache_problem_reference(KvCacheProblem(*args))


def _kvcache_problem_reference(problem: KvCacheProblem):
    out, lse = _kvcache_buffers(problem.q)
    ref_out, ref_lse = kvcache_reference.forward(*problem[:-1])  # all but num_splits
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


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
    return core.call_slow(FWD_KVCACHE, (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, block_table, alibi_slopes, seqlen, scale,
                                        window_left, window_right, softcap, rotary_interleaved, num_splits))


fwd_kvcache.register_fake(_kvcache_outputs)


# ---------------------------------------------------------------------------
# Quantized K/V (inference only): each quantized tensor enters flat, as its data,
# scales and biases, then the format (the schemas know no dtype type).
# ---------------------------------------------------------------------------

def _quantized_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                    k_scales, k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype) -> tuple:
    """fwd's arguments, K/V as QuantizedTensors."""
    return (q, from_flat(k, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype),
            from_flat(v, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype), attn_mask, alibi_slopes, sinks,
            scale, diag_offset, window_left, window_right, softcap)


def _quantized_spec(*args) -> AttentionSpec:
    return _spec(*_quantized_args(*args))


def _quantized_outputs(*args):
    plain = _quantized_args(*args)
    check_args(*plain)
    return _fwd_buffers(plain[0], plain[2], False)[:2]


def _quantized_plan(backend, args: tuple, outputs: tuple):
    spec = _quantized_spec(*args)
    if spec.q.numel() == 0 or spec.seqlen_k == 0:
        return None
    return planner.plan_forward(spec, *outputs, family=backend.family, pipeline_info=backend.pipeline_info)


def _quantized_reference(*args):
    out, lse = _quantized_outputs(*args)
    spec = _quantized_spec(*args)
    ref_out, ref_lse = reference.forward(dataclasses.replace(spec, k=spec.k.dequantize(), v=spec.v.dequantize()))
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def _quantized_no_backward(ctx, *grads):
    raise RuntimeError("metal_flash::fwd_quantized is inference-only: quantized K/V have no gradient (run under "
                       "torch.no_grad(), or attend to dequantize()d tensors to train)")


@torch.library.custom_op("metal_flash::fwd_quantized", mutates_args=())
def fwd_quantized(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
                  softcap: float, k_scales: Tensor, k_biases: Optional[Tensor], v_scales: Tensor,
                  v_biases: Optional[Tensor], kv_bits: int, kv_group_size: int,
                  kv_dtype: int) -> tuple[Tensor, Tensor]:
    """:func:`fwd` over quantized K/V: ``k``/``v`` are the packed data of (B, Hkv, Lk, D)
    QuantizedTensors (see the module doc).  The kernels dequantize in registers (every
    query length takes the decode kernels); the reference path dequantizes first."""
    return core.call_slow(FWD_QUANTIZED, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                          window_right, softcap, k_scales, k_biases, v_scales, v_biases, kv_bits,
                                          kv_group_size, kv_dtype))


fwd_quantized.register_fake(_quantized_outputs)


def _kvcache_quantized_problem(*args) -> KvCacheProblem:
    *plain, k_scales, k_biases, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype = args
    problem = KvCacheProblem(*plain)
    return problem._replace(k_cache=from_flat(problem.k_cache, k_scales, k_biases, kv_bits, kv_group_size, kv_dtype),
                            v_cache=from_flat(problem.v_cache, v_scales, v_biases, kv_bits, kv_group_size, kv_dtype))


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
    return core.call_slow(FWD_KVCACHE_QUANTIZED, (
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        alibi_slopes, seqlen, scale, window_left, window_right, softcap, rotary_interleaved, num_splits,
        k_cache_scales, k_cache_biases, v_cache_scales, v_cache_biases, kv_bits, kv_group_size, kv_dtype))


fwd_kvcache_quantized.register_fake(_kvcache_outputs)


# ---------------------------------------------------------------------------
# The C++ core runs the ops (and fwd's autograd formula when a call needs a graph).
# ---------------------------------------------------------------------------

FWD = core.register(core.CoreOp("metal_flash::fwd", outputs=_fwd_outputs, plan=_fwd_plan, reference=_fwd_reference,
                                setup_context=_setup_context, backward=_backward))
BWD = core.register(core.CoreOp("metal_flash::bwd", outputs=_bwd_outputs, plan=_bwd_plan, reference=_bwd_reference))
FWD_KVCACHE = core.register(core.CoreOp("metal_flash::fwd_kvcache", outputs=_kvcache_outputs, plan=_kvcache_plan,
                                        reference=_kvcache_reference, debug_check=_kvcache_debug_check))
FWD_QUANTIZED = core.register(core.CoreOp(
    "metal_flash::fwd_quantized", outputs=_quantized_outputs, plan=_quantized_plan, reference=_quantized_reference,
    setup_context=lambda ctx, inputs, output: None, backward=_quantized_no_backward))
FWD_KVCACHE_QUANTIZED = core.register(core.CoreOp(
    "metal_flash::fwd_kvcache_quantized", outputs=_kvcache_outputs,
    plan=lambda backend, args, outputs: _kvcache_problem_plan(_kvcache_quantized_problem(*args), backend, outputs),
    reference=lambda *args: _kvcache_problem_reference(_kvcache_quantized_problem(*args)),
    debug_check=lambda *args: _kvcache_debug_check(*args[:19])))
