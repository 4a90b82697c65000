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
    (dict(query=t(2, 2, 3, 8), key=t(3, 2, 3, 8), value=t(3, 2, 3, 8)), RuntimeError, "batch dims .* do not broadcast"),
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
    (dict(q=Q, k=K.half(), v=K), ValueError, "expected the same dtype"),
    (dict(q=Q, k=K, v=K, window_size=(-2, 0)), ValueError, "window_size: expected values >= 0 or -1"),
    (dict(q=Q, k=K, v=K, window_size=3), ValueError, "window_size: expected a pair"),
    (dict(q=Q, k=K, v=K, softcap=-1.0), ValueError, "softcap: expected a finite float >= 0"),
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
    from torch_metal_flash.problem import checks
    from torch_metal_flash.faces import functional
    monkeypatch.setattr(functional, "_FLASH_CHECKED", checks.Memo("test.flash_checks"))
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


# ---------------------------------------------------------------------------
# Every face: wrong dtypes/devices/ranks, mismatched or non-divisible heads, head dim 0,
# bad windows, scales and softcaps, malformed cu_seqlens, out-of-range indices, masks of
# the wrong shape.  A clear error naming the argument, on every backend; never a crash,
# a hang or a wrong answer.
# ---------------------------------------------------------------------------
fwd = torch.ops.metal_flash.fwd


def cu(*x):
    return torch.tensor(x, dtype=torch.int32)


def op(q=None, k=None, v=None, mask=None, alibi=None, sinks=None, scale=1.0, diag=0, left=-1, right=-1, cap=0.0):
    q = t(1, 2, 3, 8) if q is None else q
    k = t(1, 2, 3, 8) if k is None else k
    v = t(1, 2, 3, 8) if v is None else v
    return lambda: fwd(q, k, v, mask, alibi, sinks, scale, diag, left, right, cap, False)


def varlen(q=None, k=None, v=None, cq=None, ck=None, mq=5, mk=5, **kw):
    q = t(5, 2, 8) if q is None else q
    k = t(5, 2, 8) if k is None else k
    v = t(5, 2, 8) if v is None else v
    return lambda: tmf.flash_attn_varlen_func(q, k, v, cu(0, 5) if cq is None else cq, cu(0, 5) if ck is None else ck,
                                              mq, mk, **kw)


def kvc(q=None, kc=None, vc=None, **kw):
    q = t(1, 1, 2, 8) if q is None else q
    kc = t(2, 4, 2, 8) if kc is None else kc
    vc = kc.clone() if vc is None else vc
    return lambda: tmf.flash_attn_with_kvcache(q, kc, vc, **kw)


def qz(*shape, dtype=torch.float16):
    return tmf.quantize(t(*shape).to(dtype), bits=8, group_size=32)


def op_quantized(q, kq, vq):
    from torch_metal_flash.problem.quant import flat_format
    return lambda: torch.ops.metal_flash.fwd_quantized(q, kq.data, vq.data, None, None, None, 1.0, 0, -1, -1, 0.0,
                                                       kq.scales, kq.biases, vq.scales, vq.biases, *flat_format(kq))


