"""``flash_attn_with_kvcache`` as the op ``metal_flash::fwd_kvcache``: no host
synchronisation on the kernel path, a compiled decode step, the in-kernel rules for
out-of-range index values (shaders/kvcache_index.h) against the oracle, and the
debug mode that reports them.  Kernel tests run in the emulator in checked mode
(bounds guards: an out-of-range index that reached memory would fail here)."""
from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from support.host_syncs import host_syncs_raise
from support.kvcache_cases import check_against_oracle, check_call, make_case, rotated_rows_exact
from torch_metal_flash import backends, core, emulator
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.faces.kvcache import apply_rotary, flash_attn_with_kvcache
from torch_metal_flash.planner import kvcache as kv_planner


def run_emulator(kw, order="forward", **extra):
    """Strict emulator (a fallback fails), checked mode; the kernels must have run."""
    backends.run_counts(reset=True)
    with emulator.settings(order=order, checked=True), backends.backend("emulator", strict=True):
        out = check_call(kw, backend="emulator", **extra)
    assert backends.run_counts() == {"emulator": 1}, backends.run_counts()
    return out


# ---------------------------------------------------------------------------
# No host synchronisation on the kernel path
# ---------------------------------------------------------------------------

def test_host_syncs_raise_patch_works():
    t = torch.ones(2, dtype=torch.int32)
    with host_syncs_raise():
        for fn in (lambda: t.item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: int(t[0]), lambda: t.cpu(),
                   lambda: t.to("cpu"), lambda: t.numpy(), lambda: range(10)[t[0]], lambda: torch.equal(t, t)):
            with pytest.raises(AssertionError, match="host synchronisation"):
                fn()
        assert t.to(torch.int64).dtype == torch.int64
    assert t.tolist() == [1, 1] and bool(t[0])


# Every combination of the features that involve index values: how cache_seqlens
# is given, the cache layout (contiguous, cache_batch_idx, paged with an odd page
# size), leftpad, and what is appended (nothing, k/v, k/v with rotary).  The
# attention features (causal, window, softcap, ALiBi, GQA/MQA, splits) rotate over them.
_INDEX_COMBOS = [c for c in itertools.product(("tensor", "int", None), ("contiguous", "batch_idx", "paged"),
                                              (False, True), ("none", "kv", "rotary"))
                 if c[0] is not None or (not c[2] and c[3] == "none")]
_ATTENTION = [dict(causal=True), dict(window=(3, 1)), dict(softcap=4.0, causal=True), dict(alibi="bh"),
              dict(alibi="h", window=(5, 0)), dict()]


