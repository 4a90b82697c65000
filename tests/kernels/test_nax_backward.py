"""The neural-accelerator backward (shaders/flash_bwd_nax.metal, family apple10) in the emulator:

* a sampled backward case matrix (masks, dbias, band/causal/windows, ALiBi, softcap, sinks, dlse, GQA,
  layouts, odd head dims) whose forward and backward are planned as an M5, against the float64
  oracle in checked mode, two schedule orders bit-identical;
* every accelerator dQ and dK/dV variant forced through ``tmf.tuning.use`` on the public API
  (flash_attn_func + .backward(); the kernel is among the recorded launches), an accelerator dQ
  with a simdgroup dK/dV kernel, dropout with the host generator's mask, varlen, dbias;
* what stays on the simdgroup kernels: float32, the bucket 80, dK/dV above 128, dQ above 256,
  every other family.
"""
from __future__ import annotations

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import emulator, tuning
from torch_metal_flash.planner import backward_tiles as bt
from torch_metal_flash.planner import tiles
from torch_metal_flash.problem.spec import make_spec
from support import backward_cases as bk
from torch_metal_flash.testing import check_backward, generator_keep_mask, randn

NAX = "apple10"
SEED = 20261203
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}
# Head dims laid over the sampled cases: every accelerator bucket and unaligned tails.
_DIMS = (1, 256, 128, 13, 96, 64, 32, 200, 160, 100, 192, 64, 256, 40)
CASES = [dict(c, d=d) for c, d in zip(
    (c for c in bk.sample_cases(80, SEED) if c["dtype"] != "f32" and "dv" not in c), _DIMS)]


def _tiles(case):
    return bt.backward_tiles(bk.DTYPES[case["dtype"]], case["d"], NAX)


@pytest.mark.parametrize("i,case", list(enumerate(CASES)), ids=[bk.case_id(c) for c in CASES])
def test_sampled_matrix_on_the_accelerators(i, case):
    t = _tiles(case)
    assert t.dq.nax and all(x.nax for x in t.dkv) == (t.dq.bd <= 128), t
    bk.run_and_check(case, orders=bk.ORDER_PAIRS[i % len(bk.ORDER_PAIRS)], family=NAX)


def _qkv(dtype, B=2, Lq=45, Lk=70, Hq=4, Hkv=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [randn(B, L, H, D, generator=g).to(dtype).requires_grad_() for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv))]


def _backward_on_the_kernels(q, k, v, dout, forced=(), **kw):
    """flash_attn_func and its backward as an M5 plans them (strict: nothing falls back), with the
    ``forced`` bwd variants; returns the gradients and the recorded launches."""
    for t in (q, k, v):
        t.grad = None
    with emulator.settings(family=NAX, checked=True), tmf.backend("emulator", strict=True), \
            emulator.recording() as launches:
        with _using(forced):
            out = tmf.flash_attn_func(q, k, v, **kw)
            out.backward(dout)
    return (q.grad, k.grad, v.grad), list(launches)


class _using:
    def __init__(self, names):
        self.ctx = [tuning.use("bwd", n) for n in names]

    def __enter__(self):
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


def _check(q, k, v, dout, grads, causal=False, window=(-1, -1)):
    wl, wr = window
    if causal:
        wr = 0
    spec = make_spec(*(t.detach().transpose(1, 2) for t in (q, k, v)), scale=q.shape[-1] ** -0.5,
                     diag_offset=k.shape[1] - q.shape[1], window_left=wl, window_right=wr)
    check_backward(spec, dout.transpose(1, 2), None, tuple(g.transpose(1, 2) for g in grads) + (None, None))


@pytest.mark.parametrize("dtype,head_dim", [("f16", 64), ("bf16", 128), ("bf16", 32), ("f16", 96),
                                            ("f16", 256), ("bf16", 160)])
