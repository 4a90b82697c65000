"""Output allocation that keeps the caller's layout.

Outputs (out, dq, dk, dv) are dense tensors whose dims are ordered in memory
like the input's, so a flash-attn (B, L, H, D) input seen as (B, H, L, D)
gets a (B, L, H, D)-contiguous result back, and a slice of a packed QKV tensor
gets a dense one.  The fake kernels use the same function, so the strides the
compiler assumes are the strides the kernels write.
"""
from __future__ import annotations

from typing import Optional

import torch


def empty_in_layout(t: torch.Tensor, last_dim: Optional[int] = None,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    shape = list(t.shape)
    if last_dim is not None:
        shape[-1] = last_dim
    outer = sorted(range(t.dim() - 1), key=lambda d: (-t.stride(d), d))
    perm = outer + [t.dim() - 1]
    base = t.new_empty([shape[d] for d in perm], dtype=dtype or t.dtype)
    inverse = sorted(range(len(perm)), key=lambda i: perm[i])
    return base.permute(inverse)
