"""The head-dim-split kernels of the wide buckets (384, 512): DS simdgroups share 8 rows, each
holding a slice of the head dim, their partial scores (and dP) summed in slice order through
threadgroup memory (``flash::slice_sum``, shaders/flash_frag.h).

In the emulator, checked mode (poisoned threadgroup memory, bounds, races, divergent barriers),
two schedule orders:

* the forward's output, lse and probabilities equal the undivided kernel's bit for bit, dropout and
  varlen included: every kernel of the bucket sums the same slice chains, so the split changes
  where the scores are added, not their value;
* the backward (split dQ and fused dK/dV) is within the float64 oracle's budget with partial and
  empty row groups, GQA, every score feature, dbias, dlse, dropout, packed sequences and paged
  K/V, and bitwise reproducible (FlexAttention at head dim 384: tests/flex);
* the planner's defaults, threads and threadgroup bytes agree with the kernels.
"""
from __future__ import annotations

import pytest
import torch

import torch_metal_flash as tmf
from support.backward_cases import DTYPES, case_id, run_and_check
from support import varlen_cases as vc
from torch_metal_flash import emulator, ops, tuning
from torch_metal_flash.backends.emulator import EmulatorBackend
from torch_metal_flash.planner import backward_tiles, tiles
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing import check_backward, check_forward, generator_keep_mask

ORDERS = ("forward", "reverse")


def _undivided(split: tiles.ForwardTile) -> str:
    return tiles.ForwardTile(split.dtype, split.bd, split.bq, split.bk, split.shared_kv).kernel


def _forward(spec, variant, order, launched):
    launched.clear()
    named = dict(q=spec.q, k=spec.k, v=spec.v, attn_mask=spec.mask, alibi_slopes=spec.alibi_slopes,
                 sinks=spec.sinks, scale=spec.scale, diag_offset=spec.diag_offset, window_left=spec.window_left,
                 window_right=spec.window_right, softcap=spec.softcap)
    drop = dict(dropout_p=spec.dropout.p, rng_state=spec.dropout.rng_state) if spec.dropout else {}
    with tuning.use("fwd", variant), tmf.backend("emulator", strict=True), \
            emulator.settings(order=order, checked=True):
        out, lse, aux = ops.fwd_call(**named, return_aux=True, **drop)
        probs = ops.fwd_probs_call(**named, **drop)
    assert variant in launched, (variant, launched)
    return out, lse, aux, probs


def _spec(dtype, D, Lq, Lk, Hq, Hkv, seed, dropout_p=0.0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, Lq, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, Lk, D, generator=g).to(dtype) for _ in range(2))
    rng = torch.tensor([seed, 5], dtype=torch.int64) if dropout_p else None
    return make_spec(q, k, v, scale=D ** -0.5, dropout_p=dropout_p, rng_state=rng, **kw)


@pytest.mark.parametrize("dtype,D", [(torch.float16, 384), (torch.bfloat16, 448), (torch.float32, 512)], ids=str)
def test_split_forward_equals_the_undivided_kernel_bit_for_bit(dtype, D, launched):
    slopes = torch.linspace(0.05, 0.4, 4)
    spec = _spec(dtype, D, 37, 45, 4, 2, seed=D, dropout_p=0.2, alibi_slopes=slopes, softcap=20.0,
                 diag_offset=8, window_right=0, window_left=30)
    split = tiles.forward_tile(dtype, D)
    assert split.ds == tiles.score_slices(split.bd) and split.kernel.endswith("_ds4"), split
    results = {}
    for variant in (split.kernel, _undivided(split)):
        for order in ORDERS:
            results[variant, order] = _forward(spec, variant, order, launched)
    first = results[split.kernel, "forward"]
    for key, got in results.items():
        for name, a, b in zip(("out", "lse", "aux", "probs"), first, got):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (key, name)
    keep = ~torch.signbit(first[3])
    check_forward(spec, first[0], first[1], keep)
    assert torch.equal(keep[first[3] != 0], generator_keep_mask(spec)[first[3] != 0])


SPLIT_CASES = [
    # 9 rows and 11 keys of 32-row blocks: partial and empty row groups on both sides
    dict(dtype="f16", d=384, lq=9, lk=11, masking="causal_br", hq=6, hkv=3, feature="all", layout="blhd", batch=2,
         dbias=True, dlse=True),
    # q/k narrower than v: slices past head_dim read zeros; unaligned tails in two slices
    dict(dtype="bf16", d=300, dv=500, lq=41, lk=35, masking="window", hq=2, hkv=1, feature="bias_bcast",
         layout="bhld", batch=1, dbias=True),
    dict(dtype="f32", d=384, lq=19, lk=50, masking="causal_tl", hq=4, hkv=1, feature="sinks", layout="blhd",
         batch=1, dlse=True),
    dict(dtype="f16", d=512, lq=33, lk=17, masking="none", hq=2, hkv=2, feature="alibi_bh", layout="bhld", batch=1),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=case_id)
