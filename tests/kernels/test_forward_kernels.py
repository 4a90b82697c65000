"""The fused forward kernels (shaders/flash_fwd.metal) run in the emulator
against the float64 oracle (the acceptance rule of torch_metal_flash/testing/oracle.py), through the planner and the
emulator backend, in checked mode (poisoned threadgroup memory, bounds and
race checks) and in two schedule orders per case.

The full forward matrix (tests/support/forward_cases.py) is sampled with a fixed seed (every value of every
axis appears); ``bench/sweep_forward.py`` runs the whole sweep.  These tests
need the emulator: they fail (not skip) when it or its compiler is missing.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from torch_metal_flash import emulator
from support import forward_cases as fc
from torch_metal_flash._paths import shaders_dir
from torch_metal_flash.planner.plan import Plan, Unsupported
from torch_metal_flash.planner import forward_variants
from torch_metal_flash.planner.forward import plan_forward  # noqa: E402 - the prefill planner
from torch_metal_flash.planner.params import FlashFwdParams, field_layout
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.planner.shader_constants import FWD as FC

SEED = 20260411
ORDER_PAIRS = (("forward", "reverse"), ("reverse", "random"), ("random", "forward"))

# Small shapes over every axis value, plus a few bigger ones and the odd head dims.
SAMPLED = fc.sample_cases(48, SEED)
BIG = [
    dict(dtype="f16", d=64, lq=127, lk=512, masking="causal_br", hq=2, hkv=1, feature="none", layout="blhd", batch=1),
    dict(dtype="bf16", d=128, lq=257, lk=129, masking="none", hq=1, hkv=1, feature="bias_bcast", layout="bhld", batch=1),
    dict(dtype="f32", d=72, lq=113, lk=203, masking="window", hq=2, hkv=2, feature="sinks", layout="bhld", batch=1),
    dict(dtype="f16", d=40, lq=3, lk=799, masking="causal_br", hq=4, hkv=1, feature="alibi_h", layout="blhd", batch=1),
]


def _orders(i: int):
    return ORDER_PAIRS[i % len(ORDER_PAIRS)]


@pytest.mark.parametrize("i,case", list(enumerate(SAMPLED)), ids=[fc.case_id(c) for c in SAMPLED])
def test_sampled_matrix(i, case):
    fc.run_and_check(case, orders=_orders(i), checked=True)


@pytest.mark.parametrize("i,case", list(enumerate(BIG)), ids=[fc.case_id(c) for c in BIG])
def test_bigger_shapes(i, case):
    fc.run_and_check(case, orders=_orders(i), checked=True)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_every_head_dim_bucket_and_tail(dtype):
    """Every instantiation (tile width) once, with an unaligned tail too."""
    for d in (32, 64, 80, 96, 128, 160, 192, 256, 384, 512, 5, 77, 250, 300, 500):
        case = dict(dtype=dtype, d=d, lq=9, lk=11, masking="none", hq=1, hkv=1, feature="none",
                    layout="bhld", batch=1)
        fc.run_and_check(case, orders=("reverse", "random"), checked=True)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_wide_head_dims_with_features(dtype):
    """Head dims above 256 (up to 512; v's may differ) take every feature the smaller buckets have."""
    cases = [dict(d=512, lq=37, lk=70, masking="causal_br", hq=4, hkv=1, feature="softcap", layout="blhd"),
             dict(d=448, dv=384, lq=20, lk=45, masking="window", hq=2, hkv=2, feature="alibi_bh", layout="bhld"),
             dict(d=192, dv=512, lq=17, lk=33, masking="none", hq=2, hkv=1, feature="bias_bcast", layout="bhld"),
             dict(d=320, lq=9, lk=40, masking="causal_tl", hq=3, hkv=1, feature="sinks", layout="blhd")]
    for i, c in enumerate(cases):
        fc.run_and_check(dict(c, dtype=dtype, batch=2), orders=_orders(i), checked=True)


def test_dv_differs_from_d():
    case = dict(dtype="f16", d=64, dv=40, lq=21, lk=35, masking="causal_br", hq=4, hkv=2, feature="none",
                layout="blhd", batch=2)
    fc.run_and_check(case, orders=("forward", "random"), checked=True)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_fully_masked_rows_zero_and_inf_lse(dtype):
    dt = fc.DTYPES[dtype]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g).to(dt) for n in (19, 23, 23))
    mask = torch.rand(2, 2, 19, 23, generator=g) > 0.4
    mask[0, 1, 5] = False
    mask[1, :, 18] = False
    spec = make_spec(q, k, v, mask=mask, scale=0.25)
    out, lse = fc.run_forward(spec, order="reverse")
    assert torch.equal(out[0, 1, 5], torch.zeros_like(out[0, 1, 5]))
    assert torch.equal(out[1, :, 18], torch.zeros_like(out[1, :, 18]))
    assert lse[0, 1, 5].item() == math.inf and bool((lse[1, :, 18] == math.inf).all())
    assert not out.isnan().any()
    fc.check(spec, out, lse)
    # Causal with the diagonal above the first rows: rows 0..3 see nothing.
    spec = make_spec(q, k, v, scale=0.25, window_right=0, diag_offset=-4)
    out, lse = fc.run_forward(spec, order="random")
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert bool((lse[:, :, :4] == math.inf).all())
    fc.check(spec, out, lse)
    # ... with a sink the denominator is the sink alone: lse = sink, output 0.
    sinks = torch.tensor([0.5, -1.0])
    spec = make_spec(q, k, v, sinks=sinks, scale=0.25, window_right=0, diag_offset=-4)
    out, lse = fc.run_forward(spec, order="forward")
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    torch.testing.assert_close(lse[:, :, :4], sinks[None, :, None].expand(2, 2, 4))
    fc.check(spec, out, lse)


