"""Float32 precision problems shared by tests/kernels/test_precision.py and bench/rule_widening.py:
a sweep of score magnitudes (``sweep_case``) and the problems the planted defects go into
(``kernel_grads`` runs the backward kernels with a perturbed softmax scale)."""
from __future__ import annotations

import dataclasses

import torch

from torch_metal_flash.problem.spec import make_spec
import support.backward_cases as bk
from torch_metal_flash.testing.oracle import backward_reference, randn

SWEEP_SHAPES = {
    "causal-gqa": dict(d=64, lq=33, lk=33, hq=2, hkv=1, kw=dict(window_right=0)),
    "bias-dlse": dict(d=8, lq=17, lk=40, hq=2, hkv=2, kw=dict(), bias=True, dlse=True),
    "window-sinks-alibi": dict(d=128, lq=29, lk=29, hq=2, hkv=1, kw=dict(window_left=9, window_right=3),
                               sinks=True, alibi=True),
}


def sweep_case(shape: str, target: float, seed: int):
    """A float32 problem whose largest |score| is ``target`` (through the softmax scale)."""
    c = SWEEP_SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    q = randn(1, c["hq"], c["lq"], c["d"], generator=g)
    k, v = (randn(1, c["hkv"], c["lk"], c["d"], generator=g) for _ in range(2))
    mask = randn(1, 1, c["lq"], c["lk"], generator=g) if c.get("bias") else None
    sinks = randn(c["hq"], generator=g) if c.get("sinks") else None
    alibi = torch.rand(c["hq"], generator=g) * 0.1 if c.get("alibi") else None
    qk = q @ k.repeat_interleave(c["hq"] // c["hkv"], dim=1).transpose(-1, -2)
    spec = make_spec(q, k, v, mask, alibi, sinks, scale=target / qk.abs().max().item(), **c["kw"])
    dout = randn(1, c["hq"], c["lq"], c["d"], generator=g)
    dlse = randn(1, c["hq"], c["lq"], generator=g) if c.get("dlse") else None
    return spec, dout, dlse


DEFECT_CASES = [dict(d=64, l=33, amp=1.0, scale=None), dict(d=32, l=40, amp=1.0, scale=0.3),
                dict(d=16, l=64, amp=1.5, scale=None)]


def kernel_grads(c, scale_error=1.0):
    """(spec, dout, kernel grads, (oracle, plain)) of a case; the kernels run
    with the softmax scale multiplied by ``scale_error``."""
    g = torch.Generator().manual_seed(c["d"] + c["l"])
    q, k = (c["amp"] * randn(1, 2, c["l"], c["d"], generator=g) for _ in range(2))
    v, dout = (randn(1, 2, c["l"], c["d"], generator=g) for _ in range(2))
    spec = make_spec(q, k, v, scale=c["d"] ** -0.5 if c["scale"] is None else c["scale"])
    run = dataclasses.replace(spec, scale=spec.scale * scale_error)
    out, aux = bk.saved_forward(run)
    grads, _ = bk.run_backward(run, dout, out, aux, checked=False)
    return spec, dout, (*grads[:3], None, None), backward_reference(spec, dout, compute_dbias=True)
