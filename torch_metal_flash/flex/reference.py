"""FlexAttention's dense definition, differentiable on any device (the fallback path and the tests').

``scores = scale * q k^T``, ``score_mod`` and ``mask_mod`` evaluated on the whole
(B, Hq, L, S) grid (torch's vmap over the index tensors, as torch's eager
flex_attention), softmax with rows that see nothing giving 0 and lse = -inf.
Computed in float32 for float16/bfloat16 inputs (float64 stays float64); O(L * S) memory.
The mods take their captured tensors as trailing arguments when ``score_buffers`` /
``mask_buffers`` are given (as torch's flex_attention op passes them).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.nn.attention import flex_attention as torch_flex


def dense_flex_attention(query, key, value, score_mod: Optional[Callable] = None,
                         mask_mod: Optional[Callable] = None, scale: Optional[float] = None,
                         enable_gqa: bool = False, score_buffers: tuple = (), mask_buffers: tuple = ()):
    """(out in query's dtype, lse float32 -- float64 for float64 inputs, natural log)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    B, Hq, L, D = query.shape
    S, G = key.shape[2], Hq // key.shape[1]
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k = key.to(dtype).repeat_interleave(G, dim=1)
    v = value.to(dtype).repeat_interleave(G, dim=1)
    scores = (query.to(dtype) @ k.transpose(-1, -2)) * scale
    dev = query.device
    idx = (torch.arange(B, device=dev), torch.arange(Hq, device=dev), torch.arange(L, device=dev),
           torch.arange(S, device=dev))
    with TransformGetItemToIndex():
        if score_mod is not None:
            scores = torch_flex._vmap_for_bhqkv(score_mod, prefix=(0,), suffix=(None,) * len(score_buffers))(
                scores, *idx, *score_buffers)
        visible = scores > -math.inf
        if mask_mod is not None:
            visible = visible & torch_flex._vmap_for_bhqkv(mask_mod, prefix=(), suffix=(None,) * len(mask_buffers))(
                *idx, *mask_buffers).to(torch.bool)
    scores = torch.where(visible, scores, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    seen = lse > -math.inf
    p = torch.where(visible & seen[..., None], torch.exp(scores - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    return (p @ v).to(query.dtype), lse
