"""``flex_fwd`` and ``flex_bwd``: FlexAttention on the kernels, and flex_fwd's autograd formula.

Schemas::

    flex_fwd(Tensor q, Tensor k, Tensor v, str mods, Tensor[] captured, Tensor[] lists, int[] blocks,
             float scale, bool return_aux) -> (Tensor out, Tensor lse, Tensor aux)
    flex_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor aux, Tensor? dlse, str mods,
             Tensor[] captured, Tensor[] lists, int[] blocks, float scale)
        -> (Tensor dq, Tensor dk, Tensor dv, Tensor[] dcaptured)

The mods arrive compiled: ``mods`` is the header ``torch_metal_flash.flex.lowering``
generates (its first line says how many tensors it reads and which reads need a
gradient), ``captured`` the tensors it reads, in its order; ``lists`` the
BlockMask's block lists (int32): the key blocks of each query block -- counts
(b, h, rows), indices (b, h, rows, cols), then the full ones -- and the query
blocks of each key block, the same four; ``blocks`` = (query block size, key
block size, whether the full lists are real[, query sub-block size, key sub-block
size]): with sub-blocks (0: none), each direction's partial index rows are
followed by as many state words, 2 bits per sub-block of the listed block (0
hidden, 1 mask_mod, 2 visible; sub-block r of the row block and c of the listed
block at bits 2 (r * per_row + c)).  q, k, v are (B, H, L, D) with a
contiguous last dim, Hq a multiple of Hkv.  ``out`` is laid out like q, ``lse``
(B, Hq, Lq) float32 is +inf for a row that sees no key (whose output is 0),
``aux`` the backward's row state when ``return_aux`` (else empty).
``dcaptured`` holds the gradient of each captured tensor the header reads with
a gradient (in captured order), in its dtype: deterministic, summed per line by
the kernels, per index in a fixed order (:mod:`torch_metal_flash.planner.flex`).

These ops run on the kernels only (MPS tensors, or CPU tensors with the
emulator backend): the FlexAttention face decides before it calls them and
runs the dense definition itself when they cannot serve.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import torch_metal_flash.backends as backends
import torch_metal_flash.planner.flex as flex_planner
from ..planner.plan import Unsupported
from ..problem.layout import empty_in_layout
from ..problem.spec import aux_width, make_spec


def _meta(mods: str) -> dict:
    try:
        return flex_planner.describe(mods)
    except ValueError as e:
        raise ValueError(f"metal_flash.flex_fwd / flex_bwd: {e}") from None


def trainable(mods: str) -> list[int]:
    """The captured tensors (positions) whose gradients flex_bwd returns, in order."""
    return sorted({int(buffer) for buffer, _ in _meta(mods)["reads"]})


def _check(q: Tensor, k: Tensor, v: Tensor, mods: str, captured, lists, blocks) -> None:
    meta = _meta(mods)
    if len(captured) != meta["captured"]:
        raise ValueError(f"metal_flash.flex: mods read {meta['captured']} captured tensors, got {len(captured)}")
    if len(lists) != 8 or len(blocks) not in (3, 5):
        raise ValueError("metal_flash.flex: lists must be the 8 block-list tensors and blocks (q_block, kv_block, "
                         f"has_full[, q_sub, kv_sub]), got {len(lists)} and {len(blocks)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"metal_flash.flex: {name} must be a 4-D (B, H, L, D) tensor with a contiguous last "
                             f"dim, got shape {tuple(t.shape)} strides {t.stride()}")


def _fwd_outputs(q, k, v, mods, captured, lists, blocks, scale, return_aux):
    _check(q, k, v, mods, captured, lists, blocks)
    B, H, Lq, _ = q.shape
    aux_shape = (B, H, Lq, aux_width(q.dtype, v.shape[-1])) if return_aux else (0,)
    return (empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Lq), dtype=torch.float32),
            q.new_empty(aux_shape, dtype=torch.float32))


def _backend(q: Tensor):
    backend, reason = backends.select(q.device)
    if backend is None:
        raise RuntimeError("metal_flash.flex_fwd / flex_bwd run on the kernels only (MPS tensors, or CPU tensors "
                           f"with the emulator backend): {reason or 'the reference backend is selected'}; "
                           "torch_metal_flash.flex_attention falls back to the dense definition by itself")
    return backend


def _bound(t: Tensor) -> Tensor:
    """A captured tensor as the kernels read it: bool as bytes, float64 as float32, strides as they are
    (an expanded mask is read in place) unless negative."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    elif t.dtype == torch.float64:
        t = t.float()
    return t.contiguous() if any(s < 0 for s in t.stride()) else t


