"""Helpers for testing attention results against the float64 oracle.

The acceptance rule (DESIGN.md §5, as in the flash-attn test suite): a result
is good when ``max|out - ref64| <= 2 * max|lowp - ref64| + atol``, where
``lowp`` is plain PyTorch math in the inputs' own dtype.  It adapts to dtype
and shape instead of fixing a tolerance per case.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import reference
from .spec import AttentionSpec

ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def cast_spec(spec: AttentionSpec, dtype: torch.dtype) -> AttentionSpec:
    """The same problem with q, k, v (and a float mask) in ``dtype``, on the CPU."""
    def cast(t):
        if t is None:
            return None
        t = t.detach().cpu()
        return t.to(dtype) if t.is_floating_point() else t
    mask = spec.mask.detach().cpu() if spec.mask is not None else None
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    return dataclasses.replace(spec, q=cast(spec.q), k=cast(spec.k), v=cast(spec.v), mask=mask,
                               alibi_slopes=None if spec.alibi_slopes is None else spec.alibi_slopes.detach().cpu(),
                               sinks=None if spec.sinks is None else spec.sinks.detach().cpu())


def oracle_forward(spec: AttentionSpec):
    """(out, lse) in float64 on the CPU."""
    return reference.forward(cast_spec(spec, torch.float64))


def lowp_forward(spec: AttentionSpec):
    """(out, lse) computed in the inputs' own dtype (the error budget)."""
    low = cast_spec(spec, spec.q.dtype)
    return reference.forward(low, dtype=spec.q.dtype)


def error_budget(name: str, got: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor,
                 atol: Optional[float] = None, dtype: Optional[torch.dtype] = None) -> tuple[float, float]:
    """(error, allowed) per the rule; infinities must match exactly."""
    got, ref64, lowp = (t.detach().cpu().to(torch.float64) for t in (got, ref64, lowp))
    if got.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref64.shape)}")
    finite = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], ref64[~finite]):
        bad = (torch.isfinite(got) != finite) | (~finite & (got != ref64))
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: non-finite mismatch at {idx}: got {got[tuple(idx)]}, "
                             f"reference {ref64[tuple(idx)]}")
    if atol is None:
        atol = ATOL[dtype or torch.float32]
    err = (got - ref64)[finite].abs().max().item() if finite.any() else 0.0
    base = (lowp.to(torch.float64) - ref64)[finite].abs().max().item() if finite.any() else 0.0
    return err, 2 * base + atol


def assert_matches_oracle(name: str, got: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor,
                          atol: Optional[float] = None, dtype: Optional[torch.dtype] = None) -> None:
    err, allowed = error_budget(name, got, ref64, lowp, atol, dtype)
    if not err <= allowed:
        raise AssertionError(f"{name}: max error {err:.3e} > allowed {allowed:.3e} "
                             f"(2 x low-precision math error + atol)")


def check_forward(spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Assert a forward result (out, lse) against the float64 oracle."""
    ref_out, ref_lse = oracle_forward(spec)
    low_out, low_lse = lowp_forward(spec)
    dtype = spec.q.dtype
    assert_matches_oracle("out", out, ref_out, low_out, dtype=dtype)
    assert_matches_oracle("lse", lse, ref_lse, low_lse, dtype=dtype)


def _autograd_grads(spec: AttentionSpec, dout: torch.Tensor, dtype: torch.dtype):
    """dq, dk, dv of the plain math in ``dtype`` on the CPU (autograd)."""
    q, k, v = (t.detach().cpu().to(dtype).requires_grad_() for t in (spec.q, spec.k, spec.v))
    out, _ = reference.forward(dataclasses.replace(cast_spec(spec, dtype), q=q, k=k, v=v), dtype=dtype)
    return torch.autograd.grad(out, (q, k, v), dout.detach().cpu().to(dtype))


def backward_errors(spec: AttentionSpec, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grads) -> list[tuple[str, float, float]]:
    """``(name, error, allowed)`` for kernel gradients ``grads = (dq, dk, dv)`` of a
    spec without a trainable mask or sinks.  The budget is twice the larger error
    of two plain computations in the inputs' dtype: autograd of the math, and the
    FlashAttention-2 formulation the kernels implement (delta from the saved
    ``out``, float32 accumulation), whose cancellation in ``P (dP - delta)``
    autograd does not have (it matters in float32)."""
    dtype = spec.q.dtype
    ref = _autograd_grads(spec, dout, torch.float64)
    low = _autograd_grads(spec, dout, dtype)
    fa2 = reference.backward(cast_spec(spec, dtype), dout.detach().cpu(), out.detach().cpu(), lse.detach().cpu(),
                             None, False)
    rows = []
    for i, name in enumerate(("dq", "dk", "dv")):
        err, allowed = error_budget(name, grads[i], ref[i], low[i], dtype=dtype)
        _, allowed_fa2 = error_budget(name, grads[i], ref[i], fa2[i], dtype=dtype)
        rows.append((name, err, max(allowed, allowed_fa2)))
    return rows
