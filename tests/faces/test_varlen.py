"""Varlen attention (packed sequences, ``cu_seqlens``) on the kernels.

One launch per kernel covers every sequence; the kernels read the boundaries on the
GPU.  Each case runs forward and backward through the ops in the emulator, in checked
mode and two schedule orders (bit-identical results), and every sequence is checked
against its own float64 oracle call with the rule of ``torch_metal_flash.testing``
(tests/support/varlen_cases.py).  Then the faces (flash-attn's varlen functions and their
packed variants, differentiable, against per-sequence calls), no host synchronisation
on the varlen path, ``torch.compile(fullgraph=True)`` of a packed training step, and
transformers' packed-sequence path.
"""
from __future__ import annotations


import pytest
import torch

from support import varlen_cases as vc
import torch_metal_flash as tmf
from torch_metal_flash import backends, emulator
from support.host_syncs import host_syncs_raise
from torch_metal_flash.testing import randn

RAGGED_Q, RAGGED_K = [5, 0, 1, 37, 20, 1], [7, 3, 0, 37, 41, 1]
MANY_SHORT = [1, 3, 2, 6, 1, 4, 5, 2, 1, 3, 6, 2, 1, 1, 4, 3, 2, 5] + [131]  # and one long one

CASES = [
    dict(dtype="f32", h=4, hkv=2, d=32, lens_q=RAGGED_Q, lens_k=RAGGED_K, window=(-1, 0), alibi="bh"),
    dict(dtype="f16", h=4, hkv=1, d=64, lens_q=RAGGED_Q, lens_k=RAGGED_K, window=(3, 1), softcap=4.0),
    dict(dtype="bf16", h=2, hkv=2, d=40, dv=24, lens_q=RAGGED_K, lens_k=RAGGED_Q, alibi="h"),
    dict(dtype="f16", h=2, hkv=1, d=32, lens_q=MANY_SHORT, lens_k=MANY_SHORT, window=(-1, 0)),
    dict(dtype="f32", h=2, hkv=1, d=16, lens_q=RAGGED_Q, lens_k=RAGGED_K, window=(-1, 0),
         seqused=[6, 2, 0, 30, 41, 0]),
    dict(dtype="f16", h=4, hkv=2, d=32, lens_q=RAGGED_Q, lens_k=RAGGED_K, window=(-1, 0), page=5, sinks=True),
    dict(dtype="bf16", h=4, hkv=2, d=64, lens_q=RAGGED_Q, lens_k=RAGGED_K, page=16, seqused=[7, 1, 0, 20, 41, 1]),
    dict(dtype="f32", h=4, hkv=2, d=32, lens_q=RAGGED_Q, lens_k=RAGGED_K, window=(4, 0), alibi="bh", dropout=0.3),
    dict(dtype="f16", h=2, hkv=1, d=32, lens_q=MANY_SHORT, lens_k=MANY_SHORT, window=(-1, 0), dropout=0.2,
         softcap=5.0),
]


@pytest.mark.parametrize("case", CASES, ids=vc.case_id)
def test_kernels_against_per_sequence_oracle(case):
    x = vc.build(case)
    backends.run_counts(reset=True)
    first = vc.run(x, order="forward")
    assert "reference" not in backends.run_counts()
    vc.check(x, first)
    vc.same_bits(first, vc.run(x, order="reverse"))


def test_reference_path_agrees_with_the_kernels():
    """The fallback (sequence by sequence on the host) computes what the kernels compute."""
    x = vc.build(CASES[7])
    kernels, ref = vc.run(x, checked=False), vc.run(x, backend="reference")
    assert torch.equal(torch.signbit(kernels["probs"]), torch.signbit(ref["probs"]))
    vc.check(x, ref)


def _pack(seqs):
    return torch.cat(seqs), torch.tensor([0] + torch.tensor([s.shape[0] for s in seqs]).cumsum(0).tolist(),
                                         dtype=torch.int32)


