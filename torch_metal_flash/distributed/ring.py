"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank keeps its query rows and passes K/V blocks around the ring: at step ``s`` rank ``r``
holds the block of rank ``r - s`` and runs the ``metal_flash.fwd`` kernels on the pairs of rows
the causal band needs (:func:`.layout.calls`), while the next block travels.  The partial
results are merged exactly with their float32 log-sum-exp (float64 for float64 inputs), from
the kernels' unrounded output rows.

The backward runs ``metal_flash.bwd`` per step with the row's *global* state -- aux =
(m = lse, l = 1) and the merged output -- so every call yields that block's exact share of
dQ, dK and dV; the dK/dV partials travel around the ring with their block, in float32, and
arrive at their owner after ``world`` hops.
"""
from __future__ import annotations

import math
import struct
from typing import Optional

import torch
from torch import Tensor
import torch.distributed as dist

from ..problem.spec import aux_width, stats_dtype
import torch_metal_flash.distributed.layout as layout
import torch_metal_flash.ops as ops
from .transport import Ring, resolve_group

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _band(call: layout.Call) -> dict:
    """The ops' diag_offset, window_left and window_right of a call: its causal band, or none."""
    causal = call.diag_offset is not None
    return dict(diag_offset=call.diag_offset if causal else 0, window_left=-1, window_right=0 if causal else -1)


def _block_forward(q, k, v, scale: float, call: layout.Call):
    """(out, lse) of one call, out unrounded (float32 for float16/bfloat16 inputs: aux's output rows)."""
    out, lse, aux = ops.fwd_call(q=q[:, :, call.q], k=k[:, :, call.k], v=v[:, :, call.k], attn_mask=None,
                                 alibi_slopes=None, sinks=None, scale=scale, **_band(call), softcap=0.0,
                                 return_aux=True)
    return (aux[..., 2:] if aux.shape[-1] > 2 else out), lse


def _block_backward(dout, q, k, v, out, aux, scale: float, call: layout.Call):
    """(dq, dk, dv) of one call from the rows' global output and row state."""
    qs, ks = call.q, call.k
    dq, dk, dv, _, _ = ops.bwd_call(dout=dout[:, :, qs], q=q[:, :, qs], k=k[:, :, ks], v=v[:, :, ks], out=out[:, :, qs],
                                    aux=aux[:, :, qs].contiguous(), dlse=None, attn_mask=None, alibi_slopes=None,
                                    sinks=None, scale=scale, **_band(call), softcap=0.0, compute_dbias=False)
    return dq, dk, dv


def _merge(acc: Tensor, lse: Tensor, out: Tensor, out_lse: Tensor) -> None:
    """Fold one call's (out, lse) into the running (acc, lse) of its rows, in place, in the stats dtype."""
    out_lse = out_lse.masked_fill(out_lse == math.inf, -math.inf)  # a row that saw nothing of this block
    new = torch.logaddexp(lse, out_lse)
    seen = new > -math.inf
    old_w = torch.where(seen, torch.exp(lse - torch.where(seen, new, 0.0)), 0.0).unsqueeze(-1)
    new_w = torch.where(seen, torch.exp(out_lse - torch.where(seen, new, 0.0)), 0.0).unsqueeze(-1)
    acc.mul_(old_w).add_(out.to(acc.dtype) * new_w)
    lse.copy_(new)