def test_every_accelerator_variant_forced(dtype, head_dim):
    dt = HALF[dtype]
    q, k, v = _qkv(dt, D=head_dim, seed=head_dim)
    dout = randn(*q.shape, generator=torch.Generator().manual_seed(1)).to(dt)
    names = [n for n in tuning.variants("bwd", dtype=dt, head_dim=head_dim, family=NAX) if "_nax_" in n]
    assert names[0] == tuning.variants("bwd", dtype=dt, head_dim=head_dim, family=NAX)[0]
    assert any(n.startswith("flash_bwd_dkv_nax") for n in names) == (head_dim <= 128)
    for name in names:
        grads, launches = _backward_on_the_kernels(q, k, v, dout, forced=[name], causal=True)
        ran = {s.kernel: s for s in launches}
        assert name in ran and ran[name].tensor_matmuls > 0, (name, list(ran))
        if name.endswith("_m1"):  # its dV kernel follows it
            assert name[:-1] + "2" in ran
        _check(q, k, v, dout, grads, causal=True)


def test_accelerator_dq_with_a_simdgroup_dkv_kernel():
    dt = torch.float16
    q, k, v = _qkv(dt, D=128, Lq=40, Lk=33, seed=4)
    dout = randn(*q.shape, generator=torch.Generator().manual_seed(2)).to(dt)
    simd_dkv = next(n for n in tuning.variants("bwd", dtype=dt, head_dim=128, family=NAX)
                    if n.startswith("flash_bwd_dkv_f16"))
    grads, launches = _backward_on_the_kernels(q, k, v, dout, forced=[simd_dkv], window_size=(7, 3))
    kernels = [s.kernel for s in launches]
    assert "flash_bwd_dq_nax_f16_d128_q64_k32" in kernels and simd_dkv in kernels
    _check(q, k, v, dout, grads, window=(7, 3))


def test_dropout_on_the_accelerators_uses_the_generators_mask():
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    q, k, v = (randn(1, 2, n, 64, generator=g).to(dt) for n in (33, 40, 40))
    spec = make_spec(q, k, v, scale=0.125, dropout_p=0.25, rng_state=torch.tensor([1234, 7], dtype=torch.int64),
                     window_right=0, diag_offset=7)
    dout = randn(1, 2, 33, 64, generator=g).to(dt)
    args = (spec.q, spec.k, spec.v, None, None, None, spec.scale, spec.diag_offset, spec.window_left,
            spec.window_right, 0.0, True, 0.25, spec.dropout.rng_state)
    runs = []
    for order in ("forward", "reverse"):
        with emulator.settings(family=NAX, checked=True, order=order), tmf.backend("emulator", strict=True), \
                emulator.recording() as launches:
            out, lse, aux = torch.ops.metal_flash.fwd(*args)
            grads = torch.ops.metal_flash.bwd(dout, spec.q, spec.k, spec.v, out, aux, None, *args[3:11], False,
                                              *args[12:])
        kernels = [s.kernel for s in launches]
        assert "flash_bwd_dq_nax_bf16_d64_q64_k32" in kernels and "flash_bwd_dkv_nax_bf16_d64_k64_q32_m0" in kernels
        runs.append(grads)
    check_backward(spec, dout, None, runs[0], False, keep=generator_keep_mask(spec))
    for a, b in zip(*runs):
        assert a is None and b is None or torch.equal(a, b), "the backward is not bitwise reproducible"


def test_varlen_on_the_accelerators():
    dt = torch.float16
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 40, 17], [9, 64, 30]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(lens_q), 4, 64, generator=g).to(dt).requires_grad_()
    k = randn(sum(lens_k), 2, 64, generator=g).to(dt).requires_grad_()
    v = randn(sum(lens_k), 2, 64, generator=g).to(dt).requires_grad_()
    dout = randn(sum(lens_q), 4, 64, generator=g).to(dt)
    with emulator.settings(family=NAX, checked=True), tmf.backend("emulator", strict=True), \
            emulator.recording() as launches:
        out = tmf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        out.backward(dout)
    kernels = [s.kernel for s in launches]
    assert "flash_bwd_dq_nax_f16_d64_q64_k32" in kernels and "flash_bwd_dkv_nax_f16_d64_k64_q32_m0" in kernels
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        sub = [t.detach()[None, s] for t, s in ((q, qs), (k, ks), (v, ks))]
        grads = [q.grad[None, qs], k.grad[None, ks], v.grad[None, ks]]
        _check(*sub, dout[None, qs], grads, causal=True)


