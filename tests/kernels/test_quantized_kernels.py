"""Quantized and mixed-precision K/V on the kernels, in the emulator (checked mode:
bounds and race checks, exact byte counters; two schedule orders per case, whose
results must agree bit for bit).

Every face that takes K/V takes them quantized (affine 4/8-bit, symmetric int8) or in
float16 / bfloat16 under a float32 query: ``flash_attn_with_kvcache`` (contiguous and
paged caches, the new rows quantized by the append kernel), ``flash_attn_func``,
``scaled_dot_product_attention`` and the op with sinks.  Accuracy is judged against
the float64 oracle on the *dequantized* K/V (what the kernels must compute), with the
acceptance-rule budget (torch_metal_flash/testing/oracle.py) of the same math in the query's dtype on those tensors; the
quantization error itself is bench/decode_bytes.py's to report.  These tests need the
emulator: they fail (not skip) when its compiler is missing.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import torch_metal_flash as tmf

from support.host_syncs import host_syncs_raise
from support.kvcache_cases import check_against_oracle, make_case
from torch_metal_flash import backends, emulator, testing
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.faces.kvcache import flash_attn_with_kvcache
from torch_metal_flash.planner.plan import Unsupported
from torch_metal_flash.planner import decode, kvcache as kv_planner, variants
from torch_metal_flash.problem import quant
from torch_metal_flash.problem.quant import QuantizedTensor
import torch_metal_flash.faces.kvcache as face_kvcache
from torch_metal_flash.problem.spec import make_spec

ORDERS = (("forward", "reverse"), ("reverse", "random"), ("random", "forward"))
A4 = dict(bits=4, group_size=64)
A4G32 = dict(bits=4, group_size=32)
A4G128 = dict(bits=4, group_size=128)
A8 = dict(bits=8, group_size=32)
A8G128 = dict(bits=8, group_size=128)
S8 = dict(bits=8, group_size=32, mode="symmetric")
S8G64 = dict(bits=8, group_size=64, mode="symmetric")
DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def kernels_only(order):
    """Strict emulator (a fallback fails the test), checked mode; exactly one op call on the kernels."""
    backends.run_counts(reset=True)
    with backends.backend("emulator", strict=True), emulator.settings(order=order, checked=True):
        yield
    assert backends.run_counts() == {"emulator": 1}, backends.run_counts()


def _caches(kw, fmt):
    if fmt is None:
        return kw["k_cache"].clone(), kw["v_cache"].clone()
    return tmf.quantize(kw["k_cache"], **fmt), tmf.quantize(kw["v_cache"], **fmt)


def _plain(t):
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


# ---------------------------------------------------------------------------
# flash_attn_with_kvcache over quantized (or float16/bfloat16 under float32 q) caches
# ---------------------------------------------------------------------------

# (make_case arguments, K/V format (None: plain caches), q dtype (None: the caches'), num_splits)
KV_CASES = [
    # GQA 4, ragged lengths (0 and full), one new token, forced splits
    (dict(dtype="f16", B=3, Hq=8, Hkv=2, D=64, cap=72, Lq=1, lnew=1, causal=True), A4, None, 3),
    # MQA, paged (page 8), three rows causal with interleaved rotary, float32 q over bfloat16
    (dict(dtype="bf16", B=2, Hq=4, Hkv=1, D=80, cap=48, Lq=3, lnew=3, causal=True, rotary=(32, True), paged=8),
     A8, "f32", 2),
    # float32 q over a float16 int8 cache, window, leftpad
    (dict(dtype="f16", B=2, Hq=4, Hkv=2, D=96, cap=40, Lq=2, lnew=2, window=(5, 0), leftpad=True), S8, "f32", 0),
    # cache_batch_idx, ALiBi per (b, h), softcap, groups of 128 over bfloat16, GQA 2
    (dict(dtype="bf16", B=2, Hq=4, Hkv=2, D=128, cap=33, Lq=1, lnew=1, batch_idx=True, alibi="bh", softcap=4.0),
     A4G128, None, 1),
    # head dim 256, paged with an odd page size, GPT-NeoX rotary
    (dict(dtype="f16", B=2, Hq=4, Hkv=2, D=256, cap=21, paged=7, Lq=1, lnew=2, causal=True, rotary=(64, False)),
     A4G32, None, 2),
    # a short prefill (5 rows x GQA 8 = 40 rows per KV head), symmetric int8 in groups of 64
    (dict(dtype="bf16", B=1, Hq=8, Hkv=1, D=64, cap=40, Lq=5, lnew=5, causal=True, rotary=(16, False)),
     S8G64, None, 0),
    # float32 caches, 8-bit groups of 128 (a partial last group at D=80), int lengths
    (dict(dtype="f32", B=2, Hq=6, Hkv=3, D=80, cap=30, Lq=2, lnew=1, causal=True, seqlens="int"), A8G128, None, 2),
    # plain float16 cache under float32 q (mixed precision), rotary from a float32 table
    (dict(dtype="f16", B=2, Hq=4, Hkv=2, D=64, cap=30, Lq=2, lnew=2, causal=True, rotary=(32, True)), None, "f32", 2),
    # plain bfloat16 paged cache under float32 q, no append, window both sides
    (dict(dtype="bf16", B=2, Hq=4, Hkv=1, D=96, cap=24, paged=6, Lq=3, window=(4, 1)), None, "f32", 0),
    # multi-head latent attention (K 576 / V 512, 16 query heads on one KV head): 4-bit groups of 64,
    # paged, speculative rows; int8; a float16 cache under float32 q
    (dict(dtype="f16", B=2, Hq=16, Hkv=1, D=576, Dv=512, cap=24, paged=8, Lq=4, lnew=4, causal=True,
          rotary=(64, False)), A4, None, 2),
    (dict(dtype="bf16", B=1, Hq=16, Hkv=1, D=576, Dv=512, cap=20, Lq=1, lnew=1), S8, None, 0),
    (dict(dtype="f16", B=1, Hq=16, Hkv=1, D=576, Dv=512, cap=20, Lq=2, lnew=2, causal=True), None, "f32", 2),
]


def _run_kvcache(kw, fmt, qdt, splits, backend, order="forward"):
    k_cache, v_cache = _caches(kw, fmt)
    call = dict(kw, k_cache=k_cache, v_cache=v_cache)
    if qdt is not None:
        call["q"] = kw["q"].to(DT[qdt])
    ctx = kernels_only(order) if backend == "emulator" else backends.backend(backend)
    with ctx:
        out, lse = flash_attn_with_kvcache(**call, return_softmax_lse=True, num_splits=splits)
    return out, lse, k_cache, v_cache, call


@pytest.mark.parametrize("i,case", list(enumerate(KV_CASES)))
def test_kvcache_face(i, case):
    """Two schedule orders agree bit for bit; out/lse pass the acceptance rule (torch_metal_flash.testing)
    against the oracle on the caches as stored (the new rows included, as this call attended them); the stored
    rows are what the reference path (tmf.quantize of the rotated rows) stores."""
    spec, fmt, qdt, splits = case
    kw = make_case(seed=1400 + i, **spec)
    runs = [_run_kvcache(kw, fmt, qdt, splits, "emulator", order) for order in ORDERS[i % 3]]
    for a, b in zip(runs[0][:4], runs[1][:4]):
        for x, y in zip(*((t._parts() if isinstance(t, QuantizedTensor) else [t]) for t in (a, b))):
            assert torch.equal(x, y), "result depends on the schedule order"
    out, lse, k_cache, v_cache, call = runs[0]
    stored = dict(call, k_cache=_plain(k_cache), v_cache=_plain(v_cache))
    check_against_oracle(dict(stored, append=False), out, lse)
    _, _, rk, rv, _ = _run_kvcache(kw, fmt, qdt, splits, "reference")
    for mine, theirs in ((k_cache, rk), (v_cache, rv)):
        if "rotary" in spec and mine is k_cache:
            # float32 rotary may round the rotated row by an ulp (fused multiply-add): a code step at most
            step = mine.scales.float().repeat_interleave(mine.group_size, -1)[..., :mine.head_dim] \
                if fmt is not None else _plain(mine).float().abs() * 2 ** -8
            assert bool(((_plain(mine).float() - _plain(theirs).float()).abs() <= step).all())
        else:
            for x, y in zip(*((t._parts() if isinstance(t, QuantizedTensor) else [t]) for t in (mine, theirs))):
                assert torch.equal(x, y), "the append kernel stored other values than tmf.quantize()"


# ---------------------------------------------------------------------------
# The general op's faces: SDPA, flash_attn_func, the op with sinks
# ---------------------------------------------------------------------------

def _rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


def _check_face(call, spec, orders):
    """``call()`` -> out (B, Hq, Lq, Dv) or (out, lse) on the kernels in two orders; ``spec``: the
    problem on dequantized K/V."""
    results = []
    for order in orders:
        with kernels_only(order):
            results.append(call())
    first = results[0] if isinstance(results[0], tuple) else (results[0],)
    second = results[1] if isinstance(results[1], tuple) else (results[1],)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "result depends on the schedule order"
    ref, low = testing.forward_reference(spec)
    dtype = spec.q.dtype
    testing.assert_matches_oracle("out", first[0], ref.out, low.out, ref.magnitude["out"], dtype)
    if len(first) > 1:
        testing.assert_matches_oracle("lse", first[1], ref.lse, low.lse, ref.magnitude["lse"], dtype)


def _kv(g, B, Hkv, S, D, dtype, fmt):
    k, v = _rand(g, B, Hkv, S, D, dtype=dtype), _rand(g, B, Hkv, S, D, dtype=dtype)
    if fmt is None:
        return k, v
    return tmf.quantize(k, **fmt), tmf.quantize(v, **fmt)


# (q dtype, K/V dtype, format, B, Hq, Hkv, Lq, S, D, mask: None | "bool" | "float")
SDPA_CASES = [
    ("f16", "f16", A4, 2, 8, 2, 5, 70, 64, "bool"),
    ("f32", "bf16", S8, 1, 4, 1, 3, 300, 128, "float"),   # MQA, long keys: split-K
    ("bf16", "bf16", A8, 1, 8, 2, 40, 45, 96, None),      # multi-query rows (a prefill): two row blocks
    ("f32", "f16", None, 2, 6, 3, 4, 50, 80, "bool"),     # mixed precision, no quantization
]


@pytest.mark.parametrize("i,case", list(enumerate(SDPA_CASES)))
def test_sdpa_face(i, case):
    qdt, kvdt, fmt, B, Hq, Hkv, Lq, S, D, mask_kind = case
    g = torch.Generator().manual_seed(1500 + i)
    q = _rand(g, B, Hq, Lq, D, dtype=DT[qdt])
    k, v = _kv(g, B, Hkv, S, D, DT[kvdt], fmt)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Lq, S, generator=g) > 0.3
    elif mask_kind == "float":
        mask = _rand(g, 1, Hq, Lq, S, dtype=DT[qdt])
    causal = torch.ones(Lq, S, dtype=torch.bool).tril()
    if mask is not None:  # SDPA takes a mask or is_causal: the causal band folded into the mask
        mask = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, float("-inf"))
    call = lambda: tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,  # noqa: E731
                                                    enable_gqa=True)
    full = causal.expand(B, Hq, Lq, S) if mask is None else mask.expand(B, Hq, Lq, S)
    _check_face(call, make_spec(q, _plain(k), _plain(v), full, None, None, scale=D ** -0.5), ORDERS[i % 3])


# (q dtype, K/V dtype, format, B, Lq, Hq, Hkv, S, D, causal, window, softcap, alibi)
FLASH_CASES = [
    ("bf16", "bf16", A8G128, 1, 2, 4, 2, 40, 256, True, (9, 0), 3.0, True),
    ("f16", "f16", S8, 2, 1, 8, 1, 260, 96, True, (-1, -1), 0.0, False),  # MQA decode, split-K
    ("f32", "bf16", None, 2, 3, 4, 2, 33, 64, False, (6, 2), 0.0, True),  # mixed precision
]


@pytest.mark.parametrize("i,case", list(enumerate(FLASH_CASES)))
def test_flash_face(i, case):
    qdt, kvdt, fmt, B, Lq, Hq, Hkv, S, D, causal, window, softcap, alibi = case
    g = torch.Generator().manual_seed(1600 + i)
    q = _rand(g, B, Lq, Hq, D, dtype=DT[qdt])
    k, v = _kv(g, B, S, Hkv, D, DT[kvdt], fmt)  # (B, S, Hkv, D)
    slopes = torch.rand(Hq, generator=g) * 0.3 if alibi else None
    call = lambda: tuple(t for t in tmf.flash_attn_func(  # noqa: E731
        q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        return_attn_probs=True)[:2])
    left, right = window
    if causal:
        right = 0
    spec = make_spec(q.transpose(1, 2), _plain(k).transpose(1, 2), _plain(v).transpose(1, 2), None,
                     slopes, None, scale=D ** -0.5, diag_offset=S - Lq, window_left=left, window_right=right,
                     softcap=softcap)
    _check_face(lambda: _bhld(call()), spec, ORDERS[i % 3])


def _bhld(result):
    out, lse = result
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("fmt,qdt", [(A4G32, "f32"), (S8G64, "f16"), (None, "f32")], ids=["affine4", "int8", "mixed"])
def test_op_with_sinks_and_window(fmt, qdt):
    """The general op with sinks (and a sliding window): fwd_quantized, or fwd for mixed precision."""
    g = torch.Generator().manual_seed(1700)
    B, Hq, Hkv, Lq, S, D = 2, 6, 2, 3, 600, 80  # long enough for two splits
    q = _rand(g, B, Hq, Lq, D, dtype=DT[qdt])
    k, v = _kv(g, B, Hkv, S, D, torch.float16, fmt)
    sinks = torch.randn(Hq, generator=g)
    args = (None, None, sinks, 0.15, S - Lq, 7, 0, 0.0)
    if fmt is None:
        call = lambda: torch.ops.metal_flash.fwd(q, k, v, *args, False)[:2]  # noqa: E731
    else:
        call = lambda: torch.ops.metal_flash.fwd_quantized(  # noqa: E731
            q, k.data, v.data, *args, k.scales, k.biases, v.scales, v.biases, *quant.flat_format(k))
    spec = make_spec(q, _plain(k), _plain(v), None, None, sinks, scale=0.15, diag_offset=S - Lq, window_left=7,
                     window_right=0)
    _check_face(call, spec, ("reverse", "forward"))


# ---------------------------------------------------------------------------
# Bytes, host synchronisation, compile, fallbacks, errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [A4, A8, S8], ids=["affine4", "affine8", "int8"])
def test_each_packed_row_read_once_per_group(fmt):
    """Exact byte counters: the packed K/V rows and their scales (and biases) are read once
    per GQA group, and the call moves <= 1.1x the compulsory bytes."""
    g = torch.Generator().manual_seed(1800)
    B, Hq, Hkv, D, L = 1, 8, 2, 128, 1024
    q = _rand(g, B, 1, Hq, D, dtype=torch.float16)
    kc, vc = (tmf.quantize(_rand(g, B, L, Hkv, D, dtype=torch.float16), **fmt) for _ in range(2))
    out = torch.empty_like(q)
    pb = decode.DecodeProblem(q=q.transpose(1, 2), k_cache=kc, v_cache=vc, out=out.transpose(1, 2),
                              lse=torch.empty(B, Hq, 1), seqlens=torch.full((B,), L, dtype=torch.int32),
                              seqlen_fixed=0, leftpad=None, batch_idx=None, block_table=None, alibi_slopes=None,
                              scale=D ** -0.5, window_left=-1, window_right=0, softcap=0.0)
    plan = decode.plan_decode(pb, num_splits=2)
    backend = EmulatorBackend()
    with emulator.settings(checked=True, order="reverse"):
        backend.run(plan)
    stats = backend.last_stats[0]
    scales = decode.BUF_K_SCALES_SYM if fmt.get("mode") == "symmetric" else decode.BUF_K_SCALES
    assert stats.bytes_read[decode.BUF_K] == kc.data.nbytes and stats.bytes_read[decode.BUF_V] == vc.data.nbytes
    assert stats.bytes_read[scales] == kc.scales.nbytes
    moved = sum(s.device_bytes for s in backend.last_stats)
    assert moved / decode.compulsory_bytes(pb) <= 1.1, (moved, decode.compulsory_bytes(pb))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_quantized_decode_step_never_reads_device_values_on_the_host(layout):
    kw = make_case(seed=1900, dtype="f16", B=2, Hq=4, Hkv=2, D=64, cap=24, Lq=1, lnew=1, causal=True,
                   rotary=(32, True), leftpad=True, paged=6 if layout == "paged" else None)
    k_cache, v_cache = _caches(kw, A4G32)
    with kernels_only("forward"), host_syncs_raise():
        flash_attn_with_kvcache(**dict(kw, k_cache=k_cache, v_cache=v_cache), num_splits=2)


def test_compiled_decode_step_over_a_quantized_static_cache():
    """torch.compile(fullgraph=True) of a decode step (append + attend + advance) over a
    quantized cache: one graph, the op on the cache's own storage, results equal eager."""
    torch._dynamo.reset()
    B, cap, Hq, Hkv, D, steps = 2, 24, 4, 2, 32, 3
    g = torch.Generator().manual_seed(1901)
    start = torch.tensor([3, 0], dtype=torch.int32)
    tokens = [(_rand(g, B, 1, Hq, D, dtype=torch.float16), _rand(g, B, 1, Hkv, D, dtype=torch.float16),
               _rand(g, B, 1, Hkv, D, dtype=torch.float16)) for _ in range(steps)]

    def step(q, k, v, k_cache, v_cache, seqlens):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
        seqlens.add_(1)
        return out

    def decode_steps(fn):
        kc = tmf.quantized_zeros((B, cap, Hkv, D), bits=4, group_size=32, dtype=torch.float16)
        vc = tmf.quantized_zeros((B, cap, Hkv, D), bits=4, group_size=32, dtype=torch.float16)
        sl, ptr = start.clone(), kc.data.data_ptr()
        backends.run_counts(reset=True)
        with backends.backend("emulator", strict=True), emulator.settings(checked=True):
            outs = [fn(q, k, v, kc, vc, sl) for q, k, v in tokens]
        assert backends.run_counts() == {"emulator": steps} and kc.data.data_ptr() == ptr
        return outs, kc, vc

    want, got = decode_steps(step), decode_steps(torch.compile(step, fullgraph=True))
    for w, o in zip(want[0], got[0]):
        assert torch.equal(w, o)
    for w, o in zip(want[1:], got[1:]):
        assert all(torch.equal(x, y) for x, y in zip(w._parts(), o._parts()))
    torch._dynamo.reset()


