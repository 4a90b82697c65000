"""The general attention problem that every face, planner and backend shares.

Both public faces (SDPA and flash-attn) map onto one :class:`AttentionSpec`
without copying tensors:

* ``q`` is (B, Hq, Lq, D), ``k`` (B, Hkv, Lk, D), ``v`` (B, Hkv, Lk, Dv) as
  logical dims with arbitrary strides (last dim contiguous), so a flash-attn
  (B, L, H, D) tensor enters as a ``transpose(1, 2)`` view.  Query head ``h``
  reads KV head ``h // (Hq // Hkv)`` (GQA/MQA).
* Score of query row ``i`` and key ``j``::

      s = scale * q_i . k_j
      s = softcap * tanh(s / softcap)              if softcap > 0
      s = s - slope[b, h] * |i + diag_offset - j|  if alibi_slopes is given
      s = s + mask[b, h, i, j]                     if mask is a float tensor
      visible iff mask[b, h, i, j]                 if mask is a bool tensor
      visible iff window_left  < 0 or j >= i + diag_offset - window_left
              and window_right < 0 or j <= i + diag_offset + window_right

  Causal is ``window_right = 0``; SDPA aligns it top-left (``diag_offset =
  0``), flash-attn bottom-right (``diag_offset = Lk - Lq``).  The band here is
  literal; the flash-attn faces first turn a window side ``>= seqlen_k`` into
  -1, as upstream's ``mha_fwd``/``mha_varlen_fwd``/``mha_bwd``/``mha_fwd_kvcache``
  do (``seqlen_k``: the key length, the batch's ``max_seqlen_k`` for varlen,
  the cache capacity for ``flash_attn_with_kvcache``), so every face agrees.
* ``sinks`` (Hq,) adds one logit per head to the softmax denominator only.
* ``lse`` (B, Hq, Lq) float32 (float64 for float64 inputs) is the natural log of the softmax denominator
  (sink included); a row with nothing visible and no sink has ``lse = +inf``
  and output zero, so ``exp(s - lse) = 0`` in the backward.
* A row whose scores are all below -1e37 (a float mask of ``finfo.min`` on
  every key, as padding rows get in Hugging Face models) averages the values
  like torch, but passes no gradient: at that magnitude q.k is lost to
  rounding and the row is constant in q and k.
* ``aux`` (B, Hq, Lq, :func:`aux_width`), in lse's dtype, is what the forward
  keeps for the backward when gradients are needed.  Per row: the max ``m`` of
  the scores (sink included) and ``l = sum_j exp(s_j - m)`` (0 for a row with
  nothing visible, with ``m = 0``), so that the backward rebuilds
  ``P = exp(s - m) / l`` exactly -- ``exp(s - lse)`` would carry the rounding
  of ``lse = m + log(l)``, about ``|lse| * 6e-8`` in float32, into every
  probability -- and, for float16/bfloat16 inputs, the output row before it is
  rounded to the input dtype, from which the backward takes
  ``delta = rowsum(dO * O)``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]  # bool or float, broadcast view (B, Hq, Lq, Lk)
    alibi_slopes: Optional[torch.Tensor]  # float32 broadcast view (B, Hq)
    sinks: Optional[torch.Tensor]  # (Hq,)
    scale: float
    diag_offset: int
    window_left: int
    window_right: int
    softcap: float

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def seqlen_q(self) -> int:
        return self.q.shape[2]

    @property
    def seqlen_k(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[3]

    @property
    def has_band(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def visible(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Band visibility of query rows ``i`` (column) and keys ``j`` (row)."""
        rel = j - (i + self.diag_offset)
        ok = torch.ones_like(rel, dtype=torch.bool)
        if self.window_left >= 0:
            ok &= rel >= -self.window_left
        if self.window_right >= 0:
            ok &= rel <= self.window_right
        return ok


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of lse, aux, dbias and dsinks: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def aux_width(dtype: torch.dtype, head_dim_v: int) -> int:
    """Values per row of ``aux``: m and l, then the unrounded output row when
    the inputs are narrower than the stats (float16, bfloat16)."""
    return 2 + (head_dim_v if dtype in (torch.float16, torch.bfloat16) else 0)


def make_spec(q, k, v, mask=None, alibi_slopes=None, sinks=None, *, scale, diag_offset=0,
              window_left=-1, window_right=-1, softcap=0.0) -> AttentionSpec:
    """Build a spec from op arguments, expanding broadcastable masks as views."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if mask is not None:
        mask = mask.expand(B, H, Lq, Lk)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.expand(B, H)
    return AttentionSpec(q, k, v, mask, alibi_slopes, sinks, float(scale), int(diag_offset),
                         int(window_left), int(window_right), float(softcap))