@pytest.mark.parametrize("case", [
    dict(dtype="f16", d=64, lq=37, lk=70, masking="window_sym", hq=4, hkv=2, feature="bias_full", layout="bhld",
         batch=2, dbias=True, dlse=True),
    dict(dtype="bf16", d=128, lq=29, lk=65, masking="causal_br", hq=2, hkv=1, feature="bias_bcast",
         layout="blhd", batch=1, dbias=True),
    dict(dtype="f16", d=256, lq=33, lk=41, masking="none", hq=2, hkv=2, feature="bias_f32_rows", layout="bhld",
         batch=1, dbias=True),
], ids=bk.case_id)
def test_dbias_on_the_accelerators(case):
    assert _tiles(case).dq.nax
    bk.run_and_check(case, orders=("reverse", "random"), family=NAX)


def test_what_stays_on_the_simdgroup_kernels():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bd in tiles.HEAD_DIM_BUCKETS:
            t = bt.backward_tiles(dtype, bd, NAX)
            half = dtype != torch.float32
            assert t.dq.nax == (half and bd not in (80, 384, 512)), t
            assert all(x.nax == (half and bd in (32, 64, 96, 128)) for x in t.dkv), t
            # the accelerator kernels fuse while K and V fit registers; above 256 the simdgroup kernels
            # split the head dim (float32 at 512: the dK / dV pair)
            fused_up_to = 64 if t.dkv[0].nax else 256
            fused = bd <= fused_up_to or (bd > 256 and not (dtype == torch.float32 and bd == 512))
            assert [x.mode for x in t.dkv] == ([0] if fused else [1, 2])
            assert all(x.ds == (4 if bd > 256 and fused else 1) for x in t.dkv), t
            # the simdgroup tiles stay variants
            assert any(not x.nax for x in bt.dq_variants(dtype, bd, NAX))
            assert any(not p[0].nax for p in bt.dkv_variants(dtype, bd, NAX))
            for family in ("apple7", "apple8", "apple9"):
                assert not any("_nax_" in n for n in tuning.variants("bwd", dtype=dtype, head_dim=bd, family=family))
    # the threadgroup memory the emulator counts is the table's
    from torch_metal_flash.backends.emulator import EmulatorBackend
    backend = EmulatorBackend()
    for t in bt.backward_variants():
        if t.nax:
            with emulator.settings(family=NAX):
                info = backend.pipeline_info(t.source, t.kernel, {})
            assert info["static_threadgroup_memory_length"] == t.threadgroup_memory <= 18 * 1024, t


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dkv_kernel_sees_the_forwards_scores_bit_for_bit(head_dim):
    """One visible key per row (the diagonal) and scores near 1e4: P = exp(s - m) / l is 1 exactly only
    if the dK/dV kernel's score s (K Q^T) is the NAX forward's row max m (Q K^T) to the bit (one ulp
    of 1e4 would take P 1e-3 below 1); then dV = P dO is dO itself."""
    dt = torch.float16
    g = torch.Generator().manual_seed(head_dim)
    q, k, v = (randn(1, 2, 48, head_dim, generator=g).mul(24).to(dt) for _ in range(3))
    dout = randn(1, 2, 48, head_dim, generator=g).to(dt)
    spec = make_spec(q, k, v, scale=0.37, window_left=0, window_right=0)
    out, aux = bk.saved_forward(spec, NAX)
    assert aux[..., 0].abs().max() > 2000  # the row max m: large scores
    plan, grads = bk.plan_for(spec, dout, out, aux, family=NAX)
    assert all(launch.kernel.startswith("flash_bwd_dkv_nax") for launch in plan.launches[2:])
    bk.run_plan(plan, order="reverse", family=NAX)
    assert torch.equal(grads[2], dout)
