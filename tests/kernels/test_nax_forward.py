"""The neural-accelerator forward (shaders/flash_fwd_nax.metal, family apple10) in the emulator:

* the sampled case matrix (every masking, feature, GQA ratio, layout, odd head dims) planned as an
  M5, against the float64 oracle in checked mode, two schedule orders, bit-identical;
* every accelerator variant forced through ``tmf.tuning.use`` on the public API (the kernel is the
  one recorded), varlen, paged K/V, dropout with the host generator's mask;
* what stays on the simdgroup kernels: float32, buckets 80 / 384 / 512, the debug probs output,
  every other family.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash import emulator, tuning
from torch_metal_flash.planner import tiles
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import check_backward, check_forward, generator_keep_mask, randn
from support import forward_cases as fc

NAX = "apple10"
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}

CASES = [c for c in fc.sample_cases(64, seed=10, head_dims=(32, 64, 96, 128, 40, 100, 13, 256))
         if c["dtype"] != "f32"][:24]


@pytest.mark.parametrize("case", CASES, ids=fc.case_id)
def test_sampled_matrix_on_the_accelerators(case):
    spec = fc.build_spec(case, seed=zlib.crc32(fc.case_id(case).encode()))
    assert fc.tile_for(spec, NAX).nax, "half/bfloat at these head dims plan the accelerator kernel on apple10"
    fc.run_and_check(case, family=NAX)


def _qkv(dtype, B=2, Lq=37, Lk=53, Hq=4, Hkv=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (randn(B, L, H, D, generator=g).to(dtype) for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))


def _check_face(q, k, v, out, lse, causal, window=(-1, -1)):
    wl, wr = window
    if causal:
        wr = 0
    spec = make_spec(*(t.transpose(1, 2) for t in (q, k, v)), scale=q.shape[-1] ** -0.5,
                     diag_offset=k.shape[1] - q.shape[1], window_left=wl, window_right=wr)
    check_forward(spec, out.transpose(1, 2), lse)


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 256])
def test_every_variant_forced(dtype, head_dim):
    q, k, v = _qkv(dtype, D=head_dim, Lq=45, Lk=70)
    names = [n for n in tuning.variants("fwd", dtype=dtype, head_dim=head_dim, family=NAX) if "_nax_" in n]
    assert len(names) >= 2 and names[0] == tuning.variants("fwd", dtype=dtype, head_dim=head_dim, family=NAX)[0]
    for name in names:
        with emulator.settings(family=NAX, checked=True), tmf.backend("emulator", strict=True), \
                tuning.use("fwd", name), emulator.recording() as launches:
            out, lse = tmf.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
        assert [s.kernel for s in launches] == [name]
        assert launches[0].tensor_matmuls > 0
        _check_face(q, k, v, out, lse, causal=True)


def test_varlen_and_paged_on_the_accelerators():
    dtype = torch.float16
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 40, 17], [9, 64, 30]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(lens_q), 4, 64, generator=g).to(dtype)
    k = randn(sum(lens_k), 2, 64, generator=g).to(dtype)
    v = randn(sum(lens_k), 2, 64, generator=g).to(dtype)
    with emulator.settings(family=NAX), tmf.backend("emulator", strict=True), emulator.recording() as launches:
        out, lse = tmf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                              return_attn_probs=True)[:2]
    assert [s.kernel for s in launches] == ["flash_fwd_nax_f16_d64_q64_k32"]
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        _check_face(q[None, qs], k[None, ks], v[None, ks], out[None, qs], lse[None, :, qs], causal=True)

    # paged: the same sequences through a shuffled block table of 16-key pages
    page, nblocks = 16, 12
    kc = torch.zeros(nblocks, page, 2, 64, dtype=dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(nblocks, generator=g)
    table = torch.zeros(3, 4, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens_k):
        for j in range(-(-n // page)):
            blk = int(perm[used])
            used += 1
            table[b, j] = blk
            rows = slice(int(cu_k[b]) + j * page, min(int(cu_k[b]) + (j + 1) * page, int(cu_k[b + 1])))
            kc[blk, :rows.stop - rows.start] = k[rows]
            vc[blk, :rows.stop - rows.start] = v[rows]
    # through the threadgroup tiles and, forced, straight from device memory: the same bits
    for kernel in ("flash_fwd_nax_f16_d64_q64_k32", "flash_fwd_nax_f16_d64_q64_k32_r"):
        with emulator.settings(family=NAX), tmf.backend("emulator", strict=True), tuning.use("fwd", kernel), \
                emulator.recording() as launches:
            paged = tmf.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                               block_table=table)
        assert [s.kernel for s in launches] == [kernel]
        assert torch.equal(paged, out)


def test_dropout_on_the_accelerators_uses_the_generators_mask():
    dtype = torch.bfloat16
    q, k, v = _qkv(dtype, B=1, Lq=33, Lk=40, Hq=2, Hkv=1, D=96, seed=5)
    spec = make_spec(*(t.transpose(1, 2) for t in (q, k, v)), scale=96 ** -0.5, dropout_p=0.25,
                     rng_state=torch.tensor([1234, 7], dtype=torch.int64))
    with emulator.settings(family=NAX, checked=True), tmf.backend("emulator", strict=True), \
            emulator.recording() as launches:
        out, lse, _ = torch.ops.metal_flash.fwd(spec.q, spec.k, spec.v, None, None, None, spec.scale,
                                                spec.diag_offset, spec.window_left, spec.window_right, 0.0,
                                                False, 0.25, spec.dropout.rng_state)
    assert launches[0].kernel.startswith("flash_fwd_nax_bf16_d96")
    check_forward(spec, out, lse, generator_keep_mask(spec))


def test_what_stays_on_the_simdgroup_kernels():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bd in tiles.HEAD_DIM_BUCKETS:
            first = tiles.forward_tile(dtype, bd, NAX)
            assert first.nax == (dtype != torch.float32 and bd not in (80, 384, 512)), first
            for family in ("apple7", "apple8", "apple9"):
                assert not any(t.nax for t in tiles.tile_variants(dtype, bd, family))
    # the debug probs output (its own launch after the forward's): the simdgroup kernel writes it
    q, k, v = _qkv(torch.float16, B=1, Lq=9, Lk=12, Hq=2, Hkv=2, D=64)
    with emulator.settings(family=NAX), tmf.backend("emulator", strict=True), emulator.recording() as launches:
        tmf.flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True)
    assert [s.kernel for s in launches] == ["flash_fwd_nax_f16_d64_q64_k32", "flash_fwd_f16_d64_q64_k32"]


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_training_on_an_m5(dtype):
    """Autograd through the op planned as apple10: the accelerator forward's row state feeds the
    backward, whose gradients meet the float64 oracle's budget (two orders, bit-identical)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (randn(2, H, L, 64, generator=g).to(dtype) for H, L in ((4, 41), (2, 57), (2, 57)))
    mask = randn(1, 4, 41, 57, generator=g).to(dtype)
    dout = randn(2, 4, 41, 64, generator=g).to(dtype)
    spec = make_spec(q, k, v, mask=mask, scale=0.125, diag_offset=16, window_right=0, softcap=20.0)
    results = []
    for order in ("forward", "reverse"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with emulator.settings(family=NAX, order=order, checked=True), tmf.backend("emulator", strict=True), \
                emulator.recording() as launches:
            out, lse, _ = torch.ops.metal_flash.fwd(*leaves, mask, None, None, 0.125, 16, -1, 0, 20.0, True)
            out.backward(dout)
        assert launches[0].kernel.startswith("flash_fwd_nax_")
        check_forward(spec, out.detach(), lse.detach())
        grads = (*(t.grad for t in leaves), None, None)
        check_backward(spec, dout, None, grads)
        results.append(grads[:3])
    assert all(torch.equal(a, b) for a, b in zip(*results)), "gradients depend on the schedule order"
