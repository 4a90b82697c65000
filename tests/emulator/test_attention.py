"""A small tiled attention kernel (kernels/attention.metal) in all three schedule
orders, against a float64 reference (the acceptance rule of torch_metal_flash/testing/oracle.py)."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from emu_helpers import KERNELS, ORDERS
from torch_metal_flash import emulator
from torch_metal_flash.testing import Arith


class AttnParams(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("L", "S", "q_head_stride", "k_head_stride", "v_head_stride",
                                             "o_head_stride", "q_row_stride", "k_row_stride", "v_row_stride",
                                             "o_row_stride")] + [("scale_log2", ctypes.c_float)]


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _reference(q, k, v, scale, causal, mask):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    keep = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        keep &= torch.ones_like(keep).tril()
    if mask is not None:
        keep &= mask
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v.double(), lse, p


def _run(tname, d, bk, L, S, H=2, causal=False, with_mask=False, order="forward", checked=True, seed=0):
    torch.manual_seed(seed)
    dt = DTYPES[tname]
    q, k, v = torch.randn(H, L, d).to(dt), torch.randn(H, S, d).to(dt), torch.randn(H, S, d).to(dt)
    mask = torch.rand(L, S) > 0.3 if with_mask else None
    o = torch.full((H, L, d), float("nan")).to(dt)
    lse = torch.zeros(H, L)
    scale = 1 / math.sqrt(d)
    p = AttnParams(L, S, L * d, S * d, S * d, L * d, d, d, d, d, scale * math.log2(math.e))
    # The kernel masks with -INFINITY, so it is only defined where Metal honours infinities
    # (relaxed / safe math; under fast math, the default, rows that see nothing are undefined).
    lib = emulator.compile_shader(KERNELS / "attention.metal", math_mode="relaxed",
                                  function_constants={"has_mask": with_mask, "is_causal": causal})
    kern = lib[f"attention_{tname}_bq16_bk{bk}_d{d}"]
    args = [q, k, v, o, lse, p] + ([mask] if with_mask else [])
    st = kern(*args, grid=((L + 15) // 16 * 64, H), threadgroup=(64, 1), order=order, checked=checked, seed=seed)
    ref, ref_lse, _ = _reference(q, k, v, scale, causal, mask)
    lowp, _, _ = _reference(q, k, v, scale, causal, mask)
    if dt != torch.float32:  # the same math in the input dtype, for the error budget (the same on every machine)
        A = Arith(dt)
        s = A.i(A.mm(q.double(), k.double().transpose(-1, -2)) * scale)
        keep = torch.ones(L, S, dtype=torch.bool)
        if causal:
            keep &= torch.ones_like(keep).tril()
        if mask is not None:
            keep &= mask
        lowp = A.mm(A.r(torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0)), v.double())
    return o, lse, ref, ref_lse, lowp, st


def _check(o, lse, ref, ref_lse, lowp, dt):
    err = (o.double() - ref).abs().max().item()
    budget = 2 * (lowp - ref).abs().max().item() + (1e-5 if dt == torch.float32 else 1e-3)
    assert err <= budget, (err, budget)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tname,d,bk,L,S,causal,with_mask", [
    ("float32", 32, 16, 17, 33, False, False),
    ("float16", 64, 8, 40, 23, True, False),
    ("bfloat16", 32, 16, 1, 50, False, True),
    ("float32", 64, 8, 31, 31, True, True),
])
def test_attention_matches_float64_reference(order, tname, d, bk, L, S, causal, with_mask):
    o, lse, ref, ref_lse, lowp, st = _run(tname, d, bk, L, S, causal=causal, with_mask=with_mask, order=order)
    _check(o, lse, ref, ref_lse, lowp, DTYPES[tname])
    assert st.simdgroup_matrix_multiplies > 0 and st.barriers > 0


def test_attention_orders_agree_bitwise_in_fast_mode():
    outs = [_run("float16", 64, 8, 45, 70, causal=True, order=order, checked=False)[0] for order in ORDERS]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_attention_byte_counts():
    L, S, d, H = 32, 48, 32, 2
    *_, st = _run("float32", d, 16, L, S, H=H)
    esz = 4
    # Q once; K and V once per query block; O written once; LSE once
    assert st.bytes_read[0] == H * L * d * esz
    assert st.bytes_read[1] == st.bytes_read[2] == H * (L // 16) * S * d * esz
    assert st.bytes_written[3] == H * L * d * esz
    assert st.bytes_written[4] == H * L * 4
    assert st.threadgroup_memory == 4 * (16 * 36 + 2 * 16 * 36 + 16 * 20)