def _plan_inputs(mods: str, captured, lists, blocks):
    meta = _meta(mods)
    m = flex_planner.Mods(mods, tuple(_bound(t) for t in captured), tuple((b, w) for b, w in meta["reads"]))
    q_block, kv_block, has_full, q_sub, kv_sub = (int(x) for x in (*blocks, 0, 0)[:5])
    full = (lambda t: t) if has_full else (lambda t: None)  # noqa: E731
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx = lists
    by_query = flex_planner.Lists(q_block, kv_block, kv_num, kv_idx, full(fkv_num), full(fkv_idx), q_sub, kv_sub)
    by_key = flex_planner.Lists(kv_block, q_block, q_num, q_idx, full(fq_num), full(fq_idx), kv_sub, q_sub)
    return m, by_query, by_key


def _run(backend, plan) -> None:
    if isinstance(plan, Unsupported):  # e.g. a kernel that cannot be built: the face falls back
        raise backends.KernelsUnavailable(plan.reason)
    backend.run(plan)
    backends.record_run(backend.name)


@torch.library.custom_op("metal_flash::flex_fwd", mutates_args=())
def flex_fwd(q: Tensor, k: Tensor, v: Tensor, mods: str, captured: list[Tensor], lists: list[Tensor],
             blocks: list[int], scale: float, return_aux: bool) -> tuple[Tensor, Tensor, Tensor]:
    """FlexAttention forward on the kernels (see the module doc)."""
    backend = _backend(q)
    out, lse, aux = _fwd_outputs(q, k, v, mods, captured, lists, blocks, scale, return_aux)
    if lse.numel() == 0:
        return out, lse, aux
    m, by_query, by_key = _plan_inputs(mods, captured, lists, blocks)
    spec = make_spec(q, k, v, scale=scale)
    _run(backend, flex_planner.forward_plan(spec, out, lse, aux if return_aux else None, m, by_query, by_key,
                                            backend.family, backend.pipeline_info))
    return out, lse, aux


flex_fwd.register_fake(_fwd_outputs)


def _bwd_outputs(dout, q, k, v, out, aux, dlse, mods, captured, lists, blocks, scale):
    _check(q, k, v, mods, captured, lists, blocks)
    want = (*q.shape[:3], aux_width(q.dtype, v.shape[-1]))
    if tuple(aux.shape) != want:
        raise ValueError(f"metal_flash.flex_bwd: aux must be flex_fwd's aux of shape {want} (return_aux=True), got "
                         f"{tuple(aux.shape)}")
    return (empty_in_layout(q), empty_in_layout(k), empty_in_layout(v),
            [torch.empty_like(captured[i], memory_format=torch.contiguous_format) for i in trainable(mods)])


