"""The fused backward kernels (shaders/flash_bwd.metal) in the emulator,
against the float64 oracle (the rule of torch_metal_flash.testing on dq, dk,
dv, dbias, dsinks), from the forward kernel's saved state, through
``plan_backward``, in checked mode
(poisoned threadgroup memory, bounds and race checks) and in two schedule
orders per case; the two runs must agree bit for bit (determinism).

The forward matrix (tests/support/forward_cases.py) is sampled with a fixed
seed, plus GQA ratios 1/2/4/8 and MQA, dlse, fully-masked rows, both layouts.
``bench/sweep_backward.py`` runs the full sweep.  These tests need the
emulator: they fail (not skip) when it or its compiler is missing.
"""
from __future__ import annotations

import re

import pytest
import torch

import torch_metal_flash as tmf
from support.backward_cases import (DTYPES, ORDER_PAIRS, build_case, case_id, check_grads, grad_buffers, plan_for,
                                    run_and_check, run_backward, sample_cases, saved_forward)
from torch_metal_flash import reference
from torch_metal_flash._paths import shaders_dir
from torch_metal_flash.problem.layout import empty_in_layout
from torch_metal_flash.planner.plan import Plan, Unsupported
from torch_metal_flash.problem.spec import make_spec

SEED = 20261129
SAMPLED = sample_cases(30, SEED)
AWKWARD = [
    dict(dtype="f16", d=64, lq=113, lk=127, masking="causal_br", hq=2, hkv=1, feature="none", layout="blhd",
         batch=1),
    dict(dtype="bf16", d=128, lq=129, lk=65, masking="causal_tl", hq=1, hkv=1, feature="bias_bcast",
         layout="bhld", batch=1, dbias=True),
    dict(dtype="f32", d=72, lq=17, lk=203, masking="window", hq=2, hkv=2, feature="sinks", layout="bhld",
         batch=1, dlse=True),
    dict(dtype="f16", d=40, lq=3, lk=257, masking="causal_br", hq=8, hkv=1, feature="alibi_h", layout="blhd",
         batch=1),
    dict(dtype="f32", d=256, lq=33, lk=20, masking="window_sym", hq=2, hkv=1, feature="softcap",
         layout="blhd", batch=1),
    dict(dtype="f16", d=32, lq=255, lk=113, masking="causal_tl", hq=1, hkv=1, feature="bool_keys",
         layout="bhld", batch=1),
    dict(dtype="bf16", d=64, lq=203, lk=255, masking="window", hq=2, hkv=1, feature="sinks", layout="blhd",
         batch=1, dlse=True),
]


def _orders(i: int):
    return ORDER_PAIRS[i % len(ORDER_PAIRS)]


@pytest.mark.parametrize("i,case", list(enumerate(SAMPLED)), ids=[case_id(c) for c in SAMPLED])
def test_sampled_matrix(i, case):
    run_and_check(case, orders=_orders(i))


@pytest.mark.parametrize("i,case", list(enumerate(AWKWARD)), ids=[case_id(c) for c in AWKWARD])
def test_awkward_lengths(i, case):
    run_and_check(case, orders=_orders(i))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_every_head_dim_bucket(dtype):
    """Every tile width (and the dK/dV split above 64) once, with unaligned tails."""
    for d in (32, 64, 80, 96, 128, 160, 192, 256, 384, 512, 5, 72, 300):
        case = dict(dtype=dtype, d=d, lq=9, lk=11, masking="none", hq=2, hkv=1, feature="none",
                    layout="bhld", batch=1)
        run_and_check(case, orders=("reverse",))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_wide_head_dims_with_features(dtype):
    """Head dims above 256: unpadded tiles and unstaged row statistics where float32 at 512 needs them."""
    cases = [dict(d=512, lq=29, lk=41, masking="causal_br", hq=4, hkv=1, feature="softcap", layout="blhd"),
             dict(d=448, dv=384, lq=20, lk=37, masking="window_sym", hq=2, hkv=2, feature="alibi_h", layout="bhld",
                  dlse=True),
             dict(d=192, dv=512, lq=17, lk=19, masking="none", hq=2, hkv=1, feature="sinks", layout="bhld")]
    for i, c in enumerate(cases):
        run_and_check(dict(c, dtype=dtype, batch=1), orders=_orders(i))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1), (8, 1), (8, 2)])