EVERY_FACE_BAD = {
    # the ops
    "ops_rank": (op(q=t(2, 3, 8)), ValueError, "q: expected a 4-D tensor"),
    "ops_dtype": (op(q=t(1, 2, 3, 8, dtype=torch.int32)), TypeError, "q: expected dtype float16"),
    "ops_mixed_dtypes": (op(k=t(1, 2, 3, 8).half()), ValueError, "q, k, v: expected the same dtype"),
    "ops_device": (op(k=t(1, 2, 3, 8).to("meta")), ValueError, "k: expected device cpu, got meta"),
    "ops_heads_not_divisible": (op(q=t(1, 3, 3, 8)), ValueError, "number of query heads must be a multiple"),
    "ops_kv_lengths": (op(v=t(1, 2, 4, 8)), ValueError, "v: expected shape"),
    "ops_batch": (op(k=t(2, 2, 3, 8), v=t(2, 2, 3, 8)), ValueError, "k: expected shape"),
    "ops_head_dim_0": (op(q=t(1, 2, 3, 0), k=t(1, 2, 3, 0), v=t(1, 2, 3, 0)), ValueError, "q: expected a head dim"),
    "ops_mask_shape": (op(mask=t(1, 2, 4, 3)), ValueError, "attn_mask: shape .* does not broadcast"),
    "ops_mask_dtype": (op(mask=torch.ones(3, 3, dtype=torch.int64)), TypeError, "attn_mask: expected dtype bool"),
    "ops_alibi_shape": (op(alibi=t(5)), ValueError, "alibi_slopes: shape .* does not broadcast"),
    "ops_sinks_shape": (op(sinks=t(3)), ValueError, r"sinks: expected shape \(2,\)"),
    "ops_window": (op(left=-5), ValueError, "window_left: expected an int >= 0 or -1"),
    "ops_softcap": (op(cap=-1.0), ValueError, "softcap: expected a finite float >= 0"),
    "ops_scale": (op(scale=float("nan")), ValueError, "scale: expected a finite float"),
    "ops_quantized_heads": (op_quantized(t(1, 3, 3, 32).half(), qz(1, 2, 3, 32), qz(1, 2, 3, 32)), ValueError,
                            "number of query heads must be a multiple"),
    "ops_quantized_rank": (op_quantized(t(3, 3, 32).half(), qz(1, 1, 3, 32), qz(1, 1, 3, 32)), ValueError,
                           "q: expected a 4-D tensor"),
    # quantized / mixed-precision K/V on the faces
    "flash_quantized_dtype": (lambda: tmf.flash_attn_func(t(1, 3, 2, 32).half(), qz(1, 3, 2, 32, dtype=torch.bfloat16),
                                                          qz(1, 3, 2, 32, dtype=torch.bfloat16)), ValueError,
                              "q, k, v: expected the same dtype"),
    "sdpa_mixed_under_f16": (lambda: tmf.scaled_dot_product_attention(t(1, 2, 3, 8).half(), t(1, 2, 3, 8).bfloat16(),
                                                                      t(1, 2, 3, 8).bfloat16()), ValueError,
                             "query, key, value: expected the same dtype"),
    "kvcache_quantized_one_side": (kvc(kc=qz(2, 4, 2, 8), vc=t(2, 4, 2, 8).half(), q=t(1, 1, 2, 8).half()), TypeError,
                                   "pass both quantized"),
    # head dim 0, scale and softcap on the other faces
    "sdpa_head_dim_0": (lambda: tmf.scaled_dot_product_attention(t(1, 2, 3, 0), t(1, 2, 3, 0), t(1, 2, 3, 0)),
                        ValueError, "query: expected a head dim"),
    "sdpa_scale": (lambda: tmf.scaled_dot_product_attention(t(1, 2, 3, 8), t(1, 2, 3, 8), t(1, 2, 3, 8), scale="x"),
                   ValueError, "scale: expected a finite float"),
    "flash_head_dim_0": (lambda: tmf.flash_attn_func(t(1, 3, 2, 0), t(1, 3, 2, 0), t(1, 3, 2, 0)), ValueError,
                         "q: expected a head dim"),
    "flash_scale": (lambda: tmf.flash_attn_func(Q, K, K, softmax_scale=float("inf")), ValueError,
                    "softmax_scale: expected a finite float"),
    "flash_softcap_nan": (lambda: tmf.flash_attn_func(Q, K, K, softcap=float("nan")), ValueError,
                          "softcap: expected a finite float"),
    # varlen
    "varlen_rank": (varlen(q=t(1, 5, 2, 8)), ValueError, "q: expected a 3-D tensor"),
    "varlen_dtype": (varlen(k=t(5, 2, 8).half()), ValueError, "q, k, v: expected the same dtype"),
    "varlen_int_dtype": (varlen(q=t(5, 2, 8, dtype=torch.int32)), TypeError, "q: expected dtype float16"),
    "varlen_heads_not_divisible": (varlen(q=t(5, 3, 8)), ValueError, "number of query heads must be a multiple"),
    "varlen_head_dim": (varlen(k=t(5, 2, 4), v=t(5, 2, 4)), ValueError, "k: expected head dim equal to q's"),
    "varlen_head_dim_0": (varlen(q=t(5, 2, 0), k=t(5, 2, 0), v=t(5, 2, 0)), ValueError, "q: expected a head dim"),
    "varlen_kv_lengths": (varlen(v=t(4, 2, 8)), ValueError, "v: expected seqlen equal to k's"),
    "varlen_non_monotone": (varlen(cq=cu(0, 3, 2, 5), ck=cu(0, 1, 2, 5)), ValueError,
                            "cu_seqlens_q: expected non-decreasing offsets"),
    "varlen_not_from_0": (varlen(ck=cu(1, 5)), ValueError, "cu_seqlens_k: expected non-decreasing offsets from 0"),
    "varlen_total": (varlen(cq=cu(0, 4)), ValueError, "cu_seqlens_q: expected non-decreasing offsets from 0 to 5"),
    "varlen_cu_dtype": (varlen(cq=torch.tensor([0.0, 5.0])), TypeError, "cu_seqlens_q: expected dtype int32"),
    "varlen_batch_mismatch": (varlen(cq=cu(0, 2, 5)), ValueError,
                              "cu_seqlens_k: expected length equal to cu_seqlens_q's 3, got 2"),
    "varlen_max_seqlen": (varlen(mq=3), ValueError, "cu_seqlens_q: a sequence is longer than the max_seqlen"),
    "varlen_max_seqlen_type": (varlen(mq="5"), ValueError, "max_seqlen_q: expected an int >= 0"),
    "varlen_window": (varlen(window_size=(-3, 0)), ValueError, "window_size: expected values >= 0 or -1"),
    # flash_attn_with_kvcache (the decode kernels)
    "kvcache_rank": (kvc(q=t(1, 2, 8)), ValueError, "q: expected a 4-D tensor"),
    "kvcache_dtype": (kvc(q=t(1, 1, 2, 8, dtype=torch.int32)), TypeError, "q: expected dtype float16"),
    "kvcache_mixed_dtypes": (kvc(kc=t(2, 4, 2, 8).half(), vc=t(2, 4, 2, 8)), ValueError,
                             "q, k_cache, v_cache: expected the same dtype"),
    "kvcache_device": (kvc(kc=t(2, 4, 2, 8).to("meta")), ValueError, "k_cache: expected device cpu, got meta"),
    "kvcache_heads_not_divisible": (kvc(q=t(1, 1, 3, 8)), ValueError, "number of query heads must be a multiple"),
    "kvcache_head_dim": (kvc(q=t(1, 1, 2, 16)), ValueError, "k_cache: expected head dim"),
    "kvcache_head_dim_0": (kvc(q=t(1, 1, 2, 0), kc=t(2, 4, 2, 0)), ValueError, "q: expected a head dim"),
    "kvcache_batch_idx_range": (kvc(cache_batch_idx=cu(5)), IndexError, "cache_batch_idx: entry 0 is 5"),
    "kvcache_block_table_range": (kvc(block_table=cu(0, 7)[None], cache_seqlens=cu(8)), IndexError,
                                  r"block_table: entry \[0, 1\] is 7"),
    "kvcache_seqlens_negative": (kvc(cache_seqlens=cu(-1)), ValueError, "cache_seqlens: entry 0 is -1"),
    "kvcache_seqlens_beyond": (kvc(cache_seqlens=cu(9)), ValueError, "cache_seqlens: entry 0 is 9, beyond"),
    "kvcache_append_overflow": (kvc(k=t(1, 2, 2, 8), v=t(1, 2, 2, 8), cache_seqlens=cu(3)), ValueError,
                                "k, v: appending 2 rows"),
    "kvcache_leftpad": (kvc(cache_seqlens=cu(2), cache_leftpad=cu(3)), ValueError, "cache_leftpad: entry 0 is 3"),
    "kvcache_window": (kvc(window_size=(-2, -1)), ValueError, "window_size: expected values >= 0 or -1"),
    "kvcache_scale": (kvc(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite float"),
    "kvcache_rotary_shape": (kvc(k=t(1, 1, 2, 8), v=t(1, 1, 2, 8), rotary_cos=t(4, 8), rotary_sin=t(4, 8),
                                 cache_seqlens=cu(1)), ValueError, "rotary_cos: expected shape"),
    "kvcache_num_splits": (kvc(num_splits=-1), ValueError, "num_splits: expected an int >= 0"),
}


# Index *values* of flash_attn_with_kvcache and the varlen faces live on the device: the kernels
# never read them on the host (no GPU sync) and clamp them by the documented rules
# (docs/kvcache.md, ops.py; tested in test_kvcache_op.py, test_varlen.py); TORCH_METAL_FLASH_DEBUG=1
# validates them first, the reference always.
INDEX_VALUES = {"kvcache_batch_idx_range", "kvcache_block_table_range", "kvcache_seqlens_negative",
                "kvcache_seqlens_beyond", "kvcache_append_overflow", "kvcache_leftpad", "varlen_non_monotone",
                "varlen_not_from_0", "varlen_total", "varlen_max_seqlen"}


@pytest.mark.parametrize("backend", ["emulator", "reference"])
@pytest.mark.parametrize("name", list(EVERY_FACE_BAD))
def test_every_face_rejects_bad_input(name, backend, monkeypatch):
    call, exc, match = EVERY_FACE_BAD[name]
    if name in INDEX_VALUES:
        monkeypatch.setenv("TORCH_METAL_FLASH_DEBUG", "1")
    with tmf.backend(backend), pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("face", ["sdpa", "flash_attn_func", "varlen", "kvcache", "ops"])
def test_head_dim_beyond_the_kernels_is_a_clear_strict_error(face):
    """Head dim > 512: the kernels have no tile; strict mode says so (default mode falls back)."""
    D = 600
    calls = {
        "sdpa": lambda: tmf.scaled_dot_product_attention(t(1, 2, 3, D), t(1, 2, 3, D), t(1, 2, 3, D)),
        "flash_attn_func": lambda: tmf.flash_attn_func(t(1, 3, 2, D), t(1, 3, 2, D), t(1, 3, 2, D)),
        "varlen": varlen(q=t(5, 2, D), k=t(5, 2, D), v=t(5, 2, D)),
        "kvcache": kvc(q=t(1, 1, 2, D), kc=t(2, 4, 2, D)),
        "ops": op(q=t(1, 2, 3, D), k=t(1, 2, 3, D), v=t(1, 2, 3, D)),
    }
    with tmf.backend("emulator", strict=True), pytest.raises(tmf.UnsupportedError, match=f"head dim {D} "):
        calls[face]()


def test_a_rejected_kvcache_call_leaves_the_cache_untouched():
    kc, vc = t(1, 6, 2, 8), t(1, 6, 2, 8)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="rotary_cos"):  # validated before anything is appended
        tmf.flash_attn_with_kvcache(t(1, 1, 2, 8), kc, vc, k=t(1, 1, 2, 8), v=t(1, 1, 2, 8), rotary_cos=t(4, 8),
                                    rotary_sin=t(4, 8), cache_seqlens=cu(1))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
