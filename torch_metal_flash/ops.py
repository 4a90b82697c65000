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
empty tensor.  Both ops take the general problem of
:mod:`torch_metal_flash.spec` so that the SDPA and flash-attn faces map onto
them without copies.  Each call plans the kernels for the selected backend and
falls back to the reference path (with a one-time warning naming the reason)
when the kernels do not cover it; the two sides of a training step may run on
different paths (aux is the same contract for both).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backends, planner, reference
from .layout import empty_in_layout
from .plan import Unsupported
from .spec import AttentionSpec, aux_width, make_spec, stats_dtype


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
    grad = needs_grad(q, k, v, attn_mask, sinks)
    out, lse, aux = _fwd_buffers(q, v, grad)
    plan = planner.plan_forward(spec, out, lse, aux if grad else None, family=family)
    if isinstance(plan, Unsupported):
        return plan.reason
    if grad:
        compute_dbias = attn_mask is not None and attn_mask.requires_grad
        plan = planner.plan_backward(spec, torch.empty_like(out), out, aux, None,
                                     *_bwd_buffers(spec, compute_dbias), family=family)
        if isinstance(plan, Unsupported):
            return f"backward: {plan.reason}"
    return None


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will ask for gradients of a call with these inputs:
    the faces pass it as ``return_aux``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _run_kernels(spec: AttentionSpec, plan_name: str, *plan_args) -> bool:
    """Plan and run on the selected backend; False means: use the reference path."""
    backend = backends.resolve(spec.q.device)
    if backend is not None and spec.q.numel() > 0 and spec.seqlen_k > 0:
        # The tile tables are per GPU family; the emulator plans like an M2 ("apple8").
        family = getattr(backend, "family", "apple8")
        plan = getattr(planner, plan_name)(spec, *plan_args, family=family)
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
        softcap: float, return_aux: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward on (B, H, L, D)-indexed tensors; see :mod:`torch_metal_flash.spec`.
    Returns ``out``, ``lse`` and ``aux`` (the backward's row state when
    ``return_aux``, else empty)."""
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    out, lse, aux = _fwd_buffers(q, v, return_aux)
    if not _run_kernels(spec, "plan_forward", out, lse, aux if return_aux else None):
        ref_out, ref_lse = reference.forward(spec, aux if return_aux else None)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    return out, lse, aux


def _fwd_buffers(q: Tensor, v: Tensor, return_aux: bool):
    B, H, Lq, _ = q.shape
    aux_shape = (B, H, Lq, aux_width(q.dtype, v.shape[-1])) if return_aux else (0,)
    return (empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Lq), dtype=stats_dtype(q.dtype)),
            q.new_empty(aux_shape, dtype=stats_dtype(q.dtype)))


@fwd.register_fake
def _(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
      return_aux):
    return _fwd_buffers(q, v, return_aux)


@torch.library.custom_op("metal_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, dlse: Optional[Tensor],
        attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
        diag_offset: int, window_left: int, window_right: int, softcap: float,
        compute_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`fwd` from its ``out`` and ``aux`` (``return_aux=True``):
    ``dq, dk, dv`` in the inputs' dtypes and layouts, ``dbias`` (B, H, Lq, Lk)
    when ``compute_dbias`` else empty, ``dsinks`` (H,) when ``sinks`` is given
    else empty; both float32 (float64 for float64 inputs)."""
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    B, H, Lq, _ = q.shape
    want = (B, H, Lq, aux_width(q.dtype, v.shape[-1]))
    if tuple(aux.shape) != want:
        raise ValueError(f"metal_flash.bwd: aux must be the forward's aux of shape {want} (fwd with "
                         f"return_aux=True), got {tuple(aux.shape)}")
    grads = _bwd_buffers(spec, compute_dbias)
    if not _run_kernels(spec, "plan_backward", dout, out, aux, dlse, *grads):
        for buf, ref in zip(grads, reference.backward(spec, dout, out, aux, dlse, compute_dbias)):
            buf.copy_(ref)
    return grads


def _bwd_buffers(spec: AttentionSpec, compute_dbias: bool):
    q = spec.q
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    return (empty_in_layout(q), empty_in_layout(spec.k), empty_in_layout(spec.v),
            q.new_empty((B, H, Lq, Lk) if compute_dbias else (0,), dtype=stats_dtype(q.dtype)),
            q.new_empty((H,) if spec.sinks is not None else (0,), dtype=stats_dtype(q.dtype)))


@bwd.register_fake
def _(dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
      window_right, softcap, compute_dbias):
    spec = _spec(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                 softcap)
    return _bwd_buffers(spec, compute_dbias)


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
    if aux.dim() == 1:
        # fwd ran with return_aux=False (a direct op call): recompute the row state.
        _, _, aux = torch.ops.metal_flash.fwd(q, k, v, attn_mask, alibi_slopes, sinks, *ctx.scalars, True)
    compute_dbias = bool(needs["attn_mask"])
    dq, dk, dv, dbias, dsinks = torch.ops.metal_flash.bwd(
        dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, *ctx.scalars, compute_dbias)
    dmask = dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if compute_dbias else None
    dsinks = dsinks.to(sinks.dtype) if needs["sinks"] else None
    return dq, dk, dv, dmask, None, dsinks, None, None, None, None, None, None


torch.library.register_autograd("metal_flash::fwd", _backward, setup_context=_setup_context)