@pytest.mark.parametrize("dtype,amplitude", [("f32", 1e4), ("f16", 6e4), ("bf16", 1e4)])
def test_huge_logits(dtype, amplitude):
    """Scores of about +-1e4 (fp32) / +-6e4 * scale (fp16) must not overflow."""
    dt = fc.DTYPES[dtype]
    g = torch.Generator().manual_seed(5)
    lq, lk, d = 13, 37, 16
    q = (torch.randn(1, 2, lq, d, generator=g).sign() * 1.0).to(dt)
    k = (torch.randn(1, 2, lk, d, generator=g).sign() * (amplitude / d)).to(dt)
    v = torch.randn(1, 2, lk, d, generator=g).to(dt)
    scale = 1.0 if dtype != "f16" else 1.0 / math.sqrt(d)
    for kw in ({}, dict(window_right=0, diag_offset=lk - lq), dict(softcap=30.0)):
        spec = make_spec(q, k, v, scale=scale, **kw)
        out, lse = fc.run_forward(spec, order="reverse")
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        fc.check(spec, out, lse)


def test_layouts_bind_without_copies():
    """(B, L, H, D) and (B, H, L, D) inputs and a broadcast mask are bound as
    the very tensors (same storage and offset), and out keeps q's layout."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 33, 3, 4, 24, generator=g).to(torch.float16)  # packed (B, L, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    mask = (torch.rand(33, 1, generator=g) > 0.2)
    spec = make_spec(q, k, v, mask=mask, scale=0.2, window_right=0)
    out, lse = fc.outputs_for(spec)
    assert out.stride() == q.stride() or out.transpose(1, 2).is_contiguous()
    plan = plan_forward(spec, out, lse)
    assert isinstance(plan, Plan)
    bufs = plan.launches[0].buffers
    for idx, t in ((0, q), (1, k), (2, v), (3, out), (6, spec.mask)):
        assert bufs[idx] is t
    assert bufs[6].stride()[-1] == 0 and bufs[6].stride()[0] == 0  # still a broadcast view
    out2, lse2 = fc.run_forward(spec, order="random")
    fc.check(spec, out2, lse2)
    assert out2.transpose(1, 2).is_contiguous()


def test_band_skips_key_blocks():
    """Blocks outside the band are never loaded: a sliding window reads far
    fewer K/V bytes than the full problem (emulator byte counters)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 1, 256, 32, generator=g) for _ in range(3))
    full = fc.build_stats_for(make_spec(q, k, v, scale=0.2))
    window = fc.build_stats_for(make_spec(q, k, v, scale=0.2, window_left=16, window_right=0))
    kv = lambda st: st["bytes_read"][1] + st["bytes_read"][2]  # noqa: E731 - K and V buffers
    assert kv(window) < 0.35 * kv(full), (kv(window), kv(full))
    assert window["simdgroup_matrix_multiplies"] < 0.35 * full["simdgroup_matrix_multiplies"]