def _captured_grads(backend, plan, m: flex_planner.Mods, spec, partials: Tensor, captured) -> list[Tensor]:
    """Each trainable tensor's gradient: its reads' line sums sorted by index, added per index."""
    entries = flex_planner.grad_entries(m, spec)
    reads = [r for walk in flex_planner.WALKS for r in m.slots(walk)]
    out = []
    for buffer in sorted({b for b, _ in m.reads}):
        parts = torch.cat([partials[start:start + n] for (walk, slot, start, n), (b, _) in zip(entries, reads)
                           if b == buffer])
        numel, n = captured[buffer].numel(), parts.shape[0]
        index = parts[:, 0].long()
        index = torch.where(index < 0, numel, index)  # out of range: past every element (sorted last, never summed)
        # unique keys (index, then position): any sort gives the one order, so the sums are the same on every run
        order = torch.argsort(index * n + torch.arange(n, device=index.device))
        values = parts[:, 1].contiguous().view(torch.float32)[order].contiguous()
        bounds = torch.searchsorted(index[order].contiguous(), torch.arange(numel + 1, device=index.device))
        grad = torch.empty(numel, dtype=torch.float32, device=partials.device)
        if numel:
            _run(backend, flex_planner.segment_sum_plan(plan, values, bounds, grad))
        out.append(grad.view(captured[buffer].shape).to(captured[buffer].dtype))
    return out


@torch.library.custom_op("metal_flash::flex_bwd", mutates_args=())
def flex_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, aux: Tensor, dlse: Optional[Tensor],
             mods: str, captured: list[Tensor], lists: list[Tensor], blocks: list[int],
             scale: float) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of :func:`flex_fwd` from its ``out`` and ``aux`` (see the module doc)."""
    backend = _backend(q)
    dq, dk, dv, _ = _bwd_outputs(dout, q, k, v, out, aux, dlse, mods, captured, lists, blocks, scale)
    m, by_query, by_key = _plan_inputs(mods, captured, lists, blocks)
    spec = make_spec(q, k, v, scale=scale)
    partials = None
    if m.reads:
        total = sum(n for *_, n in flex_planner.grad_entries(m, spec))
        partials = torch.empty((total, 2), dtype=torch.int32, device=q.device)
    if q.numel() == 0 or k.shape[2] == 0:  # nothing attends: no gradient
        return (dq.zero_(), dk.zero_(), dv.zero_(),
                [torch.zeros_like(captured[i], memory_format=torch.contiguous_format) for i in trainable(mods)])
    plan = flex_planner.backward_plan(spec, dout, out, aux, dlse, dq, dk, dv, m, by_query, by_key, partials,
                                      backend.family, backend.pipeline_info)
    _run(backend, plan)
    return dq, dk, dv, _captured_grads(backend, plan, m, spec, partials, captured) if m.reads else []


flex_bwd.register_fake(_bwd_outputs)


def _setup_context(ctx, inputs, output):
    q, k, v, mods, captured, lists, blocks, scale, _ = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(q, k, v, output[0], output[2], *captured, *lists)
    ctx.mods, ctx.blocks, ctx.scale, ctx.n_captured = mods, blocks, scale, len(captured)
    ctx.trainable = trainable(mods)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, _daux):
    q, k, v, out, aux, *rest = ctx.saved_tensors
    captured, lists = rest[:ctx.n_captured], rest[ctx.n_captured:]
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()  # e.g. the expanded gradient of a sum(): the kernels read rows
    if dlse is not None:
        dlse = dlse.float().contiguous()
    if aux.numel() == 0:  # flex_fwd ran with return_aux=False: recompute the row state
        _, _, aux = torch.ops.metal_flash.flex_fwd(q, k, v, ctx.mods, captured, lists, ctx.blocks, ctx.scale, True)
    dq, dk, dv, dcaptured = torch.ops.metal_flash.flex_bwd(dout, q, k, v, out, aux, dlse, ctx.mods, captured, lists,
                                                            ctx.blocks, ctx.scale)
    grads = [None] * ctx.n_captured
    for i, g in zip(ctx.trainable, dcaptured):
        grads[i] = g
    return dq, dk, dv, None, grads, [None] * len(lists), None, None, None


flex_fwd.register_autograd(_backward, setup_context=_setup_context)
