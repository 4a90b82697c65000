"""NaN inputs propagate like torch's SDPA: a row that sees a NaN is NaN, out and lse
(found by the property tests: the kernels returned lse = +inf and the reference path
zeros, treating the NaN row as one that sees nothing; with finite sentinels the kernels'
max()-clamp of shifted scores swallowed the NaN, see flash::exp_shifted).

The kernels run in the launcher's one math mode (safe: Inf/NaN honoured), as the emulator
backend does by default; relaxed honours them too.  Fast math
(TORCH_METAL_FLASH_MATH_MODE=fast) lets the compiler assume there are no NaNs, so no
GPU kernel can promise NaN propagation there."""
import math

import pytest
import torch

import torch_metal_flash as tmf


def _q_with_nan_row(lq, lk):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, lq, 2, 16, generator=g), torch.randn(1, lk, 2, 16, generator=g)
    q[0, 0, 0, 3] = math.nan
    return q, k


@pytest.mark.parametrize("backend,lk", [("emulator", 17), ("emulator", 300), ("reference", 17)],
                         ids=["prefill_kernel", "decode_kernel", "reference"])
def test_nan_query_row_gives_nan_out_and_lse(backend, lk):
    q, k = _q_with_nan_row(2, lk)
    with tmf.backend(backend, strict=True):
        out, lse, _ = tmf.flash_attn_func(q, k, k, return_attn_probs=True)
    assert out[0, 0, 0].isnan().all() and lse[0, 0, 0].isnan()
    assert out[0, 1].isfinite().all() and out[0, :, 1].isfinite().all() and lse[0, 1].isfinite().all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_query_row_gives_nan_lse_in_kvcache_decode(num_splits):
    g = torch.Generator().manual_seed(1)
    q, cache = torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 300, 2, 16, generator=g)
    q[0, 0, 1, 0] = math.nan
    with tmf.backend("emulator", strict=True):
        out, lse = tmf.flash_attn_with_kvcache(q, cache, cache, num_splits=num_splits, return_softmax_lse=True)
    assert out[0, 0, 1].isnan().all() and lse[0, 1, 0].isnan()
    assert out[0, 0, 0].isfinite().all() and lse[0, 0, 0].isfinite()


def test_nan_key_reaches_every_row_that_sees_it():
    q, k = _q_with_nan_row(3, 5)
    q = q.nan_to_num()
    k[0, 2, 0, 0] = math.nan
    with tmf.backend("emulator", strict=True):
        out, lse, _ = tmf.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)  # bottom-right: all see key 2
    assert out[0, :, 0].isnan().all() and lse[0, 0].isnan().all() and out[0, :, 1].isfinite().all()
