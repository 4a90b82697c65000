"""Bad input raises a clear error naming the argument and what was expected."""
import pytest
import torch

import torch_metal_flash as tmf


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


SDPA_BAD = [
    (dict(query=t(5), key=t(5), value=t(5)), ValueError, "query: expected at least 2 dims"),
    (dict(query=t(1, 2, 3, 8), key=t(1, 2, 3, 4), value=t(1, 2, 3, 4)), ValueError, "key: expected embedding size"),
    (dict(query=t(1, 2, 3, 8), key=t(1, 2, 5, 8), value=t(1, 2, 4, 8)), ValueError, "value: expected sequence length"),
    (dict(query=t(1, 2, 3, 8), key=t(1, 2, 3, 8, dtype=torch.float16), value=t(1, 2, 3, 8)), ValueError,
     "query, key, value: expected the same dtype"),
    (dict(query=t(1, 2, 3, 8, dtype=torch.int32), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8)), TypeError,
     "query: expected dtype float16, bfloat16, float32 or float64"),
    (dict(query=t(1, 4, 3, 8), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8)), ValueError, "pass enable_gqa=True"),
    (dict(query=t(1, 3, 3, 8), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8), enable_gqa=True), ValueError,
     "must be a multiple"),
    (dict(query=t(2, 2, 3, 8), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8)), ValueError, "key/value: expected batch dims"),
    (dict(query=t(1, 2, 3, 8), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8), dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(query=t(1, 2, 3, 8), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8), attn_mask=t(4, 3)), ValueError,
     "attn_mask: shape .* does not broadcast"),
    (dict(query=t(1, 2, 3, 8), key=t(1, 2, 3, 8), value=t(1, 2, 3, 8), attn_mask=torch.ones(3, 3, dtype=torch.int64)),
     TypeError, "attn_mask: expected dtype bool"),
    (dict(query=t(1, 2, 3, 16)[..., ::2], key=t(1, 2, 3, 8), value=t(1, 2, 3, 8)), ValueError,
     "query: expected a contiguous last dimension"),
    (dict(query=[1.0], key=t(1, 2, 3, 8), value=t(1, 2, 3, 8)), TypeError, "query: expected a torch.Tensor"),
]


@pytest.mark.parametrize("kwargs,exc,match", SDPA_BAD)
def test_sdpa_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tmf.scaled_dot_product_attention(**kwargs)


Q, K = t(2, 5, 4, 8), t(2, 7, 2, 8)
FLASH_BAD = [
    (dict(q=t(5, 4, 8), k=K, v=K), ValueError, "q: expected a 4-D tensor"),
    (dict(q=Q, k=t(3, 7, 2, 8), v=t(3, 7, 2, 8)), ValueError, "k: expected batch size"),
    (dict(q=Q, k=t(2, 7, 3, 8), v=t(2, 7, 3, 8)), ValueError, "number of query heads must be a multiple"),
    (dict(q=Q, k=K, v=t(2, 6, 2, 8)), ValueError, "v: expected seqlen equal to k's"),
    (dict(q=Q, k=K, v=t(2, 7, 2, 4)), ValueError, "v: expected head dim"),
    (dict(q=Q, k=K.half(), v=K), ValueError, "expected the same dtype"),
    (dict(q=Q, k=K, v=K, window_size=(-2, 0)), ValueError, "window_size: expected values >= 0 or -1"),
    (dict(q=Q, k=K, v=K, window_size=3), ValueError, "window_size: expected a pair"),
    (dict(q=Q, k=K, v=K, softcap=-1.0), ValueError, "softcap: expected a float >= 0"),
    (dict(q=Q, k=K, v=K, alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes: expected shape \(4,\) or \(2, 4\)"),
    (dict(q=Q, k=K, v=K, alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes: expected dtype"),
    (dict(q=Q, k=K, v=K, dropout_p=1.5), ValueError, "dropout_p: expected a float in"),
    (dict(q=t(2, 5, 4, 16)[..., ::2], k=K, v=K), ValueError, "q: expected a contiguous last dimension"),
]


@pytest.mark.parametrize("kwargs,exc,match", FLASH_BAD)
def test_flash_attn_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tmf.flash_attn_func(**kwargs)


def test_packed_shape_errors():
    with pytest.raises(ValueError, match="qkv: expected size of dim 2"):
        tmf.flash_attn_qkvpacked_func(t(2, 5, 2, 4, 8))
    with pytest.raises(ValueError, match="kv: expected a 5-D tensor"):
        tmf.flash_attn_kvpacked_func(Q, t(2, 5, 4, 8))


def test_unknown_backend_names_the_source(monkeypatch):
    with pytest.raises(ValueError, match="backend\\(\\): unknown backend 'cuda'"):
        with tmf.backend("cuda"):
            pass
    monkeypatch.setenv("TORCH_METAL_FLASH_BACKEND", "gpu")
    with pytest.raises(ValueError, match="TORCH_METAL_FLASH_BACKEND: unknown backend 'gpu'"):
        tmf.flash_attn_func(Q, K, K)


def test_face_checks_are_memoised_per_signature(monkeypatch):
    """A call with a signature the checks already passed skips them; any new
    signature (here: a bad head count) runs them, with the same error."""
    from torch_metal_flash import checks, functional
    monkeypatch.setattr(functional, "_FLASH_CHECKED", checks.Memo())
    ran = []
    real = functional._flash_checks
    monkeypatch.setattr(functional, "_flash_checks", lambda *a: (ran.append(1), real(*a)))
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    for _ in range(3):
        tmf.flash_attn_func(q, k, v, causal=True)
    assert len(ran) == 1
    with pytest.raises(ValueError, match="must be a multiple of the number of key/value heads"):
        tmf.flash_attn_func(torch.randn(1, 5, 3, 8), k, v, causal=True)
    tmf.flash_attn_func(q, k, v, causal=False)  # another signature: checked again
    assert len(ran) == 3
