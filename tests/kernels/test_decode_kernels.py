"""The split-K flash-decoding kernels (shaders/flash_decode.metal) and the append
kernel (shaders/kvcache_append.metal) in the emulator.

``flash_attn_with_kvcache`` on the emulator backend, checked mode (poisoned
threadgroup memory, bounds and race checks, exact byte counters), two schedule
orders per case (results must not change by a bit), against the independent
float64 implementation of tests/support/kvcache_oracle.py with the acceptance rule of
torch_metal_flash/testing/oracle.py.
These tests need the emulator: they fail (not skip) when its compiler is missing.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import torch_metal_flash

from support.kvcache_cases import check_call, make_case
from torch_metal_flash import backends, emulator
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.faces.kvcache import flash_attn_with_kvcache
from torch_metal_flash.planner.plan import Plan, Unsupported
from torch_metal_flash.planner.decode import (DecodeParams, DecodeProblem, choose_splits,
                                              compulsory_bytes, decode_variants, plan_decode)
from torch_metal_flash.planner.shader_constants import APPEND, DECODE
from torch_metal_flash.problem.quant import quantize

ORDER_PAIRS = (("forward", "reverse"), ("reverse", "random"), ("random", "forward"))


def run_orders(kw, orders, **extra):
    first = None
    for order in orders:
        backends.run_counts(reset=True)
        with emulator.settings(order=order, checked=True):
            out, lse = check_call(kw, backend="emulator", **extra)
        assert backends.run_counts().get("emulator") == 1, backends.run_counts()  # the kernels ran
        if first is None:
            first = (out.clone(), lse.clone())
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"result depends on order ({order})"
    return first


CASES = [
    # ragged seqlens incl. 0 and L_max, GQA 4, forced 3 splits
    dict(kw=dict(dtype="f16", B=3, Hq=8, Hkv=2, D=64, cap=72, Lq=1), splits=3),
    # MQA, 5 rows causal, append with interleaved rotary
    dict(kw=dict(dtype="bf16", B=2, Hq=8, Hkv=1, D=32, cap=48, Lq=5, lnew=5, causal=True, rotary=(16, True))),
    # GQA 1, 5 rows, window, append without rotary
    dict(kw=dict(dtype="f32", B=2, Hq=3, Hkv=3, D=40, cap=50, Lq=5, lnew=2, window=(7, 0)), splits=2),
    # GQA 8, softcap, one row, append
    dict(kw=dict(dtype="f16", B=2, Hq=16, Hkv=2, D=64, cap=40, Lq=1, lnew=1, causal=True, softcap=5.0)),
    # paged (page 16), 5 rows causal, non-interleaved rotary, leftpad
    dict(kw=dict(dtype="f16", B=2, Hq=4, Hkv=1, D=32, cap=64, paged=16, Lq=5, lnew=3, causal=True,
                 rotary=(32, False), leftpad=True), splits=3),
    # paged with an odd page size, ALiBi per head
    dict(kw=dict(dtype="bf16", B=3, Hq=4, Hkv=2, D=16, cap=35, paged=5, Lq=1, alibi="h", seqlens="ragged")),
    # cache_batch_idx + leftpad + ALiBi per (b, h) + two-sided window
    dict(kw=dict(dtype="f32", B=2, Hq=4, Hkv=2, D=24, cap=40, batch_idx=True, leftpad=True, alibi="bh", Lq=3,
                 window=(4, 1)), splits=16),
    # odd head dims and the largest bucket
    dict(kw=dict(dtype="f32", B=1, Hq=2, Hkv=1, D=13, cap=30, Lq=2, causal=True, seqlens="int")),
    dict(kw=dict(dtype="f16", B=1, Hq=2, Hkv=1, D=256, cap=20, Lq=1, lnew=1)),
    dict(kw=dict(dtype="bf16", B=1, Hq=2, Hkv=2, D=100, cap=24, Lq=3, causal=True, seqlens=None)),
    dict(kw=dict(dtype="f16", B=2, Hq=2, Hkv=1, D=1, cap=9, Lq=1, lnew=1), splits=2),
    # a group of 160 query rows: two row blocks per KV head
    dict(kw=dict(dtype="f16", B=1, Hq=32, Hkv=1, D=16, cap=24, Lq=5, lnew=1, causal=True)),
    # more query rows than keys (leading rows see nothing)
    dict(kw=dict(dtype="f32", B=2, Hq=2, Hkv=1, D=16, cap=8, Lq=8, causal=True, seqlens="ragged")),
    # The append kernel: appends crossing several pages of an odd size, interleaved rotary_dim < D, GQA
    dict(kw=dict(dtype="f16", B=3, Hq=6, Hkv=2, D=40, cap=27, paged=3, Lq=4, lnew=5, causal=True,
                 rotary=(24, True))),
    # an awkward capacity, a prefill-sized append, GPT-NeoX rotary_dim < D from a float32 table
    dict(kw=dict(dtype="bf16", B=2, Hq=4, Hkv=2, D=40, cap=113, Lq=17, lnew=17, causal=True, rotary=(8, False)),
         rope_f32=True, splits=3),
    # cache_batch_idx + leftpad + rotary + window, MQA
    dict(kw=dict(dtype="f32", B=3, Hq=4, Hkv=1, D=24, cap=33, batch_idx=True, leftpad=True, Lq=3, lnew=2,
                 rotary=(16, False), window=(6, 0))),
    # paged (page 7) + leftpad + append + ALiBi per (b, h) + softcap
    dict(kw=dict(dtype="f16", B=2, Hq=4, Hkv=2, D=32, cap=35, paged=7, leftpad=True, Lq=2, lnew=3, alibi="bh",
                 softcap=5.0, causal=True), splits=2),
    # v with its own head dim (the bucket of the larger one)
    dict(kw=dict(dtype="f16", B=2, Hq=8, Hkv=2, D=64, Dv=32, cap=40, Lq=3, lnew=2, causal=True, rotary=(32, False)),
         splits=2),
    dict(kw=dict(dtype="bf16", B=2, Hq=4, Hkv=1, D=40, Dv=100, cap=30, paged=5, Lq=1, lnew=1, softcap=4.0)),
    # the wide buckets: float32 K and V sharing one tile buffer at 384 and 512
    dict(kw=dict(dtype="f32", B=1, Hq=4, Hkv=1, D=512, cap=30, Lq=2, lnew=1, causal=True), splits=3),
    dict(kw=dict(dtype="f16", B=2, Hq=2, Hkv=2, D=300, cap=21, Lq=1, alibi="h")),
    # multi-head latent attention: K 576 / V 512, GQA 16:1 (MQA) and 32:2, 1-8 query rows, paged, splits
    dict(kw=dict(dtype="f16", B=2, Hq=16, Hkv=1, D=576, Dv=512, cap=40, Lq=1, lnew=1)),
    dict(kw=dict(dtype="bf16", B=2, Hq=16, Hkv=1, D=576, Dv=512, cap=48, paged=8, Lq=4, lnew=4, causal=True,
                 rotary=(64, False)), splits=3),
    dict(kw=dict(dtype="f32", B=1, Hq=16, Hkv=1, D=576, Dv=512, cap=40, Lq=8, lnew=8, causal=True), splits=2),
    dict(kw=dict(dtype="f16", B=1, Hq=32, Hkv=2, D=576, Dv=512, cap=24, paged=4, Lq=2, causal=True,
                 seqlens="int")),
]


@pytest.mark.parametrize("i,case", list(enumerate(CASES)))
def test_kernels_match_oracle(i, case):
    kw = make_case(seed=500 + i, **case["kw"])
    if case.get("rope_f32"):
        kw["rotary_cos"], kw["rotary_sin"] = kw["rotary_cos"].float(), kw["rotary_sin"].float()
    run_orders(kw, ORDER_PAIRS[i % 3], num_splits=case.get("splits", 0))


def _sampled_cases(n: int, seed: int) -> list[dict]:
    """Random feature combinations (fixed seed), small shapes."""
    import random
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        hkv = rng.choice([1, 2, 3])
        g = rng.choice([1, 4, 8]) if hkv < 3 else rng.choice([1, 2])
        lq = rng.choice([1, 2, 5, 8])
        lnew = rng.choice([0, 1, lq])
        paged = rng.choice([None, None, 4, 16])
        cap = rng.choice([16, 32, 48]) if paged is None else paged * rng.choice([2, 3, 5])
        cap = max(cap, lnew + 1)
        kw = dict(dtype=rng.choice(["f32", "f16", "bf16"]), B=rng.choice([1, 2, 3]), Hq=hkv * g, Hkv=hkv,
                  D=rng.choice([8, 16, 24, 32, 64, 72]), cap=cap, Lq=lq, lnew=lnew, paged=paged,
                  causal=rng.random() < 0.6, softcap=rng.choice([0.0, 0.0, 4.0]),
                  alibi=rng.choice([None, None, "h", "bh"]), leftpad=rng.random() < 0.3,
                  batch_idx=paged is None and rng.random() < 0.3)
        if not kw["causal"] and rng.random() < 0.4:
            kw["window"] = (rng.choice([-1, 0, 3, 9]), rng.choice([-1, 0, 2]))
        if lnew and rng.random() < 0.5:
            kw["rotary"] = (rng.choice([8, kw["D"] // 2 * 2]), rng.random() < 0.5)
        cases.append(dict(kw=kw, splits=rng.choice([0, 1, 2, 3, 7])))
    return cases


SAMPLED = _sampled_cases(10, 20261129)


@pytest.mark.parametrize("i,case", list(enumerate(SAMPLED)))
def test_sampled_feature_matrix(i, case):
    kw = make_case(seed=900 + i, **case["kw"])
    run_orders(kw, ORDER_PAIRS[(i + 1) % 3], num_splits=case["splits"])


def test_empty_and_full_rows():
    kw = make_case(seed=41, dtype="f16", B=3, Hq=4, Hkv=2, D=32, cap=40, Lq=2, causal=True)
    kw["cache_seqlens"] = torch.tensor([0, 40, 17], dtype=torch.int32)
    out, lse = run_orders(kw, ("reverse",), num_splits=4)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == math.inf).all())
    assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all()


@pytest.mark.parametrize("lq,latent", [(1, False), (5, False), (2, True)])
def test_long_cache_forced_splits_agree(lq, latent):
    """A multi-split long case: splits 1, 3, 16 and the heuristic all pass the rule and agree
    (latent attention: the combine merges 512-wide partials)."""
    shape = dict(Hq=16, Hkv=1, D=576, Dv=512) if latent else dict(Hq=8, Hkv=2, D=64)
    kw = make_case(seed=42 + lq, dtype="f16", B=1, cap=1000, Lq=lq, lnew=lq, causal=True, seqlens="int", **shape)
    results = {}
    for n, order in ((1, "forward"), (3, "reverse"), (16, "random"), (0, "forward")):
        with emulator.settings(order=order, checked=True):
            results[n] = check_call(kw, backend="emulator", num_splits=n)
    for n in (3, 16, 0):
        torch.testing.assert_close(results[n][0], results[1][0], rtol=0, atol=2e-3)
        torch.testing.assert_close(results[n][1], results[1][1], rtol=0, atol=1e-5)


def _problem(B=1, Hq=8, Hkv=2, D=64, L=512, Lq=1, dtype=torch.float16, paged=None, seed=0, Dv=None, quant=None):
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    q = torch.randn(B, Lq, Hq, D, generator=g).to(dtype)
    if paged:
        nblk = B * (-(-L // paged))
        kc = torch.randn(nblk, paged, Hkv, D, generator=g).to(dtype)
        bt = torch.randperm(nblk, generator=g).reshape(B, -1).to(torch.int32)
    else:
        kc, bt = torch.randn(B, L, Hkv, D, generator=g).to(dtype), None
    vc = torch.randn(*kc.shape[:3], Dv, generator=g).to(dtype)
    if quant:
        kc, vc = quantize(kc, **quant), quantize(vc, **quant)
    out = torch.empty(B, Lq, Hq, Dv, dtype=dtype)
    return DecodeProblem(q=q.transpose(1, 2), k_cache=kc, v_cache=vc, out=out.transpose(1, 2),
                         lse=torch.empty(B, Hq, Lq), seqlens=torch.full((B,), L, dtype=torch.int32), seqlen_fixed=0,
                         leftpad=None, batch_idx=None, block_table=bt, alibi_slopes=None, scale=D ** -0.5,
                         window_left=-1, window_right=0, softcap=0.0)


@pytest.mark.parametrize("paged,latent", [(None, False), (64, False), (None, True), (16, True)])
def test_each_kv_row_read_once_per_group(paged, latent):
    """Exact byte counters: every K/V row is read once per GQA group (not per query
    head), and the whole call moves <= 1.1x the compulsory bytes -- for latent attention
    too (K 576 / V 512, 16 query heads x 8 rows on one KV head: one threadgroup per group)."""
    shape = dict(Hq=16, Hkv=1, D=576, Dv=512, Lq=8) if latent else dict(Hq=8, Hkv=2, D=64)
    pb = _problem(paged=paged, L=512, **shape)
    # (latent: one split; two would write and read 128 rows' 512-wide partials, ~K/V's bytes again)
    plan = plan_decode(pb, num_splits=1 if latent else 2)
    assert plan.launches[0].threadgroups[1] == shape["Hkv"]  # one row block per KV head
    backend = EmulatorBackend()
    with emulator.settings(checked=True, order="reverse"):
        backend.run(plan)
    partial = backend.last_stats[0]
    hkv, d, dv = shape["Hkv"], shape["D"], shape.get("Dv", shape["D"])
    assert partial.bytes_read[1] == 512 * hkv * d * 2 and partial.bytes_read[2] == 512 * hkv * dv * 2  # fp16
    moved = sum(s.device_bytes for s in backend.last_stats)
    assert moved / compulsory_bytes(pb) <= 1.1, (moved, compulsory_bytes(pb))


@pytest.mark.parametrize("Lq,quant,limit", [(4, None, 1.1), (1, dict(bits=4, group_size=64), 1.15)])
def test_split_heuristic_weighs_partials(Lq, quant, limit):
    """num_splits=0 on latent attention (K 576 / V 512, 16 query heads on one KV head) at
    L 4096: the float32 partials of 16 x Lq rows are wide next to one key's bytes, so the
    heuristic splits less than the cores would ask for, and the call stays within ``limit``
    of the compulsory bytes (exact counters)."""
    pb = _problem(Hq=16, Hkv=1, D=576, Dv=512, L=4096, Lq=Lq, quant=quant)
    plan = plan_decode(pb, num_splits=0)
    assert 1 < plan.launches[0].threadgroups[0] < 10  # split, but fewer than one per core
    backend = EmulatorBackend()
    with emulator.settings(checked=True):
        backend.run(plan)
    moved = sum(s.device_bytes for s in backend.last_stats)
    assert moved / compulsory_bytes(pb) <= limit, (moved, compulsory_bytes(pb))


def test_params_layout():
    """Host ctypes mirror == the shader's DecodeParams (an echo kernel)."""
    from torch_metal_flash._paths import shaders_dir
    p = DecodeParams()
    longs = [n for n, t in DecodeParams._fields_ if t.__name__ == "c_long" or t is __import__("ctypes").c_int64]
    ints = [n for n, t in DecodeParams._fields_ if t is __import__("ctypes").c_int32]
    for k, n in enumerate(longs):
        setattr(p, n, (k + 1) * 1_000_000_007)
    for k, n in enumerate(ints):
        setattr(p, n, -(k + 1) * 13)
    p.qk_scale, p.softcap = 0.5, -2.25
    lib = emulator.compile_shader(shaders_dir() / "flash_decode.metal",
                                  function_constants=dict.fromkeys(DECODE.indices(), False))
    out_l, out_i, out_f = torch.zeros(len(longs), dtype=torch.int64), torch.zeros(len(ints), dtype=torch.int32), \
        torch.zeros(2)
    lib.flash_decode_params_echo(buffers={0: out_l, 1: out_i, 2: out_f, 5: p.to_bytes()}, grid=(1,),
                                 threadgroup=(1,))
    assert out_l.tolist() == [getattr(p, n) for n in longs]
    assert out_i.tolist() == [getattr(p, n) for n in ints]
    assert out_f.tolist() == [0.5, -2.25]