def test_params_layout():
    """sizeof/offsetof of every FlashFwdParams field in the shader equals the ctypes mirror."""
    from torch_metal_flash import emulator

    layout = field_layout(FlashFwdParams)
    names = [n for n, _ in FlashFwdParams._fields_]
    lines = [f"  out[{2 * i}] = (long)__builtin_offsetof(FlashFwdParams, {n});\n"
             f"  out[{2 * i + 1}] = (long)sizeof(((thread FlashFwdParams*)0)->{n});" for i, n in enumerate(names)]
    src = ('#include <metal_stdlib>\n#include "flash_params.h"\nusing namespace metal;\n'
           "kernel void params_layout(device long* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {\n"
           "  if (tid != 0) return;\n" + "\n".join(lines) +
           f"\n  out[{2 * len(names)}] = (long)sizeof(FlashFwdParams);\n}}\n")
    lib = emulator.compile_shader(src, include_dirs=(str(shaders_dir()),))
    out = torch.full((2 * len(names) + 1,), -1, dtype=torch.int64)
    lib.params_layout(buffers={0: out}, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    got = {n: (out[2 * i].item(), out[2 * i + 1].item()) for i, n in enumerate(names)}
    got["__sizeof__"] = (0, out[-1].item())
    assert got == layout


def test_instantiations_match_tile_table():
    """Each tile is instantiated in its shader file (the defaults' or the tuning variants')."""
    declared = {}
    for source in ("flash_fwd.metal", "flash_fwd_variants.metal"):
        src = (shaders_dir() / source).read_text()
        for kind, t, _, bd, bq, bk, ds in re.findall(
                r"^FLASH_FWD_INSTANTIATE(_SHARED|_SPLIT)?\((\w+),\s*(\w+),\s*(\d+),\s*(\d+),\s*(\d+)(?:,\s*(\d+))?\)",
                src, re.M):
            suffix = {"": "", "_SHARED": "_s", "_SPLIT": f"_s_ds{ds}"}[kind]
            declared[f"flash_fwd_{t}_d{bd}_q{bq}_k{bk}{suffix}"] = source
    # the accelerator file instantiates one tile list per dtype
    src = (shaders_dir() / "flash_fwd_nax.metal").read_text()
    rows = re.findall(r"^\s*FLASH_FWD_NAX_INSTANTIATE(_SHARED|_DIRECT)?\(tname, T, (\d+), (\d+), (\d+)\)", src,
                      re.M)
    suffix = {"": "", "_SHARED": "_s", "_DIRECT": "_r"}
    for t in re.findall(r"^FLASH_FWD_NAX_TILES\((\w+), \w+\)", src, re.M):
        for kind, bd, bq, bk in rows:
            declared[f"flash_fwd_nax_{t}_d{bd}_q{bq}_k{bk}{suffix[kind]}"] = "flash_fwd_nax.metal"
    needed = {t.kernel: t.source for t in forward_variants()}
    assert needed == declared


def test_threadgroup_memory_budget():
    """Room for a second threadgroup per core, except the head-dim splits (their partial scores buy
    registers, the scarcer resource at 384 and 512); all within 32 KiB."""
    for t in forward_variants():
        assert t.threadgroup_memory <= (32 if t.ds > 1 else 20) * 1024, (t.kernel, t.threadgroup_memory)


def test_emulator_threadgroup_memory_matches_table():
    """The emulator's count of threadgroup bytes equals the table's figure."""
    for d, dt in ((64, "f16"), (256, "f32"), (96, "bf16"), (512, "f32"), (384, "bf16")):
        case = dict(dtype=dt, d=d, lq=8, lk=8, masking="none", hq=1, hkv=1, feature="none", layout="bhld", batch=1)
        spec = fc.build_spec(case)
        stats = fc.build_stats_for(spec, checked=True)
        tile = fc.tile_for(spec)
        assert stats["threadgroup_memory"] == tile.threadgroup_memory, (stats, tile)


def test_pipeline_info_of_every_variant():
    """The emulator backend's pipeline limits (the Metal launcher's keys): the
    threadgroup memory is the table's figure, the thread limit the default."""
    from torch_metal_flash.backends.emulator import EmulatorBackend

    backend = EmulatorBackend()
    for t in forward_variants():
        with emulator.settings(family=fc.tile_family(t)):
            info = backend.pipeline_info(t.source, t.kernel, {})
        assert info == {"max_total_threads_per_threadgroup": 1024, "thread_execution_width": 32,
                        "static_threadgroup_memory_length": t.threadgroup_memory,
                        "max_threadgroup_memory_length": 32768}, t.kernel


def _spec(dtype=torch.float16, D=64, Dv=None, Hq=4, Hkv=2, **kw):
    q = torch.randn(1, Hq, 5, D, dtype=dtype)
    k = torch.randn(1, Hkv, 7, D, dtype=dtype)
    v = torch.randn(1, Hkv, 7, Dv or D, dtype=dtype)
    return make_spec(q, k, v, scale=0.1, **kw)


@pytest.mark.parametrize("make,reason", [
    (lambda: _spec(D=513), "head dim 513"),
    (lambda: _spec(dtype=torch.float64), "dtype"),
    (lambda: _spec(Hq=3, Hkv=2), "multiple"),
    (lambda: make_spec(torch.randn(1, 2, 5, 8)[..., ::2], torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
                       scale=1.0), "contiguous"),
    (lambda: _spec(mask=torch.ones(5, 7, dtype=torch.int32)), "mask dtype"),
])
def test_planner_unsupported_reasons(make, reason):
    spec = make()
    out = torch.empty(spec.q.shape[:3] + (spec.head_dim_v,), dtype=spec.q.dtype)
    res = plan_forward(spec, out, torch.empty(spec.q.shape[:3]))
    assert isinstance(res, Unsupported) and reason in res.reason, res


def test_plan_shape_and_constants():
    spec = _spec(D=72, window_right=0, softcap=10.0)
    out, lse = fc.outputs_for(spec)
    plan = plan_forward(spec, out, lse)
    (launch,) = plan.launches
    assert launch.source == "flash_fwd.metal"
    assert launch.kernel == "flash_fwd_f16_d80_q32_k32"
    # Lq = 5 rows per head, GQA 4:2: both heads of a group share one threadgroup.
    assert launch.threadgroups == (1, 2, 1) and launch.threadgroup == (128, 1, 1)
    fcs = launch.function_constants
    assert fcs[FC.has_band] is True and fcs[FC.has_softcap] is True and fcs[FC.dims_aligned] is False \
        and fcs[FC.has_mask] is False
    # A window wider than the problem is no band at all.
    plan = plan_forward(_spec(window_left=10 ** 6, window_right=10 ** 6), *fc.outputs_for(_spec()))
    assert plan.launches[0].function_constants[FC.has_band] is False


def _kernel_direct(q, k, v, **kw):
    spec = make_spec(q, k, v, **kw)
    out, lse = fc.run_forward(spec, order="forward")
    return spec, out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sdpa_face_runs_the_kernel_end_to_end(dtype):
    """tmf.scaled_dot_product_attention on CPU tensors with the emulator backend
    (strict: no fallback) returns exactly what the planned kernel returns."""
    import torch_metal_flash as tmf

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, n, 48, generator=g).to(dtype) for n in (19, 27, 27))
    mask = torch.rand(19, 27, generator=g) > 0.3
    with torch.no_grad(), tmf.backend("emulator", strict=True):
        before = tmf.run_counts().get("emulator", 0)
        ours = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        ours_masked = tmf.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert tmf.run_counts().get("emulator", 0) - before == 2
    spec, direct = _kernel_direct(q, k, v, scale=48 ** -0.5, window_right=0)
    assert torch.equal(ours, direct)
    fc.check(spec, ours, fc.run_forward(spec)[1])
    _, direct_masked = _kernel_direct(q, k, v, mask=mask, scale=48 ** -0.5)
    assert torch.equal(ours_masked, direct_masked)


