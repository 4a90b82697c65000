"""``fwd``, ``bwd`` and ``fwd_probs``: attention over (B, H, L, D) tensors, and fwd's autograd formula."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

import torch_metal_flash.backends as backends
import torch_metal_flash.core as core
import torch_metal_flash.planner as planner
import torch_metal_flash.reference as reference
from ..planner.plan import Unsupported
from ..problem.layout import empty_in_layout
from ..problem.spec import AttentionSpec, aux_width, stats_dtype
import torch_metal_flash.ops.paged as paged
from .arguments import OpCall, check_args, check_dropout_varlen, check_index_values, schema_args, spec_of


def unsupported_reason(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right,
                       softcap, dropout_p: float = 0.0) -> Optional[str]:
    """None when the selected backend would run the kernels for this call (and,
    when an input requires grad, for its backward); else why the op would take
    the reference path.  Answered from the plan cache; warns about nothing."""
    backend, why = backends.select(q.device)
    if backend is None:
        return why or "the reference backend is selected"
    grad = needs_grad(q, k, v, attn_mask, sinks)
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device) if dropout_p > 0 else None  # values unread
    problem = dict(q=q, k=k, v=v, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, scale=float(scale),
                   diag_offset=int(diag_offset), window_left=int(window_left), window_right=int(window_right),
                   softcap=float(softcap), dropout_p=float(dropout_p), rng_state=rng_state, cu_seqlens_q=None,
                   cu_seqlens_k=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0)
    args = FwdArgs(**problem, return_aux=grad, block_table=None)
    reason = core.probe(FWD, backend.name, tuple(args))
    if reason is not None:
        return reason
    if grad:
        out, lse, aux = _fwd_outputs(*args)
        compute_dbias = attn_mask is not None and attn_mask.requires_grad
        reason = core.probe(BWD, backend.name, tuple(BwdArgs(**problem, dout=torch.empty_like(out), out=out, aux=aux,
                                                             dlse=None, compute_dbias=compute_dbias)))
        if reason is not None:
            return f"backward: {reason}"
    return None


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will ask for gradients of a call with these inputs (the
    faces pass it as ``return_aux``)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


# ---------------------------------------------------------------------------
# fwd
# ---------------------------------------------------------------------------

def _fwd_buffers(q: Tensor, v: Tensor, return_aux: bool):
    B, H, Lq, _ = q.shape
    aux_shape = (B, H, Lq, aux_width(q.dtype, v.shape[-1])) if return_aux else (0,)
    return (empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Lq), dtype=stats_dtype(q.dtype)),
            q.new_empty(aux_shape, dtype=stats_dtype(q.dtype)))


def _fwd_outputs(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                 return_aux, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                 block_table=None, max_seqlen_q=0, max_seqlen_k=0):
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
               cu_seqlens_q, block_table)
    check_dropout_varlen(q, k, v, attn_mask, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         block_table, max_seqlen_q, max_seqlen_k)
    return _fwd_buffers(q, v, return_aux)


def _fwd_spec(args: tuple) -> AttentionSpec:
    return spec_of(FwdArgs(*args))


def _fwd_plan(backend, args: tuple, outputs: tuple):
    spec = _fwd_spec(args)
    if spec.varlen is None and (spec.q.numel() == 0 or spec.seqlen_k == 0):
        return None  # nothing for a kernel to do: the reference fills zeros / lse / aux
    out, lse, aux = outputs
    # Launches are checked against the pipelines' limits here, before any is encoded.
    return planner.plan_forward(spec, out, lse, aux if FwdArgs(*args).return_aux else None, family=backend.family,
                                pipeline_info=backend.pipeline_info)


def _fwd_reference(*args):
    out, lse, aux = _fwd_outputs(*args)
    spec = _fwd_spec(args)
    check_index_values(spec)  # the reference path reads them on the host anyway
    ref_out, ref_lse = reference.forward(spec, aux if FwdArgs(*args).return_aux else None)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse, aux


def _fwd_debug_check(*args) -> None:
    check_index_values(_fwd_spec(args))


@torch.library.custom_op("metal_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
        softcap: float, return_aux: bool, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None,
        cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
        seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None, max_seqlen_q: int = 0,
        max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward on (B, H, L, D)-indexed tensors; see :mod:`torch_metal_flash.problem.spec`.
    Returns ``out``, ``lse`` and ``aux`` (the backward's row state when
    ``return_aux``, else empty).  Dropout and varlen: see the module doc."""
    return core.python_body(FWD, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                window_right, softcap, return_aux, dropout_p, rng_state, cu_seqlens_q,
                                cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k))


fwd.register_fake(_fwd_outputs)
FwdArgs = schema_args("metal_flash::fwd")


# ---------------------------------------------------------------------------
# bwd
# ---------------------------------------------------------------------------