def test_append_params_layout():
    """Host ctypes mirror == the shader's AppendParams (an echo kernel)."""
    from torch_metal_flash._paths import shaders_dir
    from torch_metal_flash.planner.kvcache import AppendParams
    p = AppendParams()
    longs = [n for n, t in AppendParams._fields_ if t is __import__("ctypes").c_int64]
    ints = [n for n, t in AppendParams._fields_ if t is __import__("ctypes").c_int32]
    for k, n in enumerate(longs):
        setattr(p, n, (k + 1) * 1_000_000_007)
    for k, n in enumerate(ints):
        setattr(p, n, -(k + 1) * 13)
    lib = emulator.compile_shader(shaders_dir() / "kvcache_append.metal",
                                  function_constants=dict.fromkeys(APPEND.indices(), False))
    out_l, out_i = torch.zeros(len(longs), dtype=torch.int64), torch.zeros(len(ints), dtype=torch.int32)
    lib.kvcache_append_params_echo(buffers={0: out_l, 1: out_i, 4: bytes(p)}, grid=(1,), threadgroup=(1,))
    assert out_l.tolist() == [getattr(p, n) for n in longs]
    assert out_i.tolist() == [getattr(p, n) for n in ints]


def test_planner_choices_and_reasons():
    assert {v.kernel for v in decode_variants()} >= {"flash_decode_f16_d128_k32", "flash_decode_f32_d256_k8"}
    assert choose_splits(1, 8, 1, 4096, 32) > 1  # decode of one sequence: split
    assert choose_splits(64, 8, 1, 4096, 32) == 1  # big batch fills the GPU already
    assert choose_splits(1, 8, 1, 200, 32) == 1  # short cache
    plan = plan_decode(_problem(L=4096), num_splits=0)
    assert isinstance(plan, Plan) and len(plan.launches) == 2
    plan = plan_decode(_problem(), num_splits=1)
    assert isinstance(plan, Plan) and len(plan.launches) == 1  # no combine
    assert plan_decode(_problem(), num_splits=1000).launches[0].threadgroups[0] == 128
    pb = _problem(dtype=torch.float64)
    assert isinstance(plan_decode(pb), Unsupported) and "float64" in plan_decode(pb).reason
    assert "head dim" in plan_decode(_problem(D=520)).reason