def test_flash_attn_face_runs_the_kernel_end_to_end():
    """flash_attn_func: (B, L, H, D) inputs, bottom-right causal, GQA, window,
    softcap; the output comes back in (B, L, H, D)."""
    import torch_metal_flash as tmf

    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 13, 4, 64, generator=g).half()
    k = torch.randn(2, 29, 2, 64, generator=g).half()
    v = torch.randn(2, 29, 2, 64, generator=g).half()
    with torch.no_grad(), tmf.backend("emulator", strict=True):
        ours = tmf.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=20.0)
    assert ours.shape == q.shape
    spec, direct = _kernel_direct(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=64 ** -0.5,
                                  window_left=8, window_right=0, diag_offset=29 - 13, softcap=20.0)
    assert torch.equal(ours, direct.transpose(1, 2))
    fc.check(spec, direct, fc.run_forward(spec)[1])


def test_gqa_packing_reads_kv_once_per_group():
    """Decode-like GQA (Lq = 1, 8 query heads per KV head): the planner packs
    the group's rows into one threadgroup, so K/V are read once, not 8 times."""
    from torch_metal_flash.planner.forward import gqa_pack

    assert gqa_pack(8, 1, 32) == 8 and gqa_pack(4, 5, 32) == 4
    assert gqa_pack(1, 1, 32) == 1 and gqa_pack(4, 64, 32) == 1 and gqa_pack(2, 40, 32) == 2
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 8, 1, 64, generator=g).half()
    k, v = (torch.randn(1, 1, 100, 64, generator=g).half() for _ in range(2))
    spec = make_spec(q, k, v, scale=0.125)
    st = fc.build_stats_for(spec, checked=True)
    assert st["bytes_read"][1] == k.numel() * 2 and st["bytes_read"][2] == v.numel() * 2
    out, lse = fc.run_forward(spec, order="random")
    fc.check(spec, out, lse)