def _bwd_buffers(spec: AttentionSpec, compute_dbias: bool):
    q = spec.q
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    return (empty_in_layout(q), empty_in_layout(spec.k), empty_in_layout(spec.v),
            q.new_empty((B, H, Lq, Lk) if compute_dbias else (0,), dtype=stats_dtype(q.dtype)),
            q.new_empty((H,) if spec.sinks is not None else (0,), dtype=stats_dtype(q.dtype)))


def _bwd_spec(args: tuple) -> AttentionSpec:
    """The spec of bwd's arguments (no block_table: bwd takes packed K/V, see :mod:`.paged`)."""
    return spec_of(BwdArgs(*args))


def _bwd_outputs(dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                 window_right, softcap, compute_dbias, dropout_p=0.0, rng_state=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0):
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
               cu_seqlens_q)
    want = (*q.shape[:3], aux_width(q.dtype, v.shape[-1]))
    if tuple(aux.shape) != want:
        raise ValueError(f"metal_flash.bwd: aux must be the forward's aux of shape {want} (fwd with "
                         f"return_aux=True), got {tuple(aux.shape)}")
    args = (dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
            window_right, softcap, compute_dbias, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k,
            max_seqlen_q, max_seqlen_k)
    return _bwd_buffers(_bwd_spec(args), compute_dbias)


def _bwd_plan(backend, args: tuple, outputs: tuple):
    spec, a = _bwd_spec(args), BwdArgs(*args)
    if spec.varlen is None and (a.q.numel() == 0 or spec.seqlen_k == 0):
        return None
    return planner.plan_backward(spec, a.dout, a.out, a.aux, a.dlse, *outputs, family=backend.family,
                                 pipeline_info=backend.pipeline_info)


def _bwd_reference(*args):
    a = BwdArgs(*args)
    grads = _bwd_outputs(*args)
    spec = _bwd_spec(args)
    check_index_values(spec)
    for buf, ref in zip(grads, reference.backward(spec, a.dout, a.out, a.aux, a.dlse, a.compute_dbias)):
        buf.copy_(ref)
    return grads