def test_gqa_ratios(hq, hkv):
    case = dict(dtype="f16", d=32, lq=19, lk=37, masking="causal_br", hq=hq, hkv=hkv, feature="none",
                layout="blhd" if hq % 2 else "bhld", batch=2)
    run_and_check(case, orders=("forward", "random"))


def test_dv_differs_from_d():
    case = dict(dtype="f16", d=64, dv=40, lq=21, lk=35, masking="causal_br", hq=4, hkv=2, feature="sinks",
                layout="blhd", batch=2, dlse=True)
    run_and_check(case, orders=("forward", "random"))


@pytest.mark.parametrize("feature", ["bias_full", "bias_bcast", "bias_f32_rows"])
def test_dbias(feature):
    case = dict(dtype="bf16" if feature == "bias_full" else "f32", d=32, lq=23, lk=41, masking="window_sym",
                hq=2, hkv=1, feature=feature, layout="bhld", batch=2, dbias=True)
    run_and_check(case, orders=("reverse", "forward"))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_fully_masked_rows_zero_grads(dtype):
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g).to(dt) for n in (19, 23, 23))
    bias = torch.randn(2, 2, 19, 23, generator=g)
    for kw, empty_rows in ((dict(window_right=0, diag_offset=-4), slice(0, 4)),
                           (dict(window_left=2, window_right=0, diag_offset=-30), slice(0, 19))):
        for mask in (None, bias.to(dt)):
            spec = make_spec(q, k, v, mask=mask, scale=0.25, **kw)
            out, aux = saved_forward(spec)
            assert bool((aux[:, :, empty_rows, 1] == 0).all())  # l = 0: lse = +inf
            dout = torch.randn(out.shape, generator=g).to(dt)
            dlse = torch.randn(aux.shape[:3], generator=g)
            grads, _ = run_backward(spec, dout, out, aux, dlse, compute_dbias=mask is not None,
                                    order="reverse")
            dq, dk, dv, dbias, _ = grads
            for t in (dq, dk, dv):
                assert not t.isnan().any()
            assert torch.equal(dq[:, :, empty_rows], torch.zeros_like(dq[:, :, empty_rows]))
            if mask is not None:
                assert torch.equal(dbias[:, :, empty_rows], torch.zeros_like(dbias[:, :, empty_rows]))
            check_grads(spec, dout, dlse, grads, mask is not None)
    # A bool mask emptying whole rows and one whole key.
    mask = torch.rand(2, 2, 19, 23, generator=g) > 0.4
    mask[0, 1, 5] = False
    mask[:, :, :, 7] = False
    spec = make_spec(q, k, v, mask=mask, scale=0.25)
    out, aux = saved_forward(spec)
    dout = torch.randn(out.shape, generator=g).to(dt)
    grads, _ = run_backward(spec, dout, out, aux, order="random")
    assert torch.equal(grads[0][0, 1, 5], torch.zeros_like(grads[0][0, 1, 5]))
    assert torch.equal(grads[1][:, :, 7], torch.zeros_like(grads[1][:, :, 7]))
    assert torch.equal(grads[2][:, :, 7], torch.zeros_like(grads[2][:, :, 7]))
    check_grads(spec, dout, None, grads, False)