def test_empty_keys_and_empty_queries():
    """Lk = 0: every row is empty (zeros, lse +inf; with sinks lse = sink).
    Lq = 0 or B = 0: nothing to launch."""
    q = torch.randn(1, 2, 3, 16)
    k = v = torch.randn(1, 2, 0, 16)
    spec = make_spec(q, k, v, scale=0.25)
    out, lse = fc.run_forward(spec)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == math.inf).all())
    sinks = torch.tensor([0.25, -2.0])
    out, lse = fc.run_forward(make_spec(q, k, v, sinks=sinks, scale=0.25))
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sinks[None, :, None].expand(1, 2, 3))
    for q0 in (torch.randn(1, 2, 0, 16), torch.randn(0, 2, 3, 16)):
        kv = torch.randn(q0.shape[0], 2, 5, 16)
        spec = make_spec(q0, kv, kv, scale=0.25)
        plan = plan_forward(spec, *fc.outputs_for(spec))
        assert isinstance(plan, Plan) and plan.launches == ()


def test_gpu_families():
    from torch_metal_flash.planner.tiles import table_family

    assert table_family("apple7") == "apple7" and table_family("Apple10") == "apple10"
    assert table_family("apple11") == "apple10"
    spec = _spec()
    for fam in ("apple7", "apple8", "apple9", "apple10"):
        assert isinstance(plan_forward(spec, *fc.outputs_for(spec), family=fam), Plan)
    for fam in ("apple6", "mac2", "unknown"):
        res = plan_forward(spec, *fc.outputs_for(spec), family=fam)
        assert isinstance(res, Unsupported) and "family" in res.reason