def test_split_backward_against_the_oracle(case):
    """The default plan's split dQ and fused dK/dV kernels (run_and_check: checked mode, both orders agree)."""
    dtype, D = DTYPES[case["dtype"]], max(case["d"], case.get("dv", 0))
    t = backward_tiles.backward_tiles(dtype, D)
    assert t.dq.ds == 4 and [x.mode for x in t.dkv] == [0] and t.dkv[0].ds == 4, t
    run_and_check(case, orders=ORDERS)


def test_split_backward_with_dropout(launched):
    """Dropout's regenerated mask through the split dQ and dK/dV kernels, against the oracle with the
    mask the forward drew."""
    spec = _spec(torch.float16, 512, 21, 26, 2, 1, seed=3, dropout_p=0.3, window_right=0)
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(spec.q.shape, generator=g).half()
    grads = {}
    for order in ORDERS:
        out, lse, aux, probs = _forward(spec, tiles.forward_tile(torch.float16, 512).kernel, order, launched)
        with tmf.backend("emulator", strict=True), emulator.settings(order=order, checked=True):
            grads[order] = ops.bwd_call(dout=dout, q=spec.q, k=spec.k, v=spec.v, out=out, aux=aux, dlse=None,
                                        attn_mask=None, alibi_slopes=None, sinks=None, scale=spec.scale,
                                        diag_offset=spec.diag_offset, window_left=spec.window_left,
                                        window_right=spec.window_right, softcap=spec.softcap, compute_dbias=False,
                                        dropout_p=spec.dropout.p, rng_state=spec.dropout.rng_state)
        assert {"flash_bwd_dq_f16_d512_q32_k8_ds4", "flash_bwd_dkv_f16_d512_k32_q8_m0_ds4"} <= set(launched)
    keep = ~torch.signbit(probs)
    check_backward(spec, dout, None, grads["forward"], False, keep=keep)
    assert all(torch.equal(a, b) for a, b in zip(*grads.values())), "the backward is not bitwise reproducible"


VARLEN_CASES = [
    # paged K/V (pages of 16, shuffled), dropout, softcap, a causal band
    dict(dtype="f16", h=4, hkv=2, d=384, lens_q=[13, 40, 5], lens_k=[13, 52, 9], window=(-1, 0), softcap=30.0,
         page=16, dropout=0.2),
    # keys used per sequence, sinks, per-sequence ALiBi, MQA, v wider than q/k
    dict(dtype="bf16", h=3, hkv=1, d=320, dv=512, lens_q=[33, 7], lens_k=[29, 40], seqused=[20, 40], sinks=True,
         alibi="bh"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=vc.case_id)
def test_split_kernels_with_varlen(case, launched):
    """Packed sequences through the split forward and backward (threadgroups past a sequence's rows
    return early, all simdgroups alike), sequence by sequence against the oracle, both orders alike."""
    x = vc.build(case)
    first = vc.run(x)
    assert sum(n.endswith("_ds4") for n in set(launched)) == 3, launched  # forward, dQ, dK/dV
    vc.check(x, first)
    again = vc.run(x, order="reverse")
    for a, b in zip((first["out"], first["lse"], *first["grads"]), (again["out"], again["lse"], *again["grads"])):
        assert torch.equal(a, b), "the schedule order changed a bit"


def test_split_tiles_threads_and_bytes():
    """Defaults at 384/512 (float32 at 512 keeps the undivided backward: its streamed tiles alone fill
    32 KiB); 4 simdgroups per 8 rows; the emulator's threadgroup bytes equal the table's."""
    backend = EmulatorBackend()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for D in (384, 512):
            fwd = tiles.forward_tile(dtype, D)
            bwd = backward_tiles.backward_tiles(dtype, D)
            split_bwd = not (dtype == torch.float32 and D == 512)
            assert (fwd.ds, bwd.dq.ds, bwd.dkv[0].ds) == (4, 4 if split_bwd else 1, 4 if split_bwd else 1)
            assert fwd.threads == 32 * 4 * fwd.bq // 8 and bwd.dq.threads == 32 * bwd.dq.ds * bwd.dq.bq // 8
            for t in (fwd, bwd.dq, *bwd.dkv):
                info = backend.pipeline_info(t.source, t.kernel, {})
                assert info["static_threadgroup_memory_length"] == t.threadgroup_memory <= 32768, (t, info)
            # the undivided kernels stay in the tuning space
            assert _undivided(fwd) in tuning.variants("fwd", dtype=dtype, head_dim=D)
            names = tuning.variants("bwd", dtype=dtype, head_dim=D)
            assert any("_ds" not in n and "_dq_" in n for n in names), names
            assert any("_ds" not in n and "_m1" in n for n in names), names