def test_determinism_repeated_runs():
    """Two runs of the same plan, same and different schedule: torch.equal."""
    case = dict(dtype="f16", d=64, lq=70, lk=90, masking="none", hq=4, hkv=1, feature="sinks",
                layout="bhld", batch=1)
    spec, dout, out, aux, dlse = build_case(case)
    a, _ = run_backward(spec, dout, out, aux, order="random")
    b, _ = run_backward(spec, dout, out, aux, order="random")
    c, _ = run_backward(spec, dout, out, aux, order="reverse", checked=True)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_layouts_bind_without_copies():
    """A packed (B, L, 3, H, D) QKV and a broadcast mask are bound as the very
    tensors; the gradients keep the inputs' layout."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 33, 3, 4, 24, generator=g).to(torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    mask = torch.rand(33, 1, generator=g) > 0.2
    spec = make_spec(q, k, v, mask=mask, scale=0.2, window_right=0)
    out, aux = saved_forward(spec)
    dout = empty_in_layout(out).copy_(torch.randn(out.shape, generator=g))
    plan, grads = plan_for(spec, dout, out, aux)
    dq_launch = plan.launches[1]
    for idx, t in ((0, q), (1, k), (2, v), (3, dout), (7, spec.mask), (9, grads[0])):
        assert dq_launch.buffers[idx] is t
    for t, ref in zip(grads[:3], (q, k, v)):
        assert t.transpose(1, 2).is_contiguous() and t.shape == ref.shape
    grads, _ = run_backward(spec, dout, out, aux, order="reverse")
    check_grads(spec, dout, None, grads, False)


def test_band_skips_blocks():
    """Blocks outside the band are not loaded: a sliding window reads far
    fewer bytes than the full problem (emulator byte counters)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 1, 256, 32, generator=g) for _ in range(3))

    def read_bytes(spec):
        out, aux = saved_forward(spec)
        _, stats = run_backward(spec, torch.randn(out.shape, generator=g), out, aux)
        return sum(s.device_bytes_read for s in stats[1:])

    full = read_bytes(make_spec(q, k, v, scale=0.2))
    window = read_bytes(make_spec(q, k, v, scale=0.2, window_left=16, window_right=0))
    assert window < 0.45 * full, (window, full)


def test_threadgroup_memory_under_limit():
    """Up to head dim 256 the tiles leave room for a second threadgroup per core, except the fused
    dK/dV kernels that stage K and V (their registers are the scarcer resource); all fit 32 KiB."""
    from torch_metal_flash.planner.backward_tiles import backward_variants
    for t in backward_variants():
        roomy = t.bd <= 256 and not getattr(t, "stages_kv", False)
        assert t.threadgroup_memory <= (20 if roomy else 32) * 1024, t


def test_emulator_threadgroup_memory_of_the_wide_tiles():
    """The wide tiles' threadgroup bytes as the emulator counts them equal the table's, float32 at 512
    exactly the 32 KiB (unpadded rows; the dK/dV kernel's statistics read from device memory)."""
    from torch_metal_flash.backends.emulator import EmulatorBackend
    from torch_metal_flash.planner.backward_tiles import backward_tiles
    backend = EmulatorBackend()
    for dtype, d in ((torch.float32, 512), (torch.float32, 384), (torch.float16, 512)):
        tiles = backward_tiles(dtype, d)
        for t in (tiles.dq, *tiles.dkv):
            info = backend.pipeline_info(t.source, t.kernel, {})
            assert info["static_threadgroup_memory_length"] == t.threadgroup_memory, (t, info)
    assert backward_tiles(torch.float32, 512).dq.threadgroup_memory == 32768


@pytest.mark.parametrize("case", [
    # a threadgroup whose last simdgroups own no key (40 keys, 32-row blocks), every score feature
    dict(dtype="f16", d=80, lq=29, lk=40, masking="window", hq=6, hkv=3, feature="all", layout="blhd", batch=2),
    dict(dtype="bf16", d=160, lq=33, lk=17, masking="causal_br", hq=4, hkv=1, feature="bias_bcast",
         layout="bhld", batch=1, dbias=True, dlse=True),
    dict(dtype="f32", d=256, lq=17, lk=23, masking="diag_neg", hq=2, hkv=2, feature="sinks", layout="blhd",
         batch=1),
], ids=case_id)
def test_fused_dkv_with_staged_rows(case):
    """The fused dK/dV kernel with its K/V rows in threadgroup memory: partial and empty simdgroups,
    GQA, masks, bias gradients, sinks, float32's unpadded 32 KiB tile."""
    from torch_metal_flash.planner.backward_tiles import backward_tiles
    assert backward_tiles(DTYPES[case["dtype"]], case["d"]).dkv[0].stages_kv
    run_and_check(case, orders=("forward", "reverse"))