def test_unaligned_kv_views_use_scalar_loads():
    """K/V views that do not start on a 4-element boundary (e.g. slices of a
    wider buffer) take the scalar tile loads, aligned ones the vector loads."""
    g = torch.Generator().manual_seed(14)
    base = torch.randn(1, 2, 40, 72, generator=g).half()
    q = torch.randn(1, 2, 9, 32, generator=g).half()
    k, v = base[..., 1:33], base[..., 35:67]  # offsets 1 and 35 elements
    spec = make_spec(q, k, v, scale=0.2, window_right=0, diag_offset=31)
    plan = plan_forward(spec, *fc.outputs_for(spec))
    fcs = plan.launches[0].function_constants
    assert fcs[FC.dims_aligned] is True and fcs[FC.kv_vec_aligned] is False
    out, lse = fc.run_forward(spec, order="reverse")
    fc.check(spec, out, lse)
    k2, v2 = base[..., 4:36], base[..., 36:68]
    spec = make_spec(q, k2, v2, scale=0.2)
    assert plan_forward(spec, *fc.outputs_for(spec)).launches[0].function_constants[FC.kv_vec_aligned] is True
    out, lse = fc.run_forward(spec, order="random")
    fc.check(spec, out, lse)


def test_float_mask_min_and_inf_rows():
    """A float mask with finfo.min (Hugging Face style) is a finite score: a row
    masked that way everywhere averages all keys, as torch does; a row of -inf
    sees nothing (zeros, lse +inf)."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (7, 11, 11))
    mask = torch.zeros(1, 2, 7, 11)
    mask[..., 8:] = torch.finfo(torch.float32).min  # key padding
    mask[:, :, 3] = torch.finfo(torch.float32).min
    mask[:, :, 5] = float("-inf")
    mask[:, 1, 6, :4] = float("-inf")
    spec = make_spec(q, k, v, mask=mask, scale=0.25)
    out, lse = fc.run_forward(spec, order="random")
    torch.testing.assert_close(out[:, :, 3], v.mean(dim=2), rtol=1e-5, atol=1e-6)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5])) and bool((lse[:, :, 5] == math.inf).all())
    assert bool((lse[:, :, 3] == torch.finfo(torch.float32).min).all())  # min + ln(11) rounds to min
    # Every row against the oracle (which also normalises by the row maximum).
    from torch_metal_flash.testing import check_forward

    check_forward(spec, out, lse)


def test_decode_shapes_route_to_the_decode_planner():
    """planner.plan_forward hands decode-shaped problems to planner.decode when
    it takes them; planner.forward.plan_forward always plans flash_fwd.metal."""
    from torch_metal_flash import planner

    q = torch.randn(1, 8, 1, 64).half()
    k = v = torch.randn(1, 2, 300, 64).half()
    spec = make_spec(q, k, v, scale=0.125)
    out, lse = fc.outputs_for(spec)
    routed = planner.plan_forward(spec, out, lse)
    assert isinstance(routed, Plan) and routed.launches[0].source != "flash_fwd.metal"
    assert plan_forward(spec, out, lse).launches[0].source == "flash_fwd.metal"
    masked = make_spec(q, k, v, mask=torch.ones(300, dtype=torch.bool), scale=0.125)
    assert planner.plan_forward(masked, out, lse).launches[0].source == "flash_decode.metal"  # reads masks too
    small = make_spec(q, k[:, :, :40], v[:, :, :40], scale=0.125)
    assert planner.plan_forward(small, out, lse).launches[0].source == "flash_fwd.metal"
