"""torch_metal_flash.scaled_dot_product_attention against torch's own SDPA and
the float64 oracle (reference backend; the kernel backends run the same tests
through test_forward_kernels / test_mps)."""

import pytest
import torch
import torch.nn.functional as F

import torch_metal_flash as tmf
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import assert_matches_oracle, plain_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENGTHS = [(1, 1), (3, 17), (17, 3), (113, 129), (129, 113), (203, 1000), (1000, 203)]


def _check_sdpa(name, q, k, v, **kw):
    """Ours against torch's SDPA in float64 (the oracle), with the budget of
    torch_metal_flash.testing (plain math of the same problem in the inputs' dtype)."""
    def f64(t):
        return t.double() if t is not None and t.is_floating_point() else t

    def as_4d(t):
        return t.reshape((-1,) + tuple(t.shape[-3:])) if t.dim() >= 3 else t[None]
    ours = tmf.scaled_dot_product_attention(q, k, v, **kw)
    kw64 = dict(kw, attn_mask=f64(kw.get("attn_mask")))
    ref64 = F.scaled_dot_product_attention(f64(q), f64(k), f64(v), **kw64)
    mask = kw.get("attn_mask")
    if mask is not None:
        mask = as_4d(mask.expand(tuple(q.shape[:-2]) + (q.shape[-2], k.shape[-2])))
    spec = make_spec(as_4d(q), as_4d(k), as_4d(v), mask, scale=kw.get("scale") or q.shape[-1] ** -0.5,
                     window_right=0 if kw.get("is_causal") else -1)
    plain = plain_attention(spec, q.dtype).out.reshape(ref64.shape)
    assert ours.dtype == q.dtype and ours.shape == ref64.shape
    magnitude = plain_attention(spec, torch.float64).magnitude["out"].reshape(ref64.shape)
    assert_matches_oracle(name, ours, ref64, plain, magnitude, q.dtype)
    return ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa(dtype, lq, lk, causal):
    torch.manual_seed(lq * 7 + lk)
    q = torch.randn(2, 3, lq, 40, dtype=dtype)
    k = torch.randn(2, 3, lk, 40, dtype=dtype)
    v = torch.randn(2, 3, lk, 40, dtype=dtype)
    _check_sdpa("sdpa", q, k, v, is_causal=causal)


@pytest.mark.parametrize("mask_shape", [(17, 29), (1, 17, 29), (2, 1, 17, 29), (2, 4, 1, 29), (1, 29)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast(mask_shape, kind):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 17, 16), torch.randn(2, 4, 29, 16), torch.randn(2, 4, 29, 16)
    mask = torch.rand(mask_shape) > 0.3 if kind == "bool" else torch.randn(mask_shape)
    _check_sdpa("masked sdpa", q, k, v, attn_mask=mask)


def test_fully_masked_rows_are_zero_with_finite_grad():
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False
    out = tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, 2], torch.zeros_like(q.grad[:, :, 2]))


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_and_mqa(hkv):
    torch.manual_seed(2)
    q = torch.randn(2, 8, 13, 32)
    k, v = torch.randn(2, hkv, 21, 32), torch.randn(2, hkv, 21, 32)
    _check_sdpa("gqa sdpa", q, k, v, is_causal=True, enable_gqa=True)


def test_scale_and_value_dim_and_3d_inputs():
    torch.manual_seed(3)
    q, k, v = torch.randn(4, 9, 24), torch.randn(4, 11, 24), torch.randn(4, 11, 40)
    ours = _check_sdpa("3-D sdpa", q, k, v, scale=0.37)
    assert ours.shape == (4, 9, 40)


def test_gradients_match_torch():
    torch.manual_seed(4)
    leaves = [torch.randn(2, 4, 19, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    mask = torch.randn(19, 19, dtype=torch.float64, requires_grad=True)
    grads = []
    for fn in (tmf.scaled_dot_product_attention, F.scaled_dot_product_attention):
        out = fn(*leaves, attn_mask=mask)
        grads.append(torch.autograd.grad(out, [*leaves, mask], torch.randn_like(out, generator=torch.Generator().manual_seed(0))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_flash_attn_layout_needs_no_copy():
    """A (B, L, H, D) tensor seen as (B, H, L, D) comes back in the same layout."""
    q = torch.randn(2, 7, 3, 16).transpose(1, 2)
    out = tmf.scaled_dot_product_attention(q, q, q)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))


def test_empty_inputs():
    q = torch.randn(0, 2, 5, 8)
    assert tmf.scaled_dot_product_attention(q, q, q).shape == (0, 2, 5, 8)
    q0, k = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 4, 8)
    assert tmf.scaled_dot_product_attention(q0, k, k).shape == (1, 2, 0, 8)
    q1, k0 = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8)
    out = tmf.scaled_dot_product_attention(q1, k0, k0)
    assert torch.equal(out, torch.zeros(1, 2, 3, 8))


@pytest.mark.parametrize("face", ["sdpa", "flash_attn_func", "varlen"])
def test_dropout_runs_on_the_kernels_in_strict_mode(face):
    """dropout_p > 0 runs in the kernels (tests/kernels/test_dropout.py checks the numbers):
    strict mode does not raise and run_counts counts the kernels; the reference backend counts
    the reference path."""
    q = torch.randn(1, 2, 8, 16)
    packed, cu = q[0].transpose(0, 1), torch.tensor([0, 3, 8], dtype=torch.int32)
    calls = {
        "sdpa": lambda: tmf.scaled_dot_product_attention(q, q, q, dropout_p=0.25),
        "flash_attn_func": lambda: tmf.flash_attn_func(q, q, q, dropout_p=0.25),
        "varlen": lambda: tmf.flash_attn_varlen_func(packed, packed, packed, cu, cu, 5, 5, dropout_p=0.25),
    }
    tmf.run_counts(reset=True)
    with tmf.backend("emulator", strict=True):
        calls[face]()
    assert tmf.run_counts(reset=True) == {"emulator": 1}
    with tmf.backend("reference"):
        calls[face]()
    assert tmf.run_counts(reset=True) == {"reference": 1}