@torch.library.custom_op("metal_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, dlse: Optional[Tensor],
        attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
        diag_offset: int, window_left: int, window_right: int, softcap: float, compute_dbias: bool,
        dropout_p: float = 0.0, rng_state: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, max_seqlen_q: int = 0,
        max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`fwd` from its ``out`` and ``aux`` (``return_aux=True``):
    ``dq, dk, dv`` in the inputs' dtypes and layouts, ``dbias`` (B, H, Lq, Lk) when
    ``compute_dbias`` else empty, ``dsinks`` (H,) when ``sinks`` is given else
    empty; both float32 (float64 for float64 inputs).  The dropout and varlen
    arguments must be the forward's (the same ``rng_state`` regenerates its mask);
    varlen dK/dV rows of keys a sequence does not use (seqused_k) are zero."""
    return core.python_body(BWD, (dout, q, k, v, out, aux, dlse, attn_mask, alibi_slopes, sinks, scale, diag_offset,
                                window_left, window_right, softcap, compute_dbias, dropout_p, rng_state,
                                cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k))


bwd.register_fake(_bwd_outputs)
BwdArgs = schema_args("metal_flash::bwd")


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    a = FwdArgs(*inputs)
    out, lse, aux = output
    ctx.mark_non_differentiable(aux)
    ctx.save_for_backward(a.q, a.k, a.v, out, aux, a.attn_mask, a.alibi_slopes, a.sinks, a.rng_state, a.cu_seqlens_q,
                          a.cu_seqlens_k, a.seqused_k, a.block_table)
    ctx.scalars = dict(scale=a.scale, diag_offset=a.diag_offset, window_left=a.window_left,
                       window_right=a.window_right, softcap=a.softcap)
    ctx.dropout_p, ctx.max_seqlens = a.dropout_p, (a.max_seqlen_q, a.max_seqlen_k)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, _daux):
    q, k, v, out, aux, attn_mask, alibi_slopes, sinks, *extra = ctx.saved_tensors
    rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = extra
    needs = dict(zip(FwdArgs._fields, ctx.needs_input_grad))
    if needs["alibi_slopes"]:
        raise NotImplementedError("metal_flash.fwd: gradients for alibi_slopes are not supported")
    max_seqlens = ctx.max_seqlens
    layout = None
    if block_table is not None:
        # Paged K/V: the varlen backward runs on the cache gathered into a padded packed
        # layout; dK/dV are summed back into the blocks (torch_metal_flash.ops.paged).
        layout = paged.padded_layout(block_table, cu_seqlens_k, seqused_k, max_seqlens[1], page=k.shape[2],
                                     num_blocks=k.shape[0])
        caches = (k, v)
        k, v = paged.gather(k, layout), paged.gather(v, layout)
        cu_seqlens_k, seqused_k, max_seqlens = layout.cu_seqlens_k, layout.seqused_k, (max_seqlens[0],
                                                                                        layout.max_seqlen_k)
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.shape[-1] > 1 and dout.stride(-1) != 1:
        dout = dout.contiguous()  # e.g. the expanded gradient of a sum(): the kernels read rows
    if dlse is not None:
        dlse = dlse.contiguous()
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k)
    max_seqlens = dict(zip(("max_seqlen_q", "max_seqlen_k"), max_seqlens))
    if aux.dim() == 1:
        # fwd ran with return_aux=False (a direct op call): recompute the row state.
        _, _, aux = fwd_call(q=q, k=k, v=v, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks,
                             **ctx.scalars, return_aux=True, dropout_p=ctx.dropout_p, rng_state=rng_state, **varlen,
                             **max_seqlens)
    compute_dbias = bool(needs["attn_mask"])
    dq, dk, dv, dbias, dsinks = bwd_call(
        dout=dout, q=q, k=k, v=v, out=out, aux=aux, dlse=dlse, attn_mask=attn_mask, alibi_slopes=alibi_slopes,
        sinks=sinks, **ctx.scalars, compute_dbias=compute_dbias, dropout_p=ctx.dropout_p, rng_state=rng_state, **varlen,
        **max_seqlens)
    if layout is not None:
        dk, dv = paged.scatter_sums((dk if needs["k"] else None, dv if needs["v"] else None), layout, caches)
    dmask = dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if compute_dbias else None
    dsinks = dsinks.to(sinks.dtype) if needs["sinks"] else None
    return (dq, dk, dv, dmask, None, dsinks) + (None,) * (len(FwdArgs._fields) - 6)


# ---------------------------------------------------------------------------
# fwd_probs (debug): flash-attn's S_dmask of a fwd call
# ---------------------------------------------------------------------------

def _probs_spec(args: tuple) -> AttentionSpec:
    return spec_of(ProbsArgs(*args))


def _probs_outputs(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                   dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                   block_table=None, max_seqlen_q=0, max_seqlen_k=0):
    args = ProbsArgs(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
                     dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                     max_seqlen_k)
    check_args(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left, window_right, softcap,
               cu_seqlens_q, block_table)
    spec = spec_of(args)
    return (q.new_empty(planner.forward.probs_shape(spec)),)


def _probs_plan(backend, args: tuple, outputs: tuple):
    spec = _probs_spec(args)
    if spec.varlen is None and (spec.q.numel() == 0 or spec.seqlen_k == 0):
        return None
    out, lse, _ = _fwd_buffers(spec.q, spec.v, False)  # the forward's results are not returned: scratch
    plan = planner.plan_prefill(spec, out, lse, None, family=backend.family, pipeline_info=backend.pipeline_info,
                                probs=outputs[0])
    return plan if isinstance(plan, Unsupported) else dataclasses.replace(plan, scratch=(out, lse))


def _probs_reference(*args):
    spec = _probs_spec(args)
    check_index_values(spec)
    return (reference.probs(spec),)


@torch.library.custom_op("metal_flash::fwd_probs", mutates_args=())
def fwd_probs(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
              sinks: Optional[Tensor], scale: float, diag_offset: int, window_left: int, window_right: int,
              softcap: float, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None,
              cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None, max_seqlen_q: int = 0,
              max_seqlen_k: int = 0) -> Tensor:
    """flash-attn's ``S_dmask`` of :func:`fwd` with the same arguments (debug, O(L^2);
    see the module doc).  Not differentiable."""
    return core.python_body(FWD_PROBS, (q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset, window_left,
                                      window_right, softcap, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k,
                                      seqused_k, block_table, max_seqlen_q, max_seqlen_k))[0]

fwd_probs.register_fake(lambda *args: _probs_outputs(*args)[0])
ProbsArgs = schema_args("metal_flash::fwd_probs")


# ---------------------------------------------------------------------------
# The C++ core runs the ops (and fwd's autograd formula when a call needs a graph).
# ---------------------------------------------------------------------------

FWD = core.register(core.CoreOp("metal_flash::fwd", outputs=_fwd_outputs, plan=_fwd_plan, reference=_fwd_reference,
                                setup_context=_setup_context, backward=_backward, debug_check=_fwd_debug_check))


FWD_PROBS = core.register(core.CoreOp("metal_flash::fwd_probs", outputs=_probs_outputs, plan=_probs_plan,
                                      reference=_probs_reference, debug_check=lambda *args: check_index_values(
                                          _probs_spec(args))))


BWD = core.register(core.CoreOp("metal_flash::bwd", outputs=_bwd_outputs, plan=_bwd_plan, reference=_bwd_reference))

# The ops called by argument name (the package's and the benches' calls go through these)
fwd_call = OpCall("metal_flash::fwd")
bwd_call = OpCall("metal_flash::bwd")
fwd_probs_call = OpCall("metal_flash::fwd_probs")