def test_faces_match_per_sequence_calls_and_differentiate():
    """flash_attn_varlen_func (and its kv/qkv-packed forms) equal flash_attn_func called per
    sequence, forward and backward, and run as one kernel call."""
    g = torch.Generator().manual_seed(15)
    lens = [3, 1, 17, 0, 9]
    seqs = [torch.randn(n, 3, 4, 16, generator=g) for n in lens]
    qkv, cu = _pack(seqs)
    qkv.requires_grad_(True)
    kw = dict(causal=True, window_size=(5, 0), softcap=3.0, alibi_slopes=torch.rand(len(lens), 4, generator=g))
    dout = torch.randn(qkv.shape[0], 4, 16, generator=g)
    with tmf.backend("emulator", strict=True):
        backends.run_counts(reset=True)
        out, lse, none = tmf.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), return_attn_probs=True, **kw)
        assert backends.run_counts() == {"emulator": 1} and none is None
        (got,) = torch.autograd.grad(out, qkv, dout)
        packed_kv = tmf.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, max(lens), max(lens), **kw)
        torch.testing.assert_close(packed_kv, out, rtol=0, atol=0)
        for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if e == a:
                continue
            one = qkv[a:e].detach().requires_grad_(True)
            ref, ref_lse, _ = tmf.flash_attn_qkvpacked_func(one[None], causal=True, window_size=(5, 0), softcap=3.0,
                                                            alibi_slopes=kw["alibi_slopes"][b:b + 1],
                                                            return_attn_probs=True)
            (ref_grad,) = torch.autograd.grad(ref, one, dout[None, a:e])
            torch.testing.assert_close(out[a:e], ref[0], atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(lse[:, a:e], ref_lse[0], atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(got[a:e], ref_grad, atol=1e-5, rtol=1e-5)


def test_paged_face_equals_the_packed_call_bit_for_bit():
    """flash_attn_varlen_func with paged caches (GQA, shuffled blocks, unused table entries and
    blocks; dropout, ALiBi) computes, forward and backward, exactly what it computes with the
    same keys packed: out and dq bit for bit, dK/dV of each cache row the gradient of the
    packed row it holds, zero where no sequence reads; torch.compile(fullgraph=True) of the
    paged call too."""
    x = vc.build(CASES[5])
    c = x["c"]
    dout = x["dout"][0].transpose(0, 1)

    def grads(k, v, table, compiled=False):
        q, k, v = (t.clone().requires_grad_(True) for t in (x["q"], k, v))

        def attend(q, k, v):
            return tmf.flash_attn_varlen_func(q, k, v, x["cu_q"], x["cu_k"], max(c["lens_q"]), max(c["lens_k"]),
                                              causal=True, dropout_p=0.25, alibi_slopes=torch.full((4,), 0.2),
                                              block_table=table)
        torch.manual_seed(7)  # the dropout mask's (seed, offset)
        out = (torch.compile(attend, fullgraph=True, backend="aot_eager") if compiled else attend)(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    with tmf.backend("emulator", strict=True), emulator.settings(checked=False):
        torch._dynamo.reset()
        results = [grads(x["k_cache"], x["v_cache"], x["table"]), grads(x["k"], x["v"], None),
                   grads(x["k_cache"], x["v_cache"], x["table"], compiled=True)]
        torch._dynamo.reset()
    (out, dq, dk, dv), (want_out, want_dq, want_dk, want_dv), compiled = results
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(results[0], compiled))
    assert dk.shape == x["k_cache"].shape and dv.shape == x["v_cache"].shape
    for got, want in ((out, want_out), (dq, want_dq), (vc.packed_from_cache(x, dk), want_dk.transpose(0, 1)[None]),
                      (vc.packed_from_cache(x, dv), want_dv.transpose(0, 1)[None])):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert want_dk.abs().sum() > 0
    read = torch.zeros(x["k_cache"].shape[:2], dtype=torch.bool)
    for b, lk in enumerate(c["lens_k"]):
        pos = torch.arange(lk)
        read[x["table"][b, pos // c["page"]].long(), pos % c["page"]] = True
    assert (~read).any() and not dk[~read].any() and not dv[~read].any()


def test_paged_backward_of_a_direct_op_call_without_aux():
    """metal_flash.fwd with paged K/V called with return_aux=False: its backward recomputes the
    row state on the gathered keys and gives the gradients of the return_aux=True call."""
    x = vc.build(CASES[6])
    args = vc.fwd_args(x)
    runs = []
    with tmf.backend("emulator", strict=True), emulator.settings(checked=False):
        for return_aux in (True, False):
            q, k, v = (args[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
            out, _, _ = torch.ops.metal_flash.fwd(**{**args, "q": q, "k": k, "v": v, "return_aux": return_aux})
            runs.append((out, *torch.autograd.grad(out, (q, k, v), x["dout"])))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*runs))


def _shared_prefix_case(page: int, dtype=torch.float32):
    """Four sequences over one block pool: A, B and C start with the same block, A and B share
    the next one too, D has no keys; the rest is each sequence's own, the pool has two unused
    blocks and the table's unused entries name the shared block.  Returns the tensors and the
    packed equivalent (each sequence's keys copied out of the pool)."""
    g = torch.Generator().manual_seed(page)
    r = (page + 1) // 2  # keys in the last, partly used block
    lens_k = [3 * page + r, 2 * page + r, page + r, 0]
    lens_q = [5, 1, 4, 3]
    rows = [[0, 1, 2, 3], [0, 1, 4, 0], [0, 5, 0, 0], [0, 0, 0, 0]]
    num_blocks = 8  # blocks 6 and 7 unused
    hkv, d = 2, 16
    k_cache, v_cache = (randn(num_blocks, page, hkv, d, generator=g).to(dtype) for _ in range(2))
    table = torch.tensor(rows, dtype=torch.int32)
    x = dict(c=dict(page=page, lens_k=lens_k), table=table)
    k, v = (vc.packed_from_cache(x, t)[0].transpose(0, 1) for t in (k_cache, v_cache))
    q = randn(sum(lens_q), 4, d, generator=g).to(dtype)
    dout = randn(sum(lens_q), 4, d, generator=g).to(dtype)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return dict(x=x, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, dout=dout, cu_q=cu(lens_q), cu_k=cu(lens_k),
                max_q=max(lens_q), max_k=max(lens_k))


def _varlen_grads(s, paged: bool, **kw):
    q = s["q"].clone().requires_grad_(True)
    k, v = (s[n].clone().requires_grad_(True) for n in (("k_cache", "v_cache") if paged else ("k", "v")))
    out = tmf.flash_attn_varlen_func(q, k, v, s["cu_q"], s["cu_k"], s["max_q"], s["max_k"], causal=True,
                                     block_table=s["x"]["table"] if paged else None, softcap=3.0, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), s["dout"]))


@pytest.mark.parametrize("page", [1, 6, 16])
def test_paged_shared_blocks_sum_deterministically(page):
    """Blocks shared by several sequences get the sum of their gradients, unused blocks and
    rows zeros; the sums are bit-identical over runs and schedule orders, read nothing on the
    host, and agree with the packed call: bit for bit where one or two sequences read a
    block (a + b is exact in either order), within the rounding of a three-term float32 sum
    where three do."""
    s = _shared_prefix_case(page)
    with tmf.backend("emulator", strict=True):
        with emulator.settings(checked=True, order="forward"):
            paged = _varlen_grads(s, True)
        with emulator.settings(checked=False, order="reverse"), host_syncs_raise():
            again = _varlen_grads(s, True)
        with emulator.settings(checked=False):
            packed = _varlen_grads(s, False)
    for a, b in zip(paged, again):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    lens = s["x"]["c"]["lens_k"]
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    for got, want in ((paged[2], packed[2]), (paged[3], packed[3])):
        # the packed gradient of every (block, row) a sequence reads, in sequence order
        terms: dict = {}
        for b, lk in enumerate(lens):
            for j in range(lk):
                terms.setdefault((int(s["x"]["table"][b, j // page]), j % page), []).append(want[starts[b] + j])
        assert max(len(t) for t in terms.values()) == 3
        for n in range(got.shape[0]):
            for r in range(page):
                t = terms.get((n, r))
                if t is None:
                    assert not got[n, r].any(), f"block {n} row {r}: read by no sequence, gradient not zero"
                elif len(t) <= 2:
                    assert torch.equal(got[n, r], sum(t[1:], t[0])), f"block {n} row {r}"
                else:
                    exact = torch.stack(t).double().sum(0)
                    bound = 2 * 2.0 ** -24 * torch.stack(t).double().abs().sum(0)
                    assert ((got[n, r].double() - exact).abs() <= bound).all(), f"block {n} row {r}"


def test_quantized_and_mixed_precision_kv_are_converted():
    """Quantized or fp16 K/V under fp32 q (inference caches) run the varlen kernels on K/V
    converted to q's dtype: the same result as passing the converted K/V (the padded quantized
    op, which knows no sequence boundaries, would attend across sequences)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(23, 2, 64, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 4, 23], dtype=torch.int32)
    qk, qv = tmf.quantize(k, bits=8, group_size=32), tmf.quantize(v, bits=8, group_size=32)
    with tmf.backend("emulator", strict=True), emulator.settings(checked=False):
        for kk, vv, want_k, want_v in ((qk, qv, qk.dequantize(), qv.dequantize()),
                                       (k.half(), v.half(), k.half().float(), v.half().float())):
            got = tmf.flash_attn_varlen_func(q, kk, vv, cu, cu, 19, 19, causal=True)
            want = tmf.flash_attn_varlen_func(q, want_k, want_v, cu, cu, 19, 19, causal=True)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cu_q,cu_k", [([0, 0, 0], [0, 0, 0]), ([0], [0]), ([0, 0], [0, 5]), ([0, 3], [0, 0])],
                         ids=["all-empty", "no-sequences", "no-queries", "no-keys"])
def test_degenerate_batches(cu_q, cu_k):
    """No sequences, only empty ones, keys without queries, queries without keys: forward and
    backward (dropout on, the gradient of a sum: a stride-0 dout) on the kernels; rows with no
    key give zeros and lse = +inf, keys with no query zero gradients."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(cu_q[-1], 2, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(cu_k[-1], 1, 16, generator=g, requires_grad=True) for _ in range(2))
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    with tmf.backend("emulator", strict=True), emulator.settings(checked=True):
        backends.run_counts(reset=True)
        out, lse, _ = tmf.flash_attn_varlen_func(q, k, v, cq, ck, max(cu_q[-1], 1), max(cu_k[-1], 1), dropout_p=0.3,
                                                 causal=True, return_attn_probs=True)
        out.sum().backward()
        assert "reference" not in backends.run_counts()
    assert out.shape == q.shape and lse.shape == (2, cu_q[-1])
    assert not out.any() and (lse == float("inf")).all()
    assert not q.grad.any() and not k.grad.any() and not v.grad.any()


def test_no_host_synchronisation():
    """The varlen path never reads device values on the host: item/tolist/bool/host copies raise."""
    x = vc.build(CASES[7])
    c = x["c"]
    q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    with emulator.settings(checked=False), tmf.backend("emulator", strict=True), host_syncs_raise():
        backends.run_counts(reset=True)
        out = tmf.flash_attn_varlen_func(q, k, v, x["cu_q"], x["cu_k"], max(c["lens_q"]), max(c["lens_k"]),
                                         dropout_p=0.25, causal=True, alibi_slopes=x["alibi"],
                                         seqused_k=x["cu_k"][1:] - x["cu_k"][:-1])
        out.backward(torch.ones_like(out))
        assert backends.run_counts() == {"emulator": 2}  # one forward and one backward call


def test_bad_arguments_are_named():
    """Shapes, dtypes and devices of the index tensors (and dropout_p, rng_state) are checked on
    every call without reading their values; with TORCH_METAL_FLASH_DEBUG=1 the values too
    (test_flash_face.test_varlen_errors covers cu_seqlens / seqused_k values)."""
    q, k = torch.randn(5, 2, 8), torch.randn(6, 2, 8)
    cache = torch.randn(3, 4, 2, 8)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    bad = [
        (ValueError, "cu_seqlens_q: expected device cpu, got meta", (q, k, k, cu_q.to("meta"), cu_k, 5, 6), {}),
        (ValueError, r"cu_seqlens_q: expected a 1-D tensor, got shape \(1, 2\)", (q, k, k, cu_q[None], cu_k, 5, 6),
         {}),
        (ValueError, "seqused_k: expected length \\(the batch size\\) 1, got 2", (q, k, k, cu_q, cu_k, 5, 6),
         dict(seqused_k=torch.tensor([1, 2], dtype=torch.int32))),
        (TypeError, "block_table: expected dtype int32, got torch.float32", (q, cache, cache, cu_q, cu_k, 5, 6),
         dict(block_table=table.float())),
        (ValueError, r"block_table: expected a 2-D tensor", (q, cache, cache, cu_q, cu_k, 5, 6),
         dict(block_table=table[0])),
        (ValueError, r"block_table: expected rows \(the batch size\) 1, got 2", (q, cache, cache, cu_q, cu_k, 5, 6),
         dict(block_table=table.expand(2, 2))),
        (ValueError, r"k: expected a 4-D tensor", (q, k, k, cu_q, cu_k, 5, 6), dict(block_table=table)),
        (ValueError, r"dropout_p: expected a float in \[0, 1\], got 1.5", (q, k, k, cu_q, cu_k, 5, 6),
         dict(dropout_p=1.5)),
    ]
    for error, message, args, kwargs in bad:
        with pytest.raises(error, match=message):
            tmf.flash_attn_varlen_func(*args, **kwargs)
    fwd = torch.ops.metal_flash.fwd
    base = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], k.transpose(0, 1)[None], None, None, None, 1.0, 0, -1,
            -1, 0.0, False)
    with pytest.raises(ValueError, match="rng_state: required when dropout_p > 0"):
        fwd(*base, 0.2, None)
    with pytest.raises(ValueError, match="rng_state: expected an int64 \\(seed, offset\\) pair on cpu"):
        fwd(*base, 0.2, torch.zeros(2))
    with pytest.raises(ValueError, match="seqused_k: only with cu_seqlens_q / cu_seqlens_k"):
        fwd(*base, 0.0, None, None, None, cu_q)
    with pytest.raises(ValueError, match="cu_seqlens_q, cu_seqlens_k: pass both"):
        fwd(*base, 0.0, None, cu_q)


def test_block_table_values_checked_in_debug_mode(monkeypatch):
    q, cache = torch.randn(5, 2, 8), torch.randn(3, 4, 2, 8)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    monkeypatch.setenv("TORCH_METAL_FLASH_DEBUG", "1")
    with tmf.backend("emulator", strict=True), emulator.settings(checked=False):
        for table in ([[0, 7]], [[0]], [[-1, 2]]):
            with pytest.raises(ValueError, match=r"block_table: row 0 must name 2 blocks in \[0, 3\) for its 6 keys"):
                tmf.flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 5, 6,
                                           block_table=torch.tensor(table, dtype=torch.int32))


def test_out_of_range_index_values_stay_inside_the_tensors():
    """Without debug mode the kernels never read index values on the host: nonsense ones
    (negative, past the tensors, longer than max_seqlen, decreasing at the end; seqused_k
    past its sequence; block numbers outside the pool) are clamped to the tensors, so the
    checked emulator (every access bounds-checked) sees none outside them, forward and
    backward.  (Sequences that overlap after clamping would race on their shared rows:
    garbage in, garbage out, but never outside the tensors.)"""
    x = vc.build(CASES[5])
    assert x["q"].shape[0] == 64 and x["k"].shape[0] == 89
    q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    cu_q = torch.tensor([-7, 4, 30, 30, 63, 10 ** 6, 5], dtype=torch.int32)
    cu_k = torch.tensor([-3, 50, 60, 60, 189, 2 ** 31 - 1, 0], dtype=torch.int32)
    used = torch.tensor([99, -1, 3, 2 ** 30, 0, 5], dtype=torch.int32)
    table = x["table"].clone()
    table[0, 0], table[1, -1] = 10 ** 6, -3
    with tmf.backend("emulator", strict=True), emulator.settings(checked=True):
        out = tmf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 41, causal=True, seqused_k=used, dropout_p=0.2)
        out.backward(torch.ones_like(out))
        paged = tmf.flash_attn_varlen_func(q.detach(), x["k_cache"], x["v_cache"], cu_q, cu_k, 37, 41,
                                           block_table=table, seqused_k=used)
    for t in (out, q.grad, paged):  # every query row belongs to a (clamped) sequence
        assert torch.isfinite(t).all()


class _Packed(torch.nn.Module):
    """A tiny packed-sequence block: projections, varlen attention, output projection."""

    def __init__(self, e=32, h=4, hkv=2):
        super().__init__()
        self.h, self.hkv, self.d = h, hkv, e // h
        self.qkv = torch.nn.Linear(e, (h + 2 * hkv) * self.d)
        self.o = torch.nn.Linear(e, e)

    def forward(self, x, cu, max_len):
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        out = tmf.flash_attn_varlen_func(q.unflatten(-1, (self.h, self.d)), k.unflatten(-1, (self.hkv, self.d)),
                                         v.unflatten(-1, (self.hkv, self.d)), cu, cu, max_len, max_len, causal=True,
                                         dropout_p=0.1)
        return self.o(out.flatten(-2))


def test_compiled_packed_training_step_runs_on_the_kernels():
    """torch.compile(fullgraph=True) of a packed training step: one graph, the metal_flash ops in it
    (the rng draw too), the kernels run; it equals eager under the same seed."""
    from test_compile_dropins import Recorder
    torch.manual_seed(0)
    model = _Packed()
    x = torch.randn(41, 32)
    cu = torch.tensor([0, 5, 6, 30, 41], dtype=torch.int32)

    def loss(m):
        return m(x, cu, 24).square().mean()

    torch._dynamo.reset()
    rec = Recorder()
    compiled = torch.compile(loss, fullgraph=True, backend=rec.backend())
    with emulator.settings(checked=False), tmf.backend("emulator", strict=True):
        torch.manual_seed(1)
        want = loss(model)
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.manual_seed(1)
        backends.run_counts(reset=True)
        got = compiled(model)
        got.backward()
    assert backends.run_counts().get("emulator", 0) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p, w in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)
    assert len(rec.graphs["fw"]) == 1 and "metal_flash.fwd.default" in rec.ops("fw"), rec.ops("fw")
    assert "metal_flash.bwd.default" in rec.ops("bw")
    torch._dynamo.reset()


def test_transformers_packed_sequences_take_the_varlen_kernels():
    """transformers' padding-free path: position_ids restarting per sequence (and the flash-attention
    kwargs cu_seq_lens_*/max_length_*) run one varlen call per layer, equal to running each sequence
    alone; with the kwargs there is no host synchronisation."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from torch_metal_flash.faces import functional
    from torch_metal_flash.integrations import transformers as tmf_hf
    cfg = transformers.MistralConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                     max_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.MistralForCausalLM(cfg).eval()
    tmf_hf.set_attention(model)
    lens = [5, 9, 1, 7]
    ids = torch.randint(1, 61, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    calls = []
    real = functional._attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("varlen"))
        return real(*args, **kwargs)

    with torch.no_grad(), tmf.backend("emulator", strict=True), emulator.settings(checked=False):
        alone = torch.cat([model(input_ids=ids[:, a:e]).logits for a, e in zip(cu[:-1], cu[1:])], 1)
        functional._attention, calls[:] = spy, []
        try:
            by_positions = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            assert len(calls) == 2 and all(c is not None for c in calls)
            by_kwargs = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                              max_length_q=max(lens), max_length_k=max(lens), use_cache=False).logits
            assert len(calls) == 4 and all(c is not None for c in calls)
            # with a cache (generation) transformers does not pack: the mask path
            model(input_ids=ids, position_ids=pos)
            assert len(calls) == 6 and calls[-1] is None
        finally:
            functional._attention = real
    torch.testing.assert_close(by_positions, alone, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(by_kwargs, alone, atol=2e-5, rtol=2e-5)
    # The attention function with the kwargs reads nothing on the host (transformers' own
    # packed detection from position_ids does, outside it).
    q, k, v = torch.randn(1, 4, sum(lens), 8), torch.randn(1, 2, sum(lens), 8), torch.randn(1, 2, sum(lens), 8)
    module = torch.nn.Module()
    module.is_causal = True
    with tmf.backend("emulator", strict=True), emulator.settings(checked=False), host_syncs_raise():
        out, _ = tmf_hf.metal_sdpa_attention_forward(module, q, k, v, None, dropout=0.1, cu_seq_lens_q=cu,
                                                     cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    assert out.shape == (1, sum(lens), 4, 8)