def test_fused_dkv_up_to_256():
    """One dK/dV kernel up to head dim 256: K and V in registers to 64, staged in threadgroup memory
    above (the emulator's count equals the table's, float32 at 256 the whole 32 KiB); the split pair
    stays a tuning variant.  Above 256 the fused kernel splits the head dim (tests/kernels/
    test_head_dim_split.py), but for float32 at 512."""
    from torch_metal_flash.backends.emulator import EmulatorBackend
    from torch_metal_flash.planner.backward_tiles import backward_tiles, dkv_variants
    backend = EmulatorBackend()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for d in (64, 80, 128, 256, 384):
            (t, *rest) = backward_tiles(dtype, d).dkv
            assert (t.mode, len(rest), t.ds) == ((0, 0, 1) if d <= 256 else (0, 0, 4)), t
            assert t.stages_kv == (64 < d <= 256), t
            if d in (80, 256):
                info = backend.pipeline_info(t.source, t.kernel, {})
                assert info["static_threadgroup_memory_length"] == t.threadgroup_memory, (t, info)
            if 64 < d <= 256:
                assert any([x.mode for x in pair] == [1, 2] for pair in dkv_variants(dtype, d)), d
    assert backward_tiles(torch.float32, 256).dkv[0].threadgroup_memory == 32768


def test_every_table_entry_is_instantiated():
    """Each tile is instantiated in its shader file (the defaults' or the tuning variants'), and nothing else."""
    from torch_metal_flash.planner.backward_tiles import backward_variants
    declared = {}
    for source in ("flash_bwd.metal", "flash_bwd_variants.metal"):
        src = (shaders_dir() / source).read_text()
        split = r"(?:, (\d+))?\)"  # the head-dim split's DS
        for t, bd, bq, bk, ds in re.findall(r"^FLASH_BWD_DQ_INSTANTIATE(?:_SPLIT)?\((\w+), \w+, (\d+), (\d+), (\d+)"
                                            + split, src, re.M):
            declared[f"flash_bwd_dq_{t}_d{bd}_q{bq}_k{bk}{f'_ds{ds}' if ds else ''}"] = source
        for t, bd, bk, bq, m, ds in re.findall(r"^FLASH_BWD_DKV_INSTANTIATE(?:_SPLIT)?\((\w+), \w+, (\d+), (\d+), "
                                               r"(\d+), (\d)" + split, src, re.M):
            declared[f"flash_bwd_dkv_{t}_d{bd}_k{bk}_q{bq}_m{m}{f'_ds{ds}' if ds else ''}"] = source
    # the accelerator file instantiates one tile list per dtype
    src = (shaders_dir() / "flash_bwd_nax.metal").read_text()
    dq_rows = re.findall(r"^\s*FLASH_BWD_DQ_NAX_INSTANTIATE(_SHARED)?\(tname, T, (\d+), (\d+), (\d+)\)", src, re.M)
    dkv_rows = re.findall(r"^\s*FLASH_BWD_DKV_NAX_INSTANTIATE\(tname, T, (\d+), (\d+), (\d+), (\d)\)", src, re.M)
    for t in re.findall(r"^FLASH_BWD_NAX_TILES\((\w+), \w+\)", src, re.M):
        for shared, bd, bq, bk in dq_rows:
            declared[f"flash_bwd_dq_nax_{t}_d{bd}_q{bq}_k{bk}{'_s' if shared else ''}"] = "flash_bwd_nax.metal"
        for bd, bk, bq, m in dkv_rows:
            declared[f"flash_bwd_dkv_nax_{t}_d{bd}_k{bk}_q{bq}_m{m}"] = "flash_bwd_nax.metal"
    assert {t.kernel: t.source for t in backward_variants()} == declared


def test_params_layout():
    """The ctypes mirror of FlashBwdParams matches the header (sizeof/offsetof
    written by a kernel compiled in the emulator)."""
    import ctypes

    from torch_metal_flash import emulator
    from torch_metal_flash.planner.backward import FlashBwdParams

    names = [n for n, _ in FlashBwdParams._fields_ if n != "f"]
    body = "\n".join(f"  out[{i + 1}] = offsetof(FlashBwdParams, {n});" for i, n in enumerate(names))
    src = ('#include "flash_bwd_params.h"\n#include <metal_stdlib>\nusing namespace metal;\n'
           '#define offsetof(T, m) __builtin_offsetof(T, m)\n'
           "kernel void layout(device long* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {\n"
           "  if (tid != 0) return;\n  out[0] = sizeof(FlashBwdParams);\n" + body + "\n}\n")
    lib = emulator.compile_shader(src, include_dirs=(str(shaders_dir()),))
    out = torch.zeros(len(names) + 1, dtype=torch.int64)
    lib.layout(buffers={0: out}, grid=(1,), threadgroup=(1,))
    assert out[0].item() == ctypes.sizeof(FlashBwdParams)
    for i, n in enumerate(names):
        assert out[i + 1].item() == getattr(FlashBwdParams, n).offset, n