def test_unsupported_falls_back_with_warning():
    kw = make_case(seed=43, dtype="f64", B=1, Hq=2, Hkv=1, D=8, cap=10, Lq=1)
    backends.run_counts(reset=True)
    with warnings.catch_warnings(record=True) as w, backends.backend("emulator"):
        warnings.simplefilter("always")
        out = flash_attn_with_kvcache(**kw)
    assert out.dtype == torch.float64
    assert any("float64" in str(x.message) for x in w)
    with backends.backend("emulator", strict=True), pytest.raises(backends.UnsupportedError):
        flash_attn_with_kvcache(**kw)


def test_sdpa_face_routes_decode_shapes_to_the_decode_kernels():
    """Short queries over long keys through the general op take the split-K kernels,
    with SDPA's top-left causal alignment (diag_offset 0)."""
    from torch_metal_flash import planner
    from torch_metal_flash.problem.layout import empty_in_layout
    from torch_metal_flash.problem.spec import make_spec
    g = torch.Generator().manual_seed(44)
    q = torch.randn(1, 4, 3, 32, generator=g)
    k, v = torch.randn(1, 2, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g)
    spec = make_spec(q, k, v, scale=0.2, window_right=0)
    plan = planner.plan_forward(spec, empty_in_layout(q), torch.empty(1, 4, 3))
    assert plan.launches[0].kernel.startswith("flash_decode_")
    with backends.backend("emulator", strict=True), emulator.settings(order="random", checked=True):
        out = torch_metal_flash.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                           scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------
