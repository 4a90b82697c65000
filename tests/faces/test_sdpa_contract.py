"""The SDPA face keeps the running torch's contract: an input torch rejects is rejected, an
input torch accepts gives torch's result.  torch's contract is read from torch itself, on
meta tensors (its math path: the checks its MPS path makes too), so the test follows
whichever torch runs.  Where the face goes beyond torch (docs/dropins.md), it says so here."""
import pytest
import torch
import torch.nn.functional as F

import torch_metal_flash as tmf

B, H, L, S, E = 2, 4, 5, 7, 8
BASE = dict(q=(B, H, L, E), k=(B, H, S, E), v=(B, H, S, E), mask=None, mask_dtype=torch.bool, dtype=torch.float32,
            kv_dtype=None, kw={})

# Inputs torch accepts or rejects, by name: the face must agree.
AGREE = {
    "plain": {},
    "mask_with_causal": dict(mask=(L, S), kw=dict(is_causal=True)),
    "mask_with_causal_3d": dict(q=(H, L, E), k=(H, S, E), v=(H, S, E), mask=(L, S), kw=dict(is_causal=True)),
    "mask_with_causal_dropout": dict(mask=(L, S), kw=dict(is_causal=True, dropout_p=0.2)),
    "mask_with_causal_float64": dict(dtype=torch.float64, mask=(L, S), kw=dict(is_causal=True)),
    "float_mask_with_causal": dict(mask=(1, S), mask_dtype=torch.float32, kw=dict(is_causal=True)),
    "head_dim_mismatch": dict(k=(B, H, S, E + 1), v=(B, H, S, E + 1)),
    "kv_length_mismatch": dict(v=(B, H, S + 1, E)),
    "batch_mismatch": dict(k=(B + 1, H, S, E), v=(B + 1, H, S, E)),
    "heads_without_enable_gqa": dict(k=(B, 2, S, E), v=(B, 2, S, E)),
    "enable_gqa": dict(k=(B, 2, S, E), v=(B, 2, S, E), kw=dict(enable_gqa=True)),
    "gqa_indivisible": dict(k=(B, 3, S, E), v=(B, 3, S, E), kw=dict(enable_gqa=True)),
    "mask_not_broadcasting": dict(mask=(L + 1, S)),
    "int_mask": dict(mask=(L, S), mask_dtype=torch.int32),
    "float16_mask_under_float32": dict(mask=(L, S), mask_dtype=torch.float16),
    "float_mask": dict(mask=(L, S), mask_dtype=torch.float32),
    "value_dim_differs": dict(v=(B, H, S, E + 4)),
    "kv_heads_differ": dict(k=(B, 2, S, E), v=(B, 4, S, E)),
    "one_dim": dict(q=(E,), k=(E,), v=(E,)),
    "two_dims": dict(q=(L, E), k=(S, E), v=(S, E)),
    "query_of_lower_rank": dict(q=(H, L, E)),
    "five_dims": dict(q=(2, B, H, L, E), k=(2, B, H, S, E), v=(2, B, H, S, E)),
    "batch_dims_broadcast": dict(q=(2, B, H, L, E), k=(1, B, H, S, E), v=(1, B, H, S, E)),
    "integer_query": dict(dtype=torch.int64),
    "empty_query": dict(q=(B, H, 0, E)),
    "zero_scale": dict(kw=dict(scale=0.0)),
}
# Where the face goes beyond torch, documented in docs/dropins.md.
BEYOND = {
    "float16_kv_under_float32_query": (dict(kv_dtype=torch.float16), "accepts"),  # mixed-precision K/V
    "negative_dropout": (dict(kw=dict(dropout_p=-0.1)), "rejects"),  # torch ignores it
    "mask_of_higher_rank_than_output": (dict(mask=(3, B, H, L, S)), "rejects"),  # torch grows the output
}


def _inputs(case: dict, device: str, dtype=None):
    d = dict(BASE, **case)
    dtype = dtype or d["dtype"]
    gen = torch.Generator().manual_seed(0)

    def make(shape, dt):
        if dt.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dt)
        return torch.ones(shape, dtype=dt, device=device)
    kv_dtype = d["kv_dtype"] or dtype
    mask_dtype = d["mask_dtype"] if d["mask_dtype"] in (torch.bool, torch.int32) or dtype != torch.float64 \
        else torch.float64
    q, k, v = make(d["q"], dtype), make(d["k"], kv_dtype), make(d["v"], kv_dtype)
    mask = None if d["mask"] is None else make(d["mask"], mask_dtype)
    return q, k, v, mask, d["kw"]


def _torch_accepts(case: dict) -> bool:
    q, k, v, mask, kw = _inputs(case, "meta")
    try:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    except RuntimeError:
        return False
    return True


def _ours(case: dict, dtype=None):
    q, k, v, mask, kw = _inputs(case, "cpu", dtype)
    return tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


@pytest.mark.parametrize("name", sorted(AGREE))
def test_the_face_accepts_and_rejects_what_torch_does(name):
    case = AGREE[name]
    if _torch_accepts(case):
        _ours(case)
    else:
        with pytest.raises((RuntimeError, ValueError, TypeError)):
            _ours(case)


@pytest.mark.parametrize("name", sorted(BEYOND))
def test_where_the_face_goes_beyond_torch(name):
    case, ours = BEYOND[name]
    assert _torch_accepts(case) == (ours == "rejects"), "torch changed: update docs/dropins.md and this list"
    if ours == "accepts":
        _ours(case)
    else:
        with pytest.raises(ValueError):
            _ours(case)


def test_mask_with_causal_gives_torchs_message():
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        _ours(AGREE["mask_with_causal"])


@pytest.mark.parametrize("name", ["query_of_lower_rank", "batch_dims_broadcast", "two_dims", "enable_gqa",
                                  "value_dim_differs"])
def test_accepted_inputs_give_torchs_result(name):
    """In float64 on the reference path: torch's math and ours differ only by summation order."""
    case = AGREE[name]
    q, k, v, mask, kw = _inputs(case, "cpu", torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    got = _ours(case, torch.float64)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