def test_what_the_kernels_do_not_cover_falls_back():
    """Head dim 640 (beyond the kernels): the reference path, with the warning (strict raises)."""
    kw = make_case(seed=1902, dtype="f16", B=1, Hq=2, Hkv=1, D=640, cap=8, Lq=1, lnew=1)
    k_cache, v_cache = _caches(kw, A4)
    call = dict(kw, k_cache=k_cache, v_cache=v_cache)
    with backends.backend("emulator", strict=True), pytest.raises(backends.UnsupportedError, match="head dim"):
        flash_attn_with_kvcache(**call)
    with backends.backend("emulator"), pytest.warns(backends.FallbackWarning, match="head dim"):
        out = flash_attn_with_kvcache(**call)
    check_against_oracle(dict(call, k_cache=_plain(k_cache), v_cache=_plain(v_cache), append=False), out)


def test_gradients_through_quantized_kv_are_a_clear_error():
    g = torch.Generator().manual_seed(1903)
    q = _rand(g, 1, 4, 3, 64, dtype=torch.float32).requires_grad_()
    k = tmf.quantize(_rand(g, 1, 2, 9, 64, dtype=torch.float16), **A4)
    for call in (lambda: tmf.scaled_dot_product_attention(q, k, k, enable_gqa=True),
                 lambda: tmf.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))):
        with pytest.raises(RuntimeError, match="q(uery)?: requires grad, but quantized"):
            call()
    out, _ = torch.ops.metal_flash.fwd_quantized(q, k.data, k.data, None, None, None, 0.1, 0, -1, -1, 0.0, k.scales,
                                                 k.biases, k.scales, k.biases, *quant.flat_format(k))
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
    with torch.no_grad():  # inference: fine
        tmf.scaled_dot_product_attention(q, k, k, enable_gqa=True)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v: (q.half(), k, v), ValueError, "expected the same dtype"),  # bfloat16 K/V, float16 q
    (lambda q, k, v: (q, k, v.dequantize()), TypeError, "both quantized"),
    (lambda q, k, v: (q, k, tmf.quantize(v.dequantize(), bits=8)), ValueError, "same quantization format"),
    (lambda q, k, v: (q, k, v.to("meta")), ValueError, "device"),
])
def test_face_errors(mutate, exc, match):
    g = torch.Generator().manual_seed(1904)
    q = _rand(g, 1, 2, 4, 64, dtype=torch.float32)
    k, v = (tmf.quantize(_rand(g, 1, 1, 6, 64, dtype=torch.bfloat16), **A4) for _ in range(2))
    q, k, v = mutate(q, k, v)
    with pytest.raises(exc, match=match):
        tmf.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_planned_launches_are_listed_for_the_doctor():
    """Quantized and mixed-precision launches use kernels and function constants the doctor enumerates."""
    listed = variants.kernels()
    constants = {source: set(variants._constant_sets(module)) for source, module in variants._PLANNERS.items()}
    seen = set()
    for i, (spec, fmt, qdt, splits) in enumerate(KV_CASES):
        kw = make_case(seed=1400 + i, **spec)
        k_cache, v_cache = _caches(kw, fmt)
        q = kw["q"].to(DT[qdt]) if qdt else kw["q"]
        problem = face_kvcache._op_args(q, k_cache, v_cache, kw.get("k"), kw.get("v"), kw.get("rotary_cos"),
                                       kw.get("rotary_sin"), kw.get("cache_seqlens"), kw.get("cache_batch_idx"),
                                       kw.get("cache_leftpad"), kw.get("block_table"), None, spec.get("causal", False),
                                       spec.get("window", (-1, -1)), spec.get("softcap", 0.0),
                                       spec.get("rotary", (0, True))[1], kw.get("alibi_slopes"), splits)
        plan = kv_planner.plan_kvcache(problem, torch.empty(q.shape[:-1] + v_cache.shape[-1:], dtype=q.dtype),
                                       torch.empty(q.shape[0], q.shape[2], q.shape[1]))
        assert not isinstance(plan, Unsupported), plan
        for launch in plan.launches:
            assert launch.kernel in listed[launch.source], launch.kernel
            assert tuple(sorted(launch.function_constants.items())) in constants[launch.source]
            seen.add(launch.kernel)
    assert {"kvcache_append_bf16_rf32_qf32", "flash_decode_f32_kvf16_d96_k32"} <= seen