@pytest.mark.parametrize("i,combo", list(enumerate(_INDEX_COMBOS)), ids=lambda c: str(c))
def test_decode_step_never_reads_device_values_on_the_host(i, combo):
    seqlens, layout, leftpad, append = combo
    hkv, g = ((1, 4), (2, 2), (2, 1))[i % 3]
    lnew = 0 if append == "none" else 1 + i % 2
    kw = make_case(seed=3000 + i, dtype=("f16", "bf16", "f32")[(i // 3) % 3], B=2, Lq=(1, 2, 5)[(i // 2) % 3],
                   Hq=hkv * g, Hkv=hkv, D=(16, 24, 8)[(i // 9) % 3], cap=15, lnew=lnew,
                   seqlens={"tensor": "ragged"}.get(seqlens, seqlens),
                   paged=5 if layout == "paged" else None, batch_idx=layout == "batch_idx", leftpad=leftpad,
                   rotary=(8, i % 2 == 0) if append == "rotary" else None, **_ATTENTION[i % len(_ATTENTION)])
    mine = dict(kw, k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone())
    backends.run_counts(reset=True)
    with emulator.settings(checked=True), backends.backend("emulator", strict=True), host_syncs_raise():
        out, lse = flash_attn_with_kvcache(**mine, return_softmax_lse=True, num_splits=i % 3)
    assert backends.run_counts() == {"emulator": 1}
    # ... and computed the right thing (the oracle, float64; the caches too).
    dtype = kw["q"].dtype
    ref = check_against_oracle(kw, out, lse)
    exact = dict(rtol=0, atol=0) if rotated_rows_exact(kw) else {}
    torch.testing.assert_close(mine["k_cache"], ref[2].to(dtype), **exact)
    torch.testing.assert_close(mine["v_cache"], ref[3].to(dtype), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# A compiled decode step over a static cache
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("paged", [False, True])
def test_compiled_decode_step_static_cache_runs_on_the_kernels(paged, monkeypatch):
    """torch.compile(fullgraph=True) of a whole decode step (append with rotary, attend,
    advance the lengths) over a static cache: one graph, our op called on the caches
    themselves (no functionalisation copy: the append kernel writes the user's cache
    storage), every step on the kernels, results equal to eager.  The debug mode
    works inside the compiled graph (the op validates at run time)."""
    torch._dynamo.reset()
    B, cap, Hq, Hkv, D, steps = 2, 24, 4, 2, 16, 3
    g = torch.Generator().manual_seed(5)
    cos, sin = torch.randn(cap + 4, 4, generator=g), torch.randn(cap + 4, 4, generator=g)
    if paged:
        k_cache = torch.zeros(2 * B * cap // 6, 6, Hkv, D)
        table = torch.randperm(k_cache.shape[0], generator=g)[:B * cap // 6].reshape(B, -1).to(torch.int32)
    else:
        k_cache, table = torch.zeros(B, cap, Hkv, D), None
    v_cache = torch.zeros_like(k_cache)
    start = torch.tensor([3, 0], dtype=torch.int32)
    tokens = [(torch.randn(B, 1, Hq, D, generator=g), torch.randn(B, 1, Hkv, D, generator=g),
               torch.randn(B, 1, Hkv, D, generator=g)) for _ in range(steps)]

    def step(q, k, v, k_cache, v_cache, seqlens):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                      block_table=table, causal=True, rotary_interleaved=False)
        seqlens.add_(1)
        return out

    def decode(fn):
        kc, vc, sl = k_cache.clone(), v_cache.clone(), start.clone()
        bound = []
        encode = EmulatorBackend.encode

        def spy(self, launches):  # the op core's emulator encoder: raw memory of the bound tensors
            bound.append(ctypes.addressof(launches[0][1][kv_planner.BUF_K_CACHE]))
            return encode(self, launches)
        backends.run_counts(reset=True)
        with backends.backend("emulator", strict=True), emulator.settings(checked=True, order="reverse"), \
                pytest.MonkeyPatch.context() as mp:
            mp.setattr(EmulatorBackend, "encode", spy)
            outs = [fn(q, k, v, kc, vc, sl) for q, k, v in tokens]
        assert backends.run_counts() == {"emulator": steps}
        assert bound == [kc.data_ptr()] * steps
        return outs, kc, vc, sl

    compiled = torch.compile(step, fullgraph=True)
    want, got = decode(step), decode(compiled)
    for w, o in zip(want[0], got[0]):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    for w, o in zip(want[1:], got[1:]):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    assert got[3].tolist() == [3 + steps, steps]
    monkeypatch.setenv("TORCH_METAL_FLASH_DEBUG", "1")
    kc, vc, full = k_cache.clone(), v_cache.clone(), torch.tensor([0, cap], dtype=torch.int32)
    with backends.backend("emulator", strict=True), \
            pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 24 overflows"):
        compiled(*tokens[0], kc, vc, full)
    torch._dynamo.reset()


def test_op_opcheck():
    """Schema (declared cache mutation), fake kernel and AOT dispatch of the op."""
    kw = make_case(seed=61, dtype="f32", B=2, Lq=2, Hq=4, Hkv=2, D=16, cap=12, lnew=2, paged=4, leftpad=True,
                   rotary=(8, False), causal=True, alibi="h")
    a = (kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
         kw["cache_seqlens"], None, kw["cache_leftpad"], kw["block_table"], kw["alibi_slopes"], 0, 0.3, -1, 0, 0.0,
         False, 0)
    for name in ("emulator", "reference"):
        with backends.backend(name, strict=True):
            torch.library.opcheck(torch.ops.metal_flash.fwd_kvcache.default, a)


def test_append_pipeline_limit_falls_back_before_any_launch(monkeypatch, request):
    """An append pipeline that allows fewer threads than the head dim needs: the whole
    call falls back (one warning, caches written once, by the reference path)."""
    info = EmulatorBackend.pipeline_info

    def lowered(self, source, kernel, constants):
        limits = dict(info(self, source, kernel, constants))
        if kernel.startswith("kvcache_append_"):
            limits["max_total_threads_per_threadgroup"] = 32
        return limits
    monkeypatch.setattr(EmulatorBackend, "pipeline_info", lowered)
    monkeypatch.setattr(backends, "_warned", set())
    core.plan_cache_clear()  # limits are checked when planning: on plan-cache misses
    request.addfinalizer(core.plan_cache_clear)
    kw = make_case(seed=91, dtype="f16", B=2, Lq=1, Hq=4, Hkv=2, D=64, cap=12, lnew=1, causal=True)
    with pytest.raises(backends.UnsupportedError, match="kvcache_append_f16_rf16 needs 64 threads"):
        with backends.backend("emulator", strict=True):
            flash_attn_with_kvcache(**dict(kw, k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone()))
    backends.run_counts(reset=True)
    with pytest.warns(backends.FallbackWarning, match="kvcache_append"):
        check_call(kw, backend="emulator")
    assert backends.run_counts()["reference"] == 1  # (its attention is the fwd op, on the emulator)


# ---------------------------------------------------------------------------
# Out-of-range index values: the in-kernel rules, and the debug mode
# ---------------------------------------------------------------------------

def _bad_contiguous():
    kw = make_case(seed=71, dtype="f16", B=3, Lq=3, Hq=4, Hkv=2, D=24, cap=20, lnew=3, rotary=(16, False),
                   causal=True, alibi="h")
    # negative, past the end (int32 max: no overflow in base + seqlen_new), partly overflowing
    kw["cache_seqlens"] = torch.tensor([-3, 2**31 - 1, 18], dtype=torch.int32)
    kw["cache_leftpad"] = torch.tensor([-100, 30, 4], dtype=torch.int32)
    kw["rotary_cos"], kw["rotary_sin"] = kw["rotary_cos"][:19], kw["rotary_sin"][:19]  # too short for row 2
    return kw


def _bad_batch_idx():
    kw = make_case(seed=72, dtype="f32", B=3, Lq=2, Hq=2, Hkv=1, D=16, cap=12, lnew=2, batch_idx=True,
                   alibi="h", window=(4, 0))
    kw["cache_batch_idx"] = torch.tensor([-1, 5, 2], dtype=torch.int32)  # the cache has B + 2 = 5 rows
    return kw


def _bad_paged():
    kw = make_case(seed=73, dtype="bf16", B=2, Lq=2, Hq=4, Hkv=2, D=16, cap=35, paged=7, lnew=3, softcap=3.0)
    kw["cache_seqlens"] = torch.tensor([12, 33], dtype=torch.int32)  # row 1 overflows by 1
    kw["block_table"][0, 1] = -1  # positions 7..13 of row 0: holds keys and the appended rows
    kw["block_table"][1, 2] = kw["k_cache"].shape[0] + 4
    return kw


BAD = {"contiguous": _bad_contiguous, "batch_idx": _bad_batch_idx, "paged": _bad_paged}


@pytest.mark.parametrize("name", list(BAD))
def test_out_of_range_indices_follow_the_documented_rules(name):
    """Checked mode (an access outside any buffer fails) and the oracle, which
    implements the rules of docs/kvcache.md independently; two schedule orders."""
    kw = BAD[name]()
    first = run_emulator(kw, order="reverse", num_splits=2)
    again = run_emulator(kw, order="random", num_splits=2)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("name,exc,match", [
    ("contiguous", ValueError, r"cache_seqlens: entry 0 is -3; expected >= 0"),
    ("batch_idx", IndexError, r"cache_batch_idx: entry 0 is -1, outside the 5 rows of k_cache"),
    ("paged", ValueError, r"k, v: appending 3 rows at cache_seqlens\[1\] = 33 overflows the cache \(capacity of "
                          r"block_table \(max_blocks \* page_block_size\) 35\)"),
])
def test_debug_mode_reports_out_of_range_indices(name, exc, match, monkeypatch):
    """TORCH_METAL_FLASH_DEBUG=1 validates on the host before the kernels run (caches
    untouched); the reference path validates always."""
    kw = BAD[name]()
    caches = kw["k_cache"].clone(), kw["v_cache"].clone()
    monkeypatch.setenv("TORCH_METAL_FLASH_DEBUG", "1")
    with backends.backend("emulator", strict=True), pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], caches[0]) and torch.equal(kw["v_cache"], caches[1])
    monkeypatch.delenv("TORCH_METAL_FLASH_DEBUG")
    with backends.backend("reference"), pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**kw)


# ---------------------------------------------------------------------------
# A q view that the rotary leaves non-contiguous
# ---------------------------------------------------------------------------

def test_rotary_head_dim_2_non_interleaved_q_as_bhld_view_runs_on_the_kernels():
    """Head dim 2, rotary_dim 2, GPT-NeoX rotary, several query rows and q a
    (B, H, L, D)-memory view: rotating such a view can give a non-contiguous last
    dim (strides (16, 1, 8, 4)), which the kernels do not take; the call must still
    run on them."""
    kw = make_case(seed=81, dtype="f32", B=2, Lq=3, Hq=4, Hkv=2, D=2, cap=10, lnew=3, rotary=(2, False),
                   causal=True)
    kw["q"] = kw["q"].transpose(1, 2).contiguous().transpose(1, 2)  # (B, L, H, D) view of (B, H, L, D) memory
    pos = torch.arange(3).expand(2, 3)
    rotated = apply_rotary(kw["q"], kw["rotary_cos"], kw["rotary_sin"], pos, False)
    assert rotated.stride(-1) == 1 and rotated.is_contiguous()
    run_emulator(kw)
    check_call(kw, backend="reference")
