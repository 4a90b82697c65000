"""Plain-PyTorch attention: the reference backend and the oracle for the kernels.

Implements every feature of :class:`~torch_metal_flash.problem.spec.AttentionSpec`
exactly, in float32 (float64 for float64 inputs).  Query rows are processed in
chunks so that no more than ``_CHUNK_ELEMENTS`` scores exist at once: memory is
O(L) for long sequences, never B·H·L·S.  GQA broadcasts K/V per group in the
matmul; nothing is repeated in memory.  Dropout draws the kernels' Philox mask
(:mod:`.philox`) per chunk; a varlen problem runs sequence by sequence (its
boundaries read on the host: this is the fallback, not the kernel path).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch

import torch_metal_flash.problem.philox as philox
from ..problem.layout import empty_in_layout
from ..problem.spec import AttentionSpec, stats_dtype

_CHUNK_ELEMENTS = 1 << 24  # scores per chunk (64 MiB in float32)
# A row whose lse is below this has every score below it too (e.g. a float mask
# of finfo.min on all keys: a padding row).  At that magnitude q.k is lost to
# rounding, the row is constant in q and k, and it passes no gradient — the
# kernels' rule as well (flash_bwd.metal's preprocess kernel).
SATURATED_LSE = -1e37


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _row_chunks(spec: AttentionSpec):
    per_row = max(1, spec.batch * spec.heads * spec.seqlen_k)
    step = max(1, _CHUNK_ELEMENTS // per_row)
    for r0 in range(0, spec.seqlen_q, step):
        yield r0, min(spec.seqlen_q, r0 + step)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hkv, G, ...) as a view."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


class _Chunk:
    """Scores and probabilities of query rows [r0, r1) for all heads.

    Probabilities are normalised by the row maximum (never as exp(s - lse)):
    when every score of a row is huge and negative (a float mask of
    ``finfo.min``), lse rounds to the maximum and exp(s - lse) would not sum to 1.
    """

    def __init__(self, spec: AttentionSpec, r0: int, r1: int, kf: torch.Tensor):
        ct = kf.dtype
        self.spec, self.r0, self.r1 = spec, r0, r1
        self.qc = spec.q[:, :, r0:r1].to(ct)
        s = (_grouped(self.qc, spec.kv_heads) @ kf.unsqueeze(2).transpose(-1, -2)).flatten(1, 2)
        s = s * spec.scale
        self.tanh = None
        if spec.softcap > 0:
            self.tanh = torch.tanh(s / spec.softcap)
            s = spec.softcap * self.tanh
        i = torch.arange(r0, r1, device=s.device).unsqueeze(-1)
        j = torch.arange(spec.seqlen_k, device=s.device)
        if spec.alibi_slopes is not None:
            dist = (i + spec.diag_offset - j).abs().to(ct)
            s = s - spec.alibi_slopes.to(ct)[:, :, None, None] * dist
        visible = spec.visible(i, j)
        if spec.mask is not None:
            m = spec.mask[:, :, r0:r1]
            if m.dtype == torch.bool:
                visible = visible & m
            else:
                s = s + m.to(ct)
        s = s.masked_fill(~visible, float("-inf"))
        self.s = s
        self.visible = s > float("-inf")  # a -inf float mask entry hides its key too
        row_max = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), float("-inf"))
        sink = None
        if spec.sinks is not None:
            sink = spec.sinks.to(ct)[None, :, None, None]
            row_max = torch.maximum(row_max, sink)
        row_max = row_max.masked_fill(~torch.isfinite(row_max), 0.0)  # empty rows: any finite shift
        self.row_max = row_max
        e = torch.exp(s - row_max)
        total = e.sum(dim=-1, keepdim=True)
        if sink is not None:
            self.sink_e = torch.exp(sink - row_max)
            total = total + self.sink_e
        nonempty = total != 0  # a NaN row stays NaN (out and lse), as torch's SDPA does
        self.total = total
        self.p = torch.where(nonempty, e / total, 0.0)
        # lse = +inf marks a row with nothing visible (exp(s - lse) = 0 there).
        self.lse = torch.where(nonempty, row_max + torch.log(total), float("inf")).squeeze(-1)
        # Dropout: which probabilities survive, and their factor (keep / (1 - p)); else None.
        self.keep = self.drop = None
        if spec.dropout is not None:
            d = spec.dropout
            B, H = spec.batch, spec.heads
            bh = ((torch.arange(B) + d.batch_offset) * H)[:, None, None, None] + torch.arange(H)[None, :, None, None]
            self.keep = philox.keep_mask(d.rng_state, d.p, bh, i[None, None], j[None, None, None], device=s.device)
            self.drop = self.keep.to(ct) * philox.keep_scale(d.p)

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (probabilities or their gradient) through the dropout mask."""
        return x if self.drop is None else x * self.drop

    def sink_probs(self) -> torch.Tensor:
        return torch.where(self.total != 0, self.sink_e / self.total, 0.0).squeeze(-1)

    def use_row_state(self, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        """Rebuild ``P = exp(s - m) / l`` from a given row state (aux's ``m`` and ``l``, (B, H, rows)),
        as the kernels' backward does; returns which rows pass a gradient (``l > 0``, not saturated).
        The forward's own state gives back the same P; another one -- the global state of a row
        whose keys are split over several calls (ring attention) -- gives that row's share of it."""
        m, l = m.unsqueeze(-1).to(self.s.dtype), l.unsqueeze(-1).to(self.s.dtype)
        live = (l > 0) & (m > SATURATED_LSE)
        inv_l = torch.where(live, 1.0 / torch.where(live, l, 1.0), 0.0)
        self.p = torch.where(live, torch.exp(self.s - torch.where(live, m, 0.0)), 0.0) * inv_l
        if self.spec.sinks is not None:
            self.total = torch.where(live, l, 0.0)
            sink = self.spec.sinks.to(self.s.dtype)[None, :, None, None]
            self.sink_e = torch.where(live, torch.exp(sink - torch.where(live, m, 0.0)), 0.0)
        return live.squeeze(-1)


def forward(spec: AttentionSpec, aux: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out`` (q's dtype and layout) and ``lse`` (float32, (B, Hq, Lq)).

    When ``aux`` is given it is filled with the row state of
    :mod:`torch_metal_flash.problem.spec` (row max and sum; the output before it is
    rounded to the input dtype), which either backward (reference or kernels)
    can take.
    """
    if spec.varlen is not None:
        return _varlen_forward(spec, aux)
    ct = compute_dtype(spec.q)
    kf, vf = spec.k.to(ct), spec.v.to(ct)
    out = empty_in_layout(spec.q, spec.head_dim_v)
    lse = torch.empty(spec.q.shape[:3], dtype=stats_dtype(spec.q.dtype), device=spec.q.device)
    for r0, r1 in _row_chunks(spec):
        c = _Chunk(spec, r0, r1, kf)
        o = (_grouped(c.dropped(c.p), spec.kv_heads) @ vf.unsqueeze(2)).flatten(1, 2)
        out[:, :, r0:r1] = o
        lse[:, :, r0:r1] = c.lse
        if aux is not None:
            aux[:, :, r0:r1, 0] = c.row_max.squeeze(-1)
            aux[:, :, r0:r1, 1] = c.total.squeeze(-1)
            if aux.shape[-1] > 2:
                aux[:, :, r0:r1, 2:] = o
    return out, lse


def backward(spec: AttentionSpec, dout: torch.Tensor, out: torch.Tensor, aux: torch.Tensor,
             dlse: Optional[torch.Tensor] = None, compute_dbias: bool = False):
    """Gradients ``(dq, dk, dv, dbias, dsinks)`` from the saved ``out`` and ``aux``.

    The probabilities are rebuilt from aux's row state, ``P = exp(s - m) / l``, as the
    kernels do (:meth:`_Chunk.use_row_state`); ``delta = rowsum(dO * O)`` takes O from ``aux`` when it holds the unrounded
    output (float16/bfloat16 inputs), else from ``out``.

    ``dbias`` (B, Hq, Lq, Lk) when ``compute_dbias`` (else empty) and ``dsinks``
    (Hq,) when the spec has sinks (else empty), in the compute dtype.
    """
    if spec.varlen is not None:
        return _varlen_backward(spec, dout, out, aux, dlse)
    ct = compute_dtype(spec.q)
    kf, vf = spec.k.to(ct), spec.v.to(ct)
    Hkv = spec.kv_heads
    dq = empty_in_layout(spec.q)
    dk = torch.zeros(spec.k.shape, dtype=ct, device=spec.k.device)
    dv = torch.zeros(spec.v.shape, dtype=ct, device=spec.v.device)
    B, H, Lq, Lk = spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k
    dbias = torch.empty((B, H, Lq, Lk) if compute_dbias else (0,), dtype=ct, device=spec.q.device)
    dsinks = torch.zeros((H,) if spec.sinks is not None else (0,), dtype=ct, device=spec.q.device)
    for r0, r1 in _row_chunks(spec):
        c = _Chunk(spec, r0, r1, kf)
        live = c.use_row_state(aux[:, :, r0:r1, 0], aux[:, :, r0:r1, 1])
        do = dout[:, :, r0:r1].to(ct)
        o = aux[:, :, r0:r1, 2:] if aux.shape[-1] > 2 else out[:, :, r0:r1]
        delta = (do * o.to(ct)).sum(-1)  # D = rowsum(dO * O)
        if dlse is not None:
            delta = delta - dlse[:, :, r0:r1].to(ct)
        dp = c.dropped((_grouped(do, Hkv) @ vf.unsqueeze(2).transpose(-1, -2)).flatten(1, 2))
        ds = c.p * (dp - delta.unsqueeze(-1))  # gradient of the final score
        if compute_dbias:
            dbias[:, :, r0:r1] = ds
        if spec.sinks is not None:
            dsinks -= (c.sink_probs() * live * delta).sum(dim=(0, 2))
        if c.tanh is not None:
            ds = ds * (1 - c.tanh * c.tanh)
        ds = ds * spec.scale
        dsg, pg = _grouped(ds, Hkv), _grouped(c.dropped(c.p), Hkv)
        dq[:, :, r0:r1] = (dsg @ kf.unsqueeze(2)).flatten(1, 2)
        dk += (dsg.transpose(-1, -2) @ _grouped(c.qc, Hkv)).sum(2)
        dv += (pg.transpose(-1, -2) @ _grouped(do, Hkv)).sum(2)
    return dq, _like(dk, spec.k), _like(dv, spec.v), dbias, dsinks


def _like(x: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``x`` in ``template``'s dtype and layout."""
    return empty_in_layout(template).copy_(x)


def probs(spec: AttentionSpec) -> torch.Tensor:
    """flash-attn's ``S_dmask`` of the kernels' probs output: ``exp(s - m)`` per
    element (``m`` the row's max, sink included), the sign bit set where dropout
    drops it, 0 where invisible; (num_seqs, Hq, max_seqlen_q, max_seqlen_k) in q's dtype."""
    if spec.varlen is not None:
        vl = spec.varlen
        out = spec.q.new_zeros((vl.num_seqs, spec.heads, vl.max_seqlen_q, vl.max_seqlen_k))
        for b, sub, (q0, q1), _ in _sequences(spec):
            out[b:b + 1, :, :q1 - q0, :sub.seqlen_k] = probs(sub)
        return out
    ct = compute_dtype(spec.q)
    kf = spec.k.to(ct)
    out = spec.q.new_zeros((spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k))
    for r0, r1 in _row_chunks(spec):
        c = _Chunk(spec, r0, r1, kf)
        x = torch.where(c.visible, c.p * c.total, 0.0)  # exp(s - m)
        if c.keep is not None:
            x = torch.where(c.visible & ~c.keep, -x, x)  # -0.0 for a dropped exp(s - m) that underflows
        out[:, :, r0:r1] = x
    return out


# ---------------------------------------------------------------------------
# Varlen: one padded problem per sequence (boundaries read on the host).
# ---------------------------------------------------------------------------

def _sequences(spec: AttentionSpec) -> Iterator[tuple[int, AttentionSpec, tuple[int, int], tuple[int, int]]]:
    """Per sequence b: (b, its padded spec (batch 1), its q rows, its key rows [k0, k0 + lk_rows)),
    with the kernels' clamping of out-of-range index values (shaders/flash_common.h, flash::seq_of)."""
    vl = spec.varlen
    total_q, total_k = spec.seqlen_q, spec.seqlen_k
    cu_q, cu_k = vl.cu_seqlens_q.tolist(), vl.cu_seqlens_k.tolist()
    used = vl.seqused_k.tolist() if vl.seqused_k is not None else None
    clamp = (lambda x, lo, hi: max(lo, min(x, hi)))
    for b in range(vl.num_seqs):
        q0 = clamp(cu_q[b], 0, total_q)
        lq = min(clamp(cu_q[b + 1], q0, total_q) - q0, vl.max_seqlen_q)
        if vl.block_table is not None:
            page = spec.k.shape[2]
            k0, lk_rows = 0, min(clamp(cu_k[b + 1] - cu_k[b], 0, vl.block_table.shape[1] * page), vl.max_seqlen_k)
        else:
            k0 = clamp(cu_k[b], 0, total_k)
            lk_rows = min(clamp(cu_k[b + 1], k0, total_k) - k0, vl.max_seqlen_k)
        lk = clamp(used[b], 0, lk_rows) if used is not None else lk_rows
        if vl.block_table is not None:
            pos = torch.arange(lk, device=spec.k.device)
            blocks = vl.block_table[b].to(spec.k.device)[pos // page].clamp(0, spec.k.shape[0] - 1)
            k, v = (t[blocks, :, pos % page].transpose(0, 1)[None] for t in (spec.k, spec.v))
        else:
            k, v = spec.k[:, :, k0:k0 + lk], spec.v[:, :, k0:k0 + lk]
        sub = dataclasses.replace(
            spec, q=spec.q[:, :, q0:q0 + lq], k=k, v=v,
            alibi_slopes=None if spec.alibi_slopes is None else spec.alibi_slopes[b:b + 1],
            diag_offset=spec.diag_offset + lk - lq, varlen=None,
            dropout=None if spec.dropout is None else dataclasses.replace(spec.dropout, batch_offset=b))
        yield b, sub, (q0, q0 + lq), (k0, k0 + lk_rows)


def _varlen_forward(spec: AttentionSpec, aux: Optional[torch.Tensor]):
    out = empty_in_layout(spec.q, spec.head_dim_v).zero_()
    lse = torch.full(spec.q.shape[:3], float("inf"), dtype=stats_dtype(spec.q.dtype), device=spec.q.device)
    if aux is not None:
        aux.zero_()
    for _, sub, (q0, q1), _ in _sequences(spec):
        o, l_ = forward(sub, None if aux is None else aux[:, :, q0:q1])
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = l_
    return out, lse


def _varlen_backward(spec: AttentionSpec, dout, out, aux, dlse):
    if spec.varlen.block_table is not None:
        raise NotImplementedError("block_table: the backward takes packed K/V (metal_flash.fwd's autograd gathers "
                                  "paged K/V first, torch_metal_flash.ops.paged)")
    ct = compute_dtype(spec.q)
    dq = empty_in_layout(spec.q).zero_()
    dk = torch.zeros(spec.k.shape, dtype=ct, device=spec.k.device)
    dv = torch.zeros(spec.v.shape, dtype=ct, device=spec.v.device)
    dsinks = torch.zeros((spec.heads,) if spec.sinks is not None else (0,), dtype=ct, device=spec.q.device)
    for _, sub, (q0, q1), (k0, _) in _sequences(spec):
        if q1 == q0 or sub.seqlen_k == 0:
            continue
        g = backward(sub, dout[:, :, q0:q1], out[:, :, q0:q1], aux[:, :, q0:q1],
                     None if dlse is None else dlse[:, :, q0:q1])
        dq[:, :, q0:q1] = g[0]
        dk[:, :, k0:k0 + sub.seqlen_k] += g[1].to(ct)
        dv[:, :, k0:k0 + sub.seqlen_k] += g[2].to(ct)
        if spec.sinks is not None:
            dsinks += g[4]
    return dq, _like(dk, spec.k), _like(dv, spec.v), torch.empty((0,), dtype=ct, device=spec.q.device), dsinks