# ---------------------------------------------------------------------------
# macOS: the same kernels on a real Apple GPU (skipped elsewhere).
# ---------------------------------------------------------------------------
needs_mps = pytest.mark.skipif(not torch.backends.mps.is_available(),
                               reason="needs macOS with an MPS GPU; the emulator tests above cover the kernels")


def _to(x, device):
    if isinstance(x, (torch.Tensor, QuantizedTensor)):
        return x.to(device)
    return x


@needs_mps
@pytest.mark.parametrize("i,case", list(enumerate(KV_CASES)))
def test_mps_kvcache_face(i, case):
    """Strict metal backend on mps tensors; the oracle and the reference path's stored rows on the CPU."""
    spec, fmt, qdt, splits = case
    kw = make_case(seed=1400 + i, **spec)
    k_cache, v_cache = _caches(kw, fmt)
    call = {name: _to(x, "mps") for name, x in dict(kw, k_cache=k_cache, v_cache=v_cache).items()}
    if qdt is not None:
        call["q"] = call["q"].to(DT[qdt])
    with backends.backend("metal", strict=True):
        out, lse = flash_attn_with_kvcache(**call, return_softmax_lse=True, num_splits=splits)
    stored = {name: _to(x, "cpu") for name, x in call.items()}
    stored.update(k_cache=_plain(stored["k_cache"]), v_cache=_plain(stored["v_cache"]))
    check_against_oracle(dict(stored, append=False), out, lse)
    _, _, _, rv, _ = _run_kvcache(kw, fmt, qdt, splits, "reference")
    assert torch.equal(_plain(call["v_cache"]).cpu(), _plain(rv)), "the append kernel stored other v rows"


