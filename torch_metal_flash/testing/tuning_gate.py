"""The tuner's correctness gate (installed into :func:`torch_metal_flash.tuning.tune` by the
package): before a variant is timed, it must match the float64 oracle on this GPU, on a small
problem of the class being tuned.

Every variant is verified in the emulator, but the emulator cannot vouch for what it does
not model (the neural accelerators' lane layout and precision, Apple's compiler): a variant
that computes wrong results on the machine at hand is never chosen, and ``tune`` reports it.
The check copies results to the host (tuning is not a hot path).
"""
from __future__ import annotations

from typing import Optional

import torch


def small_problem(problem: dict) -> dict:
    """One batch row, one KV head and its group of query heads, at most 70 queries and 300 keys:
    the same kernels (decode-shaped problems keep >= 256 keys) at a fraction of the cost."""
    H, Hkv = int(problem.get("heads", 8)), int(problem.get("kv_heads", problem.get("heads", 8)))
    return {**problem, "batch": 1, "heads": max(1, H // Hkv), "kv_heads": 1,
            "seqlen_q": min(int(problem["seqlen_q"]), 70), "seqlen_k": min(int(problem["seqlen_k"]), 300)}


def wrong_result(op: str, problem: dict, device: torch.device) -> Optional[str]:
    """None when ``op`` (with whatever variant is forced) matches the oracle on ``small_problem``,
    else what differs."""
    import torch_metal_flash.ops as ops
    from ..problem.spec import make_spec
    from ..tuning.space import as_dtype
    from .oracle import check_backward, check_forward, randn

    p = small_problem(problem)
    H, Lq, Lk, D = p["heads"], p["seqlen_q"], p["seqlen_k"], int(p["head_dim"])
    Dv = int(p.get("head_dim_v") or D)
    dtype = as_dtype(p["dtype"])
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (randn(1, h, L, d, generator=g).to(dtype)
                     for h, L, d in ((H, Lq, D), (1, Lk, D), (1, Lk, Dv), (H, Lq, Dv)))
    causal = bool(p["causal"])
    scalars = dict(scale=D ** -0.5, diag_offset=Lk - Lq, window_left=-1, window_right=0 if causal else -1,
                   softcap=0.0)
    spec = make_spec(q, k, v, scale=scalars["scale"], diag_offset=scalars["diag_offset"],
                     window_right=scalars["window_right"])
    dq, dk, dv, ddout = (t.to(device) for t in (q, k, v, dout))
    none = dict(attn_mask=None, alibi_slopes=None, sinks=None)
    try:
        out, lse, aux = ops.fwd_call(q=dq, k=dk, v=dv, **none, **scalars, return_aux=op == "bwd")
        if op == "bwd":
            grads = ops.bwd_call(dout=ddout, q=dq, k=dk, v=dv, out=out, aux=aux, dlse=None, **none, **scalars,
                                 compute_dbias=False)
            check_backward(spec, dout, None, (*(t.cpu() for t in grads[:3]), None, None))
        else:
            check_forward(spec, out.cpu(), lse.cpu())
    except AssertionError as e:
        return str(e)
    return None
