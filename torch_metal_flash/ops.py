"""The ``torch.ops.metal_flash`` custom ops: schemas, fake kernels, autograd.

``fwd`` returns ``(out, lse)``; ``bwd`` returns ``(dq, dk, dv, dbias, dsinks)``.
Both take the general problem of :mod:`torch_metal_flash.spec` so that the
SDPA and flash-attn faces map onto them without copies.  Each call plans the
kernels for the selected backend and falls back to the reference path (with
a one-time warning naming the reason) when the kernels do not cover it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backends, checks, planner, reference
from .layout import empty_in_layout
from .plan import Unsupported
from .spec import AttentionSpec, make_spec, stats_dtype


def check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
               softcap) -> None:
    """Clear errors, naming the argument, for what the op cannot mean (the faces check
    their own arguments first; this guards direct calls of the ops)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, t, ndim=(4,))
        checks.float_dtype(name, t)
        checks.head_dim(name, t)
    checks.same(("q", "k", "v"), (q, k, v), "dtype")
    checks.same(("q", "k", "v"), (q, k, v), "device")
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
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap)
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
    plan = planner.plan_forward(spec, out, lse, family=family)
    if isinstance(plan, Unsupported):
        return plan.reason
    tensors = (q, k, v, attn_mask, sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        compute_dbias = attn_mask is not None and attn_mask.requires_grad
        plan = planner.plan_backward(spec, torch.empty_like(out), out, lse, None,
                                        *_bwd_buffers(spec, compute_dbias), family=family)
        if isinstance(plan, Unsupported):
            return f"backward: {plan.reason}"
    return None


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
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap)
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