def test_ops_opcheck():
    """Schemas (the quantized cache op declares its mutations), fake kernels and AOT dispatch."""
    kw = make_case(seed=1905, dtype="f16", B=2, Lq=2, Hq=4, Hkv=2, D=32, cap=12, lnew=2, paged=4, leftpad=True,
                   rotary=(8, False), causal=True)
    k_cache, v_cache = _caches(kw, A4G32)
    problem = face_kvcache._op_args(kw["q"], k_cache, v_cache, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
                                   kw["cache_seqlens"], None, kw["cache_leftpad"], kw["block_table"], None, True,
                                   (-1, -1), 0.0, False, None, 0)
    op, args = problem.op_call()
    g = torch.Generator().manual_seed(1906)
    q = _rand(g, 1, 4, 3, 32, dtype=torch.float32)
    k, v = _kv(g, 1, 2, 20, 32, torch.float16, S8)
    fwd_args = (q, k.data, v.data, None, None, torch.randn(4, generator=g), 0.2, 17, 5, 0, 0.0, k.scales, None,
                v.scales, None, *quant.flat_format(k))
    with backends.backend("emulator", strict=True):
        torch.library.opcheck(op.default, args)
        torch.library.opcheck(torch.ops.metal_flash.fwd_quantized.default, fwd_args)