def _check_local(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, load_balance: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be a 4-D (B, H, L_local, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"ring_attention: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"ring_attention: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"ring_attention: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3] or k.shape[3] != q.shape[3] or k.shape[0] != q.shape[0]:
        raise ValueError(f"ring_attention: expected k (B, Hkv, L_local, D) and v (B, Hkv, L_local, Dv) with q's B and "
                         f"D, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"ring_attention: q and k/v must hold the same rows of the sequence (L_local), got "
                         f"{q.shape[2]} query rows and {k.shape[2]} key rows")
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        need = "a multiple of" if enable_gqa else "equal to (or pass enable_gqa=True for a divisor of)"
        raise ValueError(f"ring_attention: q's heads ({q.shape[1]}) must be {need} k/v's heads ({k.shape[1]})")
    if load_balance and q.shape[2] % 2:
        raise ValueError(f"ring_attention: load_balance=True needs an even L_local (two half chunks per rank, "
                         f"see zigzag_shard), got {q.shape[2]}")


def _check_across_ranks(ring: Ring, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                        load_balance: bool) -> None:
    """Every rank must call with the same problem: one small all_gather, then the same error on every rank."""
    facts = {"batch": q.shape[0], "query heads": q.shape[1], "kv heads": k.shape[1], "L_local": q.shape[2],
             "head dim": q.shape[3], "value head dim": v.shape[3], "dtype": _DTYPES.index(q.dtype),
             "causal": int(causal), "scale": _bits(scale), "load_balance": int(load_balance)}
    mine = torch.tensor(list(facts.values()), dtype=torch.int64, device=ring.wire)  # int64: MPS has no float64
    gathered = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(gathered, mine, group=ring.group)
    table = torch.stack(gathered).cpu().tolist()  # setup, once per call: a handful of numbers
    for col, name in enumerate(facts):
        values = {row[col] for row in table}
        if len(values) > 1:
            show = (lambda x: str(_DTYPES[x]).removeprefix("torch.")) if name == "dtype" else (
                (lambda x: repr(_from_bits(x))) if name == "scale" else str)
            per_rank = ", ".join(f"rank {r}: {show(row[col])}" for r, row in enumerate(table))
            what = "equal chunks (L_local)" if name == "L_local" else f"the same {name}"
            raise ValueError(f"ring_attention: every rank of the group must pass {what}; got {per_rank}")


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, causal: bool, scale: float, load_balance: bool):
        B, H, L, _ = q.shape
        rank, world = ring.rank, ring.world
        sdt = stats_dtype(q.dtype)
        acc = q.new_zeros((B, H, L, v.shape[3]), dtype=sdt)
        lse = q.new_full((B, H, L), -math.inf, dtype=sdt)
        q_runs = layout.runs(rank, world, L, load_balance)
        shapes = [(k.shape, k.dtype), (v.shape, v.dtype)]
        block, wire = (k, v), None
        for step in range(world):
            transfer = None
            if step + 1 < world:
                wire = ring.to_wire(block) if wire is None else wire
                transfer = ring.shift(wire)  # the next block travels while this one is computed
            src = (rank - step) % world
            for call in layout.calls(q_runs, layout.runs(src, world, L, load_balance), causal):
                out, out_lse = _block_forward(q, *block, scale, call)
                _merge(acc[:, :, call.q], lse[:, :, call.q], out, out_lse)
            if transfer is not None:
                wire = transfer.wait()
                block = tuple(ring.from_wire(wire, shapes))
        out = acc.to(q.dtype)
        seen = lse > -math.inf
        # The backward's row state: P = exp(s - lse) / 1 for the whole row, and delta from the unrounded output.
        aux = torch.stack((torch.where(seen, lse, 0.0), seen.to(sdt)), dim=-1)
        if aux_width(q.dtype, v.shape[3]) > 2:
            aux = torch.cat((aux, acc), dim=-1)
        lse = lse.masked_fill(~seen, math.inf)  # the ops' convention for a row that sees nothing
        ctx.save_for_backward(q, k, v, out, aux)
        ctx.mark_non_differentiable(lse)
        ctx.ring, ctx.scale, ctx.causal, ctx.load_balance = ring, scale, causal, load_balance
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, aux = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        rank, world = ring.rank, ring.world
        L = q.shape[2]
        sdt = stats_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=sdt, device=q.device)
        q_runs = layout.runs(rank, world, L, ctx.load_balance)
        kv_shapes = [(k.shape, k.dtype), (v.shape, v.dtype)]
        grad_shapes = [(k.shape, sdt), (v.shape, sdt)]
        block, wire, grads_in = (k, v), None, None
        for step in range(world):
            transfer = None
            if step + 1 < world:
                wire = ring.to_wire(block) if wire is None else wire
                transfer = ring.shift(wire)
            src = (rank - step) % world
            dk = torch.zeros(k.shape, dtype=sdt, device=q.device)
            dv = torch.zeros(v.shape, dtype=sdt, device=q.device)
            for call in layout.calls(q_runs, layout.runs(src, world, L, ctx.load_balance), ctx.causal):
                g = _block_backward(dout, q, *block, out, aux, scale, call)
                dq[:, :, call.q] += g[0]
                dk[:, :, call.k] += g[1]
                dv[:, :, call.k] += g[2]
            if grads_in is not None:
                # the partials of the ranks this block visited before (they travel with it, in float32)
                dk_in, dv_in = ring.from_wire(grads_in.wait(), grad_shapes)
                dk += dk_in
                dv += dv_in
            grads_in = ring.shift(ring.to_wire((dk, dv))) if world > 1 else None
            if transfer is not None:
                wire = transfer.wait()
                block = tuple(ring.from_wire(wire, kv_shapes))
        if grads_in is not None:  # after `world` hops a block's partials are back at its owner
            dk, dv = ring.from_wire(grads_in.wait(), grad_shapes)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                   load_balance: bool = False) -> Tensor:
    """Attention over a sequence split across the ranks of ``group`` (default: the default group).

    ``q`` (B, Hq, L_local, D), ``k`` (B, Hkv, L_local, D) and ``v`` (B, Hkv, L_local, Dv) are this
    rank's rows of the sequence, with the same ``L_local`` on every rank: rows ``[r * L_local,
    (r + 1) * L_local)`` on rank ``r``, or, with ``load_balance=True``, the head-tail rows
    :func:`~torch_metal_flash.distributed.zigzag_shard` gives.  Returns this rank's rows of
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)``
    over the whole sequence (causal aligned top-left, ``scale`` defaults to ``1 / sqrt(D)``),
    differentiable in ``q``, ``k`` and ``v``.  Every rank of the group must call it together.
    See docs/distributed.md."""
    return ring_attention_with_lse(q, k, v, group=group, causal=causal, scale=scale, enable_gqa=enable_gqa,
                                   load_balance=load_balance)[0]


def ring_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None,
                            causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                            load_balance: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`ring_attention` and the rows' log-sum-exp over the whole sequence ((B, Hq, L_local),
    float32; float64 for float64 inputs; not differentiable)."""
    _check_local(q, k, v, enable_gqa, load_balance)
    group, rank, world = resolve_group(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    ring = Ring(group, rank, world, q.device)
    _check_across_ranks(ring, q, k, v, bool(causal), scale, bool(load_balance))
    out, lse = _RingAttention.apply(q, k, v, ring, bool(causal), scale, bool(load_balance))
    return out, lse.detach()