def test_unsupported_reasons():
    from torch_metal_flash.planner.backward import plan_backward
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    spec = make_spec(q, q, q, scale=0.3)
    out, aux = torch.empty_like(q), torch.empty(1, 2, 5, 2, dtype=torch.float64)
    r = plan_backward(spec, q, out, aux, None, q, q, q, None, None)
    assert isinstance(r, Unsupported) and "float64" in str(r)
    q = torch.randn(1, 2, 5, 513)
    spec = make_spec(q, q, q, scale=0.3)
    r = plan_backward(spec, q, q, torch.empty(1, 2, 5, 2), None, q, q, q, None, None)
    assert isinstance(r, Unsupported) and "head dim" in str(r)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float16)
    spec = make_spec(q, q, q, scale=0.3)
    r = plan_backward(spec, q, q, torch.empty(1, 2, 5, 2), None, q, q, q, None, None)
    assert isinstance(r, Unsupported) and "aux must be contiguous float32 (1, 2, 5, 10)" in str(r)


def test_op_backward_uses_kernels_and_opcheck():
    """torch.ops.metal_flash.* autograd runs the kernels in the emulator backend."""
    import torch_metal_flash  # noqa: F401
    from torch_metal_flash import backends

    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 13, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 21, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 21, 16, generator=g, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True)
    bias = torch.randn(1, 1, 13, 21, generator=g, requires_grad=True)
    with backends.backend("emulator", strict=True):
        out, lse, _ = torch.ops.metal_flash.fwd(q, k, v, bias, None, sinks, 0.25, 8, -1, 0, 0.0, True)
        (out.square().sum() + lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v, sinks, bias)]
    for t in (q, k, v, sinks, bias):
        t.grad = None
    out, lse, aux = torch.ops.metal_flash.fwd(q, k, v, bias, None, sinks, 0.25, 8, -1, 0, 0.0, True)  # reference
    (out.square().sum() + lse.sum()).backward()
    for a, t in zip(grads, (q, k, v, sinks, bias)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)
    with backends.backend("emulator", strict=True):
        dout = torch.randn(out.shape, generator=g)
        args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), aux, None, bias.detach(),
                None, sinks.detach(), 0.25, 8, -1, 0, 0.0, True)
        torch.library.opcheck(torch.ops.metal_flash.bwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))
        # opcheck of the forward with requires_grad=True: its autograd and AOT
        # checks run the backward op -- on the kernels (strict: no fallback).
        qs, ks, vs = (torch.randn(*s, generator=g, requires_grad=True)
                      for s in ((1, 2, 5, 8), (1, 1, 7, 8), (1, 1, 7, 8)))
        sk = torch.randn(2, generator=g, requires_grad=True)
        for return_aux in (True, False):  # False: the backward recomputes aux
            torch.library.opcheck(torch.ops.metal_flash.fwd.default,
                                  (qs, ks, vs, None, None, sk, 0.3, 2, 3, 0, 4.0, return_aux))


