"""Plain-PyTorch attention: the reference backend and the oracle for the kernels.

Implements every feature of :class:`~torch_metal_flash.spec.AttentionSpec`
exactly, in float32 (float64 for float64 inputs).  Query rows are processed in
chunks so that no more than ``_CHUNK_ELEMENTS`` scores exist at once: memory is
O(L) for long sequences, never B·H·L·S.  GQA broadcasts K/V per group in the
matmul; nothing is repeated in memory.
"""
from __future__ import annotations

from typing import Optional

import torch

from .layout import empty_in_layout
from .spec import AttentionSpec, stats_dtype

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

    def sink_probs(self) -> torch.Tensor:
        return torch.where(self.total != 0, self.sink_e / self.total, 0.0).squeeze(-1)


def forward(spec: AttentionSpec, aux: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out`` (q's dtype and layout) and ``lse`` (float32, (B, Hq, Lq)).

    When ``aux`` is given it is filled with the row state of
    :mod:`torch_metal_flash.spec` (row max and sum; the output before it is
    rounded to the input dtype), which either backward (reference or kernels)
    can take.
    """
    ct = compute_dtype(spec.q)
    kf, vf = spec.k.to(ct), spec.v.to(ct)
    out = empty_in_layout(spec.q, spec.head_dim_v)
    lse = torch.empty(spec.q.shape[:3], dtype=stats_dtype(spec.q.dtype), device=spec.q.device)
    for r0, r1 in _row_chunks(spec):
        c = _Chunk(spec, r0, r1, kf)
        o = (_grouped(c.p, spec.kv_heads) @ vf.unsqueeze(2)).flatten(1, 2)
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

    The probabilities are recomputed with the row maximum (see :class:`_Chunk`);
    ``delta = rowsum(dO * O)`` takes O from ``aux`` when it holds the unrounded
    output (float16/bfloat16 inputs), else from ``out``.

    ``dbias`` (B, Hq, Lq, Lk) when ``compute_dbias`` (else empty) and ``dsinks``
    (Hq,) when the spec has sinks (else empty), in the compute dtype.
    """
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
        live = c.lse > SATURATED_LSE
        c.p = c.p * live.unsqueeze(-1)
        do = dout[:, :, r0:r1].to(ct)
        o = aux[:, :, r0:r1, 2:] if aux.shape[-1] > 2 else out[:, :, r0:r1]
        delta = (do * o.to(ct)).sum(-1)  # D = rowsum(dO * O)
        if dlse is not None:
            delta = delta - dlse[:, :, r0:r1].to(ct)
        dp = (_grouped(do, Hkv) @ vf.unsqueeze(2).transpose(-1, -2)).flatten(1, 2)
        ds = c.p * (dp - delta.unsqueeze(-1))  # gradient of the final score
        if compute_dbias:
            dbias[:, :, r0:r1] = ds
        if spec.sinks is not None:
            dsinks -= (c.sink_probs() * live * delta).sum(dim=(0, 2))
        if c.tanh is not None:
            ds = ds * (1 - c.tanh * c.tanh)
        ds = ds * spec.scale
        dsg, pg = _grouped(ds, Hkv), _grouped(c.p, Hkv)
        dq[:, :, r0:r1] = (dsg @ kf.unsqueeze(2)).flatten(1, 2)
        dk += (dsg.transpose(-1, -2) @ _grouped(c.qc, Hkv)).sum(2)
        dv += (pg.transpose(-1, -2) @ _grouped(do, Hkv)).sum(2)
    return dq, _like(dk, spec.k), _like(dv, spec.v), dbias, dsinks


def _like(x: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``x`` in ``template``'s dtype and layout."""
    return empty_in_layout(template).copy_(x)


def dropout_attention(spec: AttentionSpec, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with dropout on the probabilities, as composite torch ops.

    Autograd differentiates it directly; it materialises the scores (dropout
    needs the mask in the backward), so it is only used when dropout is asked for.
    """
    ct = compute_dtype(spec.q)
    kf = spec.k.to(ct)
    c = _Chunk(spec, 0, spec.seqlen_q, kf)
    p = torch.nn.functional.dropout(c.p, dropout_p, training=True)
    out = (_grouped(p, spec.kv_heads) @ spec.v.to(ct).unsqueeze(2)).flatten(1, 2)
    return out.to(spec.q.dtype), c.lse.detach().to(stats_dtype(spec.q.dtype))