# macOS: the same kernels on a real Apple GPU (skipped elsewhere).
# ---------------------------------------------------------------------------
needs_mps = pytest.mark.skipif(not torch.backends.mps.is_available(),
                               reason="needs macOS with an MPS GPU; the emulator tests above cover the kernels")


@needs_mps
@pytest.mark.parametrize("i,case", list(enumerate(CASES)))
def test_mps_kernels_match_oracle(i, case):
    """Strict metal backend (a fallback fails the test), mps tensors, oracle on the CPU."""
    from support.kvcache_cases import check_against_oracle

    kw = make_case(seed=500 + i, **case["kw"])
    dev = torch.device("mps")
    mine = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with backends.backend("metal", strict=True):
        out, lse = flash_attn_with_kvcache(**mine, return_softmax_lse=True, num_splits=case.get("splits", 0))
    ref = check_against_oracle(kw, out, lse)
    torch.testing.assert_close(mine["v_cache"].cpu(), ref[3].to(kw["q"].dtype), rtol=0, atol=0)


@needs_mps
def test_mps_long_cache_splits_agree():
    kw = make_case(seed=77, dtype="f16", B=1, Hq=32, Hkv=8, D=128, cap=4096, Lq=1, lnew=1, causal=True,
                   seqlens="int")
    dev = torch.device("mps")
    outs = []
    for n in (1, 3, 16, 0):
        mine = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        with backends.backend("metal", strict=True):
            outs.append(flash_attn_with_kvcache(**mine, num_splits=n).cpu())
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=2e-3)