def test_expanded_dout_and_dlse():
    """Autograd hands over expanded gradients (e.g. of ``out.sum()``): the
    planner binds dO and dlse as given and declines strided ones; the autograd
    formula makes them contiguous, so such calls run on the kernels."""
    from torch_metal_flash.planner.backward import plan_backward
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (11, 14, 14))
    spec = make_spec(q, k, v, scale=0.3, window_right=0, diag_offset=3)
    out, aux = saved_forward(spec)
    dout = torch.full((1,), 0.5).expand(out.shape)
    dlse = torch.full((1,), -0.25).expand(aux.shape[:3])
    for d_out, d_lse, name in ((dout, dlse.contiguous(), "dout"), (dout.contiguous(), dlse, "dlse")):
        declined = plan_backward(spec, d_out, out, aux, d_lse, *grad_buffers(spec, False))
        assert isinstance(declined, Unsupported) and name in declined.reason
    grads, _ = run_backward(spec, dout.contiguous(), out, aux, dlse.contiguous(), order="reverse")
    check_grads(spec, dout.contiguous(), dlse.contiguous(), grads, False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with tmf.backend("emulator", strict=True):  # strict: every call runs on the kernels
        o, l, a = torch.ops.metal_flash.fwd(*leaves, None, None, None, 0.3, 3, -1, 0, 0.0, True)
        (0.5 * o.sum() - 0.25 * l.sum()).backward()
        direct = torch.ops.metal_flash.bwd(dout.contiguous(), *leaves, o, a, dlse.contiguous(), None, None, None,
                                           0.3, 3, -1, 0, 0.0, False)
    for leaf, want in zip(leaves, direct[:3]):
        assert torch.equal(leaf.grad, want)


def test_gpu_families():
    """Newer Apple families use the newest table; families without simdgroup
    matrices are Unsupported with a reason (not a crash)."""
    from torch_metal_flash.planner.backward import plan_backward
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    spec = make_spec(q, k, v, scale=0.25)
    out, aux = saved_forward(spec)
    for family in ("apple7", "apple8", "apple9", "apple10", "apple11"):
        plan = plan_backward(spec, out, out, aux, None, *grad_buffers(spec, False), family=family)
        assert isinstance(plan, Plan), (family, plan)
    for family in ("apple6", "mac2", "nonsense"):
        plan = plan_backward(spec, out, out, aux, None, *grad_buffers(spec, False), family=family)
        assert isinstance(plan, Unsupported) and "GPU family" in str(plan), (family, plan)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_everything_at_once(dtype):
    """softcap + ALiBi + float bias (with dbias) + sinks + window + dlse + GQA in one call."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(19)
    q = torch.randn(2, 4, 31, 24, generator=g).to(dt)
    k, v = (torch.randn(2, 2, 45, 24, generator=g).to(dt) for _ in range(2))
    bias = torch.randn(1, 4, 31, 45, generator=g).to(dt)
    spec = make_spec(q, k, v, mask=bias, alibi_slopes=torch.rand(4, generator=g) * 0.2,
                     sinks=torch.randn(4, generator=g), scale=0.3, softcap=3.0, diag_offset=14,
                     window_left=9, window_right=2)
    out, aux = saved_forward(spec)
    dout = torch.randn(out.shape, generator=g).to(dt)
    dlse = torch.randn(aux.shape[:3], generator=g)
    a, _ = run_backward(spec, dout, out, aux, dlse, compute_dbias=True, order="random")
    check_grads(spec, dout, dlse, a, True)
    b, _ = run_backward(spec, dout, out, aux, dlse, compute_dbias=True, order="reverse")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_rows_of_finfo_min_scores_pass_no_gradient():
    """Hugging Face float masks: finfo.min on padded keys, and on every key of
    a padding row.  The padding row is constant in q and k (q.k vanishes next
    to 3.4e38): finite gradients, none through that row, the same rule as the
    reference; the other rows exact."""
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g) for n in (7, 11, 11))
    mask = torch.zeros(2, 1, 7, 11)
    mask[..., 8:] = torch.finfo(torch.float32).min  # key padding
    mask[0, :, 3] = torch.finfo(torch.float32).min  # a padding query row
    spec = make_spec(q, k, v, mask=mask, scale=0.25)
    out, aux = saved_forward(spec)
    dout = torch.randn(out.shape, generator=g)
    grads, _ = run_backward(spec, dout, out, aux, order="random")
    for t in grads[:3]:
        assert torch.isfinite(t).all()
    assert torch.equal(grads[0][0, :, 3], torch.zeros_like(grads[0][0, :, 3]))
    ref = reference.backward(spec, dout, out, aux)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    # The loss ignores padding rows (dO = 0 there): then every gradient is the exact one.
    dout[0, :, 3] = 0
    grads, _ = run_backward(spec, dout, out, aux, order="reverse")
    check_grads(spec, dout, None, grads, False)
